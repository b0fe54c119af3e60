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
            Event::Warning(w) => write!(f, "# warning: {w}"),
            Event::Note(n) if n.starts_with('#') => write!(f, "{n}"),
            Event::Note(n) => write!(f, "# {n}"),
        }
    }
}

impl Event {
    /// The event as a metrics record (a logged step, an evaluation), `wall_s` seconds
    /// into the run; `None` for the others.
    pub fn record(&self, wall_s: f64) -> Option<Record> {
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
