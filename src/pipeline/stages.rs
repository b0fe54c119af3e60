//! A pipeline stage's part of the step loop: the [`Stages`] strategy. Every replica task
//! (each replica's stages) trains in a [`crate::train::engine::Session`] over it; a
//! replica's share of each global batch goes through its stages in micro-batches, each
//! stage's gradients become its update ([`Updater`]), and one [`StepWord`] summed over
//! every replica task gives all of them the same verdict.

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::link::Link;
use super::passes::{run_passes, MicroBatches, PassTimes};
use super::report::{self, StageReport};
use super::save::{self, Saver, Writers};
use super::schedule::Op;
use super::stage::Stage;
use super::train::{PipelineConfig, PipelineError};
use super::update::Updater;
use crate::cluster::Layout;
use crate::model::{Model, Replica, Sequential, Targets};
use crate::observe::phases::{Clock, Phase, RankTimes, Times};
use crate::observe::stall::{self, Wait};
use crate::observe::timeline::{self, Detail};
use crate::tensor::Tensor;
use crate::train::checkpoint::State;
use crate::train::data::Dataset;
use crate::train::engine::{End, Started, StepWord, Strategy, TrainError};
use crate::train::events::Event;
use crate::train::ps::Roles;
use crate::transport::{Collectives, Comm};

/// Where a replica task stands: its replica and stage, of how many.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Place {
    pub replica: usize,
    pub replicas: usize,
    pub stage: usize,
}

/// A replica task of pipeline training: one stage of one replica.
pub struct Stages<'a, C: Comm> {
    pub(crate) st: Stage<'a>,
    pub(crate) updater: Updater<'a, C>,
    /// To the replica's other stages.
    pub(crate) link: Link<'a, C>,
    /// Every replica task.
    pub(crate) group: &'a Collectives<C>,
    pub(crate) layout: &'a Layout,
    /// This task's world rank.
    pub(crate) rank: usize,
    pub(crate) cfg: &'a PipelineConfig,
    pub(crate) model: &'a Sequential,
    /// The schedule's passes of this stage.
    pub(crate) ops: Vec<Op>,
    pub(crate) place: Place,
    pub(crate) writers: Writers,
    /// The stage's ps job, told when this task fails.
    pub(crate) ps_job: Option<(&'a C, &'a Roles)>,
    /// The step being applied: this replica's samples and loss (the last stage's).
    pub(crate) applying: (usize, f32),
    /// With ps tasks: the parameters are behind the ps's (pulled before they are used).
    pub(crate) stale: bool,
    /// The global step, and the first this task trained.
    pub(crate) step: u64,
    pub(crate) first: u64,
    pub(crate) peak_activations: usize,
    pub(crate) passes: PassTimes,
}

impl<'a, C: Comm> Stages<'a, C> {
    /// Where checkpoints of `dir` are written (the newest `keep` kept), and by whom.
    fn saver<'d>(&self, dir: &'d Path, keep: usize) -> Saver<'d, C>
    where
        'a: 'd,
    {
        Saver {
            group: self.group,
            who: self.writers,
            dir,
            model: self.model,
            keep,
        }
    }

    /// The parameters of the current step (with ps tasks, pulled if behind).
    fn fresh(&mut self) -> Result<(), PipelineError> {
        if let (true, Updater::Ps { client }) = (self.stale, &mut self.updater) {
            client.pull(self.step, &mut self.st.replica.params)?;
        }
        self.stale = false;
        Ok(())
    }

    /// This task's memory and pass times, for the reporter's table.
    pub(crate) fn stage_report(&self) -> StageReport {
        StageReport {
            stage: self.place.stage,
            param_bytes: self.st.param_bytes(),
            state_bytes: self.updater.state_bytes(),
            peak_activation_bytes: self.peak_activations,
            pass_secs: self.passes.total.as_secs_f64(),
            idle_secs: self.passes.idle.as_secs_f64(),
        }
    }

    /// Step `step`'s passes and reduction; this task's word summed over every replica
    /// task.
    fn passes(
        &mut self,
        step: u64,
        (x, y): (&[f32], Targets<'_>),
        word: StepWord,
        clock: &mut Clock,
    ) -> Result<StepWord, PipelineError> {
        let t = Instant::now();
        self.link.step = step;
        // A signal to a ps task reaches the stage tasks in its pull replies.
        let signal = word
            .stop_signal()
            .or(self.updater.begin(step, &mut self.st)?);
        self.stale = false;
        let n = y.rows(self.model.classes());
        let micro = MicroBatches {
            x,
            y,
            rows: n,
            count: self.cfg.micro_batches,
        };
        let (loss_sum, times) = run_passes(&mut self.st, &mut self.link, &self.ops, &micro)?;
        let mut waited = times.idle;
        if step > self.first {
            // The first step pays for allocations and first contacts.
            self.passes.total += times.total;
            self.passes.idle += times.idle;
        }
        let w = Instant::now();
        let reducing = stall::wait(|| Wait {
            op: "allreduce",
            step,
            what: Some("the stage's gradients and the step's verdict".into()),
            peer: None,
            bytes: self.st.param_bytes() as u64,
        });
        self.updater.reduce(&mut self.st, n, self.cfg.train.batch)?;
        let mut mine = StepWord::asking(signal, word.stop_asked());
        if self.st.is_last() {
            let loss = loss_sum / n.max(1) as f32;
            mine = mine.with_loss(loss, n);
            self.applying = (n, loss);
        } else {
            self.applying = (n, f32::NAN);
        }
        let agreed = mine.with_gradients(&self.st.grads).agree(self.group)?;
        drop(reducing);
        waited += w.elapsed();
        timeline::span("reduce", "comm", w, Instant::now(), Detail::at(step));
        clock.charge(Phase::Comm, waited);
        clock.charge(Phase::Compute, t.elapsed().saturating_sub(waited));
        self.peak_activations = self.peak_activations.max(self.st.take_peak_bytes());
        Ok(agreed)
    }
}

impl<'a, C: Comm> Strategy<'a> for Stages<'a, C> {
    /// Every replica task: they all sum each step's word.
    fn ranks(&self) -> (usize, usize) {
        (self.group.size(), self.group.rank())
    }

    /// Replica 0's last stage.
    fn reports(&self) -> bool {
        self.place.replica == 0 && self.st.is_last()
    }

    /// One share per replica, which all its stages take.
    fn data_shard(&self) -> (usize, usize) {
        (self.place.replicas, self.place.replica)
    }

    /// This stage's part of the model and its parameters.
    fn replica(&self) -> &Replica<'a> {
        &self.st.replica
    }

    fn into_replica(self) -> Replica<'a> {
        self.st.replica
    }

    fn start(
        &mut self,
        dir: Option<&Path>,
        events: &mut dyn FnMut(&Event),
    ) -> Result<Started, TrainError> {
        let chief = self.place.replica == 0;
        let keep = self.cfg.train.keep_checkpoints;
        let saver = dir.map(|dir| self.saver(dir, keep));
        let step = self
            .updater
            .start(saver.as_ref(), &mut self.st, chief, events)?;
        (self.step, self.first) = (step, step);
        Ok(Started {
            step,
            restored: (step > 0).then_some(step),
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
        Ok(self.passes(step, (x, y), word, clock)?)
    }

    /// Checked by each stage on its own, said in the word.
    fn pending(&self) -> &[Tensor] {
        &[]
    }

    fn apply(&mut self, step: u64) -> Result<u64, TrainError> {
        let (samples, loss) = self.applying;
        self.updater.apply(&mut self.st, step, samples, loss)?;
        self.stale = matches!(self.updater, Updater::Ps { .. });
        self.step = step + 1;
        Ok(step + 1)
    }

    fn after_step(&mut self, done: u64) -> Result<(), TrainError> {
        let every = self.cfg.check_every;
        if every > 0 && done.is_multiple_of(every) {
            self.updater.compare(&self.st, done)?;
        }
        Ok(())
    }

    fn state(&mut self, _: u64) -> Result<State, TrainError> {
        Err(TrainError::Setup(
            "a pipeline's stages write their parts of the checkpoint".into(),
        ))
    }

    /// Every replica task takes part: replica 0's stages write their parts, the
    /// coordinator the manifest.
    fn checkpoint(
        &mut self,
        dir: &Path,
        step: u64,
        keep: usize,
        events: &mut dyn FnMut(&Event),
    ) -> Result<PathBuf, TrainError> {
        let at = self.saver(dir, keep);
        let path = self.updater.checkpoint(&at, step, &mut self.st, events)?;
        // With ps tasks, the checkpoint pulled the step's parameters.
        self.stale = false;
        Ok(path)
    }

    fn sum(&mut self, values: &mut [f64]) -> Result<(), TrainError> {
        crate::train::engine::sum_over(self.group, values)
    }

    /// Every replica task: replica 0's stages run the samples through, and its last
    /// stage's counts are summed to all.
    fn evaluation_ranks(&self) -> (usize, usize) {
        self.ranks()
    }

    fn evaluate(&mut self, data: &Dataset) -> Result<(usize, usize), TrainError> {
        self.fresh()?;
        let counted = match self.place.replica {
            0 => report::evaluate(&mut self.st, &mut self.link, data)?,
            _ => None,
        };
        let mut counts = counted.map_or([0.0; 2], |(c, t)| [c as f64, t as f64]);
        self.sum(&mut counts)?;
        Ok((counts[0] as usize, counts[1] as usize))
    }

    /// Replica 0's stages send their parameters to its last stage, which writes the
    /// whole model.
    fn save_params(&mut self, path: &Path, step: u64) -> Result<(), TrainError> {
        self.fresh()?;
        if self.place.replica == 0 {
            save::save_params(&self.st, &mut self.link, self.model, path, step)?;
        }
        Ok(())
    }

    fn window(
        &mut self,
        step: u64,
        clock: &mut Clock,
    ) -> Result<(Times, Vec<RankTimes>), TrainError> {
        let window = crate::train::allreduce::window_times;
        Ok(window(self.group, self.layout, self.rank, clock, step)?)
    }

    /// With ps tasks: the final parameters pulled, and the ps told this task is done (or
    /// stopped, or failed: they tell the stage's others).
    fn end(&mut self, how: End<'_>) -> Result<(), TrainError> {
        use crate::train::ps::worker::{abort, abort_agreed};
        let stop = match how {
            End::Done => None,
            End::Stopped(signal) => Some(signal),
            End::Failed(e) => {
                if let Some((sub, roles)) = self.ps_job {
                    match e.is_agreed() {
                        // Every replica task stops with it: the ps tasks end once all said so.
                        true => abort_agreed(sub, roles, &e.to_string()),
                        false => abort(sub, roles, &e.to_string()),
                    }
                }
                return Ok(());
            }
            End::Abandoned => {
                if let Some((sub, roles)) = self.ps_job {
                    abort(sub, roles, "a stage task ended its session unclosed");
                }
                return Ok(());
            }
        };
        Ok(self.updater.finish(&mut self.st, self.step, stop)?)
    }
}
