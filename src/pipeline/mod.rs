//! Model parallelism inside a replica: a model's layers split into stages (`--stages`).
//!
//! - [`partition`]: the layers of a model split into contiguous stages of balanced cost.
//! - `schedule`: the order of a stage's forward and backward passes over a step's
//!   micro-batches (GPipe, 1F1B), and the bubble they leave.
//! - `stage`: one stage's layers, parameters and activations in flight.
//! - `link`: activations and gradients between consecutive stages.
//! - `passes`: one step's passes through a stage, in the schedule's order.
//! - [`train`]: pipeline training over replicas of S stages.
//! - `save`: checkpoints in per-stage shards, and the final parameters.
//! - `update`: a stage's update, by allreduce or by the ps tasks ([`ps`]).
//! - `report`: the partition, each stage's memory, the held-out accuracy.
//!
//! The cluster mapping (jobs `replica_0`, ... of one task per stage) lives in
//! [`crate::cluster::mapping`].
//!
//! A model of your own trains in stages with no pipeline code: build it as a
//! [`Sequential`](crate::model::Sequential) of layers (yours implement
//! [`Layer`](crate::model::layers::Layer)) and hand it to [`train::run`] on every rank.
//! Here two replicas of two stages, as threads of one process (the same code runs under
//! `mpirun` with an `MpiComm`):
//! ```
//! use mpiflow::cluster::{Layout, MappingOptions};
//! use mpiflow::model::layers::{Dense, Layer, Relu};
//! use mpiflow::model::Sequential;
//! use mpiflow::pipeline::{train, PipelineConfig, Schedule};
//! use mpiflow::train::{data::Dataset, TrainConfig};
//! use mpiflow::transport::local::LocalComm;
//!
//! let layers: Vec<Box<dyn Layer>> = vec![
//!     Box::new(Dense { units: 32 }),
//!     Box::new(Relu),
//!     Box::new(Dense { units: 3 }),
//! ];
//! let model = Sequential::new("mine", &[8], layers).unwrap();
//! let data = Dataset::synthetic(600, 8, 3, 1);
//! let (train_set, test_set) = data.split_holdout(1);
//! let opts = MappingOptions { stages: Some(2), ..MappingOptions::default() };
//! let layout = Layout::single_host(4, &opts).unwrap(); // replica_0:0..1, replica_1:0..1
//! let cfg = PipelineConfig {
//!     train: TrainConfig { steps: 200, batch: 32, log_every: 0, ..TrainConfig::default() },
//!     micro_batches: 4,
//!     schedule: Schedule::OneFOneB,
//!     ..PipelineConfig::default()
//! };
//! let said = LocalComm::run(4, |comm| {
//!     let mut lines = Vec::new();
//!     train::run(&comm, &layout, &model, &cfg, &train_set, &test_set, &mut |e| {
//!         lines.push(e.to_string())
//!     })
//!     .map(|()| lines)
//! });
//! // Replica 0's last stage reports the partition and the held-out accuracy.
//! let lines: Vec<String> = said.into_iter().flat_map(Result::unwrap).collect();
//! assert!(lines.iter().any(|l| l.starts_with("# pipeline: 2 replicas x 2 stages")));
//! let accuracy: f64 = lines
//!     .iter()
//!     .find_map(|l| l.strip_prefix("accuracy "))
//!     .and_then(|l| l.split(' ').next()?.parse().ok())
//!     .unwrap();
//! assert!(accuracy > 0.9, "{accuracy}");
//! ```

pub(crate) mod link;
pub mod partition;
pub(crate) mod passes;
pub mod ps;
pub(crate) mod report;
pub(crate) mod save;
pub(crate) mod schedule;
pub(crate) mod stage;
mod stages;
pub mod train;
pub(crate) mod update;

pub use partition::{balance, Balance, PartitionError};
pub use schedule::{Op, Schedule};
pub use stage::Stage;
pub use stages::Stages;
pub use train::{PipelineConfig, PipelineError, StagesSession};

#[cfg(test)]
mod tests;
