//! Metrics files of runs: loss and accuracy (a click model's AUC) against the step and
//! against wall time.

use std::path::Path;

use plotters::prelude::*;

use super::{color, draw_err, legend, span, PlotError};
use crate::observe::metrics::Record;

/// One run's metrics, under the name its curves carry.
#[derive(Debug, Clone)]
pub struct Run {
    pub label: String,
    pub records: Vec<Record>,
}

/// Which quantity a panel shows against which.
#[derive(Clone, Copy)]
enum Axis {
    Step,
    Time,
}

/// The (x, loss) or (x, accuracy) points of a run (a click model's accuracy: its AUC).
fn points(run: &Run, x: Axis, accuracy: bool) -> Vec<(f64, f64)> {
    let at = |step: u64, wall: f64| match x {
        Axis::Step => step as f64,
        Axis::Time => wall,
    };
    run.records
        .iter()
        .filter_map(|r| match (r, accuracy) {
            (
                Record::Step {
                    step, wall_s, loss, ..
                },
                false,
            ) => Some((at(*step, *wall_s), f64::from((*loss)?))),
            (
                Record::Eval {
                    step,
                    wall_s,
                    accuracy,
                    ..
                },
                true,
            ) => Some((at(*step, *wall_s), *accuracy)),
            (
                Record::Ctr {
                    step, wall_s, auc, ..
                },
                true,
            ) => Some((at(*step, *wall_s), *auc)),
            _ => None,
        })
        .collect()
}

/// Metrics of `runs` as an SVG at `path`: loss and accuracy (or AUC) against the step and
/// against wall time (2 x 2 panels), a curve per run.
pub fn metrics_svg(runs: &[Run], path: &Path) -> Result<(), PlotError> {
    for r in runs {
        // A side-car evaluator's file has evaluations alone.
        let drawn = |r: &Record| {
            matches!(
                r,
                Record::Step { .. } | Record::Eval { .. } | Record::Ctr { .. }
            )
        };
        if !r.records.iter().any(drawn) {
            return Err(PlotError::NoSteps(r.label.clone()));
        }
    }
    let err = draw_err(path);
    let root = SVGBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let panels = root.split_evenly((2, 2));
    let has = |kind: fn(&Record) -> bool| runs.iter().flat_map(|r| &r.records).any(kind);
    let scored = match (
        has(|r| matches!(r, Record::Eval { .. })),
        has(|r| matches!(r, Record::Ctr { .. })),
    ) {
        (_, false) => "accuracy",
        (false, true) => "AUC",
        (true, true) => "accuracy, AUC",
    };
    let specs = [
        ("loss", Axis::Step, false),
        ("loss", Axis::Time, false),
        (scored, Axis::Step, true),
        (scored, Axis::Time, true),
    ];
    for (area, (what, x, accuracy)) in panels.iter().zip(specs) {
        let series: Vec<Vec<(f64, f64)>> = runs.iter().map(|r| points(r, x, accuracy)).collect();
        // Loss and accuracy panels share the x range (the evaluations are often at the
        // end alone); accuracy stays within 0..1.
        let every = runs
            .iter()
            .flat_map(|r| points(r, x, false).into_iter().chain(points(r, x, true)));
        let xs = span(every.map(|p| p.0), false);
        let ys = span(series.iter().flatten().map(|p| p.1), false);
        let ys = match accuracy {
            true => ys.start.clamp(0.0, 0.9)..1.0,
            false => ys,
        };
        let x_desc = match x {
            Axis::Step => "global step",
            Axis::Time => "seconds",
        };
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{what} against {x_desc}"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(xs, ys)
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(what)
            .draw()
            .map_err(|e| err(e.to_string()))?;
        for (i, (run, pts)) in runs.iter().zip(series).enumerate() {
            let color = color(i);
            // Evaluations are few (often one per run): points, not a line.
            let drawn = if accuracy {
                chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled())))
            } else {
                chart.draw_series(LineSeries::new(pts, color.stroke_width(2)))
            };
            drawn
                .map_err(|e| err(e.to_string()))?
                .label(run.label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        let corner = match accuracy {
            true => SeriesLabelPosition::LowerRight,
            false => SeriesLabelPosition::UpperRight,
        };
        legend(&mut chart, corner).map_err(&err)?;
    }
    root.present().map_err(|e| err(e.to_string()))
}
