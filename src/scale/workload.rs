//! A worker's step without communication, measured on this machine: what the scale model
//! adds communication to.

use std::time::Instant;

use super::cost::Update;
use crate::model::{Model, ModelError, Replica};
use crate::train::optim::Optimizer;

/// A model's step on one worker's batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Workload {
    /// The parameters' (and the gradients') bytes.
    pub param_bytes: f64,
    /// Forward and backward of one worker's batch, seconds.
    pub compute: f64,
    /// Summing gradients and applying the optimizer, per byte.
    pub update: Update,
}

impl Workload {
    /// The optimizer's update of all the parameters, seconds.
    pub fn apply(&self) -> f64 {
        self.param_bytes * self.update.apply_per_byte
    }

    /// Measures `model` on the batch `x`, `y` (its rows: one worker's batch): the median
    /// of `reps` timed gradient computations after two untimed ones, of `reps` updates by
    /// `optimizer`, and of `reps` sums of one gradient into another.
    pub fn measure(
        model: &dyn Model,
        x: &[f32],
        y: &[u8],
        optimizer: &Optimizer,
        reps: usize,
    ) -> Result<Workload, ModelError> {
        let reps = reps.max(1);
        let mut replica = Replica::new(model, 1);
        let mut grads = replica.zeros_like();
        for _ in 0..2 {
            replica.gradients_into(x, y, &mut grads)?;
        }
        let compute = median_of(reps, || {
            replica.gradients_into(x, y, &mut grads).map(|_| ())
        })?;
        let mut states: Vec<_> = replica
            .params
            .iter()
            .map(|p| optimizer.state(p.numel()))
            .collect();
        let apply = median_of(reps, || {
            for ((p, g), s) in replica.params.iter_mut().zip(&grads).zip(&mut states) {
                optimizer.apply(p.as_mut_slice::<f32>()?, g.as_slice::<f32>()?, s);
            }
            Ok(())
        })?;
        let mut sums = replica.zeros_like();
        let add = median_of(reps, || {
            for (s, g) in sums.iter_mut().zip(&grads) {
                let (s, g) = (s.as_mut_slice::<f32>()?, g.as_slice::<f32>()?);
                for (a, b) in s.iter_mut().zip(g) {
                    *a += *b;
                }
            }
            std::hint::black_box(&sums);
            Ok(())
        })?;
        let param_bytes = (replica.num_parameters() * 4) as f64;
        Ok(Workload {
            param_bytes,
            compute,
            update: Update {
                add_per_byte: add / param_bytes,
                apply_per_byte: apply / param_bytes,
            },
        })
    }
}

/// The median of `reps` timings of `f`.
fn median_of(
    reps: usize,
    mut f: impl FnMut() -> Result<(), ModelError>,
) -> Result<f64, ModelError> {
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        t.push(start.elapsed().as_secs_f64());
    }
    Ok(crate::bench::median(&mut t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::optim::OptimizerKind;

    #[test]
    fn a_models_workload_counts_its_parameters_and_takes_time() {
        let model = crate::model::mlp(16, &[32], 4).unwrap();
        let x: Vec<f32> = (0..8 * 16).map(|i| (i % 7) as f32 / 7.0).collect();
        let y: Vec<u8> = (0..8).map(|i| (i % 4) as u8).collect();
        let opt = Optimizer::new(OptimizerKind::Adam, 0.01);
        let w = Workload::measure(&model, &x, &y, &opt, 3).unwrap();
        assert_eq!(w.param_bytes, ((16 * 32 + 32 + 32 * 4 + 4) * 4) as f64);
        assert!(w.compute > 0.0 && w.update.apply_per_byte > 0.0, "{w:?}");
        assert!(w.apply() > 0.0);
        // A batch of the wrong width is the model's error, not a timing.
        assert!(Workload::measure(&model, &x[..10], &y, &opt, 1).is_err());
    }
}
