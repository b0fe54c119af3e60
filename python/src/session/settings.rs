//! The settings a session is made with: the Python layer's keywords, checked, as the
//! library's configuration.

use std::path::PathBuf;
use std::time::Duration;

use mpiflow::model::embedding::{SparseOptimizer, TableSpec};
use mpiflow::named::Named;
use mpiflow::train::ps::placement::Strategy as Placement;
use mpiflow::{Optimizer, OptimizerKind, PsConfig, TrainConfig};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::thread::Mode;

/// The settings a session is made with (the Python layer's keywords).
#[derive(FromPyObject)]
pub(super) struct Settings {
    mode: String,
    transport: String,
    sync: bool,
    replicas_to_aggregate: Option<usize>,
    optimizer: String,
    lr: f32,
    momentum: f32,
    pub(super) steps: u64,
    seed: u64,
    log_every: u64,
    checkpoint_dir: Option<PathBuf>,
    checkpoint_every: u64,
    checkpoint_secs: Option<f64>,
    keep_checkpoints: usize,
    pub(super) stop_on_signal: bool,
    peer_timeout: f64,
    pub(super) name: String,
    /// Embedding tables on the ps tasks: name, rows, width.
    pub(super) tables: Vec<(String, u64, usize)>,
    sparse_optimizer: String,
    sparse_lr: f32,
    /// Over one-sided windows: rows of a table one ps holds, and rows of a table one
    /// worker pushes in a step, at most.
    window_rows: u64,
    push_rows: usize,
}

impl Settings {
    pub(super) fn mode(&self) -> PyResult<Mode> {
        if !matches!(self.transport.as_str(), "p2p" | "rma") {
            return Err(PyValueError::new_err(format!(
                "mpiflow: Session: transport {:?} is none of p2p, rma",
                self.transport
            )));
        }
        match self.mode.as_str() {
            "local" => Ok(Mode::Local),
            "allreduce" => Ok(Mode::Allreduce),
            "ps" if self.transport == "rma" => Ok(Mode::PsRma),
            "ps" => Ok(Mode::Ps),
            "hybrid" if self.tables.is_empty() => Err(PyValueError::new_err(
                "mpiflow: Session: mode \"hybrid\" needs embedding tables (tables={name: (rows, width)}) for the ps tasks to hold",
            )),
            "hybrid" if self.transport == "rma" => Ok(Mode::HybridRma),
            "hybrid" => Ok(Mode::Hybrid),
            m => Err(PyValueError::new_err(format!(
                "mpiflow: Session: mode {m:?} is none of ps, hybrid, allreduce, local"
            ))),
        }
    }

    pub(super) fn config(&self) -> PyResult<PsConfig> {
        let kind = OptimizerKind::from_name(&self.optimizer).ok_or_else(|| {
            PyValueError::new_err(format!(
                "mpiflow: Session: optimizer {:?} is none of sgd, momentum, adagrad, adam",
                self.optimizer
            ))
        })?;
        let mut optimizer = Optimizer::new(kind, self.lr);
        optimizer.momentum = self.momentum;
        let secs = |s: f64, what: &str| {
            Duration::try_from_secs_f64(s).map_err(|_| {
                PyValueError::new_err(format!("mpiflow: Session: {what} {s} is no duration"))
            })
        };
        let train = TrainConfig {
            steps: self.steps,
            optimizer,
            seed: self.seed,
            log_every: self.log_every,
            checkpoint_dir: self.checkpoint_dir.clone(),
            checkpoint_every: self.checkpoint_every,
            checkpoint_every_secs: match self.checkpoint_secs {
                Some(s) => Some(secs(s, "checkpoint_secs")?),
                None => None,
            },
            keep_checkpoints: self.keep_checkpoints,
            stop_on_signal: self.stop_on_signal,
            ..TrainConfig::default()
        };
        Ok(PsConfig {
            train,
            sync: self.sync,
            replicas_to_aggregate: self.replicas_to_aggregate,
            strategy: Placement::Greedy,
            peer_timeout: secs(self.peer_timeout, "peer_timeout")?,
            tables: self.tables()?,
            sparse: self.sparse()?,
            window_rows: self.window_rows.max(1),
            push_rows: Some(self.push_rows.max(1)),
            ..PsConfig::default()
        })
    }

    /// The tables, on the ps tasks (modes ps and hybrid; over one-sided windows a step's
    /// rows go with the step, summed and applied by the ps once every worker pushed, or
    /// asynchronously added into the rows as each push comes, plain SGD).
    fn tables(&self) -> PyResult<Vec<TableSpec>> {
        if self.tables.is_empty() {
            return Ok(Vec::new());
        }
        if !matches!(self.mode.as_str(), "ps" | "hybrid") {
            return Err(PyValueError::new_err(
                "mpiflow: Session: embedding tables need mode=\"ps\" or \"hybrid\"",
            ));
        }
        let windows = self.transport == "rma";
        if windows && !self.sync && self.sparse_optimizer != "sgd" {
            return Err(PyValueError::new_err(
                "mpiflow: Session: asynchronous embedding tables over one-sided windows (transport=\"rma\", sync=False) are added into by each push as it comes: plain SGD, sparse_optimizer=\"sgd\" (or sync=True, or transport \"p2p\")",
            ));
        }
        if let Some((var, value)) = windows.then(crate::one_sided_env_missing).flatten() {
            return Err(PyValueError::new_err(format!(
                "mpiflow: Session: embedding tables over one-sided windows need {var}={value} on this machine (Open MPI's default crashes in MPI_Compare_and_swap over shared memory): MPI was started before mpiflow.init() could set it; set it before MPI starts"
            )));
        }
        (self.tables.iter())
            .map(|(name, rows, dim)| match *rows > 0 && *dim > 0 {
                true => Ok(TableSpec::new(name, *rows, *dim)),
                false => Err(PyValueError::new_err(format!(
                    "mpiflow: Session: table {name:?} of {rows} rows of {dim}: both must be at least 1"
                ))),
            })
            .collect()
    }

    fn sparse(&self) -> PyResult<SparseOptimizer> {
        let lr = self.sparse_lr;
        match self.sparse_optimizer.as_str() {
            "sgd" => Ok(SparseOptimizer::Sgd { lr }),
            "adagrad" => Ok(SparseOptimizer::adagrad(lr)),
            "lazy_adam" => Ok(SparseOptimizer::lazy_adam(lr)),
            other => Err(PyValueError::new_err(format!(
                "mpiflow: Session: sparse_optimizer {other:?} is none of sgd, adagrad, lazy_adam"
            ))),
        }
    }
}
