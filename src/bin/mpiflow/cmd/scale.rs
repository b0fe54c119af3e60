//! `mpiflow scale`: fits the two links to measured latencies, measures each model's step
//! on this machine, prints the predicted weak scaling by hosts for allreduce and ps, and
//! checks measured runs against the model.

use std::path::{Path, PathBuf};

use clap::ValueEnum;
use mpiflow::model::Model;
use mpiflow::observe::osu_tables::ReadError;
use mpiflow::observe::plot::{self, MeasuredStep, ScaleCurve, ScalePoint};
use mpiflow::scale::{
    exchange_rows, latency_rows, predict, weak_scaling, Link, Links, Mode, Run, Workload,
};
use mpiflow::train::data::Dataset;
use mpiflow::train::optim::Optimizer;

use super::train::model_for;
use crate::args::{ModelChoice, ScaleArgs};
use crate::out::{emit, Failure};

/// A `--run MODEL:HOSTS:FILE`.
struct RunArg {
    model: usize,
    hosts: usize,
    path: PathBuf,
}

fn name(m: ModelChoice) -> String {
    m.to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_string())
}

fn parse_run(s: &str, models: &[ModelChoice]) -> Result<RunArg, Failure> {
    let bad = |why: &str| Failure::local(format!("--run {s}: {why}"));
    let mut parts = s.splitn(3, ':');
    let (Some(m), Some(h), Some(p)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad("give it as MODEL:HOSTS:FILE"));
    };
    let model = models
        .iter()
        .position(|c| name(*c) == m)
        .ok_or_else(|| bad(&format!("model {m} is not one of --model")))?;
    let hosts = h
        .parse::<usize>()
        .ok()
        .filter(|h| *h > 0)
        .ok_or_else(|| bad(&format!("hosts {h} is not a positive count")))?;
    Ok(RunArg {
        model,
        hosts,
        path: PathBuf::from(p),
    })
}

/// [`latency_rows`] or [`exchange_rows`]: a file's name and text to `(bytes, seconds)`.
type ReadRows = fn(&str, &str) -> Result<Vec<(f64, f64)>, ReadError>;

/// The link fitted to the OSU-format output in `path`, read into rows by `rows`.
fn fit_file(path: &Path, flag: &str, rows: ReadRows) -> Result<(Link, usize), Failure> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Failure::local(format!("{flag} {}: {e}", path.display())))?;
    let rows = rows(&path.display().to_string(), &text)
        .map_err(|e| Failure::local(format!("{flag} {e}")))?;
    let link =
        Link::fit(&rows).map_err(|e| Failure::local(format!("{flag} {}: {e}", path.display())))?;
    Ok((link, rows.len()))
}

fn describe(link: &Link) -> String {
    format!(
        "{:.2} us + bytes / {:.2} GB/s",
        link.latency * 1e6,
        link.bandwidth() / 1e9
    )
}

pub(crate) fn run(args: &ScaleArgs) -> Result<(), Failure> {
    if let Some(svg) = &args.svg {
        plot::prepare_output(svg).map_err(Failure::local)?;
    }
    let (shm, shm_n) = fit_file(&args.shm, "--shm", latency_rows)?;
    let (net, net_n) = fit_file(&args.net, "--net", latency_rows)?;
    let mut links = Links::full_duplex(shm, net);
    let exchange = match &args.net_bibw {
        Some(p) => {
            let (x, n) = fit_file(p, "--net-bibw", exchange_rows)?;
            links.exchange = x;
            format!("{} ({n} sizes of {})", describe(&x), p.display())
        }
        None => "as one way (full duplex)".to_string(),
    };
    let runs: Vec<RunArg> = args
        .run
        .iter()
        .map(|r| parse_run(r, &args.model))
        .collect::<Result<_, _>>()?;
    mpiflow::kernels::set_blas_threads(args.blas_threads);
    let (train, _) = Dataset::load_split(&args.data, 1).map_err(Failure::local)?;
    if train.len() < args.batch {
        return Err(Failure::local(format!(
            "--batch {}: data {} has {} training samples",
            args.batch,
            args.data,
            train.len()
        )));
    }
    let (x, y) = train.rows(&(0..args.batch).collect::<Vec<_>>());
    let optimizer = Optimizer::new(args.optimizer, 0.001);
    emit(&format!(
        "# mpiflow scale: links fitted to one-way latencies (latency: messages to 1 KiB; bandwidth: from 64 KiB)\n\
         # shared memory: {} ({shm_n} sizes of {})\n\
         # network:       {} ({net_n} sizes of {})\n\
         # both ways:     {exchange}\n\
         # workers: {} per host, batch {} each, {}, {} BLAS thread(s); ps mode: one ps per host\n",
        describe(&shm),
        args.shm.display(),
        describe(&net),
        args.net.display(),
        args.workers_per_host,
        args.batch,
        optimizer,
        args.blas_threads
    ));
    let mut curves = Vec::new();
    let mut workloads = Vec::new();
    for &choice in &args.model {
        let model = model_for(choice, &args.hidden, &args.data, &train).map_err(Failure::local)?;
        let w = Workload::measure(&model, &x, &y, &optimizer, args.reps).map_err(Failure::local)?;
        emit(&format!(
            "\n# {}: {:.2} MB of parameters; gradients {:.3} ms, update {:.3} ms, sum of one gradient {:.3} ms\n",
            model.describe(),
            w.param_bytes / 1e6,
            w.compute * 1e3,
            w.apply() * 1e3,
            w.param_bytes * w.update.add_per_byte * 1e3
        ));
        let rows = weak_scaling(&args.hosts, args.workers_per_host, &w, links);
        emit(&table(&rows, args.workers_per_host, args.batch));
        emit(&format!("# the shorter step: {}\n", shorter(&rows)));
        for (mode, pick) in [
            (
                Mode::Allreduce,
                (|r: &predict::Row| r.allreduce) as fn(&predict::Row) -> _,
            ),
            (Mode::Ps, |r: &predict::Row| r.ps),
        ] {
            curves.push(ScaleCurve {
                label: format!("{} {mode}", name(choice)),
                points: rows
                    .iter()
                    .map(|r| ScalePoint {
                        hosts: r.hosts as f64,
                        step_s: pick(r).total(),
                        efficiency: pick(r).efficiency(),
                    })
                    .collect(),
            });
        }
        workloads.push(w);
    }
    let (measured, off) = check_runs(&runs, args, &workloads, links)?;
    if let Some(svg) = &args.svg {
        plot::scale_svg(&curves, &measured, svg).map_err(Failure::local)?;
        emit(&format!("# wrote {}\n", svg.display()));
    }
    match off {
        0 => Ok(()),
        n => Err(Failure::local(format!(
            "{n} of {} runs are off their prediction by more than {:.0}%",
            runs.len(),
            args.tolerance * 100.0
        ))),
    }
}

fn table(rows: &[predict::Row], per_host: usize, batch: usize) -> String {
    let mut out = format!(
        "# {:>5} {:>8} {:>13} {:>8} {:>13} {:>8} {:>14} {:>14}\n",
        "hosts", "workers", "allreduce_ms", "eff", "ps_ms", "eff", "allreduce_sps", "ps_sps"
    );
    for r in rows {
        let samples = (r.hosts * per_host * batch) as f64;
        out += &format!(
            "{:>7} {:>8} {:>13.3} {:>8.3} {:>13.3} {:>8.3} {:>14.0} {:>14.0}\n",
            r.hosts,
            r.hosts * per_host,
            r.allreduce.total() * 1e3,
            r.allreduce.efficiency(),
            r.ps.total() * 1e3,
            r.ps.efficiency(),
            samples / r.allreduce.total(),
            samples / r.ps.total()
        );
    }
    out
}

/// Which mode's step is the shorter over runs of host counts: `ps at 2-128 hosts,
/// allreduce at 256-1024 hosts`.
fn shorter(rows: &[predict::Row]) -> String {
    let mut spans: Vec<(Mode, usize, usize)> = Vec::new();
    for r in rows {
        match spans.last_mut() {
            Some((m, _, last)) if *m == r.faster() => *last = r.hosts,
            _ => spans.push((r.faster(), r.hosts, r.hosts)),
        }
    }
    let span = |(m, a, b): &(Mode, usize, usize)| match a == b {
        true => format!("{m} at {a} hosts"),
        false => format!("{m} at {a}-{b} hosts"),
    };
    spans.iter().map(span).collect::<Vec<_>>().join(", ")
}

/// Each run against its prediction: a table, the runs for the plot, and how many are
/// off by more than the tolerance.
fn check_runs(
    runs: &[RunArg],
    args: &ScaleArgs,
    workloads: &[Workload],
    links: Links,
) -> Result<(Vec<MeasuredStep>, usize), Failure> {
    if runs.is_empty() {
        return Ok((Vec::new(), 0));
    }
    emit(&format!(
        "\n# measured runs against the model: the workers' time alone as measured, plus the predicted communication\n\
         # {:>5} {:>9} {:>5} {:>7} {:>3} {:>8} {:>8} {:>12} {:>11} {:>6}  file\n",
        "model", "mode", "hosts", "workers", "ps", "alone_ms", "comm_ms", "predicted_ms", "measured_ms", "ratio"
    ));
    let mut measured = Vec::new();
    let mut off = 0;
    for r in runs {
        let records = mpiflow::observe::metrics::read(&r.path).map_err(Failure::local)?;
        let run = Run::from_records(&records, r.hosts)
            .map_err(|e| Failure::local(format!("--run {}: {e}", r.path.display())))?;
        let w = &workloads[r.model];
        let predicted = run.predicted(w, links);
        let ratio = predicted / run.step;
        let within = (ratio - 1.0).abs() <= args.tolerance;
        off += usize::from(!within);
        let cluster = run.cluster(links);
        let (workers, ps) = (cluster.workers(), cluster.ps());
        emit(&format!(
            "{:>7} {:>9} {:>5} {:>7} {:>3} {:>8.3} {:>8.3} {:>12.3} {:>11.3} {:>6.2}{} {}\n",
            name(args.model[r.model]),
            run.mode.to_string(),
            r.hosts,
            workers,
            ps,
            run.alone * 1e3,
            (predicted - run.alone) * 1e3,
            predicted * 1e3,
            run.step * 1e3,
            ratio,
            if within { " " } else { "!" },
            r.path.display()
        ));
        measured.push(MeasuredStep {
            curve: 2 * r.model + usize::from(run.mode == Mode::Ps),
            hosts: r.hosts as f64,
            measured_s: run.step,
            predicted_s: predicted,
        });
    }
    Ok((measured, off))
}
