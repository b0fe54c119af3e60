//! `mpiflow train`'s flags.

use std::path::PathBuf;

use clap::Args;

use super::{
    fraction, named, positive_f32, positive_usize, ClusterArgs, DecayArg, Mode, ModelChoice,
    ProgressArg, RowsAheadArg, SparseOptimizerArg,
};
use mpiflow::pipeline::{Balance, Schedule};
use mpiflow::topology::Policy;
use mpiflow::train::optim::{Decay, Optimizer, OptimizerKind};
use mpiflow::train::ps::placement::Strategy;
use mpiflow::train::ps::PsTransport;
use mpiflow::transport::Algorithm;

/// `mpiflow train`: the built-in models through every mode.
#[derive(Args)]
pub(crate) struct TrainArgs {
    /// local (one process), ps (parameter servers and workers) or allreduce (synchronous
    /// replicas), the last two under mpirun or srun.
    #[arg(long, value_enum, default_value_t)]
    pub(crate) mode: Mode,
    /// The model to train.
    #[arg(long, value_enum, default_value_t)]
    pub(crate) model: ModelChoice,
    #[command(flatten)]
    pub(crate) cluster: ClusterArgs,
    /// Synchronous replicas (the default in ps mode).
    #[arg(long, conflicts_with = "async_")]
    pub(crate) sync: bool,
    /// Asynchronous updates: each push is applied as it arrives (--mode ps; --mode hybrid
    /// --transport rma: the embedding rows; over windows, plain SGD added by
    /// MPI_Accumulate; over messages hybrid's rows always are).
    #[arg(long = "async")]
    pub(crate) async_: bool,
    /// How ps-mode workers reach the ps: messages (p2p), or one-sided MPI windows (rma:
    /// MPI_Get / MPI_Accumulate, the RDMA path).
    #[arg(long, value_parser = named::<PsTransport>(), default_value = "p2p")]
    pub(crate) transport: PsTransport,
    /// Gradients per update in sync mode (default: all workers; fewer makes backup workers).
    #[arg(long, value_parser = positive_usize)]
    pub(crate) replicas_to_aggregate: Option<usize>,
    /// How variables are placed on ps tasks.
    #[arg(long, value_parser = named::<Strategy>(), default_value = "greedy")]
    pub(crate) var_placement: Strategy,
    /// Slice size for --var-placement partition.
    #[arg(long, default_value_t = 4 << 20, value_parser = positive_usize)]
    pub(crate) partition_bytes: usize,
    /// Write checkpoints here (and restore the newest valid one at start).
    #[arg(long)]
    pub(crate) checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N global steps (and at the end; 0: at the end only).
    #[arg(long, default_value_t = 500)]
    pub(crate) checkpoint_every: u64,
    /// Keep the newest N checkpoints in --checkpoint-dir, removing older ones (0: keep
    /// all).
    #[arg(long, default_value_t = 5)]
    pub(crate) keep_checkpoints: usize,
    /// Seconds without a message from a needed peer before it counts as lost.
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) peer_timeout: u64,
    /// allreduce mode: reduce each layer's gradients during the backward pass on a
    /// communication thread (needs MPI_THREAD_MULTIPLE; pays off only when each rank has a
    /// spare core for that thread).
    #[arg(long)]
    pub(crate) overlap: bool,
    /// allreduce mode: gradients are packed into fusion buffers of at most this many bytes,
    /// one allreduce each (1: one allreduce per tensor).
    #[arg(long, default_value_t = 64 << 20, value_parser = positive_usize)]
    pub(crate) fusion_threshold: usize,
    /// allreduce mode: the gradient allreduce's algorithm.
    #[arg(long, value_parser = named::<Algorithm>(), default_value = "auto")]
    pub(crate) allreduce_algorithm: Algorithm,
    /// With --stages: each replica's share of a step is cut into this many micro-batches,
    /// run through the stages as a pipeline.
    #[arg(long, default_value_t = 4, value_parser = positive_usize)]
    pub(crate) micro_batches: usize,
    /// With --stages: the order of a stage's passes over the micro-batches: gpipe (all
    /// forward, then all backward) or 1f1b (alternating; fewer activations held).
    #[arg(long, value_parser = named::<Schedule>(), default_value = "1f1b")]
    pub(crate) schedule: Schedule,
    /// With --stages: how the layers are weighed to balance the stages: measured (each
    /// layer's passes timed on one rank) or counted (multiply-adds from the shapes).
    #[arg(long, value_parser = named::<Balance>(), default_value = "measured")]
    pub(crate) balance: Balance,
    /// Threads per task computing its gradients, each on its share of the task's samples
    /// (TensorFlow's towers, or clones), averaged in the task before the push or the
    /// allreduce. Give each a core: --blas-threads then defaults to 1.
    #[arg(long, default_value_t = 1, value_parser = positive_usize)]
    pub(crate) towers: usize,
    /// The most parameter bytes one task may hold: a whole model larger than this is
    /// refused (naming the stages it takes), and --stages cuts the model so that no stage
    /// holds more.
    #[arg(long, value_name = "BYTES", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) max_param_bytes: Option<u64>,
    /// Test-only: this replica changes a parameter after step 1 (allreduce mode).
    #[arg(long, hide = true)]
    pub(crate) perturb_rank: Option<usize>,
    /// allreduce mode: compare the replicas' parameter checksums every N steps (0: never).
    #[arg(long, default_value_t = 100)]
    pub(crate) check_every: u64,
    /// Write the final parameters to this file (mpiflow checkpoint format).
    #[arg(long)]
    pub(crate) save_params: Option<PathBuf>,
    /// digits (the shipped UCI set), fashion-mnist (Debian's dataset-fashion-mnist, official
    /// split), digits:PATH, fashion-mnist:DIR, synthetic, or idx:IMAGES,LABELS; with
    /// --model dlrm, synthetic-ctr[:OPTIONS] (the default there) or criteo:PATH.
    #[arg(long, default_value = "digits")]
    pub(crate) data: String,
    /// --model dlrm: the embedding tables' width (the bottom MLP's output).
    #[arg(long, default_value_t = 16, value_parser = positive_usize)]
    pub(crate) embedding_dim: usize,
    /// --model dlrm: the bottom MLP's hidden widths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64", value_parser = positive_usize)]
    pub(crate) bottom: Vec<usize>,
    /// --model dlrm: the top MLP's hidden widths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64", value_parser = positive_usize)]
    pub(crate) top: Vec<usize>,
    /// --model dlrm: how the tables' rows are updated (sgd, adagrad, lazy-adam).
    #[arg(long, value_enum, default_value_t)]
    pub(crate) sparse_optimizer: SparseOptimizerArg,
    /// --model dlrm: the rows' learning rate.
    #[arg(long, default_value_t = 0.05, value_parser = positive_f32)]
    pub(crate) sparse_lr: f32,
    /// --model dlrm --transport rma: rows of one table one ps task may hold, at most (its
    /// window is sized for twice as many buckets).
    #[arg(long, default_value_t = 1 << 21, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) window_rows: u64,
    /// --model dlrm, --mode ps or hybrid over messages: ask for the next step's embedding
    /// rows that a step's push does not touch before the step computes, the ps tasks
    /// serving them meanwhile (the others come with the push); auto: where every rank of
    /// the machine has a CPU of its own.
    #[arg(long, value_enum, default_value_t)]
    pub(crate) rows_ahead: RowsAheadArg,
    /// Hidden layer widths of the MLP, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128", value_parser = positive_usize)]
    pub(crate) hidden: Vec<usize>,
    /// Global batch size.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) batch: u64,
    /// Train until this global step.
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) steps: u64,
    /// The optimizer (TensorFlow's GradientDescent, Momentum, Adagrad, Adam).
    #[arg(long, value_parser = named::<OptimizerKind>(), default_value = "adam")]
    pub(crate) optimizer: OptimizerKind,
    /// Learning rate (the base rate of a decay).
    #[arg(long, default_value_t = 0.003, value_parser = positive_f32)]
    pub(crate) lr: f32,
    /// How the learning rate changes over the run: constant, or cosine (from --lr at the
    /// first step to 0 at --steps, TensorFlow's cosine_decay).
    #[arg(long, value_enum, default_value_t)]
    pub(crate) lr_decay: DecayArg,
    /// Seed of the initial parameters, the order of the samples, the held-out split and
    /// synthetic data: the same seed, the same run.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Log every N steps (0: never).
    #[arg(long, default_value_t = 250)]
    pub(crate) log_every: u64,
    /// Evaluate on the held-out samples every N steps, each evaluation a line and a
    /// metrics record (0: only at the end). Local, allreduce and the ps over messages.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) eval_every: u64,
    /// Stop once an evaluation (--eval-every) reaches this held-out accuracy.
    #[arg(long, value_name = "ACCURACY", value_parser = fraction)]
    pub(crate) target_accuracy: Option<f64>,
    /// Write metrics as the run goes (the chief): per logged step the loss, samples/s and
    /// every rank's seconds in compute, communication and waiting; each evaluation's
    /// accuracy. CSV (FILE.csv) or JSON lines (FILE.jsonl). A side-car evaluator writes
    /// its evaluations beside it (FILE.evaluator.csv).
    #[arg(long, value_name = "FILE")]
    pub(crate) metrics: Option<PathBuf>,
    /// Write a timeline of every rank's phases (Chrome trace-event JSON, for Perfetto or
    /// chrome://tracing), merged by the chief when training ends.
    #[arg(long, value_name = "FILE")]
    pub(crate) timeline: Option<PathBuf>,
    /// When a rank has waited this many seconds in a collective or a ps step, the chief
    /// prints one line naming the step, the operation and tensors, and the tasks that have
    /// not arrived; again every interval until it clears (also in --metrics and
    /// --timeline). 0: never. In ps mode a worker silent for --peer-timeout is lost first.
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    pub(crate) stall_warning: u64,
    /// How the chief shows progress: live (one line redrawn in place), lines (a line per
    /// logged step, with the ETA), or auto (live on a terminal, also through mpirun).
    #[arg(long, value_enum, default_value_t)]
    pub(crate) progress: ProgressArg,
    /// Every rank prints its own notes (by default only the chief reports).
    #[arg(long)]
    pub(crate) verbose: bool,
    /// CPU binding of each rank.
    #[arg(long, value_parser = named::<Policy>(), default_value = "compact")]
    pub(crate) bind: Policy,
    /// OpenBLAS threads per rank (default: the cores of the rank's CPU set).
    #[arg(long, value_parser = positive_usize)]
    pub(crate) blas_threads: Option<usize>,
}

impl TrainArgs {
    /// What every mode shares.
    pub(crate) fn train_config(&self) -> mpiflow::train::TrainConfig {
        let decay = match self.lr_decay {
            DecayArg::Constant => Decay::Constant,
            DecayArg::Cosine => Decay::Cosine { steps: self.steps },
        };
        mpiflow::train::TrainConfig {
            batch: self.batch as usize,
            steps: self.steps,
            optimizer: Optimizer::new(self.optimizer, self.lr).with_decay(decay),
            seed: self.seed,
            log_every: self.log_every,
            checkpoint_dir: self.checkpoint_dir.clone(),
            checkpoint_every: self.checkpoint_every,
            checkpoint_every_secs: None,
            keep_checkpoints: self.keep_checkpoints,
            save_params: self.save_params.clone(),
            stop_on_signal: true,
            towers: self.towers,
            eval_every: self.eval_every,
            target_accuracy: self.target_accuracy,
        }
    }

    /// The flags every rank must be given alike, as `(flag, value)`: all that decides what
    /// a rank computes or which collectives it joins. Compared across ranks with the
    /// mapping flags before anything else, so ranks started differently (an MPMD launch, a
    /// wrapper script) stop with one line naming the first differing flag instead of
    /// joining different collectives. Flags of one rank's own (`--verbose`, `--progress`,
    /// `--metrics`, written by the chief alone, `--bind`, `--blas-threads`) may differ.
    pub(crate) fn agreed(&self) -> Vec<(String, String)> {
        fn cli<T: clap::ValueEnum>(v: &T) -> String {
            v.to_possible_value()
                .map_or_else(String::new, |p| p.get_name().to_string())
        }
        fn named<T: mpiflow::named::Named>(v: T) -> String {
            v.name().to_string()
        }
        fn opt<T: ToString>(v: &Option<T>) -> String {
            v.as_ref()
                .map_or_else(|| "none".into(), ToString::to_string)
        }
        let path = |p: &Option<PathBuf>| opt(&p.as_ref().map(|p| p.display().to_string()));
        fn list(v: &[usize]) -> String {
            v.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        }
        let hidden: Vec<String> = self.hidden.iter().map(ToString::to_string).collect();
        [
            ("--mode", cli(&self.mode)),
            ("--model", cli(&self.model)),
            ("--sync", self.sync.to_string()),
            ("--async", self.async_.to_string()),
            ("--transport", named(self.transport)),
            ("--replicas-to-aggregate", opt(&self.replicas_to_aggregate)),
            ("--var-placement", named(self.var_placement)),
            ("--partition-bytes", self.partition_bytes.to_string()),
            ("--checkpoint-dir", path(&self.checkpoint_dir)),
            ("--checkpoint-every", self.checkpoint_every.to_string()),
            ("--keep-checkpoints", self.keep_checkpoints.to_string()),
            ("--peer-timeout", self.peer_timeout.to_string()),
            ("--overlap", self.overlap.to_string()),
            ("--fusion-threshold", self.fusion_threshold.to_string()),
            ("--allreduce-algorithm", named(self.allreduce_algorithm)),
            ("--micro-batches", self.micro_batches.to_string()),
            ("--schedule", named(self.schedule)),
            ("--balance", named(self.balance)),
            ("--towers", self.towers.to_string()),
            ("--max-param-bytes", opt(&self.max_param_bytes)),
            ("--perturb-rank", opt(&self.perturb_rank)),
            ("--check-every", self.check_every.to_string()),
            ("--save-params", path(&self.save_params)),
            ("--data", self.data.clone()),
            ("--hidden", hidden.join(",")),
            ("--embedding-dim", self.embedding_dim.to_string()),
            ("--bottom", list(&self.bottom)),
            ("--top", list(&self.top)),
            ("--sparse-optimizer", cli(&self.sparse_optimizer)),
            ("--sparse-lr", self.sparse_lr.to_string()),
            ("--window-rows", self.window_rows.to_string()),
            ("--rows-ahead", cli(&self.rows_ahead)),
            ("--batch", self.batch.to_string()),
            ("--steps", self.steps.to_string()),
            ("--optimizer", named(self.optimizer)),
            ("--lr", self.lr.to_string()),
            ("--lr-decay", cli(&self.lr_decay)),
            ("--seed", self.seed.to_string()),
            ("--log-every", self.log_every.to_string()),
            ("--eval-every", self.eval_every.to_string()),
            ("--target-accuracy", opt(&self.target_accuracy)),
            ("--timeline", path(&self.timeline)),
            ("--stall-warning", self.stall_warning.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

/// Which runs use a flag: a flag given a value other than its default that the run would
/// not use is refused (see [`TrainArgs::unused_flag`]).
#[derive(Clone, Copy)]
enum UsedBy {
    Ps,
    /// `--mode ps` or `--mode hybrid`: ps tasks.
    PsTasks,
    /// `--model dlrm`.
    Dlrm,
    Allreduce,
    /// `--mode ps` or `--mode allreduce`: a cluster of tasks under mpirun.
    Cluster,
    /// `--mode allreduce`, or `--stages` (whose replicas of a stage sum by allreduce).
    Replicas,
    Stages,
    CheckpointDir,
    Mlp,
    /// `--eval-every`.
    EvalEvery,
    /// `--mode hybrid --transport rma`: the rows over one-sided windows.
    RowsOverWindows,
    /// `--model dlrm`, `--mode ps` or `hybrid` over messages.
    RowsOverMessages,
}

impl TrainArgs {
    /// Every flag's default, as clap sets it when the flag is not given.
    fn defaults() -> TrainArgs {
        use clap::FromArgMatches;
        let command = <TrainArgs as Args>::augment_args(clap::Command::new("train"));
        command
            .try_get_matches_from(["train"])
            .ok()
            .and_then(|m| TrainArgs::from_arg_matches(&m).ok())
            .expect("every flag of train has a default")
    }

    /// The first flag given a value other than its default (a default spelled out asks for
    /// nothing) that this run would not use, as one line naming it and what uses it: a run
    /// that silently trains without what a flag asked for is worse than no run.
    pub(crate) fn unused_flag(&self) -> Option<String> {
        use mpiflow::train::ps::PsTransport;
        let d = Self::defaults();
        let own = [
            ("--async", self.async_, UsedBy::PsTasks),
            (
                "--transport rma",
                self.transport == PsTransport::Rma,
                UsedBy::PsTasks,
            ),
            (
                "--window-rows",
                self.window_rows != d.window_rows,
                UsedBy::RowsOverWindows,
            ),
            (
                "--rows-ahead",
                self.rows_ahead != d.rows_ahead,
                UsedBy::RowsOverMessages,
            ),
            (
                "--replicas-to-aggregate",
                self.replicas_to_aggregate.is_some(),
                UsedBy::Ps,
            ),
            (
                "--var-placement",
                self.var_placement != d.var_placement,
                UsedBy::Ps,
            ),
            (
                "--partition-bytes",
                self.partition_bytes != d.partition_bytes,
                UsedBy::Ps,
            ),
            (
                "--peer-timeout",
                self.peer_timeout != d.peer_timeout,
                UsedBy::PsTasks,
            ),
            (
                "--embedding-dim",
                self.embedding_dim != d.embedding_dim,
                UsedBy::Dlrm,
            ),
            ("--bottom", self.bottom != d.bottom, UsedBy::Dlrm),
            ("--top", self.top != d.top, UsedBy::Dlrm),
            (
                "--sparse-optimizer",
                self.sparse_optimizer != d.sparse_optimizer,
                UsedBy::Dlrm,
            ),
            ("--sparse-lr", self.sparse_lr != d.sparse_lr, UsedBy::Dlrm),
            ("--overlap", self.overlap, UsedBy::Allreduce),
            (
                "--fusion-threshold",
                self.fusion_threshold != d.fusion_threshold,
                UsedBy::Replicas,
            ),
            (
                "--allreduce-algorithm",
                self.allreduce_algorithm != d.allreduce_algorithm,
                UsedBy::Replicas,
            ),
            // 0 turns the checks off: no request where none are made.
            (
                "--check-every",
                ![0, d.check_every].contains(&self.check_every),
                UsedBy::Replicas,
            ),
            (
                "--micro-batches",
                self.micro_batches != d.micro_batches,
                UsedBy::Stages,
            ),
            ("--schedule", self.schedule != d.schedule, UsedBy::Stages),
            ("--balance", self.balance != d.balance, UsedBy::Stages),
            (
                "--checkpoint-every",
                self.checkpoint_every != d.checkpoint_every,
                UsedBy::CheckpointDir,
            ),
            (
                "--keep-checkpoints",
                self.keep_checkpoints != d.keep_checkpoints,
                UsedBy::CheckpointDir,
            ),
            ("--hidden", self.hidden != d.hidden, UsedBy::Mlp),
            (
                "--target-accuracy",
                self.target_accuracy.is_some(),
                UsedBy::EvalEvery,
            ),
            (
                "--stall-warning",
                ![0, d.stall_warning].contains(&self.stall_warning),
                UsedBy::Cluster,
            ),
        ];
        let mode = match self.mode {
            Mode::Local => "local",
            Mode::Ps => "ps",
            Mode::Allreduce => "allreduce",
            Mode::Hybrid => "hybrid",
        };
        // Every cluster flag describes tasks under mpirun.
        let cluster = self
            .cluster
            .given()
            .map(|(f, given, _)| (f, given, UsedBy::Cluster));
        let (flag, used_by) = own
            .into_iter()
            .chain(cluster)
            .find(|&(_, given, used_by)| given && !self.uses(used_by))
            .map(|(flag, _, used_by)| (flag, used_by))?;
        Some(match used_by {
            UsedBy::Ps => format!("{flag} is for --mode ps, not --mode {mode}"),
            UsedBy::PsTasks => format!("{flag} is for --mode ps or hybrid, not --mode {mode}"),
            UsedBy::Dlrm => format!("{flag} is for --model dlrm"),
            UsedBy::Allreduce => format!("{flag} is for --mode allreduce, not --mode {mode}"),
            UsedBy::Cluster => format!(
                "{flag} is for --mode ps, allreduce or hybrid, not --mode local (one process, no cluster)"
            ),
            UsedBy::Replicas => format!(
                "{flag} is for --mode allreduce or hybrid, or --stages, not --mode {mode} without --stages"
            ),
            UsedBy::Stages => format!(
                "{flag} is for --stages (a model cut into stages); without it each task holds the whole model"
            ),
            UsedBy::CheckpointDir => format!(
                "{flag} {} writes into --checkpoint-dir: give the directory too",
                match flag {
                    "--keep-checkpoints" => self.keep_checkpoints.to_string(),
                    _ => self.checkpoint_every.to_string(),
                }
            ),
            UsedBy::Mlp => format!(
                "{flag} is for --model mlp (the CNN's layers are fixed; DLRM's MLPs: --bottom, --top)"
            ),
            UsedBy::EvalEvery => {
                format!("{flag} needs --eval-every N: how often to evaluate")
            }
            UsedBy::RowsOverWindows => format!(
                "{flag} sizes the embedding rows' windows of --model dlrm --transport rma, not --mode {mode}{}",
                match self.transport {
                    PsTransport::Rma => " --transport rma",
                    PsTransport::P2p => " over messages",
                }
            ),
            UsedBy::RowsOverMessages => format!(
                "{flag} is for the embedding rows of --model dlrm on ps tasks over messages, not --mode {mode}{}",
                match self.transport {
                    PsTransport::Rma => " --transport rma",
                    PsTransport::P2p => "",
                }
            ),
        })
    }

    fn uses(&self, by: UsedBy) -> bool {
        let stages = self.cluster.stages.is_some();
        match by {
            UsedBy::Ps => self.mode == Mode::Ps,
            UsedBy::PsTasks => matches!(self.mode, Mode::Ps | Mode::Hybrid),
            UsedBy::Dlrm => self.model == ModelChoice::Dlrm,
            UsedBy::RowsOverWindows => {
                matches!(self.mode, Mode::Hybrid | Mode::Ps)
                    && self.transport == PsTransport::Rma
                    && self.model == ModelChoice::Dlrm
            }
            UsedBy::RowsOverMessages => {
                matches!(self.mode, Mode::Hybrid | Mode::Ps)
                    && self.transport == PsTransport::P2p
                    && self.model == ModelChoice::Dlrm
            }
            UsedBy::Allreduce => self.mode == Mode::Allreduce,
            UsedBy::Cluster => self.mode != Mode::Local,
            UsedBy::Replicas => matches!(self.mode, Mode::Allreduce | Mode::Hybrid) || stages,
            UsedBy::Stages => stages,
            UsedBy::CheckpointDir => self.checkpoint_dir.is_some(),
            UsedBy::Mlp => self.model == ModelChoice::Mlp,
            UsedBy::EvalEvery => self.eval_every > 0,
        }
    }
}
