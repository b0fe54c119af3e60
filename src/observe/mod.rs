//! Seeing a run: where each rank's time goes, the metrics file, the live progress line.
//!
//! - [`phases`]: a rank's time in compute, communication and waiting, per log window.
//! - [`metrics`]: the metrics file (CSV or JSON lines), written by the chief as the run
//!   goes, read back by `mpiflow plot`.
//! - [`progress`]: the chief's progress line (step of total, loss, samples/s, ETA), redrawn
//!   in place on a terminal, plain lines otherwise.
//! - [`timeline`]: every rank's phases as spans, merged into one Chrome trace file.
//! - [`plot`]: metrics files and benchmark outputs as SVG pictures.
//! - [`osu_tables`]: the tables of OSU-format benchmark output, read for `plot` and
//!   `scale`.
//! - [`stall`]: which ranks a long wait waits for, reported by the chief.
//!
//! Nothing here knows training: the training loops fill [`phases::Clock`]s, and
//! [`crate::train::events::Event`] turns into [`metrics::Record`]s.

pub mod metrics;
#[doc(hidden)]
pub mod osu_tables;
pub mod phases;
#[doc(hidden)]
pub mod plot;
#[doc(hidden)]
pub mod progress;
pub mod stall;
pub mod timeline;

/// `25.6 GB`, `512 MB`, `3 KB`.
pub fn bytes(b: u64) -> String {
    let b = b as f64;
    for (unit, size) in [("GB", 1e9), ("MB", 1e6), ("KB", 1e3)] {
        if b >= size {
            return format!("{:.1} {unit}", b / size);
        }
    }
    format!("{b} B")
}
