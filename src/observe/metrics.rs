//! The metrics file (`mpiflow train --metrics FILE`): per logged step the loss, the
//! throughput and every rank's time by phase, and each evaluation's accuracy; CSV or JSON
//! lines by the file's extension. The chief writes each record as it comes, in one write
//! (a killed run keeps every record it wrote); a side-car evaluator writes its evaluations
//! to a file of its own beside ([`evaluator_path`]); [`read`] reads either format back
//! (`mpiflow plot`).
//!
//! CSV has one row per rank of a logged step (the step's columns repeated), or one row
//! with empty rank columns when the step carries no rank times, and one row per
//! evaluation:
//!
//! ```text
//! kind,step,wall_s,loss,steps_per_sec,samples_per_sec,accuracy,correct,total,rank,task,compute_s,comm_s,wait_s,other_s,rank_steps
//! step,250,0.412,0.5312,607.2,38861,,,,0,worker:0,0.301,0.052,0.031,0.028,250
//! eval,1500,2.484,,,,0.9666,348,360,,,,,,,
//! ```
//!
//! JSON lines hold one [`Record`] per line, as serde writes it.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::phases::{RankTimes, Times};

/// One record of a metrics file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// A logged step: the global step, seconds since the run started, the loss (`None`
    /// if not finite or unknown), the window's rates and each rank's times in it.
    Step {
        step: u64,
        wall_s: f64,
        loss: Option<f32>,
        steps_per_sec: f64,
        samples_per_sec: f64,
        #[serde(default)]
        ranks: Vec<RankTimes>,
    },
    /// An evaluation on the held-out samples.
    Eval {
        step: u64,
        wall_s: f64,
        accuracy: f64,
        correct: usize,
        total: usize,
    },
    /// An evaluation of a click model on the held-out samples: AUC and mean log loss over
    /// `total` samples.
    Ctr {
        step: u64,
        wall_s: f64,
        auc: f64,
        logloss: f64,
        total: usize,
    },
    /// A task's rows of one embedding table when training ended: how many exist and
    /// their bytes, the requests served, the hottest rows (id and pulls).
    Rows {
        step: u64,
        wall_s: f64,
        task: String,
        table: String,
        rows: u64,
        bytes: u64,
        pulls: u64,
        rows_pulled: u64,
        pushes: u64,
        rows_pushed: u64,
        hot: Vec<(u64, u32)>,
    },
    /// A stall report ([`super::stall`]): the longest wait, of `waited_s` seconds in `op`
    /// at `step`, the tasks that wait and those that have not arrived; `cleared`: the
    /// stall ended (then `waited_s` is its length and the lists are empty).
    Stall {
        step: u64,
        wall_s: f64,
        waited_s: f64,
        op: String,
        #[serde(default)]
        waiting: Vec<String>,
        #[serde(default)]
        missing: Vec<String>,
        #[serde(default)]
        cleared: bool,
    },
}

impl Record {
    /// What a record of a run can hold: seconds and rates finite and not negative, an
    /// accuracy of its samples (`Err`: what is not).
    fn check(&self) -> Result<(), String> {
        let fine = |what: &str, v: f64| match v.is_finite() && v >= 0.0 {
            true => Ok(()),
            false => Err(format!("{what} {v:?} is not a finite, non-negative number")),
        };
        match self {
            Record::Step {
                wall_s,
                steps_per_sec,
                samples_per_sec,
                ranks,
                ..
            } => {
                fine("wall_s", *wall_s)?;
                fine("steps_per_sec", *steps_per_sec)?;
                fine("samples_per_sec", *samples_per_sec)?;
                for r in ranks {
                    let t = &r.times;
                    fine("compute_s", t.compute)?;
                    fine("comm_s", t.comm)?;
                    fine("wait_s", t.wait)?;
                    fine("other_s", t.other)?;
                }
                Ok(())
            }
            Record::Eval {
                wall_s,
                accuracy,
                correct,
                total,
                ..
            } => {
                fine("wall_s", *wall_s)?;
                match (0.0..=1.0).contains(accuracy) && correct <= total {
                    true => Ok(()),
                    false => Err(format!(
                        "accuracy {accuracy:?} of {correct} right in {total} is not an accuracy"
                    )),
                }
            }
            Record::Ctr {
                wall_s,
                auc,
                logloss,
                ..
            } => {
                fine("wall_s", *wall_s)?;
                fine("logloss", *logloss)?;
                match (0.0..=1.0).contains(auc) {
                    true => Ok(()),
                    false => Err(format!("auc {auc:?} is not an AUC")),
                }
            }
            Record::Rows { wall_s, .. } => fine("wall_s", *wall_s),
            Record::Stall {
                wall_s, waited_s, ..
            } => {
                fine("wall_s", *wall_s)?;
                fine("wait_s", *waited_s)
            }
        }
    }

    /// The global step the record is of.
    pub fn step(&self) -> u64 {
        match self {
            Record::Step { step, .. }
            | Record::Eval { step, .. }
            | Record::Ctr { step, .. }
            | Record::Rows { step, .. }
            | Record::Stall { step, .. } => *step,
        }
    }

    /// Seconds since the run started.
    pub fn wall_s(&self) -> f64 {
        match self {
            Record::Step { wall_s, .. }
            | Record::Eval { wall_s, .. }
            | Record::Ctr { wall_s, .. }
            | Record::Rows { wall_s, .. }
            | Record::Stall { wall_s, .. } => *wall_s,
        }
    }
}

/// The two formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Csv,
    JsonLines,
}

impl Format {
    /// The format a file's name asks for: `.csv`, or `.jsonl` (also `.ndjson`, `.json`).
    pub fn of(path: &Path) -> Result<Format, MetricsError> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("csv") => Ok(Format::Csv),
            Some("jsonl" | "ndjson" | "json") => Ok(Format::JsonLines),
            _ => Err(MetricsError::Extension(path.to_path_buf())),
        }
    }
}

/// The side-car evaluator's metrics file beside the chief's `path`: `.evaluator` before
/// the extension (`run.csv` -> `run.evaluator.csv`), so the format stays the same. The
/// evaluator writes an `eval` record per checkpoint it evaluates (TensorFlow writes its
/// evaluator's summaries apart too, under `eval/`).
pub fn evaluator_path(path: &Path) -> PathBuf {
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.evaluator.{}", ext.to_string_lossy()),
        None => format!("{stem}.evaluator"),
    };
    path.with_file_name(name)
}

/// Errors of metrics files.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("metrics file {0}: name it .csv or .jsonl (the extension picks the format)")]
    Extension(PathBuf),
    #[error("metrics file {path}: cannot create it: {source}")]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("metrics file {path}: cannot write: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("metrics file {path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("metrics file {path}, line {line}: {why}")]
    Parse {
        path: PathBuf,
        line: usize,
        why: String,
    },
}

const CSV_HEADER: &str = "kind,step,wall_s,loss,steps_per_sec,samples_per_sec,accuracy,correct,total,rank,task,compute_s,comm_s,wait_s,other_s,rank_steps,op,waiting,missing,auc,logloss,table,rows_held,bytes,pulls,rows_pulled,pushes,rows_pushed,hot\n";

/// The header before click models' evaluations (read, never written): its rows lack the
/// last two columns.
const CSV_HEADER_V2: &str = "kind,step,wall_s,loss,steps_per_sec,samples_per_sec,accuracy,correct,total,rank,task,compute_s,comm_s,wait_s,other_s,rank_steps,op,waiting,missing\n";

/// The header before stall reports (read, never written): its rows lack the last three
/// columns.
const CSV_HEADER_V1: &str = "kind,step,wall_s,loss,steps_per_sec,samples_per_sec,accuracy,correct,total,rank,task,compute_s,comm_s,wait_s,other_s,rank_steps\n";

/// The columns of a row of [`CSV_HEADER`].
const CSV_COLUMNS: usize = 29;

/// A metrics file being written.
#[derive(Debug)]
pub struct MetricsFile {
    path: PathBuf,
    file: File,
    format: Format,
    start: Instant,
}

impl MetricsFile {
    /// Creates (or truncates) `path`, in the format its extension names; the run's clock
    /// starts now.
    pub fn create(path: &Path) -> Result<MetricsFile, MetricsError> {
        let format = Format::of(path)?;
        let file = File::create(path).map_err(|source| MetricsError::Create {
            path: path.to_path_buf(),
            source,
        })?;
        let mut m = MetricsFile {
            path: path.to_path_buf(),
            file,
            format,
            start: Instant::now(),
        };
        if format == Format::Csv {
            m.write_text(CSV_HEADER)?;
        }
        Ok(m)
    }

    /// Seconds since the file was created.
    pub fn wall_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Appends `r`, in one write.
    pub fn write(&mut self, r: &Record) -> Result<(), MetricsError> {
        let text = match self.format {
            Format::Csv => csv_rows(r),
            Format::JsonLines => {
                let mut s = serde_json::to_string(r).expect("a record serializes");
                s.push('\n');
                s
            }
        };
        self.write_text(&text)
    }

    fn write_text(&mut self, text: &str) -> Result<(), MetricsError> {
        self.file
            .write_all(text.as_bytes())
            .map_err(|source| MetricsError::Write {
                path: self.path.clone(),
                source,
            })
    }
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

/// `r` as CSV rows.
fn csv_rows(r: &Record) -> String {
    match r {
        Record::Step {
            step,
            wall_s,
            loss,
            steps_per_sec,
            samples_per_sec,
            ranks,
        } => {
            let head = format!(
                "step,{step},{wall_s:.6},{},{steps_per_sec:.3},{samples_per_sec:.3},",
                opt(*loss)
            );
            if ranks.is_empty() {
                return format!("{head},,,,,,,,,,,,,,,,,,,,,,\n");
            }
            ranks
                .iter()
                .map(|rt| {
                    let t = &rt.times;
                    format!(
                        "{head},,,{},{},{:.6},{:.6},{:.6},{:.6},{},,,,,,,,,,,,,\n",
                        rt.rank,
                        csv_field(&rt.task),
                        t.compute,
                        t.comm,
                        t.wait,
                        t.other,
                        t.steps
                    )
                })
                .collect()
        }
        Record::Eval {
            step,
            wall_s,
            accuracy,
            correct,
            total,
        } => {
            format!("eval,{step},{wall_s:.6},,,,{accuracy},{correct},{total},,,,,,,,,,,,,,,,,,,,\n")
        }
        Record::Ctr {
            step,
            wall_s,
            auc,
            logloss,
            total,
        } => format!("ctr,{step},{wall_s:.6},,,,,,{total},,,,,,,,,,,{auc},{logloss},,,,,,,,\n"),
        Record::Rows {
            step,
            wall_s,
            task,
            table,
            rows,
            bytes,
            pulls,
            rows_pulled,
            pushes,
            rows_pushed,
            hot,
        } => {
            let hot: Vec<String> = hot.iter().map(|(id, n)| format!("{id}:{n}")).collect();
            format!(
                "rows,{step},{wall_s:.6},,,,,,,,{},,,,,,,,,,,{},{rows},{bytes},{pulls},{rows_pulled},{pushes},{rows_pushed},{}\n",
                csv_field(task),
                csv_field(table),
                hot.join(";")
            )
        }
        Record::Stall {
            step,
            wall_s,
            waited_s,
            op,
            waiting,
            missing,
            cleared,
        } => format!(
            "{},{step},{wall_s:.6},,,,,,,,,,,{waited_s:.3},,,{},{},{},,,,,,,,,,\n",
            if *cleared { "stall_cleared" } else { "stall" },
            csv_field(op),
            csv_field(&waiting.join(";")),
            csv_field(&missing.join(";"))
        ),
    }
}

/// A task name as a CSV field (task names have no commas or quotes; quoted if one did).
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Splits a CSV line into fields (RFC 4180 quoting).
fn csv_split(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                chars.next();
                fields.last_mut().expect("a field").push('"');
            }
            ('"', _) => quoted = !quoted,
            (',', false) => fields.push(String::new()),
            (c, _) => fields.last_mut().expect("a field").push(c),
        }
    }
    fields
}

/// Reads a metrics file in either format (by its extension).
pub fn read(path: &Path) -> Result<Vec<Record>, MetricsError> {
    let format = Format::of(path)?;
    let text = std::fs::read_to_string(path).map_err(|source| MetricsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(path, format, &text)
}

/// Parses metrics text (`path` names it in errors). A last line cut short (a run killed
/// while writing it) is dropped; any other bad line is an error naming it.
pub fn parse(path: &Path, format: Format, text: &str) -> Result<Vec<Record>, MetricsError> {
    let bad = |line: usize, why: String| MetricsError::Parse {
        path: path.to_path_buf(),
        line,
        why,
    };
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    let mut out = Vec::new();
    let mut lines = complete.lines().enumerate().map(|(i, l)| (i + 1, l));
    if format == Format::JsonLines {
        for (n, l) in lines.filter(|(_, l)| !l.trim().is_empty()) {
            let r: Record = serde_json::from_str(l).map_err(|e| bad(n, e.to_string()))?;
            r.check().map_err(|why| bad(n, why))?;
            out.push(r);
        }
        return Ok(out);
    }
    let columns = match lines.next() {
        Some((_, h)) if h == CSV_HEADER.trim_end() => CSV_COLUMNS,
        Some((_, h)) if h == CSV_HEADER_V2.trim_end() => 19,
        Some((_, h)) if h == CSV_HEADER_V1.trim_end() => 16,
        Some((n, h)) => return Err(bad(n, format!("not mpiflow's CSV header: {h:?}"))),
        None => return Ok(out),
    };
    for (n, l) in lines {
        let mut f = csv_split(l);
        if f.len() != columns {
            return Err(bad(n, format!("{} fields, not {columns}", f.len())));
        }
        f.resize(CSV_COLUMNS, String::new());
        let num = |i: usize, what: &str| -> Result<Option<f64>, MetricsError> {
            match f[i].as_str() {
                "" => Ok(None),
                s => s
                    .parse::<f64>()
                    .map(Some)
                    .map_err(|_| bad(n, format!("{what} {s:?} is not a number"))),
            }
        };
        let need = |i: usize, what: &str| {
            num(i, what)?.ok_or_else(|| bad(n, format!("{what} is missing")))
        };
        let count = |i: usize, what: &str| {
            f[i].parse::<usize>()
                .map_err(|_| bad(n, format!("{what} {:?} is not a count", f[i])))
        };
        let step = f[1]
            .parse::<u64>()
            .map_err(|_| bad(n, format!("step {:?} is not a step number", f[1])))?;
        let wall_s = need(2, "wall_s")?;
        match f[0].as_str() {
            "eval" => out.push(Record::Eval {
                step,
                wall_s,
                accuracy: need(6, "accuracy")?,
                correct: count(7, "correct")?,
                total: count(8, "total")?,
            }),
            "ctr" => out.push(Record::Ctr {
                step,
                wall_s,
                auc: need(19, "auc")?,
                logloss: need(20, "logloss")?,
                total: count(8, "total")?,
            }),
            "rows" => {
                let big = |i: usize, what: &str| {
                    f[i].parse::<u64>()
                        .map_err(|_| bad(n, format!("{what} {:?} is not a count", f[i])))
                };
                let hot = (f[28].split(';').filter(|h| !h.is_empty()))
                    .map(|h| {
                        let pair = h.split_once(':');
                        let parsed =
                            pair.and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
                        parsed.ok_or_else(|| bad(n, format!("hot row {h:?} is not id:pulls")))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                out.push(Record::Rows {
                    step,
                    wall_s,
                    task: f[10].clone(),
                    table: f[21].clone(),
                    rows: big(22, "rows_held")?,
                    bytes: big(23, "bytes")?,
                    pulls: big(24, "pulls")?,
                    rows_pulled: big(25, "rows_pulled")?,
                    pushes: big(26, "pushes")?,
                    rows_pushed: big(27, "rows_pushed")?,
                    hot,
                })
            }
            "step" => {
                let rank = match f[9].as_str() {
                    "" => None,
                    s => Some(RankTimes {
                        rank: s
                            .parse()
                            .map_err(|_| bad(n, format!("rank {s:?} is not a rank")))?,
                        task: f[10].clone(),
                        times: Times {
                            compute: need(11, "compute_s")?,
                            comm: need(12, "comm_s")?,
                            wait: need(13, "wait_s")?,
                            other: need(14, "other_s")?,
                            steps: count(15, "rank_steps")? as u64,
                        },
                    }),
                };
                // Rows of one logged step follow each other: they make one record.
                let merged = match (out.last_mut(), &rank) {
                    (Some(Record::Step { step: s, ranks, .. }), Some(r))
                        if *s == step
                            && !ranks.is_empty()
                            && ranks.iter().all(|x| x.rank != r.rank) =>
                    {
                        ranks.push(r.clone());
                        true
                    }
                    _ => false,
                };
                if !merged {
                    out.push(Record::Step {
                        step,
                        wall_s,
                        loss: num(3, "loss")?.map(|v| v as f32),
                        steps_per_sec: need(4, "steps_per_sec")?,
                        samples_per_sec: need(5, "samples_per_sec")?,
                        ranks: rank.into_iter().collect(),
                    });
                }
            }
            kind @ ("stall" | "stall_cleared") => {
                let list = |i: usize| -> Vec<String> {
                    f[i].split(';')
                        .filter(|t| !t.is_empty())
                        .map(str::to_string)
                        .collect()
                };
                out.push(Record::Stall {
                    step,
                    wall_s,
                    waited_s: need(13, "wait_s")?,
                    op: f[16].clone(),
                    waiting: list(17),
                    missing: list(18),
                    cleared: kind == "stall_cleared",
                })
            }
            k => {
                return Err(bad(
                    n,
                    format!("kind {k:?} is not step, eval, ctr, rows or stall"),
                ))
            }
        }
        // The line's record, or the step's record it joined.
        if let Some(r) = out.last() {
            r.check().map_err(|why| bad(n, why))?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
