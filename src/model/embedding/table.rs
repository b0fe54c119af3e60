//! A table's rows in one process (local training, or a ps task's shard): rows made on
//! their first touch, updated only where a sparse gradient names them, each with its own
//! optimizer state.

use serde::{Deserialize, Serialize};

use super::index::{self, RowIndex};
use super::lines::{self, Lines};
use super::{EmbeddingError, SparseGrad, TableSpec};

/// How a sparse gradient updates its rows; the state is per row and changes only when
/// the row is in a gradient.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SparseOptimizer {
    /// `w -= lr g`.
    Sgd { lr: f32 },
    /// `acc += g^2; w -= lr g / sqrt(acc)`, `acc` starting at `initial` (TensorFlow's 0.1).
    Adagrad { lr: f32, initial: f32 },
    /// Adam whose moments and step count are the row's own (TensorFlow's `LazyAdam`, with
    /// the bias correction by the row's updates): rows a batch does not touch keep their
    /// moments instead of decaying.
    LazyAdam {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
    },
}

impl SparseOptimizer {
    /// Adagrad with TensorFlow's initial accumulator.
    pub fn adagrad(lr: f32) -> SparseOptimizer {
        SparseOptimizer::Adagrad { lr, initial: 0.1 }
    }

    /// Lazy Adam with Adam's usual moments.
    pub fn lazy_adam(lr: f32) -> SparseOptimizer {
        SparseOptimizer::LazyAdam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }

    /// Its name on the command line (`--sparse-optimizer`).
    pub fn name(&self) -> &'static str {
        match self {
            SparseOptimizer::Sgd { .. } => "sgd",
            SparseOptimizer::Adagrad { .. } => "adagrad",
            SparseOptimizer::LazyAdam { .. } => "lazy-adam",
        }
    }

    /// State values per row of `dim` values.
    pub fn state_len(&self, dim: usize) -> usize {
        match self {
            SparseOptimizer::Sgd { .. } => 0,
            SparseOptimizer::Adagrad { .. } => dim,
            // Both moments, then the row's update count.
            SparseOptimizer::LazyAdam { .. } => 2 * dim + 1,
        }
    }

    /// A new row's state.
    fn initial_state(&self, state: &mut [f32]) {
        match *self {
            SparseOptimizer::Adagrad { initial, .. } => state.fill(initial),
            _ => state.fill(0.0),
        }
    }
}

/// Lazy Adam of one row by its gradient `g` (already scaled): its moments, then its
/// update count (`state`), moved only when the row is.
fn lazy_adam_row(
    w: &mut [f32],
    state: &mut [f32],
    g: &[f32],
    (lr, beta1, beta2, eps): (f32, f32, f32, f32),
) {
    let d = w.len();
    let (moments, count) = state.split_at_mut(2 * d);
    count[0] += 1.0;
    let t = count[0];
    let step = lr * (1.0 - beta2.powf(t)).sqrt() / (1.0 - beta1.powf(t));
    let (m, v) = moments.split_at_mut(d);
    for i in 0..d {
        m[i] = beta1 * m[i] + (1.0 - beta1) * g[i];
        v[i] = beta2 * v[i] + (1.0 - beta2) * g[i] * g[i];
        w[i] -= step * m[i] / (v[i].sqrt() + eps);
    }
}

/// The rows of one table that exist here, their values and optimizer state.
#[derive(Debug, Clone)]
pub struct Table {
    spec: TableSpec,
    seed: u64,
    opt: SparseOptimizer,
    /// Each existing row's slot.
    slot: RowIndex,
    /// Each slot's row.
    ids: Vec<u64>,
    /// Each slot's values, then its optimizer state, from the start of a cache line.
    values: Lines,
    state: Lines,
    /// A request's slots, kept from one request to the next.
    scratch: Vec<u32>,
    /// Each requester's last pull ([`Table::pull_extend_by`]): a push of the same ids, as
    /// training's push of the rows it pulled is, finds them without a lookup.
    recent: Vec<Recent>,
}

/// A requester's last pull: its ids and their slots (valid for the table's life: rows are
/// only ever added).
#[derive(Debug, Clone, Default)]
struct Recent {
    ids: Vec<u64>,
    slots: Vec<u32>,
}

impl Table {
    /// How far ahead of its lookup a batch's id's bucket is prefetched.
    const AHEAD: usize = 16;

    /// A table with no rows yet; a row is made on its first touch from `spec.init` and
    /// `seed`.
    pub fn new(spec: TableSpec, seed: u64, opt: SparseOptimizer) -> Table {
        Table {
            slot: RowIndex::for_rows(spec.rows),
            spec,
            seed,
            opt,
            ids: Vec::new(),
            values: Lines::default(),
            state: Lines::default(),
            scratch: Vec::new(),
            recent: Vec::new(),
        }
    }

    pub fn spec(&self) -> &TableSpec {
        &self.spec
    }

    /// The rows that exist (touched so far, or restored).
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The bytes the existing rows take with their state and index (a small table's
    /// array index whatever its rows).
    pub fn bytes(&self) -> usize {
        let (index, per_row) = self.slot.bytes();
        let (d, k) = (self.spec.dim, self.opt.state_len(self.spec.dim));
        index + self.len() * (4 * (d + k) + 8 + per_row)
    }

    /// The bytes one row of `spec` takes here at most, updated by `opt`: values, optimizer
    /// state, its id, its pulls and its place in the index.
    pub fn row_bytes(spec: &TableSpec, opt: &SparseOptimizer) -> usize {
        4 * (spec.dim + opt.state_len(spec.dim)) + 8 + RowIndex::BYTES_PER_ROW
    }

    /// The `n` rows pulled most often (in this process's life: a restore starts them at
    /// none), with their pulls, most first (ties by id).
    pub fn hottest(&self, n: usize) -> Vec<(u64, u32)> {
        let mut all: Vec<(u64, u32)> = self.slot.hits().filter(|(_, hits)| *hits > 0).collect();
        let n = n.min(all.len());
        if n == 0 {
            return Vec::new();
        }
        let by_heat = |a: &(u64, u32), b: &(u64, u32)| b.1.cmp(&a.1).then(a.0.cmp(&b.0));
        all.select_nth_unstable_by(n - 1, by_heat);
        all.truncate(n);
        all.sort_unstable_by(by_heat);
        all
    }

    /// Row `id`'s slot, made from the initialiser if the row does not exist (`pulled`: its
    /// pull counted).
    #[inline]
    fn slot_of(&mut self, id: u64, pulled: bool) -> Result<usize, EmbeddingError> {
        let found = match pulled {
            true => self.slot.pull(id),
            false => self.slot.get(id),
        };
        match found {
            Some(s) => Ok(s as usize),
            None => self.make(id, pulled),
        }
    }

    /// Row `id` made from the initialiser (`pulled`: its first pull counted); its slot.
    #[cold]
    fn make(&mut self, id: u64, pulled: bool) -> Result<usize, EmbeddingError> {
        self.spec.check(id)?;
        let (d, k) = (self.spec.dim, self.opt.state_len(self.spec.dim));
        let s = self.ids.len();
        self.ids.push(id);
        self.values.resize((s + 1) * d, 0.0);
        self.spec
            .init
            .fill(self.seed, &self.spec, id, &mut self.values[s * d..]);
        self.state.resize((s + 1) * k, 0.0);
        self.opt.initial_state(&mut self.state[s * k..]);
        self.slot.insert(id, s as u32, u32::from(pulled));
        Ok(s)
    }

    /// Before the `i`th of a batch's `ids` is served: starts loading the bucket of the id
    /// [`Self::AHEAD`] places on, and the row and state of the one half as far (whose
    /// bucket was started before), so that the misses of a batch's lookups overlap.
    #[inline]
    fn prefetch(&self, ids: &[u64], i: usize) {
        if let Some(id) = ids.get(i + Self::AHEAD) {
            self.slot.prefetch(*id);
        }
        let Some(s) = ids
            .get(i + Self::AHEAD / 2)
            .and_then(|id| self.slot.get(*id))
        else {
            return;
        };
        let (d, k, s) = (self.spec.dim, self.opt.state_len(self.spec.dim), s as usize);
        index::prefetch_values(&self.values[s * d..(s + 1) * d]);
        if k > 0 {
            index::prefetch_values(&self.state[s * k..(s + 1) * k]);
        }
    }

    /// The slots of `ids` into `slots`, each row made if it does not exist: one lookup per
    /// id, the bucket of the id [`Self::AHEAD`] places on loaded meanwhile (a batch's
    /// misses overlap instead of following one another).
    fn slots_into(
        &mut self,
        ids: &[u64],
        slots: &mut Vec<u32>,
        pulled: bool,
    ) -> Result<(), EmbeddingError> {
        slots.clear();
        slots.reserve(ids.len());
        for (i, id) in ids.iter().enumerate() {
            if let Some(next) = ids.get(i + Self::AHEAD) {
                self.slot.prefetch(*next);
            }
            slots.push(self.slot_of(*id, pulled)? as u32);
        }
        Ok(())
    }

    /// The rows of `ids` into `out` (`ids.len() x dim`, in that order), each made if it
    /// does not exist.
    pub fn pull_into(&mut self, ids: &[u64], out: &mut Vec<f32>) -> Result<(), EmbeddingError> {
        out.clear();
        self.pull_extend(ids, out)
    }

    /// [`Table::pull_into`], the rows appended to what `out` holds.
    pub fn pull_extend(&mut self, ids: &[u64], out: &mut Vec<f32>) -> Result<(), EmbeddingError> {
        let mut slots = std::mem::take(&mut self.scratch);
        let found = self.pull_slots(ids, out, &mut slots);
        self.scratch = slots;
        found
    }

    /// [`Table::pull_extend`] for requester `by` (a worker), whose next
    /// [`Table::apply_rows_by`] of the same ids then finds their rows without a lookup.
    pub fn pull_extend_by(
        &mut self,
        by: usize,
        ids: &[u64],
        out: &mut Vec<f32>,
    ) -> Result<(), EmbeddingError> {
        if self.recent.len() <= by {
            self.recent.resize_with(by + 1, Recent::default);
        }
        let mut recent = std::mem::take(&mut self.recent[by]);
        let found = self.pull_slots(ids, out, &mut recent.slots);
        recent.ids.clear();
        if found.is_ok() {
            recent.ids.extend_from_slice(ids);
        }
        self.recent[by] = recent;
        found
    }

    /// The rows of `ids` appended to `out` (each made if it does not exist, its pull
    /// counted), their slots into `slots`: one pass, the bucket of the id
    /// [`Self::AHEAD`] places on loaded meanwhile. `out` is as it was if a row cannot be.
    fn pull_slots(
        &mut self,
        ids: &[u64],
        out: &mut Vec<f32>,
        slots: &mut Vec<u32>,
    ) -> Result<(), EmbeddingError> {
        let (d, at) = (self.spec.dim, out.len());
        slots.clear();
        slots.reserve(ids.len());
        out.reserve(ids.len() * d);
        for (i, id) in ids.iter().enumerate() {
            if let Some(next) = ids.get(i + Self::AHEAD) {
                self.slot.prefetch(*next);
            }
            let s = match self.slot_of(*id, true) {
                Ok(s) => s,
                Err(e) => {
                    out.truncate(at);
                    return Err(e);
                }
            };
            slots.push(s as u32);
            lines::append_row(out, &self.values[s * d..(s + 1) * d]);
        }
        Ok(())
    }

    /// The rows of `ids` into `out` as [`Table::pull_into`] gives them, without making
    /// any: a row that does not exist is its initial values (an evaluation's read, which
    /// must not grow the table).
    pub fn read_into(&self, ids: &[u64], out: &mut Vec<f32>) -> Result<(), EmbeddingError> {
        out.clear();
        self.read_extend(ids, out)
    }

    /// [`Table::read_into`], the rows appended to what `out` holds.
    pub fn read_extend(&self, ids: &[u64], out: &mut Vec<f32>) -> Result<(), EmbeddingError> {
        let (d, at) = (self.spec.dim, out.len());
        out.resize(at + ids.len() * d, 0.0);
        let rows = out[at..].chunks_exact_mut(d.max(1));
        for (i, (id, row)) in ids.iter().zip(rows).enumerate() {
            self.prefetch(ids, i);
            match self.row(*id) {
                Some(r) => row.copy_from_slice(r),
                None => {
                    self.spec.check(*id)?;
                    self.spec.init.fill(self.seed, &self.spec, *id, row);
                }
            }
        }
        Ok(())
    }

    /// Row `id`, if it exists.
    pub fn row(&self, id: u64) -> Option<&[f32]> {
        let d = self.spec.dim;
        let s = self.slot.get(id)? as usize;
        Some(&self.values[s * d..(s + 1) * d])
    }

    /// Updates the rows `grad` names by `scale` times their gradient (each row made first
    /// if it does not exist); the other rows and their state are untouched.
    pub fn apply(&mut self, grad: &SparseGrad, scale: f32) -> Result<(), EmbeddingError> {
        self.apply_rows(&grad.ids, &grad.values, scale)
    }

    /// [`Table::apply`] of the gradient rows `values` (one of `dim` values per id of
    /// `ids`).
    pub fn apply_rows(
        &mut self,
        ids: &[u64],
        values: &[f32],
        scale: f32,
    ) -> Result<(), EmbeddingError> {
        self.check_gradient(ids, values)?;
        let mut slots = std::mem::take(&mut self.scratch);
        let found = self.slots_into(ids, &mut slots, false);
        if found.is_ok() {
            self.apply_slots(&slots, values, scale);
        }
        self.scratch = slots;
        found
    }

    /// [`Table::apply_rows`] from requester `by`: where `ids` are those of its last pull
    /// ([`Table::pull_extend_by`]), their rows are where that pull found them.
    pub fn apply_rows_by(
        &mut self,
        by: usize,
        ids: &[u64],
        values: &[f32],
        scale: f32,
    ) -> Result<(), EmbeddingError> {
        if self.recent.get(by).is_none_or(|r| r.ids != ids) {
            return self.apply_rows(ids, values, scale);
        }
        self.check_gradient(ids, values)?;
        let slots = std::mem::take(&mut self.recent[by].slots);
        self.apply_slots(&slots, values, scale);
        self.recent[by].slots = slots;
        Ok(())
    }

    /// Why `values` is not a gradient of the rows `ids`, if it is not.
    fn check_gradient(&self, ids: &[u64], values: &[f32]) -> Result<(), EmbeddingError> {
        let d = self.spec.dim;
        if values.len() == ids.len() * d {
            return Ok(());
        }
        Err(EmbeddingError::Shape {
            table: self.spec.name.clone(),
            what: format!(
                "a gradient of {} values for {} rows of {d}",
                values.len(),
                ids.len()
            ),
        })
    }

    /// Updates the rows at `slots` by `scale` times their gradient rows `values` (the
    /// rows are not prefetched: their loads do not depend on one another, and the
    /// processor overlaps them better without).
    fn apply_slots(&mut self, slots: &[u32], values: &[f32], scale: f32) {
        let (d, k) = (self.spec.dim, self.opt.state_len(self.spec.dim));
        let rows = (slots.iter().map(|s| *s as usize)).zip(values.chunks_exact(d.max(1)));
        // SGD and Adagrad by the row, scaling as they go; lazy Adam on a scaled copy.
        match self.opt {
            SparseOptimizer::Sgd { lr } => {
                for (s, g) in rows {
                    lines::sgd_row(&mut self.values[s * d..(s + 1) * d], g, lr, scale);
                }
            }
            SparseOptimizer::Adagrad { lr, .. } => {
                for (s, g) in rows {
                    let (w, acc) = (
                        &mut self.values[s * d..(s + 1) * d],
                        &mut self.state[s * k..(s + 1) * k],
                    );
                    lines::adagrad_row(w, acc, g, lr, scale);
                }
            }
            SparseOptimizer::LazyAdam {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                let mut g = vec![0f32; d];
                for (s, row) in rows {
                    g.iter_mut().zip(row).for_each(|(g, v)| *g = scale * v);
                    let (w, st) = (
                        &mut self.values[s * d..(s + 1) * d],
                        &mut self.state[s * k..(s + 1) * k],
                    );
                    lazy_adam_row(w, st, &g, (lr, beta1, beta2, eps));
                }
            }
        }
    }

    /// Every existing row with its state, in the order rows were made: what a checkpoint
    /// holds of the table.
    pub fn rows(&self) -> impl Iterator<Item = (u64, &[f32], &[f32])> {
        let (d, k) = (self.spec.dim, self.opt.state_len(self.spec.dim));
        self.ids.iter().enumerate().map(move |(s, id)| {
            (
                *id,
                &self.values[s * d..(s + 1) * d],
                &self.state[s * k..(s + 1) * k],
            )
        })
    }

    /// Sets row `id` and its state (a restore), making the row if it does not exist.
    pub fn insert(&mut self, id: u64, values: &[f32], state: &[f32]) -> Result<(), EmbeddingError> {
        let (d, k) = (self.spec.dim, self.opt.state_len(self.spec.dim));
        if values.len() != d || state.len() != k {
            return Err(EmbeddingError::Shape {
                table: self.spec.name.clone(),
                what: format!(
                    "row {id} restored with {} values and {} of state, not {d} and {k}",
                    values.len(),
                    state.len()
                ),
            });
        }
        let s = self.slot_of(id, false)?;
        self.values[s * d..(s + 1) * d].copy_from_slice(values);
        self.state[s * k..(s + 1) * k].copy_from_slice(state);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
