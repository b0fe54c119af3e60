//! Embedding tables: the parameters of recommendation models, too large to be dense.
//!
//! A table has `rows` rows of `dim` values; a batch touches few of them. So a table is
//! never a [`super::Model`]'s dense parameter and its gradient is never dense: a step
//! takes the ids its batch names, deduplicates them ([`Unique`]), obtains just those rows
//! (from a [`Table`] in this process, or pulled from the ps tasks that hold the table's
//! shards), and its backward pass gives a [`SparseGrad`]: the unique ids and one gradient
//! row each, duplicates combined. A [`Table`] creates a row on its first touch from a
//! seeded initialiser ([`RowInit`]: the same values on every process for the same seed,
//! table and row, so a table may be far larger than what training touches) and updates
//! only the rows a gradient names, with per-row optimizer state ([`SparseOptimizer`]:
//! SGD, Adagrad, lazy Adam).
//!
//! - [`bag`]: `EmbeddingBag`'s forward (a row gather, summed or averaged over a multi-hot
//!   feature) and backward (the sparse gradient), over rows obtained for the batch;
//!   `Embedding`'s (a row per id).
//! - [`table`]: a table's rows and their optimizer state in one process.

pub mod bag;
mod index;
mod lines;
pub(crate) use index::RowIndex;
pub(crate) use lines::{append_row, copy_row};
pub mod table;

use serde::{Deserialize, Serialize};

pub use bag::{Bags, Embedding, EmbeddingBag, Pooling, SparseGrad, Unique};
pub use table::{SparseOptimizer, Table};

/// One embedding table of a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableSpec {
    /// The table's name (`emb3`): its rows' seeds and its checkpoint entries.
    pub name: String,
    /// Rows the ids may name: `0..rows`.
    pub rows: u64,
    /// Values per row.
    pub dim: usize,
    pub init: RowInit,
}

impl TableSpec {
    pub fn new(name: &str, rows: u64, dim: usize) -> TableSpec {
        TableSpec {
            name: name.to_string(),
            rows,
            dim,
            init: RowInit::default(),
        }
    }

    /// The bytes the table would take if every row existed (what a dense variable costs).
    pub fn dense_bytes(&self) -> u128 {
        u128::from(self.rows) * self.dim as u128 * 4
    }

    /// Why `id` is no row of this table.
    pub fn check(&self, id: u64) -> Result<(), EmbeddingError> {
        match id < self.rows {
            true => Ok(()),
            false => Err(EmbeddingError::Id {
                table: self.name.clone(),
                id,
                rows: self.rows,
            }),
        }
    }
}

/// How a row starts, on its first touch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RowInit {
    /// Uniform in `[-a, a]`, drawn from a generator seeded by the run's seed, the table's
    /// name and the row: the same values wherever and whenever the row is made.
    Uniform {
        a: f32,
    },
    Zeros,
}

impl Default for RowInit {
    fn default() -> RowInit {
        RowInit::Uniform { a: 0.05 }
    }
}

impl RowInit {
    /// Writes row `id` of table `spec` (seed `seed`) into `out` (`spec.dim` values).
    pub fn fill(&self, seed: u64, spec: &TableSpec, id: u64, out: &mut [f32]) {
        match *self {
            RowInit::Zeros => out.fill(0.0),
            RowInit::Uniform { a } => {
                let table = crate::hash::fnv1a(spec.name.as_bytes());
                let mut rng = crate::rng::Rng::new(
                    seed ^ table.rotate_left(17) ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                );
                for v in out.iter_mut() {
                    *v = ((rng.uniform() * 2.0 - 1.0) * f64::from(a)) as f32;
                }
            }
        }
    }
}

/// Embedding errors: one line naming the table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EmbeddingError {
    #[error("table {table}: id {id} is no row of its {rows}")]
    Id { table: String, id: u64, rows: u64 },
    #[error("table {table}: {what}")]
    Shape { table: String, what: String },
}
