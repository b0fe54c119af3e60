//! Training: the model, its data, the optimizers, and the training loop.
//!
//! - [`data`]: digits, MNIST IDX, synthetic; the held-out fifth; batch sharding.
//! - [`ctr`]: click-through data (a planted-teacher generator, Criteo's TSV) and AUC.
//! - [`optim`]: SGD, momentum, Adagrad, Adam as pure update rules.
//! - [`ps`], [`checkpoint`]: parameter-server training (placement, protocol, server,
//!   worker, the one-sided variant, the monitored session workers train in), and
//!   checkpoints.
//! - [`events`]: what training reports, as typed values.
//! - [`allreduce`]: synchronous replica training by fused allreduce.
//!
//! Every mode trains any [`crate::model::Model`].
//!
//! [`train_local`] is single-process training (`mpiflow train --mode local`): the
//! reference the distributed modes are compared with.

pub mod allreduce;
pub mod checkpoint;
pub mod ctr;
pub mod data;
pub mod engine;
pub mod events;
pub mod guard;
pub mod hybrid;
pub mod optim;
pub mod ps;
pub mod resources;
pub(crate) mod server;
pub(crate) mod sidecar;
pub mod tables;

use std::path::PathBuf;

/// The tags training's protocols keep on a communicator (the transport's
/// [`Kept`](crate::transport::tags::Kept) slots), in one place so that they stay distinct.
pub(crate) mod tags {
    use crate::transport::tags::Kept;

    /// Parameter-server requests (worker to ps).
    pub const PS_REQUEST: Kept = Kept(0);
    /// Parameter-server replies (ps to worker).
    pub const PS_REPLY: Kept = Kept(1);
    /// Parameter-server payloads (the floats after a request or a reply, both ways).
    pub const PS_PAYLOAD: Kept = Kept(2);
    /// The chief's end notice to side-car evaluators.
    pub const SIDECAR: Kept = Kept(3);
}

use data::{Batches, Dataset};
use events::Event;
use optim::{Optimizer, OptimizerKind};

use crate::model::{Model, ModelError, Replica};
use crate::observe::phases::RankTimes;

/// How to train, in every mode (the model is given apart: every mode trains any model;
/// a mode's own settings wrap this, as [`ps::PsConfig`] and [`allreduce::AllreduceConfig`]).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// Global batch size.
    pub batch: usize,
    /// Train until this global step.
    pub steps: u64,
    /// The update rule, its learning rate and decay.
    pub optimizer: Optimizer,
    /// Seed of the initial values and of the batch order.
    pub seed: u64,
    /// Log every this many steps (0: never).
    pub log_every: u64,
    /// Where the chief checkpoints, and restores the newest valid checkpoint from at start
    /// (`None`: no checkpoints).
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many global steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Checkpoint at least this often, too.
    pub checkpoint_every_secs: Option<std::time::Duration>,
    /// Keep the newest this many checkpoints, removing older ones (0: keep all);
    /// TensorFlow's `max_to_keep`.
    pub keep_checkpoints: usize,
    /// The chief writes the final parameters here (the checkpoint file format).
    pub save_params: Option<PathBuf>,
    /// Stop at the next step boundary once SIGTERM, SIGINT or SIGUSR1 was noted
    /// ([`crate::signals`]; the caller catches them): checkpoint, then [`Stopped`].
    pub stop_on_signal: bool,
    /// Threads computing a task's gradients, each on its share of the task's samples
    /// (`crate::model::towers`); 1: the calling thread alone.
    pub towers: usize,
    /// The command line's runs evaluate on the held-out samples every this many steps
    /// (0: only at the end; a session of one's own: [`engine::Session::evaluate_every`]).
    pub eval_every: u64,
    /// ... and stop once an evaluation reaches this accuracy.
    pub target_accuracy: Option<f64>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            batch: 64,
            steps: 1500,
            optimizer: Optimizer::new(OptimizerKind::Adam, 0.003),
            seed: 1,
            log_every: 250,
            checkpoint_dir: None,
            checkpoint_every: 500,
            checkpoint_every_secs: None,
            keep_checkpoints: 5,
            save_params: None,
            stop_on_signal: false,
            towers: 1,
            eval_every: 0,
            target_accuracy: None,
        }
    }
}

/// What a training run reached.
#[derive(Debug, Clone)]
pub struct TrainReport<'m> {
    pub steps: u64,
    pub final_loss: f32,
    pub accuracy: f64,
    pub test_samples: usize,
    pub samples_per_sec: f64,
    /// The trained parameters.
    pub model: Replica<'m>,
}

/// One logged step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepLog {
    pub step: u64,
    pub loss: f32,
    pub steps_per_sec: f64,
    pub samples_per_sec: f64,
    /// The share of the window spent in the gradient reduction (allreduce mode).
    pub comm_fraction: Option<f64>,
    /// Each rank's time by phase in the window (those the chief has heard from).
    pub ranks: Vec<RankTimes>,
}

impl StepLog {
    /// The log of a window of synchronous steps ending at `step` whose times on this rank
    /// were `mine`, each of `batch` samples, with the share spent communicating.
    pub fn of_window(
        step: u64,
        loss: f32,
        mine: &crate::observe::phases::Times,
        batch: usize,
        ranks: Vec<RankTimes>,
    ) -> StepLog {
        let secs = mine.total().max(1e-9);
        StepLog {
            step,
            loss,
            steps_per_sec: mine.steps as f64 / secs,
            samples_per_sec: (mine.steps * batch as u64) as f64 / secs,
            comm_fraction: Some(mine.comm / secs),
            ranks,
        }
    }

    /// The log line (`step N loss L steps/s S samples/s R`, then `comm C%` if known).
    pub fn line(&self) -> String {
        let mut line = format!(
            "step {:>6} loss {:.4} steps/s {:.1} samples/s {:.0}",
            self.step, self.loss, self.steps_per_sec, self.samples_per_sec
        );
        if let Some(c) = self.comm_fraction {
            line.push_str(&format!(" comm {:.0}%", 100.0 * c));
        }
        line
    }
}

/// Training stopped at a step boundary because the job was asked to end (a preemption
/// signal, a time limit, Ctrl-C): nothing is lost past `checkpoint`, the checkpoint of
/// `step` (written then, or already; none when the run has no checkpoint directory). The
/// command exits with [`Stopped::EXIT_STATUS`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stopped by {signal} at step {step}{}", match checkpoint { Some(p) => format!(", checkpoint {}: rerun the same command to resume", p.display()), None => " (no checkpoint directory: a rerun starts over)".to_string() })]
pub struct Stopped {
    pub signal: String,
    pub step: u64,
    pub checkpoint: Option<PathBuf>,
}

impl Stopped {
    /// `EX_TEMPFAIL`: the run did not fail; it may be retried (`mpiflow supervise`, a
    /// Slurm requeue) and resumes.
    pub const EXIT_STATUS: u8 = 75;
}

/// Writes a model's parameters (by name) in the checkpoint file format.
pub fn save_params(
    model: &Replica<'_>,
    path: &std::path::Path,
    step: u64,
) -> Result<(), checkpoint::CheckpointError> {
    let arrays = model
        .params
        .iter()
        .map(|t| {
            (
                t.name().to_string(),
                t.as_slice::<f32>().expect("f32").to_vec(),
            )
        })
        .collect();
    checkpoint::write_params_file(
        path,
        &checkpoint::Arrays {
            step,
            meta: serde_json::json!({}),
            arrays,
        },
    )
}

/// Every rank of `group` holds the same model (its description and every parameter's name
/// and shape), or every rank gets the same error naming (by `who`, from its group rank)
/// the first that differs from group rank 0's: a replica of another model would otherwise
/// wait in the first reduction for sizes that never come, or put its gradients where
/// another model's variables are (a program that builds its model per rank).
pub(crate) fn agree_on_model<C: crate::transport::Comm>(
    group: &crate::transport::Collectives<C>,
    model: &dyn Model,
    who: impl Fn(usize) -> String,
) -> Result<Result<(), String>, crate::transport::TransportError> {
    let params: Vec<String> = model
        .parameters()
        .iter()
        .map(|p| format!("{} {:?}", p.name, p.shape))
        .collect();
    let mine = format!("{}\n{}", model.describe(), params.join("\n"));
    let all = group.allgather_varlen(mine.as_bytes())?;
    let Some(i) = all.iter().position(|a| *a != all[0]) else {
        return Ok(Ok(()));
    };
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let (first, other) = (text(&all[0]), text(&all[i]));
    let (d0, di) = (first.lines().next(), other.lines().next());
    let why = if d0 != di {
        format!("{} against {}", di.unwrap_or(""), d0.unwrap_or(""))
    } else {
        let differs = other
            .lines()
            .zip(first.lines())
            .skip(1)
            .find(|(a, b)| a != b);
        match differs {
            Some((a, b)) => format!("parameter {a} against {b}"),
            None => "another number of parameters".into(),
        }
    };
    Ok(Err(format!(
        "{} holds another model than {}: {why}",
        who(i),
        who(0)
    )))
}

/// The replica every mode starts from: `model`'s initial parameters from `seed`, after
/// checking that `train`'s samples and classes fit it (an error naming both sides).
pub fn initial_replica<'m>(
    model: &'m dyn Model,
    train: &Dataset,
    seed: u64,
) -> Result<Replica<'m>, ModelError> {
    crate::model::check_data(model, "train", train.features, train.classes)?;
    Ok(Replica::new(model, seed))
}

/// Trains `model` in this process on `train`, evaluates on `test`; `events` sees every
/// `log_every`-th step and the checkpoints. With `checkpoint_dir` it resumes from
/// the newest valid checkpoint there (any mode's) and checkpoints every
/// `checkpoint_every` steps and at the end; with `save_params` it writes the final
/// parameters. A thin loop over an [`engine::Session`] of the [`engine::Local`] strategy.
pub fn train_local<'m>(
    model: &'m dyn Model,
    cfg: &TrainConfig,
    train: &Dataset,
    test: &Dataset,
    events: &mut dyn FnMut(&Event),
) -> Result<TrainReport<'m>, engine::TrainError> {
    crate::model::check_data(model, "train", train.features, train.classes)?;
    let sess = engine::Session::with_events(engine::Local::new(model, cfg)?, cfg, events)?;
    let mut sess = evaluating(sess, cfg, test);
    fit(&mut sess, cfg, train)?;
    let trained = sess.close()?;
    let accuracy = trained.replica.accuracy(&test.x, &test.y)?;
    Ok(TrainReport {
        steps: trained.step,
        final_loss: trained.loss,
        accuracy,
        test_samples: test.len(),
        samples_per_sec: trained.samples_per_sec,
        model: trained.replica,
    })
}

/// `sess` evaluating on `test` as `cfg` asks (every `cfg.eval_every` steps, stopping at
/// `cfg.target_accuracy`): the built-in modes' evaluation hooks.
pub fn evaluating<'m, 'e, S: engine::Strategy<'m>>(
    sess: engine::Session<'m, 'e, S>,
    cfg: &TrainConfig,
    test: &'e Dataset,
) -> engine::Session<'m, 'e, S> {
    let sess = sess.evaluate_every(cfg.eval_every, test);
    match cfg.target_accuracy {
        Some(a) => sess.stop_at_accuracy(a),
        None => sess,
    }
}

/// The built-in modes' run of a session: trains on `train` as `cfg` says ([`fit`]),
/// evaluating on `test` every `cfg.eval_every` steps ([`evaluating`]), checkpoints the
/// last step, evaluates the final parameters (the ranks that evaluate: the chief, and
/// where ranks evaluate together, every one) and closes.
pub fn train_to_end<'m, S: engine::Strategy<'m>>(
    sess: engine::Session<'m, '_, S>,
    cfg: &TrainConfig,
    train: &Dataset,
    test: &Dataset,
) -> Result<engine::Trained<'m>, engine::TrainError> {
    let mut sess = evaluating(sess, cfg, test);
    fit(&mut sess, cfg, train)?;
    // Saved first, so that the newest checkpoint is what was evaluated.
    sess.save()?;
    if sess.evaluates() {
        sess.evaluate_now(test)?;
    }
    sess.close()
}

/// Trains in `sess` on `train` until it stops: each rank's share of each global batch
/// (`cfg.batch` samples in `cfg.seed`'s order). The loop of the built-in modes.
pub fn fit<'m, S: engine::Strategy<'m>>(
    sess: &mut engine::Session<'m, '_, S>,
    cfg: &TrainConfig,
    train: &Dataset,
) -> Result<(), engine::TrainError> {
    let mut batches = Batches::new(train.len(), cfg.batch, cfg.seed);
    let (n, i) = sess.data_shard();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    while !sess.should_stop() {
        let global = batches.global(sess.global_step());
        train.rows_into(data::shard(global, i, n), &mut x, &mut y);
        sess.run(&x, &y)?;
    }
    Ok(())
}

/// Test support: the largest relative difference (`|a - b| / (1 + |a|)`) between `model`'s
/// parameters and those saved by name at `saved` (`--save-params`' format).
#[cfg(test)]
pub(crate) fn max_relative_difference(model: &Replica<'_>, saved: &std::path::Path) -> f32 {
    let got = checkpoint::read_file(saved, None).unwrap();
    let mut worst = 0.0f32;
    for p in &model.params {
        let theirs = got.get(p.name()).unwrap();
        assert_eq!(theirs.len(), p.numel(), "{}", p.name());
        for (a, b) in p.as_slice::<f32>().unwrap().iter().zip(theirs) {
            worst = worst.max((a - b).abs() / (1.0 + a.abs()));
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_training_reaches_95_percent_on_digits_deterministically() {
        let data = Dataset::load("digits", 0).unwrap();
        let (train, test) = data.split_holdout(1);
        let cfg = TrainConfig::default();
        let mlp = crate::model::mlp(64, &[128], 10).unwrap();
        let mut losses = Vec::new();
        let mut record = |e: &Event| {
            if let Event::Step(l) = e {
                losses.push(l.loss)
            }
        };
        let a = train_local(&mlp, &cfg, &train, &test, &mut record).unwrap();
        assert!(a.accuracy >= 0.95, "held-out accuracy {}", a.accuracy);
        assert!(
            losses.first().unwrap() > losses.last().unwrap(),
            "{losses:?}"
        );
        let b = train_local(&mlp, &cfg, &train, &test, &mut |_| {}).unwrap();
        assert!(
            a.model.same_parameters(&b.model),
            "same seed, same parameters bit for bit"
        );
        assert_eq!(a.accuracy, b.accuracy);
    }
}
