//! A multilayer perceptron: dense layers with ReLU between them and softmax cross-entropy
//! at the end, forward and backward on the BLAS kernels.
//!
//! Parameters are named tensors, `layer{i}/w` (`in x out`) and `layer{i}/b` (`out`), so
//! placement on parameter servers and gradient fusion can address them by name.
//! Initialisation is He-normal from a seed, biases zero: the same seed gives the same
//! model on every machine.

use super::rng::Rng;
use crate::kernels::{self, KernelError};
use crate::tensor::{DType, Tensor};

/// A multilayer perceptron.
#[derive(Debug, Clone)]
pub struct Mlp {
    /// Layer widths, input first: `[64, 128, 10]`.
    pub sizes: Vec<usize>,
    /// `w0, b0, w1, b1, ...`
    pub params: Vec<Tensor>,
}

/// Loss and gradients of one batch.
#[derive(Debug, Clone)]
pub struct Gradients {
    pub loss: f32,
    /// Same names and shapes as the parameters.
    pub grads: Vec<Tensor>,
}

fn f32s(t: &Tensor) -> &[f32] {
    t.as_slice::<f32>().expect("parameters are f32")
}

impl Mlp {
    pub fn new(sizes: &[usize], seed: u64) -> Mlp {
        let mut rng = Rng::new(seed);
        let mut params = Vec::new();
        for (i, w) in sizes.windows(2).enumerate() {
            let (fan_in, fan_out) = (w[0], w[1]);
            let std = (2.0 / fan_in as f64).sqrt();
            let data: Vec<f32> = (0..fan_in * fan_out)
                .map(|_| (rng.normal() * std) as f32)
                .collect();
            params.push(
                Tensor::from_slice(&[fan_in, fan_out], &data)
                    .expect("shape matches")
                    .named(&format!("layer{i}/w")),
            );
            params.push(
                Tensor::zeros(DType::F32, &[fan_out])
                    .expect("1-D")
                    .named(&format!("layer{i}/b")),
            );
        }
        Mlp {
            sizes: sizes.to_vec(),
            params,
        }
    }

    pub fn num_layers(&self) -> usize {
        self.sizes.len() - 1
    }

    /// Number of scalar parameters.
    pub fn num_parameters(&self) -> usize {
        self.params.iter().map(Tensor::numel).sum()
    }

    /// Zero tensors shaped and named like the parameters.
    pub fn zeros_like(&self) -> Vec<Tensor> {
        self.params
            .iter()
            .map(|p| {
                Tensor::zeros(DType::F32, p.shape())
                    .expect("same shape")
                    .named(p.name())
            })
            .collect()
    }

    /// Layer outputs for `rows` samples: `acts[0]` is the input, the last the logits.
    fn forward_all(&self, x: &[f32], rows: usize) -> Result<Vec<Vec<f32>>, KernelError> {
        let mut acts = vec![x.to_vec()];
        for l in 0..self.num_layers() {
            let (fi, fo) = (self.sizes[l], self.sizes[l + 1]);
            let mut out = vec![0.0f32; rows * fo];
            kernels::gemm(
                false,
                false,
                rows,
                fo,
                fi,
                1.0,
                &acts[l],
                f32s(&self.params[2 * l]),
                0.0,
                &mut out,
            )?;
            kernels::bias_add(&mut out, f32s(&self.params[2 * l + 1]));
            if l + 1 < self.num_layers() {
                kernels::relu(&mut out);
            }
            acts.push(out);
        }
        Ok(acts)
    }

    /// Logits for `rows` samples.
    pub fn logits(&self, x: &[f32], rows: usize) -> Result<Vec<f32>, KernelError> {
        Ok(self
            .forward_all(x, rows)?
            .pop()
            .expect("at least one layer"))
    }

    /// Mean loss and its gradients for one batch.
    pub fn gradients(&self, x: &[f32], y: &[u8]) -> Result<Gradients, KernelError> {
        let mut grads = self.zeros_like();
        let loss = self.gradients_into(x, y, &mut grads)?;
        Ok(Gradients { loss, grads })
    }

    /// Mean loss; gradients written into `grads` (shaped like the parameters).
    pub fn gradients_into(
        &self,
        x: &[f32],
        y: &[u8],
        grads: &mut [Tensor],
    ) -> Result<f32, KernelError> {
        self.gradients_with(x, y, grads, &mut |_, _| {})
    }

    /// As [`Self::gradients_into`], calling `on_layer(l, [dW, db])` as soon as layer `l`'s
    /// gradients are final, last layer first, while earlier layers are still to come: the
    /// hook to start their reduction during the rest of the backward pass.
    pub fn gradients_with(
        &self,
        x: &[f32],
        y: &[u8],
        grads: &mut [Tensor],
        on_layer: &mut dyn FnMut(usize, &[Tensor]),
    ) -> Result<f32, KernelError> {
        let rows = y.len();
        let acts = self.forward_all(x, rows)?;
        let classes = *self.sizes.last().expect("sizes");
        let mut delta = vec![0.0f32; rows * classes];
        let loss =
            kernels::softmax_cross_entropy(acts.last().expect("logits"), y, classes, &mut delta);
        for l in (0..self.num_layers()).rev() {
            let (fi, fo) = (self.sizes[l], self.sizes[l + 1]);
            let (gw, rest) = grads[2 * l..].split_at_mut(1);
            // dW = A^T delta, db = column sums of delta.
            kernels::gemm(
                true,
                false,
                fi,
                fo,
                rows,
                1.0,
                &acts[l],
                &delta,
                0.0,
                gw[0].as_mut_slice::<f32>().expect("f32"),
            )?;
            kernels::sum_rows(&delta, rest[0].as_mut_slice::<f32>().expect("f32"));
            on_layer(l, &grads[2 * l..2 * l + 2]);
            if l > 0 {
                let mut prev = vec![0.0f32; rows * fi];
                kernels::gemm(
                    false,
                    true,
                    rows,
                    fi,
                    fo,
                    1.0,
                    &delta,
                    f32s(&self.params[2 * l]),
                    0.0,
                    &mut prev,
                )?;
                kernels::relu_backward(&acts[l], &mut prev);
                delta = prev;
            }
        }
        Ok(loss)
    }

    /// Fraction of samples classified correctly.
    pub fn accuracy(&self, x: &[f32], y: &[u8]) -> Result<f64, KernelError> {
        let logits = self.logits(x, y.len())?;
        let pred = kernels::argmax_rows(&logits, *self.sizes.last().expect("sizes"));
        Ok(pred
            .iter()
            .zip(y)
            .filter(|(p, l)| **p == **l as usize)
            .count() as f64
            / y.len().max(1) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loss in f64 for finite differences.
    fn loss(m: &Mlp, x: &[f32], y: &[u8]) -> f64 {
        let logits = m.logits(x, y.len()).unwrap();
        let c = *m.sizes.last().unwrap();
        logits
            .chunks(c)
            .zip(y)
            .map(|(row, l)| {
                let max = row.iter().copied().fold(f32::MIN, f32::max) as f64;
                let s: f64 = row.iter().map(|v| (*v as f64 - max).exp()).sum();
                s.ln() - (row[*l as usize] as f64 - max)
            })
            .sum::<f64>()
            / y.len() as f64
    }

    #[test]
    fn gradients_match_finite_differences() {
        let m = Mlp::new(&[5, 7, 6, 3], 11);
        let mut rng = Rng::new(2);
        let x: Vec<f32> = (0..4 * 5).map(|_| rng.normal() as f32).collect();
        let y = [0u8, 2, 1, 2];
        let g = m.gradients(&x, &y).unwrap();
        assert!((g.loss as f64 - loss(&m, &x, &y)).abs() < 1e-5);
        let eps = 1e-2f32;
        let mut checked = 0;
        for (pi, p) in m.params.iter().enumerate() {
            for i in (0..p.numel()).step_by(3) {
                let mut plus = m.clone();
                plus.params[pi].as_mut_slice::<f32>().unwrap()[i] += eps;
                let mut minus = m.clone();
                minus.params[pi].as_mut_slice::<f32>().unwrap()[i] -= eps;
                let fd = (loss(&plus, &x, &y) - loss(&minus, &x, &y)) / (2.0 * eps as f64);
                let an = g.grads[pi].as_slice::<f32>().unwrap()[i] as f64;
                assert!(
                    (fd - an).abs() < 2e-3 + 2e-2 * an.abs(),
                    "{} [{i}]: fd {fd} analytic {an}",
                    p.name()
                );
                checked += 1;
            }
        }
        assert!(checked > 20);
        assert_eq!(g.grads[0].name(), "layer0/w");
        assert_eq!(g.grads[5].shape(), &[3]);
    }

    #[test]
    fn same_seed_same_model() {
        let (a, b) = (Mlp::new(&[4, 3, 2], 5), Mlp::new(&[4, 3, 2], 5));
        assert_eq!(a.params[0].bytes(), b.params[0].bytes());
        assert_ne!(
            a.params[0].bytes(),
            Mlp::new(&[4, 3, 2], 6).params[0].bytes()
        );
        assert_eq!(a.num_parameters(), 4 * 3 + 3 + 3 * 2 + 2);
    }
}
