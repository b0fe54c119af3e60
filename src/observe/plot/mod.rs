//! Pictures of runs and benchmarks as SVG (`mpiflow plot`), drawn with plotters (no
//! display, no fonts needed: text is SVG text).
//!
//! - [`metrics_svg`] ([`runs`]): metrics files ([`super::metrics`]) as four panels, loss
//!   and accuracy against the step and against wall time, one curve per run (runs
//!   overlaid to compare: ps against allreduce, 2 against 4 ranks).
//! - [`osu_svg`] ([`osu`]): OSU-format benchmark output (`mpiflow bench`'s, with a table
//!   per path, or OSU's own programs') as latency and bandwidth against message size,
//!   log-log, one curve per path and file.
//! - [`scale_svg`] ([`scale`]): a scale model's predicted step time and weak-scaling
//!   efficiency against hosts (`mpiflow scale`), measured runs beside their predictions.
//! - [`timeline_svg`] ([`trace`]): a timeline (`--timeline`'s trace) as one row per rank
//!   and a bar per span, over a window of steps.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

pub mod osu;
pub mod runs;
pub mod scale;
pub mod trace;

pub use osu::{osu_svg, parse_osu, Curve};
pub use runs::{metrics_svg, Run};
pub use scale::{scale_svg, MeasuredStep, ScaleCurve, ScalePoint};
pub use trace::{timeline_svg, Steps};

/// Errors of plotting.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("{path}: {why}")]
    Draw { path: PathBuf, why: String },
    #[error(transparent)]
    Tables(#[from] crate::observe::osu_tables::ReadError),
    #[error("{0}: no logged steps to plot")]
    NoSteps(String),
    #[error("{0}")]
    Trace(String),
    #[error("no predictions to draw")]
    NoPredictions,
    #[error("{path}: cannot write the picture there: {why}")]
    Output { path: PathBuf, why: String },
}

/// Checks, before any work, that a picture can be written at `path`: not a directory, its
/// directory created if missing, the file writable. An existing picture is left as it is
/// until the new one replaces it; a file made for the check is removed.
pub fn prepare_output(path: &Path) -> Result<(), PlotError> {
    let err = |why: String| PlotError::Output {
        path: path.to_path_buf(),
        why,
    };
    if path.is_dir() {
        return Err(err("it is a directory".into()));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| err(format!("cannot create {}: {e}", dir.display())))?;
    }
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| err(e.to_string()))?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

pub(super) fn draw_err(path: &Path) -> impl Fn(String) -> PlotError + '_ {
    move |why| PlotError::Draw {
        path: path.to_path_buf(),
        why,
    }
}

/// Draws `chart`'s legend at `at`: a white box with a black border, a line per labelled
/// series.
pub(super) fn legend<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    at: SeriesLabelPosition,
) -> Result<(), String>
where
    DB: DrawingBackend + 'a,
    CT: plotters::coord::CoordTranslate,
{
    chart
        .configure_series_labels()
        .position(at)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())
}

/// A range around `values` (a margin on either side; a span where all are equal).
pub(super) fn span(values: impl Iterator<Item = f64>, log: bool) -> std::ops::Range<f64> {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && (!log || *v > 0.0))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    match (lo.is_finite(), log) {
        (false, true) => 1.0..10.0,
        (false, false) => 0.0..1.0,
        (true, true) => lo / 1.5..hi * 1.5,
        (true, false) if hi - lo < 1e-12 => lo - 0.5..hi + 0.5,
        (true, false) => {
            let m = (hi - lo) * 0.05;
            lo - m..hi + m
        }
    }
}

/// Curve colours: dark and far apart (Tableau's ten), cycled.
const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

pub(super) fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}
