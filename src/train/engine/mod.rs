//! The training engine: one step loop for every mode, and the strategies that make the
//! modes.
//!
//! A [`Session`] owns what every mode shares: the stop agreement (signals, hooks, the last
//! step), phase timing and the log window, the checkpoint schedule and its writing (kept
//! to the newest few), evaluation on held-out data, the non-finite guard, the user's
//! hooks. A [`Strategy`] says only what makes its mode: how a step's gradients become the
//! update (summed by allreduce, applied in place, pushed to parameter servers), how the
//! ranks that train together agree on each step's [`StepWord`], and what a checkpoint
//! holds. A new mode is one file that implements [`Strategy`], and a program can bring its
//! own (`tests/` train a local-SGD strategy through this loop).
//!
//! ```no_run
//! use mpiflow::train::engine::{Session, Local};
//! use mpiflow::train::{data::Dataset, TrainConfig};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (train, test) = Dataset::load_split("digits", 1)?;
//! let model = mpiflow::model::mlp(64, &[128], 10)?;
//! let cfg = TrainConfig { steps: 500, ..TrainConfig::default() };
//! let mut sess = Session::new(Local::new(&model, &cfg)?, &cfg)?.evaluate_every(100, &test);
//! let mut batches = mpiflow::train::data::Batches::new(train.len(), cfg.batch, cfg.seed);
//! while !sess.should_stop() {
//!     let (x, y) = train.rows(&batches.global(sess.global_step()));
//!     sess.run(&x, &y)?;
//! }
//! let trained = sess.close()?;
//! println!("{} steps, {:?}", trained.step, trained.evaluation);
//! # Ok(()) }
//! ```

mod error;
mod hooks;
pub(crate) mod local;
mod session;
mod word;

pub use error::TrainError;
pub use hooks::{Hook, StepInfo};
pub use local::Local;
pub use session::{Evaluation, Session, Trained};
pub use word::StepWord;

use std::path::{Path, PathBuf};

use crate::model::{Replica, Targets};
use crate::observe::phases::{Clock, RankTimes, Times};
use crate::observe::timeline::{self, Detail};
use crate::tensor::Tensor;
use crate::train::checkpoint::{self, State};
use crate::train::data::Dataset;
use crate::train::events::Event;
use crate::transport::{Collectives, Comm};

/// Where a rank starts: the global step, and the step of the checkpoint it was restored
/// from (the newest on disk), if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Started {
    pub step: u64,
    pub restored: Option<u64>,
}

/// How training ended on a rank, told to its strategy ([`Strategy::end`]) once.
#[derive(Debug)]
pub enum End<'a> {
    /// The session closed.
    Done,
    /// Every rank stops after this step, asked by this signal.
    Stopped(i32),
    /// A step or the start failed with this error.
    Failed(&'a TrainError),
    /// The session was dropped without being closed (an early return, a panic).
    Abandoned,
}

/// A training mode: how a step's gradients become the update, among the ranks that train
/// together. The [`Session`] calls [`Strategy::start`] once, then each step
/// [`Strategy::gradients`], (the guard passed) [`Strategy::apply`] and
/// [`Strategy::after_step`], and [`Strategy::end`] once when training ends.
pub trait Strategy<'m> {
    /// The ranks that train together and this rank's place among them; place 0 is the
    /// chief, which writes checkpoints and reports.
    fn ranks(&self) -> (usize, usize);

    /// True on the rank that reports (logs, evaluations, checkpoint events): by default
    /// the chief.
    fn reports(&self) -> bool {
        self.ranks().1 == 0
    }

    /// The shares each global batch is cut into and this rank's ([`crate::train::fit`]):
    /// by default one per rank that trains together (a pipeline: one per replica, which
    /// all its stages take).
    fn data_shard(&self) -> (usize, usize) {
        self.ranks()
    }

    /// True if the ranks sum every step's word, so that a hook's request to stop rides in
    /// the next step's and every rank stops together; false where ranks step apart (the
    /// asynchronous ps), where a hook stops its own rank at once.
    fn agrees(&self) -> bool {
        true
    }

    /// This rank's copy of the parameters (after [`Strategy::apply`], the updated ones).
    fn replica(&self) -> &Replica<'m>;

    /// Takes the parameters out when the session closes.
    fn into_replica(self) -> Replica<'m>
    where
        Self: Sized;

    /// Sets every rank's starting point, from the newest valid checkpoint in `dir` if
    /// there is one (any mode's: [`restore`] reads it for the chief), else from the
    /// initial values; the same step on every rank.
    fn start(
        &mut self,
        dir: Option<&Path>,
        events: &mut dyn FnMut(&Event),
    ) -> Result<Started, TrainError>;

    /// Step `step` up to its update: this rank's gradients of `x`, `y` and their
    /// combination with the other ranks', with this rank's `word` (its loss added with
    /// [`StepWord::with_loss`]) summed over the ranks and returned. Charges `clock` with
    /// the step's compute and communication.
    fn gradients(
        &mut self,
        step: u64,
        x: &[f32],
        y: Targets<'_>,
        word: StepWord,
        clock: &mut Clock,
        events: &mut dyn FnMut(&Event),
    ) -> Result<StepWord, TrainError>;

    /// The gradients [`Strategy::apply`] will take, for the guard to check first (none
    /// where the mode checked them itself).
    fn pending(&self) -> &[Tensor];

    /// Applies step `step`'s update; returns the global step after it (`step + 1` where
    /// each step is one update).
    fn apply(&mut self, step: u64) -> Result<u64, TrainError>;

    /// After the update, `done` steps in all: checks the mode makes (replicas compared).
    fn after_step(&mut self, done: u64) -> Result<(), TrainError> {
        let _ = done;
        Ok(())
    }

    /// What a checkpoint of `step` holds (the chief's, for [`Strategy::checkpoint`]).
    fn state(&mut self, step: u64) -> Result<State, TrainError>;

    /// The checkpoint of `step` into `dir` (every rank calls it; by default the chief
    /// writes [`Strategy::state`] as one file), the newest `keep` kept; returns its path,
    /// the same on every rank. The chief reports it.
    fn checkpoint(
        &mut self,
        dir: &Path,
        step: u64,
        keep: usize,
        events: &mut dyn FnMut(&Event),
    ) -> Result<PathBuf, TrainError> {
        if !self.reports() {
            return Ok(checkpoint::path_of(dir, step));
        }
        let t = std::time::Instant::now();
        let replica = self.replica();
        let (describe, vars) = (replica.model.describe(), replica.variables());
        let path = self.state(step)?.write(dir, &describe, &vars)?;
        checkpoint::retain(dir, keep);
        let written = Event::Checkpoint {
            path: path.clone(),
            step,
        };
        checkpointed(step, t, &written, events);
        Ok(path)
    }

    /// Sums `values` over the ranks that evaluate together (an evaluation's counts).
    fn sum(&mut self, values: &mut [f64]) -> Result<(), TrainError>;

    /// The ranks that evaluate together (each its share of the samples) and this rank's
    /// place: by default those that train together.
    fn evaluation_ranks(&self) -> (usize, usize) {
        self.ranks()
    }

    /// The samples of `data` the current parameters classify correctly, and how many were
    /// evaluated, over the ranks that evaluate together: the same on each. By default each
    /// takes its share ([`Strategy::evaluation_ranks`], a contiguous run of rows, read in
    /// place) and the counts are summed ([`Strategy::sum`]).
    fn evaluate(&mut self, data: &Dataset) -> Result<(usize, usize), TrainError> {
        let (n, i) = self.evaluation_ranks();
        let rows = i * data.len() / n..(i + 1) * data.len() / n;
        let f = data.features;
        let (x, y) = (&data.x[rows.start * f..rows.end * f], &data.y[rows]);
        let accuracy = self.replica().accuracy(x, y)?;
        let mut counts = [(accuracy * y.len() as f64).round(), y.len() as f64];
        self.sum(&mut counts)?;
        Ok((counts[0] as usize, counts[1] as usize))
    }

    /// Writes the trained parameters to `path` (the checkpoint file format; every rank
    /// calls it): by default the chief writes its copy.
    fn save_params(&mut self, path: &Path, step: u64) -> Result<(), TrainError> {
        if self.reports() {
            crate::train::save_params(self.replica(), path, step)?;
        }
        Ok(())
    }

    /// The log window closing after `step`: this rank's times (taken from `clock`, or as
    /// the mode kept them) and every rank's the chief reports.
    fn window(
        &mut self,
        step: u64,
        clock: &mut Clock,
    ) -> Result<(Times, Vec<RankTimes>), TrainError>;

    /// True if a step communicates (the log line then gives the share of it).
    fn communicates(&self) -> bool {
        true
    }

    /// The loss the log reports for the last step, where it is not the step's word's (the
    /// ps: that of the update the parameters came from).
    fn reported_loss(&self) -> Option<f32> {
        None
    }

    /// Training ended on this rank (`how`): what the mode owes its peers (the ps tasks
    /// are told). Called once.
    fn end(&mut self, how: End<'_>) -> Result<(), TrainError> {
        let _ = how;
        Ok(())
    }
}

/// Sums `values` over the ranks of `coll`: an evaluation's counts ([`Strategy::sum`]).
pub fn sum_over<C: Comm>(coll: &Collectives<C>, values: &mut [f64]) -> Result<(), TrainError> {
    if coll.size() < 2 {
        return Ok(());
    }
    let mut t = crate::tensor::Tensor::from_slice(&[values.len()], values)?;
    let (sum, algorithm) = (
        crate::transport::ReduceOp::Sum,
        crate::transport::Algorithm::Auto,
    );
    coll.allreduce_tensor(&mut t, sum, algorithm)?;
    values.copy_from_slice(t.as_slice::<f64>()?);
    Ok(())
}

/// Reports checkpoint `step`, begun at `t` and `written` (its event): the timeline's
/// span and the event, as every mode's chief does.
pub fn checkpointed(
    step: u64,
    t: std::time::Instant,
    written: &Event,
    events: &mut dyn FnMut(&Event),
) {
    let now = std::time::Instant::now();
    timeline::span("checkpoint", "other", t, now, Detail::at(step));
    events(written);
}

/// The newest valid checkpoint in `dir` (created if missing) for `replica`'s variables,
/// read by the chief (`None` elsewhere, and where there is none): what
/// [`Strategy::start`] restores in the modes that hold the whole state on each rank.
pub fn restore(
    dir: Option<&Path>,
    chief: bool,
    replica: &Replica<'_>,
    events: &mut dyn FnMut(&Event),
) -> Result<Option<State>, TrainError> {
    match (dir, chief) {
        (Some(dir), true) => Ok(checkpoint::state::restore(
            dir,
            &replica.variables(),
            events,
        )?),
        _ => Ok(None),
    }
}
