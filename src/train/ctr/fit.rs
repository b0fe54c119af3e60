//! A click model trained in any mode whose strategy holds its embedding tables
//! ([`Tables`]: the ps mode, hybrid, local with [`crate::train::tables::LocalRows`]).
//!
//! Each step takes this rank's share of the global batch, pulls the rows it names (each
//! id once; with the last step's push where it can, or ahead of the last step's
//! gradients, see [`fit`]), computes the loss and
//! both gradients, pushes the rows' sparse gradient and
//! hands the dense gradients to the session ([`External::run`]): the step loop does the
//! rest as for any model (the mode's update, the guard, logs, checkpoints of the dense
//! state and the rows, signals). A step that cannot be made on one rank (a bad id, a ps
//! gone) fails on every rank, through the session.

use std::time::Instant;

use super::metrics::ScoreCounts;
use super::{CtrBatch, CtrData};
use crate::model::dlrm::{Dlrm, DlrmScratch, Lookup};
use crate::model::embedding::{copy_row, SparseGrad, TableSpec};
use crate::model::External;
use crate::observe::phases::Phase;
use crate::observe::stall::{self, Wait, Waiting};
use crate::tensor::Tensor;
use crate::train::data::{self, Batches};
use crate::train::engine::{Session, Strategy, TrainError};
use crate::train::events::Event;
use crate::train::tables::Tables;

/// Score buckets of an evaluation's AUC ([`ScoreCounts`]).
const BUCKETS: usize = 10_000;
/// Samples per pass of an evaluation.
const EVAL_BATCH: usize = 4096;

/// What [`fit`] trains and how.
pub struct CtrFit<'d> {
    pub model: &'d Dlrm,
    /// The dense parameters the session's strategy trains: `model.dense_model(seed)`.
    pub dense: &'d External,
    /// Global batch.
    pub batch: usize,
    /// The batches' order.
    pub seed: u64,
    /// Evaluate on the held-out samples every this many steps (0: only at the end).
    pub eval_every: u64,
    /// Whether the next step's rows that this step's push does not touch are asked for
    /// before the step computes, where the strategy's rows can be ([`Tables::pulls_ahead`]).
    pub rows_ahead: RowsAhead,
}

/// Whether a step asks for the next step's rows ahead of its gradients (those its push
/// does not touch; the others come with the push, after it): their homes serve them
/// while the step computes. With one worker training is the same either way; with
/// several, rows asked ahead may miss the other workers' pushes of the step, as
/// asynchronous rows may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowsAhead {
    /// Where every rank of the machine has a CPU of its own
    /// ([`crate::transport::comm::cpu_each`]): a ps that serves rows while a worker
    /// computes on a shared CPU takes the time from it, and each extra request waits for
    /// the ps to be scheduled.
    #[default]
    Auto,
    On,
    Off,
}

impl RowsAhead {
    /// Whether rows are asked for ahead on this rank.
    pub fn on(self) -> bool {
        match self {
            RowsAhead::Auto => crate::transport::comm::cpu_each(),
            RowsAhead::On => true,
            RowsAhead::Off => false,
        }
    }
}

/// An evaluation on held-out samples, the same on every rank that evaluates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CtrEvaluation {
    /// The global step of the parameters evaluated.
    pub step: u64,
    /// `None` where the samples were all of one kind.
    pub auc: Option<f64>,
    pub logloss: f64,
    pub total: usize,
}

/// A step's buffers, kept from step to step.
#[derive(Default)]
struct Work {
    batch: CtrBatch,
    lookups: Vec<Lookup>,
    grads: Vec<Tensor>,
    sparse: Vec<SparseGrad>,
    ws: DlrmScratch,
    /// The next step's batch and its rows, pulled with this step's push (those this
    /// step's batch lacks asked for ahead of its gradients, where they are).
    next: CtrBatch,
    next_lookups: Vec<Lookup>,
    /// The global step whose batch and rows `next` holds, if any.
    ahead: Option<u64>,
    /// The next step's rows in two parts (see [`NextRows`]).
    parts: NextRows,
}

/// The next step's distinct ids of each table in two parts: those this step's batch has
/// too (`again`, pulled with this step's push, after it) and the others (`fresh`, pulled
/// ahead while this step computes), with their rows; `known[t][i]`: the next step's `i`th
/// id of table `t` is among this step's.
#[derive(Default)]
struct NextRows {
    known: Vec<Vec<bool>>,
    again: Vec<Vec<u64>>,
    fresh: Vec<Vec<u64>>,
    again_rows: Vec<Vec<f32>>,
    fresh_rows: Vec<Vec<f32>>,
}

impl NextRows {
    /// The parts of `next`'s ids against `now`'s (the same tables).
    fn split(&mut self, now: &[Lookup], next: &[Lookup]) {
        let n = next.len();
        for v in [&mut self.again, &mut self.fresh] {
            v.resize_with(n, Vec::new);
        }
        self.known.resize_with(n, Vec::new);
        self.again_rows.resize_with(n, Vec::new);
        self.fresh_rows.resize_with(n, Vec::new);
        for (t, (now, next)) in now.iter().zip(next).enumerate() {
            next.unique.marks_in(&now.unique, &mut self.known[t]);
            let (again, fresh) = (&mut self.again[t], &mut self.fresh[t]);
            again.clear();
            fresh.clear();
            for (id, known) in next.unique.ids.iter().zip(&self.known[t]) {
                match known {
                    true => again.push(*id),
                    false => fresh.push(*id),
                }
            }
        }
    }

    /// Each table and its ids of one part.
    fn want(part: &[Vec<u64>]) -> Vec<(usize, &[u64])> {
        part.iter()
            .enumerate()
            .map(|(t, ids)| (t, &ids[..]))
            .collect()
    }

    /// Both parts' rows, arrived, into each of `next`'s lookups (tables `specs`) in the
    /// order of its ids.
    fn join(&self, next: &mut [Lookup], specs: &[TableSpec]) {
        for (t, (l, spec)) in next.iter_mut().zip(specs).enumerate() {
            let dim = spec.dim.max(1);
            l.rows.resize(l.unique.ids.len() * spec.dim, 0.0);
            let (mut again, mut fresh) = (
                self.again_rows[t].chunks_exact(dim),
                self.fresh_rows[t].chunks_exact(dim),
            );
            for (row, known) in l.rows.chunks_exact_mut(dim).zip(&self.known[t]) {
                let from = match known {
                    true => again.next(),
                    false => fresh.next(),
                };
                copy_row(row, from.expect("a row per id"));
            }
        }
    }
}

/// Trains in `sess` on `train` until the session stops, evaluating on `test` as `run`
/// says and at the end (after the last checkpoint, so that it is what was evaluated).
/// Returns the last evaluation where this rank evaluates.
///
/// Where the global step goes one by one (every mode but the asynchronous ps with other
/// workers), a step's push of its rows' gradient also pulls the next step's rows (one
/// round trip to each ps per step, not two): those rows hold every update their ps had
/// applied by then, this rank's own included. Where rows are asked for ahead
/// ([`RowsAhead`]), the push pulls only the next step's rows that this step's batch has
/// too (those its push changes); the others are asked for before the step computes, and
/// the ps tasks serve them meanwhile.
pub fn fit<'m, S: Strategy<'m> + Tables>(
    sess: &mut Session<'m, '_, S>,
    run: &CtrFit<'_>,
    train: &dyn CtrData,
    test: &dyn CtrData,
) -> Result<Option<CtrEvaluation>, TrainError> {
    let mut batches = Batches::new(train.len(), run.batch, run.seed);
    let mut work = Work {
        grads: crate::model::zeros_like(&sess.replica().params),
        ..Work::default()
    };
    let (mut last, mut steady) = (None, true);
    let rows_ahead = run.rows_ahead.on();
    while !sess.should_stop() {
        let prev = sess.global_step();
        let (n, i) = sess.data_shard();
        let global = batches.global(prev);
        let mine = data::shard(global, i, n);
        // This rank's share of the update: its samples over the global batch's.
        let share = (mine.len() * n) as f32 / global.len().max(1) as f32;
        let ready = work.ahead == Some(prev);
        if ready {
            std::mem::swap(&mut work.batch, &mut work.next);
            std::mem::swap(&mut work.lookups, &mut work.next_lookups);
        } else {
            train.batch_into(mine, &mut work.batch);
        }
        // The step after this one, if it can be told now.
        let next = steady.then_some(prev + 1);
        if let Some(s) = next {
            train.batch_into(data::shard(batches.global(s), i, n), &mut work.next);
        }
        let ahead = next.filter(|_| rows_ahead && sess.strategy().pulls_ahead());
        let plan = (share, ready, next, ahead.is_some());
        let (loss, times, pulled) = match step(sess, run.model, plan, &mut work) {
            Ok(done) => done,
            Err(Unmade { why, pushed }) => {
                if !pushed {
                    // The others' rows step must not wait for this rank's push: an empty
                    // one, then the step fails on every rank through the session.
                    let _ = push_nothing(sess.strategy());
                }
                return Err(run.dense.refuse(sess, why));
            }
        };
        let now = Instant::now();
        let rows = match sess.strategy().remote() {
            true => Phase::Comm,
            false => Phase::Compute,
        };
        sess.charge(rows, times[0], times[1], "pull rows");
        sess.charge(Phase::Compute, times[1], times[2], "gradients");
        sess.charge(rows, times[2], now, "push rows");
        let grads = (work.grads.iter())
            .map(Tensor::as_slice::<f32>)
            .collect::<Result<Vec<_>, _>>()?;
        run.dense.run(sess, &grads, loss, work.batch.len())?;
        steady = sess.global_step() == prev + 1;
        work.ahead = next.filter(|s| pulled && *s == sess.global_step());
        let every = run.eval_every;
        if every > 0 && sess.global_step() / every > prev / every && sess.evaluates() {
            last = Some(evaluate(sess, run.model, test)?);
        }
    }
    sess.save()?;
    if sess.evaluates() && last.is_none_or(|e| e.step != sess.global_step()) {
        last = Some(evaluate(sess, run.model, test)?);
    }
    if sess.is_chief() {
        let reports = sess.strategy().rows_report()?;
        let step = sess.global_step();
        sess.report(&Event::Rows { step, reports });
    }
    Ok(last.filter(|_| sess.evaluates()))
}

/// The phases of a step before the dense update: when the pull, the gradients and the
/// push began (each ends where the next begins, the push now).
type Began = [Instant; 3];

/// Why a step cannot be made on this rank, and whether its push was made (or tried).
struct Unmade {
    why: String,
    pushed: bool,
}

/// Where a step's rows wait for every rank's push ([`Tables::pushes_every_step`]), an
/// empty push from this rank: the others' step goes on without its rows.
fn push_nothing<T: Tables + ?Sized>(tables: &T) -> Result<(), TrainError> {
    match tables.pushes_every_step() {
        true => tables.push_tables(&[], 0.0),
        false => Ok(()),
    }
}

/// An error before this rank's push.
fn before_push(e: impl std::fmt::Display) -> Unmade {
    Unmade {
        why: e.to_string(),
        pushed: false,
    }
}

/// An error of this rank's push.
fn of_push(e: impl std::fmt::Display) -> Unmade {
    Unmade {
        why: e.to_string(),
        pushed: true,
    }
}

/// This rank's part of a step up to the dense update: rows pulled (unless `ready`: pulled
/// with the last step's push), gradients computed, the sparse ones pushed (scaled by the
/// rank's `share`), with the rows of `w.next`'s batch if there is a `next` step (those
/// this batch does not have asked for `ahead` of the gradients, where the plan says so);
/// the loss, when each part began and whether the next step's rows were pulled, or why the
/// step cannot be made here.
fn step<'m, S: Strategy<'m> + Tables>(
    sess: &Session<'m, '_, S>,
    model: &Dlrm,
    (share, ready, next, ahead): (f32, bool, Option<u64>, bool),
    w: &mut Work,
) -> Result<(f32, Began, bool), Unmade> {
    let tables = sess.strategy();
    let pulled = Instant::now();
    let step = sess.global_step();
    if !ready {
        model
            .lookups_into(&w.batch, &mut w.lookups)
            .map_err(before_push)?;
        let _wait = rows_wait(tables, "rows pull", step);
        pull_lookups(tables, &mut w.lookups, true).map_err(before_push)?;
    }
    if ahead {
        model
            .lookups_into(&w.next, &mut w.next_lookups)
            .map_err(before_push)?;
        w.parts.split(&w.lookups, &w.next_lookups);
        let _wait = rows_wait(tables, "rows pull ahead", step);
        (tables.pull_ahead(&NextRows::want(&w.parts.fresh))).map_err(before_push)?;
    }
    let computed = Instant::now();
    let params = &sess.replica().params;
    let loss = model
        .loss_and_gradients(
            params,
            &w.batch,
            &w.lookups,
            &mut w.grads,
            &mut w.sparse,
            &mut w.ws,
        )
        .map_err(before_push)?;
    // A row gradient that is not finite is never pushed; the dense step's guard sees the
    // loss (a finite loss with such gradients is this rank's own failure).
    let pushed = Instant::now();
    let began = [pulled, computed, pushed];
    let spec = tables.table_specs();
    if let Some(t) = (w.sparse.iter()).position(|g| g.values.iter().any(|v| !v.is_finite())) {
        if loss.is_finite() {
            let why = format!("table {}'s gradient is not finite", spec[t].name);
            return Err(before_push(why));
        }
        // The others' step is applied without this one's rows; the guard then stops
        // every rank on the loss.
        push_nothing(tables).map_err(of_push)?;
        return Ok((loss, began, false));
    }
    let scale = tables.push_scale() * share;
    let grads: Vec<(usize, &SparseGrad)> = w.sparse.iter().enumerate().collect();
    if next.is_none() {
        let _wait = rows_wait(tables, "rows push", step);
        tables.push_tables(&grads, scale).map_err(of_push)?;
        return Ok((loss, began, false));
    }
    let _wait = rows_wait(tables, "rows push and pull", step);
    if ahead {
        let p = &mut w.parts;
        (tables.land_tables(&NextRows::want(&p.fresh), &mut p.fresh_rows)).map_err(before_push)?;
        let again = NextRows::want(&p.again);
        (tables.push_pull_tables(&grads, scale, &again, &mut p.again_rows)).map_err(of_push)?;
        p.join(&mut w.next_lookups, spec);
        return Ok((loss, began, true));
    }
    model
        .lookups_into(&w.next, &mut w.next_lookups)
        .map_err(before_push)?;
    with_rows(&mut w.next_lookups, |want, rows| {
        tables.push_pull_tables(&grads, scale, want, rows)
    })
    .map_err(of_push)?;
    Ok((loss, began, true))
}

/// Marks a wait of `op` on the rows' homes at global step `step`, where they are other
/// tasks (for stall reports).
fn rows_wait<T: Tables>(tables: &T, op: &'static str, step: u64) -> Option<Waiting<'static>> {
    tables.remote().then(|| {
        stall::wait(|| Wait {
            op,
            step,
            what: None,
            peer: None,
            bytes: 0,
        })
    })
}

/// `fetch(want, rows)` of every lookup's rows (`want`: each table and its unique ids),
/// into the lookups.
fn with_rows(
    lookups: &mut [Lookup],
    fetch: impl FnOnce(&[(usize, &[u64])], &mut [Vec<f32>]) -> Result<(), TrainError>,
) -> Result<(), TrainError> {
    let mut rows: Vec<Vec<f32>> = (lookups.iter_mut())
        .map(|l| std::mem::take(&mut l.rows))
        .collect();
    let want: Vec<(usize, &[u64])> = (lookups.iter().enumerate())
        .map(|(t, l)| (t, &l.unique.ids[..]))
        .collect();
    let fetched = fetch(&want, &mut rows);
    drop(want);
    for (l, r) in lookups.iter_mut().zip(rows) {
        l.rows = r;
    }
    fetched
}

/// Every lookup's rows, from one pull of all the tables (`make`: rows made where new).
fn pull_lookups<T: Tables>(
    tables: &T,
    lookups: &mut [Lookup],
    make: bool,
) -> Result<(), TrainError> {
    with_rows(lookups, |want, rows| tables.pull_tables(want, rows, make))
}

/// Evaluates the current parameters and rows on `test` (each rank that evaluates its
/// share, the counts summed); the chief reports it ([`Event::Auc`]). Every rank that
/// evaluates ([`Session::evaluates`]) calls it.
pub fn evaluate<'m, S: Strategy<'m> + Tables>(
    sess: &mut Session<'m, '_, S>,
    model: &Dlrm,
    test: &dyn CtrData,
) -> Result<CtrEvaluation, TrainError> {
    let (n, i) = sess.evaluation_ranks();
    let rows = i * test.len() / n..(i + 1) * test.len() / n;
    let mut counts = ScoreCounts::new(BUCKETS);
    let (mut batch, mut lookups, mut ws) =
        (CtrBatch::default(), Vec::new(), DlrmScratch::default());
    let idx: Vec<usize> = rows.collect();
    for part in idx.chunks(EVAL_BATCH) {
        test.batch_into(part, &mut batch);
        model.lookups_into(&batch, &mut lookups)?;
        pull_lookups(sess.strategy(), &mut lookups, false)?;
        let logits = model.logits(&sess.replica().params, &batch, &lookups, &mut ws)?;
        counts.add(&logits, &batch.labels);
    }
    sess.sum(counts.values_mut())?;
    let eval = CtrEvaluation {
        step: sess.global_step(),
        auc: counts.auc(),
        logloss: counts.logloss(),
        total: counts.total(),
    };
    if sess.is_chief() {
        sess.report(&Event::Auc {
            auc: eval.auc.unwrap_or(f64::NAN),
            logloss: eval.logloss,
            total: eval.total,
            step: eval.step,
        });
    }
    Ok(eval)
}
