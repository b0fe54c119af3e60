//! A click model's run in each mode that holds tables: the session set up as the mode
//! needs, then [`fit`]. What `mpiflow train --model dlrm` runs on each rank.

use super::fit::{fit, CtrEvaluation, CtrFit, RowsAhead};
use super::CtrData;
use crate::cluster::Layout;
use crate::model::dlrm::Dlrm;
use crate::model::embedding::SparseOptimizer;
use crate::train::engine::{Local, Session, Strategy, TrainError, Trained};
use crate::train::events::Event;
use crate::train::hybrid::{self, HybridConfig};
use crate::train::ps::rma;
use crate::train::ps::rma::rows::RowsConfig;
use crate::train::ps::{server, Ps, PsConfig, PsTransport, Roles};
use crate::train::resources::Share;
use crate::train::tables::{LocalRows, Sparse, Tables};
use crate::train::TrainConfig;
use crate::transport::Comm;

/// What a click model's run reached on a rank that trains.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CtrReport {
    /// The last evaluation, on the ranks that evaluate.
    pub evaluation: Option<CtrEvaluation>,
    /// The global step reached.
    pub steps: u64,
    /// The last step's loss.
    pub loss: f32,
    /// Samples per second over the run (every rank's).
    pub samples_per_sec: f64,
}

/// What every mode's click run shares.
pub struct CtrRun<'d> {
    pub model: &'d Dlrm,
    pub train: &'d dyn CtrData,
    pub test: &'d dyn CtrData,
    /// The dense parameters' training (the batch, steps, optimizer, seed, checkpoints).
    pub cfg: &'d TrainConfig,
    /// How the tables' rows are updated.
    pub sparse: SparseOptimizer,
    /// This rank's share of its node's memory: a ps task whose rows outgrow it fails the
    /// request that grew them, naming the table (`None`: unchecked).
    pub memory: Option<Share>,
    /// Whether the next step's rows that a step's push does not touch are pulled while
    /// the step computes, where the rows travel by messages.
    pub rows_ahead: RowsAhead,
}

impl<'d> CtrRun<'d> {
    /// `model` trained on `train` and evaluated on `test` (`data`) as `cfg` says, its rows
    /// updated by `sparse`, memory unchecked.
    pub fn new(
        model: &'d Dlrm,
        (train, test): (&'d dyn CtrData, &'d dyn CtrData),
        cfg: &'d TrainConfig,
        sparse: SparseOptimizer,
    ) -> CtrRun<'d> {
        CtrRun {
            model,
            train,
            test,
            cfg,
            sparse,
            memory: None,
            rows_ahead: RowsAhead::Auto,
        }
    }

    /// The run with rows checked against `memory`, this rank's share of its node.
    pub fn within(self, memory: Option<Share>) -> CtrRun<'d> {
        CtrRun { memory, ..self }
    }

    /// The run with the next step's rows pulled ahead as `ahead` says.
    pub fn rows_ahead(self, ahead: RowsAhead) -> CtrRun<'d> {
        CtrRun {
            rows_ahead: ahead,
            ..self
        }
    }

    /// Trains in `sess` to the end; what it reached.
    fn fit<'m, S: Strategy<'m> + Tables>(
        &self,
        mut sess: Session<'m, '_, S>,
        dense: &crate::model::External,
    ) -> Result<CtrReport, TrainError> {
        let run = CtrFit {
            model: self.model,
            dense,
            batch: self.cfg.batch,
            seed: self.cfg.seed,
            eval_every: self.cfg.eval_every,
            rows_ahead: self.rows_ahead,
        };
        let evaluation = fit(&mut sess, &run, self.train, self.test)?;
        Ok(report(sess.close()?, evaluation))
    }

    /// Local training: the tables in this process.
    pub fn local(&self, events: &mut dyn FnMut(&Event)) -> Result<CtrReport, TrainError> {
        let dense = self.model.dense_model(self.cfg.seed)?;
        let values: usize = dense.variables().iter().map(|v| v.numel()).sum();
        let rows = LocalRows::new(self.model.tables(), self.cfg.seed, self.sparse)
            .within(self.memory.clone(), values as u64 * 4 * 4);
        let strategy = Sparse::new(Local::new(&dense, self.cfg)?, rows);
        let sess = Session::with_events(strategy, self.cfg, |e: &Event| events(e))?;
        self.fit(sess, &dense)
    }

    /// Hybrid training on this rank of `comm` (`layout`'s cluster): a ps task serves the
    /// rows, a worker trains (`cfg`'s allreduce settings and timeout; the training
    /// settings are the run's, the tables the model's).
    /// `None` on a ps task.
    pub fn hybrid<C: Comm + Send + 'static>(
        &self,
        comm: &C,
        layout: &Layout,
        cfg: &HybridConfig,
        events: &mut dyn FnMut(&Event),
    ) -> Result<Option<CtrReport>, TrainError>
    where
        C::Window<f32>: 'static,
        C::Window<i64>: 'static,
    {
        let roles = Roles::new(layout)?;
        let workers = hybrid::split_workers(comm, &roles)?;
        // The run's training settings, whatever `cfg.allreduce.train` says: the session,
        // the dense update and the rows' seed take one.
        let cfg = HybridConfig {
            allreduce: crate::train::allreduce::AllreduceConfig {
                train: self.cfg.clone(),
                ..cfg.allreduce.clone()
            },
            tables: self.model.tables().to_vec(),
            sparse: self.sparse,
            ..cfg.clone()
        };
        if cfg.transport == PsTransport::Rma {
            return self.hybrid_over_windows(comm, (layout, &roles), workers, &cfg, events);
        }
        if let Some(k) = roles.ps_index(comm.rank()) {
            server::serve_within(comm, &roles, k, cfg.peer_timeout, self.memory.clone())?;
            return Ok(None);
        }
        let Some(workers) = workers else {
            return Ok(None); // an evaluator: no part in hybrid training
        };
        let dense = self.model.dense_model(self.cfg.seed)?;
        let strategy = hybrid::strategy(comm, workers, &roles, layout, &dense, &cfg)?;
        let sess = Session::with_events(strategy, self.cfg, |e: &Event| events(e))?;
        self.fit(sess, &dense).map(Some)
    }

    /// [`CtrRun::hybrid`] with the rows over one-sided windows (every rank allocates
    /// them: a collective).
    fn hybrid_over_windows<C: Comm + Send + 'static>(
        &self,
        comm: &C,
        (layout, roles): (&Layout, &Roles),
        workers: Option<C>,
        cfg: &HybridConfig,
        events: &mut dyn FnMut(&Event),
    ) -> Result<Option<CtrReport>, TrainError>
    where
        C::Window<f32>: 'static,
        C::Window<i64>: 'static,
    {
        // `cfg.allreduce.train` is the run's: each push of a worker's share of its batch.
        let rows = cfg.rows_over_windows(roles.workers.len(), self.memory.clone());
        let dense = self.model.dense_model(self.cfg.seed)?;
        let on = (layout, roles);
        let ran = hybrid::over_windows(comm, on, workers, &dense, (cfg, &rows), |s| {
            let sess = Session::with_events(s, self.cfg, |e: &Event| events(e))?;
            self.fit(sess, &dense)
        })?;
        Ok(ran)
    }

    /// Ps training on this rank of `comm`: the dense variables and the rows on the ps
    /// tasks (`cfg`'s synchrony, placement and timeout; the tables are the model's).
    /// `None` on a ps task.
    pub fn ps<C: Comm>(
        &self,
        comm: &C,
        layout: &Layout,
        cfg: &PsConfig,
        events: &mut dyn FnMut(&Event),
    ) -> Result<Option<CtrReport>, TrainError> {
        let roles = Roles::new(layout)?;
        crate::train::ps::check_config(cfg, layout)?;
        if let Some(k) = roles.ps_index(comm.rank()) {
            server::serve_within(comm, &roles, k, cfg.peer_timeout, self.memory.clone())?;
            return Ok(None);
        }
        if roles.worker_index(comm.rank()).is_none() {
            return Ok(None);
        }
        let dense = self.model.dense_model(self.cfg.seed)?;
        let cfg = PsConfig {
            train: self.cfg.clone(),
            tables: self.model.tables().to_vec(),
            sparse: self.sparse,
            ..cfg.clone()
        };
        let strategy = Ps::new(comm, &roles, &dense, &cfg)?;
        let sess = Session::with_events(strategy, self.cfg, |e: &Event| events(e))?;
        self.fit(sess, &dense).map(Some)
    }

    /// Ps training over one-sided windows (`--mode ps --transport rma`) on this rank of
    /// `comm`: the dense variables' shards and the tables' rows (at most `window_rows` of a
    /// table per ps task) in the ps tasks' windows; synchronous, each step applied once
    /// every worker pushed it; asynchronous (plain SGD on both), each worker's push added
    /// as it arrives. Every rank calls it (the windows are allocated by all at once).
    /// `None` on a ps task.
    pub fn ps_over_windows<C: Comm>(
        &self,
        comm: &C,
        layout: &Layout,
        (cfg, window_rows): (&PsConfig, u64),
        events: &mut dyn FnMut(&Event),
    ) -> Result<Option<CtrReport>, TrainError>
    where
        C::Window<f32>: 'static,
        C::Window<i64>: 'static,
    {
        let dense = self.model.dense_model(self.cfg.seed)?;
        let cfg = PsConfig {
            train: self.cfg.clone(),
            tables: self.model.tables().to_vec(),
            sparse: self.sparse,
            ..cfg.clone()
        };
        let rows = RowsConfig {
            rows_per_table: window_rows,
            memory: self.memory.clone(),
            ..RowsConfig::of(&cfg, layout)
        };
        // No side-car evaluation: the workers evaluate the click model.
        let none = crate::train::data::Dataset {
            x: Vec::new(),
            y: Vec::new(),
            features: 0,
            classes: 0,
            shape: Vec::new(),
        };
        let job = (layout, &dense as &dyn crate::model::Model, &cfg, Some(rows));
        let ran = rma::scope_with_rows(comm, job, &none, events, |sess| self.fit(sess, &dense));
        Ok(ran?)
    }
}

/// The report of a closed session and its last evaluation.
fn report(trained: Trained<'_>, evaluation: Option<CtrEvaluation>) -> CtrReport {
    CtrReport {
        evaluation,
        steps: trained.step,
        loss: trained.loss,
        samples_per_sec: trained.samples_per_sec,
    }
}
