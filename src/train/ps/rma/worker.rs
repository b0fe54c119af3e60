//! The worker side of one-sided training, the [`OneSided`] strategy of the step loop:
//! pull by `MPI_Get`, compute, push by `MPI_Accumulate`; the chief asks the ps tasks for
//! their checkpoint shards and commits the manifest.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::rows::RmaRows;
use super::*;
use crate::model::embedding::{SparseGrad, TableSpec};
use crate::model::Targets;
use crate::train::checkpoint::{self, State};
use crate::train::engine::{self, End, Started, StepWord, Strategy, TrainError};
use crate::train::sidecar::EndNotice;
use crate::train::tables::{RowHome, RowsReport, Tables};

/// A worker of one-sided ps training: the ps tasks' windows hold the parameters (and,
/// synchronous, apply the update); this worker gets them, computes its gradient and
/// accumulates it there.
pub struct OneSided<'a, C: Comm, D: Access<f32>, K: Access<i64>> {
    rma: &'a Rma<'a>,
    data: &'a D,
    ctl: &'a K,
    /// This worker's index among the workers (0: the chief).
    w: usize,
    replica: Replica<'a>,
    grads: Vec<Tensor>,
    towers: crate::model::towers::Towers,
    /// The chief's notes for the start (placement, restore, the one-sided path).
    notes: Vec<Event>,
    /// The step of the checkpoint the ps tasks restored, if any.
    restored: Option<u64>,
    /// Asynchronous: the global step this worker's last update counted as, and whether
    /// it skipped it (the last step passed, or a stop announced).
    claimed: (u64, bool),
    /// Asynchronous: the global step this worker last reported its times at; it told
    /// ps 0 it is done.
    reported: u64,
    done: bool,
    /// The chief: every rank's phase-time counters when last read.
    seen: Vec<[i64; TIME_FIELDS]>,
    /// Bytes a pull or a push moves, and with whom (for the timeline).
    moved: (usize, Arc<str>),
    /// The chief's notice to side-car evaluators, sent when the strategy is dropped.
    _end: Option<EndNotice<'a, C>>,
    /// The model's embedding rows, in the ps tasks' windows beside the shards.
    rows: Option<RmaRows<'a, D, K>>,
}

impl<'a, C: Comm, D: Access<f32>, K: Access<i64>> OneSided<'a, C, D, K> {
    /// Worker `w` of `rma`'s training over the locked windows `data` and `ctl`, from
    /// `replica`'s parameters (the ps tasks' are pulled at start).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        rma: &'a Rma<'a>,
        w: usize,
        replica: Replica<'a>,
        (data, ctl): (&'a D, &'a K),
        notes: Vec<Event>,
        restored: Option<u64>,
        end: Option<EndNotice<'a, C>>,
    ) -> Self {
        let chief = w == 0;
        OneSided {
            grads: replica.zeros_like(),
            towers: crate::model::towers::Towers::new(rma.cfg.train.towers),
            rma,
            data,
            ctl,
            w,
            replica,
            notes: if chief { notes } else { Vec::new() },
            restored,
            claimed: (0, false),
            reported: 0,
            done: false,
            seen: vec![[0; TIME_FIELDS]; if chief { rma.ranks } else { 0 }],
            moved: rma.moved(),
            _end: end,
            rows: None,
        }
    }

    /// This worker with the model's embedding rows reached through `rows`.
    pub(super) fn with_rows(self, rows: RmaRows<'a, D, K>) -> Self {
        OneSided {
            rows: Some(rows),
            ..self
        }
    }

    /// The rows, or why there are none.
    fn rows(&self) -> Result<&RmaRows<'a, D, K>, TrainError> {
        self.rows.as_ref().ok_or_else(|| {
            TrainError::Setup("this one-sided ps training holds no embedding tables".into())
        })
    }

    fn me(&self) -> String {
        self.rma.roles.task(self.rma.roles.workers[self.w])
    }

    fn ps0(&self) -> usize {
        self.rma.roles.ps[0]
    }

    /// This worker's gradients of `x`, `y` and their loss.
    fn compute(&mut self, x: &[f32], y: Targets<'_>) -> Result<f32, TrainError> {
        self.towers
            .gradients_into(&self.replica, x, y, &mut self.grads)
            .map_err(|e| PsError::Setup(format!("{}: {e}", self.me())).into())
    }

    /// Scales the gradients by `by`, in place.
    fn scale(&mut self, by: f32) {
        for g in &mut self.grads {
            let g = g.as_mut_slice::<f32>().expect("f32 gradients");
            g.iter_mut().for_each(|v| *v *= by);
        }
    }

    /// Accumulates the gradients into every ps's window (synchronous: into the gradient
    /// sums, with `tail`, the loss and sample sums; asynchronous: into the parameters).
    fn push(&self, tail: Option<[f32; 2]>) -> Result<(), PsError> {
        let (rma, roles) = (self.rma, self.rma.roles);
        let sync = tail.is_some();
        let grads = slices(&self.grads, rma.pieces).into_iter().map(|(p, g)| {
            let at = if sync { rma.held[p.ps] + p.at } else { p.at };
            (roles.ps[p.ps], at, g)
        });
        let tails = tail.iter().flat_map(|t| {
            let held = &rma.held;
            (roles.ps.iter().enumerate()).map(move |(k, r)| (*r, 2 * held[k], &t[..]))
        });
        Ok(self.data.accumulates(grads.chain(tails))?)
    }

    /// Gets every shard straight into the model's tensors (one `MPI_Get` each).
    fn pull(&mut self) -> Result<(), PsError> {
        let targets = slices_mut(&mut self.replica.params, self.rma.pieces);
        let ps = &self.rma.roles.ps;
        let ops = targets.into_iter().map(|(p, dst)| (ps[p.ps], p.at, dst));
        Ok(self.data.gets(ops)?)
    }

    /// Synchronous: waits until every ps published step `step` (the update of the step
    /// before); returns the stop announced with it (a signal, or [`HOOK`]), if any.
    fn published(&self, step: u64) -> Result<Option<i64>, PsError> {
        let (rma, ctl) = (self.rma, self.ctl);
        let roles = rma.roles;
        let me = self.me();
        let mut stop = None;
        for (k, r) in roles.ps.iter().enumerate() {
            // ps k's step, unless it stopped: the step before was not applied (see the
            // module's rule), or a worker was lost.
            let verdict = |published: i64, abort: i64| match abort {
                0 => Ok(published),
                found if found < 0 => Err(not_applied(step - 1, -found, roles.workers.len())),
                late if late > ENDED => Err(PsError::Remote {
                    task: me.clone(),
                    message: format!(
                        "{}: {} ended at step {} (its error says why)",
                        rma.ps_task(k),
                        roles.task(roles.workers[(late - ENDED - 1) as usize]),
                        step - 1
                    ),
                }),
                late => Err(PsError::Remote {
                    task: me.clone(),
                    message: rma
                        .lost(
                            rma.ps_task(k),
                            roles.task(roles.workers[(late - 1) as usize]),
                        )
                        .to_string(),
                }),
            };
            // The update of the step before (the one whose pushes ps k gathers).
            let _wait = rma.waiting("pull", step - 1, k);
            let v = wait_alive(
                ctl,
                rma.cfg.peer_timeout * 2,
                || {
                    // STEP, ABORT and SAVED (a ps writing a checkpoint counts it down: a
                    // sign of life) in one atomic read.
                    let mut v = [0i64; SAVED + 1];
                    ctl.read_atomic(*r, STEP, &mut v)?;
                    Ok((verdict(v[STEP], v[ABORT])?, v[SAVED]))
                },
                |v| v % MARK >= step as i64,
                || rma.lost(me.clone(), rma.ps_task(k)),
            )?;
            stop = stop.or((v >= MARK).then_some(v / MARK));
        }
        Ok(stop)
    }

    /// Tells every ps the stop this worker's `word` asks for (a signal it noted, a hook's
    /// request), before its push counts: every ps reads it once the step is in.
    fn ask_stop(&self, word: &StepWord) -> Result<(), PsError> {
        let code = match (word.stop_signal(), word.stop_asked()) {
            (Some(signal), _) => i64::from(signal),
            (None, true) => HOOK,
            (None, false) => return Ok(()),
        };
        for r in &self.rma.roles.ps {
            self.ctl.compare_and_swap(*r, STOP, 0, code)?;
        }
        Ok(())
    }

    /// Synchronous step `step`: push this worker's gradient, scaled by its samples, with
    /// its loss; count the push; wait for the update; pull it.
    fn sync_step(
        &mut self,
        step: u64,
        (x, y): (&[f32], Targets<'_>),
        word: StepWord,
        clock: &mut Clock,
    ) -> Result<StepWord, TrainError> {
        let (rma, ctl) = (self.rma, self.ctl);
        let t = Instant::now();
        let loss = self.compute(x, y)?;
        // Pushed all the same, and counted on every ps (see the module's rule).
        let found = crate::train::guard::check_step(step, loss, &self.grads);
        let found = super::super::non_finite_rule(found, true, || self.me())?;
        let rows = y.rows(self.replica.model.classes());
        let n = rows as f32;
        // In place: the ps divides the sum by the samples.
        self.scale(n);
        let t = clock.since_as(Phase::Compute, t, "gradients", Detail::at(step));
        self.push(Some([loss * n, n]))?;
        self.ask_stop(&word)?;
        let (bytes, peer) = self.moved.clone();
        let t = clock.since_as(Phase::Comm, t, "push", Detail::moved(step, bytes, &peer));
        // The window ends with the step before a logged one, added before this push
        // counts (the chief reads once the step is published).
        let every = rma.cfg.train.log_every;
        if every > 0 && (step + 1).is_multiple_of(every) {
            rma.report_times(ctl, rma.roles.workers[self.w], &clock.take())?;
        }
        for r in &rma.roles.ps {
            // Ordered before the count (same origin and target: accumulate order).
            if let Some(found) = &found {
                ctl.fetch_and_add(*r, NON_FINITE, non_finite_code(found))?;
            }
            ctl.fetch_and_add(*r, PUSHES + self.w, 1)?;
            ctl.fetch_and_add(*r, ARRIVALS, 1)?;
        }
        let stop = self.published(step + 1)?;
        let t = clock.since_as(Phase::Wait, t, "wait", Detail::at(step));
        self.pull()?;
        clock.since_as(Phase::Comm, t, "pull", Detail::moved(step, bytes, &peer));
        // The combined batch's loss and samples, from ps 0.
        let (combined, samples) = loss_of(ctl.fetch_and_add(self.ps0(), LOSS, 0)?);
        let said = match stop {
            Some(HOOK) => StepWord::asking(None, true),
            Some(signal) => StepWord::asking(Some(signal as i32), false),
            None => StepWord::default(),
        };
        Ok(said.with_loss(combined, samples))
    }

    /// Asynchronous: claims the next global step on ps 0 and, unless the last step is
    /// passed or a stop announced, accumulates `-lr x gradient` into the parameters (plain
    /// SGD applied by `MPI_Accumulate`), then gets the newest for the next step.
    fn async_step(
        &mut self,
        step: u64,
        (x, y): (&[f32], Targets<'_>),
        word: StepWord,
        clock: &mut Clock,
    ) -> Result<StepWord, TrainError> {
        let (rma, ctl, ps0) = (self.rma, self.ctl, self.ps0());
        let t = Instant::now();
        let v = ctl.fetch_and_add(ps0, STEP, 1)?;
        let s = (v % MARK) as u64;
        let t = clock.since_as(Phase::Comm, t, "claim", Detail::at(s));
        let signal = match v >= MARK {
            true => Some(ctl.fetch_and_add(ps0, STOP, 0)? as i32),
            false => None,
        };
        self.claimed = (s, signal.is_some() || s >= rma.cfg.train.steps);
        if self.claimed.1 {
            return Ok(StepWord::asking(signal, false));
        }
        let (bytes, peer) = self.moved.clone();
        // On the parameters pulled after this worker's last push (or at the start): an
        // external model's gradients were computed on them before this step began.
        let loss = self.compute(x, y)?;
        let found = crate::train::guard::check_step(s, loss, &self.grads);
        if found.is_err() {
            later_finder_waits(ctl.compare_and_swap(ps0, NON_FINITE, 0, 1)?);
        }
        super::super::non_finite_rule(found, false, || self.me())?;
        // (s is the global step this update counts as: the decay's update s + 1.)
        self.scale(-rma.cfg.train.optimizer.lr_at(s + 1));
        let t = clock.since_as(Phase::Compute, t, "gradients", Detail::at(s));
        self.push(None)?;
        if let Some(signal) = word.stop_signal() {
            // Every worker's next claim sees it (this one's too).
            super::serve::announce_async_stop(ctl, ps0, signal)?;
        }
        let t = clock.since_as(Phase::Comm, t, "push", Detail::moved(s, bytes, &peer));
        // The newest parameters, this push's included, for the next step.
        self.pull()?;
        clock.since_as(Phase::Comm, t, "pull", Detail::moved(s, bytes, &peer));
        // At the first step claimed past a logged one.
        let every = rma.cfg.train.log_every;
        if every > 0 && s / every > self.reported / every {
            rma.report_times(ctl, rma.roles.workers[self.w], &clock.take())?;
            self.reported = s;
        }
        // The global steps since this worker's last one, each a worker's batch.
        let advanced = (s + 1).saturating_sub(step) as usize;
        let rows = y.rows(self.replica.model.classes());
        Ok(StepWord::default().with_loss(loss, rows * advanced.max(1)))
    }

    /// Asynchronous: tells ps 0 this worker is done (once).
    fn tell_done(&mut self) -> Result<(), PsError> {
        if !std::mem::replace(&mut self.done, true) {
            self.ctl.fetch_and_add(self.ps0(), DONE, 1)?;
        }
        Ok(())
    }

    /// The chief: asks every ps for its shard of checkpoint `step` and commits the
    /// manifest once all are written (the newest `keep` kept); the event that says so.
    fn commit(&self, dir: &Path, step: u64, keep: usize) -> Result<Event, PsError> {
        let (rma, ctl) = (self.rma, self.ctl);
        for r in &rma.roles.ps {
            let before = ctl.fetch_and_add(*r, SAVE_AT, 0)?;
            ctl.fetch_and_add(*r, SAVE_AT, step as i64 - before)?;
        }
        let me = self.me();
        let mut files = Vec::new();
        for (k, r) in rma.roles.ps.iter().enumerate() {
            let _wait = rma.waiting("checkpoint commit", step, k);
            wait_until(
                ctl,
                rma.cfg.peer_timeout * 2,
                || Ok(ctl.fetch_and_add(*r, SAVED, 0)?),
                |v| v >= step as i64,
                || rma.lost(me.clone(), rma.ps_task(k)),
            )?;
            let bytes = ctl.fetch_and_add(*r, SAVED_BYTES, 0)? as u64;
            let sum = ctl.fetch_and_add(*r, SAVED_SUM, 0)? as u64;
            files.push((crate::train::ps::shards::file(k), bytes, sum));
        }
        crate::train::ps::shards::commit(dir, step, &files, rma.model_meta.clone(), keep)
    }
}

impl<'a, C: Comm, D: Access<f32>, K: Access<i64>> Strategy<'a> for OneSided<'a, C, D, K> {
    fn ranks(&self) -> (usize, usize) {
        (self.rma.roles.workers.len(), self.w)
    }

    /// Synchronous: the ps tasks carry a hook's request like a signal, so every worker
    /// stops after the same step; asynchronous: a hook stops its own worker.
    fn agrees(&self) -> bool {
        self.rma.cfg.sync
    }

    fn replica(&self) -> &Replica<'a> {
        &self.replica
    }

    fn into_replica(self) -> Replica<'a> {
        self.replica
    }

    /// The ps tasks restored the checkpoint (or took the initial values) before the
    /// windows opened: every worker pulls what they hold.
    fn start(
        &mut self,
        _: Option<&Path>,
        events: &mut dyn FnMut(&Event),
    ) -> Result<Started, TrainError> {
        for e in std::mem::take(&mut self.notes) {
            events(&e);
        }
        // Asynchronous, another worker may have claimed steps already: the restored one.
        let step = match self.rma.cfg.sync {
            true => (self.ctl.fetch_and_add(self.ps0(), STEP, 0)? % MARK) as u64,
            false => self.restored.unwrap_or(0),
        };
        self.pull()?;
        Ok(Started {
            step,
            restored: self.restored,
        })
    }

    fn gradients(
        &mut self,
        step: u64,
        x: &[f32],
        y: Targets<'_>,
        word: StepWord,
        clock: &mut Clock,
        _: &mut dyn FnMut(&Event),
    ) -> Result<StepWord, TrainError> {
        match self.rma.cfg.sync {
            true => self.sync_step(step, (x, y), word, clock),
            false => self.async_step(step, (x, y), word, clock),
        }
    }

    /// Checked before the push: the ps tasks refuse what is not finite (synchronous), or
    /// the finder stops the job (asynchronous).
    fn pending(&self) -> &[Tensor] {
        &[]
    }

    fn apply(&mut self, step: u64) -> Result<u64, TrainError> {
        Ok(match (self.rma.cfg.sync, self.claimed) {
            (true, _) => step + 1,
            (false, (s, true)) => s,
            (false, (s, false)) => s + 1,
        })
    }

    /// Asynchronous, at the last step: the final parameters are those after every
    /// worker's last push; the chief waits for them and pulls them.
    fn after_step(&mut self, done: u64) -> Result<(), TrainError> {
        if self.rma.cfg.sync || done < self.rma.cfg.train.steps {
            return Ok(());
        }
        self.tell_done()?;
        if self.w != 0 {
            return Ok(());
        }
        let (rma, ctl, ps0) = (self.rma, self.ctl, self.ps0());
        let nw = rma.roles.workers.len() as i64;
        let me = self.me();
        let _wait = rma.waiting("finish", rma.cfg.train.steps, 0);
        wait_until(
            ctl,
            rma.cfg.peer_timeout * 2,
            || Ok(ctl.fetch_and_add(ps0, DONE, 0)?),
            |d| d >= nw,
            || rma.lost(me.clone(), "a worker (not done)".into()),
        )?;
        Ok(self.pull()?)
    }

    fn state(&mut self, _: u64) -> Result<State, TrainError> {
        Err(TrainError::Setup(
            "the ps tasks hold the training state: each writes its shard".into(),
        ))
    }

    /// The chief asks every ps for its shard of `step` (synchronous: written from its
    /// window while the workers' pushes of the step gather; asynchronous: a snapshot of
    /// its window as pushes land) and commits the manifest.
    fn checkpoint(
        &mut self,
        dir: &Path,
        step: u64,
        keep: usize,
        events: &mut dyn FnMut(&Event),
    ) -> Result<PathBuf, TrainError> {
        if self.w == 0 {
            let t = Instant::now();
            let written = self.commit(dir, step, keep)?;
            engine::checkpointed(step, t, &written, events);
        }
        Ok(checkpoint::path_of(dir, step))
    }

    /// Each worker evaluates alone (the workers share no collective).
    fn sum(&mut self, _: &mut [f64]) -> Result<(), TrainError> {
        Ok(())
    }

    fn evaluation_ranks(&self) -> (usize, usize) {
        (1, 0)
    }

    /// The chief: every rank's times since the last log line, read from ps 0 (each rank
    /// added its window before the step was published); the others report there instead.
    fn window(&mut self, _: u64, _: &mut Clock) -> Result<(Times, Vec<RankTimes>), TrainError> {
        let ranks = match self.w {
            0 => self.rma.read_times(self.ctl, &mut self.seen)?,
            _ => Vec::new(),
        };
        Ok((Times::default(), ranks))
    }

    fn communicates(&self) -> bool {
        false
    }

    /// Tells the ps tasks this worker ended: synchronous, with the signal that stopped
    /// it, if one did (they end when every worker has); asynchronous, counted done.
    fn end(&mut self, how: End<'_>) -> Result<(), TrainError> {
        if let Some(rows) = &mut self.rows {
            RowHome::end(rows, &how)?;
        }
        if matches!(how, End::Failed(_) | End::Abandoned) {
            for r in &self.rma.roles.ps {
                self.ctl.fetch_and_add(*r, FAILED, 1)?;
            }
        }
        if !self.rma.cfg.sync {
            // Done pushing, then ended: ps 0's `ARRIVALS` counts the workers that ended
            // (the ps tasks write the chief's checkpoints until all have).
            self.tell_done()?;
            self.ctl.fetch_and_add(self.ps0(), ARRIVALS, 1)?;
            return Ok(());
        }
        for r in &self.rma.roles.ps {
            if let End::Stopped(signal) = how {
                self.ctl
                    .compare_and_swap(*r, STOPPED_BY, 0, i64::from(signal))?;
            }
            self.ctl.fetch_and_add(*r, ARRIVALS, MARK)?;
        }
        Ok(())
    }
}

/// The model's embedding tables, in the ps tasks' windows (synchronous: each step's rows
/// applied once every worker pushed them).
impl<C: Comm, D: Access<f32>, K: Access<i64>> Tables for OneSided<'_, C, D, K> {
    fn table_specs(&self) -> &[TableSpec] {
        self.rows.as_ref().map_or(&[], |r| r.table_specs())
    }

    fn pull_tables(
        &self,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
        make: bool,
    ) -> Result<(), TrainError> {
        self.rows()?.pull_tables(want, out, make)
    }

    fn push_tables(&self, grads: &[(usize, &SparseGrad)], scale: f32) -> Result<(), TrainError> {
        self.rows()?.push_tables(grads, scale)
    }

    /// Synchronous: the rows' (every worker's share of the step); asynchronous: each
    /// worker's push is an update of its own, as its dense gradient is.
    fn push_scale(&self) -> f32 {
        match self.rma.cfg.sync {
            true => self.rows.as_ref().map_or(1.0, |r| r.push_scale()),
            false => 1.0,
        }
    }

    fn rows_report(&self) -> Result<Vec<RowsReport>, TrainError> {
        self.rows()?.rows_report()
    }

    fn pushes_every_step(&self) -> bool {
        self.rows.is_some()
    }
}

/// Asynchronous training, a value not finite: one verdict. The first worker to find one
/// (`before`, ps 0's `NON_FINITE` word before its compare-and-swap, was 0) stops the job
/// with it; a later finder waits for the job to end on that line (a launcher ends every
/// rank once one fails), and says its own only if the job goes on (a launcher that does
/// not end it): one line, never a hang, nothing unsaid.
fn later_finder_waits(before: i64) {
    if before != 0 {
        std::thread::sleep(std::time::Duration::from_secs(10));
    }
}
