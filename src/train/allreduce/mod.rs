//! Synchronous replica training by allreduce (`mpiflow train --mode allreduce`).
//!
//! Every worker (the `chief` and `worker` tasks; ps and evaluator tasks take no part and
//! are told so) holds all parameters. The chief's initial values, or the checkpoint it
//! restored (parameters, optimizer state and step), are broadcast; each step every replica
//! computes gradients on its shard of the global batch, scales them by its sample count,
//! and the fused allreduce sums them, so dividing by the global batch gives exactly the
//! combined batch's gradient; every replica then applies the same optimizer step.
//!
//! Replicas stay identical: every `check_every` steps the ranks compare a checksum of
//! their parameters and stop with an error naming the rank that diverged. The chief alone
//! writes checkpoints (the same atomic, verified format as ps mode).
//!
//! Gradients are reduced after the whole backward pass as one fused allreduce (buffers of
//! at most `fusion.threshold_bytes`, by `fusion.algorithm`: `mpiflow train
//! --fusion-threshold --allreduce-algorithm`; a threshold of 1 byte reduces them one by
//! one), or with `overlap` layer by layer during the backward pass, on a communication
//! thread. Each replica's word on the step (its loss, a non-finite loss, a stop signal)
//! is summed in the same reduction, so every replica reaches the same verdict without a
//! message of its own. The chief logs once what a step's reduction takes (allreduce calls
//! and bytes).

use std::time::Instant;

mod reducer;

use super::checkpoint::{self, State};
use super::data::{shard, Batches, Dataset};
use super::events::Event;
use super::guard;
use super::optim::Slots;
use super::{StepLog, TrainConfig};
use crate::cluster::Layout;
use crate::model::{Model, Replica};
use crate::observe::phases::{self, Clock, Phase, RankTimes, Times};
use crate::observe::stall::{self, Wait};
use crate::observe::timeline::{self, Detail};
use crate::tensor::Tensor;
use crate::transport::fusion::{FusionConfig, FusionError};
use crate::transport::{Collectives, Comm, TransportError};
use reducer::{Reducer, Verdict};

/// Settings of allreduce training.
#[derive(Debug, Clone)]
pub struct AllreduceConfig {
    pub train: TrainConfig,
    /// Compare parameter checksums every N steps (0: never).
    pub check_every: u64,
    /// Reduce each layer's gradients during the backward pass, on a communication thread
    /// (needs MPI_THREAD_MULTIPLE under MPI).
    pub overlap: bool,
    /// How the fused path packs gradients, and the allreduce algorithm of either path.
    pub fusion: FusionConfig,
    /// Test-only: this replica nudges one parameter after the first step, so the checksum
    /// check must catch it.
    pub perturb_rank: Option<usize>,
}

impl Default for AllreduceConfig {
    /// The shared defaults, replicas compared every 100 steps, one fused allreduce after
    /// the backward pass (the library's algorithm choice).
    fn default() -> Self {
        AllreduceConfig {
            train: TrainConfig::default(),
            check_every: 100,
            overlap: false,
            fusion: FusionConfig::default(),
            perturb_rank: None,
        }
    }
}

/// Errors of allreduce training.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllreduceError {
    #[error("{0}")]
    Transport(#[from] TransportError),
    #[error("{0}")]
    Fusion(#[from] FusionError),
    #[error("{0}")]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error(
        "replicas diverged at step {step}: rank {rank}'s parameters differ from rank {first}'s"
    )]
    Diverged {
        step: u64,
        rank: usize,
        first: usize,
    },
    #[error("{0}")]
    NonFinite(#[from] guard::NonFinite),
    #[error("{0}")]
    Stopped(#[from] super::Stopped),
    #[error("{0}")]
    Setup(String),
    /// The replicas hold different models (every replica raises it).
    #[error("{0}")]
    Models(String),
    #[error("{0}")]
    Sidecar(#[from] crate::train::sidecar::SidecarError),
}

impl AllreduceError {
    /// True for an error every replica raises at the same step (a non-finite value among
    /// the reduced ones, diverged parameters), so no replica is left waiting on another.
    pub fn is_agreed(&self) -> bool {
        matches!(
            self,
            AllreduceError::NonFinite(_)
                | AllreduceError::Diverged { .. }
                | AllreduceError::Stopped(_)
                | AllreduceError::Models(_)
        )
    }
}

fn params_checksum(model: &Replica<'_>) -> u64 {
    model
        .params
        .iter()
        .fold(0, |h, p| checkpoint::checksum(p.bytes()) ^ h.rotate_left(7))
}

/// Runs this rank's part of allreduce training; `events` sees what the chief reports.
pub fn run<C: Comm + Send>(
    comm: &C,
    layout: &Layout,
    model: &dyn Model,
    cfg: &AllreduceConfig,
    train: &Dataset,
    test: &Dataset,
    events: &mut dyn FnMut(&Event),
) -> Result<(), AllreduceError> {
    let me = &layout.ranks[comm.rank()];
    let worker_id = layout.spec.worker_id(&me.task);
    let sub = comm.split(
        u32::from(worker_id.is_none()),
        worker_id.unwrap_or(comm.rank()),
    )?;
    let dir = cfg.train.checkpoint_dir.as_deref();
    let Some(_) = worker_id else {
        if crate::train::sidecar::take_part(comm, layout, model, test, dir, events)? {
            return Ok(());
        }
        // A warning: every rank prints it (the others' notes only with --verbose).
        events(&Event::Warning(format!(
            "{} (rank {}): not a replica in allreduce mode; idle",
            me.task,
            comm.rank()
        )));
        return Ok(());
    };
    // Dropped on every way out of training: the evaluators then end.
    let evaluators = crate::train::sidecar::evaluators(layout);
    let _end = crate::train::sidecar::EndNotice::by(worker_id == Some(0), comm, evaluators, dir);
    let coll = Collectives::new(sub);
    super::agree_on_model(&coll, model, |i| format!("replica {i}"))?
        .map_err(AllreduceError::Models)?;
    let (w, nw) = (coll.rank(), coll.size());
    let chief = w == 0;
    let mut model = super::initial_replica(model, train, cfg.train.seed)
        .map_err(|e| AllreduceError::Setup(e.to_string()))?;
    let opt = cfg.train.optimizer;
    let mut slots: Vec<Slots> = model.params.iter().map(|p| opt.state(p.numel())).collect();
    let mut step = 0u64;

    // The chief's starting point (fresh or restored, from any mode's checkpoint) goes to
    // every replica.
    let vars = model.variables();
    let mut start_bytes = Vec::new();
    if chief {
        let restored = match &cfg.train.checkpoint_dir {
            Some(dir) => checkpoint::state::restore(dir, &vars, events)?,
            None => None,
        };
        let start = restored.unwrap_or_else(|| State::of_replica(&model, &slots, 0));
        start_bytes = checkpoint::encode(&start.arrays(&vars));
    }
    let start = coll.bcast_varlen(start_bytes, 0)?;
    let arrays = checkpoint::parse(std::path::Path::new("<broadcast>"), &start, None)?;
    let state = State::assemble(std::path::Path::new("<broadcast>"), &[arrays], &vars)?;
    state.apply_to(&mut model, &mut slots, &opt);
    step = step.max(state.step);

    let mut batches = Batches::new(train.len(), cfg.train.batch, cfg.train.seed);
    let mut grads: Vec<Tensor> = model.zeros_like();
    let names = model.model.parameters();
    let what = stall::tensors_label(names.iter().map(|p| p.name.as_str()));
    let comm_thread = if cfg.overlap {
        Some(coll.comm().split(0, w)?)
    } else {
        None
    };
    std::thread::scope(|scope| -> Result<(), AllreduceError> {
        let mut reducer = Reducer::new(scope, comm_thread, &model, cfg.fusion);
        let mut towers = crate::model::towers::Towers::new(cfg.train.towers);
        let mut last_ckpt = step;
        // The log window: its steps, its time in the gradient allreduce, its length.
        let mut clock = Clock::new();
        let mut verdict = Verdict::new();
        while step < cfg.train.steps {
            let global = batches.global(step);
            let mine = shard(&global, w, nw);
            let (x, y) = train.rows(mine);
            // Sum of (mean gradient x samples) over replicas, over the global batch: exact.
            let first = step == state.step;
            verdict.signal = crate::signals::stop_requested_if(cfg.train.stop_on_signal);
            let t = Instant::now();
            verdict.step = step;
            let (secs, stats) = reducer.step(
                &coll,
                (&model, &mut towers),
                &what,
                (&x, &y),
                &mut grads,
                &mut verdict,
            )?;
            let reduced = Instant::now();
            let comm_time = std::time::Duration::from_secs_f64(secs);
            clock.charge(Phase::Comm, comm_time);
            if first && chief {
                let how = if cfg.overlap {
                    "one per layer, overlapped".to_string()
                } else {
                    format!("fused up to {} bytes", cfg.fusion.threshold_bytes)
                };
                let algorithm = crate::named::Named::name(cfg.fusion.algorithm);
                events(&Event::Note(format!(
                    "gradients: {} tensors, {} bytes (and the step's {}-byte verdict), \
                     allreduce calls per step: {} ({how}, algorithm {algorithm}, {nw} replicas)",
                    grads.len(),
                    grads.iter().map(Tensor::nbytes).sum::<usize>(),
                    stats.bytes - grads.iter().map(Tensor::nbytes).sum::<usize>(),
                    stats.messages,
                )));
            }
            let (nan, inf) = verdict.non_finite();
            let stop = verdict.stop().map(crate::signals::name);
            if nan + inf > 0 {
                let value = if nan > 0 { f32::NAN } else { f32::INFINITY };
                let whose = format!(" on {} of {nw} replicas", nan + inf);
                guard::check_loss(step, value, whose)?;
            }
            // The reduced gradients are the same on every replica: so is the verdict.
            guard::check_gradients(step, &grads)?;
            let total = global.len() as f32;
            for ((p, g), s) in model.params.iter_mut().zip(&mut grads).zip(&mut slots) {
                let g = g.as_mut_slice::<f32>().expect("f32");
                g.iter_mut().for_each(|v| *v /= total);
                opt.apply(p.as_mut_slice::<f32>().expect("f32"), g, s);
            }
            clock.charge(Phase::Compute, t.elapsed().saturating_sub(comm_time));
            timeline::span(
                "update",
                "compute",
                reduced,
                Instant::now(),
                Detail::at(step),
            );
            clock.steps(1);
            step += 1;
            if step == 1 && cfg.perturb_rank == Some(w) {
                model.params[0].as_mut_slice::<f32>().expect("f32")[0] += 1e-3;
            }
            if cfg.check_every > 0 && step.is_multiple_of(cfg.check_every) {
                let sums = {
                    let _wait = gathering(step, "parameter checksums", 8);
                    coll.allgather_varlen(&params_checksum(&model).to_le_bytes())?
                };
                if let Some(rank) = sums.iter().position(|s| *s != sums[0]) {
                    return Err(AllreduceError::Diverged {
                        step,
                        rank,
                        first: 0,
                    });
                }
            }
            let every = cfg.train.log_every;
            if every > 0 && step.is_multiple_of(every) {
                // Every replica's window, to the chief (all of them log at this step).
                let mine = clock.take();
                let ranks = gather_times(&coll, layout, comm.rank(), mine, step)?;
                if chief {
                    let log =
                        StepLog::of_window(step, verdict.loss(), &mine, cfg.train.batch, ranks);
                    events(&Event::Step(log));
                }
            }
            if chief
                && cfg.train.checkpoint_every > 0
                && step.is_multiple_of(cfg.train.checkpoint_every)
                && step < cfg.train.steps
            {
                write_checkpoint(cfg, &model, &slots, step, events)?;
                last_ckpt = step;
            }
            if let Some(signal) = stop {
                // Every replica stops after the same step; the chief keeps it.
                let mut checkpoint = cfg
                    .train
                    .checkpoint_dir
                    .as_deref()
                    .map(|d| checkpoint::path_of(d, step));
                if chief && last_ckpt != step {
                    checkpoint = write_checkpoint(cfg, &model, &slots, step, events)?;
                }
                return Err(super::Stopped {
                    signal,
                    step,
                    checkpoint,
                }
                .into());
            }
        }
        if chief {
            if last_ckpt != step {
                write_checkpoint(cfg, &model, &slots, step, events)?;
            }
            super::finish(&model, test, step, cfg.train.save_params.as_deref(), events)
                .map_err(|e| AllreduceError::Setup(e.to_string()))?;
        }
        Ok(())
    })
}

/// Marks this rank as waiting in an allgather of `step` (`what` it gathers, `bytes` of its
/// own) on the stall board: the replicas' periodic checks and logs wait on every replica
/// as the step's allreduce does, so a rank that stops there is named too.
pub(crate) fn gathering(step: u64, what: &'static str, bytes: usize) -> stall::Waiting<'static> {
    stall::wait(|| Wait {
        op: "allgather",
        step,
        what: Some(what.into()),
        peer: None,
        bytes: bytes as u64,
    })
}

/// Every replica's phase times of the window closing now (after `step`), named by world
/// rank and task, with each rank's time in the reduction split into communication and
/// waiting ([`phases::split_collective`]).
pub(crate) fn gather_times<C: Comm>(
    coll: &Collectives<C>,
    layout: &Layout,
    world_rank: usize,
    mine: Times,
    step: u64,
) -> Result<Vec<RankTimes>, TransportError> {
    let mut bytes = (world_rank as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&mine.to_bytes());
    let mut all = vec![0u8; bytes.len() * coll.size()];
    {
        let _wait = gathering(step, "phase times", bytes.len());
        coll.allgather(&bytes, &mut all)?;
    }
    let (ranks, mut times): (Vec<usize>, Vec<Times>) = all
        .chunks_exact(bytes.len())
        .map(|c| {
            let rank = u64::from_le_bytes(c[..8].try_into().expect("8 bytes")) as usize;
            (rank, Times::from_bytes(&c[8..]).expect("Times::BYTES"))
        })
        .unzip();
    phases::split_collective(&mut times);
    Ok(ranks
        .into_iter()
        .zip(times)
        .map(|(rank, times)| RankTimes {
            rank,
            task: layout
                .ranks
                .get(rank)
                .map_or_else(|| format!("rank {rank}"), |r| r.task.to_string()),
            times,
        })
        .collect())
}

fn write_checkpoint(
    cfg: &AllreduceConfig,
    model: &Replica<'_>,
    slots: &[Slots],
    step: u64,
    events: &mut dyn FnMut(&Event),
) -> Result<Option<std::path::PathBuf>, AllreduceError> {
    let Some(dir) = &cfg.train.checkpoint_dir else {
        return Ok(None);
    };
    let vars = model.variables();
    let t = Instant::now();
    let path = State::of_replica(model, slots, step).write(dir, &model.model.describe(), &vars)?;
    timeline::span("checkpoint", "other", t, Instant::now(), Detail::at(step));
    events(&Event::Checkpoint {
        path: path.clone(),
        step,
    });
    Ok(Some(path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::MappingOptions;
    use crate::transport::local::LocalComm;

    #[test]
    fn n_replicas_equal_local_training_of_the_global_batch() {
        let data = Dataset::load("digits", 0).unwrap();
        let (train, test) = data.split_holdout(1);
        let tc = TrainConfig {
            steps: 40,
            log_every: 0,
            ..TrainConfig::default()
        };
        let mlp = crate::model::mlp(64, &[128], 10).unwrap();
        let local = super::super::train_local(&mlp, &tc, &train, &test, &mut |_| {}).unwrap();
        for n in [2usize, 3, 4] {
            let layout = Layout::single_host(n, &MappingOptions::default()).unwrap();
            let out =
                std::env::temp_dir().join(format!("mpiflow-ar-eq-{}-{n}.bin", std::process::id()));
            // Fused, overlapped, and one by one (a 1-byte threshold) by the ring.
            let one_by_one = FusionConfig {
                threshold_bytes: 1,
                algorithm: crate::transport::Algorithm::Ring,
            };
            // And three towers per replica, overlapped: their gradients are ready only
            // once all towers are done, as one bucket.
            for (overlap, fusion, towers) in [
                (false, FusionConfig::default(), 1),
                (true, FusionConfig::default(), 1),
                (false, one_by_one, 1),
                (true, FusionConfig::default(), 3),
            ] {
                let cfg = AllreduceConfig {
                    train: TrainConfig {
                        save_params: Some(out.clone()),
                        towers,
                        ..tc.clone()
                    },
                    check_every: 10,
                    overlap,
                    fusion,
                    perturb_rank: None,
                };
                let logs = LocalComm::run(n, |c| {
                    let mut said = Vec::new();
                    run(&c, &layout, &mlp, &cfg, &train, &test, &mut |l| {
                        said.push(l.to_string())
                    })
                    .unwrap();
                    said
                });
                let lines: Vec<String> = logs.into_iter().flatten().collect();
                // Two layers: two weights and two biases, reduced as the settings say.
                // The verdict rides in the fused buffer, or goes on its own.
                let calls = match (overlap, fusion.threshold_bytes, towers) {
                    (true, _, 1) => 3,
                    (true, _, _) => 2,
                    (false, 1, _) => 5,
                    _ => 1,
                };
                let said = format!(
                    "tensors, {} bytes (and the step's 24-byte verdict), allreduce calls per \
                     step: {calls} (",
                    4 * (64 * 128 + 128 + 128 * 10 + 10)
                );
                assert!(
                    lines
                        .iter()
                        .any(|l| l.starts_with("# gradients: 4 ") && l.contains(&said)),
                    "{n} replicas, overlap {overlap}, {fusion:?}, {towers} towers: {lines:?}"
                );
                let worst = super::super::max_relative_difference(&local.model, &out);
                assert!(
                    worst < 1e-4,
                    "{n} replicas, overlap {overlap}, {fusion:?}, {towers} towers: largest relative difference {worst}"
                );
            }
            std::fs::remove_file(&out).unwrap();
        }
    }

    #[test]
    fn replicas_of_different_models_fail_together() {
        let data = Dataset::load("digits", 0).unwrap();
        let (train, test) = data.split_holdout(1);
        let layout = Layout::single_host(2, &MappingOptions::default()).unwrap();
        let cfg = AllreduceConfig {
            train: TrainConfig {
                steps: 5,
                log_every: 0,
                ..TrainConfig::default()
            },
            ..AllreduceConfig::default()
        };
        let wide = crate::model::mlp(64, &[32], 10).unwrap();
        let narrow = crate::model::mlp(64, &[16], 10).unwrap();
        let out = LocalComm::run(2, |c| {
            let model: &dyn crate::model::Model = if c.rank() == 0 { &wide } else { &narrow };
            run(&c, &layout, model, &cfg, &train, &test, &mut |_| {}).map_err(|e| e.to_string())
        });
        // Both at once, the same line (rank 0 waited 30 s in its first allreduce before).
        let want = "replica 1 holds another model than replica 0: mlp: input 64, dense 16, \
                    relu, dense 10 against mlp: input 64, dense 32, relu, dense 10";
        assert_eq!(out, vec![Err(want.to_string()), Err(want.to_string())]);
    }
}
