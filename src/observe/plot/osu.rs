//! OSU-format benchmark output as latency and bandwidth against message size.

use std::path::Path;

use plotters::prelude::*;

use super::{color, draw_err, legend, span, PlotError};
use crate::observe::osu_tables;

/// One curve of a benchmark: its label, what its values are (the column header, such as
/// `Avg Latency(us)`), and (size, value) points.
#[derive(Debug, Clone, PartialEq)]
pub struct Curve {
    pub label: String,
    pub column: String,
    pub points: Vec<(f64, f64)>,
}

/// The curves of OSU-format text `text` (of the file `file`, named in errors): a table per
/// `# Size` header ([`crate::observe::osu_tables`]); the curve is named by the `# mpiflow
/// path: NAME` line before it, if any, else by `name` and the test's title. Rows of size
/// or value 0 (OSU prints both) are off log axes: left out.
pub fn parse_osu(name: &str, file: &str, text: &str) -> Result<Vec<Curve>, PlotError> {
    let curves: Vec<Curve> = osu_tables::read(file, text)?
        .into_iter()
        .map(|t| Curve {
            label: match (&t.path, &t.title) {
                (Some(p), _) => format!("{name}: {p}"),
                (None, Some(t)) => format!("{name}: {t}"),
                (None, None) => name.to_string(),
            },
            column: t.column,
            points: t
                .rows
                .into_iter()
                .filter(|p| p.0 > 0.0 && p.1 > 0.0)
                .collect(),
        })
        .filter(|c| !c.points.is_empty())
        .collect();
    if curves.is_empty() {
        return Err(PlotError::Tables(osu_tables::ReadError::NoTable(
            file.to_string(),
        )));
    }
    Ok(curves)
}

/// A message size as OSU's tables would say it: 512, 4 KiB, 1 MiB.
fn size_label(v: &f64) -> String {
    let v = v.round() as u64;
    match v {
        v if v >= 1 << 20 && v % (1 << 20) == 0 => format!("{} MiB", v >> 20),
        v if v >= 1 << 10 && v % (1 << 10) == 0 => format!("{} KiB", v >> 10),
        v => v.to_string(),
    }
}

/// Benchmark curves as an SVG at `path`: a log-log panel per kind of value (latency,
/// bandwidth, in the order first seen), a curve per table.
pub fn osu_svg(curves: &[Curve], path: &Path) -> Result<(), PlotError> {
    let mut columns: Vec<&str> = Vec::new();
    for c in curves {
        if !columns.contains(&c.column.as_str()) {
            columns.push(&c.column);
        }
    }
    let err = draw_err(path);
    let height = 560 * columns.len().max(1) as u32;
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let panels = root.split_evenly((columns.len().max(1), 1));
    for (area, column) in panels.iter().zip(&columns) {
        let mine: Vec<&Curve> = curves.iter().filter(|c| c.column == *column).collect();
        let xs = span(mine.iter().flat_map(|c| c.points.iter().map(|p| p.0)), true);
        let ys = span(mine.iter().flat_map(|c| c.points.iter().map(|p| p.1)), true);
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{column} against message size"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(xs.log_scale(), ys.log_scale())
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .x_desc("message size (bytes)")
            .x_label_formatter(&size_label)
            .y_desc(*column)
            .draw()
            .map_err(|e| err(e.to_string()))?;
        for (i, c) in mine.iter().enumerate() {
            let color = color(i);
            let pts: Vec<(f64, f64)> = c.points.iter().copied().filter(|p| p.0 > 0.0).collect();
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?
                .label(c.label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft).map_err(&err)?;
    }
    root.present().map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::super::{metrics_svg, Run};
    use super::*;
    use crate::observe::metrics::Record;

    const BENCH: &str = "# mpiflow path: mpi\n# OSU MPI Latency Test v7.4\n# Datatype: MPI_CHAR.\n\
        # Size         Avg Latency(us)\n1                         0.39\n2   0.40\n\
        # mpiflow path: mpiflow\n# OSU MPI Latency Test v7.4\n# Datatype: MPI_CHAR.\n\
        # Size         Avg Latency(us)\n1   0.41\n2   0.42\n4   0.43\n\
        # ratio mpiflow/mpi\n# Size                    Ratio\n# 1          1.05\n";

    #[test]
    fn osu_tables_become_one_curve_per_path() {
        let curves = parse_osu("run", "run", BENCH).unwrap();
        assert_eq!(curves.len(), 2);
        assert_eq!(curves[0].label, "run: mpi");
        assert_eq!(curves[0].column, "Avg Latency(us)");
        assert_eq!(curves[1].points, [(1.0, 0.41), (2.0, 0.42), (4.0, 0.43)]);
        let osu = "# OSU MPI Bandwidth Test v7.4\n# Datatype: MPI_CHAR.\n\
            # Size      Bandwidth (MB/s)\n1   8.92\n2   16.13\n";
        let c = parse_osu("osu_bw", "osu_bw", osu).unwrap();
        assert_eq!(
            (c[0].label.as_str(), c[0].column.as_str()),
            ("osu_bw: MPI Bandwidth Test", "Bandwidth (MB/s)")
        );
        assert_eq!(
            parse_osu("x", "x", "no table\n").unwrap_err().to_string(),
            "x: no benchmark table (a `# Size` header and rows of size and value)"
        );
        // Zeros (OSU's size 0, a bandwidth printed as 0.00) are off log axes: left out.
        // A negative or non-finite value is named by its line.
        let zeros = "# Size  Bandwidth (MB/s)\n0 0.00\n1 0.00\n2 3.5\n";
        assert_eq!(parse_osu("z", "z", zeros).unwrap()[0].points, [(2.0, 3.5)]);
        for bad in ["4 -1.5", "4 nan", "4 inf"] {
            let text = format!("# Size  Avg Latency(us)\n1 0.3\n{bad}\n");
            assert_eq!(
                parse_osu("b", "b", &text).unwrap_err().to_string(),
                format!("b:3: {bad:?}: sizes and values are finite and not negative")
            );
        }
    }

    /// Whether `svg` holds `label` as a text, and how many of its lines have `n` points.
    fn holds(svg: &Path, label: &str) -> bool {
        std::fs::read_to_string(svg)
            .unwrap()
            .contains(&format!(">\n{label}\n</text>"))
    }

    fn lines_of(svg: &Path, n: usize) -> usize {
        let text = std::fs::read_to_string(svg).unwrap();
        text.split("<polyline")
            .skip(1)
            .filter(|l| {
                let points = l.split("points=\"").nth(1).unwrap_or("");
                points
                    .split('"')
                    .next()
                    .unwrap_or("")
                    .split_whitespace()
                    .count()
                    == n
            })
            .count()
    }

    #[test]
    fn pictures_parse_and_hold_every_curve_with_its_label() {
        let dir = std::env::temp_dir().join(format!("mpiflow-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let svg = dir.join("bench.svg");
        let mut curves = parse_osu("run", "run", BENCH).unwrap();
        curves.extend(
            parse_osu(
                "bw",
                "bw",
                "# Size  Bandwidth (MB/s)\n1 8.9\n2 16.1\n4 30.5\n",
            )
            .unwrap(),
        );
        osu_svg(&curves, &svg).unwrap();
        for label in [
            "run: mpi",
            "run: mpiflow",
            "bw",
            "Avg Latency(us) against message size",
        ] {
            assert!(holds(&svg, label), "{label}");
        }
        // The curves with 3 points: lines of that many points.
        assert_eq!(lines_of(&svg, 3), 2);

        let step = |step: u64, loss: f32| Record::Step {
            step,
            wall_s: step as f64 / 100.0,
            loss: Some(loss),
            steps_per_sec: 100.0,
            samples_per_sec: 6400.0,
            ranks: vec![],
        };
        let eval = Record::Eval {
            step: 300,
            wall_s: 3.1,
            accuracy: 0.9,
            correct: 9,
            total: 10,
        };
        let runs = [
            Run {
                label: "ps".into(),
                records: vec![
                    step(100, 1.0),
                    step(200, 0.5),
                    step(300, 0.25),
                    eval.clone(),
                ],
            },
            Run {
                label: "allreduce".into(),
                records: vec![step(100, 0.9), step(200, 0.4), step(300, 0.2), eval.clone()],
            },
        ];
        let svg = dir.join("runs.svg");
        metrics_svg(&runs, &svg).unwrap();
        for label in [
            "ps",
            "allreduce",
            "loss against global step",
            "accuracy against seconds",
        ] {
            assert!(holds(&svg, label), "{label}");
        }
        // Two loss panels of two runs of 3 logged steps each.
        assert_eq!(lines_of(&svg, 3), 4);
        let empty = [Run {
            label: "empty".into(),
            records: vec![],
        }];
        assert!(matches!(
            metrics_svg(&empty, &svg),
            Err(PlotError::NoSteps(_))
        ));
        // A side-car evaluator's file: evaluations alone, beside a run's.
        let evaluator = Run {
            label: "evaluator".into(),
            records: vec![eval],
        };
        metrics_svg(&[runs[0].clone(), evaluator], &svg).unwrap();
        assert!(holds(&svg, "evaluator"));
        // A click model's run: its AUC where a classifier's accuracy goes.
        let ctr = Run {
            label: "dlrm".into(),
            records: vec![
                step(100, 0.6),
                step(200, 0.5),
                Record::Ctr {
                    step: 200,
                    wall_s: 2.1,
                    auc: 0.77,
                    logloss: 0.5,
                    total: 100,
                },
            ],
        };
        metrics_svg(std::slice::from_ref(&ctr), &svg).unwrap();
        assert!(holds(&svg, "AUC against global step"), "AUC panel");
        let circles = std::fs::read_to_string(&svg)
            .unwrap()
            .matches("<circle")
            .count();
        assert_eq!(circles, 2, "the AUC in both panels");
        metrics_svg(&[runs[0].clone(), ctr], &svg).unwrap();
        assert!(holds(&svg, "accuracy, AUC against seconds"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
