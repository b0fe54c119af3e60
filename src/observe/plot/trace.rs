//! A timeline (`--timeline`'s trace) as a picture: one row per rank, a bar per span,
//! coloured by the span's name, over a window of steps.

use std::path::Path;

use plotters::prelude::*;

use super::{color, draw_err, legend, PlotError};
use crate::observe::timeline::{SpanRead, Track};

/// The steps a picture shows (`first..=last`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Steps {
    pub first: u64,
    pub last: u64,
}

impl std::fmt::Display for Steps {
    /// `steps 3 to 7`, or `step 3`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.first == self.last {
            true => write!(f, "step {}", self.first),
            false => write!(f, "steps {} to {}", self.first, self.last),
        }
    }
}

/// Steps a picture shows when none are asked for: five from the middle of the run.
const DEFAULT_STEPS: u64 = 5;

/// The time window (µs) of `steps`: from the first start to the last end of the spans of
/// those steps, on any track.
fn window(tracks: &[Track], steps: Steps) -> Option<(f64, f64)> {
    let of = |s: &&SpanRead| {
        s.step
            .is_some_and(|t| (steps.first..=steps.last).contains(&t))
    };
    let spans = || tracks.iter().flat_map(|t| t.spans.iter().filter(of));
    let start = spans().map(|s| s.start_us).min_by(f64::total_cmp)?;
    let end = spans()
        .map(|s| s.start_us + s.dur_us)
        .max_by(f64::total_cmp)?;
    Some((start, end))
}

/// The steps of the middle of the run: [`DEFAULT_STEPS`] from its middle step, or from
/// earlier when fewer follow it; only steps the run has (a run of 3 steps is steps 0 to 2,
/// not 0 to 4).
fn middle(tracks: &[Track]) -> Option<Steps> {
    let mut steps: Vec<u64> = tracks
        .iter()
        .flat_map(|t| t.spans.iter().filter_map(|s| s.step))
        .collect();
    steps.sort_unstable();
    steps.dedup();
    let from = (steps.len() / 2).min(steps.len().saturating_sub(DEFAULT_STEPS as usize));
    let first = *steps.get(from)?;
    let last = steps
        .iter()
        .copied()
        .take_while(|s| *s < first + DEFAULT_STEPS)
        .max()?;
    Some(Steps { first, last })
}

/// Draws `tracks` over the window of `steps` (default: five from the middle of the run)
/// as an SVG at `path`; returns the steps drawn. Spans that overlap the window are drawn
/// clipped to it, inner spans over outer ones.
pub fn timeline_svg(
    tracks: &[Track],
    steps: Option<Steps>,
    path: &Path,
) -> Result<Steps, PlotError> {
    let name = path.display().to_string();
    let steps = steps
        .or_else(|| middle(tracks))
        .ok_or_else(|| PlotError::Trace(format!("{name}: no spans with a step to draw")))?;
    let (t0, t1) = window(tracks, steps).ok_or_else(|| {
        PlotError::Trace(format!(
            "{name}: no spans of steps {}..={}",
            steps.first, steps.last
        ))
    })?;
    // Microseconds for a short window, milliseconds otherwise.
    let (unit, scale) = match t1 - t0 < 5000.0 {
        true => ("µs", 1.0),
        false => ("ms", 1e-3),
    };
    let x = |us: f64| (us.clamp(t0, t1) - t0) * scale;
    let n = tracks.len();
    // Rank 0 on top: track i is the row centred at n - 1 - i.
    let row = |i: usize| (n - 1 - i) as f64;
    let mut names: Vec<&str> = Vec::new();
    let mut bars: Vec<(usize, &SpanRead)> = Vec::new();
    for (i, t) in tracks.iter().enumerate() {
        for s in &t.spans {
            if s.start_us < t1 && s.start_us + s.dur_us > t0 {
                bars.push((i, s));
                if !names.contains(&s.name.as_str()) {
                    names.push(&s.name);
                }
            }
        }
    }
    // Outer spans first, inner ones over them.
    bars.sort_by(|a, b| {
        a.1.start_us
            .total_cmp(&b.1.start_us)
            .then(b.1.dur_us.total_cmp(&a.1.dur_us))
    });
    let err = draw_err(path);
    let height = 160 + 48 * n as u32;
    let root = SVGBackend::new(path, (1200, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let labels: Vec<&str> = tracks.iter().map(|t| t.name.as_str()).collect();
    let label = |v: &f64| -> String {
        let i = n as f64 - 1.0 - v.round();
        match (v - v.round()).abs() < 1e-6 && i >= 0.0 && (i as usize) < n {
            true => labels[i as usize].to_string(),
            false => String::new(),
        }
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("timeline of {steps}"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(150)
        // Room on the right for the legend.
        .build_cartesian_2d(0.0..x(t1) * 1.2, -0.5..n as f64 - 0.5)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n.max(1))
        .y_label_formatter(&label)
        .x_desc(format!(
            "{unit} from the first span of step {}",
            steps.first
        ))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (k, span_name) in names.iter().enumerate() {
        let c = color(k);
        let mine = bars.iter().filter(|(_, s)| s.name == *span_name);
        let rects = mine.map(|(i, s)| {
            let y = row(*i);
            Rectangle::new(
                [
                    (x(s.start_us), y - 0.35),
                    (x(s.start_us + s.dur_us), y + 0.35),
                ],
                c.filled(),
            )
        });
        chart
            .draw_series(rects)
            .map_err(|e| err(e.to_string()))?
            .label(*span_name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], c.filled()));
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight).map_err(&err)?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(name: &str, start_us: f64, dur_us: f64, step: u64) -> SpanRead {
        SpanRead {
            name: name.into(),
            cat: "compute".into(),
            start_us,
            dur_us,
            step: Some(step),
        }
    }

    #[test]
    fn a_bar_per_span_of_the_window_and_a_row_per_track() {
        let tracks: Vec<Track> = (0..2)
            .map(|r| Track {
                pid: r,
                name: format!("worker:{r} (rank {r})"),
                spans: (0..20)
                    .flat_map(|s| {
                        let t = s as f64 * 100.0;
                        [
                            span("gradients", t, 60.0, s),
                            span("allreduce", t + 60.0, 40.0, s),
                        ]
                    })
                    .collect(),
            })
            .collect();
        let path = std::env::temp_dir().join(format!("mpiflow-tl-{}.svg", std::process::id()));
        let steps = timeline_svg(&tracks, None, &path).unwrap();
        assert_eq!(
            steps,
            Steps {
                first: 10,
                last: 14
            }
        );
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(svg.contains("worker:1 (rank 1)") && svg.contains("allreduce"));
        // 5 steps x 2 spans x 2 tracks, and the spans touching the window's edges.
        let rects = svg.matches("<rect").count();
        assert!((20..=30).contains(&rects), "{rects}");
        // A short run: the steps it has.
        let short: Vec<Track> = tracks
            .iter()
            .map(|t| Track {
                spans: t
                    .spans
                    .iter()
                    .filter(|s| s.step < Some(3))
                    .cloned()
                    .collect(),
                ..t.clone()
            })
            .collect();
        let steps = timeline_svg(&short, None, &path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(steps, Steps { first: 0, last: 2 });
        let none = timeline_svg(
            &tracks,
            Some(Steps {
                first: 50,
                last: 60,
            }),
            &path,
        );
        assert!(none
            .unwrap_err()
            .to_string()
            .contains("no spans of steps 50..=60"));
    }
}
