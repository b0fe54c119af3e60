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
        for step in start..self.cfg.train.steps {
            let want = (step - start + 1) as i64 * nw;
            wait_until(
                self.cfg.peer_timeout,
                || Ok(ctl.fetch_and_add(me, ARRIVALS, 0)?),
                |a| a >= want,
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
                    let snapshot = checkpoint_due(self.cfg, start, step + 1).then(|| {
                        let views: Vec<&[f32]> =
                            mine.iter().map(|p| &params[p.at..p.at + p.len]).collect();
                        crate::train::ps::shards::arrays(k, &shards, &views, &slots, step + 1)
                    });
                    (loss, snapshot)
                })
            }?;
            let (loss, snapshot) = loss;
            if let Some(arrays) = snapshot {
                self.save_shard(k, ctl, step + 1, &arrays)?;
            }
            ctl.put(me, LOSS, &[i64::from(loss.to_bits())])?;
            ctl.fetch_and_add(me, STEP, 1)?;
        }
        Ok(())
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
        std::fs::create_dir_all(&stage)
            .map_err(|e| PsError::Setup(format!("{}: {e}", stage.display())))?;
        let (bytes, sum) = crate::train::checkpoint::write_file(
            &stage.join(crate::train::ps::shards::file(k)),
            arrays,
        )?;
        let me = self.roles.ps[k];
        ctl.put(me, SAVED_BYTES, &[bytes as i64, sum as i64])?;
        let before = ctl.fetch_and_add(me, SAVED, 0)?;
        ctl.fetch_and_add(me, SAVED, step as i64 - before)?;
        Ok(())
    }

    /// The async ps: nothing to do per request; wait until every worker is done.
    pub(super) fn serve_async(&self, k: usize, ctl: &Epoch<'_, i64>) -> Result<(), PsError> {
        let ps0 = self.roles.ps[0];
        let nw = self.roles.workers.len() as i64;
        // Progress is any claimed step or finished worker; done is every worker finished.
        wait_until(
            self.cfg.peer_timeout,
            || Ok((ctl.fetch_and_add(ps0, DONE, 0)? << 32) + ctl.fetch_and_add(ps0, STEP, 0)?),
            |v| v >> 32 >= nw,
            || {
                self.lost(
                    self.ps_task(k),
                    "a worker (no step claimed, none finished)".into(),
                )
            },
        )?;
        Ok(())
    }
}
