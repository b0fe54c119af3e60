//! The ps side of one-sided training: a sync ps applies each step's summed gradient once
//! every worker pushed it, and writes its checkpoint shard when the chief asks; an async
//! ps only waits.

use super::rows::RowsOnPs;
use super::*;

/// How long a sync ps gathering pushes waits for the next before it looks for the chief's
/// checkpoint request (it waits for the shard, pushing nothing).
const SAVE_POLL: std::time::Duration = std::time::Duration::from_millis(1);

/// A sync ps at work: the step its window's parameters are at, their optimizer state,
/// the newest step whose shard it wrote; the embedding rows it serves beside them.
struct Serving<'r> {
    state: ShardState,
    step: u64,
    saved: u64,
    clock: Clock,
    rows: Option<&'r mut dyn RowsOnPs>,
}

impl Rma<'_> {
    /// The sync ps: applies each step's summed gradient once every worker pushed it,
    /// until the last step or a stop, then serves checkpoint requests until every worker
    /// ended; `rows` (a model's embedding rows) served meanwhile.
    pub(super) fn serve_sync(
        &self,
        data: &mut impl Access<f32>,
        ctl: &impl Access<i64>,
        state: ShardState,
        rows: Option<&mut dyn RowsOnPs>,
    ) -> Result<(), PsError> {
        let mut ps = Serving {
            step: state.start,
            saved: state.start,
            state,
            clock: Clock::new(),
            rows,
        };
        while ps.step < self.cfg.train.steps {
            if !self.gather(&mut ps, data, ctl)? || self.update(&mut ps, data, ctl)? {
                break;
            }
        }
        self.ending(&mut ps, data, ctl)
    }

    /// Waits until every worker pushed `ps.step` (true), or one ended before pushing it
    /// (false: all stopped at this step, or one failed), writing the shard the chief asks
    /// for meanwhile.
    fn gather(
        &self,
        ps: &mut Serving,
        data: &impl Access<f32>,
        ctl: &impl Access<i64>,
    ) -> Result<bool, PsError> {
        let t = Instant::now();
        let (step, nw) = (ps.step, self.roles.workers.len());
        let me = self.roles.ps[ps.state.k];
        let base = ((step - ps.state.start) * nw as u64) as i64;
        let _wait = stall::wait(|| Wait {
            op: "gather of pushes",
            step,
            what: None,
            peer: None,
            bytes: 0,
        });
        let (state, saved, rows) = (&ps.state, &mut ps.saved, &mut ps.rows);
        let (mut last, mut since) = (-1, Instant::now());
        // A checkpoint written meanwhile is this ps's work, not the workers' silence.
        let arrived = wait_alive(
            ctl,
            self.cfg.peer_timeout,
            || {
                if let Some(r) = rows.as_deref_mut() {
                    r.poll()?;
                }
                let a = ctl.fetch_and_add(me, ARRIVALS, 0)?;
                // Asked only once no push came for a while: the chief asks, then waits,
                // pushing nothing until the shard is written.
                if a != last {
                    (last, since) = (a, Instant::now());
                } else if since.elapsed() >= SAVE_POLL {
                    self.save_on_request(data, ctl, (state, step, saved), rows)?;
                }
                Ok((a, *saved as i64))
            },
            // Every worker pushed this step or ended (one that ends before the others
            // push is waited out: they push, then learn it failed).
            |a| {
                a % MARK >= base + nw as i64
                    || (a >= MARK && a % MARK - base + a / MARK >= nw as i64)
            },
            || {
                let late = self.late_worker(ctl, me, step, false);
                self.lost(self.roles.task(me), late)
            },
        )?;
        ps.clock.since_as(Phase::Wait, t, "wait", Detail::at(step));
        if arrived < MARK {
            return Ok(true);
        }
        if arrived % MARK > base {
            // Some pushed this step and another ended: that one failed (its error says why).
            let late = self.late_worker(ctl, me, step, true);
            return Err(PsError::Aborted {
                task: self.roles.task(me),
                message: format!("{late} ended at step {step}, which the others pushed"),
            });
        }
        Ok(false)
    }

    /// The first worker whose push count is behind `step`, named; told to the workers
    /// waiting for the step (`ABORT`, with whether it `ended` or went silent; best
    /// effort: this ps stops either way).
    fn late_worker(&self, ctl: &impl Access<i64>, me: usize, step: u64, ended: bool) -> String {
        let late = (0..self.roles.workers.len())
            .find(|w| {
                ctl.fetch_and_add(me, PUSHES + w, 0)
                    .is_ok_and(|c| c <= step as i64)
            })
            .unwrap_or(0);
        let said = late as i64 + 1 + if ended { ENDED } else { 0 };
        let _ = ctl.put(me, ABORT, &[said]);
        self.roles.task(self.roles.workers[late])
    }

    /// Applies the gathered step and publishes the next, with the stop announced (a
    /// signal, or a hook's request) if any: true then.
    fn update(
        &self,
        ps: &mut Serving,
        data: &mut impl Access<f32>,
        ctl: &impl Access<i64>,
    ) -> Result<bool, PsError> {
        let t = Instant::now();
        let (k, step) = (ps.state.k, ps.step);
        let me = self.roles.ps[k];
        // Not finite on some worker: nothing applied; the workers read the verdict.
        let found = ctl.fetch_and_add(me, NON_FINITE, 0)?;
        if found != 0 {
            ctl.put(me, ABORT, &[-found])?;
            return Err(not_applied(step, found, self.roles.workers.len()));
        }
        // A stop this process got, or a worker asked for before it counted its push, is
        // announced with the next step, by every ps that learns it here.
        let asked = crate::signals::stop_requested()
            .map(i64::from)
            .or(Some(ctl.fetch_and_add(me, STOP, 0)?).filter(|s| *s != 0))
            .filter(|_| step + 1 < self.cfg.train.steps);
        let (n, opt) = (self.held[k], self.cfg.train.optimizer);
        let mine: Vec<&Piece> = self.pieces.iter().filter(|p| p.ps == k).collect();
        let slots = &mut ps.state.slots;
        // SAFETY: every worker pushed this step (accumulates flushed before it counted
        // its arrival) and now only polls `ctl` until STEP moves, which happens after
        // this returns: nothing touches this window meanwhile.
        let (loss, samples) = unsafe {
            data.with_local(|mem| {
                let (params, rest) = mem.split_at_mut(n);
                let (grads, tail) = rest.split_at_mut(n);
                let samples = tail[1].max(1.0);
                grads.iter_mut().for_each(|g| *g /= samples);
                for (p, s) in mine.iter().zip(slots.iter_mut()) {
                    let at = p.at..p.at + p.len;
                    opt.apply(&mut params[at.clone()], &grads[at], s);
                }
                let loss = tail[0] / samples;
                grads.fill(0.0);
                tail.fill(0.0);
                (loss, samples)
            })
        }?;
        ps.clock
            .since_as(Phase::Compute, t, "update", Detail::at(step));
        ps.clock.steps(1);
        let every = self.cfg.train.log_every;
        if every > 0 && (step + 1).is_multiple_of(every) {
            self.report_times(ctl, me, &ps.clock.take())?;
        }
        ctl.put(me, LOSS, &[loss_word(loss, samples)])?;
        ctl.fetch_and_add(me, STEP, 1 + asked.unwrap_or(0) * MARK)?;
        ps.step += 1;
        Ok(asked.is_some())
    }

    /// After the last step or a stop: serves the chief's checkpoint request until every
    /// worker ended; the stop the workers ended with, if one did.
    fn ending(
        &self,
        ps: &mut Serving,
        data: &impl Access<f32>,
        ctl: &impl Access<i64>,
    ) -> Result<(), PsError> {
        let me = self.roles.ps[ps.state.k];
        let nw = self.roles.workers.len() as i64;
        stall::Board::global().idle();
        let (state, saved, step) = (&ps.state, &mut ps.saved, ps.step);
        let rows = &mut ps.rows;
        wait_alive(
            ctl,
            self.cfg.peer_timeout * 2,
            || {
                if let Some(r) = rows.as_deref_mut() {
                    r.poll()?;
                }
                self.save_on_request(data, ctl, (state, step, saved), rows)?;
                Ok((ctl.fetch_and_add(me, ARRIVALS, 0)?, *saved as i64))
            },
            |a| a / MARK >= nw,
            || self.lost(self.roles.task(me), "a worker (not ended)".into()),
        )?;
        finish_rows(rows.as_deref_mut())?;
        self.none_failed(ctl, me)?;
        match ctl.fetch_and_add(me, STOPPED_BY, 0)? {
            0 => Ok(()),
            signal => Err(self.stopped(signal as i32, step)),
        }
    }

    /// Every worker ended: an error if any failed (its own error says why), so that this
    /// ps ends as they did (the windows are then not freed together: the failed do not
    /// come to the free).
    fn none_failed(&self, ctl: &impl Access<i64>, me: usize) -> Result<(), PsError> {
        match ctl.fetch_and_add(me, FAILED, 0)? {
            0 => Ok(()),
            failed => Err(PsError::Aborted {
                task: self.roles.task(me),
                message: format!(
                    "{failed} of {} workers failed (their errors say why)",
                    self.roles.workers.len()
                ),
            }),
        }
    }

    /// Writes this ps's shard of checkpoint `step` (the parameters its window holds) if
    /// the chief asked for it (`SAVE_AT`) and it is not written yet (`saved`).
    fn save_on_request(
        &self,
        data: &impl Access<f32>,
        ctl: &impl Access<i64>,
        (state, step, saved): (&ShardState, u64, &mut u64),
        rows: &mut Option<&mut dyn RowsOnPs>,
    ) -> Result<(), PsError> {
        let k = state.k;
        if *saved == step || ctl.fetch_and_add(self.roles.ps[k], SAVE_AT, 0)? != step as i64 {
            return Ok(());
        }
        let mine = self.pieces.iter().filter(|p| p.ps == k);
        // SAFETY: the parameters (the window's first `held[k]` elements) change only in
        // this ps's update, after every worker pushed the step; meanwhile workers read
        // them and accumulate into the gradient sums past them.
        let mut arrays = unsafe {
            data.with_local_prefix(self.held[k], |params| {
                let views: Vec<&[f32]> = mine.map(|p| &params[p.at..p.at + p.len]).collect();
                crate::train::ps::shards::arrays(k, &state.shards, &views, &state.slots, step)
            })
        }?;
        // The rows of the same step beside the shards (every worker pushed them before
        // it pushed this step's gradients).
        if let Some(r) = rows.as_deref_mut() {
            r.reach(step)?;
            arrays.arrays.extend(r.arrays());
        }
        self.save_shard(k, ctl, step, &arrays)?;
        *saved = step;
        Ok(())
    }

    /// Writes this ps's shard of checkpoint `step` into its staging directory and
    /// publishes its size and checksum, then the step, in `ctl` for the chief.
    fn save_shard(
        &self,
        k: usize,
        ctl: &impl Access<i64>,
        step: u64,
        arrays: &crate::train::checkpoint::Arrays,
    ) -> Result<(), PsError> {
        let (dir, me) = (self.checkpoint_dir(), self.roles.ps[k]);
        let timeout = self.cfg.peer_timeout;
        let written = write_saving(ctl, (me, SAVED), timeout, (dir, step, k), arrays)?;
        // This ps stops; the chief, waiting for its shard, is ended with the job.
        let (bytes, sum) =
            written.map_err(|e| crate::train::checkpoint::abandoned(dir, step, e))?;
        ctl.put(me, SAVED_BYTES, &[bytes as i64, sum as i64])?;
        let before = ctl.fetch_and_add(me, SAVED, 0)?;
        ctl.fetch_and_add(me, SAVED, step as i64 - before)?;
        Ok(())
    }

    /// The async ps: nothing to do per request; writes a snapshot of its window for the
    /// checkpoint the chief asks for, until every worker ended, then ends `rows` (added
    /// into by the workers). A stop signal this process gets is announced in ps 0's step
    /// counter (every worker's next claim sees it).
    pub(super) fn serve_async(
        &self,
        data: &impl Access<f32>,
        ctl: &impl Access<i64>,
        state: &ShardState,
        mut rows: Option<&mut dyn RowsOnPs>,
    ) -> Result<(), PsError> {
        let (ps0, nw) = (self.roles.ps[0], self.roles.workers.len() as i64);
        let (mut announced, mut saved) = (false, state.start);
        // Progress is a claimed step, an ended worker or a checkpoint written; done is
        // every worker ended (past its last checkpoint and evaluation: twice the timeout,
        // as a sync ps's ending waits).
        stall::Board::global().idle();
        let last = wait_alive(
            ctl,
            self.cfg.peer_timeout * 2,
            || {
                if let (Some(signal), false) = (crate::signals::stop_requested(), announced) {
                    announce_async_stop(ctl, ps0, signal)?;
                    announced = true;
                }
                self.snapshot_on_request(data, ctl, state, &mut saved, &mut rows)?;
                let mut words = [0i64; ARRIVALS + 1];
                ctl.read_atomic(ps0, STEP, &mut words)?;
                let step = words[STEP] & ((1 << 48) - 1);
                Ok(((words[ARRIVALS] << 48) + step, saved as i64))
            },
            |v| v >> 48 >= nw,
            || {
                self.lost(
                    self.ps_task(state.k),
                    "a worker (no step claimed, none ended)".into(),
                )
            },
        )?;
        finish_rows(rows)?;
        self.none_failed(ctl, self.roles.ps[state.k])?;
        if last & ((1 << 48) - 1) >= MARK {
            let signal = ctl.fetch_and_add(ps0, STOP, 0)? as i32;
            return Err(self.stopped(signal, saved));
        }
        Ok(())
    }

    /// The async ps: writes its shard of the checkpoint the chief asked for (`SAVE_AT`,
    /// past `saved`), a snapshot of its window's parameters (and rows) read atomically
    /// while the workers' pushes go on landing: each element is before or after each push,
    /// as an asynchronous ps's variables are when TensorFlow saves them.
    fn snapshot_on_request(
        &self,
        data: &impl Access<f32>,
        ctl: &impl Access<i64>,
        state: &ShardState,
        saved: &mut u64,
        rows: &mut Option<&mut dyn RowsOnPs>,
    ) -> Result<(), PsError> {
        let (k, me) = (state.k, self.roles.ps[state.k]);
        let asked = ctl.fetch_and_add(me, SAVE_AT, 0)? as u64;
        if asked <= *saved {
            return Ok(());
        }
        let mut params = vec![0.0f32; self.held[k]];
        data.read_atomic(me, 0, &mut params)?;
        let mine = self.pieces.iter().filter(|p| p.ps == k);
        let views: Vec<&[f32]> = mine.map(|p| &params[p.at..p.at + p.len]).collect();
        let shards = crate::train::ps::shards::arrays;
        let mut arrays = shards(k, &state.shards, &views, &state.slots, asked);
        if let Some(r) = rows.as_deref_mut() {
            arrays.arrays.extend(r.snapshot()?);
        }
        self.save_shard(k, ctl, asked, &arrays)?;
        *saved = asked;
        Ok(())
    }
}

/// The rows served beside the shards (if any) end as the shards do, once every worker
/// ended; the shards' verdict (a stop's checkpoint) is the one said.
fn finish_rows<'r>(rows: Option<&mut (dyn RowsOnPs + 'r)>) -> Result<(), PsError> {
    match rows.map(|r| r.finish()) {
        None | Some(Ok(()) | Err(PsError::Stopped(_))) => Ok(()),
        Some(Err(e)) => Err(e),
    }
}

/// Asks async one-sided training to stop (`signal`): the number in ps 0's `STOP`, the
/// mark on its step counter that every worker's next claim sees.
pub(super) fn announce_async_stop(
    ctl: &impl Access<i64>,
    ps0: usize,
    signal: i32,
) -> Result<(), PsError> {
    ctl.compare_and_swap(ps0, STOP, 0, i64::from(signal))?;
    ctl.fetch_and_add(ps0, STEP, MARK)?;
    Ok(())
}
