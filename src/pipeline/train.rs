//! Pipeline training (`mpiflow train --stages S --micro-batches M --schedule gpipe|1f1b`,
//! `--mode allreduce` or `--mode ps`): every replica (a `replica_N` job) runs the model
//! split into S stages, one per task; replicas train on their shares of the global batch.
//!
//! A step: each replica cuts its share into M micro-batches and runs them through its
//! stages in the schedule's order, activations forward and their gradients backward by
//! `super::link`; each stage sums its parameters' gradients over the micro-batches,
//! the replicas' stage-k tasks sum theirs by a fused allreduce on a communicator of
//! their own, and dividing by the global batch gives exactly the combined batch's
//! gradient. Every task then applies the optimizer to its own parameters (with ps tasks,
//! each stage's gradients go to its own ps job instead: `super::update`). One small sum
//! over every replica task carries the step's word (the loss, a non-finite value, a stop
//! signal) so all of them reach the same verdict.
//!
//! Evaluation runs the held-out samples through replica 0's stages; its last stage
//! reports. With `save_params`, replica 0's stages send their parameters to its last
//! stage, which writes the whole model (the checkpoint file format).

use std::ops::Range;

use super::link::{Link, LinkError};
use super::partition::{self, Balance};
use super::passes::PassTimes;
use super::ps::{StageClient, StagePs};
use super::report::{describe_partition, report_stages};
use super::save::{self, Writers};
use super::schedule::{self, Schedule};
use super::stage::Stage;
use super::stages::{Place, Stages};
use super::update::Updater;
use super::PartitionError;
use crate::cluster::Layout;
use crate::model::{Model, ModelError, Sequential};
use crate::train::data::Dataset;
use crate::train::engine::{Session, TrainError};
use crate::train::events::Event;
use crate::train::resources;
use crate::train::{checkpoint, guard, Stopped, TrainConfig};
use crate::transport::fusion::{Fusion, FusionConfig, FusionError};
use crate::transport::{Collectives, Comm, TransportError};

/// Settings of pipeline training.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    pub train: TrainConfig,
    /// Micro-batches a replica's share of a step is cut into.
    pub micro_batches: usize,
    pub schedule: Schedule,
    /// How the layers are weighed to balance the stages.
    pub balance: Balance,
    /// The most parameter bytes one task may hold (`--max-param-bytes`): the stages are
    /// cut so that none holds more.
    pub max_param_bytes: Option<u64>,
    /// The memory each task may use ([`resources::share`]); `None`: not checked.
    pub memory_share: Option<resources::Share>,
    /// Parameter servers hold the variables (`--mode ps`); `None`: the replicas' stage
    /// tasks sum their gradients by allreduce.
    pub ps: Option<StagePs>,
    /// How the replicas' stage-k tasks sum their gradients.
    pub fusion: FusionConfig,
    /// Compare the replicas' parameter checksums, stage by stage, every N steps (0: never).
    pub check_every: u64,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            train: TrainConfig::default(),
            micro_batches: 4,
            schedule: Schedule::OneFOneB,
            balance: Balance::default(),
            max_param_bytes: None,
            memory_share: None,
            ps: None,
            fusion: FusionConfig::default(),
            check_every: 100,
        }
    }
}

/// Errors of pipeline training.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PipelineError {
    #[error("{0}")]
    Transport(#[from] TransportError),
    #[error("{0}")]
    Link(#[from] LinkError),
    #[error("{0}")]
    Fusion(#[from] FusionError),
    #[error("{0}")]
    Model(#[from] ModelError),
    #[error("{0}")]
    Partition(#[from] PartitionError),
    #[error("{0}")]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error("{0}")]
    NonFinite(#[from] guard::NonFinite),
    #[error("{0}")]
    Stopped(#[from] Stopped),
    #[error(
        "replicas diverged at step {step}: stage {stage} of replica {replica} differs from replica 0's"
    )]
    Diverged {
        step: u64,
        stage: usize,
        replica: usize,
    },
    /// A setting every rank judges alike (so every rank stops with it).
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Ps(String),
    /// On a ps task: the replica tasks stopped with this error, agreed among them (they
    /// print it).
    #[error("{0}")]
    Ended(String),
    #[error("{0}")]
    Sidecar(#[from] crate::train::sidecar::SidecarError),
    #[error("{task} (rank {rank}): {what}")]
    Mismatch {
        task: String,
        rank: usize,
        what: String,
    },
}

impl PipelineError {
    /// True for an error every replica task raises at the same point, so none is left
    /// waiting on another.
    pub fn is_agreed(&self) -> bool {
        matches!(
            self,
            PipelineError::NonFinite(_)
                | PipelineError::Stopped(_)
                | PipelineError::Diverged { .. }
                | PipelineError::Config(_)
                | PipelineError::Partition(_)
                | PipelineError::Mismatch { .. }
                | PipelineError::Ended(_)
        )
    }
}

impl From<PipelineError> for TrainError {
    /// A stage's error, as the step loop carries it.
    fn from(e: PipelineError) -> TrainError {
        match e {
            PipelineError::Transport(e) => TrainError::Transport(e),
            PipelineError::Fusion(e) => TrainError::Fusion(e),
            PipelineError::Model(e) => TrainError::Model(e),
            PipelineError::Checkpoint(e) => TrainError::Checkpoint(e),
            PipelineError::NonFinite(e) => TrainError::NonFinite(e),
            PipelineError::Stopped(e) => TrainError::Stopped(e),
            PipelineError::Sidecar(e) => TrainError::Sidecar(e),
            e if e.is_agreed() => TrainError::Agreed(e.to_string()),
            e => TrainError::Setup(e.to_string()),
        }
    }
}

impl From<TrainError> for PipelineError {
    /// A stage's session's error, as pipeline training says it.
    fn from(e: TrainError) -> PipelineError {
        match e {
            TrainError::Transport(e) => PipelineError::Transport(e),
            TrainError::Fusion(e) => PipelineError::Fusion(e),
            TrainError::Model(e) => PipelineError::Model(e),
            TrainError::Checkpoint(e) => PipelineError::Checkpoint(e),
            TrainError::NonFinite(e) => PipelineError::NonFinite(e),
            TrainError::Stopped(e) => PipelineError::Stopped(e),
            TrainError::Sidecar(e) => PipelineError::Sidecar(e),
            e if e.is_agreed() => PipelineError::Config(e.to_string()),
            e => PipelineError::Ps(e.to_string()),
        }
    }
}

/// The world rank that reports (replica 0's last stage), if the cluster has replicas.
pub fn reporter(layout: &Layout) -> Option<usize> {
    let (_, stages) = layout.spec.replica_shape()?;
    layout
        .ranks
        .iter()
        .position(|r| layout.spec.replica_stage(&r.task) == Some((0, stages - 1)))
}

/// The plan every replica task must share, compared before the first step.
fn plan(model: &Sequential, ranges: &[Range<usize>], cfg: &PipelineConfig) -> String {
    format!(
        "model {}; stages {ranges:?}; --micro-batches {}; --schedule {}; --balance {}; batch {}; seed {}; --towers {}",
        model.describe(),
        cfg.micro_batches,
        crate::named::Named::name(cfg.schedule),
        crate::named::Named::name(cfg.balance),
        cfg.train.batch,
        cfg.train.seed,
        cfg.train.towers
    )
}

/// A replica task's session of pipeline training: the step loop over its stage's
/// [`Stages`] strategy (it lives inside [`scope`], which holds the communicators).
pub type StagesSession<'a, C> = Session<'a, 'a, Stages<'a, C>>;

/// Runs this rank's part of pipeline training; `events` sees what this rank reports
/// (replica 0's last stage reports the steps and the accuracy).
pub fn run<C: Comm>(
    comm: &C,
    layout: &Layout,
    model: &Sequential,
    cfg: &PipelineConfig,
    train: &Dataset,
    test: &Dataset,
    events: &mut dyn FnMut(&Event),
) -> Result<(), PipelineError> {
    let data = (train, test);
    scope(comm, layout, model, cfg, data, events, |s| {
        finish(s, cfg, train, test)
    })
    .map(drop)
}

/// Trains a replica task's session to its end: every step, the last checkpoint, the
/// stages' report (memory, bubble), the last evaluation.
fn finish<C: Comm>(
    sess: StagesSession<'_, C>,
    pipeline: &PipelineConfig,
    train: &Dataset,
    test: &Dataset,
) -> Result<(), TrainError> {
    let cfg = &pipeline.train;
    let mut sess = crate::train::evaluating(sess, cfg, test);
    crate::train::fit(&mut sess, cfg, train)?;
    sess.save()?;
    let (mine, reporting) = (sess.strategy().stage_report(), sess.is_chief());
    let (group, micro) = (sess.strategy().group, pipeline.micro_batches);
    report_stages(group, mine, micro, reporting, &mut |e| sess.report(e))?;
    sess.evaluate_now(test)?;
    sess.close()?;
    Ok(())
}

/// Pipeline training as the program drives it: every rank of `comm` calls it (the
/// communicators of replicas and stages are made by all of them). On a replica task it
/// plans the stages (timing the layers on `train`'s samples), opens the session and
/// hands it to `drive`, whose result it returns; a ps task serves every stage's job, an
/// evaluator evaluates the checkpoints on `test`, and both return `None`.
pub fn scope<C: Comm, R>(
    comm: &C,
    layout: &Layout,
    model: &Sequential,
    cfg: &PipelineConfig,
    (train, test): (&Dataset, &Dataset),
    events: &mut dyn FnMut(&Event),
    drive: impl for<'a> FnOnce(StagesSession<'a, C>) -> Result<R, TrainError>,
) -> Result<Option<R>, PipelineError> {
    let me = &layout.ranks[comm.rank()];
    let place = layout.spec.replica_stage(&me.task);
    let shape = layout.spec.replica_shape();
    let (replicas, stages) = shape.unwrap_or((0, 0));
    // Communicators, made by every rank (collectives): every replica task; a replica's
    // stages (rank = stage); the replicas' tasks of one stage (rank = replica).
    let (replica, stage) = place.unwrap_or((replicas, stages));
    let group = comm.split(u32::from(place.is_none()), comm.rank())?;
    let pipe = comm.split(replica as u32, stage)?;
    let peers = comm.split(stage as u32, replica)?;
    // With ps tasks, each stage's tasks and the ps tasks: one job per stage.
    let stage_jobs = match cfg.ps {
        Some(_) => (0..stages)
            .map(|k| super::ps::stage_job(comm, layout, k))
            .collect::<Result<Vec<_>, _>>()?,
        None => Vec::new(),
    };
    if let (Some(ps), "ps") = (&cfg.ps, me.task.job.as_str()) {
        let jobs: Vec<(&C, &crate::train::ps::Roles)> = stage_jobs
            .iter()
            .filter_map(|(c, r)| r.as_ref().map(|r| (c, r)))
            .collect();
        let served =
            crate::train::ps::server::serve_many(&jobs, me.task.index, ps.peer_timeout, None);
        return served.map(|()| None).map_err(PipelineError::from);
    }
    let dir = cfg.train.checkpoint_dir.as_deref();
    let Some((replica, stage)) = place else {
        // (Replica jobs of different shapes stop the replica tasks before training: no
        // end notice comes then.)
        let evaluator = crate::train::sidecar::take_part;
        if shape.is_some() && evaluator(comm, layout, model, test, dir, events)? {
            return Ok(None);
        }
        events(&Event::Warning(format!(
            "{} (rank {}): not a replica in pipeline training; idle",
            me.task,
            comm.rank()
        )));
        return Ok(None);
    };
    let Some((replicas, _)) = shape else {
        return Err(PipelineError::Config(
            "the replica jobs (replica_0, replica_1, ...) differ in their number of stages".into(),
        ));
    };
    // Dropped on every way out of training, by the task that reports: the evaluators end.
    let reports = reporter(layout) == Some(comm.rank());
    let evaluators = crate::train::sidecar::evaluators(layout);
    let _end = crate::train::sidecar::EndNotice::by(reports, comm, evaluators, dir);
    let ps_job = stage_jobs
        .get(stage)
        .and_then(|(sub, roles)| roles.as_ref().map(|r| (sub, r)));
    let place = Place {
        replica,
        replicas,
        stage,
    };
    let (group, pipe) = (Collectives::new(group), Collectives::new(pipe));
    let members = members(layout);
    let coordinator = (members.iter())
        .position(|r| layout.spec.replica_stage(&layout.ranks[*r].task) == Some((0, 0)))
        .unwrap_or(0);
    let task = Task {
        comm,
        layout,
        model,
        cfg,
        place,
        group: &group,
        members,
        coordinator,
        ps_job,
    };
    // Before the session, a failure of this task reaches the ps tasks here (they tell the
    // stage's others); within it, the strategy tells them.
    let ranges = match task.plan(train) {
        Ok(r) => r,
        Err(e) => return Err(task.tell_ps(e)),
    };
    let part = model.part(ranges[stage].clone())?;
    let strategy = match task.strategy(&part, &ranges, pipe.comm(), peers, events) {
        Ok(s) => s,
        Err(e) => return Err(task.tell_ps(e)),
    };
    let sess = Session::with_events(strategy, &cfg.train, &mut *events)?;
    drive(sess).map(Some).map_err(PipelineError::from)
}

/// A replica task setting up and running its part of pipeline training.
struct Task<'a, C: Comm> {
    comm: &'a C,
    layout: &'a Layout,
    model: &'a Sequential,
    cfg: &'a PipelineConfig,
    place: Place,
    /// Every replica task.
    group: &'a Collectives<C>,
    /// The replica tasks' world ranks, and the place among them of the coordinator (replica
    /// 0's stage 0: it times the layers and checkpoints).
    members: Vec<usize>,
    coordinator: usize,
    /// The stage's ps job, if ps tasks hold the variables.
    ps_job: Option<(&'a C, &'a crate::train::ps::Roles)>,
}

impl<'a, C: Comm> Task<'a, C> {
    /// `e`, told to the stage's ps tasks (which tell the stage's others) first.
    fn tell_ps(&self, e: PipelineError) -> PipelineError {
        use crate::train::ps::worker::{abort, abort_agreed};
        if let Some((sub, roles)) = self.ps_job {
            match e.is_agreed() {
                true => abort_agreed(sub, roles, &e.to_string()),
                false => abort(sub, roles, &e.to_string()),
            }
        }
        e
    }

    /// The stages' layers, the same on every replica task (checked): the model's layers
    /// cut by their costs.
    fn plan(&self, train: &Dataset) -> Result<Vec<Range<usize>>, PipelineError> {
        let (cfg, model, replicas) = (self.cfg, self.model, self.place.replicas);
        crate::model::check_data(model, "train", train.features, train.classes)?;
        let share = cfg.train.batch / replicas;
        if cfg.micro_batches == 0 || share < cfg.micro_batches {
            return Err(PipelineError::Config(format!(
                "--micro-batches {}: each of the {replicas} replicas' share of batch {} is {share} samples; take 1 to {share} micro-batches",
                cfg.micro_batches, cfg.train.batch
            )));
        }
        let costs = layer_costs(
            self.group,
            self.coordinator,
            model,
            cfg.balance,
            self.rows(),
        )?;
        let sizes = model.layer_param_bytes();
        let limit = cfg.max_param_bytes.map(|l| (sizes.as_slice(), l));
        let stages = self.layout.spec.replica_shape().map_or(1, |s| s.1);
        let ranges = partition::balance_within(&costs, stages, limit)?;
        agree_on_plan(
            self.group,
            self.layout,
            &self.members,
            &plan(model, &ranges, cfg),
        )?;
        Ok(ranges)
    }

    /// Rows of a micro-batch (the last may hold fewer).
    fn rows(&self) -> usize {
        let share = self.cfg.train.batch / self.place.replicas;
        share.div_ceil(self.cfg.micro_batches)
    }

    /// This task's strategy: its stage holding `part`, checked to fit its share of the
    /// node on every task, and how its gradients become the update.
    fn strategy(
        &self,
        part: &'a crate::model::Part<'a>,
        ranges: &[Range<usize>],
        pipe: &'a C,
        peers: C,
        events: &mut dyn FnMut(&Event),
    ) -> Result<Stages<'a, C>, PipelineError> {
        let (cfg, place) = (self.cfg, self.place);
        let st = Stage::new(part, ranges, place.stage, cfg.train.seed)?;
        let st = st.with_towers(cfg.train.towers);
        // What this task will hold must fit its share of the node, on every task.
        let stages = ranges.len();
        let ops = schedule::ops(cfg.schedule, place.stage, stages, cfg.micro_batches);
        let in_flight = schedule::peak_in_flight(&ops);
        let need = st.need(self.rows(), in_flight, &cfg.train.optimizer);
        let task = self.layout.ranks[self.comm.rank()].task.to_string();
        let fits = resources::check(&task, &need, cfg.memory_share.as_ref());
        save::agree(self.group, fits.map_err(|e| e.to_string()))?;
        if place.replica == 0 && st.is_last() {
            events(&Event::Note(format!(
                "pipeline: {} replicas x {stages} stages, {} micro-batches per replica step, schedule {}; by {} cost: {}",
                place.replicas,
                cfg.micro_batches,
                crate::named::Named::name(cfg.schedule),
                crate::named::Named::name(cfg.balance),
                describe_partition(self.model, ranges).join("; ")
            )));
        }
        let updater = match (&cfg.ps, self.ps_job) {
            (Some(ps), Some((sub, roles))) => {
                let vars = crate::model::variables(&st.replica.params);
                let client =
                    StageClient::new(sub, roles, ps, &vars, place.stage, place.replicas, cfg);
                Updater::Ps { client }
            }
            _ => Updater::Allreduce {
                peers: Box::new(Collectives::new(peers)),
                fusion: Fusion::new(cfg.fusion),
                opt: cfg.train.optimizer,
                slots: (st.replica.params.iter())
                    .map(|p| cfg.train.optimizer.state(p.numel()))
                    .collect(),
            },
        };
        Ok(Stages {
            st,
            updater,
            link: Link::new(pipe),
            group: self.group,
            layout: self.layout,
            rank: self.comm.rank(),
            cfg,
            model: self.model,
            ops,
            place,
            writers: Writers {
                coordinator: self.coordinator,
                writes: place.replica == 0,
            },
            ps_job: self.ps_job,
            applying: (0, f32::NAN),
            stale: false,
            step: 0,
            first: 0,
            peak_activations: 0,
            passes: PassTimes::default(),
        })
    }
}

/// The layers' costs by `balance`: counted on every task, or timed by the coordinator on
/// a micro-batch of `rows` samples and sent to every task (so all cut alike).
fn layer_costs<C: Comm>(
    group: &Collectives<C>,
    coordinator: usize,
    model: &Sequential,
    balance: Balance,
    rows: usize,
) -> Result<Vec<f64>, PipelineError> {
    if balance == Balance::Counted {
        return Ok(model.layer_costs());
    }
    let mut mine = Vec::new();
    if group.rank() == coordinator {
        let costs = partition::measure_layer_costs(model, rows, 5)?;
        mine = costs.iter().flat_map(|c| c.to_le_bytes()).collect();
    }
    let got = group.bcast_varlen(mine, coordinator)?;
    Ok(got
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// The replica tasks' world ranks, in order: the ranks of the replica tasks'
/// communicator.
fn members(layout: &Layout) -> Vec<usize> {
    (0..layout.ranks.len())
        .filter(|r| layout.spec.replica_stage(&layout.ranks[*r].task).is_some())
        .collect()
}

/// Every replica task's plan against rank 0's: the first that differs is named.
fn agree_on_plan<C: Comm>(
    group: &Collectives<C>,
    layout: &Layout,
    members: &[usize],
    plan: &str,
) -> Result<(), PipelineError> {
    let all = group.allgather_varlen(plan.as_bytes())?;
    let Some(i) = all.iter().position(|p| *p != all[0]) else {
        return Ok(());
    };
    let rank = members.get(i).copied().unwrap_or(i);
    let first = members.first().copied().unwrap_or(0);
    Err(PipelineError::Mismatch {
        task: layout.ranks[rank].task.to_string(),
        rank,
        what: format!(
            "its pipeline ({}) differs from rank {first}'s ({})",
            String::from_utf8_lossy(&all[i]),
            String::from_utf8_lossy(&all[0])
        ),
    })
}
