//! One process trains alone (`mpiflow train --mode local`): the reference every other
//! mode is compared with.

use std::time::Instant;

use std::path::Path;

use super::{Started, StepWord, Strategy, TrainError};
use crate::model::towers::Towers;
use crate::model::{Model, Replica, Targets};
use crate::observe::phases::{Clock, Phase, RankTimes, Times};
use crate::observe::timeline::Detail;
use crate::tensor::Tensor;
use crate::train::checkpoint::State;
use crate::train::events::Event;
use crate::train::optim::{Optimizer, Slots};
use crate::train::TrainConfig;

/// The parameters and the optimizer state in this process; a step's gradients applied as
/// they are.
pub struct Local<'m> {
    replica: Replica<'m>,
    opt: Optimizer,
    slots: Vec<Slots>,
    grads: Vec<Tensor>,
    towers: Towers,
}

impl<'m> Local<'m> {
    /// `model` from `cfg.seed`'s initial values, trained by `cfg.optimizer` in
    /// `cfg.towers` threads.
    pub fn new(model: &'m dyn Model, cfg: &TrainConfig) -> Result<Local<'m>, TrainError> {
        let replica = Replica::new(model, cfg.seed);
        let opt = cfg.optimizer;
        Ok(Local {
            slots: replica
                .params
                .iter()
                .map(|p| opt.state(p.numel()))
                .collect(),
            grads: replica.zeros_like(),
            replica,
            opt,
            towers: Towers::new(cfg.towers),
        })
    }
}

impl<'m> Strategy<'m> for Local<'m> {
    fn ranks(&self) -> (usize, usize) {
        (1, 0)
    }

    fn replica(&self) -> &Replica<'m> {
        &self.replica
    }

    fn into_replica(self) -> Replica<'m> {
        self.replica
    }

    fn start(
        &mut self,
        dir: Option<&Path>,
        events: &mut dyn FnMut(&Event),
    ) -> Result<Started, TrainError> {
        let restored = super::restore(dir, true, &self.replica, events)?;
        let step = restored.map(|s| {
            s.apply_to(&mut self.replica, &mut self.slots, &self.opt);
            s.step
        });
        Ok(Started {
            step: step.unwrap_or(0),
            restored: step,
        })
    }

    fn gradients(
        &mut self,
        step: u64,
        x: &[f32],
        y: Targets<'_>,
        word: StepWord,
        clock: &mut Clock,
        _: &mut dyn FnMut(&Event),
    ) -> Result<StepWord, TrainError> {
        let t = Instant::now();
        let loss = self
            .towers
            .gradients_into(&self.replica, x, y, &mut self.grads)?;
        clock.since_as(Phase::Compute, t, "gradients", Detail::at(step));
        Ok(word.with_loss(loss, y.rows(self.replica.model.classes())))
    }

    fn pending(&self) -> &[Tensor] {
        &self.grads
    }

    fn apply(&mut self, step: u64) -> Result<u64, TrainError> {
        apply_optimizer(&mut self.replica, &self.grads, &self.opt, &mut self.slots);
        Ok(step + 1)
    }

    fn state(&mut self, step: u64) -> Result<State, TrainError> {
        Ok(State::of_replica(&self.replica, &self.slots, step))
    }

    fn sum(&mut self, _: &mut [f64]) -> Result<(), TrainError> {
        Ok(())
    }

    fn window(&mut self, _: u64, clock: &mut Clock) -> Result<(Times, Vec<RankTimes>), TrainError> {
        let mine = clock.take();
        let me = RankTimes {
            rank: 0,
            task: "local".into(),
            times: mine,
        };
        Ok((mine, vec![me]))
    }

    fn communicates(&self) -> bool {
        false
    }
}

/// `opt`'s step on each of `replica`'s parameters with its gradient and state.
pub(crate) fn apply_optimizer(
    replica: &mut Replica<'_>,
    grads: &[Tensor],
    opt: &Optimizer,
    slots: &mut [Slots],
) {
    for ((p, g), s) in replica.params.iter_mut().zip(grads).zip(slots) {
        opt.apply(
            p.as_mut_slice::<f32>().expect("f32"),
            g.as_slice::<f32>().expect("f32"),
            s,
        );
    }
}
