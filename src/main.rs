//! The `mpiflow` command: `spec` (show the cluster) and `launch` (run a program as a task).
//!
//! Errors become one line on stderr (`mpiflow: error: ...`) and a non-zero exit. Under MPI,
//! an error found on any rank is agreed by all ranks first (see
//! [`mpiflow::transport::Context::agree`]), printed once by rank 0, and every rank exits
//! non-zero, so `mpirun` ends the whole job instead of leaving ranks waiting.

/// `eprintln!` in one `write`: Rust's stderr is unbuffered and `eprintln!` writes its
/// pieces separately, so under mpirun the lines of several ranks could splice together.
macro_rules! say {
    ($($t:tt)*) => {{
        let mut line = format!($($t)*);
        line.push('\n');
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }};
}

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::json;

use mpiflow::cluster::flags;
use mpiflow::cluster::hostfile::MapBy;
use mpiflow::cluster::resolve::{launcher_rank_hint, resolve_mpi, resolve_offline};
use mpiflow::cluster::{MappingOptions, Placement, Request, Resolved, Source};
use mpiflow::launch;
use mpiflow::model::Model;
use mpiflow::transport::Context;

#[derive(Parser)]
#[command(
    name = "mpiflow",
    version,
    about = "TensorFlow-style ps/worker clusters on MPI and Slurm"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Show the cluster: every rank's job, task and address.
    Spec(SpecArgs),
    /// Run PROGRAM as this rank's task, with TF_CONFIG (and optionally legacy flags) set.
    Launch(LaunchArgs),
    /// Verify point-to-point and every collective on this job (one JSON line per rank).
    Check(CheckArgs),
    /// Train a model (`--mode local`: one process, the reference for distributed modes).
    Train(TrainArgs),
    /// This node's topology and, per rank, the CPU binding and BLAS threads applied.
    Topo(TopoArgs),
    /// OSU-style transfer benchmarks: latency, bw, bibw, allreduce, bcast, allreduce-fused.
    Bench(BenchArgs),
}

#[derive(Args)]
struct CheckArgs {
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Test-only: this rank submits a different fused-allreduce list.
    #[arg(long, hide = true)]
    mismatch_rank: Option<usize>,
}

#[derive(Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
enum Mode {
    /// One process.
    #[default]
    Local,
    /// Parameter servers and workers (under mpirun; --ps N sets the ps tasks).
    Ps,
    /// Synchronous replicas, gradients averaged by fused allreduce (under mpirun).
    Allreduce,
}

/// The built-in models.
#[derive(Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
enum ModelChoice {
    /// Dense layers of --hidden widths with ReLU.
    #[default]
    Mlp,
    /// Two 5x5 convolution + max-pool blocks (16, 32 filters), dense 128, for images.
    Cnn,
}

/// `--optimizer` (the library's `OptimizerKind`, spelled for the command line).
#[derive(Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
enum OptimizerArg {
    Sgd,
    Momentum,
    Adagrad,
    #[default]
    Adam,
}

impl From<OptimizerArg> for mpiflow::train::optim::OptimizerKind {
    fn from(a: OptimizerArg) -> Self {
        use mpiflow::train::optim::OptimizerKind as K;
        match a {
            OptimizerArg::Sgd => K::Sgd,
            OptimizerArg::Momentum => K::Momentum,
            OptimizerArg::Adagrad => K::Adagrad,
            OptimizerArg::Adam => K::Adam,
        }
    }
}

/// `--var-placement` (the library's placement `Strategy`).
#[derive(Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
enum PlacementArg {
    /// Variables to ps tasks in creation order (TensorFlow's default).
    RoundRobin,
    /// Each variable to the ps with the fewest bytes so far, largest first.
    #[default]
    Greedy,
    /// Like greedy, with variables above --partition-bytes cut into slices.
    Partition,
}

impl From<PlacementArg> for mpiflow::train::ps::placement::Strategy {
    fn from(a: PlacementArg) -> Self {
        use mpiflow::train::ps::placement::Strategy as S;
        match a {
            PlacementArg::RoundRobin => S::RoundRobin,
            PlacementArg::Greedy => S::Greedy,
            PlacementArg::Partition => S::Partition,
        }
    }
}

#[derive(Args)]
struct TrainArgs {
    #[arg(long, value_enum, default_value_t)]
    mode: Mode,
    /// The model to train.
    #[arg(long, value_enum, default_value_t)]
    model: ModelChoice,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Synchronous replicas (the default in ps mode).
    #[arg(long, conflicts_with = "async_")]
    sync: bool,
    /// Asynchronous updates: each push is applied as it arrives.
    #[arg(long = "async")]
    async_: bool,
    /// How ps-mode workers reach the ps: messages (p2p), or one-sided MPI windows (rma:
    /// MPI_Get / MPI_Accumulate, the RDMA path).
    #[arg(long, value_enum, default_value_t)]
    transport: mpiflow::train::ps::PsTransport,
    /// Gradients per update in sync mode (default: all workers; fewer makes backup workers).
    #[arg(long)]
    replicas_to_aggregate: Option<usize>,
    /// How variables are placed on ps tasks.
    #[arg(long, value_enum, default_value_t)]
    var_placement: PlacementArg,
    /// Slice size for --var-placement partition.
    #[arg(long, default_value_t = 4 << 20)]
    partition_bytes: usize,
    /// Write checkpoints here (and restore the newest valid one at start).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N global steps (and at the end).
    #[arg(long, default_value_t = 500)]
    checkpoint_every: u64,
    /// Seconds without a message from a needed peer before it counts as lost.
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u64).range(1..))]
    peer_timeout: u64,
    /// allreduce mode: reduce each layer's gradients during the backward pass on a
    /// communication thread (pays off when ranks have a spare core for it; measured here,
    /// 2 ranks on 2 cores, it is 0.6x).
    #[arg(long)]
    overlap: bool,
    /// allreduce mode: gradients are packed into fusion buffers of at most this many bytes,
    /// one allreduce each (1: one allreduce per tensor).
    #[arg(long, default_value_t = 64 << 20, value_parser = positive_usize)]
    fusion_threshold: usize,
    /// allreduce mode: the gradient allreduce's algorithm.
    #[arg(long, value_enum, default_value_t)]
    allreduce_algorithm: mpiflow::transport::Algorithm,
    /// Test-only: this replica changes a parameter after step 1 (allreduce mode).
    #[arg(long, hide = true)]
    perturb_rank: Option<usize>,
    /// allreduce mode: compare the replicas' parameter checksums every N steps (0: never).
    #[arg(long, default_value_t = 100)]
    check_every: u64,
    /// Write the final parameters to this file (mpiflow checkpoint format).
    #[arg(long)]
    save_params: Option<PathBuf>,
    /// digits (the shipped UCI set), fashion-mnist (Debian's dataset-fashion-mnist, official
    /// split), digits:PATH, fashion-mnist:DIR, synthetic, or idx:IMAGES,LABELS.
    #[arg(long, default_value = "digits")]
    data: String,
    /// Hidden layer widths of the MLP, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128", value_parser = positive_usize)]
    hidden: Vec<usize>,
    /// Global batch size.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
    /// Train until this global step.
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    #[arg(long, value_enum, default_value_t)]
    optimizer: OptimizerArg,
    /// Learning rate.
    #[arg(long, default_value_t = 0.003, value_parser = positive_f32)]
    lr: f32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Log every N steps (0: never).
    #[arg(long, default_value_t = 250)]
    log_every: u64,
    /// CPU binding of each rank.
    #[arg(long, value_enum, default_value_t)]
    bind: mpiflow::topology::Policy,
    /// OpenBLAS threads per rank (default: the cores of the rank's CPU set).
    #[arg(long)]
    blas_threads: Option<usize>,
}

#[derive(Args)]
struct TopoArgs {
    /// Pinning policy to apply.
    #[arg(long, value_enum, default_value_t)]
    bind: mpiflow::topology::Policy,
    /// table (rank 0 prints all ranks) or json (one line per rank).
    #[arg(long, value_enum, default_value_t)]
    format: Format,
}

#[derive(Args)]
struct BenchArgs {
    /// latency, bw, bibw, allreduce, bcast or allreduce-fused.
    name: String,
    #[command(flatten)]
    options: mpiflow::bench::BenchOptions,
}

#[derive(Args)]
struct ClusterArgs {
    /// Where the cluster comes from.
    #[arg(long, value_enum, default_value_t)]
    from: Source,
    /// Number of parameter-server tasks.
    #[arg(long, default_value_t = 0)]
    ps: usize,
    /// Give the cluster a separate chief job (chief:0); otherwise worker:0 is the chief.
    #[arg(long)]
    chief: bool,
    /// Give the cluster an evaluator task (the highest remaining rank).
    #[arg(long)]
    evaluator: bool,
    /// Where ps tasks go: the first ranks, or spread over hosts.
    #[arg(long, value_enum, default_value_t)]
    placement: Placement,
    /// First port to try for each task (probed upward under MPI).
    #[arg(long, default_value_t = 2222, value_parser = clap::value_parser!(u16).range(1..))]
    port_base: u16,
    /// Preview the layout `mpirun --hostfile H -np N` would give (no MPI needed).
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// Number of ranks for a hostfile preview (`-np N` is accepted too).
    #[arg(short = 'n', long = "np")]
    np: Option<usize>,
    /// Rank mapping of the previewed mpirun.
    #[arg(long, value_enum, default_value_t)]
    map_by: MapBy,
    /// Allow more ranks than slots in the preview.
    #[arg(long)]
    oversubscribe: bool,
    /// Slots of a hostfile line without `slots=` (OpenMPI uses the host's core count;
    /// default: this machine's).
    #[arg(long)]
    default_slots: Option<usize>,
    /// `rpc_layer` to put in TF_CONFIG (e.g. grpc); TF_CONFIG input keeps its own.
    #[arg(long)]
    rpc_layer: Option<String>,
    /// Legacy TF flag: comma-separated ps addresses.
    #[arg(long = "ps_hosts")]
    ps_hosts: Option<String>,
    /// Legacy TF flag: comma-separated worker addresses.
    #[arg(long = "worker_hosts")]
    worker_hosts: Option<String>,
    /// Legacy TF flag: this task's job (ps or worker).
    #[arg(long = "job_name")]
    job_name: Option<String>,
    /// Legacy TF flag: this task's index.
    #[arg(long = "task_index")]
    task_index: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
enum Format {
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
struct SpecArgs {
    #[command(flatten)]
    cluster: ClusterArgs,
    #[arg(long, value_enum, default_value_t)]
    format: Format,
}

#[derive(Args)]
struct LaunchArgs {
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Append --ps_hosts --worker_hosts --job_name --task_index to the program's arguments.
    #[arg(long)]
    legacy_flags: bool,
    /// The program and its arguments.
    #[arg(last = true, required = true, value_name = "PROGRAM")]
    program: Vec<String>,
}

/// A failure to report: the message of a local error, which `main` prints with this rank's
/// number first, or `None` for an error all ranks agreed on, which rank 0 has printed.
struct Failure(Option<String>);

impl Failure {
    fn local(e: impl std::fmt::Display) -> Self {
        Failure(Some(e.to_string()))
    }

    /// An error all ranks agreed on, printed once by rank 0, right away: while MPI is still
    /// initialised, so no rank can exit (and make mpirun end the job) before it is printed.
    fn agreed(e: impl std::fmt::Display, ctx: &Context) -> Self {
        if ctx.rank() == 0 {
            say!("mpiflow: error: {e}");
        }
        Failure(None)
    }
}

impl ClusterArgs {
    fn request(&self) -> Request {
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
        }
    }
}

/// Resolves the cluster; under MPI returns the live context too.
fn resolve(
    args: &ClusterArgs,
    env: &BTreeMap<String, String>,
) -> Result<(Resolved, Option<Context>), Failure> {
    resolve_with(args, env, false).map(|(r, c, _)| (r, c))
}

/// As [`resolve`]; with `threaded`, MPI is asked for `MPI_THREAD_MULTIPLE` and the last
/// value says whether it was granted.
fn resolve_with(
    args: &ClusterArgs,
    env: &BTreeMap<String, String>,
    threaded: bool,
) -> Result<(Resolved, Option<Context>, bool), Failure> {
    let req = args.request();
    match req.pick_source(env) {
        Source::Mpi => {
            let (ctx, multiple) = if threaded {
                Context::init_threaded().map_err(Failure::local)?
            } else {
                (Context::init().map_err(Failure::local)?, false)
            };
            // Every error of the MPI resolver is collective: all ranks hold the same one.
            let r = resolve_mpi(&ctx, &req).map_err(|e| Failure::agreed(e, &ctx))?;
            Ok((r, Some(ctx), multiple))
        }
        source => {
            let r = resolve_offline(&req, source, env).map_err(Failure::local)?;
            Ok((r, None, false))
        }
    }
}

/// Writes text in one `write` call, so lines of different ranks do not interleave.
fn emit(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

fn rank_line(resolved: &Resolved, who: usize, format: Format) -> Result<String, String> {
    let layout = &resolved.layout;
    let r = &layout.ranks[who];
    Ok(match format {
        Format::Json => json!({
            "rank": r.rank,
            "size": resolved.size,
            "host": r.host,
            "local_rank": r.local_rank,
            "task": {"type": r.task.job, "index": r.task.index},
            "address": r.address.to_string(),
            "source": resolved.source.name(),
            "cluster": layout.spec.as_dict(),
        })
        .to_string(),
        Format::TfConfig => layout.tf_config(r).to_json(),
        Format::Flags => flags::emit(&layout.tf_config(r))
            .map_err(|e| e.to_string())?
            .join(" "),
        Format::Table => unreachable!("tables are not per rank"),
    })
}

fn cmd_spec(args: &SpecArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    let (resolved, ctx) = resolve(&args.cluster, env)?;
    let leader = match (&ctx, resolved.me) {
        (Some(c), _) => c.rank() == 0,
        (None, Some(me)) => resolved.layout.ranks[me].rank.unwrap_or(0) == 0,
        (None, None) => true,
    };
    if args.format == Format::Table {
        if leader {
            emit(&resolved.layout.table(resolved.source.name()));
        }
        return Ok(());
    }
    let mine: Vec<usize> = match resolved.me {
        Some(me) => vec![me],
        None => (0..resolved.layout.ranks.len()).collect(),
    };
    let lines: Result<Vec<String>, String> = mine
        .iter()
        .map(|w| rank_line(&resolved, *w, args.format))
        .collect();
    let lines = match &ctx {
        Some(c) => c.agree(lines).map_err(|e| Failure::agreed(e, c))?,
        None => lines.map_err(Failure::local)?,
    };
    emit(&(lines.join("\n") + "\n"));
    Ok(())
}

fn cmd_check(args: &CheckArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    let (resolved, ctx) = resolve(&args.cluster, env)?;
    let Some(ctx) = ctx else {
        return Err(Failure::local(
            "check runs under mpirun (or srun --mpi=pmix)",
        ));
    };
    drop(resolved.port_guard);
    let coll =
        mpiflow::transport::Collectives::new(mpiflow::transport::mpi::MpiComm::new(ctx.world()));
    let report = mpiflow::check::run(&coll, &resolved.layout, args.mismatch_rank)
        .and_then(|mut rep| {
            mpiflow::check::run_rma(coll.comm(), &mut rep)?;
            Ok(rep)
        })
        .and_then(|rep| {
            emit(&(rep.json(ctx.rank(), ctx.size()) + "\n"));
            match rep.failures.first() {
                Some(f) => Err(format!(
                    "{} of {} checks failed, first: {f}",
                    rep.failures.len(),
                    rep.checks
                )),
                None => Ok(rep),
            }
        });
    let rep = ctx.agree(report).map_err(|e| Failure::agreed(e, &ctx))?;
    if ctx.rank() == 0 {
        say!(
            "mpiflow check: {} checks passed on each of {} ranks",
            rep.checks,
            ctx.size()
        );
    }
    Ok(())
}

fn cmd_train(args: &TrainArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    use mpiflow::train::{data::Dataset, train_local, TrainConfig};
    if args.mode != Mode::Local {
        return cmd_train_distributed(args, env);
    }
    let pin = pin_rank(args, 0, 1);
    if let Some(w) = &pin.warning {
        say!("mpiflow: warning: {w}");
    }
    let (train, test) = Dataset::load_split(&args.data, args.seed).map_err(Failure::local)?;
    let model = build_model(args, &train).map_err(Failure::local)?;
    let cfg: TrainConfig = train_config(args);
    emit(&format!(
        "# mpiflow train --mode local: {} train / {} held-out samples, {}, {:?} lr {}, batch {}, BLAS threads {} (CPUs {})\n",
        train.len(),
        test.len(),
        model.describe(),
        cfg.optimizer,
        cfg.lr,
        cfg.batch,
        pin.blas_threads,
        mpiflow::topology::cpu_list(&pin.cpus)
    ));
    let report = train_local(&model, &cfg, &train, &test, |l| {
        emit(&format!(
            "step {:>6} loss {:.4} steps/s {:.1} samples/s {:.0}\n",
            l.step, l.loss, l.steps_per_sec, l.samples_per_sec
        ))
    })
    .map_err(Failure::local)?;
    if let Some(p) = &args.save_params {
        mpiflow::train::save_params(&report.model, p, report.steps).map_err(Failure::local)?;
    }
    let correct = (report.accuracy * report.test_samples as f64).round() as usize;
    emit(&format!(
        "accuracy {:.4} ({correct}/{} held-out samples) after {} steps, loss {:.4}, {:.0} samples/s\n",
        report.accuracy, report.test_samples, report.steps, report.final_loss, report.samples_per_sec
    ));
    Ok(())
}

/// Pins this rank and sizes its BLAS pool (`--blas-threads` overrides the plan).
fn pin_rank(args: &TrainArgs, local: usize, count: usize) -> mpiflow::topology::Pinning {
    let mut pin = mpiflow::topology::pin(local, count, args.bind);
    if let Some(n) = args.blas_threads {
        mpiflow::kernels::set_blas_threads(n);
        pin.blas_threads = mpiflow::kernels::blas_threads();
    }
    pin
}

/// The model `--model` names, shaped for `train`'s samples and classes.
fn build_model(
    args: &TrainArgs,
    train: &mpiflow::train::data::Dataset,
) -> Result<mpiflow::model::Sequential, String> {
    let built = match args.model {
        ModelChoice::Mlp => mpiflow::model::mlp(train.features, &args.hidden, train.classes),
        ModelChoice::Cnn => match train.shape[..] {
            [h, w, c] => mpiflow::model::cnn([h, w, c], train.classes),
            _ => {
                return Err(format!(
                    "--model cnn takes images; data {} has samples of shape {:?}",
                    args.data, train.shape
                ))
            }
        },
    };
    built.map_err(|e| e.to_string())
}

fn train_config(args: &TrainArgs) -> mpiflow::train::TrainConfig {
    mpiflow::train::TrainConfig {
        batch: args.batch as usize,
        steps: args.steps,
        optimizer: args.optimizer.into(),
        lr: args.lr,
        seed: args.seed,
        log_every: args.log_every,
    }
}

/// Distributed training (`--mode ps` or `--mode allreduce`) on this rank.
fn cmd_train_distributed(args: &TrainArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    use mpiflow::train::allreduce::{self, AllreduceConfig};
    use mpiflow::train::data::Dataset;
    use mpiflow::train::ps::{self, PsConfig, PsTransport};
    let overlap = args.mode == Mode::Allreduce && args.overlap;
    let (resolved, ctx, multiple) = resolve_with(&args.cluster, env, overlap)?;
    let Some(ctx) = ctx else {
        return Err(Failure::local(
            "distributed training runs under mpirun (or srun --mpi=pmix)",
        ));
    };
    if overlap && !multiple && ctx.rank() == 0 {
        say!("mpiflow: warning: MPI did not grant MPI_THREAD_MULTIPLE; gradients are reduced after the backward pass");
    }
    drop(resolved.port_guard);
    let layout = &resolved.layout;
    let me = &layout.ranks[ctx.rank()];
    let count = layout.ranks.iter().filter(|r| r.host == me.host).count();
    let pin = pin_rank(args, me.local_rank.unwrap_or(0), count);
    let (train, test) = ctx
        .agree(Dataset::load_split(&args.data, args.seed))
        .map_err(|e| Failure::agreed(e, &ctx))?;
    let model = ctx
        .agree(build_model(args, &train))
        .map_err(|e| Failure::agreed(e, &ctx))?;
    if ctx.rank() == 0 {
        let mode = match args.mode {
            Mode::Ps if args.async_ => "ps, async",
            Mode::Ps => "ps, sync",
            _ => "allreduce",
        };
        let mode = match (args.mode, args.transport) {
            (Mode::Ps, PsTransport::Rma) => format!("{mode}, one-sided (rma)"),
            _ => mode.to_string(),
        };
        emit(&format!(
            "# mpiflow train --mode {mode}: {} tasks, {} train / {} held-out samples, {}, BLAS threads {} per rank\n",
            layout.ranks.len(),
            train.len(),
            test.len(),
            model.describe(),
            pin.blas_threads
        ));
        // If mpirun reports a dead rank by number, this line names its task.
        let map: Vec<String> = layout
            .ranks
            .iter()
            .map(|r| format!("{}={}", r.rank.unwrap_or(0), r.task))
            .collect();
        emit(&format!("# ranks: {}\n", map.join(" ")));
    }
    let comm = mpiflow::transport::mpi::MpiComm::new(ctx.world());
    let mut log = |line: &str| emit(&format!("{}\n", line.trim_end()));
    let result = match args.mode {
        Mode::Ps => {
            let cfg = PsConfig {
                train: train_config(args),
                sync: !args.async_,
                replicas_to_aggregate: args.replicas_to_aggregate,
                strategy: args.var_placement.into(),
                partition_bytes: args.partition_bytes,
                checkpoint_dir: args.checkpoint_dir.clone(),
                checkpoint_every: args.checkpoint_every,
                peer_timeout: std::time::Duration::from_secs(args.peer_timeout),
                save_params: args.save_params.clone(),
            };
            match args.transport {
                PsTransport::P2p => ps::run(&comm, layout, &model, &cfg, &train, &test, &mut log),
                PsTransport::Rma => {
                    use mpiflow::train::ps::rma;
                    ctx.agree(rma::check_config(&cfg, layout))
                        .map_err(|e| Failure::agreed(e, &ctx))?;
                    rma::run(&comm, layout, &model, &cfg, &train, &test, &mut log)
                }
            }
            .map_err(|e| e.to_string())
        }
        _ => {
            let cfg = AllreduceConfig {
                train: train_config(args),
                checkpoint_dir: args.checkpoint_dir.clone(),
                checkpoint_every: args.checkpoint_every,
                check_every: args.check_every,
                save_params: args.save_params.clone(),
                overlap: overlap && multiple,
                fusion: mpiflow::transport::fusion::FusionConfig {
                    threshold_bytes: args.fusion_threshold,
                    algorithm: args.allreduce_algorithm,
                },
                perturb_rank: args.perturb_rank,
            };
            allreduce::run(&comm, layout, &model, &cfg, &train, &test, &mut log)
                .map_err(|e| e.to_string())
        }
    };
    if let Err(e) = result {
        // Peers may be gone or waiting: no collective and no MPI_Finalize, which could
        // wait for a dead rank; exiting non-zero ends the job.
        say!("mpiflow: error: {e}");
        std::process::exit(1);
    }
    Ok(())
}

fn cmd_topo(args: &TopoArgs) -> Result<(), Failure> {
    use mpiflow::topology::{cpu_list, pin, Machine};
    let ctx = Context::init().map_err(Failure::local)?;
    let host = std::env::var("MPIFLOW_HOST").unwrap_or_else(|_| ctx.processor_name());
    let hosts = ctx.all_gather_strings(&host);
    let locals = mpiflow::cluster::mapping::local_ranks(&hosts);
    let count = hosts.iter().filter(|h| **h == host).count();
    let machine = ctx
        .agree(Machine::detect())
        .map_err(|e| Failure::agreed(e, &ctx))?;
    let p = pin(locals[ctx.rank()], count, args.bind);
    let line = json!({
        "rank": ctx.rank(), "host": host, "local_rank": locals[ctx.rank()], "cpus": cpu_list(&p.cpus),
        "blas_threads": p.blas_threads, "bound_by": p.bound_by, "warning": p.warning,
    })
    .to_string();
    if args.format == Format::Json {
        emit(&(line + "\n"));
        return Ok(());
    }
    let lines = ctx.all_gather_strings(&line);
    if ctx.rank() == 0 {
        let mut out = format!(
            "# node {host}: {}\n{:<5} {:<12} {:<5} {:<12} {:<5} {}\n",
            machine.summary(),
            "rank",
            "host",
            "local",
            "cpus",
            "blas",
            "bound by"
        );
        for l in lines {
            let v: serde_json::Value = serde_json::from_str(&l).expect("our own JSON");
            let s = |k: &str| {
                v[k].as_str()
                    .map_or_else(|| v[k].to_string(), str::to_string)
            };
            out.push_str(&format!(
                "{:<5} {:<12} {:<5} {:<12} {:<5} {}",
                s("rank"),
                s("host"),
                s("local_rank"),
                s("cpus"),
                s("blas_threads"),
                s("bound_by")
            ));
            if let Some(w) = v["warning"].as_str() {
                out.push_str(&format!(" (warning: {w})"));
            }
            out.push('\n');
        }
        emit(&out);
    }
    Ok(())
}

fn cmd_bench(args: &BenchArgs) -> Result<(), Failure> {
    let ctx = Context::init().map_err(Failure::local)?;
    ctx.agree(mpiflow::bench::validate(
        &args.name,
        ctx.size(),
        &args.options,
    ))
    .map_err(|e| Failure::agreed(e, &ctx))?;
    let comm = mpiflow::transport::mpi::MpiComm::new(ctx.world());
    if let Err(e) = mpiflow::bench::run(&comm, &args.name, &args.options) {
        // The peer may be blocked in a transfer with this rank: no collective agreement and
        // no MPI_Finalize, which could wait forever; exiting makes mpirun end the job.
        say!("mpiflow: error: rank {}: {e}", ctx.rank());
        std::process::exit(1);
    }
    Ok(())
}

fn cmd_launch(args: &LaunchArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    let (resolved, ctx) = resolve(&args.cluster, env)?;
    let Some(me) = resolved.me else {
        return Err(Failure::local(
            "launch starts a task in a running job; a hostfile only previews one (run: mpirun --hostfile H mpiflow launch -- PROGRAM)",
        ));
    };
    let layout = &resolved.layout;
    let info = &layout.ranks[me];
    let prepared =
        launch::task_args(layout, info, &args.program, args.legacy_flags).and_then(|a| {
            launch::find_program(&a[0], std::env::var_os("PATH").as_ref())?;
            Ok(a)
        });
    let argv = match &ctx {
        Some(c) => c.agree(prepared).map_err(|e| Failure::agreed(e, c))?,
        None => prepared.map_err(Failure::local)?,
    };
    let task_env = launch::task_env(layout, info, resolved.size);
    // Free the probed port for the program's server, and finalise MPI before the exec.
    drop(resolved.port_guard);
    drop(ctx);
    Err(Failure::local(launch::exec(&argv, &task_env)))
}

fn positive_usize(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s:?} is not a positive integer")),
    }
}

fn positive_f32(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x),
        _ => Err(format!("{s:?} is not a positive number")),
    }
}

/// mpirun's `-np N` spelling, accepted as `--np N`.
fn normalise_args(args: impl Iterator<Item = String>) -> Vec<String> {
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

/// Variables that must be set before the libraries read them (OpenBLAS when it loads,
/// before `main`; OpenMPI in `MPI_Init`), for the commands that compute. Empty when the
/// environment already has them (a user's own choice is inherited as it is).
///
/// - `OPENBLAS_NUM_THREADS` (default: every core) and `OPENBLAS_CORETYPE` (see
///   [`mpiflow::kernels::openblas_coretype`]): threads OpenBLAS does not use still compete
///   with the other ranks of the node (measured: 2 pinned ranks train 1.4x faster with the
///   variable set). Set from the rank's share of the node: the launcher's binding, or
///   cores divided by the ranks the launcher put on this node.
/// - `OMPI_MCA_osc` (one-sided windows), when the machine has no RDMA device: OpenMPI's
///   default `osc rdma` then emulates atomics over shared memory and crashes in
///   `MPI_Compare_and_swap` (OpenMPI 4.1.4), and fails over TCP. `sm,pt2pt` picks shared
///   memory within a node and point-to-point emulation across nodes.
fn env_before_init(env: &BTreeMap<String, String>) -> Vec<(&'static str, String)> {
    let computes = std::env::args()
        .nth(1)
        .is_some_and(|c| matches!(c.as_str(), "train" | "bench" | "check" | "topo"));
    let mut set = Vec::new();
    if !computes {
        return set;
    }
    if !env.contains_key("OMPI_MCA_osc") && mpiflow::transport::rma::rdma_devices().is_empty() {
        set.push((
            "OMPI_MCA_osc",
            mpiflow::transport::rma::OSC_WITHOUT_RDMA.to_string(),
        ));
    }
    if env.contains_key("OPENBLAS_NUM_THREADS") {
        return set;
    }
    if !env.contains_key("OPENBLAS_CORETYPE") {
        if let Some(c) = mpiflow::kernels::openblas_coretype() {
            set.push(("OPENBLAS_CORETYPE", c.to_string()));
        }
    }
    let all = mpiflow::topology::Machine::detect().map_or(1, |m| m.cores().len().max(1));
    let mine = mpiflow::topology::current_affinity().len().max(1);
    let local = [
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MPI_LOCALNRANKS",
        "SLURM_NTASKS_PER_NODE",
    ]
    .iter()
    .find_map(|v| env.get(*v).and_then(|x| x.parse::<usize>().ok()))
    .unwrap_or(1)
    .max(1);
    let threads = if mine < all {
        mine
    } else {
        (all / local).max(1)
    };
    set.push(("OPENBLAS_NUM_THREADS", threads.to_string()));
    set
}

/// Sets [`env_before_init`]'s variables by re-executing the same process (same PID, so
/// mpirun and srun keep tracking it), before MPI is initialised.
fn reexec_with_env(env: &BTreeMap<String, String>) {
    let set = env_before_init(env);
    if set.is_empty() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.args(std::env::args_os().skip(1)).envs(set);
    let err = cmd.exec();
    // Could not re-execute: carry on with the environment as it is.
    say!("mpiflow: warning: could not re-execute to set the environment: {err}");
}

fn main() -> ExitCode {
    let env: BTreeMap<String, String> = std::env::vars().collect();
    reexec_with_env(&env);
    let prefix = launcher_rank_hint(&env)
        .map(|r| format!("rank {r}: "))
        .unwrap_or_default();
    // A bug must still give one line and a non-zero exit, never a backtrace or a hang:
    // exiting ends this rank, and mpirun then ends the job.
    let panic_prefix = prefix.clone();
    std::panic::set_hook(Box::new(move |info| {
        say!("mpiflow: internal error: {panic_prefix}{info}");
        std::process::exit(70);
    }));
    let cli = match Cli::try_parse_from(normalise_args(std::env::args())) {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or("bad arguments");
            say!(
                "mpiflow: {prefix}{} (see mpiflow --help)",
                first.trim_start_matches("error: ").trim()
            );
            return ExitCode::from(2);
        }
    };
    let result = match &cli.cmd {
        Cmd::Spec(a) => cmd_spec(a, &env),
        Cmd::Launch(a) => cmd_launch(a, &env),
        Cmd::Check(a) => cmd_check(a, &env),
        Cmd::Bench(a) => cmd_bench(a),
        Cmd::Train(a) => cmd_train(a, &env),
        Cmd::Topo(a) => cmd_topo(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            if let Some(message) = f.0 {
                say!("mpiflow: error: {prefix}{message}");
            }
            ExitCode::from(1)
        }
    }
}
