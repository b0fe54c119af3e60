//! OSU options (`-m -i -x -W -f -c`) and OSU 7.4's output format.

use std::fmt::Write as _;

use super::Row;
use crate::transport::Algorithm;

/// Which implementation a benchmark measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Path {
    /// Plain rsmpi calls on raw buffers (the baseline).
    Mpi,
    /// mpiflow's tensor API.
    Mpiflow,
    /// mpiflow's persistent channels (latency, bw, bibw): the header crosses once, when
    /// the channel opens; messages carry the payload alone.
    Channel,
    /// Channels whose receiving rank keeps the window's receives posted ahead
    /// ([`crate::transport::inbox`]; latency, bw, bibw).
    Inbox,
    /// Plain rsmpi push and pull whose ps applies the SGD update to its parameters
    /// between them (pushpull): what any parameter server that updates costs.
    MpiSgd,
    /// Every path the benchmark has, alternating at every size.
    #[default]
    Both,
}

impl crate::named::Named for Path {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (
            Path::Mpi,
            "mpi",
            "Plain rsmpi calls on raw buffers (the baseline)",
        ),
        (Path::Mpiflow, "mpiflow", "mpiflow's tensor API"),
        (
            Path::Channel,
            "channel",
            "mpiflow's persistent channels (latency, bw, bibw)",
        ),
        (
            Path::Inbox,
            "inbox",
            "channels with the window's receives posted ahead (latency, bw, bibw)",
        ),
        (
            Path::MpiSgd,
            "mpi-sgd",
            "Plain rsmpi push and pull with the SGD update on the ps (pushpull)",
        ),
        (
            Path::Both,
            "both",
            "mpi and mpiflow (with channel and inbox for latency, bw and bibw, mpi-sgd for pushpull), alternating at every size",
        ),
    ];
}

/// OSU's options, plus mpiflow's (`mpiflow bench --help` spells them).
#[derive(Debug, Clone, PartialEq)]
pub struct BenchOptions {
    /// Message sizes in bytes, `[MIN:]MAX`, doubling from MIN.
    pub sizes: Option<(usize, usize)>,
    /// Timed iterations per size (default: OSU's, by benchmark and size).
    pub iterations: Option<usize>,
    /// Warm-up iterations per size (default: OSU's).
    pub warmup: Option<usize>,
    /// Window of non-blocking sends (bw, bibw).
    pub window: usize,
    /// OSU's `-b`: whether a window's messages share one buffer per side (bw, bibw).
    pub buffers: Buffers,
    /// Full statistics for collectives: min, max, iterations.
    pub full: bool,
    /// Check the data that arrived (outside the timed loop).
    pub validate: bool,
    /// Digits after the point in the tables: OSU's compile-time `FLOAT_PRECISION` (2),
    /// which rounds a 0.2 us latency to 5%; more to compare runs finer.
    pub digits: usize,
    /// OSU's `-T`: the elements an allreduce sums (allreduce only; OSU's default is
    /// `mpi_char`).
    pub element: Element,
    /// Which path to measure.
    pub path: Path,
    /// Alternating rounds per size with `--path both`; each table keeps the best round.
    pub rounds: usize,
    /// Places the paths' order turns before the first round (0: `mpi` first), so that
    /// separate jobs of one round each can balance the order between them.
    pub rotate: usize,
    /// Allreduce algorithm of the mpiflow path; a list (`auto,ring,shm`) measures each as a
    /// path of its own in the same job, all paired with `mpi` (allreduce only).
    pub algorithms: Vec<Algorithm>,
    /// Tensors per round in allreduce-fused.
    pub count: usize,
    /// Parameter-server tasks in pushpull (the first ranks).
    pub ps: usize,
    /// How pushpull's mpiflow path reaches the ps: messages, or one-sided windows.
    pub transport: crate::train::ps::PsTransport,
    /// Bytes per slot of the shared-memory allreduce, rounded up to 4096 (allreduce and
    /// allreduce-fused; default: the library's, 256 KiB): to re-tune on another machine.
    pub shm_slot_bytes: Option<usize>,
    /// Stores into the shared-memory allreduce's slots: as measured (auto), or always
    /// cached or streaming (allreduce and allreduce-fused).
    pub shm_stores: ShmStores,
    /// Where a run longer than 2 s is, on rank 0's stderr (`None`: quiet).
    pub progress: Option<crate::observe::progress::Style>,
}

/// OSU's `-b single|multiple` (bw, bibw; latency always has one buffer per side): one send
/// and one receive buffer per rank, allocated once at the largest size and reused by every
/// message of a window (OSU's default), or a buffer per message of the window, allocated
/// for each size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Buffers {
    #[default]
    Single,
    Multiple,
}

impl crate::named::Named for Buffers {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (
            Buffers::Single,
            "single",
            "One send and one receive buffer per rank, reused by every message (OSU's default)",
        ),
        (
            Buffers::Multiple,
            "multiple",
            "A buffer per message of the window",
        ),
    ];
}

/// OSU's `-T mpi_char|mpi_int|mpi_float`: the elements `osu_allreduce` sums, bytes by
/// default. The `mpi` path reduces the same MPI type (for `mpi_char` `MPI_INT8_T`, which
/// rsmpi names where it has no `MPI_CHAR`: one byte, summed by the same kernel in Open MPI,
/// measured the same in `benches/compare/allreduce_loop.c`); the mpiflow path a tensor of
/// `u8`, `i32` or `f32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Element {
    #[default]
    Char,
    Int,
    Float,
}

impl crate::named::Named for Element {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (Element::Char, "mpi_char", "Bytes (OSU's default)"),
        (Element::Int, "mpi_int", "32-bit integers"),
        (Element::Float, "mpi_float", "32-bit floats, as gradients"),
    ];
}

impl Element {
    /// The MPI type's name, as OSU's tables print it.
    pub fn mpi_name(self) -> &'static str {
        match self {
            Element::Char => "MPI_CHAR",
            Element::Int => "MPI_INT",
            Element::Float => "MPI_FLOAT",
        }
    }

    /// The tensor dtype of the mpiflow path.
    pub fn dtype(self) -> crate::tensor::DType {
        use crate::tensor::DType;
        match self {
            Element::Char => DType::U8,
            Element::Int => DType::I32,
            Element::Float => DType::F32,
        }
    }
}

/// `--shm-stores`: see `crate::transport::collectives::stores`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShmStores {
    /// Whichever makes a step cheaper, as measured.
    #[default]
    Auto,
    Cached,
    Streaming,
}

impl crate::named::Named for ShmStores {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (
            ShmStores::Auto,
            "auto",
            "Whichever makes a step cheaper, as measured",
        ),
        (ShmStores::Cached, "cached", ""),
        (ShmStores::Streaming, "streaming", ""),
    ];
}

impl ShmStores {
    /// The forced mode, if any.
    pub fn forced(self) -> Option<crate::transport::collectives::stores::StoreMode> {
        use crate::transport::collectives::stores::StoreMode;
        match self {
            ShmStores::Auto => None,
            ShmStores::Cached => Some(StoreMode::Cached),
            ShmStores::Streaming => Some(StoreMode::Streaming),
        }
    }
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            sizes: None,
            iterations: None,
            warmup: None,
            window: 64,
            buffers: Buffers::Single,
            full: false,
            validate: false,
            digits: 2,
            element: Element::Char,
            path: Path::Both,
            rounds: 3,
            rotate: 0,
            algorithms: vec![Algorithm::Auto],
            count: 100,
            ps: 1,
            transport: Default::default(),
            shm_slot_bytes: None,
            shm_stores: ShmStores::Auto,
            progress: None,
        }
    }
}

impl BenchOptions {
    /// The paths to measure, and how they alternate (rounds per size, the first path).
    pub(crate) fn plan(&self) -> (Vec<Path>, super::Schedule) {
        match self.path {
            Path::Both => (
                vec![Path::Mpi, Path::Mpiflow],
                super::Schedule {
                    rounds: self.rounds.max(1),
                    first: self.rotate,
                },
            ),
            p => (
                vec![p],
                super::Schedule {
                    rounds: 1,
                    first: 0,
                },
            ),
        }
    }
}

/// How ratio lines computed from paired samples say so.
pub const PAIRED: &str = "(median over rounds of the ratio within a round)";

/// Every path's table after a `# mpiflow path: LABEL` line.
pub fn tables(paths: &[(String, Vec<Row>)], table: impl Fn(&[Row]) -> String) -> String {
    let mut out = String::new();
    for (label, rows) in paths {
        let _ = writeln!(out, "# mpiflow path: {label}");
        out.push_str(&table(rows));
    }
    out
}

/// Every path's table ([`tables`]), then, when the first path is `mpi`, each other path's
/// ratio to it (`mpiflow/mpi`, `channel/mpi`) from `paired`: per path, per size, the
/// median over rounds of the ratio within a round.
pub fn render(
    paths: &[(String, Vec<Row>)],
    paired: &[Vec<f64>],
    table: impl Fn(&[Row]) -> String,
) -> String {
    let mut out = tables(paths, table);
    if let [(first, a), rest @ ..] = paths {
        for (k, (label, _)) in rest.iter().enumerate().filter(|_| first == "mpi") {
            let label = format!("{label}/mpi {PAIRED}");
            out.push_str(&ratio_table(&label, a, &paired[k + 1]));
        }
    }
    out
}

/// Parses `[MIN:]MAX`.
pub fn parse_sizes(s: &str) -> Result<(usize, usize), String> {
    let num = |x: &str| {
        x.trim()
            .parse::<usize>()
            .map_err(|_| format!("{x:?} is not a size in bytes"))
    };
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (num(a)?, num(b)?),
        None => (1, num(s)?),
    };
    if min > max {
        return Err(format!("MIN {min} is larger than MAX {max}"));
    }
    if max > 1 << 30 {
        return Err(format!("MAX {max} is larger than 1 GiB"));
    }
    Ok((min, max))
}

/// Sizes from `min` to `max`, doubling (0 is followed by 1).
pub fn sizes(min: usize, max: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut s = min;
    while s <= max {
        out.push(s);
        s = if s == 0 { 1 } else { s * 2 };
    }
    out
}

/// OSU's defaults: (iterations, warm-up) for small and large messages.
pub fn iterations(
    opts: &BenchOptions,
    size: usize,
    small: (usize, usize),
    large: (usize, usize),
    limit: usize,
) -> (usize, usize) {
    let (i, x) = if size > limit { large } else { small };
    (opts.iterations.unwrap_or(i), opts.warmup.unwrap_or(x))
}

/// The two header lines every OSU benchmark prints.
pub fn preamble(title: &str, datatype: &str) -> String {
    format!("# OSU MPI {title} v7.4\n# Datatype: {datatype}.\n")
}

/// A point-to-point table: `# Size` and one value column, and OSU's `Validation` column
/// (`Pass`) when the data was checked (`-c`; a failed check ends the run instead).
pub fn p2p_table(
    title: &str,
    datatype: &str,
    column: &str,
    rows: &[Row],
    validated: bool,
    digits: usize,
) -> String {
    if !validated {
        return value_rows(preamble(title, datatype), column, rows, digits);
    }
    let mut out = preamble(title, datatype);
    let _ = writeln!(out, "{:<10}{:>20}{:>20}", "# Size", column, "Validation");
    for r in rows {
        let _ = writeln!(out, "{:<10}{:>20.digits$}{:>20}", r.size, r.value, "Pass");
    }
    out
}

/// A table of OMB's one-sided tests (`osu_put_latency` ...): the title names the MPI call
/// (`MPI_Put Latency Test`), then how the window was made and synchronised.
pub fn one_sided_table(
    title: &str,
    datatype: &str,
    column: &str,
    rows: &[Row],
    digits: usize,
) -> String {
    let head = format!(
        "# OSU {title} v7.4\n# Window creation: MPI_Win_allocate\n# Synchronization: MPI_Win_flush\n# Datatype: {datatype}.\n"
    );
    value_rows(head, column, rows, digits)
}

fn value_rows(mut out: String, column: &str, rows: &[Row], digits: usize) -> String {
    let _ = writeln!(out, "{:<10}{:>20}", "# Size", column);
    for r in rows {
        let _ = writeln!(out, "{:<10}{:>20.digits$}", r.size, r.value);
    }
    out
}

/// A collective table, with `-f`'s extra columns when `full`.
pub fn collective_table(
    title: &str,
    datatype: &str,
    rows: &[Row],
    full: bool,
    validated: bool,
    digits: usize,
) -> String {
    let mut out = preamble(title, datatype);
    let _ = write!(out, "{:<10}{:>20}", "# Size", "Avg Latency(us)");
    if full {
        let _ = write!(
            out,
            "{:>20}{:>20}{:>12}",
            "Min Latency(us)", "Max Latency(us)", "Iterations"
        );
    }
    if validated {
        let _ = write!(out, "{:>20}", "Validation");
    }
    out.push('\n');
    for r in rows {
        let _ = write!(out, "{:<10}{:>20.digits$}", r.size, r.value);
        if full {
            let (min, max, n) = (r.min, r.max, r.iterations);
            let _ = write!(out, "{min:>20.digits$}{max:>20.digits$}{n:>12}");
        }
        if validated {
            // A row is printed only when every check of every iteration passed.
            let _ = write!(out, "{:>20}", "Pass");
        }
        out.push('\n');
    }
    out
}

/// Comment lines comparing two tables of the same sizes: `b / a` per size.
pub fn ratio_table(label: &str, a: &[Row], ratios: &[f64]) -> String {
    let mut out = format!("# ratio {label}\n{:<10}{:>20}\n", "# Size", "Ratio");
    for (x, r) in a.iter().zip(ratios) {
        let _ = writeln!(out, "# {:<8}{:>20.3}", x.size, r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn osu_format_to_the_byte() {
        let rows = [
            Row {
                size: 1,
                value: 0.15,
                min: 0.1,
                max: 0.2,
                iterations: 1000,
            },
            Row {
                size: 4194304,
                value: 12345.678,
                min: 1.0,
                max: 2.0,
                iterations: 100,
            },
        ];
        assert_eq!(
            p2p_table("Latency Test", "MPI_CHAR", "Avg Latency(us)", &rows, false, 2),
            "# OSU MPI Latency Test v7.4\n# Datatype: MPI_CHAR.\n# Size         Avg Latency(us)\n1                         0.15\n4194304               12345.68\n"
        );
        assert_eq!(
            p2p_table("Bandwidth Test", "MPI_CHAR", "Bandwidth (MB/s)", &rows[..1], true, 2),
            "# OSU MPI Bandwidth Test v7.4\n# Datatype: MPI_CHAR.\n# Size        Bandwidth (MB/s)          Validation\n1                         0.15                Pass\n"
        );
        assert_eq!(
            collective_table("Allreduce Latency Test", "MPI_FLOAT", &rows[..1], true, false, 2),
            "# OSU MPI Allreduce Latency Test v7.4\n# Datatype: MPI_FLOAT.\n# Size         Avg Latency(us)     Min Latency(us)     Max Latency(us)  Iterations\n1                         0.15                0.10                0.20        1000\n"
        );
        // OSU's -c column after the others, as `print_stats_validate` writes it.
        assert_eq!(
            collective_table("Allreduce Latency Test", "MPI_FLOAT", &rows[..1], false, true, 2),
            "# OSU MPI Allreduce Latency Test v7.4\n# Datatype: MPI_FLOAT.\n# Size         Avg Latency(us)          Validation\n1                         0.15                Pass\n"
        );
    }

    #[test]
    fn more_digits_keep_the_columns() {
        let rows = [Row {
            size: 8,
            value: 0.213_456,
            min: 0.2,
            max: 0.25,
            iterations: 10,
        }];
        assert_eq!(
            p2p_table("Latency Test", "MPI_CHAR", "Avg Latency(us)", &rows, false, 4),
            "# OSU MPI Latency Test v7.4\n# Datatype: MPI_CHAR.\n# Size         Avg Latency(us)\n8                       0.2135\n"
        );
        assert!(
            collective_table("Bcast Latency Test", "MPI_CHAR", &rows, true, false, 3)
                .ends_with("\n8                        0.213               0.200               0.250          10\n")
        );
    }

    #[test]
    fn size_ranges() {
        assert_eq!(sizes(1, 8), [1, 2, 4, 8]);
        assert_eq!(sizes(0, 2), [0, 1, 2]);
        assert_eq!(sizes(10240, 40960), [10240, 20480, 40960]);
        assert_eq!(parse_sizes("4:64"), Ok((4, 64)));
        assert_eq!(parse_sizes("64"), Ok((1, 64)));
        assert!(parse_sizes("64:4").is_err());
        assert!(parse_sizes("x").is_err());
    }
}
