//! A task's server: TensorFlow's `tf.train.Server` on MPI.
//!
//! Every process of the job runs the same program and starts one. The cluster and this
//! process's task come from wherever the job was described: the seeds' flags
//! (`--ps_hosts --worker_hosts --job_name --task_index`), `TF_CONFIG`, or, under
//! `mpirun`/`srun` with neither, mpiflow's mapping of ranks onto jobs (`--ps N` tasks
//! first). Tensors travel by MPI in every case, so the job runs under an MPI launcher.
//! A ps task calls [`Server::join`], which serves the variables until every worker is
//! done; workers train in a [`MonitoredSession`]; an evaluator task evaluates the chief's
//! checkpoints as they come ([`Server::evaluate`]). Over one-sided windows every task
//! calls [`Server::one_sided`] instead (the windows are allocated by all of them at once),
//! and in pipeline training [`Server::stages`]; data-parallel replicas train in
//! [`Server::allreduce_session`].
//!
//! ```no_run
//! use mpiflow::{PsConfig, Server, TrainConfig};
//! # fn model() -> mpiflow::model::Sequential { unimplemented!() }
//! # fn batch(step: u64) -> (Vec<f32>, Vec<u8>) { unimplemented!() }
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let args: Vec<String> = std::env::args().skip(1).collect();
//! let mapping = mpiflow::cluster::MappingOptions { ps: 1, ..Default::default() };
//! let server = Server::start(&args, mapping)?;
//! if server.is_ps() {
//!     server.join()?;
//!     return Ok(());
//! }
//! let model = model();
//! let cfg = PsConfig { train: TrainConfig { steps: 1000, ..TrainConfig::default() },
//!                      ..PsConfig::default() };
//! let mut sess = server.session(&model, &cfg)?;
//! while !sess.should_stop() {
//!     let (x, y) = batch(sess.global_step());
//!     sess.run(&x, &y)?;
//! }
//! sess.close()?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use super::allreduce::{Allreduce, AllreduceConfig};
use super::data::Dataset;
use super::engine::{Session, TrainError};
use super::events::Event;
use super::hybrid::{self, Hybrid, HybridConfig, HybridOverWindows};
use super::ps::rma::{self, OneSidedSession};
use super::ps::MonitoredSession;
use super::ps::PsConfig;
use super::ps::{server, PsError, Roles};
use super::sidecar;
use crate::cluster::resolve::{resolve_bound, resolve_mpi, resolve_offline};
use crate::cluster::{Layout, MappingOptions, Request, ResolveError, Source, TaskId};
use crate::model::Model;
use crate::pipeline::StagesSession;
use crate::transport::mpi::MpiComm;
use crate::transport::Comm;
use crate::transport::{Context, InitError};

/// Errors of starting or running a server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{0}")]
    Init(#[from] InitError),
    #[error("{0}")]
    Resolve(#[from] ResolveError),
    #[error("{0}")]
    Ps(#[from] PsError),
    #[error("{0}")]
    Sidecar(#[from] sidecar::SidecarError),
    #[error("{0}")]
    Train(#[from] TrainError),
    #[error("{0}")]
    Pipeline(#[from] crate::pipeline::PipelineError),
    #[error("{task} (rank {rank}): {what}")]
    Role {
        task: String,
        rank: usize,
        what: String,
    },
}

/// This process's server: its MPI communicator, the cluster, its task.
pub struct Server {
    // Field order matters: the communicators are freed before MPI is finalised.
    /// The workers' own communicator (`None` on other tasks): split off at start, so that
    /// the workers' sessions need no other task.
    workers: Option<MpiComm>,
    comm: MpiComm,
    layout: Layout,
    roles: Option<Roles>,
    rank: usize,
    /// How long a ps waits for a worker (and a worker for a ps) before calling it lost.
    pub peer_timeout: Duration,
    _ctx: Context,
}

impl Server {
    /// Starts this process's server: initialises MPI and resolves the cluster as the
    /// command line does ([`Request::pick_source`]): from the seeds' flags if `args` has
    /// them (other arguments are ignored), else `TF_CONFIG`, else the ranks of the MPI job
    /// (or Slurm's step) mapped onto `mapping`'s jobs.
    pub fn start(args: &[String], mapping: MappingOptions) -> Result<Server, ServerError> {
        let env: BTreeMap<String, String> = std::env::vars().collect();
        Server::start_with(&Server::request(args, mapping), &env)
    }

    /// The cluster request [`Server::start`] makes of `args` and `mapping`: the seeds'
    /// flags if `args` has them (other arguments are ignored), else `TF_CONFIG`, else the
    /// MPI job's ranks (or Slurm's step) mapped onto `mapping`'s jobs.
    pub fn request(args: &[String], mapping: MappingOptions) -> Request {
        let seeds_flag = |a: &String| {
            let name = a.split('=').next().unwrap_or_default();
            crate::cluster::flags::FLAG_NAMES.contains(&name)
        };
        let flags = match args.iter().any(seeds_flag) {
            true => args.to_vec(),
            false => Vec::new(),
        };
        Request {
            source: Source::Auto,
            mapping,
            legacy_flags: flags,
            // The first port the MPI mapping probes on each host: TensorFlow's 2222, or
            // the Slurm job's own (`cluster::ports::default_base`).
            port_base: None,
            ..Request::default()
        }
    }

    /// Starts the server of the cluster `req` describes (`req.source` picked as
    /// [`Request::pick_source`] does for `Auto`).
    pub fn start_with(
        req: &Request,
        env: &BTreeMap<String, String>,
    ) -> Result<Server, ServerError> {
        Server::start_in(Context::init()?, req, env)
    }

    /// [`Server::start_with`] on an MPI library the caller initialised (for example with
    /// threads: [`Context::init_threaded`]).
    pub fn start_in(
        ctx: Context,
        req: &Request,
        env: &BTreeMap<String, String>,
    ) -> Result<Server, ServerError> {
        let layout = match req.pick_source(env) {
            Source::Mpi | Source::Auto => resolve_mpi(&ctx, req)?.layout,
            Source::Slurm => resolve_offline(req, Source::Slurm, env)?.layout,
            Source::Hostfile => {
                return Err(ResolveError::Usage(
                    "a hostfile previews a cluster; a server needs MPI, TF_CONFIG or flags".into(),
                )
                .into())
            }
            s => resolve_bound(&ctx, req, s, env)?,
        };
        let roles = layout
            .ranks
            .iter()
            .any(|r| r.task.job == "ps")
            .then(|| Roles::new(&layout))
            .transpose()?;
        let comm = MpiComm::new(ctx.world());
        let worker = layout.spec.worker_id(&layout.ranks[ctx.rank()].task);
        let workers = comm
            .split(u32::from(worker.is_none()), worker.unwrap_or(ctx.rank()))
            .map_err(|e| ResolveError::Usage(e.to_string()))?;
        Ok(Server {
            workers: worker.map(|_| workers),
            comm,
            rank: ctx.rank(),
            layout,
            roles,
            peer_timeout: Duration::from_secs(60),
            _ctx: ctx,
        })
    }

    /// Warnings from starting, the same on every task (for one of them to print): hosts
    /// that are one machine, whose ranks shared bound CPUs or oversubscribe it.
    pub fn warnings(&self) -> &[String] {
        self._ctx.warnings()
    }

    /// This process's task (`ps:0`, `worker:2`, ...).
    pub fn task(&self) -> &TaskId {
        &self.layout.ranks[self.rank].task
    }

    /// The whole cluster.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The communicator every task shares.
    pub fn comm(&self) -> &MpiComm {
        &self.comm
    }

    pub fn is_ps(&self) -> bool {
        self.task().job == "ps"
    }

    /// True for an evaluator task: it takes no part in training ([`Server::evaluate`]).
    pub fn is_evaluator(&self) -> bool {
        self.task().is_evaluator()
    }

    /// True for the chief: `chief:0`, or `worker:0` if the cluster has no chief job.
    pub fn is_chief(&self) -> bool {
        self.roles
            .as_ref()
            .and_then(|r| r.worker_index(self.rank))
            .map_or(self.rank == 0, |w| w == 0)
    }

    /// This worker's index (the chief is 0) and the number of workers; `None` on a task
    /// that is no worker. Each worker trains on its shard of each global batch.
    pub fn worker(&self) -> Option<(usize, usize)> {
        let roles = self.roles.as_ref()?;
        Some((roles.worker_index(self.rank)?, roles.workers.len()))
    }

    fn role_error(&self, what: &str) -> ServerError {
        ServerError::Role {
            task: self.task().to_string(),
            rank: self.rank,
            what: what.into(),
        }
    }

    /// A ps task: serves its variables until every worker is done (or one is lost or
    /// stops with an error, which this returns).
    pub fn join(&self) -> Result<(), ServerError> {
        let roles = self
            .roles
            .as_ref()
            .ok_or_else(|| self.role_error("no ps job"))?;
        let k = roles
            .ps_index(self.rank)
            .ok_or_else(|| self.role_error("join() serves ps tasks; this is not one"))?;
        Ok(server::serve(&self.comm, roles, k, self.peer_timeout)?)
    }

    /// An evaluator task: evaluates `model` on `test` with each checkpoint the chief
    /// commits in `dir` (the chief's session has its `checkpoint_dir` there), reporting
    /// each to `events`, until the chief's session ends (TensorFlow's side-car evaluation,
    /// `crate::train::sidecar`).
    pub fn evaluate(
        &self,
        model: &dyn Model,
        test: &Dataset,
        dir: &Path,
        events: &mut dyn FnMut(&Event),
    ) -> Result<(), ServerError> {
        if !self.is_evaluator() {
            return Err(self.role_error("evaluate() is for evaluator tasks; this is not one"));
        }
        let task = format!("{} (rank {})", self.task(), self.rank);
        Ok(sidecar::evaluate(
            &self.comm, &task, model, test, dir, events,
        )?)
    }

    /// A worker's training session of `model` by synchronous replicas (allreduce): every
    /// worker task (`chief` and `worker` jobs) opens one; other tasks take no part.
    pub fn allreduce_session<'s>(
        &'s self,
        model: &'s dyn Model,
        cfg: &AllreduceConfig,
    ) -> Result<Session<'s, 's, Allreduce<'s, MpiComm>>, ServerError> {
        let replicas = self.replicas("an allreduce session")?;
        let strategy = Allreduce::new(replicas, &self.layout, self.rank, model, cfg)?;
        Ok(Session::new(strategy, &cfg.train)?)
    }

    /// A worker's hybrid training session of `model` (`--mode hybrid`): `cfg.tables`'
    /// rows on the ps tasks (which `join`), pulled and pushed by the workers as their
    /// batches name them ([`crate::train::tables::Tables`] on the session's strategy),
    /// and the model's variables replicated on the workers, summed by allreduce among them
    /// every step. Every worker task opens one.
    pub fn hybrid_session<'s>(
        &'s self,
        model: &'s dyn Model,
        cfg: &HybridConfig,
    ) -> Result<Session<'s, 's, Hybrid<'s, MpiComm>>, ServerError> {
        let roles = self
            .roles
            .as_ref()
            .ok_or_else(|| self.role_error("a hybrid session needs a ps job for its tables"))?;
        let replicas = self.replicas("a hybrid session")?;
        let strategy = hybrid::strategy(&self.comm, replicas, roles, &self.layout, model, cfg)?;
        Ok(Session::new(strategy, &cfg.allreduce.train)?)
    }

    /// Hybrid training of `model` with the rows over one-sided windows (`cfg`'s tables,
    /// [`HybridConfig::rows_over_windows`]; `cfg.transport` is not read): every task calls
    /// it with the same model and configuration (the windows are allocated by all
    /// together). On a worker it opens the session (the variables by allreduce among the
    /// workers, the rows in the windows) and hands it to `drive`, whose result it returns;
    /// a ps task serves its rows until the workers end, and it and any other task return
    /// `None`. The windows are freed when it returns, so the session lives inside `drive`.
    pub fn hybrid_one_sided<'s, R>(
        &'s self,
        model: &'s dyn Model,
        cfg: &HybridConfig,
        drive: impl for<'a, 'w> FnOnce(
            Session<'s, 'a, HybridOverWindows<'s, 'a, 'w, MpiComm>>,
        ) -> Result<R, TrainError>,
    ) -> Result<Option<R>, ServerError> {
        let roles = (self.roles.as_ref())
            .ok_or_else(|| self.role_error("hybrid training needs a ps job for its tables"))?;
        let workers = match self.workers {
            Some(_) => Some(self.replicas("hybrid training")?),
            None => None,
        };
        let rows = cfg.rows_over_windows(roles.workers.len(), None);
        let on = (&self.layout, roles);
        let train = &cfg.allreduce.train;
        let ran = hybrid::over_windows(&self.comm, on, workers, model, (cfg, &rows), |s| {
            drive(Session::new(s, train)?)
        })?;
        Ok(ran)
    }

    /// A communicator of the worker tasks (worker index order) for a session of `what`
    /// whose replicas reduce among them; an error on any other task.
    fn replicas(&self, what: &str) -> Result<MpiComm, ServerError> {
        let workers = (self.workers.as_ref())
            .ok_or_else(|| self.role_error(&format!("{what} is for the chief and worker tasks")))?;
        Ok(workers.split(0, workers.rank()).map_err(TrainError::from)?)
    }

    /// One-sided ps training (`--transport rma`): the ps tasks' variables in MPI windows
    /// that the workers read and accumulate into. Every task calls it with the same model
    /// and configuration (the windows are allocated by all tasks together and sized from
    /// the model): on a worker it opens the session and hands it to `drive`, whose result
    /// it returns; a ps task serves, and an evaluator evaluates the chief's checkpoints on
    /// `test` (`cfg.train.checkpoint_dir`), until the workers end, and both return `None`.
    /// The windows are freed when it returns, so the session lives inside `drive`. Events
    /// are printed by the chief and the evaluator.
    pub fn one_sided<R>(
        &self,
        model: &dyn Model,
        cfg: &PsConfig,
        test: &Dataset,
        drive: impl for<'a, 'w> FnOnce(OneSidedSession<'a, 'w, MpiComm>) -> Result<R, TrainError>,
    ) -> Result<Option<R>, ServerError> {
        let prints = self.is_chief() || self.is_evaluator();
        let mut events = |e: &Event| {
            if prints {
                println!("{e}")
            }
        };
        let (comm, layout) = (&self.comm, &self.layout);
        Ok(rma::scope(
            comm,
            layout,
            model,
            cfg,
            test,
            &mut events,
            drive,
        )?)
    }

    /// Pipeline training (model parallelism): the cluster's replica jobs (`replica_0`,
    /// `replica_1`, ..., started with [`MappingOptions::stages`]) each hold the model cut
    /// into stages, one per task. Every task calls it with the same model and
    /// configuration (the communicators of replicas and stages are made by all tasks
    /// together): on a replica task it plans the stages (timing the layers on `train`'s
    /// samples) and hands the stage's session to `drive`, whose result it returns; a ps
    /// task serves every stage's variables (`cfg.ps`), an evaluator evaluates the
    /// checkpoints on `test`, and both return `None`. Every replica task runs every step
    /// with its replica's share of the batch ([`Session::data_shard`]). Events are printed
    /// by the task that reports (replica 0's last stage) and the evaluator.
    pub fn stages<R>(
        &self,
        model: &crate::model::Sequential,
        cfg: &crate::pipeline::PipelineConfig,
        (train, test): (&Dataset, &Dataset),
        drive: impl for<'a> FnOnce(StagesSession<'a, MpiComm>) -> Result<R, TrainError>,
    ) -> Result<Option<R>, ServerError> {
        let reporter = crate::pipeline::train::reporter(&self.layout);
        let prints = reporter == Some(self.rank) || self.is_evaluator();
        let mut events = |e: &Event| {
            if prints {
                println!("{e}")
            }
        };
        let (comm, layout, data) = (&self.comm, &self.layout, (train, test));
        let scope = crate::pipeline::train::scope;
        Ok(scope(comm, layout, model, cfg, data, &mut events, drive)?)
    }

    /// A worker's training session of `model` against the ps tasks, as `cfg` says (its
    /// events printed by the chief).
    pub fn session<'s>(
        &'s self,
        model: &'s dyn Model,
        cfg: &PsConfig,
    ) -> Result<MonitoredSession<'s, 's, MpiComm>, ServerError> {
        let roles = self
            .roles
            .as_ref()
            .ok_or_else(|| self.role_error("a training session needs a ps job"))?;
        Ok(MonitoredSession::for_worker(&self.comm, roles, model, cfg)?)
    }
}
