//! How a stage's gradients become its next parameters: summed over the replicas' tasks of
//! the stage by allreduce and applied by each task (`Updater::Allreduce`), or pushed to
//! the ps tasks holding the stage's variables and pulled back (`Updater::Ps`). The
//! pipeline's step loop is the same for both.

use std::path::PathBuf;

use super::ps::StageClient;
use super::save::{self, Saver};
use super::stage::Stage;
use super::train::PipelineError;
use crate::tensor::Tensor;
use crate::train::events::Event;
use crate::train::optim::{Optimizer, Slots};
use crate::transport::fusion::Fusion;
use crate::transport::{Collectives, Comm, ReduceOp};

/// A stage's update rule.
pub(crate) enum Updater<'a, C: Comm> {
    /// The replicas' stage tasks sum their gradients on `peers`; each applies the optimizer.
    Allreduce {
        peers: Box<Collectives<C>>,
        fusion: Fusion,
        opt: Optimizer,
        slots: Vec<Slots>,
    },
    /// The stage's ps job holds the variables and the optimizer state.
    Ps { client: StageClient<'a, C> },
}

impl<C: Comm> Updater<'_, C> {
    /// Restores the newest checkpoint in `at.dir`, or starts from `st`'s initial values;
    /// returns the step training starts at.
    pub(crate) fn start(
        &mut self,
        at: Option<&Saver<'_, C>>,
        st: &mut Stage<'_>,
        chief: bool,
        events: &mut dyn FnMut(&Event),
    ) -> Result<u64, PipelineError> {
        match self {
            Updater::Allreduce { opt, slots, .. } => match at {
                Some(at) => Ok(save::restore(at, st, slots, opt, events)?.unwrap_or(0)),
                None => Ok(0),
            },
            Updater::Ps { client } => {
                let found = match at {
                    Some(at) => save::newest(at, events)?,
                    None => None,
                };
                if chief {
                    client.start(
                        found.as_ref().map(|(path, _)| path.as_path()),
                        &st.replica.params,
                    )?;
                    if let (Some((path, step)), true) = (found, st.is_last()) {
                        events(&Event::Restored { path, step });
                    }
                }
                Ok(client.pull(0, &mut st.replica.params)?.0)
            }
        }
    }

    /// Before step `step`'s passes: the ps's parameters of that step; returns the stop
    /// signal a ps task announces (it was sent one), for the step's word.
    pub(crate) fn begin(
        &mut self,
        step: u64,
        st: &mut Stage<'_>,
    ) -> Result<Option<i32>, PipelineError> {
        match self {
            Updater::Ps { client } => Ok(client.pull(step, &mut st.replica.params)?.1),
            Updater::Allreduce { .. } => Ok(None),
        }
    }

    /// The stage's gradient sums over this replica's `samples` become what the update
    /// takes: the global batch's mean (`total` samples) by allreduce, or this replica's mean
    /// for the ps (which weights replicas by their samples).
    pub(crate) fn reduce(
        &mut self,
        st: &mut Stage<'_>,
        samples: usize,
        total: usize,
    ) -> Result<(), PipelineError> {
        let divide = match self {
            Updater::Allreduce { peers, fusion, .. } => {
                if peers.size() > 1 {
                    let mut refs: Vec<&mut Tensor> = st.grads.iter_mut().collect();
                    fusion.allreduce(peers, &mut refs, ReduceOp::Sum)?;
                }
                total
            }
            Updater::Ps { .. } => samples,
        };
        let d = divide.max(1) as f32;
        for g in &mut st.grads {
            let g = g.as_mut_slice::<f32>().expect("f32");
            g.iter_mut().for_each(|v| *v /= d);
        }
        Ok(())
    }

    /// Applies the agreed step: the optimizer on this task's parameters, or the push of
    /// the stage's gradients (`loss`: the replica's, known on its last stage).
    pub(crate) fn apply(
        &mut self,
        st: &mut Stage<'_>,
        step: u64,
        samples: usize,
        loss: f32,
    ) -> Result<(), PipelineError> {
        match self {
            Updater::Allreduce { opt, slots, .. } => {
                for ((p, g), s) in st.replica.params.iter_mut().zip(&st.grads).zip(slots) {
                    let g = g.as_slice::<f32>().expect("f32");
                    opt.apply(p.as_mut_slice::<f32>().expect("f32"), g, s);
                }
                Ok(())
            }
            Updater::Ps { client } => client.push(step, samples, loss, &mut st.grads),
        }
    }

    /// The replicas' stage tasks compare their parameters (allreduce only: the ps keeps
    /// one copy).
    pub(crate) fn compare(&self, st: &Stage<'_>, step: u64) -> Result<(), PipelineError> {
        let Updater::Allreduce { peers, .. } = self else {
            return Ok(());
        };
        if peers.size() < 2 {
            return Ok(());
        }
        let sum = st.replica.params.iter().fold(0u64, |h, p| {
            crate::train::checkpoint::checksum(p.bytes()) ^ h.rotate_left(7)
        });
        let sums = {
            let _wait = crate::train::allreduce::gathering(step, "parameter checksums", 8);
            peers.allgather_varlen(&sum.to_le_bytes())?
        };
        match sums.iter().position(|s| *s != sums[0]) {
            Some(replica) => Err(PipelineError::Diverged {
                step,
                stage: st.index(),
                replica,
            }),
            None => Ok(()),
        }
    }

    /// The checkpoint of `step` (after its update): every replica task takes part.
    pub(crate) fn checkpoint(
        &mut self,
        at: &Saver<'_, C>,
        step: u64,
        st: &mut Stage<'_>,
        events: &mut dyn FnMut(&Event),
    ) -> Result<PathBuf, PipelineError> {
        match self {
            Updater::Allreduce { slots, .. } => save::write(at, step, st, slots, events),
            Updater::Ps { client } => {
                // The ps tasks have applied `step` updates once this pull returns.
                client.pull(step, &mut st.replica.params)?;
                let last = st.is_last();
                save::write_with(at, step, last, events, |staging| client.save(staging))
            }
        }
    }

    /// After the last step (`step`): the final parameters into `st`, and the ps told this
    /// task is done (`stop`: stopped by that signal).
    pub(crate) fn finish(
        &mut self,
        st: &mut Stage<'_>,
        step: u64,
        stop: Option<i32>,
    ) -> Result<(), PipelineError> {
        if let Updater::Ps { client } = self {
            client.pull(step, &mut st.replica.params)?;
            client.done(stop)?;
        }
        Ok(())
    }

    /// Bytes of optimizer state this task holds (none with a ps).
    pub(crate) fn state_bytes(&self) -> usize {
        match self {
            Updater::Allreduce { slots, .. } => {
                slots.iter().map(|s| 4 * (s.m.len() + s.v.len())).sum()
            }
            Updater::Ps { .. } => 0,
        }
    }
}
