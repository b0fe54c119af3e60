//! Criteo-like click-through samples from a planted teacher, so that what a model learns
//! can be checked against a known truth.
//!
//! Sample `i` is drawn from a generator seeded by the set's seed and `i`, so any rank
//! makes any sample on demand and the set needs no memory. Its dense features are
//! standard normal; its id of feature `f` is Zipf-distributed over the feature's rows
//! (rank `r` with probability proportional to `r^-s`, ranks scattered over the ids by a
//! hash), as real categorical features are: a few ids are most of the traffic, most rows
//! are rare. Its label is a coin with the teacher's click probability
//! `sigmoid(b + a.x + sum_f w_f(id_f) + sum_(f,g) <u_f(id_f), u_g(id_g)>)`: a weight per
//! dense feature, a weight per id (smaller for later features, so some features matter
//! little), and latent vectors whose dot products make pairs of features interact (what
//! DLRM's dot interaction models). Each id's weight and vector come from a hash of the
//! seed, the feature and the id, so the teacher needs no memory either.

use super::{CtrBatch, CtrData, CtrError};
use crate::rng::Rng;

/// The generator's options (`--data synthetic-ctr:samples=N,rows=R,...`).
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticCtr {
    pub samples: usize,
    pub dense: usize,
    /// Rows of each categorical feature's table.
    pub tables: Vec<u64>,
    /// Zipf's exponent of the ids.
    pub zipf: f64,
    pub seed: u64,
    /// The teacher's bias (about a quarter of the samples are clicks at -1.4).
    pub bias: f64,
}

/// Latent dimensions of the teacher's pairwise interactions.
const LATENT: usize = 4;
/// Features paired in the teacher: (0, 1), (2, 3), ... up to this many features.
const PAIRED: usize = 8;

impl Default for SyntheticCtr {
    /// Criteo's shape: 13 dense features, 26 categorical ones (here of 10^5 rows each).
    fn default() -> SyntheticCtr {
        SyntheticCtr {
            samples: 1_000_000,
            dense: 13,
            tables: vec![100_000; 26],
            zipf: 1.05,
            seed: 1,
            bias: -1.4,
        }
    }
}

impl SyntheticCtr {
    /// The options of `spec`: comma-separated `key=value` (`samples`, `dense`,
    /// `features` (how many categorical features), `rows` (each table's rows), `zipf`,
    /// `seed`), each optional; e.g. `samples=200000,features=8,rows=100000000`.
    pub fn parse(spec: &str) -> Result<SyntheticCtr, CtrError> {
        let mut s = SyntheticCtr::default();
        let (mut features, mut rows) = (s.tables.len(), s.tables[0]);
        for kv in spec.split(',').filter(|kv| !kv.is_empty()) {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| CtrError::Options(format!("{kv:?} is not key=value")))?;
            let bad = |e: &dyn std::fmt::Display| CtrError::Options(format!("{k}={v}: {e}"));
            match k {
                "samples" => s.samples = v.parse().map_err(|e| bad(&e))?,
                "dense" => s.dense = v.parse().map_err(|e| bad(&e))?,
                "features" => features = v.parse().map_err(|e| bad(&e))?,
                "rows" => rows = v.parse().map_err(|e| bad(&e))?,
                "zipf" => s.zipf = v.parse().map_err(|e| bad(&e))?,
                "seed" => s.seed = v.parse().map_err(|e| bad(&e))?,
                _ => {
                    return Err(CtrError::Options(format!(
                        "unknown option {k:?} (samples, dense, features, rows, zipf, seed)"
                    )))
                }
            }
        }
        if rows == 0 || features == 0 || s.samples == 0 {
            return Err(CtrError::Options(
                "samples, features and rows must be at least 1".into(),
            ));
        }
        if s.zipf.is_nan() || s.zipf <= 0.0 {
            return Err(CtrError::Options(format!(
                "zipf={} is not positive",
                s.zipf
            )));
        }
        s.tables = vec![rows; features];
        Ok(s)
    }

    /// The teacher's logit of sample `i` (its click probability's log-odds): the best any
    /// model can know. The teacher's AUC on the set is the ceiling of a trained model's.
    pub fn teacher_logit(&self, i: usize) -> f64 {
        let mut batch = CtrBatch::default();
        batch.clear(self.dense, self.tables.len());
        self.draw(i, &mut batch).0
    }

    /// Sample `i` appended to `batch`; its teacher logit and the generator after it.
    fn draw(&self, i: usize, batch: &mut CtrBatch) -> (f64, Rng) {
        let mut rng = Rng::new(self.seed ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
        let mut logit = self.bias;
        for j in 0..self.dense {
            let x = rng.normal();
            logit += self.dense_weight(j) * x;
            batch.dense.push(x as f32);
        }
        let first = batch.ids.len();
        for (f, rows) in self.tables.iter().enumerate() {
            let id = self.zipf_id(f, *rows, rng.uniform());
            logit += self.id_weight(f, id);
            batch.ids.push(id);
        }
        let ids = &batch.ids[first..];
        for f in (0..PAIRED.min(ids.len()) & !1).step_by(2) {
            let (u, v) = (self.latent(f, ids[f]), self.latent(f + 1, ids[f + 1]));
            logit += u.iter().zip(&v).map(|(a, b)| a * b).sum::<f64>();
        }
        (logit, rng)
    }

    /// A Zipf-distributed id of feature `f` (of `rows` rows) for uniform `u`: the rank by
    /// the continuous inverse of the distribution, scattered over the rows by a hash.
    fn zipf_id(&self, f: usize, rows: u64, u: f64) -> u64 {
        let n = rows as f64;
        let s = self.zipf;
        let rank = if (s - 1.0).abs() < 1e-9 {
            n.powf(u)
        } else {
            ((n.powf(1.0 - s) - 1.0) * u + 1.0).powf(1.0 / (1.0 - s))
        };
        let rank = (rank as u64).clamp(1, rows) - 1;
        let mut h = Rng::new(self.seed ^ 0x5EED ^ ((f as u64) << 40) ^ rank);
        h.next_u64() % rows
    }

    /// The teacher's weight of dense feature `j`.
    fn dense_weight(&self, j: usize) -> f64 {
        Rng::new(self.seed ^ 0xDE45E ^ j as u64).normal() * 0.4
    }

    /// The teacher's weight of feature `f`'s id `id`: feature `f`'s scale times a normal.
    fn id_weight(&self, f: usize, id: u64) -> f64 {
        let scale = 0.8 * 0.9f64.powi(f as i32);
        Rng::new(self.seed ^ 0x1D ^ ((f as u64) << 48) ^ id.rotate_left(8)).normal() * scale
    }

    /// The teacher's latent vector of feature `f`'s id `id`.
    fn latent(&self, f: usize, id: u64) -> [f64; LATENT] {
        let mut r = Rng::new(self.seed ^ 0x1A7E ^ ((f as u64) << 48) ^ id.rotate_left(16));
        std::array::from_fn(|_| r.normal() * 0.5)
    }
}

impl CtrData for SyntheticCtr {
    fn len(&self) -> usize {
        self.samples
    }

    fn dense(&self) -> usize {
        self.dense
    }

    fn tables(&self) -> &[u64] {
        &self.tables
    }

    fn push(&self, i: usize, batch: &mut CtrBatch) {
        let (logit, mut rng) = self.draw(i, batch);
        let p = 1.0 / (1.0 + (-logit).exp());
        batch.labels.push(f32::from(u8::from(rng.uniform() < p)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::ctr::auc;

    /// The same sample wherever it is made; ids within their tables, the most common id
    /// far more common than the median one (Zipf); about a quarter clicks; the teacher's
    /// logits rank the labels (AUC well above half, below 1: the coin is noisy).
    #[test]
    fn samples_are_deterministic_zipf_and_follow_the_teacher() {
        let data = SyntheticCtr::parse("samples=20000,features=6,rows=1000000,seed=5").unwrap();
        let idx: Vec<usize> = (0..data.len()).collect();
        let mut a = CtrBatch::default();
        data.batch_into(&idx, &mut a);
        let mut b = CtrBatch::default();
        data.batch_into(&[17, 3], &mut b);
        assert_eq!(&b.ids[..6], &a.ids[17 * 6..18 * 6]);
        assert_eq!(&b.dense[13..26], &a.dense[3 * 13..4 * 13]);
        assert!(a.ids.iter().all(|id| *id < 1_000_000));
        let mut f0 = Vec::new();
        a.feature_into(0, &mut f0);
        let mut counts = std::collections::HashMap::<u64, usize>::new();
        f0.iter()
            .for_each(|id| *counts.entry(*id).or_default() += 1);
        let top = *counts.values().max().unwrap();
        assert!(top > 200, "the most common id: {top} of 20000");
        assert!(counts.len() > 2000, "distinct ids: {}", counts.len());
        let ctr = a.labels.iter().sum::<f32>() / a.len() as f32;
        assert!((0.15..0.4).contains(&ctr), "click rate {ctr}");
        let teacher: Vec<f32> = idx.iter().map(|i| data.teacher_logit(*i) as f32).collect();
        let ceiling = auc(&teacher, &a.labels).unwrap();
        assert!((0.7..0.95).contains(&ceiling), "teacher AUC {ceiling}");
    }

    #[test]
    fn bad_options_are_named() {
        let e = |s: &str| SyntheticCtr::parse(s).unwrap_err().to_string();
        assert_eq!(
            e("rows=x"),
            "synthetic-ctr: rows=x: invalid digit found in string"
        );
        assert_eq!(
            e("size=3"),
            "synthetic-ctr: unknown option \"size\" (samples, dense, features, rows, zipf, seed)"
        );
        assert_eq!(e("rows"), "synthetic-ctr: \"rows\" is not key=value");
        assert_eq!(e("zipf=0"), "synthetic-ctr: zipf=0 is not positive");
        assert_eq!(
            e("features=0"),
            "synthetic-ctr: samples, features and rows must be at least 1"
        );
    }
}
