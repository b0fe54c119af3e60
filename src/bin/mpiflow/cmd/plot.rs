//! `mpiflow plot`: metrics files, benchmark outputs or a timeline as an SVG picture.

use std::path::Path;

use mpiflow::observe::metrics::{self, Format};
use mpiflow::observe::plot::{self, Run};
use mpiflow::observe::timeline;

use crate::args::PlotArgs;
use crate::out::{emit, Failure};

pub(crate) fn run(args: &PlotArgs) -> Result<(), Failure> {
    let label = |i: usize, p: &Path| -> String {
        args.label.get(i).cloned().unwrap_or_else(|| {
            p.file_stem()
                .map_or_else(|| p.display().to_string(), |s| s.to_string_lossy().into())
        })
    };
    plot::prepare_output(&args.out).map_err(Failure::local)?;
    if args.label.len() > args.files.len() {
        return Err(Failure::local(format!(
            "{} --label for {} file(s): one per file, in order",
            args.label.len(),
            args.files.len()
        )));
    }
    if let [one] = args.files.as_slice() {
        if is_trace(one) {
            if !args.label.is_empty() {
                return Err(Failure::local(
                    "--label names the curves of metrics files and benchmark outputs, not a timeline's rows (its tasks)",
                ));
            }
            let tracks = timeline::read(one).map_err(Failure::local)?;
            let steps = args.steps.map(|(first, last)| plot::Steps { first, last });
            let drawn = plot::timeline_svg(&tracks, steps, &args.out).map_err(Failure::local)?;
            let whose = match tracks.len() {
                1 => "1 rank's".to_string(),
                n => format!("{n} ranks'"),
            };
            emit(&format!(
                "# wrote {}: {whose} spans of {drawn}\n",
                args.out.display()
            ));
            return Ok(());
        }
    }
    if args.steps.is_some() {
        return Err(Failure::local(
            "--steps is for a timeline (one --timeline file)",
        ));
    }
    let is_metrics: Vec<bool> = args.files.iter().map(|p| Format::of(p).is_ok()).collect();
    if is_metrics.iter().all(|m| *m) {
        let runs = args
            .files
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let records = metrics::read(p)?;
                Ok(Run {
                    label: label(i, p),
                    records,
                })
            })
            .collect::<Result<Vec<_>, metrics::MetricsError>>()
            .map_err(Failure::local)?;
        plot::metrics_svg(&runs, &args.out).map_err(Failure::local)?;
        emit(&format!(
            "# wrote {}: loss and accuracy of {} run(s) against step and time\n",
            args.out.display(),
            runs.len()
        ));
        return Ok(());
    }
    if is_metrics.iter().any(|m| *m) {
        return Err(Failure::local(
            "plot takes metrics files (.csv, .jsonl) or benchmark outputs, not both at once",
        ));
    }
    let mut curves = Vec::new();
    for (i, p) in args.files.iter().enumerate() {
        let text = std::fs::read_to_string(p)
            .map_err(|e| Failure::local(format!("{}: cannot read it: {e}", p.display())))?;
        curves.extend(
            plot::parse_osu(&label(i, p), &p.display().to_string(), &text)
                .map_err(Failure::local)?,
        );
    }
    plot::osu_svg(&curves, &args.out).map_err(Failure::local)?;
    emit(&format!(
        "# wrote {}: {} benchmark curve(s) against message size\n",
        args.out.display(),
        curves.len()
    ));
    Ok(())
}

/// Whether `path` holds a trace-event file (`--timeline`'s): JSON that opens with its
/// `traceEvents` key.
fn is_trace(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 64];
    let n = std::fs::File::open(path)
        .and_then(|mut f| f.read(&mut head))
        .unwrap_or(0);
    let text = String::from_utf8_lossy(&head[..n]);
    text.trim_start()
        .strip_prefix('{')
        .is_some_and(|rest| rest.trim_start().starts_with("\"traceEvents\""))
}
