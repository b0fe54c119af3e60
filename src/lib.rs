//! mpiflow: TensorFlow-style ps/worker training clusters on MPI and Slurm.
//!
//! - [`cluster`]: ClusterSpec, TF_CONFIG, legacy flags, and the resolvers that turn an
//!   `mpirun`, Slurm or hostfile job into a cluster with one task per rank.
//! - [`transport`]: the MPI context and the data plane.
//! - [`tensor`]: tensors with their wire header in their own buffer.
//! - [`check`]: `mpiflow check`, the data plane verified on a live job.
//! - [`bench`]: OSU-style benchmarks, OSU 7.4's output format.
//! - [`launch`]: exporting a task's identity and exec'ing any program as that task.
//!
//! The `mpiflow` binary (`src/main.rs`) is a thin command-line layer over these.

pub mod bench;
pub mod check;
pub mod cluster;
pub mod launch;
pub mod tensor;
pub mod transport;
