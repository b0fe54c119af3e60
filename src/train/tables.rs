//! Embedding tables beside a mode's dense parameters: where their rows live (this
//! process, or the ps tasks), and [`Sparse`], the strategy that adds them to any mode.
//!
//! A recommendation model's step pulls the rows its batch names, computes, and pushes the
//! rows' sparse gradient ([`Tables`]); the dense parameters go through the mode as any
//! model's do. [`Sparse`] wraps a mode's strategy with a [`RowHome`]: the dense part's
//! start, steps and logs are the mode's, while the start (a restore of the rows), the
//! checkpoint (the dense state and the rows in one checkpoint, the rows that exist
//! only) and the end (the ps tasks told) take the rows along. `--mode hybrid` is
//! `Sparse<Allreduce, PsRows>` ([`super::hybrid`]); the ps mode holds its tables itself
//! ([`super::ps::Ps`] is a [`Tables`] too).

use std::cell::RefCell;
use std::path::{Path, PathBuf};

use super::checkpoint::{self, state::REPLICA_FILE, State};
use super::engine::{End, Started, StepWord, Strategy, TrainError};
use super::events::Event;
use crate::model::embedding::{SparseGrad, SparseOptimizer, Table, TableSpec};
use crate::model::{Replica, Targets};
use crate::observe::phases::{Clock, RankTimes, Times};
use crate::tensor::Tensor;
use crate::train::data::Dataset;
use crate::train::resources::Share;

/// A strategy whose model has embedding tables: what a step does with their rows.
pub trait Tables {
    /// The tables, in the order the calls name them by index.
    fn table_specs(&self) -> &[TableSpec];

    /// The rows of several tables at once, every row's home asked once for them all:
    /// `want[i]`'s rows (a table and ids) into `out[i]` (`dim` values each, in the order
    /// of the ids). Rows not yet touched are made from the initialiser (`make`), or read
    /// as their initial values (an evaluation's read, which must not grow the tables).
    fn pull_tables(
        &self,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
        make: bool,
    ) -> Result<(), TrainError>;

    /// Applies sparse gradients of several tables (each a table and its gradient) scaled
    /// by `scale`, every row's home sent its part of them all at once.
    fn push_tables(&self, grads: &[(usize, &SparseGrad)], scale: f32) -> Result<(), TrainError>;

    /// [`Tables::push_tables`], then [`Tables::pull_tables`] of `want` (making rows): the
    /// next step's rows, pulled after this step's push is applied, each row's home asked
    /// once for both where rows travel.
    fn push_pull_tables(
        &self,
        grads: &[(usize, &SparseGrad)],
        scale: f32,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
    ) -> Result<(), TrainError> {
        self.push_tables(grads, scale)?;
        self.pull_tables(want, out, true)
    }

    /// True where [`Tables::pull_ahead`] sends its requests ahead: rows that travel and
    /// are updated as pushes arrive, so a step may ask for the next step's rows before
    /// it computes.
    fn pulls_ahead(&self) -> bool {
        false
    }

    /// Starts pulling `want`'s rows (made where new), to arrive while this rank computes;
    /// [`Tables::land_tables`] with the same `want` puts them into buffers. They hold the
    /// updates their homes had applied when asked: a caller asks ahead only for rows its
    /// own pending push does not touch. Where rows are not pulled ahead (the default),
    /// they are pulled when landed.
    fn pull_ahead(&self, want: &[(usize, &[u64])]) -> Result<(), TrainError> {
        let _ = want;
        Ok(())
    }

    /// The rows [`Tables::pull_ahead`] asked for, `want[i]`'s into `out[i]` as
    /// [`Tables::pull_tables`] puts them.
    fn land_tables(
        &self,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
    ) -> Result<(), TrainError> {
        self.pull_tables(want, out, true)
    }

    /// Rows `ids` of table `table` into `out` ([`Tables::pull_tables`] of one table).
    fn pull_rows(&self, table: usize, ids: &[u64], out: &mut Vec<f32>) -> Result<(), TrainError> {
        self.pull_tables(&[(table, ids)], std::slice::from_mut(out), true)
    }

    /// [`Tables::pull_rows`] without making rows.
    fn read_rows(&self, table: usize, ids: &[u64], out: &mut Vec<f32>) -> Result<(), TrainError> {
        self.pull_tables(&[(table, ids)], std::slice::from_mut(out), false)
    }

    /// Applies table `table`'s sparse gradient `grad` scaled by `scale` to its rows.
    fn push_rows(&self, table: usize, grad: &SparseGrad, scale: f32) -> Result<(), TrainError> {
        self.push_tables(&[(table, grad)], scale)
    }

    /// The scale of this rank's sparse gradients (the mean over its share of the global
    /// batch) in the update: `1 / replicas` where the replicas' updates make one step.
    fn push_scale(&self) -> f32;

    /// The chief: each task's report of the rows it holds and the requests it served.
    fn rows_report(&self) -> Result<Vec<RowsReport>, TrainError>;

    /// True where rows travel to and from other tasks (pulls and pushes are
    /// communication); false where they are in this process.
    fn remote(&self) -> bool {
        true
    }

    /// True where every worker must push every step (the rows' home applies a step once
    /// all pushed): a step whose gradient is not pushed pushes none instead.
    fn pushes_every_step(&self) -> bool {
        false
    }
}

/// What one table's rows are in one process (a ps task, or the local one): how many
/// exist and their bytes, the requests served, and the hottest rows.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TableReport {
    pub table: String,
    /// Rows that exist here.
    pub rows: u64,
    /// Their bytes, with their optimizer state and index.
    pub bytes: u64,
    /// Pull requests served, and the rows they named.
    pub pulls: u64,
    pub rows_pulled: u64,
    /// Push requests applied, and the rows they named.
    pub pushes: u64,
    pub rows_pushed: u64,
    /// The rows pulled most often, with their pulls, most first.
    pub hot: Vec<(u64, u32)>,
}

/// The hottest rows a report names per table.
pub const HOT_ROWS: usize = 5;

/// A task's tables' reports.
#[derive(Debug, Clone, PartialEq)]
pub struct RowsReport {
    /// `ps:0 (rank 0)`, or `local`.
    pub task: String,
    pub tables: Vec<TableReport>,
}

/// The requests a table served.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Served {
    pub pulls: u64,
    pub rows_pulled: u64,
    pub pushes: u64,
    pub rows_pushed: u64,
}

impl Served {
    /// `table`'s report with these counts.
    pub fn report(&self, table: &Table) -> TableReport {
        TableReport {
            table: table.spec().name.clone(),
            rows: table.len() as u64,
            bytes: table.bytes() as u64,
            pulls: self.pulls,
            rows_pulled: self.rows_pulled,
            pushes: self.pushes,
            rows_pushed: self.rows_pushed,
            hot: table.hottest(HOT_ROWS),
        }
    }
}

/// Why rows no longer fit where `who` holds them (`held` bytes in all, against `share`),
/// if they do not: one line naming `table`, whose request grew them.
pub fn outgrew(
    who: &dyn std::fmt::Display,
    table: &Table,
    held: u64,
    share: Option<&Share>,
) -> Result<(), String> {
    let Some(share) = share.filter(|s| held > s.bytes) else {
        return Ok(());
    };
    Err(format!(
        "table {}: {who}'s rows ({} of this table's, {} with the other tables' and the variables) outgrew the task's share of {} ({}): more ps tasks, or nodes with more memory, would hold them",
        table.spec().name,
        table.len(),
        crate::observe::bytes(held),
        crate::observe::bytes(share.bytes),
        share.why
    ))
}

/// Where a [`Sparse`] strategy's rows live: the [`Tables`] a step uses, and what the
/// strategy's start, checkpoints and end ask of them.
pub trait RowHome: Tables {
    /// The rows' start (the chief's call; the others wait for it in the mode's own start,
    /// which follows): fresh tables, or the rows of the checkpoint at `restore`.
    fn start(&mut self, restore: Option<&Path>) -> Result<(), TrainError>;

    /// The chief: writes the rows into checkpoint staging directory `dir`; the files'
    /// names, bytes and checksums for the manifest.
    fn save(&mut self, dir: &Path) -> Result<Vec<(String, u64, u64)>, TrainError>;

    /// Training ended on this rank.
    fn end(&mut self, how: &End<'_>) -> Result<(), TrainError> {
        let _ = how;
        Ok(())
    }
}

/// A mode's strategy `S` with embedding tables whose rows live in `R`.
pub struct Sparse<S, R> {
    inner: S,
    rows: R,
}

impl<'m, S: Strategy<'m>, R: RowHome> Sparse<S, R> {
    /// The chief's checkpoint of `step`: the dense state's file, the rows' files, the
    /// manifest over them.
    fn write_checkpoint(
        &mut self,
        dir: &Path,
        step: u64,
        keep: usize,
        events: &mut dyn FnMut(&Event),
    ) -> Result<PathBuf, TrainError> {
        let t = std::time::Instant::now();
        let replica = self.inner.replica();
        let (describe, vars) = (replica.model.describe(), replica.variables());
        let state = self.inner.state(step)?;
        let written = checkpoint::begin(dir, step)
            .map_err(TrainError::from)
            .and_then(|tmp| {
                // The rows' home first: once asked, ps tasks excuse the workers' silence
                // until the checkpoint is over, which a slow write (an fsync behind the
                // file system's other writes) of the dense file may then take.
                let rows = self.rows.save(&tmp)?;
                let dense = checkpoint::write_file(&tmp.join(REPLICA_FILE), &state.arrays(&vars))?;
                let mut files = vec![(REPLICA_FILE.to_string(), dense.0, dense.1)];
                files.extend(rows);
                let meta = checkpoint::state::model_meta(&describe, &vars);
                Ok(checkpoint::commit(dir, step, &files, meta)?)
            });
        let path = written.map_err(|e| checkpoint::abandoned(dir, step, e))?;
        checkpoint::retain(dir, keep);
        let done = Event::Checkpoint {
            path: path.clone(),
            step,
        };
        super::engine::checkpointed(step, t, &done, events);
        Ok(path)
    }
}

impl<S, R: RowHome> Sparse<S, R> {
    /// `inner`'s mode with tables in `rows`.
    pub fn new(inner: S, rows: R) -> Sparse<S, R> {
        Sparse { inner, rows }
    }

    /// The mode's strategy.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S, R: RowHome> Tables for Sparse<S, R> {
    fn table_specs(&self) -> &[TableSpec] {
        self.rows.table_specs()
    }

    fn pull_tables(
        &self,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
        make: bool,
    ) -> Result<(), TrainError> {
        self.rows.pull_tables(want, out, make)
    }

    fn push_tables(&self, grads: &[(usize, &SparseGrad)], scale: f32) -> Result<(), TrainError> {
        self.rows.push_tables(grads, scale)
    }

    fn pulls_ahead(&self) -> bool {
        self.rows.pulls_ahead()
    }

    fn pull_ahead(&self, want: &[(usize, &[u64])]) -> Result<(), TrainError> {
        self.rows.pull_ahead(want)
    }

    fn land_tables(
        &self,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
    ) -> Result<(), TrainError> {
        self.rows.land_tables(want, out)
    }

    fn push_scale(&self) -> f32 {
        self.rows.push_scale()
    }

    fn rows_report(&self) -> Result<Vec<RowsReport>, TrainError> {
        self.rows.rows_report()
    }

    fn remote(&self) -> bool {
        self.rows.remote()
    }

    fn pushes_every_step(&self) -> bool {
        self.rows.pushes_every_step()
    }
}

impl<'m, S: Strategy<'m>, R: RowHome> Strategy<'m> for Sparse<S, R> {
    fn ranks(&self) -> (usize, usize) {
        self.inner.ranks()
    }
    fn reports(&self) -> bool {
        self.inner.reports()
    }
    fn data_shard(&self) -> (usize, usize) {
        self.inner.data_shard()
    }
    fn agrees(&self) -> bool {
        self.inner.agrees()
    }
    fn replica(&self) -> &Replica<'m> {
        self.inner.replica()
    }
    fn into_replica(self) -> Replica<'m> {
        self.inner.into_replica()
    }

    /// The chief starts the rows first (from the checkpoint the mode restores), so that
    /// no rank pulls a row before its home is set up: the others leave the mode's start
    /// only after the chief entered it.
    fn start(
        &mut self,
        dir: Option<&Path>,
        events: &mut dyn FnMut(&Event),
    ) -> Result<Started, TrainError> {
        let newest = match (dir, self.inner.reports()) {
            (Some(dir), true) => {
                checkpoint::prepare_dir(dir)?;
                checkpoint::latest(dir).0.map(|f| (f.step, f.path))
            }
            _ => None,
        };
        if self.inner.reports() {
            self.rows.start(newest.as_ref().map(|n| n.1.as_path()))?;
        }
        let started = self.inner.start(dir, events)?;
        if let Some((_, path)) = newest.filter(|n| started.restored != Some(n.0)) {
            return Err(TrainError::Setup(format!(
                "the tables were restored from {} but the dense parameters from step {:?}: \
                 the checkpoint directory changed during the start",
                path.display(),
                started.restored
            )));
        }
        Ok(started)
    }

    fn gradients(
        &mut self,
        step: u64,
        x: &[f32],
        y: Targets<'_>,
        word: StepWord,
        clock: &mut Clock,
        events: &mut dyn FnMut(&Event),
    ) -> Result<StepWord, TrainError> {
        self.inner.gradients(step, x, y, word, clock, events)
    }
    fn pending(&self) -> &[Tensor] {
        self.inner.pending()
    }
    fn apply(&mut self, step: u64) -> Result<u64, TrainError> {
        self.inner.apply(step)
    }
    fn after_step(&mut self, done: u64) -> Result<(), TrainError> {
        self.inner.after_step(done)
    }
    fn state(&mut self, step: u64) -> Result<State, TrainError> {
        self.inner.state(step)
    }

    /// One checkpoint of both: the chief writes the dense state, the rows' home writes
    /// the rows, and the chief commits the manifest over every file. The other ranks wait
    /// for it (no rank pushes the next step's rows into the checkpoint meanwhile) and learn
    /// whether it failed.
    fn checkpoint(
        &mut self,
        dir: &Path,
        step: u64,
        keep: usize,
        events: &mut dyn FnMut(&Event),
    ) -> Result<PathBuf, TrainError> {
        let written = match self.inner.reports() {
            true => self.write_checkpoint(dir, step, keep, events),
            false => Ok(checkpoint::path_of(dir, step)),
        };
        let mut failed = [f64::from(u8::from(written.is_err()))];
        self.inner.sum(&mut failed)?;
        match written {
            Ok(_) if failed[0] > 0.0 => Err(TrainError::Agreed(format!(
                "the chief's checkpoint of step {step} in {} failed",
                dir.display()
            ))),
            written => written,
        }
    }

    fn sum(&mut self, values: &mut [f64]) -> Result<(), TrainError> {
        self.inner.sum(values)
    }
    fn evaluation_ranks(&self) -> (usize, usize) {
        self.inner.evaluation_ranks()
    }
    fn evaluate(&mut self, data: &Dataset) -> Result<(usize, usize), TrainError> {
        self.inner.evaluate(data)
    }
    fn save_params(&mut self, path: &Path, step: u64) -> Result<(), TrainError> {
        self.inner.save_params(path, step)
    }
    fn window(
        &mut self,
        step: u64,
        clock: &mut Clock,
    ) -> Result<(Times, Vec<RankTimes>), TrainError> {
        self.inner.window(step, clock)
    }
    fn communicates(&self) -> bool {
        self.inner.communicates()
    }
    fn reported_loss(&self) -> Option<f32> {
        self.inner.reported_loss()
    }
    fn end(&mut self, how: End<'_>) -> Result<(), TrainError> {
        let rows = self.rows.end(&how);
        let inner = self.inner.end(how);
        inner.and(rows)
    }
}

/// The file of a checkpoint that holds the rows of tables kept in one process.
pub const TABLES_FILE: &str = "tables.bin";

/// Tables whose rows are in this process (local training).
pub struct LocalRows {
    specs: Vec<TableSpec>,
    tables: RefCell<Vec<Table>>,
    served: RefCell<Vec<Served>>,
    /// The memory this process may use (rows beyond it fail the step that made them).
    memory: Option<Share>,
}

impl LocalRows {
    /// `specs`' tables, their rows made from `seed` and updated by `opt`.
    pub fn new(specs: &[TableSpec], seed: u64, opt: SparseOptimizer) -> LocalRows {
        LocalRows {
            specs: specs.to_vec(),
            tables: RefCell::new(
                specs
                    .iter()
                    .map(|s| Table::new(s.clone(), seed, opt))
                    .collect(),
            ),
            served: RefCell::new(vec![Served::default(); specs.len()]),
            memory: None,
        }
    }

    /// These tables within `memory` (with the dense state's `dense` bytes): a step whose
    /// rows outgrow it fails, naming the table.
    pub fn within(mut self, memory: Option<Share>, dense: u64) -> LocalRows {
        self.memory = memory.map(|m| Share {
            bytes: m.bytes.saturating_sub(dense),
            why: m.why,
        });
        self
    }

    /// Why the rows outgrew the memory, table `table`'s request having grown them.
    fn room(&self, tables: &[Table], table: usize) -> Result<(), TrainError> {
        let held = tables.iter().map(|t| t.bytes() as u64).sum();
        outgrew(&"this process", &tables[table], held, self.memory.as_ref())
            .map_err(TrainError::Usage)
    }

    /// The rows each table holds.
    pub fn rows_held(&self) -> Vec<usize> {
        self.tables.borrow().iter().map(Table::len).collect()
    }

    fn table_error(&self, table: usize) -> TrainError {
        TrainError::Usage(format!(
            "no embedding table {table} (the model has {})",
            self.specs.len()
        ))
    }
}

/// Rows in this process: each rank's gradient applied whole.
impl Tables for LocalRows {
    fn table_specs(&self) -> &[TableSpec] {
        &self.specs
    }

    fn pull_tables(
        &self,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
        make: bool,
    ) -> Result<(), TrainError> {
        let mut tables = self.tables.borrow_mut();
        for ((table, ids), out) in want.iter().zip(out.iter_mut()) {
            let t = tables
                .get_mut(*table)
                .ok_or_else(|| self.table_error(*table))?;
            let done = match make {
                true => t.pull_into(ids, out),
                false => t.read_into(ids, out),
            };
            done.map_err(|e| TrainError::Usage(e.to_string()))?;
            if make {
                let served = &mut self.served.borrow_mut()[*table];
                served.pulls += 1;
                served.rows_pulled += ids.len() as u64;
                self.room(&tables, *table)?;
            }
        }
        Ok(())
    }

    fn push_tables(&self, grads: &[(usize, &SparseGrad)], scale: f32) -> Result<(), TrainError> {
        let mut tables = self.tables.borrow_mut();
        for (table, grad) in grads {
            let t = tables
                .get_mut(*table)
                .ok_or_else(|| self.table_error(*table))?;
            t.apply(grad, scale)
                .map_err(|e| TrainError::Usage(e.to_string()))?;
            let served = &mut self.served.borrow_mut()[*table];
            served.pushes += 1;
            served.rows_pushed += grad.ids.len() as u64;
        }
        Ok(())
    }

    fn remote(&self) -> bool {
        false
    }

    fn rows_report(&self) -> Result<Vec<RowsReport>, TrainError> {
        let (tables, served) = (self.tables.borrow(), self.served.borrow());
        Ok(vec![RowsReport {
            task: "local".into(),
            tables: served
                .iter()
                .zip(tables.iter())
                .map(|(s, t)| s.report(t))
                .collect(),
        }])
    }

    fn push_scale(&self) -> f32 {
        1.0
    }
}

impl RowHome for LocalRows {
    fn start(&mut self, restore: Option<&Path>) -> Result<(), TrainError> {
        let Some(path) = restore else {
            return Ok(());
        };
        let (_, files) = checkpoint::open(path)?;
        let mut tables = self.tables.borrow().clone();
        checkpoint::tables::restore_rows(&mut tables, &files, |_| true).map_err(|why| {
            checkpoint::CheckpointError::Corrupt {
                path: path.display().to_string(),
                why,
            }
        })?;
        *self.tables.borrow_mut() = tables;
        Ok(())
    }

    fn save(&mut self, dir: &Path) -> Result<Vec<(String, u64, u64)>, TrainError> {
        let arrays = checkpoint::Arrays {
            step: 0,
            meta: serde_json::json!({}),
            arrays: checkpoint::tables::table_arrays(&self.tables.borrow()),
        };
        let (bytes, sum) = checkpoint::write_file(&dir.join(TABLES_FILE), &arrays)?;
        Ok(vec![(TABLES_FILE.to_string(), bytes, sum)])
    }
}
