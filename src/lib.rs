//! mpiflow: TensorFlow-style ps/worker training clusters on MPI and Slurm.
//!
//! - [`cluster`]: ClusterSpec, TF_CONFIG, legacy flags, and the resolvers that turn an
//!   `mpirun`, Slurm or hostfile job into a cluster with one task per rank.
//! - [`transport`]: the MPI context and the data plane.
//! - [`kernels`]: BLAS (OpenBLAS through cblas), element-wise and convolution kernels.
//! - [`model`]: the model interface every mode trains through; layers, the MLP, the CNN.
//! - [`pipeline`]: a model's layers split into stages (model parallelism in a replica).
//! - [`topology`]: hwloc topology, pinning plans, BLAS threads per rank.
//! - [`train`]: data sets, optimizers, and the training modes (local, ps, allreduce).
//! - [`rng`]: the seeded generator behind every random choice.
//! - [`tensor`]: tensors with their wire header in their own buffer.
//! - [`observe`]: seeing a run: time by phase per rank, the metrics file, progress.
//! - [`signals`]: stop signals noted for the step loop.
//!
//! The `mpiflow` binary (`src/bin/mpiflow/`) is a thin command-line layer over these. Its
//! commands' own machinery is public for it but not part of the library's face (hidden
//! from these pages): `bench` (OSU-style benchmarks), `check` (the data plane verified on
//! a live job), `launch` (a task's identity exported and any program exec'd as that task),
//! `named` (the names users pick values by on the command line), `scale` (the scale
//! model), `supervise` (restarts), and in [`observe`] the plots, the OSU tables' reader and
//! the progress line.
//!
//! What a program needs is named at the crate root (and in [`prelude`]): the [`Server`]
//! every task starts, the [`Session`] a worker trains in and the [`Strategy`] behind each
//! mode, the [`Model`] interface with [`Sequential`] and its [`layers`](model::layers),
//! [`Dataset`], [`TrainConfig`], and one [`Error`].

mod error;

pub mod cluster;
pub mod kernels;
pub mod model;
pub mod observe;
pub mod pipeline;
pub mod rng;
pub mod signals;
pub mod tensor;
pub mod topology;
pub mod train;
pub mod transport;

// The command line's own (and the Python package's): public for them, not the library's
// face.
#[doc(hidden)]
pub mod bench;
#[doc(hidden)]
pub mod check;
#[doc(hidden)]
pub mod hash;
#[doc(hidden)]
pub mod launch;
#[doc(hidden)]
pub mod named;
#[doc(hidden)]
pub mod scale;
#[doc(hidden)]
pub mod supervise;

pub use cluster::MappingOptions;
pub use error::Error;
pub use model::layers::{Conv2d, Dense, Flatten, Layer, MaxPool2d, Relu, ShapeError};
pub use model::{External, Model, Replica, Sequential, Targets};
pub use pipeline::{PipelineConfig, PipelineError, Schedule};
pub use signals::catch_stop_signals;
pub use train::allreduce::{Allreduce, AllreduceConfig};
pub use train::data::{shard, Batches, Dataset};
pub use train::engine::{
    Evaluation, Hook, Local, Session, StepInfo, StepWord, Strategy, TrainError, Trained,
};
pub use train::events::Event;
pub use train::optim::{Decay, Optimizer, OptimizerKind};
pub use train::ps::{PsConfig, PsError};
pub use train::server::{Server, ServerError};
pub use train::{Stopped, TrainConfig};

/// The names a program on mpiflow uses: `use mpiflow::prelude::*;`.
pub mod prelude {
    pub use crate::{
        shard, Allreduce, AllreduceConfig, Batches, Conv2d, Dataset, Decay, Dense, Error, Event,
        External, Flatten, Layer, Local, MappingOptions, MaxPool2d, Model, Optimizer,
        OptimizerKind, PipelineConfig, PipelineError, PsConfig, PsError, Relu, Replica, Sequential,
        Server, ServerError, Session, ShapeError, StepInfo, Stopped, Strategy, Targets,
        TrainConfig, TrainError, Trained,
    };
}

/// Helpers shared by the unit tests.
#[cfg(test)]
pub(crate) mod test_support {
    use std::collections::BTreeMap;

    /// An environment of `pairs`, as the resolvers and the pre-init choices read it.
    pub(crate) fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}
