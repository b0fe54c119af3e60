//! Non-finite values stop training, in every mode.
//!
//! A loss or a gradient that is NaN or infinite (a learning rate too large, bad data) makes
//! every later step worthless and, once applied, the parameters too. Each mode checks the
//! loss and the gradients of every step before applying them, and stops with one line
//! naming the step and the tensor; the step is not applied and no checkpoint is written
//! after it, so the newest checkpoint is the last good one. In the synchronous modes every
//! rank reaches the same verdict at the same step, so all stop together: allreduce and
//! pipelines check the reduced values, the synchronous ps counts what each worker's push
//! says it found ([`NonFinite::seen`] adds the count). The asynchronous two-sided ps
//! refuses training from the first push that says so on, naming its worker.

use serde::{Deserialize, Serialize};

use crate::tensor::Tensor;

/// A non-finite value found in training.
/// Values are kept as printed (`NaN`, `inf`, `-inf`), so errors compare equal; `whose`
/// says where it was seen (` on 2 of 4 replicas`), or is empty. It travels in the ps
/// protocol (a worker's push says what it found; the ps tasks' verdict counts them).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum NonFinite {
    #[error("the loss is {value} at step {step}{whose}: training stopped before applying it (no checkpoint follows it: lower --lr and resume from the newest)")]
    Loss {
        step: u64,
        value: String,
        #[serde(default)]
        whose: String,
    },
    #[error("gradient '{tensor}' holds {value} at step {step}{whose}: training stopped before applying it (no checkpoint follows it: lower --lr and resume from the newest)")]
    Gradient {
        step: u64,
        tensor: String,
        value: String,
        #[serde(default)]
        whose: String,
    },
    /// Gradients a rank computed and applies itself held a non-finite value: the ranks
    /// agree on the count ([`crate::train::engine::StepWord`]), not on the tensor.
    #[error("a gradient holds a non-finite value at step {step}{whose}: training stopped before applying it (no checkpoint follows it: lower --lr and resume from the newest)")]
    Gradients {
        step: u64,
        #[serde(default)]
        whose: String,
    },
}

impl NonFinite {
    /// Where it was seen (` on 2 of 4 replicas`), or empty.
    fn whose(&mut self) -> &mut String {
        match self {
            NonFinite::Loss { whose, .. }
            | NonFinite::Gradient { whose, .. }
            | NonFinite::Gradients { whose, .. } => whose,
        }
    }

    /// The same finding, said to be seen `whose` (` on 2 of 3 workers`).
    pub fn seen(mut self, on: String) -> NonFinite {
        *self.whose() = on;
        self
    }
}

/// True if every value is finite: `v - v` is 0 for a finite `v` and NaN otherwise, so a
/// sum answers for the whole slice. Summed in 16 independent lanes: one running sum would
/// be a chain of dependent additions (the compiler may not reorder float sums), several
/// times slower than the step's own arithmetic on small models.
pub fn all_finite(xs: &[f32]) -> bool {
    #[allow(clippy::eq_op)] // v - v is the point: 0 for finite v, NaN for NaN and inf
    let zero_if_finite = |v: f32| v - v;
    const LANES: usize = 16;
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .fold(0.0f32, |acc, &v| acc + zero_if_finite(v));
    let lanes = chunks.fold([0.0f32; LANES], |mut acc, c| {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += zero_if_finite(v);
        }
        acc
    });
    lanes.iter().sum::<f32>() + tail == 0.0
}

/// The loss of step `step` must be finite; `whose` says where it was seen (e.g.
/// ` on 1 of 4 replicas`, or empty).
pub fn check_loss(step: u64, value: f32, whose: impl Into<String>) -> Result<(), NonFinite> {
    if value.is_finite() {
        return Ok(());
    }
    Err(NonFinite::Loss {
        step,
        value: value.to_string(),
        whose: whose.into(),
    })
}

/// One replica's step: its own loss, then its gradients (the modes that check what this
/// rank computed; allreduce checks the agreed loss and the reduced gradients instead).
pub fn check_step(step: u64, loss: f32, grads: &[Tensor]) -> Result<(), NonFinite> {
    check_loss(step, loss, "")?;
    check_gradients(step, grads)
}

/// Every gradient of step `step` must be finite; the first that is not is named.
pub fn check_gradients(step: u64, grads: &[Tensor]) -> Result<(), NonFinite> {
    for g in grads {
        let Ok(values) = g.as_slice::<f32>() else {
            continue;
        };
        if all_finite(values) {
            continue;
        }
        let value = values
            .iter()
            .copied()
            .find(|v| !v.is_finite())
            .unwrap_or(f32::NAN);
        return Err(NonFinite::Gradient {
            step,
            tensor: g.name().to_string(),
            value: value.to_string(),
            whose: String::new(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finite_slices_pass_and_the_first_bad_tensor_is_named() {
        assert!(all_finite(&[0.0, -1e30, 3.5, f32::MAX, f32::MIN_POSITIVE]));
        assert!(all_finite(&[]));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            // In a lane and in the tail; +inf and -inf in different lanes too.
            for at in [0, 777, 995, 999] {
                let mut v = vec![1.0f32; 1000];
                v[at] = bad;
                assert!(!all_finite(&v), "{bad} at {at}");
            }
        }
        let mut v = vec![f32::MAX; 1000];
        (v[5], v[6]) = (f32::INFINITY, f32::NEG_INFINITY);
        assert!(!all_finite(&v));
        let ok = Tensor::from_slice(&[2], &[1f32, 2.])
            .unwrap()
            .named("dense0/w");
        let bad = Tensor::from_slice(&[3], &[1f32, f32::INFINITY, f32::NAN])
            .unwrap()
            .named("dense1/b");
        assert_eq!(check_gradients(7, std::slice::from_ref(&ok)), Ok(()));
        assert_eq!(
            check_gradients(7, &[ok, bad]).unwrap_err().to_string(),
            "gradient 'dense1/b' holds inf at step 7: training stopped before applying it \
             (no checkpoint follows it: lower --lr and resume from the newest)"
        );
        assert_eq!(
            check_loss(3, f32::NAN, " on 1 of 2 replicas")
                .unwrap_err()
                .to_string(),
            "the loss is NaN at step 3 on 1 of 2 replicas: training stopped before applying \
             it (no checkpoint follows it: lower --lr and resume from the newest)"
        );
        assert_eq!(check_loss(3, 0.5, ""), Ok(()));
    }
}
