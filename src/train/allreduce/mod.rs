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
//! thread. Each replica's [`StepWord`] (its loss, a non-finite loss, a stop signal, a
//! hook's request) is summed in the same reduction, so every replica reaches the same
//! verdict without a message of its own. The chief logs once what a step's reduction takes
//! (allreduce calls and bytes).
//!
//! [`Allreduce`] is the mode's [`Strategy`]: a program drives it in a
//! [`Session`]; [`run`] is the command line's loop over one.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod reducer;

use super::checkpoint::{self, State};
use super::data::Dataset;
use super::engine::{Session, Started, StepWord, Strategy, TrainError};
use super::events::Event;
use super::optim::{Optimizer, Slots};
use super::TrainConfig;
use crate::cluster::Layout;
use crate::model::towers::Towers;
use crate::model::{Model, Replica, Targets};
use crate::observe::phases::{self, Clock, Phase, RankTimes, Times};
use crate::observe::stall::{self, Wait};
use crate::tensor::Tensor;
use crate::transport::fusion::FusionConfig;
use crate::transport::{Collectives, Comm, TransportError};
use reducer::Reducer;

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

fn params_checksum(model: &Replica<'_>) -> u64 {
    model
        .params
        .iter()
        .fold(0, |h, p| checkpoint::checksum(p.bytes()) ^ h.rotate_left(7))
}

/// Synchronous replicas: the strategy of allreduce training, on the ranks of `C` that
/// train together (every rank of the communicator it is given).
pub struct Allreduce<'m, C: Comm> {
    coll: Collectives<C>,
    layout: Layout,
    world_rank: usize,
    replica: Replica<'m>,
    opt: Optimizer,
    slots: Vec<Slots>,
    grads: Vec<Tensor>,
    towers: Towers,
    reducer: Reducer,
    /// The gradients' names, as a stall report says them.
    what: Arc<str>,
    cfg: AllreduceConfig,
    /// The global batch of the step being taken (what the summed gradients divide by).
    samples: f32,
    /// The first step's note (what a step's reduction takes) is said.
    noted: bool,
}

impl<'m, C: Comm + Send + 'static> Allreduce<'m, C> {
    /// The replica of `model` on this rank of `replicas` (every rank of it trains);
    /// `layout` names the ranks by task (`world_rank`: this rank's in it). Every replica
    /// must hold the same model: one that differs stops all with one line naming it.
    pub fn new(
        replicas: C,
        layout: &Layout,
        world_rank: usize,
        model: &'m dyn Model,
        cfg: &AllreduceConfig,
    ) -> Result<Self, TrainError> {
        let coll = Collectives::new(replicas);
        super::agree_on_model(&coll, model, |i| format!("replica {i}"))?
            .map_err(TrainError::Models)?;
        let comm_thread = match cfg.overlap {
            true => Some(coll.comm().split(0, coll.rank())?),
            false => None,
        };
        let replica = Replica::new(model, cfg.train.seed);
        let opt = cfg.train.optimizer;
        let names = model.parameters();
        Ok(Allreduce {
            reducer: Reducer::new(comm_thread, &replica, cfg.fusion),
            what: stall::tensors_label(names.iter().map(|p| p.name.as_str())),
            slots: replica
                .params
                .iter()
                .map(|p| opt.state(p.numel()))
                .collect(),
            grads: replica.zeros_like(),
            towers: Towers::new(cfg.train.towers),
            layout: layout.clone(),
            coll,
            world_rank,
            replica,
            opt,
            cfg: cfg.clone(),
            samples: 0.0,
            noted: false,
        })
    }
}

impl<C: Comm> Allreduce<'_, C> {
    /// The chief's note on what a step's reduction takes, after the first step.
    fn note(&mut self, stats: crate::transport::fusion::FusionStats) -> Event {
        self.noted = true;
        let how = if self.cfg.overlap {
            "one per layer, overlapped".to_string()
        } else {
            format!("fused up to {} bytes", self.cfg.fusion.threshold_bytes)
        };
        let algorithm = crate::named::Named::name(self.cfg.fusion.algorithm);
        let bytes = self.grads.iter().map(Tensor::nbytes).sum::<usize>();
        Event::Note(format!(
            "gradients: {} tensors, {bytes} bytes (and the step's {}-byte word), \
             allreduce calls per step: {} ({how}, algorithm {algorithm}, {} replicas)",
            self.grads.len(),
            stats.bytes - bytes,
            stats.messages,
            self.coll.size(),
        ))
    }
}

impl<'m, C: Comm> Strategy<'m> for Allreduce<'m, C> {
    fn ranks(&self) -> (usize, usize) {
        (self.coll.size(), self.coll.rank())
    }

    fn replica(&self) -> &Replica<'m> {
        &self.replica
    }

    fn into_replica(self) -> Replica<'m> {
        self.replica
    }

    /// The chief's starting point (fresh or restored, from any mode's checkpoint) goes to
    /// every replica.
    fn start(
        &mut self,
        dir: Option<&Path>,
        events: &mut dyn FnMut(&Event),
    ) -> Result<Started, TrainError> {
        let chief = self.coll.rank() == 0;
        let restored = super::engine::restore(dir, chief, &self.replica, events)?;
        let on_disk = restored.as_ref().map(|s| s.step);
        let vars = self.replica.variables();
        // The state, after a byte that says whether it is a checkpoint's: every replica's
        // session then counts the restored step as written, as the chief's does (one
        // verdict on whether to checkpoint it again at close).
        let mut start_bytes = Vec::new();
        if chief {
            let start =
                restored.unwrap_or_else(|| State::of_replica(&self.replica, &self.slots, 0));
            start_bytes.push(u8::from(on_disk.is_some()));
            start_bytes.extend(checkpoint::encode(&start.arrays(&vars)));
        }
        let start = self.coll.bcast_varlen(start_bytes, 0)?;
        let at = std::path::Path::new("<broadcast>");
        let (from_disk, start) = start.split_first().unwrap_or((&0, &[]));
        let arrays = checkpoint::parse(at, start, None)?;
        let state = State::assemble(at, &[arrays], &vars)?;
        state.apply_to(&mut self.replica, &mut self.slots, &self.opt);
        Ok(Started {
            step: state.step,
            restored: (*from_disk == 1).then_some(state.step),
        })
    }

    /// Sum of (mean gradient x samples) over replicas, over the global batch: exact.
    fn gradients(
        &mut self,
        step: u64,
        x: &[f32],
        y: Targets<'_>,
        mut word: StepWord,
        clock: &mut Clock,
        events: &mut dyn FnMut(&Event),
    ) -> Result<StepWord, TrainError> {
        let t = Instant::now();
        let (secs, stats) = self.reducer.step(
            &self.coll,
            (&self.replica, &mut self.towers),
            &self.what,
            (x, y),
            &mut self.grads,
            step,
            &mut word,
        )?;
        let comm = Duration::from_secs_f64(secs);
        clock.charge(Phase::Comm, comm);
        clock.charge(Phase::Compute, t.elapsed().saturating_sub(comm));
        if !self.noted && self.coll.rank() == 0 {
            events(&self.note(stats));
        }
        self.noted = true;
        self.samples = word.samples;
        Ok(word)
    }

    fn pending(&self) -> &[Tensor] {
        &self.grads
    }

    fn apply(&mut self, step: u64) -> Result<u64, TrainError> {
        let total = self.samples.max(1.0);
        for g in &mut self.grads {
            let g = g.as_mut_slice::<f32>().expect("f32");
            g.iter_mut().for_each(|v| *v /= total);
        }
        super::engine::local::apply_optimizer(
            &mut self.replica,
            &self.grads,
            &self.opt,
            &mut self.slots,
        );
        Ok(step + 1)
    }

    fn after_step(&mut self, done: u64) -> Result<(), TrainError> {
        let w = self.coll.rank();
        if done == 1 && self.cfg.perturb_rank == Some(w) {
            self.replica.params[0].as_mut_slice::<f32>().expect("f32")[0] += 1e-3;
        }
        let every = self.cfg.check_every;
        if every == 0 || !done.is_multiple_of(every) {
            return Ok(());
        }
        let sums = {
            let _wait = gathering(done, "parameter checksums", 8);
            let sum = params_checksum(&self.replica);
            self.coll.allgather_varlen(&sum.to_le_bytes())?
        };
        match sums.iter().position(|s| *s != sums[0]) {
            Some(rank) => Err(TrainError::Diverged {
                step: done,
                rank,
                first: 0,
            }),
            None => Ok(()),
        }
    }

    fn state(&mut self, step: u64) -> Result<State, TrainError> {
        Ok(State::of_replica(&self.replica, &self.slots, step))
    }

    fn sum(&mut self, values: &mut [f64]) -> Result<(), TrainError> {
        crate::train::engine::sum_over(&self.coll, values)
    }

    fn window(
        &mut self,
        step: u64,
        clock: &mut Clock,
    ) -> Result<(Times, Vec<RankTimes>), TrainError> {
        let (coll, layout) = (&self.coll, &self.layout);
        Ok(window_times(coll, layout, self.world_rank, clock, step)?)
    }
}

/// Runs this rank's part of allreduce training; `events` sees what the chief reports.
/// Ranks of other jobs than the workers take no part: an evaluator evaluates the chief's
/// checkpoints, the others idle with a warning.
pub fn run<C: Comm + Send + 'static>(
    comm: &C,
    layout: &Layout,
    model: &dyn Model,
    cfg: &AllreduceConfig,
    train: &Dataset,
    test: &Dataset,
    events: &mut dyn FnMut(&Event),
) -> Result<(), TrainError> {
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
    crate::model::check_data(model, "train", train.features, train.classes)
        .map_err(|e| TrainError::Setup(e.to_string()))?;
    let strategy = Allreduce::new(sub, layout, comm.rank(), model, cfg)?;
    let sess = Session::with_events(strategy, &cfg.train, &mut *events)?;
    super::train_to_end(sess, &cfg.train, train, test)?;
    Ok(())
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

/// The log window closing now (after `step`) on every rank of `coll` (a collective):
/// this rank's (`world_rank`'s) times taken from `clock`, and every rank's, named by world
/// rank and task, with each rank's time in the reduction split into communication and
/// waiting ([`phases::split_collective`]): [`Strategy::window`] of the modes whose ranks
/// step together.
pub(crate) fn window_times<C: Comm>(
    coll: &Collectives<C>,
    layout: &Layout,
    world_rank: usize,
    clock: &mut Clock,
    step: u64,
) -> Result<(Times, Vec<RankTimes>), TransportError> {
    let mine = clock.take();
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
    let ranks = ranks
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
        .collect();
    Ok((mine, ranks))
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
                    "tensors, {} bytes (and the step's 36-byte word), allreduce calls per \
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

    /// A session that restores step N and closes at it, no step taken (a program's
    /// second job that only reads its state): every replica counts step N as written,
    /// so none checkpoints it again alone (the chief did not, and the others waited in
    /// the checkpoint's agreement of a strategy with tables for ever).
    #[test]
    fn a_restored_session_closed_at_its_step_ends_on_every_replica() {
        let dir = std::env::temp_dir().join(format!("mpiflow-ar-reclose-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let layout = Layout::single_host(2, &MappingOptions::default()).unwrap();
        let mlp = crate::model::mlp(4, &[3], 2).unwrap();
        let cfg = AllreduceConfig {
            train: TrainConfig {
                steps: 2,
                log_every: 0,
                checkpoint_dir: Some(dir.clone()),
                ..TrainConfig::default()
            },
            ..AllreduceConfig::default()
        };
        let (x, y) = (vec![0.5f32; 4], vec![1u8]);
        let specs = [crate::model::embedding::TableSpec::new("t", 10, 2)];
        let sgd = crate::model::embedding::SparseOptimizer::Sgd { lr: 0.1 };
        for job in 0..2 {
            let out = LocalComm::run(2, |c| {
                let rank = c.rank();
                let dense = Allreduce::new(c, &layout, rank, &mlp, &cfg)?;
                // With tables (rows of their own here): its checkpoint agrees on the
                // chief's outcome, which every replica must then reach.
                let rows = crate::train::tables::LocalRows::new(&specs, 1, sgd);
                let strategy = crate::train::tables::Sparse::new(dense, rows);
                let mut sess = Session::new(strategy, &cfg.train)?;
                while job == 0 && !sess.should_stop() {
                    sess.run(&x, &y)?;
                }
                let closed = sess.close()?;
                Ok::<_, TrainError>((closed.first_step, closed.step))
            });
            let want = if job == 0 { (0, 2) } else { (2, 2) };
            for o in out {
                assert_eq!(o.map_err(|e| e.to_string()), Ok(want), "job {job}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
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
