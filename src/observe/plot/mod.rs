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
    #[error("{0}: no logged steps or evaluations to plot")]
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

/// The largest magnitude a value is drawn at: plotters did not finish an axis near f64's
/// limit (1.7e308); values beyond it are drawn at it.
const AXIS_LIMIT: f64 = 1e300;

/// A range around `values` (a margin on either side; a span where all are equal), finite
/// and within a little more than [`AXIS_LIMIT`].
pub(super) fn span(values: impl Iterator<Item = f64>, log: bool) -> std::ops::Range<f64> {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && (!log || *v > 0.0))
        .map(|v| v.clamp(-AXIS_LIMIT, AXIS_LIMIT))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    match (lo.is_finite(), log) {
        (false, true) => 1.0..10.0,
        (false, false) => 0.0..1.0,
        (true, true) => lo / 1.5..hi * 1.5,
        // All equal: half a unit either side, or a part of a value too large for that.
        (true, false) if hi - lo < 1e-12 => {
            let m = hi.abs().max(lo.abs()) * 1e-9;
            lo - m.max(0.5)..hi + m.max(0.5)
        }
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

#[cfg(test)]
mod tests {
    use super::span;

    #[test]
    fn axes_stay_finite_and_within_what_can_be_drawn() {
        // Values 1.7e308 apart: the margin was infinite, and plotters did not finish an
        // axis near f64's limit.
        for values in [
            [0.0, 1.7e308],
            [-1.7e308, 1.7e308],
            [1.0, 1e308],
            [1.7e308, 1.7e308],
            [1e20, 1e20],
        ] {
            for log in [false, true] {
                let r = span(values.into_iter(), log);
                assert!(r.start.is_finite() && r.end.is_finite(), "{values:?} {r:?}");
                assert!(
                    r.start < r.end && r.end <= 2e300 && r.start >= -2e300,
                    "{r:?}"
                );
            }
        }
        assert_eq!(span([2.0, 4.0].into_iter(), false), 1.9..4.1);
        assert_eq!(span([f64::NAN].into_iter(), true), 1.0..10.0);
    }
}
