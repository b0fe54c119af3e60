//! A scale model's predictions (`mpiflow scale`): step time and weak-scaling efficiency
//! against the number of hosts, a curve per model and mode, measured runs as points.

use std::path::Path;

use plotters::prelude::*;

use super::{color, draw_err, legend, span, PlotError};

/// A predicted step at a host count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalePoint {
    pub hosts: f64,
    pub step_s: f64,
    pub efficiency: f64,
}

/// Predictions of one model in one mode.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaleCurve {
    pub label: String,
    pub points: Vec<ScalePoint>,
}

/// A measured run beside its prediction, drawn on the curve of the same `curve` index.
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredStep {
    pub curve: usize,
    pub hosts: f64,
    pub measured_s: f64,
    pub predicted_s: f64,
}

/// `curves` as an SVG at `path`: step time (log-log) and efficiency against hosts (log
/// x), side by side; each of `measured` as a filled dot (measured) and a cross
/// (predicted) in the step-time panel, in its curve's colour.
pub fn scale_svg(
    curves: &[ScaleCurve],
    measured: &[MeasuredStep],
    path: &Path,
) -> Result<(), PlotError> {
    if curves.iter().all(|c| c.points.is_empty()) {
        return Err(PlotError::NoPredictions);
    }
    let err = draw_err(path);
    let root = SVGBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let (left, right) = root.split_horizontally(600);
    let all = || curves.iter().flat_map(|c| c.points.iter());
    let xs = span(all().map(|p| p.hosts), true);
    let xs = xs.start.max(1.0)..xs.end;

    let times = all().map(|p| p.step_s * 1e3).chain(
        measured
            .iter()
            .flat_map(|m| [m.measured_s, m.predicted_s].map(|s| s * 1e3)),
    );
    let mut chart = ChartBuilder::on(&left)
        .caption("predicted step against hosts", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(xs.clone().log_scale(), span(times, true).log_scale())
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("hosts")
        .y_desc("ms per step")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, c) in curves.iter().enumerate() {
        let col = color(i);
        let pts: Vec<(f64, f64)> = c.points.iter().map(|p| (p.hosts, p.step_s * 1e3)).collect();
        chart
            .draw_series(LineSeries::new(pts, col.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(c.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], col.stroke_width(2)));
    }
    for m in measured {
        let col = color(m.curve);
        chart
            .draw_series([Circle::new((m.hosts, m.measured_s * 1e3), 5, col.filled())])
            .map_err(|e| err(e.to_string()))?;
        chart
            .draw_series([Cross::new(
                (m.hosts, m.predicted_s * 1e3),
                6,
                col.stroke_width(2),
            )])
            .map_err(|e| err(e.to_string()))?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft).map_err(&err)?;

    let mut chart = ChartBuilder::on(&right)
        .caption("weak-scaling efficiency against hosts", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(xs.log_scale(), 0.0..1.0)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("hosts")
        .y_desc("compute / step")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, c) in curves.iter().enumerate() {
        let pts: Vec<(f64, f64)> = c.points.iter().map(|p| (p.hosts, p.efficiency)).collect();
        chart
            .draw_series(LineSeries::new(pts, color(i).stroke_width(2)))
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predictions_and_runs_are_drawn_with_their_labels() {
        let dir = std::env::temp_dir().join(format!("mpiflow-scale-svg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("scale.svg");
        let curve = |label: &str, slope: f64| ScaleCurve {
            label: label.into(),
            points: [2.0, 16.0, 1024.0]
                .iter()
                .map(|&h| ScalePoint {
                    hosts: h,
                    step_s: 0.01 + slope * h,
                    efficiency: 0.01 / (0.01 + slope * h),
                })
                .collect(),
        };
        let curves = [curve("mlp allreduce", 1e-6), curve("mlp ps", 1e-5)];
        let runs = [MeasuredStep {
            curve: 1,
            hosts: 3.0,
            measured_s: 0.031,
            predicted_s: 0.034,
        }];
        scale_svg(&curves, &runs, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("mlp allreduce") && svg.contains("mlp ps"));
        assert!(svg.contains("weak-scaling efficiency"));
        assert!(scale_svg(&[], &[], &path).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
