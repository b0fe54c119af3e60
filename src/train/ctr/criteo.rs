//! The Criteo TSV layout (the Display Advertising Challenge's `train.txt`): per line a
//! label, 13 integer features and 26 categorical features given as 32-bit hex hashes,
//! tab-separated, any of the features possibly empty.
//!
//! Integer features become `ln(1 + max(x, 0))` (DLRM's transform), an empty one 0. A
//! categorical value becomes a row of its feature's table by the hashing trick: row 0 for
//! an empty value, else `1 + hash mod (rows - 1)`.

use std::io::{BufRead, BufReader};
use std::path::Path;

use super::{CtrBatch, CtrData, CtrError};

/// Dense features of the layout.
pub const DENSE: usize = 13;
/// Categorical features of the layout.
pub const CATEGORICAL: usize = 26;

/// A Criteo file read into memory.
#[derive(Debug, Clone, Default)]
pub struct Criteo {
    tables: Vec<u64>,
    /// Every sample, as one batch.
    all: CtrBatch,
}

impl Criteo {
    /// Reads `path` (at most `limit` samples), each categorical feature hashed into a
    /// table of `rows` rows (at least 2).
    pub fn load(path: &Path, rows: u64, limit: Option<usize>) -> Result<Criteo, CtrError> {
        let shown = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|e| CtrError::Read {
            path: shown.clone(),
            why: e.to_string(),
        })?;
        Criteo::read(&shown, BufReader::new(file), rows, limit)
    }

    /// [`Criteo::load`] from `reader`, named `path` in errors.
    pub fn read(
        path: &str,
        reader: impl BufRead,
        rows: u64,
        limit: Option<usize>,
    ) -> Result<Criteo, CtrError> {
        if rows < 2 {
            return Err(CtrError::Read {
                path: path.into(),
                why: format!("tables of {rows} rows (at least 2: row 0 is the empty value)"),
            });
        }
        let mut c = Criteo {
            tables: vec![rows; CATEGORICAL],
            all: CtrBatch::default(),
        };
        c.all.clear(DENSE, CATEGORICAL);
        for (n, line) in reader.lines().enumerate() {
            if limit.is_some_and(|l| c.all.len() >= l) {
                break;
            }
            let at = |why: String| CtrError::Line {
                path: path.into(),
                line: n + 1,
                why,
            };
            let line = line.map_err(|e| at(e.to_string()))?;
            c.parse_line(&line, rows).map_err(at)?;
        }
        if c.all.is_empty() {
            return Err(CtrError::Read {
                path: path.into(),
                why: "no samples".into(),
            });
        }
        Ok(c)
    }

    /// Appends one line's sample, or says what is wrong with it.
    fn parse_line(&mut self, line: &str, rows: u64) -> Result<(), String> {
        let fields: Vec<&str> = line.trim_end_matches(['\r', '\n']).split('\t').collect();
        if fields.len() != 1 + DENSE + CATEGORICAL {
            return Err(format!(
                "{} tab-separated fields, not {} (label, {DENSE} integers, {CATEGORICAL} hashes)",
                fields.len(),
                1 + DENSE + CATEGORICAL
            ));
        }
        let label = match fields[0] {
            "0" => 0.0,
            "1" => 1.0,
            other => return Err(format!("label {other:?} is not 0 or 1")),
        };
        for (j, v) in fields[1..=DENSE].iter().enumerate() {
            let x: i64 = match v.is_empty() {
                true => 0,
                false => v
                    .parse()
                    .map_err(|_| format!("integer feature {} is {v:?}", j + 1))?,
            };
            self.all.dense.push((x.max(0) as f32).ln_1p());
        }
        for (f, v) in fields[1 + DENSE..].iter().enumerate() {
            let id = match v.is_empty() {
                true => 0,
                false => {
                    let h = u64::from_str_radix(v, 16)
                        .map_err(|_| format!("categorical feature {} is {v:?}, not hex", f + 1))?;
                    1 + h % (rows - 1)
                }
            };
            self.all.ids.push(id);
        }
        self.all.labels.push(label);
        Ok(())
    }
}

impl CtrData for Criteo {
    fn len(&self) -> usize {
        self.all.len()
    }

    fn dense(&self) -> usize {
        DENSE
    }

    fn tables(&self) -> &[u64] {
        &self.tables
    }

    fn push(&self, i: usize, batch: &mut CtrBatch) {
        batch
            .dense
            .extend_from_slice(&self.all.dense[i * DENSE..(i + 1) * DENSE]);
        batch
            .ids
            .extend_from_slice(&self.all.ids[i * CATEGORICAL..(i + 1) * CATEGORICAL]);
        batch.labels.push(self.all.labels[i]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(label: &str, ints: &[&str], cats: &[&str]) -> String {
        let mut v = vec![label.to_string()];
        v.extend(ints.iter().map(|s| s.to_string()));
        v.extend(cats.iter().map(|s| s.to_string()));
        v.join("\t")
    }

    #[test]
    fn lines_become_log_counts_and_hashed_rows() {
        let mut ints = vec![""; DENSE];
        ints[0] = "3";
        ints[1] = "-1";
        let mut cats = vec![""; CATEGORICAL];
        cats[0] = "68fd1e64";
        cats[25] = "ff";
        let text = format!("{}\n{}\n", line("1", &ints, &cats), line("0", &ints, &cats));
        let c = Criteo::read("t.txt", text.as_bytes(), 1000, None).unwrap();
        assert_eq!(c.len(), 2);
        let mut b = CtrBatch::default();
        c.batch_into(&[1], &mut b);
        assert_eq!(b.labels, vec![0.0]);
        assert!((b.dense[0] - 4f32.ln()).abs() < 1e-6);
        assert_eq!(b.dense[1], 0.0);
        assert_eq!(b.ids[0], 1 + 0x68fd_1e64 % 999);
        assert_eq!(b.ids[1], 0);
        assert_eq!(b.ids[25], 1 + 0xff);
        let one = Criteo::read("t.txt", text.as_bytes(), 1000, Some(1)).unwrap();
        assert_eq!(one.len(), 1);
    }

    #[test]
    fn a_bad_line_is_named_with_its_number() {
        let ints = vec!["1"; DENSE];
        let cats = vec!["a"; CATEGORICAL];
        let good = line("0", &ints, &cats);
        let err = |bad: String| {
            let text = format!("{good}\n{bad}\n");
            Criteo::read("day_0", text.as_bytes(), 100, None)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err(line("2", &ints, &cats)),
            "day_0 line 2: label \"2\" is not 0 or 1"
        );
        assert_eq!(
            err("1\t2".into()),
            "day_0 line 2: 2 tab-separated fields, not 40 (label, 13 integers, 26 hashes)"
        );
        let mut bad_cat = cats.clone();
        bad_cat[3] = "xyz";
        assert_eq!(
            err(line("1", &ints, &bad_cat)),
            "day_0 line 2: categorical feature 4 is \"xyz\", not hex"
        );
        assert_eq!(
            Criteo::read("empty", "".as_bytes(), 100, None)
                .unwrap_err()
                .to_string(),
            "empty: no samples"
        );
    }
}
