//! The settings a session is made with: the Python layer's keywords, checked, as the
//! library's configuration.

use std::path::PathBuf;
use std::time::Duration;

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
            m => Err(PyValueError::new_err(format!(
                "mpiflow: Session: mode {m:?} is none of ps, allreduce, local"
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
            ..PsConfig::default()
        })
    }
}
