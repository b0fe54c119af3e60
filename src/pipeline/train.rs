//! Pipeline training (`mpiflow train --stages S --micro-batches M --schedule gpipe|1f1b`,
//! `--mode allreduce` or `--mode ps`): every replica (a `replica_N` job) runs the model
//! split into S stages, one per task; replicas train on their shares of the global batch.
//!
//! A step: each replica cuts its share into M micro-batches and runs them through its
//! stages in the schedule's order, activations forward and their gradients backward by
//! [`super::link`]; each stage sums its parameters' gradients over the micro-batches,
//! the replicas' stage-k tasks sum theirs by a fused allreduce on a communicator of
//! their own, and dividing by the global batch gives exactly the combined batch's
//! gradient. Every task then applies the optimizer to its own parameters (with ps tasks,
//! each stage's gradients go to its own ps job instead: [`super::update`]). One small sum
//! over every replica task carries the step's word (the loss, a non-finite value, a stop
//! signal) so all of them reach the same verdict.
//!
//! Evaluation runs the held-out samples through replica 0's stages; its last stage
//! reports. With `save_params`, replica 0's stages send their parameters to its last
//! stage, which writes the whole model (the checkpoint file format).

use std::ops::Range;
use std::time::Instant;

use super::link::{Link, LinkError};
use super::partition::{self, Balance};
use super::passes::{run_passes, MicroBatches, PassTimes};
use super::ps::{StageClient, StagePs};
use super::report::{describe_partition, evaluate, report_stages, StageReport};
use super::save::{self, Saver, Writers};
use super::schedule::{self, Schedule};
use super::stage::Stage;
use super::update::Updater;
use super::PartitionError;
use crate::cluster::Layout;
use crate::model::{Model, ModelError, Sequential};
use crate::observe::phases::{Clock, Phase};
use crate::observe::stall::{self, Wait};
use crate::observe::timeline::{self, Detail};
use crate::tensor::{DType, Tensor};
use crate::train::data::{shard, Batches, Dataset};
use crate::train::events::Event;
use crate::train::resources;
use crate::train::{checkpoint, guard, StepLog, Stopped, TrainConfig};
use crate::transport::fusion::{Fusion, FusionConfig, FusionError};
use crate::transport::{Collectives, Comm, ReduceOp, TransportError};

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

/// The world rank that reports (replica 0's last stage), if the cluster has replicas.
pub fn reporter(layout: &Layout) -> Option<usize> {
    let (_, stages) = layout.spec.replica_shape()?;
    layout
        .ranks
        .iter()
        .position(|r| layout.spec.replica_stage(&r.task) == Some((0, stages - 1)))
}

/// What every replica task says about a step, summed over all of them: the last stages'
/// sample-weighted losses and samples, how many saw a NaN and an infinite loss, how many
/// stages' reduced gradients were not finite, how many tasks were asked to stop and the
/// sum of their signal numbers.
struct Verdict(Tensor);

impl Verdict {
    fn new() -> Verdict {
        Verdict(
            Tensor::zeros(DType::F32, &[7])
                .expect("1-D")
                .named("pipeline verdict"),
        )
    }

    fn values(&self) -> &[f32] {
        self.0.as_slice::<f32>().expect("f32")
    }

    /// This task's word: its loss sum over its `samples` (the last stage's), whether its
    /// reduced gradients are finite, the signal it was sent.
    fn fill(&mut self, loss_sum: f32, samples: usize, grads_finite: bool, signal: Option<i32>) {
        let flag = |b: bool| f32::from(u8::from(b));
        self.0
            .as_mut_slice::<f32>()
            .expect("f32")
            .copy_from_slice(&[
                if loss_sum.is_finite() { loss_sum } else { 0.0 },
                samples as f32,
                flag(loss_sum.is_nan()),
                flag(loss_sum.is_infinite()),
                flag(!grads_finite),
                flag(signal.is_some()),
                signal.unwrap_or(0) as f32,
            ]);
    }

    /// After the sum: a non-finite loss or gradient anywhere stops every task.
    fn check(&self, step: u64, replicas: usize) -> Result<(), PipelineError> {
        let v = self.values();
        if v[2] + v[3] > 0.0 {
            let value = if v[2] > 0.0 { f32::NAN } else { f32::INFINITY };
            let whose = format!(" on {} of {replicas} replicas", (v[2] + v[3]) as usize);
            guard::check_loss(step, value, whose)?;
        }
        if v[4] > 0.0 {
            return Err(PipelineError::NonFinite(guard::NonFinite::Gradient {
                step,
                tensor: format!("(the reduced gradients of {} stages)", v[4] as usize),
                value: "a non-finite value".into(),
                whose: String::new(),
            }));
        }
        Ok(())
    }

    fn loss(&self) -> f32 {
        let v = self.values();
        v[0] / v[1].max(1.0)
    }

    fn stop(&self) -> Option<i32> {
        let v = self.values();
        (v[5] > 0.0).then(|| (v[6] / v[5]).round() as i32)
    }
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
        let served = crate::train::ps::server::serve_many(&jobs, me.task.index, ps.peer_timeout);
        return served.map_err(PipelineError::from);
    }
    let dir = cfg.train.checkpoint_dir.as_deref();
    let Some((replica, stage)) = place else {
        // (Replica jobs of different shapes stop the replica tasks before training: no
        // end notice comes then.)
        let evaluator = crate::train::sidecar::take_part;
        if shape.is_some() && evaluator(comm, layout, model, test, dir, events)? {
            return Ok(());
        }
        events(&Event::Warning(format!(
            "{} (rank {}): not a replica in pipeline training; idle",
            me.task,
            comm.rank()
        )));
        return Ok(());
    };
    let Some((replicas, stages)) = shape else {
        return Err(PipelineError::Config(
            "the replica jobs (replica_0, replica_1, ...) differ in their number of stages".into(),
        ));
    };
    // Dropped on every way out of training, by the task that reports: the evaluators end.
    let reports = reporter(layout) == Some(comm.rank());
    let evaluators = crate::train::sidecar::evaluators(layout);
    let _end = crate::train::sidecar::EndNotice::by(reports, comm, evaluators, dir);
    // With ps tasks, any error of this task reaches them (they tell the stage's others),
    // so none waits for a task that stopped.
    let result = (|| -> Result<(), PipelineError> {
        let group = Collectives::new(group);
        let peers = Collectives::new(peers);
        crate::model::check_data(model, "train", train.features, train.classes)?;
        let share = cfg.train.batch / replicas;
        if cfg.micro_batches == 0 || share < cfg.micro_batches {
            return Err(PipelineError::Config(format!(
                "--micro-batches {}: each of the {replicas} replicas' share of batch {} is {share} samples; take 1 to {share} micro-batches",
                cfg.micro_batches, cfg.train.batch
            )));
        }
        let members = members(layout);
        // Replica 0's stage 0 coordinates: it times the layers and checkpoints.
        let coordinator = members
            .iter()
            .position(|r| layout.spec.replica_stage(&layout.ranks[*r].task) == Some((0, 0)))
            .unwrap_or(0);
        // Rows of a micro-batch (the last may hold fewer).
        let rows = share.div_ceil(cfg.micro_batches);
        let costs = layer_costs(&group, coordinator, model, cfg.balance, rows)?;
        let sizes = model.layer_param_bytes();
        let limit = cfg.max_param_bytes.map(|l| (sizes.as_slice(), l));
        let ranges = partition::balance_within(&costs, stages, limit)?;
        agree_on_plan(&group, layout, &members, &plan(model, &ranges, cfg))?;
        let mut st =
            Stage::new(model, &ranges, stage, cfg.train.seed)?.with_towers(cfg.train.towers);
        // What this task will hold must fit its share of the node, on every task.
        let plan_ops = schedule::ops(cfg.schedule, stage, stages, cfg.micro_batches);
        let need = st.need(
            rows,
            schedule::peak_in_flight(&plan_ops),
            &cfg.train.optimizer,
        );
        let task = me.task.to_string();
        let fits = resources::check(&task, &need, cfg.memory_share.as_ref());
        save::agree(&group, fits.map_err(|e| e.to_string()))?;
        let reporting = replica == 0 && st.is_last();
        if reporting {
            events(&Event::Note(format!(
                "pipeline: {replicas} replicas x {stages} stages, {} micro-batches per replica step, schedule {}; by {} cost: {}",
                cfg.micro_batches,
                crate::named::Named::name(cfg.schedule),
                crate::named::Named::name(cfg.balance),
                describe_partition(model, &ranges).join("; ")
            )));
        }
        let writers = Writers {
            coordinator,
            writes: replica == 0,
        };
        let saver = cfg.train.checkpoint_dir.as_deref().map(|dir| Saver {
            group: &group,
            who: writers,
            dir,
            model,
            keep: cfg.train.keep_checkpoints,
        });
        let mut updater = match (&cfg.ps, stage_jobs.get(stage)) {
            (Some(ps), Some((sub, Some(roles)))) => {
                let vars = crate::model::variables(&st.params);
                let client = StageClient::new(sub, roles, ps, &vars, stage, replicas, cfg);
                Updater::Ps { client }
            }
            _ => Updater::Allreduce {
                peers: Box::new(peers),
                fusion: Fusion::new(cfg.fusion),
                opt: cfg.train.optimizer,
                slots: st
                    .params
                    .iter()
                    .map(|p| cfg.train.optimizer.state(p.numel()))
                    .collect(),
            },
        };
        let mut step = updater.start(saver.as_ref(), &mut st, replica == 0, events)?;
        let pipe = Collectives::new(pipe);
        let mut link = Link::new(pipe.comm());
        let mut batches = Batches::new(train.len(), cfg.train.batch, cfg.train.seed);
        let mut clock = Clock::new();
        let mut verdict = Verdict::new();
        let mut peak_activations = 0usize;
        let mut passes = PassTimes::default();
        let mut last_ckpt = step;
        let first_step = step;
        let mut steps = || -> Result<Option<i32>, PipelineError> {
            while step < cfg.train.steps {
                let signal = crate::signals::stop_requested_if(cfg.train.stop_on_signal);
                let t = Instant::now();
                link.step = step;
                // A signal to a ps task reaches the stage tasks in its pull replies.
                let signal = signal.or(updater.begin(step, &mut st)?);
                let global = batches.global(step);
                let mine = shard(&global, replica, replicas);
                let micro = MicroBatches {
                    data: train,
                    mine,
                    count: cfg.micro_batches,
                };
                let (loss_sum, times) = run_passes(&mut st, &mut link, &plan_ops, &micro)?;
                let mut waited = times.idle;
                if step > first_step {
                    // The first step pays for allocations and first contacts.
                    passes.total += times.total;
                    passes.idle += times.idle;
                }
                let w = Instant::now();
                let reducing = stall::wait(|| Wait {
                    op: "allreduce",
                    step,
                    what: Some("the stage's gradients and the step's verdict".into()),
                    peer: None,
                    bytes: st.param_bytes() as u64,
                });
                updater.reduce(&mut st, mine.len(), global.len())?;
                let grads_finite = st
                    .grads
                    .iter()
                    .all(|g| guard::all_finite(g.as_slice::<f32>().expect("f32")));
                let samples = if st.is_last() { mine.len() } else { 0 };
                verdict.fill(loss_sum, samples, grads_finite, signal);
                group.allreduce_tensor(&mut verdict.0, ReduceOp::Sum, cfg.fusion.algorithm)?;
                drop(reducing);
                verdict.check(step, replicas)?;
                let loss = if st.is_last() {
                    loss_sum / mine.len().max(1) as f32
                } else {
                    f32::NAN
                };
                updater.apply(&mut st, step, mine.len(), loss)?;
                waited += w.elapsed();
                timeline::span(
                    "reduce and update",
                    "comm",
                    w,
                    Instant::now(),
                    Detail::at(step),
                );
                clock.charge(Phase::Comm, waited);
                clock.charge(Phase::Compute, t.elapsed().saturating_sub(waited));
                clock.steps(1);
                peak_activations = peak_activations.max(st.take_peak_bytes());
                step += 1;
                if cfg.check_every > 0 && step.is_multiple_of(cfg.check_every) {
                    updater.compare(&st, step)?;
                }
                let every = cfg.train.log_every;
                if every > 0 && step.is_multiple_of(every) {
                    let mine = clock.take();
                    let ranks = crate::train::allreduce::gather_times(
                        &group,
                        layout,
                        comm.rank(),
                        mine,
                        step,
                    )?;
                    if reporting {
                        let batch = cfg.train.batch;
                        let log = StepLog::of_window(step, verdict.loss(), &mine, batch, ranks);
                        events(&Event::Step(log));
                    }
                }
                let every = cfg.train.checkpoint_every;
                let due = every > 0 && step.is_multiple_of(every) && step < cfg.train.steps;
                let stop = verdict.stop();
                if let (Some(at), true) = (&saver, due || (stop.is_some() && last_ckpt != step)) {
                    updater.checkpoint(at, step, &mut st, events)?;
                    last_ckpt = step;
                }
                if stop.is_some() {
                    // Every task stops after the same step, its checkpoint kept.
                    return Ok(stop);
                }
            }
            if let (Some(at), true) = (&saver, last_ckpt != step) {
                updater.checkpoint(at, step, &mut st, events)?;
            }
            Ok(None)
        };
        let stopped = steps()?;
        updater.finish(&mut st, step, stopped)?;
        if let Some(signal) = stopped {
            let dir = cfg.train.checkpoint_dir.as_deref();
            return Err(Stopped {
                signal: crate::signals::name(signal),
                step,
                checkpoint: dir.map(|d| crate::train::checkpoint::path_of(d, step)),
            }
            .into());
        }
        let mine = StageReport {
            stage,
            param_bytes: st.param_bytes(),
            state_bytes: updater.state_bytes(),
            peak_activation_bytes: peak_activations,
            pass_secs: passes.total.as_secs_f64(),
            idle_secs: passes.idle.as_secs_f64(),
        };
        report_stages(&group, mine, cfg.micro_batches, reporting, events)?;
        if replica == 0 {
            evaluate(&mut st, &mut link, test, step, events)?;
            if let Some(path) = &cfg.train.save_params {
                save::save_params(&st, &mut link, model, path, step)?;
            }
        }
        Ok(())
    })();
    if let (Err(e), Some((sub, Some(roles)))) = (&result, stage_jobs.get(stage)) {
        use crate::train::ps::worker::{abort, abort_agreed};
        match e {
            PipelineError::Stopped(_) => {}
            // Every replica task stops with it: the ps tasks end once all said so.
            e if e.is_agreed() => abort_agreed(sub, roles, &e.to_string()),
            e => abort(sub, roles, &e.to_string()),
        }
    }
    result
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
