//! Optimizers as pure update rules over (parameter, gradient, state).
//!
//! The same functions run wherever an update is applied (in-process, on a parameter server,
//! on every replica after an allreduce), so all modes share one definition of each rule.
//! Conventions follow TensorFlow's `tf.train` optimizers: momentum is
//! `v = m v + g; p -= lr v`; Adagrad starts its accumulator at 0.1; Adam uses the bias
//! correction of Kingma and Ba with `eps` outside the square root.

/// Which rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerKind {
    Sgd,
    Momentum,
    Adagrad,
    #[default]
    Adam,
}

/// Hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Optimizer {
    pub kind: OptimizerKind,
    pub lr: f32,
    pub momentum: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub adagrad_init: f32,
}

impl Optimizer {
    pub fn new(kind: OptimizerKind, lr: f32) -> Optimizer {
        Optimizer {
            kind,
            lr,
            momentum: 0.9,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            adagrad_init: 0.1,
        }
    }

    /// Fresh state for a parameter of `n` elements.
    pub fn state(&self, n: usize) -> Slots {
        let init = if self.kind == OptimizerKind::Adagrad {
            self.adagrad_init
        } else {
            0.0
        };
        let (m, v) = match self.kind {
            OptimizerKind::Sgd => (0, 0),
            OptimizerKind::Momentum | OptimizerKind::Adagrad => (n, 0),
            OptimizerKind::Adam => (n, n),
        };
        Slots {
            m: vec![init; m],
            v: vec![0.0; v],
            t: 0,
        }
    }

    /// Applies one update to `param` with `grad`, advancing `state`.
    pub fn apply(&self, param: &mut [f32], grad: &[f32], state: &mut Slots) {
        state.t += 1;
        let lr = self.lr;
        match self.kind {
            OptimizerKind::Sgd => param.iter_mut().zip(grad).for_each(|(p, g)| *p -= lr * g),
            OptimizerKind::Momentum => {
                let m = self.momentum;
                for ((p, g), v) in param.iter_mut().zip(grad).zip(&mut state.m) {
                    *v = m * *v + g;
                    *p -= lr * *v;
                }
            }
            OptimizerKind::Adagrad => {
                for ((p, g), a) in param.iter_mut().zip(grad).zip(&mut state.m) {
                    *a += g * g;
                    *p -= lr * g / a.sqrt();
                }
            }
            OptimizerKind::Adam => {
                let (b1, b2) = (self.beta1, self.beta2);
                let t = state.t as i32;
                let lr_t = lr * (1.0 - b2.powi(t)).sqrt() / (1.0 - b1.powi(t));
                for (((p, g), m), v) in param
                    .iter_mut()
                    .zip(grad)
                    .zip(&mut state.m)
                    .zip(&mut state.v)
                {
                    *m = b1 * *m + (1.0 - b1) * g;
                    *v = b2 * *v + (1.0 - b2) * g * g;
                    *p -= lr_t * *m / (v.sqrt() + self.eps);
                }
            }
        }
    }
}

/// An optimizer's per-parameter state.
#[derive(Debug, Clone, PartialEq)]
pub struct Slots {
    /// Momentum / Adagrad accumulator / Adam first moment.
    pub m: Vec<f32>,
    /// Adam second moment.
    pub v: Vec<f32>,
    /// Updates applied.
    pub t: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rule minimises a quadratic.
    #[test]
    fn every_rule_descends() {
        for kind in [
            OptimizerKind::Sgd,
            OptimizerKind::Momentum,
            OptimizerKind::Adagrad,
            OptimizerKind::Adam,
        ] {
            // Adagrad's steps shrink as 1/sqrt(sum g^2): it needs a larger rate.
            let opt = Optimizer::new(
                kind,
                if kind == OptimizerKind::Adagrad {
                    0.5
                } else {
                    0.05
                },
            );
            let mut p = vec![3.0f32, -2.0];
            let mut s = opt.state(2);
            for _ in 0..500 {
                let g: Vec<f32> = p.iter().map(|x| 2.0 * x).collect();
                opt.apply(&mut p, &g, &mut s);
            }
            assert!(p.iter().all(|x| x.abs() < 0.1), "{kind:?}: {p:?}");
            assert_eq!(s.t, 500);
        }
    }

    #[test]
    fn first_steps_by_hand() {
        let mut p = [1.0f32];
        let opt = Optimizer::new(OptimizerKind::Momentum, 0.1);
        let mut s = opt.state(1);
        opt.apply(&mut p, &[1.0], &mut s);
        opt.apply(&mut p, &[1.0], &mut s);
        assert!((p[0] - (1.0 - 0.1 - 0.19)).abs() < 1e-6);
        let adam = Optimizer::new(OptimizerKind::Adam, 0.1);
        let mut s = adam.state(1);
        let mut q = [1.0f32];
        adam.apply(&mut q, &[0.5], &mut s);
        assert!(
            (q[0] - 0.9).abs() < 1e-4,
            "Adam's first step is lr * sign(g): {q:?}"
        );
    }
}
