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

use crate::model::Replica;
use crate::observe::phases::{Clock, RankTimes, Times};
use crate::tensor::Tensor;
use crate::train::checkpoint::State;
use crate::train::events::Event;

/// A training mode: how a step's gradients become the update, among the ranks that train
/// together. The [`Session`] calls, each step: [`Strategy::gradients`], then (the guard
/// passed) [`Strategy::apply`], then [`Strategy::after_step`].
pub trait Strategy<'m> {
    /// The ranks that train together and this rank's place among them; place 0 is the
    /// chief, which writes checkpoints and reports.
    fn ranks(&self) -> (usize, usize);

    /// This rank's copy of the parameters (after [`Strategy::apply`], the updated ones).
    fn replica(&self) -> &Replica<'m>;

    /// Takes the parameters out when the session closes.
    fn into_replica(self) -> Replica<'m>
    where
        Self: Sized;

    /// Sets every rank's starting point: `restored` is the chief's newest valid checkpoint
    /// (`None` on the other ranks, or where there is none). Returns the step training
    /// starts at, the same on every rank.
    fn start(
        &mut self,
        restored: Option<State>,
        events: &mut dyn FnMut(&Event),
    ) -> Result<u64, TrainError>;

    /// Step `step` up to its update: this rank's gradients of `x`, `y` and their
    /// combination with the other ranks', with this rank's `word` (its loss added with
    /// [`StepWord::with_loss`]) summed over the ranks and returned. Charges `clock` with
    /// the step's compute and communication.
    fn gradients(
        &mut self,
        step: u64,
        x: &[f32],
        y: &[u8],
        word: StepWord,
        clock: &mut Clock,
        events: &mut dyn FnMut(&Event),
    ) -> Result<StepWord, TrainError>;

    /// The gradients [`Strategy::apply`] will take, for the guard to check first.
    fn pending(&self) -> &[Tensor];

    /// Applies step `step`'s update.
    fn apply(&mut self, step: u64) -> Result<(), TrainError>;

    /// After the update, `done` steps in all: checks the mode makes (replicas compared).
    fn after_step(&mut self, done: u64) -> Result<(), TrainError> {
        let _ = done;
        Ok(())
    }

    /// What a checkpoint of `step` holds (asked of the chief).
    fn state(&mut self, step: u64) -> Result<State, TrainError>;

    /// Sums `values` over the ranks (an evaluation's counts), in place.
    fn sum(&mut self, values: &mut [f64]) -> Result<(), TrainError>;

    /// Every rank's times of the log window closing after `step` (this rank's: `mine`).
    fn window(&mut self, step: u64, mine: Times) -> Result<Vec<RankTimes>, TrainError>;

    /// True if a step communicates (the log line then gives the share of it).
    fn communicates(&self) -> bool {
        true
    }
}
