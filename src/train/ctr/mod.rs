//! Click-through data, the workload of recommendation models: each sample has dense
//! features, one categorical id per feature (a row of that feature's embedding table) and
//! a label (clicked or not).
//!
//! - [`synthetic`]: a generator of Criteo-like samples from a planted teacher (Zipf ids, a
//!   known logistic ground truth, any number of samples and any table sizes), made on
//!   demand from the sample's index, so no rank holds the data set.
//! - [`criteo`]: a reader of the Criteo TSV layout (label, 13 integer features, 26 hashed
//!   categorical features) for those who have such files.
//! - [`metrics`]: AUC and log loss.
//! - [`fit`]: a click model trained in any mode whose strategy holds its tables, and its
//!   evaluation (AUC over every evaluating rank's share).

pub mod criteo;
mod fit;
pub mod metrics;
mod run;
pub mod synthetic;

pub use fit::{evaluate, fit, CtrEvaluation, CtrFit, RowsAhead};
pub use run::{CtrReport, CtrRun};

pub use criteo::Criteo;
pub use metrics::{auc, logloss};
pub use synthetic::SyntheticCtr;

/// Samples of click-through data, read by index.
pub trait CtrData: Send + Sync {
    /// Samples in the set.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Dense features a sample.
    fn dense(&self) -> usize;

    /// Rows of each categorical feature's table (a sample has one id of each).
    fn tables(&self) -> &[u64];

    /// Appends sample `i` to `batch`.
    fn push(&self, i: usize, batch: &mut CtrBatch);

    /// The samples `idx` as a batch (into `batch`, its buffers reused).
    fn batch_into(&self, idx: &[usize], batch: &mut CtrBatch) {
        batch.clear(self.dense(), self.tables().len());
        idx.iter().for_each(|i| self.push(*i, batch));
    }
}

/// Samples `rows` of a set: a training part and a held-out part of one set.
#[derive(Clone, Copy)]
pub struct Part<'a> {
    data: &'a dyn CtrData,
    start: usize,
    len: usize,
}

impl<'a> Part<'a> {
    /// The samples of `data` from `start`, `len` of them (cut to the set).
    pub fn new(data: &'a dyn CtrData, start: usize, len: usize) -> Part<'a> {
        let start = start.min(data.len());
        Part {
            data,
            start,
            len: len.min(data.len() - start),
        }
    }

    /// `data` cut into its first samples for training and its last `held_out` for
    /// evaluation.
    pub fn split(data: &'a dyn CtrData, held_out: usize) -> (Part<'a>, Part<'a>) {
        let cut = data.len().saturating_sub(held_out);
        (Part::new(data, 0, cut), Part::new(data, cut, held_out))
    }
}

impl CtrData for Part<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn dense(&self) -> usize {
        self.data.dense()
    }

    fn tables(&self) -> &[u64] {
        self.data.tables()
    }

    fn push(&self, i: usize, batch: &mut CtrBatch) {
        self.data.push(self.start + i, batch)
    }
}

/// A batch: `n` samples of `dense` features and `features` ids each, and their labels.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CtrBatch {
    pub dense_features: usize,
    pub features: usize,
    /// `n x dense_features`.
    pub dense: Vec<f32>,
    /// `n x features`: sample `s`'s id of feature `f` at `s * features + f`.
    pub ids: Vec<u64>,
    /// 1 for a click, 0 otherwise.
    pub labels: Vec<f32>,
}

impl CtrBatch {
    /// Empty, for samples of `dense` dense features and `features` ids.
    pub fn clear(&mut self, dense: usize, features: usize) {
        self.dense_features = dense;
        self.features = features;
        self.dense.clear();
        self.ids.clear();
        self.labels.clear();
    }

    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Feature `f`'s ids of every sample, in sample order, into `out`.
    pub fn feature_into(&self, f: usize, out: &mut Vec<u64>) {
        out.clear();
        out.extend(self.ids.iter().skip(f).step_by(self.features.max(1)));
    }
}

/// Why click-through data cannot be read or made: one line naming the file (and line) or
/// the option.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CtrError {
    #[error("{path}: {why}")]
    Read { path: String, why: String },
    #[error("{path} line {line}: {why}")]
    Line {
        path: String,
        line: usize,
        why: String,
    },
    #[error("synthetic-ctr: {0}")]
    Options(String),
}

#[cfg(test)]
mod tests;
