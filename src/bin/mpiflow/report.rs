//! What `mpiflow train` shows and records of a run: the chief's lines and progress, the
//! metrics file; the other ranks stay quiet but for warnings, unless `--verbose`.

use std::io::IsTerminal;
use std::path::Path;
use std::sync::{Arc, Mutex};

use mpiflow::cluster::Layout;
use mpiflow::observe::metrics::{evaluator_path, MetricsError, MetricsFile, Record};
use mpiflow::observe::progress::{Progress, Style, Tick};
use mpiflow::observe::stall::{Board, Notice, Watch, WatchConfig};
use mpiflow::observe::timeline::{self, TimelineError};
use mpiflow::train::events::Event;
use mpiflow::transport::mpi::MpiComm;
use mpiflow::transport::{Comm, TransportError};

use crate::args::ProgressArg;
use crate::out::{emit, say};

/// One rank's reporter.
pub(crate) struct Reporter {
    progress: Progress,
    metrics: Option<MetricsFile>,
    /// This rank prints its events (the chief, or any rank with `--verbose`).
    speaks: bool,
}

impl Reporter {
    /// A reporter of a run to `total` steps; `metrics`: the chief's metrics file.
    pub(crate) fn new(
        total: u64,
        progress: ProgressArg,
        metrics: Option<MetricsFile>,
        speaks: bool,
    ) -> Self {
        Reporter {
            progress: Progress::new(total, style(progress, Stream::Stdout)),
            metrics,
            speaks,
        }
    }

    /// Prints and records one event.
    pub(crate) fn event(&mut self, e: &Event) {
        self.record(e);
        let text = match e {
            // Warnings, and a side-car evaluator's evaluations (its output), on every rank.
            _ if !self.speaks && !matches!(e, Event::Warning(_) | Event::Evaluated { .. }) => {
                return
            }
            Event::Step(s) => self.progress.step(&Tick {
                step: s.step,
                loss: s.loss,
                steps_per_sec: s.steps_per_sec,
                samples_per_sec: s.samples_per_sec,
                line: &s.line(),
            }),
            // The evaluation ends the run: the live line stays as it is, above it.
            Event::Accuracy { .. } => format!("{}{e}\n", self.progress.finish()),
            other => self.progress.line(&other.to_string()),
        };
        emit(&text);
    }

    /// Records an event in the metrics file (if it is a step or an evaluation) without
    /// printing it (what the command prints its own way).
    pub(crate) fn record(&mut self, e: &Event) {
        self.write(|wall_s| e.records(wall_s));
    }

    fn write(&mut self, records: impl FnOnce(f64) -> Vec<Record>) {
        let Some(m) = &mut self.metrics else {
            return;
        };
        for r in records(m.wall_s()) {
            if let Err(err) = m.write(&r) {
                // A full disk must not end a long run: say so once, train on.
                say!("mpiflow: warning: {err}; no more metrics are written");
                self.metrics = None;
                return;
            }
        }
    }

    /// A stall watch's notice: a warning line (every rank prints warnings), a metrics
    /// record, and on the timeline the stall's span once it cleared.
    pub(crate) fn stall(&mut self, n: &Notice) {
        self.write(|wall_s| n.record(wall_s).into_iter().collect());
        if let Notice::Cleared {
            step,
            secs,
            missing,
            ..
        } = n
        {
            let end = std::time::Instant::now();
            let start = end - std::time::Duration::from_secs_f64(*secs);
            let detail = timeline::Detail {
                step: Some(*step),
                peer: Some(format!("not arrived: {}", missing.join(", ")).into()),
                bytes: None,
            };
            timeline::span("stall", "wait", start, end, detail);
        }
        self.event(&Event::Warning(n.to_string()));
    }
}

/// A reporter the training loop and the stall watch share.
pub(crate) type Shared = Arc<Mutex<Reporter>>;

/// Reports `e` through a shared reporter.
pub(crate) fn event(reporter: &Shared, e: &Event) {
    reporter.lock().unwrap_or_else(|p| p.into_inner()).event(e);
}

/// Starts this rank's stall watch over `comm` (collective: every rank calls it with the
/// same `secs`), reporting to `reporter`; `None` when `secs` is 0.
pub(crate) fn start_watch(
    secs: u64,
    comm: &MpiComm,
    layout: &Layout,
    chief: usize,
    reporter: &Shared,
) -> Result<Option<Watch>, TransportError> {
    if secs == 0 {
        return Ok(None);
    }
    let own = comm.split(0, comm.rank())?;
    let cfg = WatchConfig {
        threshold: std::time::Duration::from_secs(secs),
        chief,
        tasks: layout.ranks.iter().map(|r| r.task.to_string()).collect(),
    };
    let reporter = reporter.clone();
    let sink = Box::new(move |n: Notice| {
        reporter.lock().unwrap_or_else(|p| p.into_inner()).stall(&n);
    });
    Ok(Some(Watch::start(own, Board::global(), cfg, sink)))
}

impl Drop for Reporter {
    /// Ends the live line, so what follows (the result, an error) starts a line of its own.
    fn drop(&mut self) {
        let end = self.progress.finish();
        if !end.is_empty() {
            emit(&end);
        }
    }
}

/// Who writes a metrics file.
#[derive(Clone, Copy)]
pub(crate) enum Writer {
    /// The chief: `--metrics FILE` itself.
    Chief,
    /// A side-car evaluator: its evaluations, beside (`metrics::evaluator_path`).
    Evaluator,
}

/// This rank's metrics file, created now (`None` without `--metrics` or on a rank that
/// writes none).
pub(crate) fn metrics_file(
    path: Option<&Path>,
    writer: Option<Writer>,
) -> Result<Option<MetricsFile>, MetricsError> {
    match (path, writer) {
        (Some(p), Some(Writer::Chief)) => MetricsFile::create(p).map(Some),
        (Some(p), Some(Writer::Evaluator)) => MetricsFile::create(&evaluator_path(p)).map(Some),
        _ => Ok(None),
    }
}

/// The stream progress goes to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stream {
    Stdout,
    Stderr,
}

/// `--progress` as shown on `stream`: `auto` is live when the stream ends on a terminal:
/// under an MPI launcher, when the `mpirun` (or `mpiexec`) that started this rank on this
/// host writes to one (it passes the bytes on as they come; the rank's own output is a
/// pseudo-terminal of OpenMPI's whatever mpirun's is), otherwise when this process's
/// stream is one. Elsewhere (a batch job's log, a pipe, srun) plain lines.
pub(crate) fn style(arg: ProgressArg, stream: Stream) -> Style {
    let own = match stream {
        Stream::Stdout => std::io::stdout().is_terminal(),
        Stream::Stderr => std::io::stderr().is_terminal(),
    };
    let live = match arg {
        ProgressArg::Live => true,
        ProgressArg::Lines => false,
        ProgressArg::Auto => match launcher_output(stream) {
            Some(tty) => tty,
            None if under_mpi() => false,
            None => own,
        },
    };
    if live {
        Style::Live
    } else {
        Style::Lines
    }
}

/// Whether an MPI launcher started this process (its variables are set).
fn under_mpi() -> bool {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_RANK",
        "SLURM_STEP_ID",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
}

/// Whether the MPI launcher among this process's ancestors (three generations) writes
/// `stream` to a terminal; `None` if there is none (Linux's /proc; none where it cannot
/// tell).
fn launcher_output(stream: Stream) -> Option<bool> {
    let fd = match stream {
        Stream::Stdout => 1,
        Stream::Stderr => 2,
    };
    const LAUNCHERS: [&str; 5] = ["mpirun", "mpiexec", "orterun", "prterun", "mpiexec.hydra"];
    let parent = |pid: u32| -> Option<u32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // `pid (comm) state ppid ...`: comm may hold spaces, so read after its ')'.
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    let mut pid = std::process::id();
    for _ in 0..3 {
        let p = parent(pid).filter(|p| *p > 1)?;
        pid = p;
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if LAUNCHERS.contains(&comm.trim()) {
            let out = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).unwrap_or_default();
            let out = out.to_string_lossy();
            return Some(out.starts_with("/dev/pts/") || out.starts_with("/dev/tty"));
        }
    }
    None
}

/// Starts the timeline on every rank of `comm` (collective): the chief (`root`) made sure
/// it can write the file; every rank's clock is aligned to the chief's.
pub(crate) fn start_timeline<C: Comm>(comm: &C, root: usize) -> Result<(), TimelineError> {
    timeline::enable(timeline::align(comm, root)?);
    Ok(())
}

/// Ends the timeline (collective over `comm`): every rank's spans to the chief (`root`),
/// who writes them to `path`.
pub(crate) fn finish_timeline<C: Comm>(
    comm: &C,
    root: usize,
    task: &str,
    path: &Path,
) -> Result<(), TimelineError> {
    if let Some(trace) = timeline::gather_trace(comm, root, task)? {
        timeline::write(path, &trace)?;
    }
    Ok(())
}
