//! Hybrid training (`--mode hybrid`), Persia's and XDL's design: the embedding tables'
//! rows on the ps tasks, each row where [`row_owner`](super::ps::protocol::row_owner)
//! puts it, pulled and pushed by the workers as their batches name them (applied as they
//! arrive: asynchronous), and the dense parameters replicated on the workers, summed by
//! allreduce among them every step (synchronous). A table may be far larger than a worker
//! (only touched rows exist, spread over the ps tasks); the dense part, small, never
//! waits on a ps.
//!
//! The strategy is [`Sparse`] over the allreduce's [`Allreduce`] with [`PsRows`]: the
//! workers' step loop is the allreduce's (signals, the guard, evaluations agreed among
//! them), and a checkpoint holds the chief's dense state beside each ps task's rows, one
//! checkpoint that the ps mode can resume too (and the other way round).

use std::path::Path;
use std::time::Duration;

use super::allreduce::{Allreduce, AllreduceConfig};
use super::engine::{End, TrainError};
use super::ps::protocol::Setup;
use super::ps::rma::rows::{self as rma_rows, Rows, RowsConfig};
use super::ps::worker::Client;
use super::ps::{PsTransport, Roles};
use super::resources::Share;
use super::tables::{RowHome, RowsReport, Sparse, Tables};
use crate::cluster::Layout;
use crate::model::embedding::{SparseGrad, SparseOptimizer, TableSpec};
use crate::model::Model;
use crate::transport::Comm;

/// Settings of hybrid training.
#[derive(Debug, Clone)]
pub struct HybridConfig {
    /// The dense parameters' allreduce (and what every mode shares: `allreduce.train`).
    pub allreduce: AllreduceConfig,
    /// The tables whose rows the ps tasks hold.
    pub tables: Vec<TableSpec>,
    /// How the rows are updated.
    pub sparse: SparseOptimizer,
    /// How long a ps waits for a worker (and a worker for a ps) before calling it lost.
    pub peer_timeout: Duration,
    /// How the rows travel: messages the ps tasks serve as they come (applied as they
    /// arrive), or one-sided windows (every worker's step summed and applied once, or
    /// each push as it arrives: [`HybridConfig::asynchronous`];
    /// [`crate::train::ps::rma::rows`]).
    pub transport: PsTransport,
    /// Over windows: rows of one table one ps task may hold, at most (its window is
    /// sized for them).
    pub window_rows: u64,
    /// Over windows: each worker's rows applied as its push arrives (plain SGD added by
    /// `MPI_Accumulate`) instead of every worker's step summed and applied once. Over
    /// messages the rows are always applied as they arrive.
    pub asynchronous: bool,
    /// Over windows, synchronous: rows of one table one worker pushes in a step, at most
    /// (its staging area on each ps is sized for them); `None`: its share of the global
    /// batch, one id per sample (`allreduce.train.batch` over the workers).
    pub push_rows: Option<usize>,
}

impl Default for HybridConfig {
    fn default() -> Self {
        HybridConfig {
            allreduce: AllreduceConfig::default(),
            tables: Vec::new(),
            sparse: SparseOptimizer::adagrad(0.05),
            peer_timeout: Duration::from_secs(60),
            transport: PsTransport::P2p,
            window_rows: 1 << 21,
            asynchronous: false,
            push_rows: None,
        }
    }
}

/// The strategy of a hybrid worker.
pub type Hybrid<'s, C> = Sparse<Allreduce<'s, C>, PsRows<'s, C>>;

/// The strategy of a hybrid worker with the rows over one-sided windows: `model`'s
/// variables (`'m`) by allreduce, the rows in the windows (`'w`) of [`over_windows`]'s
/// scope (`'a`).
pub type HybridOverWindows<'m, 'a, 'w, C> = Sparse<Allreduce<'m, C>, Rows<'a, 'w, C>>;

impl HybridConfig {
    /// The rows over windows of these settings, for `workers` workers; the ps tasks'
    /// memory checked against `memory`.
    pub fn rows_over_windows(&self, workers: usize, memory: Option<Share>) -> RowsConfig {
        let train = &self.allreduce.train;
        RowsConfig {
            tables: self.tables.clone(),
            sparse: self.sparse,
            seed: train.seed,
            rows_per_table: self.window_rows,
            rows_per_push: (self.push_rows).unwrap_or(train.batch.div_ceil(workers.max(1))),
            peer_timeout: self.peer_timeout,
            checkpoint_dir: train.checkpoint_dir.clone(),
            memory,
            asynchronous: self.asynchronous,
        }
    }
}

/// Rows on the ps tasks, reached over `C` (every task's communicator).
pub struct PsRows<'s, C: Comm> {
    client: Client<'s, C>,
    setup: Setup,
    /// A worker's share of each step's sparse update ([`Tables::push_scale`]).
    scale: f32,
}

impl<'s, C: Comm> PsRows<'s, C> {
    /// This worker's way to the rows of `cfg`'s tables on `roles`' ps tasks, its sparse
    /// gradients a `1 / workers` share of each step's update.
    pub fn new(comm: &'s C, roles: &'s Roles, cfg: &HybridConfig, workers: usize) -> PsRows<'s, C> {
        PsRows {
            scale: 1.0 / workers.max(1) as f32,
            client: Client::new(comm, roles, Vec::new(), cfg.peer_timeout),
            setup: Setup {
                shards: Vec::new(),
                optimizer: cfg.allreduce.train.optimizer,
                sync: None,
                stage: None,
                tables: cfg.tables.clone(),
                sparse: Some(cfg.sparse),
                seed: cfg.allreduce.train.seed,
            },
        }
    }
}

impl<C: Comm> Tables for PsRows<'_, C> {
    fn table_specs(&self) -> &[TableSpec] {
        &self.setup.tables
    }

    fn pull_tables(
        &self,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
        make: bool,
    ) -> Result<(), TrainError> {
        let specs = &self.setup.tables;
        Ok(self.client.pull_tables(specs, want, out, make)?)
    }

    fn push_tables(&self, grads: &[(usize, &SparseGrad)], scale: f32) -> Result<(), TrainError> {
        Ok(self.client.push_tables(&self.setup.tables, grads, scale)?)
    }

    fn push_pull_tables(
        &self,
        grads: &[(usize, &SparseGrad)],
        scale: f32,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
    ) -> Result<(), TrainError> {
        let specs = &self.setup.tables;
        Ok(self
            .client
            .push_pull_tables(specs, (grads, scale), want, out)?)
    }

    fn pulls_ahead(&self) -> bool {
        true
    }

    fn pull_ahead(&self, want: &[(usize, &[u64])]) -> Result<(), TrainError> {
        Ok(self.client.pull_tables_ahead(&self.setup.tables, want)?)
    }

    fn land_tables(
        &self,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
    ) -> Result<(), TrainError> {
        Ok(self.client.land_tables(&self.setup.tables, want, out)?)
    }

    fn push_scale(&self) -> f32 {
        self.scale
    }

    fn rows_report(&self) -> Result<Vec<RowsReport>, TrainError> {
        Ok(self.client.stats()?)
    }
}

impl<C: Comm> RowHome for PsRows<'_, C> {
    fn start(&mut self, restore: Option<&Path>) -> Result<(), TrainError> {
        match restore {
            Some(path) => self.client.restore(&self.setup, path)?,
            None => self.client.init(&self.setup, &mut Vec::new())?,
        }
        Ok(())
    }

    fn save(&mut self, dir: &Path) -> Result<Vec<(String, u64, u64)>, TrainError> {
        Ok(self.client.save(dir)?)
    }

    /// Every ps is told: done (with the signal that stopped the workers), or the error;
    /// one the workers agreed on ends the ps tasks quietly (each worker says it).
    fn end(&mut self, how: &End<'_>) -> Result<(), TrainError> {
        let c = &self.client;
        match how {
            End::Done => Ok(c.done(None)?),
            End::Stopped(signal) => Ok(c.done(Some(*signal))?),
            End::Failed(e) if e.is_agreed() => {
                c.abort_agreed(&e.to_string());
                Ok(())
            }
            End::Failed(e) => {
                c.abort(&e.to_string());
                Ok(())
            }
            End::Abandoned => {
                let me = c.me();
                c.abort(&format!(
                    "{me} left its training session without closing it"
                ));
                Ok(())
            }
        }
    }
}

/// A hybrid worker of `roles` (the chief is worker 0) training `model`'s dense
/// parameters with the other workers over `workers` (their own communicator, this
/// worker's rank in it its worker index) and the tables' rows on the ps tasks over
/// `comm` (every task's); `layout` names the tasks.
pub fn strategy<'s, C: Comm + Send + 'static>(
    comm: &'s C,
    workers: C,
    roles: &'s Roles,
    layout: &Layout,
    model: &'s dyn Model,
    cfg: &HybridConfig,
) -> Result<Hybrid<'s, C>, TrainError> {
    if cfg.tables.is_empty() {
        return Err(TrainError::Setup(
            "hybrid training needs embedding tables for the ps tasks to hold".into(),
        ));
    }
    let rows = PsRows::new(comm, roles, cfg, workers.size());
    let dense = Allreduce::new(workers, layout, comm.rank(), model, &cfg.allreduce)?;
    Ok(Sparse::new(dense, rows))
}

/// Hybrid training with the rows over one-sided windows, on this rank of `comm` (every
/// rank calls it: the windows are allocated by all together): a ps task serves its rows
/// until the workers end (`None`); a worker hands its strategy (`model`'s variables by
/// allreduce among `workers`, the workers' communicator that
/// [`split_workers`] made, and the rows of `rows`) to `drive`, whose result it returns;
/// any other task takes part in the windows only.
pub fn over_windows<'m, C: Comm + Send + 'static, R>(
    comm: &C,
    (layout, roles): (&Layout, &Roles),
    workers: Option<C>,
    model: &'m dyn Model,
    (cfg, rows): (&HybridConfig, &RowsConfig),
    drive: impl for<'a, 'w> FnOnce(HybridOverWindows<'m, 'a, 'w, C>) -> Result<R, TrainError>,
) -> Result<Option<R>, TrainError>
where
    C::Window<f32>: 'static,
    C::Window<i64>: 'static,
{
    if cfg.tables.is_empty() {
        return Err(TrainError::Setup(
            "hybrid training needs embedding tables for the ps tasks to hold".into(),
        ));
    }
    let ran = rma_rows::scope(comm, roles, rows, |rows| {
        let workers = workers.expect("a worker has the workers' communicator");
        let dense = Allreduce::new(workers, layout, comm.rank(), model, &cfg.allreduce)?;
        drive(Sparse::new(dense, rows))
    });
    Ok(ran?)
}

/// The workers' communicator of `roles` (worker index order), made by every task of
/// `comm` together; `None` on a task that is no worker.
pub fn split_workers<C: Comm>(comm: &C, roles: &Roles) -> Result<Option<C>, TrainError> {
    let worker = roles.worker_index(comm.rank());
    let split = comm.split(u32::from(worker.is_none()), worker.unwrap_or(comm.rank()))?;
    Ok(worker.map(|_| split))
}
