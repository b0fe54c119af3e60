//! `EmbeddingBag`: each sample's feature is a bag of ids (one for a one-hot feature, several
//! for a multi-hot one) whose rows are summed or averaged; `Embedding`: a row per id. The forward pass gathers rows
//! obtained for the batch; the backward pass gives the sparse gradient of exactly those
//! rows, an id named twice in the batch getting one row of gradient (the sum of both).

use super::{EmbeddingError, TableSpec};

/// How a bag's rows become one vector (PyTorch's `EmbeddingBag` modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    #[default]
    Sum,
    Mean,
}

/// A batch's bags of one feature: bag `b` holds `ids[offsets[b]..offsets[b + 1]]` (an
/// empty bag gives zeros).
#[derive(Debug, Clone, Copy)]
pub struct Bags<'a> {
    pub ids: &'a [u64],
    pub offsets: &'a [usize],
}

impl<'a> Bags<'a> {
    /// One id a bag: a one-hot feature's `n` samples.
    pub fn one_hot(ids: &'a [u64], offsets: &'a mut Vec<usize>) -> Bags<'a> {
        offsets.clear();
        offsets.extend(0..=ids.len());
        Bags { ids, offsets }
    }

    /// The number of bags.
    pub fn len(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bag `b`'s ids.
    pub fn bag(&self, b: usize) -> &'a [u64] {
        &self.ids[self.offsets[b]..self.offsets[b + 1]]
    }

    /// Why these bags do not fit `table` (offsets not rising from 0 to the ids, an id
    /// beyond its rows).
    pub fn check(&self, table: &TableSpec) -> Result<(), EmbeddingError> {
        let shape = |what: String| EmbeddingError::Shape {
            table: table.name.clone(),
            what,
        };
        let (first, last) = (self.offsets.first(), self.offsets.last());
        if first != Some(&0) || last != Some(&self.ids.len()) {
            return Err(shape(format!(
                "bag offsets must rise from 0 to the {} ids (first {first:?}, last {last:?})",
                self.ids.len()
            )));
        }
        if let Some(w) = self.offsets.windows(2).position(|w| w[0] > w[1]) {
            return Err(shape(format!("bag offsets fall at bag {w}")));
        }
        self.ids.iter().try_for_each(|id| table.check(*id))
    }
}

/// A batch's ids deduplicated: the distinct ids, and for each occurrence the position of
/// its id among them (so a row obtained once serves every occurrence).
///
/// The distinct ids are in the order of their bits reversed: ids whose low bits agree lie
/// together, so for any power of 2 of ps tasks (which hold rows by their ids' low bits,
/// [`crate::train::ps::protocol::row_owner`]) each ps's ids are one run, whose rows come
/// and go without being gathered or placed row by row.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Unique {
    pub ids: Vec<u64>,
    pub at: Vec<u32>,
    /// The ids' bits reversed, ascending.
    keys: Vec<u64>,
}

impl Unique {
    /// The distinct ids of `ids`; reuses this one's buffers.
    pub fn of(&mut self, ids: &[u64]) -> &Unique {
        self.keys.clear();
        self.keys.extend(ids.iter().map(|id| id.reverse_bits()));
        self.keys.sort_unstable();
        self.keys.dedup();
        self.ids.clear();
        self.ids.extend(self.keys.iter().map(|k| k.reverse_bits()));
        self.at.clear();
        let found = ids.iter().map(|id| {
            let k = id.reverse_bits();
            self.keys.binary_search(&k).expect("every id is among them") as u32
        });
        self.at.extend(found);
        self
    }

    /// For each of these ids in order, whether `other` has it too, into `marks`: one walk
    /// of both lists (each in the same order).
    pub fn marks_in(&self, other: &Unique, marks: &mut Vec<bool>) {
        marks.clear();
        let mut j = 0;
        for k in &self.keys {
            while other.keys.get(j).is_some_and(|o| o < k) {
                j += 1;
            }
            marks.push(other.keys.get(j) == Some(k));
        }
    }
}

/// A sparse gradient of a table: one row of `dim` values for each id (distinct).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SparseGrad {
    pub ids: Vec<u64>,
    pub values: Vec<f32>,
}

impl SparseGrad {
    /// The gradient row of the `i`th id.
    pub fn row(&self, i: usize, dim: usize) -> &[f32] {
        &self.values[i * dim..(i + 1) * dim]
    }
}

/// The embedding of one table: a row per id (a one-hot feature's samples, a sequence's
/// tokens), `dim` values each. The forward pass gathers each id's row; the backward pass
/// gives one gradient row per distinct id, an id named twice getting the sum of both: an
/// [`EmbeddingBag`] whose every bag holds one id, without the bags' offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Embedding {
    pub dim: usize,
}

impl Embedding {
    /// Each id's row into `out` (`unique.at.len() x dim`, in the ids' order), from
    /// `rows`: the rows of `unique.ids` in that order (`unique` made of the ids).
    pub fn forward_into(&self, unique: &Unique, rows: &[f32], out: &mut Vec<f32>) {
        let d = self.dim;
        out.clear();
        out.reserve(unique.at.len() * d);
        for &at in &unique.at {
            out.extend_from_slice(&rows[at as usize * d..(at as usize + 1) * d]);
        }
    }

    /// The sparse gradient of the rows of `unique.ids` from the gradient `dout` of the
    /// forward pass's output (a row per id): into `grad`, duplicates combined.
    pub fn backward_into(&self, unique: &Unique, dout: &[f32], grad: &mut SparseGrad) {
        let d = self.dim;
        grad.ids.clear();
        grad.ids.extend_from_slice(&unique.ids);
        grad.values.clear();
        grad.values.resize(unique.ids.len() * d, 0.0);
        for (&at, g) in unique.at.iter().zip(dout.chunks_exact(d.max(1))) {
            let row = &mut grad.values[at as usize * d..(at as usize + 1) * d];
            row.iter_mut().zip(g).for_each(|(r, g)| *r += g);
        }
    }
}

/// The embedding bag of one table: `dim` values per bag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingBag {
    pub dim: usize,
    pub pooling: Pooling,
}

impl EmbeddingBag {
    /// Each bag's pooled row into `out` (`bags.len() x dim`), from `rows`: the rows of
    /// `unique.ids` in that order (`unique` made of `bags.ids`).
    pub fn forward_into(&self, bags: Bags<'_>, unique: &Unique, rows: &[f32], out: &mut Vec<f32>) {
        let d = self.dim;
        out.clear();
        out.resize(bags.len() * d, 0.0);
        for (b, o) in out.chunks_exact_mut(d).enumerate() {
            let (start, end) = (bags.offsets[b], bags.offsets[b + 1]);
            for &at in &unique.at[start..end] {
                let row = &rows[at as usize * d..(at as usize + 1) * d];
                o.iter_mut().zip(row).for_each(|(o, r)| *o += r);
            }
            if self.pooling == Pooling::Mean && end > start {
                let k = 1.0 / (end - start) as f32;
                o.iter_mut().for_each(|o| *o *= k);
            }
        }
    }

    /// The sparse gradient of the rows of `unique.ids` from the gradient `dout` of the
    /// forward pass's output: into `grad` (its ids those of `unique`, duplicates combined).
    pub fn backward_into(
        &self,
        bags: Bags<'_>,
        unique: &Unique,
        dout: &[f32],
        grad: &mut SparseGrad,
    ) {
        let d = self.dim;
        grad.ids.clear();
        grad.ids.extend_from_slice(&unique.ids);
        grad.values.clear();
        grad.values.resize(unique.ids.len() * d, 0.0);
        for (b, g) in dout.chunks_exact(d).enumerate() {
            let (start, end) = (bags.offsets[b], bags.offsets[b + 1]);
            let k = match self.pooling {
                Pooling::Mean if end > start => 1.0 / (end - start) as f32,
                _ => 1.0,
            };
            for &at in &unique.at[start..end] {
                let row = &mut grad.values[at as usize * d..(at as usize + 1) * d];
                row.iter_mut().zip(g).for_each(|(r, g)| *r += k * g);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::embedding::RowInit;
    use crate::rng::Rng;

    /// A loss of the bags' output (a fixed weighting of it) and its gradient.
    fn loss(out: &[f32], w: &[f32]) -> f64 {
        out.iter()
            .zip(w)
            .map(|(o, w)| f64::from(*o) * f64::from(*w) + 0.5 * f64::from(*o).powi(2))
            .sum()
    }

    /// A batch's distinct ids, each once, every occurrence pointing at its own; for 2, 4,
    /// 8 and 64 ps tasks each task's ids (by their low bits) one run of them.
    #[test]
    fn distinct_ids_lie_in_one_run_per_ps_for_any_power_of_two() {
        let mut r = Rng::new(7);
        let ids: Vec<u64> = (0..5000)
            .map(|i| match i % 3 {
                0 => r.below(100) as u64,
                1 => r.below(1 << 20) as u64,
                _ => u64::MAX - r.below(1000) as u64,
            })
            .collect();
        let mut unique = Unique::default();
        unique.of(&ids);
        let mut sorted = unique.ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), unique.ids.len(), "each distinct id once");
        assert!(ids
            .iter()
            .zip(&unique.at)
            .all(|(id, at)| unique.ids[*at as usize] == *id));
        for nps in [2u64, 4, 8, 64] {
            let owners: Vec<u64> = unique.ids.iter().map(|id| id % nps).collect();
            let mut runs = owners.clone();
            runs.dedup();
            assert_eq!(runs.len() as u64, nps, "{nps} ps: one run each");
        }
    }

    /// The sparse gradient equals finite differences of the loss in every touched row's
    /// every value (sum and mean, an id repeated within a bag and across bags, an empty
    /// bag), and untouched rows get none.
    #[test]
    fn the_sparse_gradient_is_the_finite_differences_of_the_touched_rows() {
        let table = TableSpec::new("t", 1000, 3);
        let ids = [7u64, 900, 7, 5, 7, 900, 31];
        let offsets = [0usize, 3, 3, 4, 7];
        let bags = Bags {
            ids: &ids,
            offsets: &offsets,
        };
        bags.check(&table).unwrap();
        let mut unique = Unique::default();
        unique.of(&ids);
        // Ordered by their bits reversed: the even id first, then 5 (bit 1 clear).
        assert_eq!(unique.ids, vec![900, 5, 7, 31]);
        for pooling in [Pooling::Sum, Pooling::Mean] {
            let bag = EmbeddingBag { dim: 3, pooling };
            let mut rows = vec![0f32; unique.ids.len() * 3];
            for (i, id) in unique.ids.iter().enumerate() {
                RowInit::Uniform { a: 1.0 }.fill(3, &table, *id, &mut rows[i * 3..i * 3 + 3]);
            }
            let mut out = Vec::new();
            bag.forward_into(bags, &unique, &rows, &mut out);
            assert_eq!(out.len(), 4 * 3);
            assert!(out[3..6].iter().all(|v| *v == 0.0), "the empty bag");
            let mut r = Rng::new(1);
            let w: Vec<f32> = (0..out.len()).map(|_| r.normal() as f32).collect();
            let dout: Vec<f32> = out.iter().zip(&w).map(|(o, w)| w + o).collect();
            let mut grad = SparseGrad::default();
            bag.backward_into(bags, &unique, &dout, &mut grad);
            assert_eq!(grad.ids, unique.ids);
            for i in 0..rows.len() {
                let h = 1e-2f32;
                let mut at = |delta: f32| {
                    let mut moved = rows.clone();
                    moved[i] += delta;
                    bag.forward_into(bags, &unique, &moved, &mut out);
                    loss(&out, &w)
                };
                let numeric = (at(h) - at(-h)) / (2.0 * f64::from(h));
                let got = f64::from(grad.values[i]);
                assert!(
                    (numeric - got).abs() < 1e-3,
                    "{pooling:?} value {i}: {numeric} vs {got}"
                );
            }
        }
    }

    /// An embedding's rows and gradient are an embedding bag's over bags of one id each:
    /// every value the same, an id named three times getting the sum of its three rows of
    /// gradient.
    #[test]
    fn an_embedding_is_a_bag_of_one_id_per_sample() {
        let table = TableSpec::new("t", 1000, 4);
        let ids = [7u64, 900, 7, 5, 7];
        let mut unique = Unique::default();
        unique.of(&ids);
        let mut rows = vec![0f32; unique.ids.len() * 4];
        for (i, id) in unique.ids.iter().enumerate() {
            RowInit::Uniform { a: 1.0 }.fill(4, &table, *id, &mut rows[i * 4..i * 4 + 4]);
        }
        let mut offsets = Vec::new();
        let bags = Bags::one_hot(&ids, &mut offsets);
        let (emb, bag) = (
            Embedding { dim: 4 },
            EmbeddingBag {
                dim: 4,
                pooling: Pooling::Sum,
            },
        );
        let (mut got, mut want) = (Vec::new(), Vec::new());
        emb.forward_into(&unique, &rows, &mut got);
        bag.forward_into(bags, &unique, &rows, &mut want);
        assert_eq!(got, want);
        assert_eq!(got[8..12], got[..4], "id 7's row, twice");
        let mut r = Rng::new(3);
        let dout: Vec<f32> = (0..got.len()).map(|_| r.normal() as f32).collect();
        let (mut g, mut h) = (SparseGrad::default(), SparseGrad::default());
        emb.backward_into(&unique, &dout, &mut g);
        bag.backward_into(bags, &unique, &dout, &mut h);
        assert_eq!(g, h);
        let seven = unique.ids.iter().position(|id| *id == 7).unwrap();
        let sum: Vec<f32> = (0..4)
            .map(|j| dout[j] + dout[8 + j] + dout[16 + j])
            .collect();
        assert_eq!(g.row(seven, 4), &sum[..]);
    }

    #[test]
    fn bags_that_do_not_fit_their_table_are_named() {
        let table = TableSpec::new("emb2", 10, 4);
        let bad = Bags {
            ids: &[1, 10],
            offsets: &[0, 1, 2],
        };
        assert_eq!(
            bad.check(&table).unwrap_err().to_string(),
            "table emb2: id 10 is no row of its 10"
        );
        let falling = Bags {
            ids: &[1, 2],
            offsets: &[0, 2, 1, 2],
        };
        assert_eq!(
            falling.check(&table).unwrap_err().to_string(),
            "table emb2: bag offsets fall at bag 1"
        );
        let short = Bags {
            ids: &[1, 2],
            offsets: &[0, 1],
        };
        assert!(short
            .check(&table)
            .unwrap_err()
            .to_string()
            .contains("from 0 to the 2 ids"));
    }
}
