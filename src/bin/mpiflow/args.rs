//! The command line: every flag of every command, apart from what the commands do.
//! Library enums are offered by their [`Named`] names.

use std::path::PathBuf;

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand, ValueEnum};

use mpiflow::bench::osu::{BenchOptions, Buffers, Element, Path as BenchPath, ShmStores};
use mpiflow::cluster::hostfile::MapBy;
use mpiflow::cluster::{MappingOptions, Placement, Request, Source};
use mpiflow::named::Named;
use mpiflow::topology::Policy;
use mpiflow::train::ps::PsTransport;
use mpiflow::transport::stack::RdmaStack;
use mpiflow::transport::Algorithm;

mod scale;
mod train;
mod usage;
pub(crate) use scale::ScaleArgs;
pub(crate) use train::TrainArgs;
pub(crate) use usage::{one_line, parse};

/// clap's parser for a library enum: its names as the possible values, with their help.
fn named<T: Named + Send + Sync + Clone>() -> impl TypedValueParser<Value = T> {
    let values = T::NAMES.iter().map(|(_, name, help)| {
        let v = PossibleValue::new(*name);
        if help.is_empty() {
            v
        } else {
            v.help(*help)
        }
    });
    PossibleValuesParser::new(values).map(|s| T::from_name(&s).expect("one of the names"))
}

#[derive(Parser)]
#[command(
    name = "mpiflow",
    version,
    about = "TensorFlow-style ps/worker clusters on MPI and Slurm"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) cmd: Cmd,
    /// Open MPI's components for the commands that compute (default: the
    /// MPIFLOW_RDMA_STACK variable, else auto).
    #[arg(long, global = true, value_parser = named::<RdmaStack>())]
    pub(crate) rdma_stack: Option<RdmaStack>,
}

#[derive(Subcommand)]
pub(crate) enum Cmd {
    /// Show the cluster: every rank's job, task and address.
    Spec(SpecArgs),
    /// Run PROGRAM as this rank's task, with TF_CONFIG (and optionally legacy flags) set.
    Launch(LaunchArgs),
    /// Verify point-to-point and every collective on this job (one JSON line per rank).
    Check(CheckArgs),
    /// Train a model (`--mode local`: one process, the reference for distributed modes).
    Train(Box<TrainArgs>),
    /// This node's topology and, per rank, the CPU binding and BLAS threads applied.
    Topo(TopoArgs),
    /// OSU-style benchmarks: point-to-point, collectives, one-sided, ps push and pull.
    Bench(BenchArgs),
    /// Run a training job command; when it fails, rerun it from its newest valid checkpoint.
    Supervise(SuperviseArgs),
    /// Draw runs' metrics files, or benchmark outputs (OSU format), as an SVG picture.
    Plot(PlotArgs),
    /// Predict training steps from 2 to 1024 hosts: links fitted to measured latencies,
    /// the models measured here, measured runs checked.
    Scale(ScaleArgs),
}

#[derive(Args)]
pub(crate) struct PlotArgs {
    /// Metrics files of runs to overlay (`--metrics`' .csv or .jsonl: loss and accuracy,
    /// or a click model's AUC, against step and wall time), benchmark outputs in OSU's format (`mpiflow bench`'s
    /// or OSU's programs': latency and bandwidth against size, log-log), or one timeline
    /// (`--timeline`'s trace: a row per rank, a bar per span).
    #[arg(required = true, value_name = "FILE")]
    pub(crate) files: Vec<PathBuf>,
    /// A timeline's steps to draw, FIRST:LAST (default: five from the middle of the run).
    #[arg(long, value_name = "FIRST:LAST", value_parser = parse_steps)]
    pub(crate) steps: Option<(u64, u64)>,
    /// The SVG file to write.
    #[arg(short, long, value_name = "SVG")]
    pub(crate) out: PathBuf,
    /// Name each file's curves (once per file, in order; default: the file's name).
    #[arg(long)]
    pub(crate) label: Vec<String>,
}

#[derive(Args)]
pub(crate) struct SuperviseArgs {
    /// Reruns allowed after failures (it also stops after two failures in a row at the same
    /// checkpoint).
    #[arg(long, default_value_t = 3)]
    pub(crate) max_restarts: u32,
    /// The job's checkpoint directory (by default the command's --checkpoint-dir).
    #[arg(long)]
    pub(crate) checkpoint_dir: Option<std::path::PathBuf>,
    /// Seconds to wait before a rerun.
    #[arg(long, default_value_t = 1.0, value_parser = parse_grace)]
    pub(crate) restart_delay: f64,
    /// The job command and its arguments (mpirun ..., srun ...).
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub(crate) command: Vec<String>,
}

#[derive(Args)]
pub(crate) struct CheckArgs {
    #[command(flatten)]
    pub(crate) cluster: ClusterArgs,
    /// Test-only: this rank submits a different fused-allreduce list.
    #[arg(long, hide = true)]
    pub(crate) mismatch_rank: Option<usize>,
}

#[derive(Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub(crate) enum Mode {
    /// One process.
    #[default]
    Local,
    /// Parameter servers and workers (under mpirun; --ps N sets the ps tasks).
    Ps,
    /// Synchronous replicas, gradients averaged by fused allreduce (under mpirun).
    Allreduce,
    /// Embedding tables' rows on the ps tasks, dense layers by allreduce among the
    /// workers (--model dlrm, under mpirun).
    Hybrid,
}

/// The built-in models.
#[derive(Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub(crate) enum ModelChoice {
    /// Dense layers of --hidden widths with ReLU.
    #[default]
    Mlp,
    /// Two 5x5 convolution + max-pool blocks (16, 32 filters), dense 128, for images.
    Cnn,
    /// DLRM for click-through data (--data synthetic-ctr or criteo:PATH): a bottom MLP
    /// over the dense features, an embedding table per categorical feature, their
    /// pairwise dot products, a top MLP.
    Dlrm,
}

/// `--sparse-optimizer` (the library's `SparseOptimizer`, spelled for the command line).
#[derive(Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub(crate) enum SparseOptimizerArg {
    /// Plain SGD on the rows a batch names.
    Sgd,
    /// Adagrad with a per-row accumulator (TensorFlow's initial 0.1).
    #[default]
    Adagrad,
    /// Adam with per-row moments, updated only where a row is in a batch.
    LazyAdam,
}

impl SparseOptimizerArg {
    /// The update rule at learning rate `lr`.
    pub(crate) fn with_lr(self, lr: f32) -> mpiflow::model::embedding::SparseOptimizer {
        use mpiflow::model::embedding::SparseOptimizer;
        match self {
            SparseOptimizerArg::Sgd => SparseOptimizer::Sgd { lr },
            SparseOptimizerArg::Adagrad => SparseOptimizer::adagrad(lr),
            SparseOptimizerArg::LazyAdam => SparseOptimizer::lazy_adam(lr),
        }
    }
}

/// `--rows-ahead` (the library's `RowsAhead`, spelled for the command line).
#[derive(Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub(crate) enum RowsAheadArg {
    /// Where every rank of the machine has a CPU of its own.
    #[default]
    Auto,
    On,
    Off,
}

impl RowsAheadArg {
    pub(crate) fn library(self) -> mpiflow::train::ctr::RowsAhead {
        use mpiflow::train::ctr::RowsAhead;
        match self {
            RowsAheadArg::Auto => RowsAhead::Auto,
            RowsAheadArg::On => RowsAhead::On,
            RowsAheadArg::Off => RowsAhead::Off,
        }
    }
}

/// `--lr-decay` (the library's `Decay`, spelled for the command line).
#[derive(Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub(crate) enum DecayArg {
    /// The same rate throughout.
    #[default]
    Constant,
    /// Half a cosine from --lr to 0 over --steps.
    Cosine,
}

/// `--progress`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub(crate) enum ProgressArg {
    /// Live on a terminal (this process's, or mpirun's on this host), lines otherwise.
    #[default]
    Auto,
    /// One line redrawn in place.
    Live,
    /// A plain line per logged step.
    Lines,
}

/// `mpiflow bench`: OSU's options (`-m -i -x -W -f -c`), plus mpiflow's.
#[derive(Args)]
pub(crate) struct BenchArgs {
    /// The benchmark: OSU's point-to-point (latency, bw, bibw), collectives (allreduce,
    /// bcast) and one-sided ones (put_latency, get_latency, acc_latency, get_bw), fused
    /// allreduces of many tensors (allreduce-fused), ps push and pull (pushpull), or
    /// embedding rows pulled and pushed (rows).
    #[arg(value_parser = clap::builder::PossibleValuesParser::new(mpiflow::bench::NAMES))]
    pub(crate) name: String,
    /// Message sizes in bytes, `[MIN:]MAX`, doubling from MIN.
    #[arg(short = 'm', long = "message-size", value_parser = mpiflow::bench::osu::parse_sizes)]
    sizes: Option<(usize, usize)>,
    /// Timed iterations per size (default: OSU's, by benchmark and size).
    #[arg(short = 'i', long = "iterations", value_parser = positive_usize)]
    iterations: Option<usize>,
    /// Warm-up iterations per size (default: OSU's).
    #[arg(short = 'x', long = "warmup")]
    warmup: Option<usize>,
    /// Window of non-blocking sends (bw, bibw).
    #[arg(short = 'W', long = "window-size", default_value_t = 64, value_parser = positive_usize)]
    window: usize,
    /// OSU's buffer use in bw and bibw: one send and one receive buffer per rank, reused by
    /// every message of a window (single), or a buffer per message (multiple).
    #[arg(short = 'b', long = "buffer-num", value_parser = named::<Buffers>(), default_value = "single")]
    buffers: Buffers,
    /// Full statistics for collectives: min, max, iterations.
    #[arg(short = 'f', long = "full")]
    full: bool,
    /// Check the data that arrived (outside the timed loop).
    #[arg(short = 'c', long = "validation")]
    validate: bool,
    /// Digits after the point in the tables (OSU's compile-time FLOAT_PRECISION, 2; more
    /// to compare small latencies: 0.01 us is 5% of a 0.2 us one).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(0..=9).map(usize::from))]
    digits: usize,
    /// The elements an allreduce sums, as OSU's `-T` (allreduce only).
    #[arg(short = 'T', long = "type", value_parser = named::<Element>(), default_value = "mpi_char")]
    element: Element,
    /// Which path to measure.
    #[arg(long, value_parser = named::<BenchPath>(), default_value = "both")]
    path: BenchPath,
    /// Alternating rounds per size with `--path both`; each table keeps the best round.
    #[arg(long, default_value_t = 3, value_parser = positive_usize)]
    rounds: usize,
    /// Places the paths' order turns before the first round (0: mpi first), to balance the
    /// order over separate jobs (benches/compare/osu.sh gives its job r `--rotate r`).
    #[arg(long, default_value_t = 0)]
    rotate: usize,
    /// Allreduce algorithm of the mpiflow path; a list (`auto,ring,shm`) measures each as a
    /// path of its own in the same job, all paired with `mpi` (allreduce only).
    #[arg(long = "algorithm", value_parser = named::<Algorithm>(), value_delimiter = ',', default_value = "auto")]
    algorithms: Vec<Algorithm>,
    /// Tensors per round in allreduce-fused.
    #[arg(long, default_value_t = 100, value_parser = positive_usize)]
    count: usize,
    /// Parameter-server tasks in pushpull and rows (the first ranks).
    #[arg(long, default_value_t = 1, value_parser = positive_usize)]
    ps: usize,
    /// How pushpull's mpiflow path reaches the ps: messages, or one-sided windows.
    #[arg(long, value_parser = named::<PsTransport>(), default_value = "p2p")]
    transport: PsTransport,
    /// Bytes per slot of the shared-memory allreduce, rounded up to 4096 (allreduce and
    /// allreduce-fused; default: the library's, 256 KiB): to re-tune on another machine.
    #[arg(long, value_parser = positive_bytes)]
    shm_slot_bytes: Option<usize>,
    /// Stores into the shared-memory allreduce's slots: as measured (auto), or always
    /// cached or streaming (allreduce and allreduce-fused).
    #[arg(long, value_parser = named::<ShmStores>(), default_value = "auto")]
    shm_stores: ShmStores,
    /// Where a run is (after 2 s), on stderr: live (one line redrawn in place), lines, or
    /// auto (live on a terminal, also through mpirun).
    #[arg(long, value_enum, default_value_t)]
    progress: ProgressArg,
}

impl BenchArgs {
    /// The library's options these flags give.
    pub(crate) fn options(&self) -> BenchOptions {
        BenchOptions {
            sizes: self.sizes,
            iterations: self.iterations,
            warmup: self.warmup,
            window: self.window,
            buffers: self.buffers,
            full: self.full,
            validate: self.validate,
            digits: self.digits,
            element: self.element,
            path: self.path,
            rounds: self.rounds,
            rotate: self.rotate,
            algorithms: self.algorithms.clone(),
            count: self.count,
            ps: self.ps,
            transport: self.transport,
            shm_slot_bytes: self.shm_slot_bytes,
            shm_stores: self.shm_stores,
            progress: Some(crate::report::style(
                self.progress,
                crate::report::Stream::Stderr,
            )),
        }
    }
}

#[derive(Args)]
pub(crate) struct TopoArgs {
    /// Pinning policy to apply.
    #[arg(long, value_parser = named::<Policy>(), default_value = "compact")]
    pub(crate) bind: Policy,
    /// table (rank 0 prints all ranks) or json (one line per rank).
    #[arg(long, value_enum, default_value_t)]
    pub(crate) format: Format,
}

#[derive(Args)]
pub(crate) struct ClusterArgs {
    /// Where the cluster comes from.
    #[arg(long, value_parser = named::<Source>(), default_value = "auto")]
    pub(crate) from: Source,
    /// Number of parameter-server tasks.
    #[arg(long, default_value_t = 0)]
    pub(crate) ps: usize,
    /// Give the cluster a separate chief job (chief:0); otherwise worker:0 is the chief.
    #[arg(long)]
    pub(crate) chief: bool,
    /// Give the cluster an evaluator task (the highest remaining rank).
    #[arg(long)]
    pub(crate) evaluator: bool,
    /// Where ps tasks go: the first ranks, or spread over hosts.
    #[arg(long, value_parser = named::<Placement>(), default_value = "block")]
    pub(crate) placement: Placement,
    /// Model replicas of S stages instead of workers: jobs replica_0, replica_1, ...,
    /// task s of each its stage s, a replica's stages on as few hosts as possible.
    #[arg(long, value_name = "S", value_parser = positive_usize)]
    pub(crate) stages: Option<usize>,
    /// First port to try for each task (probed upward under MPI). Default: 2222, or inside
    /// a Slurm job 10000 + 64 x (job id mod 350), so that jobs sharing a node stay apart.
    #[arg(long, value_name = "P", value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) port_base: Option<u16>,
    /// Preview the layout `mpirun --hostfile H -np N` would give (no MPI needed).
    #[arg(long)]
    pub(crate) hostfile: Option<PathBuf>,
    /// Number of ranks for a hostfile preview (`-np N` is accepted too).
    #[arg(short = 'n', long = "np")]
    pub(crate) np: Option<usize>,
    /// Rank mapping of the previewed mpirun.
    #[arg(long, value_parser = named::<MapBy>(), default_value = "slot")]
    pub(crate) map_by: MapBy,
    /// Allow more ranks than slots in the preview.
    #[arg(long)]
    pub(crate) oversubscribe: bool,
    /// Slots of a hostfile line without `slots=` (OpenMPI uses the host's core count;
    /// default: this machine's).
    #[arg(long, value_parser = positive_usize)]
    pub(crate) default_slots: Option<usize>,
    /// `rpc_layer` to put in TF_CONFIG (e.g. grpc); TF_CONFIG input keeps its own.
    #[arg(long)]
    pub(crate) rpc_layer: Option<String>,
    /// Legacy TF flag: comma-separated ps addresses.
    #[arg(long = "ps_hosts")]
    pub(crate) ps_hosts: Option<String>,
    /// Legacy TF flag: comma-separated worker addresses.
    #[arg(long = "worker_hosts")]
    pub(crate) worker_hosts: Option<String>,
    /// Legacy TF flag: this task's job (ps or worker).
    #[arg(long = "job_name")]
    pub(crate) job_name: Option<String>,
    /// Legacy TF flag: this task's index.
    #[arg(long = "task_index")]
    pub(crate) task_index: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub(crate) enum Format {
    /// The whole mapping, printed once (rank 0).
    #[default]
    Table,
    /// One JSON line per rank: rank, host, task, address, cluster.
    Json,
    /// One line per rank: its TF_CONFIG.
    TfConfig,
    /// One line per rank: its legacy flags.
    Flags,
}

#[derive(Args)]
pub(crate) struct SpecArgs {
    #[command(flatten)]
    pub(crate) cluster: ClusterArgs,
    #[arg(long, value_enum, default_value_t)]
    pub(crate) format: Format,
}

#[derive(Args)]
pub(crate) struct LaunchArgs {
    #[command(flatten)]
    pub(crate) cluster: ClusterArgs,
    /// Append --ps_hosts --worker_hosts --job_name --task_index to the program's arguments.
    #[arg(long)]
    pub(crate) legacy_flags: bool,
    /// How long ps tasks live: `job` stops them (SIGTERM, then SIGKILL after
    /// --stop-grace) once every worker and chief exited 0, and stops every task once one
    /// fails; `forever` keeps TensorFlow's behaviour (ps tasks `join()` until killed).
    /// `job` needs MPI (mpirun, or srun --mpi=pmix): without it, `forever` applies.
    #[arg(long, value_enum, default_value_t = PsLifetimeArg::Job)]
    pub(crate) ps_lifetime: PsLifetimeArg,
    /// Stop the evaluator with the ps tasks (by default the job waits for it to end).
    #[arg(long)]
    pub(crate) stop_evaluator: bool,
    /// Seconds between SIGTERM and SIGKILL when a task is stopped.
    #[arg(long, default_value_t = 10.0, value_parser = parse_grace)]
    pub(crate) stop_grace: f64,
    /// The program and its arguments.
    #[arg(last = true, required = true, value_name = "PROGRAM")]
    pub(crate) program: Vec<String>,
}

/// `--ps-lifetime`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PsLifetimeArg {
    Job,
    Forever,
}

impl From<PsLifetimeArg> for mpiflow::launch::PsLifetime {
    fn from(a: PsLifetimeArg) -> Self {
        match a {
            PsLifetimeArg::Job => mpiflow::launch::PsLifetime::Job,
            PsLifetimeArg::Forever => mpiflow::launch::PsLifetime::Forever,
        }
    }
}

fn parse_grace(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds from 0 to 3600")),
    }
}

impl ClusterArgs {
    /// Each cluster flag, whether it was given (a value other than its default), and the
    /// one source that reads it (`None`: the mapping flags, which every source reads).
    pub(crate) fn given(&self) -> [(&'static str, bool, Option<Source>); 16] {
        let (hostfile, flags) = (Some(Source::Hostfile), Some(Source::Flags));
        [
            ("--from", self.from != Source::Auto, None),
            ("--ps", self.ps != 0, None),
            ("--chief", self.chief, None),
            ("--evaluator", self.evaluator, None),
            ("--placement", self.placement != Placement::default(), None),
            ("--port-base", self.port_base.is_some(), None),
            ("--rpc-layer", self.rpc_layer.is_some(), None),
            ("--hostfile", self.hostfile.is_some(), hostfile),
            ("--np", self.np.is_some(), hostfile),
            ("--map-by", self.map_by != MapBy::default(), hostfile),
            ("--oversubscribe", self.oversubscribe, hostfile),
            ("--default-slots", self.default_slots.is_some(), hostfile),
            ("--ps_hosts", self.ps_hosts.is_some(), flags),
            ("--worker_hosts", self.worker_hosts.is_some(), flags),
            ("--job_name", self.job_name.is_some(), flags),
            ("--task_index", self.task_index.is_some(), flags),
        ]
    }

    /// The first flag given that the cluster's `source` does not read, as one line: the
    /// hostfile preview's flags and the seeds' legacy flags are read by their own source
    /// alone (`--from mpi --hostfile H` was the running job's cluster, the hostfile unread).
    pub(crate) fn unused_flag(&self, source: Source) -> Option<String> {
        let (flag, owner) = self.given().into_iter().find_map(|(flag, given, owner)| {
            owner.filter(|o| given && *o != source).map(|o| (flag, o))
        })?;
        let how = match owner {
            Source::Hostfile => "a preview of mpirun: --hostfile H -np N",
            _ => "the seeds' flags: --ps_hosts, --worker_hosts, --job_name, --task_index",
        };
        Some(format!(
            "{flag} is for --from {} ({how}), but this cluster comes from {}",
            owner.name(),
            source.name()
        ))
    }

    pub(crate) fn request(&self) -> Request {
        let legacy_flags = [
            ("--ps_hosts", &self.ps_hosts),
            ("--worker_hosts", &self.worker_hosts),
            ("--job_name", &self.job_name),
            ("--task_index", &self.task_index),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={v}")))
        .collect();
        Request {
            source: self.from,
            mapping: MappingOptions {
                ps: self.ps,
                chief: self.chief,
                evaluator: self.evaluator,
                placement: self.placement,
                stages: self.stages,
            },
            port_base: self.port_base,
            hostfile: self.hostfile.clone(),
            np: self.np,
            map_by: self.map_by,
            oversubscribe: self.oversubscribe,
            default_slots: self
                .default_slots
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            legacy_flags,
            rpc_layer: self.rpc_layer.clone(),
            agreed: Vec::new(),
        }
    }
}

pub(crate) fn positive_usize(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s:?} is not a positive integer")),
    }
}

fn positive_bytes(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s:?} is not a positive number of bytes")),
    }
}

pub(crate) fn positive_f32(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x),
        _ => Err(format!("{s:?} is not a positive number")),
    }
}

/// A fraction in (0, 1] (an accuracy to reach).
pub(crate) fn fraction(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err(format!("{s:?} is not a fraction in (0, 1]")),
    }
}

/// mpirun's `-np N` spelling, accepted as `--np N`.
pub(crate) fn normalise_args(args: impl Iterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut after_dashdash = false;
    for a in args {
        if a == "--" {
            after_dashdash = true;
        }
        if !after_dashdash && a == "-np" {
            out.push("--np".to_string());
        } else {
            out.push(a);
        }
    }
    out
}

/// `FIRST:LAST`, two step numbers in order.
fn parse_steps(v: &str) -> Result<(u64, u64), String> {
    let bad =
        || format!("{v:?} is not FIRST:LAST (two step numbers, the first not above the last)");
    let (a, b) = v.split_once(':').ok_or_else(bad)?;
    let (a, b): (u64, u64) = (
        a.trim().parse().map_err(|_| bad())?,
        b.trim().parse().map_err(|_| bad())?,
    );
    if a > b {
        return Err(bad());
    }
    Ok((a, b))
}

#[cfg(test)]
mod tests;
