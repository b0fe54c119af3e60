//! What training reports, as typed values: a sink turns them into log lines (their
//! `Display`), and metrics or timelines can read the fields.

use std::fmt;
use std::path::PathBuf;

use super::StepLog;
use crate::observe::metrics::Record;

/// One thing a training run reports.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A logged step.
    Step(StepLog),
    /// Where the variables went (a table).
    Placement(String),
    /// Restored from a checkpoint.
    Restored { path: PathBuf, step: u64 },
    /// A checkpoint committed.
    Checkpoint { path: PathBuf, step: u64 },
    /// A side-car evaluator's evaluation of a checkpoint on the held-out samples.
    Evaluated {
        path: PathBuf,
        step: u64,
        accuracy: f64,
        correct: usize,
        total: usize,
    },
    /// The chief's evaluation on the held-out samples.
    Accuracy {
        accuracy: f64,
        correct: usize,
        total: usize,
        step: u64,
    },
    /// The chief's evaluation of a click model on the held-out samples.
    Auc {
        auc: f64,
        logloss: f64,
        total: usize,
        step: u64,
    },
    /// Each task's rows of the embedding tables when training ended at `step`.
    Rows {
        step: u64,
        reports: Vec<crate::train::tables::RowsReport>,
    },
    /// Something worth a look that does not stop training.
    Warning(String),
    /// Any other note (a comment line).
    Note(String),
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Step(s) => write!(f, "{}", s.line()),
            Event::Placement(table) => write!(f, "{}", table.trim_end()),
            Event::Restored { path, step } => {
                write!(f, "# restored {} (global step {step})", path.display())
            }
            Event::Checkpoint { path, .. } => write!(f, "# checkpoint {} written", path.display()),
            Event::Accuracy {
                accuracy,
                correct,
                total,
                step,
            } => write!(
                f,
                "accuracy {accuracy:.4} ({correct}/{total} held-out samples) at global step {step}"
            ),
            Event::Evaluated {
                path,
                step,
                accuracy,
                correct,
                total,
            } => write!(
                f,
                "evaluated {}: accuracy {accuracy:.4} ({correct}/{total} held-out samples) at global step {step}",
                path.file_name().unwrap_or_default().to_string_lossy()
            ),
            Event::Auc {
                auc,
                logloss,
                total,
                step,
            } => write!(
                f,
                "auc {auc:.4} (log loss {logloss:.4}, {total} held-out samples) at global step {step}"
            ),
            Event::Rows { reports, .. } => {
                let lines: Vec<String> = reports.iter().map(rows_line).collect();
                write!(f, "{}", lines.join("\n"))
            }
            Event::Warning(w) => write!(f, "# warning: {w}"),
            Event::Note(n) if n.starts_with('#') => write!(f, "{n}"),
            Event::Note(n) => write!(f, "# {n}"),
        }
    }
}

/// `# rows on ps:0 (rank 0): 5051 rows (464.6 KB) of 8 tables, 19200 pulls / 773511 rows,
/// 19200 pushes / 773511 rows; hottest emb1:1424 (2400 pulls), emb2:1892 (2400), ...`: a
/// task's tables in one line (each table's own in the metrics file).
fn rows_line(r: &crate::train::tables::RowsReport) -> String {
    let t = &r.tables;
    let sum = |f: fn(&crate::train::tables::TableReport) -> u64| t.iter().map(f).sum::<u64>();
    let mut hot: Vec<(u32, &str, u64)> = (t.iter())
        .flat_map(|t| t.hot.iter().map(move |(id, n)| (*n, t.table.as_str(), *id)))
        .collect();
    hot.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)).then(a.2.cmp(&b.2)));
    let hot: Vec<String> = (hot.iter().take(crate::train::tables::HOT_ROWS).enumerate())
        .map(|(i, (n, table, id))| match i {
            0 => format!("{table}:{id} ({n} pulls)"),
            _ => format!("{table}:{id} ({n})"),
        })
        .collect();
    // Over one-sided windows a ps sees no pull: reads are gets it takes no part in.
    let pulls = match (sum(|t| t.pulls), sum(|t| t.pushes)) {
        (0, p) if p > 0 => "pulls unseen (one-sided gets)".to_string(),
        (n, _) => format!("{n} pulls / {} rows", sum(|t| t.rows_pulled)),
    };
    let hot = match hot.is_empty() {
        true => String::new(),
        false => format!("; hottest {}", hot.join(", ")),
    };
    format!(
        "# rows on {}: {} rows ({}) of {} tables, {pulls}, {} pushes / {} rows{hot}",
        r.task,
        sum(|t| t.rows),
        crate::observe::bytes(sum(|t| t.bytes)),
        t.len(),
        sum(|t| t.pushes),
        sum(|t| t.rows_pushed),
    )
}

impl Event {
    /// The event as metrics records (a logged step, an evaluation, the tables' rows),
    /// `wall_s` seconds into the run; none for the others.
    pub fn records(&self, wall_s: f64) -> Vec<Record> {
        if let Event::Rows { step, reports } = self {
            let mut out = Vec::new();
            for r in reports {
                out.extend(r.tables.iter().map(|t| Record::Rows {
                    step: *step,
                    wall_s,
                    task: r.task.clone(),
                    table: t.table.clone(),
                    rows: t.rows,
                    bytes: t.bytes,
                    pulls: t.pulls,
                    rows_pulled: t.rows_pulled,
                    pushes: t.pushes,
                    rows_pushed: t.rows_pushed,
                    hot: t.hot.clone(),
                }));
            }
            return out;
        }
        self.record(wall_s).into_iter().collect()
    }

    /// The one metrics record of an event that has one.
    fn record(&self, wall_s: f64) -> Option<Record> {
        match self {
            Event::Step(s) => Some(Record::Step {
                step: s.step,
                wall_s,
                loss: s.loss.is_finite().then_some(s.loss),
                steps_per_sec: s.steps_per_sec,
                samples_per_sec: s.samples_per_sec,
                ranks: s.ranks.clone(),
            }),
            // The chief's final evaluation, or a side-car evaluator's (each writes its own
            // file: `metrics::evaluator_path`).
            Event::Accuracy {
                accuracy,
                correct,
                total,
                step,
            }
            | Event::Evaluated {
                accuracy,
                correct,
                total,
                step,
                ..
            } => Some(Record::Eval {
                step: *step,
                wall_s,
                accuracy: *accuracy,
                correct: *correct,
                total: *total,
            }),
            Event::Auc {
                auc,
                logloss,
                total,
                step,
            } => Some(Record::Ctr {
                step: *step,
                wall_s,
                auc: *auc,
                logloss: *logloss,
                total: *total,
            }),
            _ => None,
        }
    }
}
