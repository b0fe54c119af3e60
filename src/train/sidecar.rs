//! Side-car evaluation: what TensorFlow's `evaluator` task does. It takes no part in
//! training; it evaluates each checkpoint the chief commits, on the held-out samples,
//! while the others train, and ends once the chief says training ended (after evaluating
//! the newest checkpoint then, normally the last step's).
//!
//! Every mode runs it the same way: the evaluator rank calls [`evaluate`] where the mode
//! leaves it idle (through [`take_part`]; a program of its own, through
//! `Server::evaluate`), and the chief holds an [`EndNotice`] from the start of its part
//! (a ps worker's `MonitoredSession` holds it), whose drop (training done, stopped, or
//! failed: every way out) tells every evaluator. Without a checkpoint directory there is
//! nothing to evaluate: neither side does anything.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::cluster::Layout;
use crate::model::{Model, Replica};
use crate::train::checkpoint::{self, State};
use crate::train::data::Dataset;
use crate::train::events::Event;
use crate::transport::comm::{self, Comm, ANY_SOURCE};

/// How often the evaluator looks for a newer checkpoint.
const POLL: Duration = Duration::from_millis(200);

/// The world ranks of `layout`'s evaluator tasks.
pub fn evaluators(layout: &Layout) -> Vec<usize> {
    (0..layout.ranks.len())
        .filter(|r| layout.ranks[*r].task.is_evaluator())
        .collect()
}

/// Held by the chief while it trains, if there are evaluators and checkpoints: dropped,
/// it tells every evaluator that training ended.
pub struct EndNotice<'c, C: Comm> {
    comm: &'c C,
    to: Vec<usize>,
}

impl<'c, C: Comm> EndNotice<'c, C> {
    /// The notice for the evaluators at ranks `to` ([`evaluators`]), held by the rank that
    /// is the `chief`; `None` elsewhere, and without evaluators or a checkpoint directory
    /// (`dir`).
    pub fn by(chief: bool, comm: &'c C, to: Vec<usize>, dir: Option<&Path>) -> Option<Self> {
        // Made only when held: a notice made and dropped sends.
        (chief && dir.is_some() && !to.is_empty()).then(|| EndNotice { comm, to })
    }
}

impl<C: Comm> Drop for EndNotice<'_, C> {
    fn drop(&mut self) {
        let tag = self.comm.tags().kept(crate::train::tags::SIDECAR);
        for r in &self.to {
            // A few bytes: sent eagerly, whether or not the evaluator receives yet. A
            // failure here is the job's end anyway (a dead evaluator ends it).
            let _ = comm::send(self.comm, b"end", *r, tag);
        }
    }
}

/// Why an evaluator stopped (a checkpoint that does not verify is only a warning).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SidecarError {
    #[error("{0}")]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error("{0}")]
    Model(#[from] crate::model::ModelError),
    #[error("{0}")]
    Transport(#[from] crate::transport::comm::TransportError),
}

/// This rank's part where a mode leaves it out of training: if it is an evaluator, a
/// side-car evaluation of the checkpoints in `dir` ([`evaluate`]), or without `dir` a
/// warning that it has nothing to evaluate; `Ok(true)` then. `Ok(false)`: not an
/// evaluator (the mode says why it is idle).
pub fn take_part<C: Comm>(
    comm: &C,
    layout: &Layout,
    model: &dyn Model,
    test: &Dataset,
    dir: Option<&Path>,
    events: &mut dyn FnMut(&Event),
) -> Result<bool, SidecarError> {
    let me = comm.rank();
    if !layout.ranks[me].task.is_evaluator() {
        return Ok(false);
    }
    let task = format!("{} (rank {me})", layout.ranks[me].task);
    match dir {
        Some(dir) => evaluate(comm, &task, model, test, dir, events)?,
        None => events(&Event::Warning(format!(
            "{task}: an evaluator evaluates the chief's checkpoints, and without --checkpoint-dir there are none; idle"
        ))),
    }
    Ok(true)
}

/// The evaluator's part: evaluates `model` on `test` with the parameters of each newer
/// checkpoint committed in `dir` (the one found at the start too), reporting each as an
/// [`Event::Evaluated`], until the chief's [`EndNotice`] comes; then the newest once more
/// if it is newer, and returns. A checkpoint that does not verify or does not fit the
/// model is a warning (the next may) naming this rank's `task`.
pub fn evaluate<C: Comm>(
    comm: &C,
    task: &str,
    model: &dyn Model,
    test: &Dataset,
    dir: &Path,
    events: &mut dyn FnMut(&Event),
) -> Result<(), SidecarError> {
    let mut replica = Replica::new(model, 0);
    let vars = replica.variables();
    let tag = comm.tags().kept(crate::train::tags::SIDECAR);
    let mut last: Option<u64> = None;
    let mut warned: Vec<PathBuf> = Vec::new();
    loop {
        // Whether training ended is read before the directory: the checkpoint that came
        // before the notice is then always seen.
        let ended = comm.try_receive(ANY_SOURCE, tag, POLL)?.is_some();
        let started = Instant::now();
        let newer = checkpoint::listed(dir).into_iter();
        for (step, path) in newer.filter(|(s, _)| last.is_none_or(|l| *s > l)) {
            match State::open(&path, &vars) {
                Ok(state) => {
                    load(&mut replica, &state);
                    let accuracy = replica.accuracy(&test.x, &test.y)?;
                    events(&Event::Evaluated {
                        path,
                        step,
                        accuracy,
                        correct: (accuracy * test.len() as f64).round() as usize,
                        total: test.len(),
                    });
                    last = Some(step);
                    break;
                }
                Err(e) if !warned.contains(&path) => {
                    warned.push(path);
                    events(&Event::Warning(format!("{task}: {e}; not evaluated")));
                }
                Err(_) => {}
            }
        }
        if ended {
            return Ok(());
        }
        std::thread::sleep(POLL.saturating_sub(started.elapsed()));
    }
}

/// Puts a checkpoint's parameters into `replica` (they fit: [`State::open`] checked the
/// variables).
fn load(replica: &mut Replica<'_>, state: &State) {
    for (p, v) in replica.params.iter_mut().zip(&state.vars) {
        p.as_mut_slice::<f32>()
            .expect("f32")
            .copy_from_slice(&v.param);
    }
}
