//! Parameter-server training (`mpiflow train --mode ps`).
//!
//! ps tasks hold the variables (placed by a [`placement::DeviceSetter`]) and apply the
//! optimizer; workers pull parameters, compute gradients on their shard of each global
//! batch, and push them. The chief (`chief:0`, else `worker:0`) initialises or restores
//! the variables, writes checkpoints and logs.
//!
//! - [`protocol`]: the typed requests and replies, and their framing.
//! - `wire`: sends and receives with deadlines.
//! - `server`: a ps task's server (what `Server::join` runs).
//! - `worker`: a worker's client of the ps tasks.
//! - `session`: the monitored session workers train in (chief init/restore, hooks).
//! - [`rma`]: the same training over one-sided MPI windows.
//! - `shards`: the checkpoint both transports write: one file per ps and a manifest.
//!
//! Semantics (TensorFlow's `SyncReplicasOptimizer`, plus):
//! - sync: a step's update is applied when `replicas_to_aggregate` fresh gradients have
//!   arrived, averaged weighted by each worker's sample count (so the update equals the
//!   gradient of the combined batch) and summed in worker order (so it is reproducible);
//!   late gradients of a finished step are dropped as stale (the other workers are
//!   backups); `global_step` counts updates; pulls for step `s` wait until
//!   `global_step >= s`.
//! - async: each push is applied as it arrives; pulls return the latest values.
//! - Failure: every wait has a deadline. A ps that stops hearing from a worker it needs
//!   tells every worker and stops, naming the lost task; a worker whose ps does not answer
//!   stops naming that ps; a worker that stops with an error (a non-finite loss, a model
//!   error) tells the ps tasks, which tell every other worker. (Run OpenMPI with
//!   `--mca orte_enable_recovery 1` to let mpiflow report a dead process; by default
//!   mpirun ends the whole job at once itself.)
//! - Bad requests (unknown variable, wrong length) are answered with an error to that
//!   worker; the ps keeps serving the others.

pub mod placement;
pub mod protocol;
pub mod rma;
pub(crate) mod roles;
mod rows;
pub(crate) mod server;
pub(crate) mod session;
pub(crate) mod shards;
mod store;
pub(crate) mod wire;
pub(crate) mod worker;

use std::time::Duration;

use self::placement::{DeviceSetter, Strategy};
use self::protocol::SyncReplicas;
pub use self::roles::Roles;
pub use self::session::{MonitoredSession, Ps};
use super::checkpoint;
use super::data::Dataset;
use super::engine::{Session, TrainError};
use super::events::Event;
use super::TrainConfig;
use crate::cluster::Layout;
use crate::model::embedding::{SparseOptimizer, TableSpec};
use crate::model::Model;
use crate::transport::comm::{Comm, TransportError};

/// How workers reach the ps tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PsTransport {
    /// Two-sided messages: the ps serves each request (`server`).
    #[default]
    P2p,
    /// One-sided MPI windows: workers get and accumulate; the ps works once per step
    /// ([`rma`]).
    Rma,
}

impl crate::named::Named for PsTransport {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (
            PsTransport::P2p,
            "p2p",
            "Two-sided messages: the ps serves each request",
        ),
        (
            PsTransport::Rma,
            "rma",
            "One-sided MPI windows: workers get and accumulate",
        ),
    ];
}

/// Settings of ps training.
#[derive(Debug, Clone)]
pub struct PsConfig {
    pub train: TrainConfig,
    pub sync: bool,
    /// Default: the number of workers.
    pub replicas_to_aggregate: Option<usize>,
    pub strategy: Strategy,
    pub partition_bytes: usize,
    pub peer_timeout: Duration,
    /// Embedding tables the ps tasks hold besides the model's variables: their rows spread
    /// over the ps tasks by id, made on first touch from the run's seed, pulled and pushed
    /// by workers ([`Ps::pull_rows`], [`Ps::push_rows`]).
    pub tables: Vec<TableSpec>,
    /// How the tables' rows are updated.
    pub sparse: SparseOptimizer,
    /// Over one-sided windows: rows of one table one ps task may hold, at most (its window
    /// is sized for them).
    pub window_rows: u64,
    /// Over one-sided windows, synchronous: rows of one table one worker pushes in a step,
    /// at most (its staging area on each ps is sized for them); `None`: its share of the
    /// global batch, one id per sample (`train.batch` over the workers).
    pub push_rows: Option<usize>,
}

impl Default for PsConfig {
    /// The shared defaults, synchronous over every worker, variables placed greedily, a
    /// minute's wait for a peer.
    fn default() -> Self {
        PsConfig {
            train: TrainConfig::default(),
            sync: true,
            replicas_to_aggregate: None,
            strategy: Strategy::Greedy,
            partition_bytes: 4 << 20,
            peer_timeout: Duration::from_secs(60),
            tables: Vec::new(),
            sparse: SparseOptimizer::adagrad(0.05),
            window_rows: 1 << 21,
            push_rows: None,
        }
    }
}

impl PsConfig {
    /// The placement these settings ask for.
    pub fn device_setter(&self) -> DeviceSetter {
        DeviceSetter {
            strategy: self.strategy,
            partition_bytes: self.partition_bytes,
        }
    }

    /// The synchronous-replicas setting for `workers` workers (`None`: async); a value
    /// outside 1..=workers is refused by [`check_config`] before it gets here.
    pub fn sync_replicas(&self, workers: usize) -> Option<SyncReplicas> {
        self.sync.then(|| SyncReplicas {
            replicas_to_aggregate: self.replicas_to_aggregate.unwrap_or(workers),
        })
    }
}

/// Errors of ps training.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PsError {
    #[error("{0}")]
    Transport(#[from] TransportError),
    #[error("{0}")]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error("{task}: lost {lost}: no message for {secs} s (it died or hangs); stopping")]
    Lost {
        task: String,
        lost: String,
        secs: u64,
    },
    #[error("{task}: stopped by a ps: {message}")]
    Remote { task: String, message: String },
    /// On a ps: a worker stopped training (`message` names it and says why).
    #[error("{task}: stopped by a worker: {message}")]
    Aborted { task: String, message: String },
    #[error("{task}: {source}")]
    NonFinite {
        task: String,
        source: crate::train::guard::NonFinite,
    },
    /// Synchronous training: a step's losses or gradients were not finite on some workers,
    /// so the ps tasks did not apply it. Every worker and ps task ends with this, at the
    /// same step (the chief prints it).
    #[error("{0}")]
    NotApplied(crate::train::guard::NonFinite),
    /// On a ps: every worker stopped with this error, which they agreed on among
    /// themselves and print (a pipeline's replica tasks).
    #[error("{0}")]
    Ended(String),
    #[error("{0}")]
    Setup(String),
    #[error("{0}")]
    Sidecar(#[from] crate::train::sidecar::SidecarError),
    /// The job was asked to stop (a preemption signal): every rank ends with this, at
    /// the same step.
    #[error("{0}")]
    Stopped(crate::train::Stopped),
}

impl From<TrainError> for PsError {
    /// A worker's session's error, as ps training says it.
    fn from(e: TrainError) -> PsError {
        match e {
            TrainError::Ps(e) => e,
            TrainError::Stopped(s) => PsError::Stopped(s),
            TrainError::Transport(e) => PsError::Transport(e),
            TrainError::Checkpoint(e) => PsError::Checkpoint(e),
            TrainError::Sidecar(e) => PsError::Sidecar(e),
            e => PsError::Setup(e.to_string()),
        }
    }
}

/// What a worker does with its step's check (`found`, [`crate::train::guard::check_step`]),
/// the rule of both transports: where the ps tasks can refuse a step (`refusable`: the
/// two-sided ps, synchronous or not; the one-sided ps when synchronous), a finding goes to
/// them with the push (`Ok(Some)`), they apply none of it and give every worker one
/// verdict; elsewhere (the one-sided ps, asynchronous) this worker (`task`) stops the job
/// with it.
pub(crate) fn non_finite_rule(
    found: Result<(), crate::train::guard::NonFinite>,
    refusable: bool,
    task: impl FnOnce() -> String,
) -> Result<Option<crate::train::guard::NonFinite>, PsError> {
    match found {
        Err(source) if !refusable => Err(PsError::NonFinite {
            task: task(),
            source,
        }),
        found => Ok(found.err()),
    }
}

/// Refuses settings no ps training can carry out, before anything starts (the same verdict
/// on every rank: it reads only `cfg` and `layout`). [`rma::check_config`] adds what the
/// one-sided ps does not implement.
pub fn check_config(cfg: &PsConfig, layout: &Layout) -> Result<(), PsError> {
    let Some(r) = cfg.replicas_to_aggregate else {
        return Ok(());
    };
    if !cfg.sync {
        return Err(PsError::Setup(format!(
            "--replicas-to-aggregate {r} is for synchronous training: drop it, or drop --async"
        )));
    }
    let nw = Roles::new(layout)?.workers.len();
    if r == 0 || r > nw {
        return Err(PsError::Setup(format!(
            "--replicas-to-aggregate {r} is not between 1 and the job's {nw} workers"
        )));
    }
    Ok(())
}

/// Runs this rank's part (ps, worker or chief) of ps training over two-sided messages:
/// a ps task serves, a worker trains in a session of the `Ps` strategy on its shard of
/// each global batch, and the chief finally evaluates on `test` and saves the parameters.
pub fn run<C: Comm>(
    comm: &C,
    layout: &Layout,
    model: &dyn Model,
    cfg: &PsConfig,
    train: &Dataset,
    test: &Dataset,
    events: &mut dyn FnMut(&Event),
) -> Result<(), PsError> {
    check_config(cfg, layout)?;
    let roles = Roles::new(layout)?;
    let me = comm.rank();
    crate::model::check_data(model, "train", train.features, train.classes)
        .map_err(|e| PsError::Setup(e.to_string()))?;
    if let Some(k) = roles.ps_index(me) {
        return server::serve(comm, &roles, k, cfg.peer_timeout);
    }
    let dir = cfg.train.checkpoint_dir.as_deref();
    let Some(_) = roles.worker_index(me) else {
        if crate::train::sidecar::take_part(comm, layout, model, test, dir, events)? {
            return Ok(());
        }
        events(&Event::Warning(format!(
            "{}: not part of ps training (evaluator); idle",
            roles.task(me)
        )));
        return Ok(());
    };
    let strategy = Ps::new(comm, &roles, model, cfg)?;
    let sess = Session::with_events(strategy, &cfg.train, &mut *events)?;
    super::train_to_end(sess, &cfg.train, train, test)?;
    Ok(())
}

/// What the tests of both ps transports set up alike.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use crate::cluster::MappingOptions;

    /// `n` ranks on one host, `ps` of them ps tasks.
    pub(crate) fn layout(n: usize, ps: usize) -> Layout {
        let mapping = MappingOptions {
            ps,
            ..Default::default()
        };
        Layout::single_host(n, &mapping).unwrap()
    }

    /// `steps` steps, synchronous or not, no logs, whole variables on the ps tasks.
    pub(crate) fn cfg(steps: u64, sync: bool) -> PsConfig {
        PsConfig {
            train: TrainConfig {
                steps,
                log_every: 0,
                ..TrainConfig::default()
            },
            sync,
            replicas_to_aggregate: None,
            strategy: Strategy::Greedy,
            partition_bytes: 4 << 20,
            peer_timeout: Duration::from_secs(10),
            ..PsConfig::default()
        }
    }
}

#[cfg(test)]
mod tests;
