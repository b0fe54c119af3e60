//! The cluster: who is who, and where.
//!
//! - `spec`: `ClusterSpec`, `TaskId`, roles, with TensorFlow's semantics.
//! - `tf_config` and [`flags`]: the two ways TensorFlow programs learn their role.
//! - [`hostlist`], [`hostfile`], [`slurm`]: the formats HPC schedulers describe jobs in.
//! - [`launched`]: the job as its MPI launcher's variables tell it, before any `MPI_Init`.
//! - [`mapping`]: rank-to-role policies and the resulting [`mapping::Layout`].
//! - [`peers`]: tensors to and from tasks (`worker:1`) instead of ranks.
//! - `ports`: free ports, found by binding them.
//! - [`resolve`]: putting it together for MPI, Slurm, hostfile previews, TF_CONFIG and flags.

pub mod flags;
pub mod hostfile;
pub mod hostlist;
pub mod launched;
pub mod mapping;
pub mod peers;
pub(crate) mod ports;
pub mod resolve;
pub mod slurm;
pub(crate) mod spec;
pub(crate) mod tf_config;

pub use mapping::{Layout, MappingOptions, Placement, RankInfo};
pub use resolve::{Request, ResolveError, Resolved, Source};
pub use spec::{replica_job, Address, ClusterSpec, Role, TaskId};
pub use tf_config::TfConfig;
