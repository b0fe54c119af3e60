//! `mpiflow train --model dlrm`: a click model whose embedding tables live in this
//! process (`--mode local`) or on the ps tasks (`--mode ps`: the dense variables there
//! too; `--mode hybrid`: the dense ones replicated on the workers, summed by allreduce).

use std::collections::BTreeMap;

use mpiflow::model::dlrm::Dlrm;
use mpiflow::model::embedding::TableSpec;
use mpiflow::train::ctr::{Criteo, CtrData, CtrReport, CtrRun, Part, SyntheticCtr};
use mpiflow::train::engine::TrainError;
use mpiflow::train::events::Event;
use mpiflow::train::ps::{PsError, PsTransport};
use mpiflow::train::resources;
use mpiflow::transport::threads;

use super::resolve_with;
use super::train::{pin_rank, prepare_outputs};
use crate::args::{Mode, ModelChoice, TrainArgs};
use crate::out::{emit, say, Failure};
use crate::report::{self, Reporter};

/// Held-out samples of the synthetic set, at most (a tenth of the training samples if
/// fewer).
const HELD_OUT: usize = 20_000;
/// Rows of each table of Criteo data (its ids hashed into them).
const CRITEO_ROWS: u64 = 1 << 20;

/// Click data: the set, and how many of its last samples are held out.
struct Clicks {
    data: Box<dyn CtrData>,
    held_out: usize,
}

pub(crate) fn run(args: &TrainArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    refuse(args).map_err(Failure::local)?;
    match args.mode {
        Mode::Local => local(args),
        _ => distributed(args, env),
    }
}

/// What `--model dlrm` does not train (yet), in one line before anything starts.
fn refuse(args: &TrainArgs) -> Result<(), String> {
    let why = match (args.mode, args.model) {
        (Mode::Hybrid, m) if m != ModelChoice::Dlrm => {
            "--mode hybrid trains models with embedding tables: --model dlrm"
        }
        (Mode::Allreduce, _) => {
            "--model dlrm trains in --mode local, ps or hybrid (its tables live in one process or on ps tasks)"
        }
        _ if args.towers > 1 => "--towers is for dense models, not --model dlrm",
        _ if args.timeline.is_some() => "--timeline is not written for --model dlrm",
        _ if args.target_accuracy.is_some() => {
            "--target-accuracy is for classifiers; --model dlrm reports AUC"
        }
        _ => return Ok(()),
    };
    Err(why.to_string())
}

/// The click data `--data` names (synthetic-ctr when it names none of its own).
fn clicks(spec: &str) -> Result<Clicks, String> {
    let err = |e: mpiflow::train::ctr::CtrError| e.to_string();
    // `--data`'s default (digits) names no click data: the generator's defaults then.
    let (kind, rest) = match spec {
        "digits" => ("synthetic-ctr", ""),
        s => s.split_once(':').unwrap_or((s, "")),
    };
    match kind {
        "synthetic-ctr" => {
            let mut data = SyntheticCtr::parse(rest).map_err(err)?;
            let held_out = (data.samples / 10).clamp(1, HELD_OUT);
            data.samples += held_out;
            Ok(Clicks {
                data: Box::new(data),
                held_out,
            })
        }
        "criteo" if !rest.is_empty() => {
            let data = Criteo::load(std::path::Path::new(rest), CRITEO_ROWS, None).map_err(err)?;
            let held_out = (data.len() / 10).max(1);
            if data.len() < 2 {
                return Err(format!("{rest}: {} samples, too few to hold any out", data.len()));
            }
            Ok(Clicks {
                data: Box::new(data),
                held_out,
            })
        }
        _ => Err(format!(
            "--model dlrm takes click data: --data synthetic-ctr[:OPTIONS] or criteo:PATH, not {spec}"
        )),
    }
}

/// The model for `data`'s features, shaped by the flags.
fn model(args: &TrainArgs, data: &dyn CtrData) -> Result<Dlrm, String> {
    let tables = (data.tables().iter().enumerate())
        .map(|(f, rows)| TableSpec::new(&format!("emb{f}"), *rows, args.embedding_dim))
        .collect();
    Dlrm::new(data.dense(), tables, &args.bottom, &args.top).map_err(|e| e.to_string())
}

/// What this rank holds before any row is made (rows are checked as they are made, on
/// the task that holds them): the dense parameters as the mode keeps them, and a worker's
/// batch of rows and their gradients.
fn rank_need(
    args: &TrainArgs,
    layout: &mpiflow::cluster::Layout,
    task: &mpiflow::cluster::TaskId,
    m: &Dlrm,
) -> Result<resources::Need, String> {
    let dense = m.dense_model(args.seed).map_err(|e| e.to_string())?;
    let spec = &layout.spec;
    let per_worker = (args.batch as usize).div_ceil(spec.num_workers().max(1));
    let opt = args.train_config().optimizer;
    let features = m.tables().len() as u64;
    let dim = m.tables().first().map_or(0, |t| t.dim) as u64;
    let rows = (
        "batch rows".to_string(),
        per_worker as u64 * features * dim * 4 * 3,
    );
    Ok(match (args.mode, spec.worker_id(task)) {
        (Mode::Ps, Some(_)) => {
            let mut need = resources::worker_need(&dense, per_worker);
            need.parts.push(rows);
            need
        }
        (_, Some(_)) => {
            let mut need = resources::replica_need(&dense, per_worker, &opt);
            need.parts.push(rows);
            need
        }
        (Mode::Ps, None) if task.job == "ps" => {
            let ps = spec.num_tasks("ps").unwrap_or(1);
            let staged = if args.async_ { 1 } else { spec.num_workers() };
            resources::ps_need(&dense, &opt, ps, staged)
        }
        _ => resources::Need { parts: Vec::new() },
    })
}

/// The run's header: the data, the model, the updates.
fn header(
    args: &TrainArgs,
    mode: &str,
    train: &dyn CtrData,
    test: &dyn CtrData,
    m: &Dlrm,
) -> String {
    format!(
        "# mpiflow train --mode {mode}: {} train / {} held-out samples, {}, {}, rows by {} lr {}, batch {}\n",
        train.len(),
        test.len(),
        m.describe(),
        args.train_config().optimizer,
        clap::ValueEnum::to_possible_value(&args.sparse_optimizer)
            .map_or_else(String::new, |v| v.get_name().to_string()),
        args.sparse_lr,
        args.batch
    )
}

/// The chief's last line.
fn summary(r: &CtrReport) -> String {
    let (auc, logloss, total) = match r.evaluation {
        Some(e) => (e.auc.unwrap_or(f64::NAN), e.logloss, e.total),
        None => (f64::NAN, f64::NAN, 0),
    };
    format!(
        "auc {auc:.4} (log loss {logloss:.4}, {total} held-out samples) after {} steps, loss {:.4}, {:.0} samples/s\n",
        r.steps, r.loss, r.samples_per_sec
    )
}

fn local(args: &TrainArgs) -> Result<(), Failure> {
    let pin = pin_rank(args, 0, 1);
    if let Some(w) = &pin.warning {
        say!("mpiflow: warning: {w}");
    }
    prepare_outputs(args).map_err(Failure::local)?;
    let clicks = clicks(&args.data).map_err(Failure::local)?;
    let (train, test) = Part::split(clicks.data.as_ref(), clicks.held_out);
    let m = model(args, &train).map_err(Failure::local)?;
    let metrics = report::metrics_file(args.metrics.as_deref(), Some(report::Writer::Chief))
        .map_err(Failure::local)?;
    emit(&header(args, "local", &train, &test, &m));
    let mut reporter = Reporter::new(args.steps, args.progress, metrics, true);
    let cfg = args.train_config();
    let sparse = args.sparse_optimizer.with_lr(args.sparse_lr);
    let run = CtrRun::new(&m, (&train, &test), &cfg, sparse).within(resources::share(1));
    let report = match run.local(&mut |e| reporter.event(e)) {
        Err(TrainError::Stopped(s)) => {
            drop(reporter);
            return Err(Failure::stopped(&s, true));
        }
        r => r.map_err(Failure::local)?,
    };
    drop(reporter);
    emit(&summary(&report));
    Ok(())
}

/// `--mode ps` or `--mode hybrid` on this rank.
fn distributed(args: &TrainArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    // The stall watch asks the others from a thread of its own (MPI_THREAD_MULTIPLE),
    // which one-sided windows may refuse.
    let refused = match args.transport {
        PsTransport::Rma => threads::windows_refuse_threads(&threads::library(), env),
        PsTransport::P2p => None,
    };
    let watching = args.stall_warning > 0 && refused.is_none();
    let (resolved, ctx, multiple) =
        resolve_with(&args.cluster, args.agreed(), env, watching, true)?;
    let Some(ctx) = ctx else {
        return Err(Failure::local(
            "distributed training runs under mpirun (or srun --mpi=pmix)",
        ));
    };
    if ctx.rank() == 0 && args.stall_warning > 0 {
        match refused {
            Some(why) => say!("mpiflow: warning: {why}; no stall reports (--stall-warning)"),
            None if !multiple => say!("mpiflow: warning: MPI did not grant MPI_THREAD_MULTIPLE; no stall reports (--stall-warning)"),
            None => {}
        }
    }
    drop(resolved.port_guard);
    let layout = &resolved.layout;
    let agree = |r: Result<(), String>| ctx.agree(r).map_err(|e| Failure::agreed(e, &ctx));
    agree(
        mpiflow::train::ps::Roles::new(layout)
            .map(drop)
            .map_err(|e| e.to_string()),
    )?;
    agree(prepare_outputs(args).map_err(|e| e.to_string()))?;
    let (local, count) = ctx.machine_local();
    let pin = pin_rank(args, local, count);
    for w in ctx.gather_warnings(pin.warning.as_deref()) {
        if ctx.rank() == 0 {
            say!("mpiflow: warning: {w}");
        }
    }
    let clicks = ctx
        .agree(clicks(&args.data))
        .map_err(|e| Failure::agreed(e, &ctx))?;
    let (train, test) = Part::split(clicks.data.as_ref(), clicks.held_out);
    let m = ctx
        .agree(model(args, &train))
        .map_err(|e| Failure::agreed(e, &ctx))?;
    let me = &layout.ranks[ctx.rank()].task;
    let share = resources::share(count);
    let fits = rank_need(args, layout, me, &m).and_then(|need| {
        resources::check(&me.to_string(), &need, share.as_ref()).map_err(|e| e.to_string())
    });
    agree(fits)?;
    let chief_rank =
        (0..layout.ranks.len()).find(|r| layout.spec.worker_id(&layout.ranks[*r].task) == Some(0));
    let chief = chief_rank == Some(ctx.rank());
    let writer = chief.then_some(report::Writer::Chief);
    let metrics = ctx
        .agree(report::metrics_file(args.metrics.as_deref(), writer))
        .map_err(|e| Failure::agreed(e, &ctx))?;
    let reporter = Reporter::new(args.steps, args.progress, metrics, chief || args.verbose);
    let reporter: report::Shared = std::sync::Arc::new(std::sync::Mutex::new(reporter));
    let mode = match args.mode {
        Mode::Hybrid if args.transport == PsTransport::Rma && args.async_ => {
            "hybrid, rows over one-sided windows, async"
        }
        Mode::Hybrid if args.transport == PsTransport::Rma => "hybrid, rows over one-sided windows",
        Mode::Hybrid => "hybrid",
        _ if args.async_ && args.transport == PsTransport::Rma => "ps, async, one-sided windows",
        _ if args.async_ => "ps, async",
        _ if args.transport == PsTransport::Rma => "ps, sync, one-sided windows",
        _ => "ps, sync",
    };
    if ctx.rank() == 0 {
        emit(&header(args, mode, &train, &test, &m));
    }
    let comm = mpiflow::transport::mpi::MpiComm::new(ctx.world());
    let secs = if multiple { args.stall_warning } else { 0 };
    let watch = report::start_watch(secs, &comm, layout, chief_rank.unwrap_or(0), &reporter)
        .map_err(Failure::local)?;
    let cfg = args.train_config();
    let sparse = args.sparse_optimizer.with_lr(args.sparse_lr);
    let run = CtrRun::new(&m, (&train, &test), &cfg, sparse)
        .within(share)
        .rows_ahead(args.rows_ahead.library());
    let mut log = |e: &Event| report::event(&reporter, e);
    let timeout = std::time::Duration::from_secs(args.peer_timeout);
    let ran = match args.mode {
        Mode::Hybrid => {
            let cfg = mpiflow::train::hybrid::HybridConfig {
                allreduce: mpiflow::train::allreduce::AllreduceConfig {
                    train: cfg.clone(),
                    check_every: args.check_every,
                    fusion: mpiflow::transport::fusion::FusionConfig {
                        threshold_bytes: args.fusion_threshold,
                        algorithm: args.allreduce_algorithm,
                    },
                    ..Default::default()
                },
                peer_timeout: timeout,
                transport: args.transport,
                window_rows: args.window_rows,
                asynchronous: args.async_,
                ..Default::default()
            };
            run.hybrid(&comm, layout, &cfg, &mut log)
        }
        _ => {
            let cfg = mpiflow::train::ps::PsConfig {
                train: cfg.clone(),
                sync: !args.async_,
                replicas_to_aggregate: args.replicas_to_aggregate,
                strategy: args.var_placement,
                partition_bytes: args.partition_bytes,
                peer_timeout: timeout,
                ..Default::default()
            };
            match args.transport {
                PsTransport::Rma => {
                    run.ps_over_windows(&comm, layout, (&cfg, args.window_rows), &mut log)
                }
                PsTransport::P2p => run.ps(&comm, layout, &cfg, &mut log),
            }
        }
    };
    drop(watch);
    drop(reporter);
    match ran {
        Ok(Some(r)) if chief => {
            emit(&summary(&r));
            Ok(())
        }
        Ok(_) => Ok(()),
        Err(TrainError::Stopped(s)) | Err(TrainError::Ps(PsError::Stopped(s))) => {
            Err(Failure::stopped(&s, chief))
        }
        Err(e) if e.is_agreed() => {
            drop(comm);
            Err(Failure::agreed_by(e, chief))
        }
        // A ps stopped every worker for one cause, which it prints and the chief repeats.
        Err(TrainError::Ps(PsError::Remote { .. })) if !chief && !args.verbose => {
            std::process::exit(1)
        }
        Err(e) => {
            // Peers may be gone or waiting: no collective and no MPI_Finalize.
            say!("mpiflow: error: {e}");
            std::process::exit(1);
        }
    }
}
