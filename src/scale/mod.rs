//! A scale model of a training step across hosts.
//!
//! Each link class (shared memory within a host, the network between hosts one way, and
//! both ways at once) costs a message of `m` bytes `latency + m × per_byte` (Hockney's
//! model, [`link`]), fitted to measured latencies and bidirectional bandwidths. On hosts running workers and ps tasks, [`cost`] gives the
//! time of an allreduce (ring, recursive doubling, Rabenseifner, the flat ring and the
//! hierarchical algorithm, with the adds of the reduction) and of a synchronous
//! parameter-server step (ports, messages, the ps's update). [`workload`] measures a
//! model's step on one worker's batch without communication; [`predict`] puts both
//! together into a step and weak-scaling efficiency from 2 to any number of hosts;
//! [`run`] reads a measured run (`mpiflow train --metrics`) to check a prediction against.
//! `mpiflow scale` is the command; what it was fitted to and checked against lives in
//! `benches/results/`.
//!
//! The model leaves out what it cannot know from these inputs: overlap of communication
//! with the backward pass, stragglers, congestion beyond one port per host, and the
//! network's topology (every pair of hosts is one hop).

pub mod cost;
pub mod link;
pub mod predict;
pub mod run;
pub mod workload;

pub use cost::{Cluster, HostTasks, Links, PsStep, Update};
pub use link::{exchange_rows, latency_rows, FitError, Link};
pub use predict::{weak_scaling, Mode, Row, Step};
pub use run::{Run, RunError};
pub use workload::Workload;

/// Links the unit tests share: about the namespace cluster's 10 Gbit/s network and a
/// host's shared memory.
#[cfg(test)]
mod fixtures {
    use super::Link;

    pub const NET: Link = Link {
        latency: 6e-6,
        per_byte: 1.0 / 1.19e9,
    };
    pub const SHM: Link = Link {
        latency: 0.4e-6,
        per_byte: 1.0 / 10e9,
    };
}
