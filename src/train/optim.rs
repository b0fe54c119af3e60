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

impl crate::named::Named for OptimizerKind {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (OptimizerKind::Sgd, "sgd", ""),
        (OptimizerKind::Momentum, "momentum", "Momentum 0.9"),
        (OptimizerKind::Adagrad, "adagrad", ""),
        (OptimizerKind::Adam, "adam", ""),
    ];
}

/// How the learning rate changes over the updates (TensorFlow's `tf.train.*_decay`).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decay {
    /// The base rate throughout.
    #[default]
    Constant,
    /// `tf.train.cosine_decay` with alpha 0: the rate falls along half a cosine from the
    /// base rate at the first update to 0 at update `steps`, and stays 0 after it.
    Cosine { steps: u64 },
}

impl Decay {
    /// The factor on the base rate for update `t` (1-based, as [`Slots::t`] after it).
    pub fn factor(&self, t: u64) -> f32 {
        match *self {
            Decay::Constant => 1.0,
            Decay::Cosine { steps } => {
                let done = (t.saturating_sub(1) as f64 / steps.max(1) as f64).min(1.0);
                (0.5 * (1.0 + (std::f64::consts::PI * done).cos())) as f32
            }
        }
    }
}

/// Hyper-parameters: everything a ps or a replica needs to apply updates, sent as is by
/// the chief to the ps tasks.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Optimizer {
    pub kind: OptimizerKind,
    /// The base learning rate.
    pub lr: f32,
    pub decay: Decay,
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
            decay: Decay::Constant,
            momentum: 0.9,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            adagrad_init: 0.1,
        }
    }

    /// The same rule with the learning rate following `decay`.
    pub fn with_decay(self, decay: Decay) -> Optimizer {
        Optimizer { decay, ..self }
    }

    /// The learning rate of update `t` (1-based).
    pub fn lr_at(&self, t: u64) -> f32 {
        self.lr * self.decay.factor(t)
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

    /// The state to resume a parameter of `n` elements from restored moments `m`, `v`
    /// after `t` updates: kept where they are what this rule keeps (a checkpoint of the
    /// same optimizer), fresh otherwise (one written by a rule that keeps other moments,
    /// or none), so a changed optimizer starts its moments anew instead of updating
    /// nothing.
    pub fn resume(&self, n: usize, m: Vec<f32>, v: Vec<f32>, t: u64) -> Slots {
        let fresh = self.state(n);
        let fits = m.len() == fresh.m.len() && v.len() == fresh.v.len();
        if fits {
            Slots { m, v, t }
        } else {
            Slots { t, ..fresh }
        }
    }

    /// Applies one update to `param` with `grad`, advancing `state`.
    pub fn apply(&self, param: &mut [f32], grad: &[f32], state: &mut Slots) {
        state.t += 1;
        let t = state.t;
        self.apply_part(param, grad, state, 0, t);
    }

    /// Update number `t` of elements `at..at + param.len()` of a parameter whose state is
    /// `state`, with their gradient `grad`: a parameter updated piece by piece, each piece
    /// as its gradient arrives. The caller counts updates ([`Slots::t`]) per whole
    /// parameter, once all its pieces are applied.
    pub fn apply_part(
        &self,
        param: &mut [f32],
        grad: &[f32],
        state: &mut Slots,
        at: usize,
        t: u64,
    ) {
        let lr = self.lr_at(t);
        let end = at + param.len();
        let part = |x: &mut Vec<f32>| -> std::ops::Range<usize> {
            if x.is_empty() {
                0..0
            } else {
                at..end
            }
        };
        let (rm, rv) = (part(&mut state.m), part(&mut state.v));
        let (sm, sv) = (&mut state.m[rm], &mut state.v[rv]);
        match self.kind {
            OptimizerKind::Sgd => param.iter_mut().zip(grad).for_each(|(p, g)| *p -= lr * g),
            OptimizerKind::Momentum => {
                let m = self.momentum;
                for ((p, g), v) in param.iter_mut().zip(grad).zip(sm) {
                    *v = m * *v + g;
                    *p -= lr * *v;
                }
            }
            OptimizerKind::Adagrad => {
                for ((p, g), a) in param.iter_mut().zip(grad).zip(sm) {
                    *a += g * g;
                    *p -= lr * g / a.sqrt();
                }
            }
            OptimizerKind::Adam => {
                let (b1, b2) = (self.beta1, self.beta2);
                let t = t as i32;
                let lr_t = lr * (1.0 - b2.powi(t)).sqrt() / (1.0 - b1.powi(t));
                for (((p, g), m), v) in param.iter_mut().zip(grad).zip(sm).zip(sv) {
                    *m = b1 * *m + (1.0 - b1) * g;
                    *v = b2 * *v + (1.0 - b2) * g * g;
                    *p -= lr_t * *m / (v.sqrt() + self.eps);
                }
            }
        }
    }
}

impl std::fmt::Display for Optimizer {
    /// `adam lr 0.003` or `adam lr 0.003 cosine to 0 at step 2000`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::named::Named;
        write!(f, "{} lr {}", self.kind.name(), self.lr)?;
        match self.decay {
            Decay::Constant => Ok(()),
            Decay::Cosine { steps } => write!(f, " cosine to 0 at step {steps}"),
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

    #[test]
    fn resumed_moments_are_kept_only_when_they_fit_the_rule() {
        let adam = Optimizer::new(OptimizerKind::Adam, 0.1);
        let kept = adam.resume(2, vec![1.0, 2.0], vec![3.0, 4.0], 9);
        assert_eq!(
            (kept.m, kept.v, kept.t),
            (vec![1.0, 2.0], vec![3.0, 4.0], 9)
        );
        // From an SGD checkpoint (no moments): Adam starts them at zero and still moves.
        let mut s = adam.resume(2, Vec::new(), Vec::new(), 9);
        assert_eq!((s.m.len(), s.v.len(), s.t), (2, 2, 9));
        let mut p = [1.0f32, 1.0];
        adam.apply(&mut p, &[1.0, -1.0], &mut s);
        assert!(p[0] < 1.0 && p[1] > 1.0, "{p:?}");
    }

    #[test]
    fn cosine_decay_falls_from_the_base_rate_to_zero() {
        let sgd = Optimizer::new(OptimizerKind::Sgd, 0.4).with_decay(Decay::Cosine { steps: 4 });
        let rates: Vec<f32> = (1..=6).map(|t| sgd.lr_at(t)).collect();
        let want = [0.4, 0.341_421_36, 0.2, 0.058_578_64, 0.0, 0.0];
        for (got, want) in rates.iter().zip(want) {
            assert!((got - want).abs() < 1e-6, "{rates:?}");
        }
        // The update uses the rate of its own step: the third moves by 0.2 * g.
        let mut p = [0.0f32];
        let mut s = sgd.state(1);
        s.t = 2;
        sgd.apply(&mut p, &[1.0], &mut s);
        assert!((p[0] + 0.2).abs() < 1e-6, "{p:?}");
    }

    /// A parameter updated piece by piece ends where one whole update does, for every rule.
    #[test]
    fn updates_in_pieces_equal_whole_updates() {
        for kind in [
            OptimizerKind::Sgd,
            OptimizerKind::Momentum,
            OptimizerKind::Adagrad,
            OptimizerKind::Adam,
        ] {
            let opt = Optimizer::new(kind, 0.01);
            let grad: Vec<f32> = (0..10).map(|i| (i as f32 - 4.5) / 3.0).collect();
            let (mut whole, mut pieces) = (vec![1.0f32; 10], vec![1.0f32; 10]);
            let (mut sw, mut sp) = (opt.state(10), opt.state(10));
            for _ in 0..3 {
                opt.apply(&mut whole, &grad, &mut sw);
                let t = sp.t + 1;
                for r in [0..4, 4..9, 9..10] {
                    let at = r.start;
                    opt.apply_part(&mut pieces[r.clone()], &grad[r], &mut sp, at, t);
                }
                sp.t = t;
            }
            assert_eq!(whole, pieces, "{kind:?}");
            assert_eq!(sw, sp, "{kind:?}");
        }
    }
}
