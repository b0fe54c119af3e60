//! Model parallelism inside a replica: a model's layers split into stages (`--stages`).
//!
//! - [`partition`]: the layers of a model split into contiguous stages of balanced cost.
//! - [`schedule`]: the order of a stage's forward and backward passes over a step's
//!   micro-batches (GPipe, 1F1B), and the bubble they leave.
//! - [`stage`]: one stage's layers, parameters and activations in flight.
//! - [`link`]: activations and gradients between consecutive stages.
//! - [`passes`]: one step's passes through a stage, in the schedule's order.
//! - [`train`]: pipeline training over replicas of S stages.
//! - [`save`]: checkpoints in per-stage shards, and the final parameters.
//! - [`update`]: a stage's update, by allreduce or by the ps tasks ([`ps`]).
//! - [`report`]: the partition, each stage's memory, the held-out accuracy.
//!
//! The cluster mapping (jobs `replica_0`, ... of one task per stage) lives in
//! [`crate::cluster::mapping`].

pub mod link;
pub mod partition;
pub mod passes;
pub mod ps;
pub mod report;
pub mod save;
pub mod schedule;
pub mod stage;
pub mod train;
pub mod update;

pub use partition::{balance, Balance, PartitionError};
pub use schedule::{Op, Schedule};
pub use stage::Stage;
pub use train::{PipelineConfig, PipelineError};

#[cfg(test)]
mod tests;
