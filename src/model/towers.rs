//! Towers (TensorFlow's clones, `--towers K`): K threads in one task, each computing a
//! copy of the model's gradients on its share of the batch; the task averages them
//! (weighted by the shares' sizes, so the result is the whole batch's gradient) before
//! the push or the allreduce. The parameters are shared, read-only; each tower has its
//! own gradient buffers and activations.

use std::ops::Range;

use super::{ModelError, Replica, Targets};
use crate::tensor::Tensor;

/// Rows `t` of `n` split `k` ways: contiguous, sizes differing by at most one.
pub fn share(n: usize, t: usize, k: usize) -> Range<usize> {
    t * n / k..(t + 1) * n / k
}

/// The gradient buffers of towers 1..K (tower 0 writes into the caller's).
#[derive(Debug, Clone, Default)]
pub struct Towers {
    k: usize,
    spare: Vec<Vec<Tensor>>,
}

impl Towers {
    /// `k` towers (1: the batch in the calling thread, as without towers).
    pub fn new(k: usize) -> Towers {
        Towers {
            k: k.max(1),
            spare: Vec::new(),
        }
    }

    /// The mean loss of the batch `x`, `y` and its gradients into `grads`, computed by the
    /// towers on their shares (a tower whose share is empty sits out). With more than one
    /// tower, `ready` hears of every parameter at once, at the end.
    pub fn gradients_with<'y>(
        &mut self,
        replica: &Replica<'_>,
        x: &[f32],
        y: impl Into<Targets<'y>>,
        grads: &mut [Tensor],
        ready: &mut dyn FnMut(Range<usize>, &[Tensor]),
    ) -> Result<f32, ModelError> {
        let y = y.into();
        let width = replica.model.classes();
        let n = y.rows(width);
        let k = self.k.min(n.max(1));
        if k <= 1 {
            return replica.gradients_with(x, y, grads, ready);
        }
        let per = crate::model::sample_len(replica.model);
        self.spare
            .resize_with(k - 1, || crate::model::zeros_like(&replica.params));
        let losses = std::thread::scope(|s| {
            let others: Vec<_> = self.spare[..k - 1]
                .iter_mut()
                .enumerate()
                .map(|(i, g)| {
                    let rows = share(n, i + 1, k);
                    let (xs, ys) = (&x[rows.start * per..rows.end * per], y.slice(rows, width));
                    s.spawn(move || replica.gradients_into(xs, ys, g))
                })
                .collect();
            let rows = share(n, 0, k);
            let first = replica.gradients_into(&x[..rows.end * per], y.slice(rows, width), grads);
            let rest = others
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
            std::iter::once(first).chain(rest).collect::<Vec<_>>()
        });
        // Weighted by the shares: the mean over the whole batch.
        let mut loss = 0.0f32;
        for (t, l) in losses.into_iter().enumerate() {
            let w = share(n, t, k).len() as f32 / n as f32;
            loss += l? * w;
            if t == 0 {
                for g in grads.iter_mut() {
                    let g = g.as_mut_slice::<f32>()?;
                    g.iter_mut().for_each(|v| *v *= w);
                }
            } else {
                for (g, o) in grads.iter_mut().zip(&self.spare[t - 1]) {
                    crate::kernels::axpy(w, o.as_slice::<f32>()?, g.as_mut_slice::<f32>()?)?;
                }
            }
        }
        ready(0..grads.len(), grads);
        Ok(loss)
    }

    /// [`Towers::gradients_with`] with no early word.
    pub fn gradients_into<'y>(
        &mut self,
        replica: &Replica<'_>,
        x: &[f32],
        y: impl Into<Targets<'y>>,
        grads: &mut [Tensor],
    ) -> Result<f32, ModelError> {
        self.gradients_with(replica, x, y, grads, &mut |_, _| {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn towers_give_the_whole_batch_gradient() {
        let model = crate::model::cnn([8, 8, 1], 3).unwrap();
        let r = Replica::new(&model, 3);
        let mut rng = Rng::new(4);
        let n = 7;
        let x: Vec<f32> = (0..n * 64).map(|_| rng.normal() as f32).collect();
        let y: Vec<u8> = (0..n).map(|i| (i % 3) as u8).collect();
        let mut want = r.zeros_like();
        let loss = r.gradients_into(&x, &y, &mut want).unwrap();
        for k in [1, 2, 3, 7, 9] {
            let mut towers = Towers::new(k);
            let mut got = r.zeros_like();
            let mut heard = Vec::new();
            let l = towers
                .gradients_with(&r, &x, &y, &mut got, &mut |range, _| heard.push(range))
                .unwrap();
            assert!((l - loss).abs() < 1e-5, "{k} towers: loss {l} vs {loss}");
            let all: usize = heard.iter().map(|r| r.len()).sum();
            assert_eq!(all, got.len(), "{k} towers: every parameter ready once");
            for (g, w) in got.iter().zip(&want) {
                let (g, w) = (g.as_slice::<f32>().unwrap(), w.as_slice::<f32>().unwrap());
                for (a, b) in g.iter().zip(w) {
                    assert!(
                        (a - b).abs() < 1e-5 * (1.0 + b.abs()),
                        "{k} towers: {a} vs {b}"
                    );
                }
            }
        }
    }
}
