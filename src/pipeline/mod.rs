//! Model parallelism inside a replica: a model's layers split into stages (`--stages`).
//!
//! - [`partition`]: the layers of a model split into contiguous stages of balanced cost.
//! - [`schedule`]: the order of a stage's forward and backward passes over a step's
//!   micro-batches (GPipe, 1F1B), and the bubble they leave.
//! - [`stage`]: one stage's layers, parameters and activations in flight.
//!
//! The cluster mapping (jobs `replica_0`, ... of one task per stage) lives in
//! [`crate::cluster::mapping`].

pub mod partition;
pub mod schedule;
pub mod stage;

pub use partition::{balance, PartitionError};
pub use schedule::{Op, Schedule};
pub use stage::Stage;
