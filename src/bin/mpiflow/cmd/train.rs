//! `mpiflow train`: the built-in models through every mode.

use std::collections::BTreeMap;

use mpiflow::model::Model;
use mpiflow::train::events::Event;
use mpiflow::train::resources;

use super::resolve_with;
use crate::args::{Mode, ModelChoice, TrainArgs};
use crate::out::{emit, say, Failure};
use crate::report::{self, Reporter};

pub(crate) fn run(args: &TrainArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    use mpiflow::train::{data::Dataset, train_local, TrainConfig};
    if let Some(unused) = args.unused_flag() {
        return Err(Failure::local(unused));
    }
    if let Some(s) = args.cluster.stages {
        refuse_with_stages(args, s)?;
    }
    // First: a stop asked for during setup is kept for the first step boundary.
    catch_stop_signals();
    if args.model == ModelChoice::Dlrm || args.mode == Mode::Hybrid {
        return super::train_ctr::run(args, env);
    }
    if args.mode != Mode::Local {
        return cmd_train_distributed(args, env);
    }
    let pin = pin_rank(args, 0, 1);
    if let Some(w) = &pin.warning {
        say!("mpiflow: warning: {w}");
    }
    prepare_outputs(args).map_err(Failure::local)?;
    let (train, test) = Dataset::load_split(&args.data, args.seed).map_err(Failure::local)?;
    batch_fits(args, &train).map_err(Failure::local)?;
    let model = build_model(args, &train).map_err(Failure::local)?;
    whole_model_fits(args, &model).map_err(Failure::local)?;
    let cfg: TrainConfig = args.train_config();
    let need = resources::replica_need(&model, cfg.batch, &cfg.optimizer);
    resources::check("training", &need, resources::share(1).as_ref()).map_err(Failure::local)?;
    // The outputs are checked before anything is printed: a bad path is the only line.
    let metrics = report::metrics_file(args.metrics.as_deref(), Some(report::Writer::Chief))
        .map_err(Failure::local)?;
    if let Some(p) = &args.timeline {
        mpiflow::observe::timeline::check_writable(p).map_err(Failure::local)?;
        mpiflow::observe::timeline::enable(mpiflow::observe::timeline::Alignment::alone());
    }
    emit(&format!(
        "# mpiflow train --mode local: {} train / {} held-out samples, {}, {}, batch {}{}, BLAS threads {} (CPUs {})\n",
        train.len(),
        test.len(),
        model.describe(),
        cfg.optimizer,
        cfg.batch,
        towers_label(cfg.towers),
        pin.blas_threads,
        mpiflow::topology::cpu_list(&pin.cpus)
    ));
    if let Some(w) = idle_towers(args, None) {
        say!("mpiflow: warning: {w}");
    }
    let mut reporter = Reporter::new(cfg.steps, args.progress, metrics, true);
    let trained = train_local(&model, &cfg, &train, &test, &mut |e| reporter.event(e));
    let report = match trained {
        Err(mpiflow::train::engine::TrainError::Stopped(s)) => {
            drop(reporter);
            return Err(Failure::stopped(&s, true));
        }
        r => r.map_err(Failure::local)?,
    };
    let correct = (report.accuracy * report.test_samples as f64).round() as usize;
    reporter.record(&Event::Accuracy {
        accuracy: report.accuracy,
        correct,
        total: report.test_samples,
        step: report.steps,
    });
    drop(reporter);
    if let Some(p) = &args.timeline {
        use mpiflow::observe::timeline;
        timeline::write(p, &timeline::local_trace("local")).map_err(Failure::local)?;
    }
    emit(&format!(
        "accuracy {:.4} ({correct}/{} held-out samples) after {} steps, loss {:.4}, {:.0} samples/s\n",
        report.accuracy, report.test_samples, report.steps, report.final_loss, report.samples_per_sec
    ));
    Ok(())
}

/// `--save-params`'s file and `--checkpoint-dir` can be written (checked before training,
/// not after it or at its first checkpoint).
pub(crate) fn prepare_outputs(
    args: &TrainArgs,
) -> Result<(), mpiflow::train::checkpoint::CheckpointError> {
    use mpiflow::train::checkpoint::{prepare_dir, prepare_params_file};
    if let Some(p) = &args.save_params {
        prepare_params_file(p)?;
    }
    args.checkpoint_dir.as_deref().map_or(Ok(()), prepare_dir)
}

/// What `--stages` does not train (yet), in one line before anything starts.
fn refuse_with_stages(args: &TrainArgs, stages: usize) -> Result<(), Failure> {
    let refused = match args.mode {
        Mode::Local => Some("trains replicas split into stages under mpirun: add --mode allreduce"),
        Mode::Ps if args.async_ => Some("trains synchronously: drop --async"),
        Mode::Ps if args.transport == mpiflow::train::ps::PsTransport::Rma => {
            Some("reaches the ps tasks by messages: drop --transport rma")
        }
        Mode::Ps if args.replicas_to_aggregate.is_some() => {
            Some("aggregates every replica's gradients: drop --replicas-to-aggregate")
        }
        Mode::Ps => None,
        Mode::Allreduce if args.overlap => Some("does not overlap (--overlap): each stage's gradients are summed after its micro-batches"),
        Mode::Allreduce => None,
        Mode::Hybrid => Some("cuts a model of dense layers; hybrid training's tables live on ps tasks: drop --stages"),
    };
    match refused {
        Some(why) => Err(Failure::local(format!("--stages {stages} {why}"))),
        None => Ok(()),
    }
}

/// `--max-param-bytes` without `--stages`: a task holds the whole model (a replica, a ps
/// worker), which must fit; if not, the error names the stages it would take.
fn whole_model_fits(args: &TrainArgs, model: &mpiflow::model::Sequential) -> Result<(), String> {
    let (Some(limit), None) = (args.max_param_bytes, args.cluster.stages) else {
        return Ok(());
    };
    let sizes = model.layer_param_bytes();
    let total: u64 = sizes.iter().sum();
    if total <= limit {
        return Ok(());
    }
    let fewest =
        mpiflow::pipeline::partition::fewest_stages(&sizes, limit).map_err(|e| e.to_string())?;
    Err(format!(
        "the model holds {total} parameter bytes, more than --max-param-bytes {limit}: split it into stages (--mode allreduce --stages {fewest} or more)"
    ))
}

/// SIGTERM, SIGINT and SIGUSR1 (Slurm's time limit, `scancel`, `--signal=USR1@120`, a
/// preemption, Ctrl-C) stop training at the next step boundary with a checkpoint, in
/// every mode: the ranks agree on the boundary (allreduce: in the gradient reduction; ps:
/// the ps tasks announce it in their replies). A failure to catch them (not seen in practice) leaves their default action, with a
/// warning: it must not stop one rank while the others train on.
pub(crate) fn catch_stop_signals() {
    if let Err(e) = mpiflow::signals::catch(&mpiflow::signals::STOP, false) {
        say!("mpiflow: warning: signals end training without a checkpoint here: {e}");
    }
}

/// Pins this rank and sizes its BLAS pool (`--blas-threads` overrides the plan). A pool
/// OpenBLAS cut, or one larger than the rank's CPUs, is a warning beside the binding's.
pub(crate) fn pin_rank(args: &TrainArgs, local: usize, count: usize) -> mpiflow::topology::Pinning {
    let mut pin = mpiflow::topology::pin(local, count, args.bind);
    // Towers are the rank's threads: each calls BLAS alone.
    let towers = (args.towers > 1).then_some(1);
    if let Some(n) = args.blas_threads.or(towers) {
        mpiflow::kernels::set_blas_threads(n);
        pin.blas_threads = mpiflow::kernels::blas_threads();
    }
    let cpus = pin.cpus.len();
    let pool = match args.blas_threads {
        Some(n) if pin.blas_threads < n => Some(format!(
            "--blas-threads {n}: OpenBLAS runs at most {}",
            pin.blas_threads
        )),
        Some(n) if cpus > 0 && n > cpus => Some(format!(
            "--blas-threads {n} is more than the {cpus} CPU(s) a rank runs on: its threads share them"
        )),
        _ => None,
    };
    pin.warning = match (pin.warning.take(), pool) {
        (Some(a), Some(b)) => Some(format!("{a}; {b}")),
        (a, b) => a.or(b),
    };
    pin
}

/// A (global) batch within the training samples: a larger one was cut to them silently,
/// and the samples/s reported counted the batch asked for.
fn batch_fits(args: &TrainArgs, train: &mpiflow::train::data::Dataset) -> Result<(), String> {
    match args.batch as usize {
        b if b > train.len() => Err(format!(
            "--batch {b} is larger than the {} training samples of {}",
            train.len(),
            args.data
        )),
        _ => Ok(()),
    }
}

/// The model `--model` names, shaped for `train`'s samples and classes.
fn build_model(
    args: &TrainArgs,
    train: &mpiflow::train::data::Dataset,
) -> Result<mpiflow::model::Sequential, String> {
    model_for(args.model, &args.hidden, &args.data, train)
}

/// The built-in model `choice` (an MLP of `hidden` widths, or the CNN) for the samples
/// and classes of `train`, loaded from `data`.
pub(crate) fn model_for(
    choice: ModelChoice,
    hidden: &[usize],
    data: &str,
    train: &mpiflow::train::data::Dataset,
) -> Result<mpiflow::model::Sequential, String> {
    let built = match choice {
        ModelChoice::Mlp => mpiflow::model::mlp(train.features, hidden, train.classes),
        ModelChoice::Cnn => match train.shape[..] {
            [h, w, c] => mpiflow::model::cnn([h, w, c], train.classes),
            _ => {
                return Err(format!(
                    "--model cnn takes images; data {data} has samples of shape {:?}",
                    train.shape
                ))
            }
        },
        ModelChoice::Dlrm => {
            return Err("--model dlrm trains on click data (mpiflow train --model dlrm)".into())
        }
    };
    built.map_err(|e| e.to_string())
}

/// `, towers K` in a run's header when a task computes with several.
fn towers_label(k: usize) -> String {
    match k {
        0 | 1 => String::new(),
        k => format!(", towers {k}"),
    }
}

/// `--towers K` beyond the rows a task's towers share in a pass (the batch alone; a
/// data-parallel task's share of it under mpirun; with stages, a micro-batch's share):
/// the towers past them have no rows and sit out, which the run says rather than leave K
/// threads assumed.
fn idle_towers(args: &TrainArgs, layout: Option<&mpiflow::cluster::Layout>) -> Option<String> {
    let batch = args.batch as usize;
    let (rows, what) = match layout.map(|l| &l.spec) {
        None => (batch, "the batch"),
        Some(spec) => match spec
            .replica_shape()
            .filter(|_| args.cluster.stages.is_some())
        {
            Some((replicas, _)) => (
                batch / replicas.max(1) / args.micro_batches.max(1),
                "a replica's micro-batch",
            ),
            None => (
                batch / spec.num_workers().max(1),
                "a task's share of the batch",
            ),
        },
    };
    let rows = rows.max(1);
    (args.towers > rows).then(|| {
        format!(
            "--towers {}: {what} is {rows} sample(s), so {rows} tower(s) compute and the rest sit out",
            args.towers
        )
    })
}

/// What this rank's task holds in distributed training (see [`resources`]): a replica's
/// or a worker's share of the global batch, or a ps task's share of the parameters.
fn rank_need(
    args: &TrainArgs,
    layout: &mpiflow::cluster::Layout,
    task: &mpiflow::cluster::TaskId,
    model: &dyn Model,
) -> resources::Need {
    let spec = &layout.spec;
    let workers = spec.num_workers();
    let per_worker = (args.batch as usize).div_ceil(workers.max(1));
    let opt = args.train_config().optimizer;
    match (args.mode, spec.worker_id(task)) {
        (_, Some(_)) if args.mode == Mode::Allreduce => {
            resources::replica_need(model, per_worker, &opt)
        }
        (_, Some(_)) => resources::worker_need(model, per_worker),
        (Mode::Ps, None) if task.job == "ps" => {
            let ps = spec.num_tasks("ps").unwrap_or(1);
            let staged = if args.async_ { 1 } else { workers };
            resources::ps_need(model, &opt, ps, staged)
        }
        _ => resources::Need { parts: Vec::new() },
    }
}

/// Distributed training (`--mode ps` or `--mode allreduce`) on this rank.
fn cmd_train_distributed(args: &TrainArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    use mpiflow::train::allreduce::{self, AllreduceConfig};
    use mpiflow::train::data::Dataset;
    use mpiflow::train::ps::{self, PsConfig, PsTransport};
    use mpiflow::transport::threads;
    let overlap = args.mode == Mode::Allreduce && args.overlap;
    // The one-sided ps's windows may refuse the thread level the stall watch needs.
    let refused = match (args.mode, args.transport) {
        (Mode::Ps, PsTransport::Rma) => threads::windows_refuse_threads(&threads::library(), env),
        _ => None,
    };
    let watching = args.stall_warning > 0 && refused.is_none();
    let (resolved, ctx, multiple) =
        resolve_with(&args.cluster, args.agreed(), env, overlap || watching, true)?;
    let Some(ctx) = ctx else {
        return Err(Failure::local(
            "distributed training runs under mpirun (or srun --mpi=pmix)",
        ));
    };
    if overlap && !multiple && ctx.rank() == 0 {
        say!("mpiflow: warning: MPI did not grant MPI_THREAD_MULTIPLE; gradients are reduced after the backward pass");
    }
    if watching && !multiple && ctx.rank() == 0 {
        say!("mpiflow: warning: MPI did not grant MPI_THREAD_MULTIPLE; no stall reports (--stall-warning)");
    }
    if let Some(why) = refused.filter(|_| args.stall_warning > 0 && ctx.rank() == 0) {
        say!("mpiflow: warning: {why}; no stall reports (--stall-warning)");
    }
    drop(resolved.port_guard);
    let layout = &resolved.layout;
    if args.mode == Mode::Ps {
        // The same verdict on every rank (no ps task, no worker): one line, before anything.
        ctx.agree(ps::Roles::new(layout).map(drop))
            .map_err(|e| Failure::agreed(e, &ctx))?;
    }
    // Whichever rank writes the parameters or a checkpoint, every rank's view of the path
    // is checked now (a cluster's file systems are shared, or should be for these files).
    ctx.agree(prepare_outputs(args))
        .map_err(|e| Failure::agreed(e, &ctx))?;
    let me = &layout.ranks[ctx.rank()];
    // Planned and shared per machine: hosts that are containers of one machine share its
    // cores and memory.
    let (local, count) = ctx.machine_local();
    let pin = pin_rank(args, local, count);
    for w in ctx.gather_warnings(pin.warning.as_deref()) {
        if ctx.rank() == 0 {
            say!("mpiflow: warning: {w}");
        }
    }
    let (train, test) = ctx
        .agree(Dataset::load_split(&args.data, args.seed))
        .map_err(|e| Failure::agreed(e, &ctx))?;
    ctx.agree(batch_fits(args, &train))
        .map_err(|e| Failure::agreed(e, &ctx))?;
    let model = ctx
        .agree(build_model(args, &train))
        .map_err(|e| Failure::agreed(e, &ctx))?;
    ctx.agree(whole_model_fits(args, &model))
        .map_err(|e| Failure::agreed(e, &ctx))?;
    let need = rank_need(args, layout, &me.task, &model);
    ctx.agree(resources::check(
        &me.task.to_string(),
        &need,
        resources::share(count).as_ref(),
    ))
    .map_err(|e| Failure::agreed(e, &ctx))?;
    // The chief (worker 0) reports, writes the metrics and gathers the timeline; the
    // others speak only with --verbose.
    let root = match args.cluster.stages {
        Some(_) => mpiflow::pipeline::train::reporter(layout),
        None => (0..layout.ranks.len())
            .find(|r| layout.spec.worker_id(&layout.ranks[*r].task) == Some(0)),
    };
    let chief = root == Some(ctx.rank());
    let root = root.unwrap_or(0);
    // A side-car evaluator (with checkpoints to evaluate) writes its evaluations beside.
    let writer = if chief {
        Some(report::Writer::Chief)
    } else if me.task.is_evaluator() && args.checkpoint_dir.is_some() {
        Some(report::Writer::Evaluator)
    } else {
        None
    };
    let metrics = ctx
        .agree(report::metrics_file(args.metrics.as_deref(), writer))
        .map_err(|e| Failure::agreed(e, &ctx))?;
    let reporter = Reporter::new(args.steps, args.progress, metrics, chief || args.verbose);
    let reporter: report::Shared = std::sync::Arc::new(std::sync::Mutex::new(reporter));
    let comm = mpiflow::transport::mpi::MpiComm::new(ctx.world());
    let secs = if multiple { args.stall_warning } else { 0 };
    let watch =
        report::start_watch(secs, &comm, layout, root, &reporter).map_err(Failure::local)?;
    if let Some(p) = &args.timeline {
        let writable = match chief {
            true => mpiflow::observe::timeline::check_writable(p),
            false => Ok(()),
        };
        ctx.agree(writable).map_err(|e| Failure::agreed(e, &ctx))?;
        report::start_timeline(&comm, root).map_err(Failure::local)?;
    }
    if ctx.rank() == 0 {
        let mode = match args.mode {
            Mode::Ps if args.cluster.stages.is_some() => "ps, sync, pipeline",
            Mode::Ps if args.async_ => "ps, async",
            Mode::Ps => "ps, sync",
            _ if args.cluster.stages.is_some() => "allreduce, pipeline",
            _ => "allreduce",
        };
        let mode = match (args.mode, args.transport) {
            (Mode::Ps, PsTransport::Rma) => format!("{mode}, one-sided (rma)"),
            _ => mode.to_string(),
        };
        emit(&format!(
            "# mpiflow train --mode {mode}: {} tasks, {} train / {} held-out samples, {}, {}, batch {}{}, BLAS threads {} per rank\n",
            layout.ranks.len(),
            train.len(),
            test.len(),
            model.describe(),
            args.train_config().optimizer,
            args.batch,
            towers_label(args.towers),
            pin.blas_threads
        ));
        if let Some(w) = idle_towers(args, Some(layout)) {
            say!("mpiflow: warning: {w}");
        }
        // If mpirun reports a dead rank by number, this line names its task.
        let map: Vec<String> = layout
            .ranks
            .iter()
            .map(|r| format!("{}={}", r.rank.unwrap_or(0), r.task))
            .collect();
        emit(&format!("# ranks: {}\n", map.join(" ")));
    }
    // The timeline is gathered when training ends on every rank: done, or stopped by a
    // signal at the same step everywhere (a collective either way).
    let task = me.task.to_string();
    let timeline = |comm: &mpiflow::transport::mpi::MpiComm| -> Result<(), Failure> {
        match &args.timeline {
            Some(p) => report::finish_timeline(comm, root, &task, p).map_err(Failure::local),
            None => Ok(()),
        }
    };
    let mut log = |e: &Event| report::event(&reporter, e);
    let result = match args.mode {
        Mode::Ps if args.cluster.stages.is_none() => {
            let cfg = PsConfig {
                train: args.train_config(),
                sync: !args.async_,
                replicas_to_aggregate: args.replicas_to_aggregate,
                strategy: args.var_placement,
                partition_bytes: args.partition_bytes,
                peer_timeout: std::time::Duration::from_secs(args.peer_timeout),
                ..PsConfig::default()
            };
            let ran = match args.transport {
                PsTransport::P2p => {
                    ctx.agree(ps::check_config(&cfg, layout))
                        .map_err(|e| Failure::agreed(e, &ctx))?;
                    ps::run(&comm, layout, &model, &cfg, &train, &test, &mut log)
                }
                PsTransport::Rma => {
                    use mpiflow::train::ps::rma;
                    ctx.agree(rma::check_config(&cfg, layout))
                        .map_err(|e| Failure::agreed(e, &ctx))?;
                    rma::run(&comm, layout, &model, &cfg, &train, &test, &mut log)
                }
            };
            match ran {
                Err(ps::PsError::Stopped(s)) => {
                    // The chief names the checkpoint it wrote.
                    drop((watch, reporter));
                    timeline(&comm)?;
                    return Err(Failure::stopped(&s, chief));
                }
                // A step not applied: every worker and ps task has the same verdict and
                // ends cleanly (nothing in flight); the chief prints it, before MPI ends.
                Err(e @ ps::PsError::NotApplied(_)) => {
                    drop((watch, comm, reporter));
                    return Err(Failure::agreed_by(e, chief));
                }
                // A ps stopped every worker for one cause, which it prints and the chief
                // repeats; a line from every other worker would say it again, N times.
                Err(ps::PsError::Remote { .. }) if !chief && !args.verbose => {
                    drop((watch, reporter));
                    // As below: no collective, no MPI_Finalize; exiting non-zero ends the job.
                    std::process::exit(1);
                }
                r => r.map_err(|e| e.to_string()),
            }
        }
        _ if args.cluster.stages.is_some() => {
            use mpiflow::pipeline::{train as pipeline, PipelineConfig};
            let cfg = PipelineConfig {
                train: args.train_config(),
                micro_batches: args.micro_batches,
                schedule: args.schedule,
                balance: args.balance,
                max_param_bytes: args.max_param_bytes,
                memory_share: resources::share(count),
                ps: (args.mode == Mode::Ps).then(|| mpiflow::pipeline::ps::StagePs {
                    placement: mpiflow::train::ps::placement::DeviceSetter {
                        strategy: args.var_placement,
                        partition_bytes: args.partition_bytes,
                    },
                    peer_timeout: std::time::Duration::from_secs(args.peer_timeout),
                }),
                fusion: mpiflow::transport::fusion::FusionConfig {
                    threshold_bytes: args.fusion_threshold,
                    algorithm: args.allreduce_algorithm,
                },
                check_every: args.check_every,
            };
            match pipeline::run(&comm, layout, &model, &cfg, &train, &test, &mut log) {
                Err(mpiflow::pipeline::PipelineError::Stopped(s)) => {
                    drop((watch, reporter));
                    timeline(&comm)?;
                    return Err(Failure::stopped(&s, chief));
                }
                Err(e) if e.is_agreed() => {
                    // Agreed by the replica tasks: the first of them prints it.
                    let spec = &layout.spec;
                    let first = layout
                        .ranks
                        .iter()
                        .position(|r| spec.replica_stage(&r.task).is_some());
                    drop((watch, comm, reporter));
                    return Err(Failure::agreed_by(e, first == Some(ctx.rank())));
                }
                r => r.map_err(|e| e.to_string()),
            }
        }
        _ => {
            let cfg = AllreduceConfig {
                train: args.train_config(),
                check_every: args.check_every,
                overlap: overlap && multiple,
                fusion: mpiflow::transport::fusion::FusionConfig {
                    threshold_bytes: args.fusion_threshold,
                    algorithm: args.allreduce_algorithm,
                },
                perturb_rank: args.perturb_rank,
            };
            match allreduce::run(&comm, layout, &model, &cfg, &train, &test, &mut log) {
                Err(mpiflow::train::engine::TrainError::Stopped(s)) => {
                    drop((watch, reporter));
                    timeline(&comm)?;
                    return Err(Failure::stopped(&s, chief));
                }
                // The same error on every replica at the same step: one line, from the
                // chief (rank 0 may be an idle ps task, which never hears of it).
                Err(e) if e.is_agreed() => {
                    drop((watch, comm, reporter));
                    return Err(Failure::agreed_by(e, chief));
                }
                r => r.map_err(|e| e.to_string()),
            }
        }
    };
    drop((watch, reporter));
    if let Err(e) = result {
        // Peers may be gone or waiting: no collective and no MPI_Finalize, which could
        // wait for a dead rank; exiting non-zero ends the job.
        say!("mpiflow: error: {e}");
        std::process::exit(1);
    }
    timeline(&comm)
}
