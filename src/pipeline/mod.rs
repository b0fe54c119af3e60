//! Model parallelism inside a replica: a model's layers split into stages (`--stages`).
//!
//! - [`partition`]: the layers of a model split into contiguous stages of balanced cost.
//!
//! The cluster mapping (jobs `replica_0`, ... of one task per stage) lives in
//! [`crate::cluster::mapping`]; the pipeline that trains on it is not built yet.

pub mod partition;

pub use partition::{balance, PartitionError};
