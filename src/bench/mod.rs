//! OSU-style benchmarks (`mpiflow bench NAME`), printing OSU Micro-Benchmarks 7.4's format
//! so the tables can be read beside OMB's and diffed by scripts that parse it.
//!
//! Each benchmark runs two paths in the same job:
//! - `mpi`: plain rsmpi calls on raw buffers (the baseline, what OMB measures);
//! - `mpiflow`: mpiflow's tensor API, headers, checks and all.
//!
//! With `--path both` (the default) the paths alternate at every size (A, B, A, B, ...,
//! `--rounds` times each) and each table reports, per size, the best round: on these shared
//! machines run-to-run noise is larger than the differences being measured, and
//! alternation is what makes the ratio meaningful. A `# ratio` comment table follows.
//!
//! Method and defaults follow OMB (see `shared/docs/osu-format.md`): latency is half a
//! ping-pong round trip; bandwidth posts a window of `-W` non-blocking sends and waits for
//! a 4-byte ack; collectives report the average over ranks of each rank's mean time,
//! with min, max and iterations under `-f`.

pub mod collective;
pub mod osu;
pub mod p2p;
pub mod pushpull;
pub mod rma;
pub mod rows;
mod verify;

use std::time::Instant;

use crate::observe::progress::{Style, Ticker};
use crate::transport::mpi::MpiComm;
use crate::transport::{Collectives, Comm, TransportError};

pub use osu::{BenchOptions, Buffers, Path};

/// Errors from running a benchmark.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Transport(#[from] TransportError),
    #[error("{0}")]
    P2p(#[from] crate::transport::p2p::P2pError),
    #[error("{0}")]
    Fusion(#[from] crate::transport::fusion::FusionError),
    #[error("{0}")]
    Tensor(#[from] crate::tensor::TensorError),
    #[error("{0}")]
    Option(String),
    #[error("benchmark {name} needs {need} ranks, the job has {have}")]
    Ranks {
        name: String,
        need: String,
        have: usize,
    },
    #[error("unknown benchmark {0:?} ({names})", names = NAMES.join(", "))]
    Unknown(String),
    #[error("data validation failed: {0}")]
    Validation(String),
    /// A one-sided window that could not be allocated or used.
    #[error("{0}")]
    Rma(String),
}

/// The benchmarks `run` knows.
pub const NAMES: [&str; 12] = [
    "latency",
    "bw",
    "bibw",
    "allreduce",
    "bcast",
    "allreduce-fused",
    "pushpull",
    "rows",
    "put_latency",
    "get_latency",
    "acc_latency",
    "get_bw",
];

/// One measured row: per-size statistics over ranks, in microseconds or MB/s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Row {
    pub size: usize,
    pub value: f64,
    pub min: f64,
    pub max: f64,
    pub iterations: usize,
}

impl Row {
    /// A row with one measured value (min = max = value), as point-to-point tables have.
    pub fn point(size: usize, value: f64, iterations: usize) -> Row {
        Row {
            size,
            value,
            min: value,
            max: value,
            iterations,
        }
    }
}

/// Seconds since `t`.
pub(crate) fn secs(t: Instant) -> f64 {
    t.elapsed().as_secs_f64()
}

/// Which of two measurements is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Better {
    /// Latencies.
    Lower,
    /// Bandwidths.
    Higher,
}

impl Better {
    /// The row of best value among a path's rounds.
    pub(crate) fn best(self, rounds: &[Row]) -> Row {
        let rows = rounds.iter().copied();
        match self {
            Better::Lower => rows.min_by(|a, b| a.value.total_cmp(&b.value)),
            Better::Higher => rows.max_by(|a, b| a.value.total_cmp(&b.value)),
        }
        .expect("at least one round")
    }
}

/// How [`best_of_rounds`] alternates: `rounds` passes over all sizes, path `first` first in
/// the first (the first path rotating from round to round).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Schedule {
    pub(crate) rounds: usize,
    pub(crate) first: usize,
}

/// The alternation every table uses: `rounds` passes over all sizes, each path in turn
/// at each size (the first path rotating from round to round, see [`Schedule`]), a
/// barrier before every measurement, keeping each path's best value; returns one table of
/// rows per path.
/// Rounds go over all sizes rather than repeating one size, so that each size's samples
/// spread over the whole run: on a shared machine slow phases last seconds, and a size
/// measured only inside one would show the phase, not the code. `measure(path, size)`
/// runs on every rank (ranks that take no part return anything: only rank 0's tables are
/// printed) and gives a row: one value for point-to-point tables ([`Row::point`]), the
/// average with its minimum, maximum and iterations for collectives; a path's best row is
/// the one of best value.
pub(crate) fn best_of_rounds<P: Copy + Label>(
    coll: &Collectives<MpiComm>,
    sizes: impl IntoIterator<Item = usize>,
    paths: &[P],
    schedule: Schedule,
    better: Better,
    progress: Option<Style>,
    mut measure: impl FnMut(P, usize) -> Result<Row, BenchError>,
) -> Result<Rounds, BenchError> {
    let sizes: Vec<usize> = sizes.into_iter().collect();
    let Schedule { rounds, first } = schedule;
    // samples[i][k]: every round's row of path k at size i.
    let mut samples = vec![vec![Vec::with_capacity(rounds); paths.len()]; sizes.len()];
    // Rank 0 shows where a long run is, on stderr (stdout holds the tables).
    let mut ticker = progress.filter(|_| coll.rank() == 0).map(Ticker::new);
    let say = |text: String| {
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), text.as_bytes());
    };
    for round in 0..rounds {
        for (i, &size) in sizes.iter().enumerate() {
            for j in 0..paths.len() {
                let k = (j + round + first) % paths.len();
                coll.barrier()?;
                samples[i][k].push(measure(paths[k], size)?);
            }
            let at = || {
                let (n, r) = (sizes.len(), round + 1);
                format!(
                    "bench: round {r} of {rounds}, {size} bytes ({} of {n} sizes)",
                    i + 1
                )
            };
            if let Some(text) = ticker.as_mut().and_then(|t| t.tick(at)) {
                say(text);
            }
        }
    }
    if let Some(text) = ticker.as_mut().and_then(Ticker::finish) {
        say(text);
    }
    let tables: Vec<Vec<Row>> = (0..paths.len())
        .map(|k| samples.iter().map(|s| better.best(&s[k])).collect())
        .collect();
    let values = samples
        .iter()
        .map(|s| {
            s.iter()
                .map(|r| r.iter().map(|x| x.value).collect())
                .collect()
        })
        .collect();
    Ok(Rounds {
        tables: paths.iter().map(Label::label).zip(tables).collect(),
        values,
    })
}

/// What a table's `# mpiflow path:` line calls the path it measured.
pub(crate) trait Label {
    fn label(&self) -> String;
}

impl Label for Path {
    /// `mpi`, `mpiflow`, `channel`, `mpi-sgd`: the path's name on the command line.
    fn label(&self) -> String {
        crate::named::Named::name(*self).to_string()
    }
}

/// The middle value (the upper one of an even count).
pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// What [`best_of_rounds`] measured.
pub(crate) struct Rounds {
    /// Per path, its name (`mpi`, `mpiflow`) and a row per size: the best value of all
    /// rounds.
    pub tables: Vec<(String, Vec<Row>)>,
    /// Per size, per path, every round's value.
    values: Vec<Vec<Vec<f64>>>,
}

impl Rounds {
    /// The OSU tables of every path, then the paired ratios to the first path.
    pub fn render(&self, table: impl Fn(&[Row]) -> String) -> String {
        let paired: Vec<Vec<f64>> = (0..self.tables.len()).map(|k| self.paired(k, 0)).collect();
        osu::render(&self.tables, &paired, table)
    }

    /// Per size, the median over rounds of path `k`'s value divided by path `base`'s in
    /// the same round. Paired in time, so a slow phase of the machine slows both sides of
    /// a ratio; the ratio lines print these.
    pub fn paired(&self, k: usize, base: usize) -> Vec<f64> {
        self.values
            .iter()
            .map(|s| {
                let mut r: Vec<f64> = s[k].iter().zip(&s[base]).map(|(a, b)| a / b).collect();
                median(&mut r)
            })
            .collect()
    }

    /// The ratio lines of path `k` to path `base` (`mpiflow/mpi-sgd`).
    pub fn ratio(&self, k: usize, base: usize) -> String {
        let (label, rows) = (&self.tables[k].0, &self.tables[base].1);
        let label = format!("{label}/{} {}", self.tables[base].0, osu::PAIRED);
        osu::ratio_table(&label, rows, &self.paired(k, base))
    }
}

/// Checks a benchmark name and its options against the job size (before anything is sent).
pub fn validate(name: &str, ranks: usize, opts: &BenchOptions) -> Result<(), BenchError> {
    if matches!(name, "pushpull" | "rows") && ranks <= opts.ps.max(1) {
        return Err(BenchError::Ranks {
            name: name.into(),
            need: format!("more than --ps {}", opts.ps.max(1)),
            have: ranks,
        });
    }
    if !NAMES.contains(&name) {
        return Err(BenchError::Unknown(name.into()));
    }
    // OSU refuses these as "Invalid Number of Iterations" and "Invalid Window Size"; at 0
    // a table would hold NaN, or a window would silently carry one message.
    for (flag, value) in [
        (
            "-i (timed iterations per size)",
            opts.iterations.unwrap_or(1),
        ),
        ("-W (messages per window)", opts.window),
        ("--rounds", opts.rounds),
        ("--count (tensors per round)", opts.count),
        ("--ps", opts.ps),
    ] {
        if value == 0 {
            return Err(BenchError::Option(format!(
                "{flag} must be at least 1, not 0"
            )));
        }
    }
    if matches!(opts.path, osu::Path::Channel | osu::Path::Inbox)
        && !matches!(name, "latency" | "bw" | "bibw")
    {
        return Err(BenchError::Option(format!(
            "--path {} is for latency, bw and bibw, not {name}",
            crate::named::Named::name(opts.path)
        )));
    }
    if opts.path == osu::Path::MpiSgd && name != "pushpull" {
        return Err(BenchError::Option(format!(
            "--path mpi-sgd is for pushpull, not {name}"
        )));
    }
    match (name, opts.algorithms.len()) {
        (_, 0) => return Err(BenchError::Option("--algorithm needs a value".into())),
        ("allreduce", _) | (_, 1) => {}
        _ => {
            return Err(BenchError::Option(format!(
                "--algorithm takes a list for allreduce only, not {name}"
            )))
        }
    }
    unused_option(name, opts)?;
    let shm_tuned = opts.shm_slot_bytes.is_some() || opts.shm_stores != osu::ShmStores::Auto;
    if shm_tuned && !matches!(name, "allreduce" | "allreduce-fused") {
        return Err(BenchError::Option(format!(
            "--shm-slot-bytes and --shm-stores are for allreduce and allreduce-fused, not {name}"
        )));
    }
    if (matches!(name, "latency" | "bw" | "bibw" | "pushpull") || rma::NAMES.contains(&name))
        && ranks < 2
    {
        return Err(BenchError::Ranks {
            name: name.into(),
            need: "at least 2".into(),
            have: ranks,
        });
    }
    Ok(())
}

/// An option given a value other than its default that benchmark `name` does not use is
/// refused, as OSU's programs refuse options outside their own (`osu_latency -W 8` is an
/// invalid option): a table measured without what was asked for, such as `-c` on a
/// benchmark that checks nothing, would mislead.
fn unused_option(name: &str, opts: &BenchOptions) -> Result<(), BenchError> {
    let d = BenchOptions::default();
    let p2p = matches!(name, "latency" | "bw" | "bibw");
    let window = matches!(name, "bw" | "bibw" | "get_bw");
    let collective = matches!(name, "allreduce" | "bcast" | "allreduce-fused");
    let reduces = matches!(name, "allreduce" | "allreduce-fused");
    let options = [
        (
            "-T",
            opts.element != d.element,
            name == "allreduce",
            "allreduce (the elements it sums)",
        ),
        ("-W", opts.window != d.window, window, "bw, bibw and get_bw"),
        ("-b", opts.buffers != d.buffers, p2p, "latency, bw and bibw"),
        (
            "-f",
            opts.full,
            collective,
            "allreduce, bcast and allreduce-fused",
        ),
        (
            "-c",
            opts.validate,
            p2p || matches!(name, "allreduce" | "bcast"),
            "latency, bw, bibw, allreduce and bcast",
        ),
        (
            "--algorithm",
            opts.algorithms != d.algorithms,
            reduces,
            "allreduce and allreduce-fused",
        ),
        (
            "--count",
            opts.count != d.count,
            name == "allreduce-fused",
            "allreduce-fused",
        ),
        (
            "--ps",
            opts.ps != d.ps,
            matches!(name, "pushpull" | "rows"),
            "pushpull and rows",
        ),
        (
            "--transport",
            opts.transport != d.transport,
            name == "pushpull",
            "pushpull",
        ),
    ];
    match options.iter().find(|(_, given, used, _)| *given && !used) {
        Some((flag, _, _, by)) => Err(BenchError::Option(format!(
            "{flag} is for {by}, not {name}"
        ))),
        None => Ok(()),
    }
}

/// The memory a rank of benchmark `name` holds at its largest size, at least: windows of
/// large messages are more than a node has (`bw -b multiple` at 1 GiB was ended by the
/// kernel's OOM killer with no word, `get_bw -W 1000` by a failed `MPI_Win_allocate`).
pub fn need(name: &str, opts: &BenchOptions) -> crate::train::resources::Need {
    let max = opts.sizes.map_or(1 << 22, |(_, max)| max) as u64;
    let window = opts.window.max(1) as u64;
    let parts: Vec<(String, u64)> = match name {
        "latency" | "bw" | "bibw" => {
            let n = p2p::buffers(name, opts) as u64;
            vec![
                ("OSU's single buffers".into(), 2 * max),
                (
                    format!("{n} send and {n} receive buffers"),
                    2 * n.saturating_mul(max),
                ),
            ]
        }
        "get_bw" => vec![(
            format!("a window of {window} messages"),
            window.saturating_mul(max),
        )],
        "allreduce-fused" => {
            let n = opts.count.max(1) as u64;
            vec![(
                format!("{n} send and {n} receive buffers"),
                2 * n.saturating_mul(max),
            )]
        }
        n if rma::NAMES.contains(&n) => vec![("a window".into(), max)],
        _ => vec![("send and receive buffers".into(), 2 * max)],
    };
    crate::train::resources::Need { parts }
}

/// Runs the benchmark `name` on every rank of `comm`; rank 0 prints.
pub fn run(comm: &MpiComm, name: &str, opts: &BenchOptions) -> Result<(), BenchError> {
    validate(name, comm.size(), opts)?;
    let mut coll = Collectives::new(MpiComm::new(comm.raw()));
    if let Some(bytes) = opts.shm_slot_bytes {
        coll.tuning.shm_slot_bytes = bytes;
    }
    if let Some(mode) = opts.shm_stores.forced() {
        // Collective (it makes the shared segments): every rank has the same options.
        coll.force_shm_stores(Some(mode))?;
    }
    let out = match name {
        "latency" | "bw" | "bibw" => p2p::run(comm, name, opts)?,
        "pushpull" => pushpull::run(comm, &coll, opts)?,
        "rows" => rows::run(comm, &coll, opts)?,
        n if rma::NAMES.contains(&n) => rma::run(comm, n, opts)?,
        "allreduce" | "bcast" | "allreduce-fused" => collective::run(&coll, name, opts)?,
        other => return Err(BenchError::Unknown(other.into())),
    };
    if comm.rank() == 0 {
        let mut stdout = std::io::stdout().lock();
        let _ = std::io::Write::write_all(&mut stdout, out.as_bytes());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_needs_grow_with_windows_counts_and_sizes() {
        let gib = 1usize << 30;
        let total = |name: &str, o: &BenchOptions| need(name, o).total();
        let mut o = BenchOptions {
            sizes: Some((1, gib)),
            ..BenchOptions::default()
        };
        let g = gib as u64;
        // -b single: OSU's pair and one pair of a path's.
        assert_eq!(total("bw", &o), 4 * g);
        assert_eq!(total("latency", &o), 4 * g);
        o.buffers = osu::Buffers::Multiple;
        assert_eq!(total("bw", &o), (2 + 2 * 64) * g);
        // Latency sends one message at a time, whatever -b says.
        assert_eq!(total("latency", &o), 4 * g);
        o.window = 1000;
        assert_eq!(total("get_bw", &o), 1000 * g);
        assert_eq!(total("get_latency", &o), g);
        o.count = 8;
        assert_eq!(total("allreduce-fused", &o), 16 * g);
        assert_eq!(total("allreduce", &o), 2 * g);
        assert_eq!(
            need("bw", &o).to_string(),
            "2149.6 GB (OSU's single buffers 2.1 GB, 1000 send and 1000 receive buffers 2147.5 GB)"
        );
    }

    #[test]
    fn counts_of_zero_are_refused_as_osu_refuses_them() {
        assert_eq!(validate("bw", 2, &BenchOptions::default()), Ok(()));
        let zero = |set: fn(&mut BenchOptions)| {
            let mut opts = BenchOptions::default();
            set(&mut opts);
            validate("bw", 2, &opts).unwrap_err().to_string()
        };
        assert_eq!(
            zero(|o| o.iterations = Some(0)),
            "-i (timed iterations per size) must be at least 1, not 0"
        );
        assert_eq!(
            zero(|o| o.window = 0),
            "-W (messages per window) must be at least 1, not 0"
        );
        assert_eq!(zero(|o| o.rounds = 0), "--rounds must be at least 1, not 0");
        assert_eq!(
            zero(|o| o.count = 0),
            "--count (tensors per round) must be at least 1, not 0"
        );
        assert_eq!(zero(|o| o.ps = 0), "--ps must be at least 1, not 0");
    }

    #[test]
    fn options_a_benchmark_does_not_use_are_refused() {
        use crate::transport::Algorithm;
        let refused = |name: &str, set: fn(&mut BenchOptions)| {
            let mut opts = BenchOptions::default();
            set(&mut opts);
            validate(name, 4, &opts).err().map(|e| e.to_string())
        };
        type Set = fn(&mut BenchOptions);
        let cases: [(&str, Set, Option<&str>); 12] = [
            (
                "latency",
                |o| o.window = 8,
                Some("-W is for bw, bibw and get_bw, not latency"),
            ),
            ("bw", |o| o.window = 8, None),
            ("get_bw", |o| o.window = 8, None),
            ("latency", |o| o.buffers = osu::Buffers::Multiple, None),
            (
                "allreduce",
                |o| o.buffers = osu::Buffers::Multiple,
                Some("-b is for latency, bw and bibw, not allreduce"),
            ),
            (
                "bw",
                |o| o.full = true,
                Some("-f is for allreduce, bcast and allreduce-fused, not bw"),
            ),
            ("bcast", |o| o.full = true, None),
            (
                "allreduce-fused",
                |o| o.validate = true,
                Some("-c is for latency, bw, bibw, allreduce and bcast, not allreduce-fused"),
            ),
            (
                "bcast",
                |o| o.algorithms = vec![Algorithm::Ring],
                Some("--algorithm is for allreduce and allreduce-fused, not bcast"),
            ),
            (
                "allreduce-fused",
                |o| o.algorithms = vec![Algorithm::Ring],
                None,
            ),
            (
                "allreduce",
                |o| o.count = 10,
                Some("--count is for allreduce-fused, not allreduce"),
            ),
            (
                "latency",
                |o| o.transport = crate::train::ps::PsTransport::Rma,
                Some("--transport is for pushpull, not latency"),
            ),
        ];
        for (name, set, want) in cases {
            assert_eq!(refused(name, set).as_deref(), want, "{name}");
        }
        // A default spelled out asks for nothing.
        assert_eq!(refused("latency", |o| o.window = 64), None);
    }
}
