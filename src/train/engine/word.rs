//! The step's word: what every training rank says of a step (its loss over its samples, a
//! non-finite loss, a stop signal it was sent, a hook's request to stop), summed over the
//! ranks so that every rank reaches the same verdict. One typed value, encoded as `f32`s so
//! that it rides in the gradients' own reduction (the gradients' dtype): the counts are
//! exact far beyond any rank count, the loss sum is for reporting.

use crate::tensor::{DType, Tensor};
use crate::transport::{Algorithm, Collectives, Comm, ReduceOp, TransportError};

/// One rank's word on a step, or (after [`StepWord::add`] or a reduction) every rank's.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepWord {
    /// Sum of loss x samples over the ranks whose loss was finite.
    pub loss_sum: f32,
    /// Samples of the step.
    pub samples: f32,
    /// Ranks whose loss was NaN.
    pub nan: f32,
    /// Ranks whose loss was infinite.
    pub inf: f32,
    /// Ranks sent a stop signal, and the sum of their signal numbers.
    pub signals: f32,
    pub signal_sum: f32,
    /// Ranks whose hooks asked to stop.
    pub asked: f32,
    /// Ranks whose own gradients held a non-finite value ([`StepWord::with_gradients`]).
    pub bad_gradients: f32,
    /// Ranks whose step failed before the reduction (their gradients could not be made:
    /// [`StepWord::failing`]); every rank then stops.
    pub failed: f32,
}

impl StepWord {
    /// Elements of the encoding.
    pub const LEN: usize = 9;

    /// A rank's word before its step: the signal it was sent, and whether its hooks asked
    /// to stop.
    pub fn asking(signal: Option<i32>, asked: bool) -> StepWord {
        StepWord {
            signals: f32::from(u8::from(signal.is_some())),
            signal_sum: signal.unwrap_or(0) as f32,
            asked: f32::from(u8::from(asked)),
            ..StepWord::default()
        }
    }

    /// This word with the rank's loss over its `samples`.
    pub fn with_loss(self, loss: f32, samples: usize) -> StepWord {
        let n = samples as f32;
        StepWord {
            loss_sum: if loss.is_finite() { loss * n } else { 0.0 },
            samples: n,
            nan: f32::from(u8::from(loss.is_nan())),
            inf: f32::from(u8::from(loss.is_infinite())),
            ..self
        }
    }

    /// This word saying whether `grads`, this rank's own, are all finite: a strategy
    /// whose ranks apply gradients that differ (not one reduced sum) says it, so that every
    /// rank stops at a non-finite one.
    pub fn with_gradients(self, grads: &[Tensor]) -> StepWord {
        let bad = grads.iter().any(|g| {
            g.as_slice::<f32>()
                .is_ok_and(|v| !crate::train::guard::all_finite(v))
        });
        StepWord {
            bad_gradients: f32::from(u8::from(bad)),
            ..self
        }
    }

    /// This word saying the rank's step failed (it takes part in the reduction with no
    /// gradients, so that no rank waits for it, and raises its own error after).
    pub fn failing(self) -> StepWord {
        StepWord {
            failed: 1.0,
            ..self
        }
    }

    /// How many ranks' steps failed before the reduction.
    pub fn failed(&self) -> usize {
        self.failed as usize
    }

    /// The sum of two ranks' words.
    pub fn add(&self, o: &StepWord) -> StepWord {
        let mut a = self.encode();
        for (x, y) in a.iter_mut().zip(o.encode()) {
            *x += y;
        }
        StepWord::decode(&a)
    }

    pub fn encode(&self) -> [f32; Self::LEN] {
        [
            self.loss_sum,
            self.samples,
            self.nan,
            self.inf,
            self.signals,
            self.signal_sum,
            self.asked,
            self.bad_gradients,
            self.failed,
        ]
    }

    pub fn decode(v: &[f32]) -> StepWord {
        let at = |i: usize| v.get(i).copied().unwrap_or(0.0);
        StepWord {
            loss_sum: at(0),
            samples: at(1),
            nan: at(2),
            inf: at(3),
            signals: at(4),
            signal_sum: at(5),
            asked: at(6),
            bad_gradients: at(7),
            failed: at(8),
        }
    }

    /// The word as a tensor (to ride in a fused reduction), named as stall reports say it.
    pub fn to_tensor(&self) -> Tensor {
        Tensor::from_slice(&[Self::LEN], &self.encode())
            .expect("1-D")
            .named("step word")
    }

    /// The word a reduced tensor of [`StepWord::to_tensor`] holds.
    pub fn from_tensor(t: &Tensor) -> StepWord {
        StepWord::decode(t.as_slice::<f32>().unwrap_or(&[]))
    }

    /// The step's loss (sample-weighted over the ranks that saw a finite one).
    pub fn loss(&self) -> f32 {
        self.loss_sum / self.samples.max(1.0)
    }

    /// How many ranks saw a NaN loss, and how many an infinite one.
    pub fn non_finite(&self) -> (usize, usize) {
        (self.nan as usize, self.inf as usize)
    }

    /// How many ranks found a non-finite value in their own gradients.
    pub fn bad_gradients(&self) -> usize {
        self.bad_gradients as usize
    }

    /// The signal that stops the job after this step, if any rank was sent one. Named by
    /// the signal only: one sent to every rank can reach them on either side of a step.
    pub fn stop_signal(&self) -> Option<i32> {
        (self.signals > 0.0).then(|| (self.signal_sum / self.signals).round() as i32)
    }

    /// True if a hook on any rank asked to stop.
    pub fn stop_asked(&self) -> bool {
        self.asked > 0.0
    }

    /// Sums this word over `coll`'s ranks, on its own (a strategy whose step has no
    /// reduction of its own to carry it).
    pub fn agree<C: Comm>(&self, coll: &Collectives<C>) -> Result<StepWord, TransportError> {
        if coll.size() < 2 {
            return Ok(*self);
        }
        let mut t = self.to_tensor();
        debug_assert_eq!(t.dtype(), DType::F32);
        coll.allreduce_tensor(&mut t, ReduceOp::Sum, Algorithm::Auto)?;
        Ok(StepWord::from_tensor(&t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_sum_to_one_verdict() {
        let a = StepWord::asking(Some(15), false).with_loss(2.0, 4);
        let b = StepWord::asking(None, true).with_loss(f32::NAN, 3);
        let c = StepWord::asking(Some(15), false).with_loss(1.0, 4);
        let grads = [Tensor::from_slice(&[2], &[1f32, f32::INFINITY]).unwrap()];
        let all = a.add(&b).add(&c.with_gradients(&grads).failing());
        assert_eq!(all.bad_gradients(), 1);
        assert_eq!(all.failed(), 1);
        assert_eq!(StepWord::decode(&all.encode()), all);
        assert_eq!(all.loss(), 12.0 / 11.0);
        assert_eq!(all.non_finite(), (1, 0));
        assert_eq!(all.stop_signal(), Some(15));
        assert!(all.stop_asked());
        let quiet = StepWord::asking(None, false).with_loss(0.5, 2);
        assert_eq!(
            (quiet.stop_signal(), quiet.stop_asked(), quiet.loss()),
            (None, false, 0.5)
        );
        assert_eq!(StepWord::from_tensor(&all.to_tensor()), all);
    }
}
