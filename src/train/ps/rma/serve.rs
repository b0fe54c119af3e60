//! The ps side of one-sided training: a sync ps applies each step's summed gradient
//! once every worker pushed it (and writes its checkpoint shards); an async ps only waits.

use super::*;

impl Rma<'_> {
    /// The sync ps: apply each step's summed gradient once every worker pushed it.
    pub(super) fn serve_sync(
        &self,
        k: usize,
        data: &mut Epoch<'_, f32>,
        ctl: &Epoch<'_, i64>,
        state: ShardState,
    ) -> Result<(), PsError> {
        let nw = self.roles.workers.len() as i64;
        let me = self.roles.ps[k];
        let opt = self.cfg.train.optimizer;
        let mine: Vec<&Piece> = self.pieces.iter().filter(|p| p.ps == k).collect();
        let ShardState {
            shards,
            mut slots,
            start,
        } = state;
        let n = self.held[k];
        // This ps's phase times, added to its counters on ps 0 before each logged step
        // is published.
        let mut clock = Clock::new();
        let every = self.cfg.train.log_every;
        for step in start..self.cfg.train.steps {
            let t = Instant::now();
            let want = (step - start + 1) as i64 * nw;
            let _wait = stall::wait(|| Wait {
                op: "gather of pushes",
                step,
                what: None,
                peer: None,
                bytes: 0,
            });
            let arrived = wait_until(
                &self.progress,
                self.cfg.peer_timeout,
                || Ok(ctl.fetch_and_add(me, ARRIVALS, 0)?),
                |a| a % MARK >= want || a >= MARK,
                || {
                    // The first worker whose push count is behind this step.
                    let late = (0..self.roles.workers.len())
                        .find(|w| {
                            ctl.fetch_and_add(me, PUSHES + w, 0)
                                .is_ok_and(|c| c <= step as i64)
                        })
                        .unwrap_or(0);
                    // Tell the others why (best effort: this ps stops either way).
                    let _ = ctl.put(me, ABORT, &[late as i64 + 1]);
                    self.lost(
                        self.roles.task(me),
                        self.roles.task(self.roles.workers[late]),
                    )
                },
            )?;
            let t = clock.since_as(Phase::Wait, t, "wait", Detail::at(step));
            if arrived >= MARK {
                // The workers stopped at this step, which another ps announced: keep it.
                return self.stopped_at(k, data, ctl, &shards, &slots, step);
            }
            // Not finite on some worker: nothing applied; the workers read the verdict.
            let found = ctl.fetch_and_add(me, NON_FINITE, 0)?;
            if found != 0 {
                ctl.put(me, ABORT, &[-found])?;
                return Err(not_applied(step, found, nw as usize));
            }
            // A stop a worker asked for (before it counted its push) or this process got
            // is announced with the next step, by every ps that learns it here.
            let asked = crate::signals::stop_requested()
                .or(Some(ctl.fetch_and_add(me, STOP, 0)? as i32).filter(|s| *s != 0))
                .filter(|_| step + 1 < self.cfg.train.steps);
            // SAFETY: every worker pushed this step (accumulates flushed before it counted
            // its arrival) and now only polls `ctl` until STEP moves, which happens after
            // this returns: nothing touches this window meanwhile.
            let loss = unsafe {
                data.with_local(|mem| {
                    let (params, rest) = mem.split_at_mut(n);
                    let (grads, tail) = rest.split_at_mut(n);
                    let samples = tail[1].max(1.0);
                    let loss = tail[0] / samples;
                    grads.iter_mut().for_each(|g| *g /= samples);
                    for (p, s) in mine.iter().zip(slots.iter_mut()) {
                        opt.apply(
                            &mut params[p.at..p.at + p.len],
                            &grads[p.at..p.at + p.len],
                            s,
                        );
                    }
                    grads.fill(0.0);
                    tail.fill(0.0);
                    // Copied while no rank can touch the window (see above).
                    let keep = asked.is_some() && self.cfg.train.checkpoint_dir.is_some();
                    let snapshot = (keep || checkpoint_due(self.cfg, start, step + 1)).then(|| {
                        let views: Vec<&[f32]> =
                            mine.iter().map(|p| &params[p.at..p.at + p.len]).collect();
                        crate::train::ps::shards::arrays(k, &shards, &views, &slots, step + 1)
                    });
                    (loss, snapshot)
                })
            }?;
            let (loss, snapshot) = loss;
            clock.since_as(Phase::Compute, t, "update", Detail::at(step));
            clock.steps(1);
            if let Some(arrays) = snapshot {
                self.save_shard(k, ctl, step + 1, &arrays)?;
            }
            if every > 0 && (step + 1).is_multiple_of(every) {
                self.report_times(ctl, me, &clock.take())?;
            }
            ctl.put(me, LOSS, &[i64::from(loss.to_bits())])?;
            let mark = asked.map_or(0, |s| i64::from(s) * MARK);
            ctl.fetch_and_add(me, STEP, 1 + mark)?;
            if let Some(signal) = asked {
                return Err(self.stopped(signal, step + 1));
            }
        }
        Ok(())
    }

    /// This sync ps ends at `step`, where the workers stopped because another ps announced
    /// a stop: it writes its shard of that step's checkpoint (unless written already).
    fn stopped_at(
        &self,
        k: usize,
        data: &mut Epoch<'_, f32>,
        ctl: &Epoch<'_, i64>,
        shards: &[Shard],
        slots: &[Slots],
        step: u64,
    ) -> Result<(), PsError> {
        let me = self.roles.ps[k];
        let saved = ctl.fetch_and_add(me, SAVED, 0)? as u64;
        if self.cfg.train.checkpoint_dir.is_some() && saved < step {
            let mine: Vec<&Piece> = self.pieces.iter().filter(|p| p.ps == k).collect();
            // SAFETY: every worker stopped: none touches this window again.
            let arrays = unsafe {
                data.with_local(|mem| {
                    let views: Vec<&[f32]> =
                        mine.iter().map(|p| &mem[p.at..p.at + p.len]).collect();
                    crate::train::ps::shards::arrays(k, shards, &views, slots, step)
                })
            }?;
            self.save_shard(k, ctl, step, &arrays)?;
        }
        let signal = ctl.fetch_and_add(me, STOP, 0)? as i32;
        Err(self.stopped(signal, step))
    }

    /// Writes this ps's shard of checkpoint `step` into its staging directory and
    /// publishes its size and checksum, then the step, in `ctl` for the chief.
    fn save_shard(
        &self,
        k: usize,
        ctl: &Epoch<'_, i64>,
        step: u64,
        arrays: &crate::train::checkpoint::Arrays,
    ) -> Result<(), PsError> {
        let dir = self.checkpoint_dir();
        let stage = crate::train::checkpoint::staging_dir(dir, step);
        let written = std::fs::create_dir_all(&stage)
            .map_err(|e| format!("{}: {e}", stage.display()))
            .and_then(|()| {
                let file = stage.join(crate::train::ps::shards::file(k));
                crate::train::checkpoint::write_file(&file, arrays).map_err(|e| e.to_string())
            });
        // This ps stops; the chief, waiting for its shard, is ended with the job.
        let (bytes, sum) =
            written.map_err(|e| crate::train::checkpoint::abandoned(dir, step, e))?;
        let me = self.roles.ps[k];
        ctl.put(me, SAVED_BYTES, &[bytes as i64, sum as i64])?;
        let before = ctl.fetch_and_add(me, SAVED, 0)?;
        ctl.fetch_and_add(me, SAVED, step as i64 - before)?;
        Ok(())
    }

    /// The async ps: nothing to do per request; wait until every worker is done. A stop
    /// signal this process gets is announced in ps 0's step counter (every worker's next
    /// claim sees it).
    pub(super) fn serve_async(&self, k: usize, ctl: &Epoch<'_, i64>) -> Result<(), PsError> {
        let ps0 = self.roles.ps[0];
        let nw = self.roles.workers.len() as i64;
        let mut announced = false;
        // Progress is any claimed step or finished worker; done is every worker finished.
        stall::Board::global().idle();
        let last = wait_until(
            &self.progress,
            self.cfg.peer_timeout,
            || {
                if let (Some(signal), false) = (crate::signals::stop_requested(), announced) {
                    announce_async_stop(ctl, ps0, signal)?;
                    announced = true;
                }
                let step = ctl.fetch_and_add(ps0, STEP, 0)?;
                Ok((ctl.fetch_and_add(ps0, DONE, 0)? << 48) + (step & ((1 << 48) - 1)))
            },
            |v| v >> 48 >= nw,
            || {
                self.lost(
                    self.ps_task(k),
                    "a worker (no step claimed, none finished)".into(),
                )
            },
        )?;
        let step = last & ((1 << 48) - 1);
        if step >= MARK {
            let signal = ctl.fetch_and_add(ps0, STOP, 0)? as i32;
            return Err(self.stopped(signal, (step % MARK) as u64));
        }
        Ok(())
    }
}

/// Asks async one-sided training to stop (`signal`): the number in ps 0's `STOP`, the
/// mark on its step counter that every worker's next claim sees.
pub(super) fn announce_async_stop(
    ctl: &Epoch<'_, i64>,
    ps0: usize,
    signal: i32,
) -> Result<(), PsError> {
    ctl.compare_and_swap(ps0, STOP, 0, i64::from(signal))?;
    ctl.fetch_and_add(ps0, STEP, MARK)?;
    Ok(())
}
