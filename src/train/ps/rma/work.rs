//! The worker side of one-sided training: pull by `MPI_Get`, compute, push by
//! `MPI_Accumulate`; the chief logs and commits checkpoints.

use super::*;

impl Rma<'_> {
    /// The chief: commits checkpoint `step` once every ps saved its shard.
    fn commit(
        &self,
        ctl: &Epoch<'_, i64>,
        step: u64,
        events: &mut dyn FnMut(&Event),
    ) -> Result<(), PsError> {
        let me = self.roles.task(self.roles.workers[0]);
        let mut files = Vec::new();
        for (k, r) in self.roles.ps.iter().enumerate() {
            let _wait = self.waiting("checkpoint commit", step, k);
            wait_until(
                &self.progress,
                self.cfg.peer_timeout * 2,
                || Ok(ctl.fetch_and_add(*r, SAVED, 0)?),
                |v| v >= step as i64,
                || self.lost(me.clone(), self.ps_task(k)),
            )?;
            let bytes = ctl.fetch_and_add(*r, SAVED_BYTES, 0)? as u64;
            let sum = ctl.fetch_and_add(*r, SAVED_SUM, 0)? as u64;
            files.push((crate::train::ps::shards::file(k), bytes, sum));
        }
        let dir = self.checkpoint_dir();
        events(&crate::train::ps::shards::commit(
            dir,
            step,
            &files,
            self.model_meta.clone(),
            self.cfg.train.keep_checkpoints,
        )?);
        Ok(())
    }

    /// A worker (the chief too): pull, compute, push, until the last step.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn work(
        &self,
        w: usize,
        model: &mut Replica<'_>,
        data: &Epoch<'_, f32>,
        ctl: &Epoch<'_, i64>,
        train: &Dataset,
        test: &Dataset,
        events: &mut dyn FnMut(&Event),
    ) -> Result<(), PsError> {
        let cfg = self.cfg;
        let roles = self.roles;
        let nw = roles.workers.len();
        let me = roles.task(roles.workers[w]);
        let chief = w == 0;
        let mut batches = Batches::new(train.len(), cfg.train.batch, cfg.train.seed);
        let mut grads = model.zeros_like();
        let mut towers = crate::model::towers::Towers::new(cfg.train.towers);
        // Where training starts: step 0, or the restored checkpoint's step.
        let start = ctl.fetch_and_add(roles.ps[0], STEP, 0)? as u64;
        let (mut window, mut logged, mut last_loss) = (Instant::now(), start, f32::NAN);
        let mut step = if cfg.sync { start } else { 0 };
        // A stop this worker asked for (announced once), and one announced to it.
        let (mut asked, mut stop) = (false, None);
        // This worker's phase times, added to its counters on ps 0 at each logged step;
        // the chief's view of every rank's counters.
        let (mut clock, mut reported) = (Clock::new(), start);
        let mut seen = vec![[0i64; TIME_FIELDS]; if chief { self.ranks } else { 0 }];
        let every = cfg.train.log_every;
        let (bytes, peer) = self.moved();
        loop {
            let t = Instant::now();
            let s = if cfg.sync {
                for (k, r) in roles.ps.iter().enumerate() {
                    // The update of the step before (the one whose pushes ps k gathers).
                    let _wait = self.waiting("pull", step.saturating_sub(1), k);
                    let v = wait_until(
                        &self.progress,
                        cfg.peer_timeout * 2,
                        || match ctl.fetch_and_add(*r, ABORT, 0)? {
                            0 => Ok(ctl.fetch_and_add(*r, STEP, 0)?),
                            // The step before was not applied (see the module's rule).
                            found if found < 0 => {
                                Err(not_applied(step.saturating_sub(1), -found, nw))
                            }
                            late => Err(PsError::Remote {
                                task: me.clone(),
                                message: self
                                    .lost(
                                        self.ps_task(k),
                                        roles.task(roles.workers[(late - 1) as usize]),
                                    )
                                    .to_string(),
                            }),
                        },
                        |v| v % MARK >= step as i64,
                        || self.lost(me.clone(), self.ps_task(k)),
                    )?;
                    stop = stop.or((v >= MARK).then_some((v / MARK) as i32));
                }
                step
            } else {
                let v = ctl.fetch_and_add(roles.ps[0], STEP, 1)?;
                if v >= MARK {
                    stop = Some(ctl.fetch_and_add(roles.ps[0], STOP, 0)? as i32);
                }
                (v % MARK) as u64
            };
            // Sync: waiting for the others' pushes and the update; async: claiming a step.
            match cfg.sync {
                true => clock.since_as(Phase::Wait, t, "wait", Detail::at(s)),
                false => clock.since_as(Phase::Comm, t, "claim", Detail::at(s)),
            };
            if chief && every > 0 && s / every > logged / every {
                // Sync: the combined batch's loss, from ps 0; async: this worker's own.
                let loss = if cfg.sync {
                    f32::from_bits(ctl.fetch_and_add(roles.ps[0], LOSS, 0)? as u32)
                } else {
                    last_loss
                };
                // Sync: every rank added this window before the step was published.
                let ranks = self.read_times(ctl, &mut seen)?;
                let took = window.elapsed();
                events(&step_event(cfg, nw, (s, loss), s - logged, took, ranks));
                (window, logged) = (Instant::now(), s);
            }
            if chief && cfg.sync && checkpoint_due(cfg, start, s) {
                self.commit(ctl, s, events)?;
            }
            if let Some(signal) = stop {
                return self.stop_at(chief, ctl, signal, start, s, events);
            }
            step = s + u64::from(cfg.sync);
            if s >= cfg.train.steps {
                break;
            }
            let t = Instant::now();
            self.pull(model, data)?;
            let t = clock.since_as(Phase::Comm, t, "pull", Detail::moved(s, bytes, &peer));
            let global = batches.global(s);
            let mine = shard(&global, w, nw);
            let (x, y) = train.rows(mine);
            let loss = towers
                .gradients_into(model, &x, &y, &mut grads)
                .map_err(|e| PsError::Setup(e.to_string()))?;
            // Sync: pushed all the same, and counted on every ps (see the module's rule).
            let found = crate::train::guard::check_step(s, loss, &grads);
            if found.is_err() && !cfg.sync {
                later_finder_waits(ctl.compare_and_swap(roles.ps[0], NON_FINITE, 0, 1)?);
            }
            let found = super::super::non_finite_rule(found, cfg.sync, || me.clone())?;
            last_loss = loss;
            let n = mine.len() as f32;
            // In place: the sync ps divides the sum by the samples; async applies SGD.
            // (s is the global step this update counts as: the decay's update s + 1.)
            let scale = if cfg.sync {
                n
            } else {
                -cfg.train.optimizer.lr_at(s + 1)
            };
            for g in grads.iter_mut() {
                g.as_mut_slice::<f32>()
                    .expect("f32")
                    .iter_mut()
                    .for_each(|v| *v *= scale);
            }
            let tail = [loss * n, n];
            let t = clock.since_as(Phase::Compute, t, "gradients", Detail::at(s));
            data.batch(|b| -> Result<(), RmaError> {
                for (p, g) in slices(&grads, self.pieces) {
                    let r = roles.ps[p.ps];
                    let at = if cfg.sync {
                        self.held[p.ps] + p.at
                    } else {
                        p.at
                    };
                    b.accumulate_sum(r, at, g)?;
                }
                if cfg.sync {
                    for (k, r) in roles.ps.iter().enumerate() {
                        b.accumulate_sum(*r, 2 * self.held[k], &tail)?;
                    }
                }
                Ok(())
            })??;
            let noted = crate::signals::stop_requested_if(cfg.train.stop_on_signal);
            if let (Some(signal), false) = (noted, asked) {
                // Before this push counts: every ps reads it once the step is in.
                asked = true;
                if cfg.sync {
                    for r in &roles.ps {
                        ctl.compare_and_swap(*r, STOP, 0, i64::from(signal))?;
                    }
                } else {
                    super::serve::announce_async_stop(ctl, roles.ps[0], signal)?;
                }
            }
            clock.since_as(Phase::Comm, t, "push", Detail::moved(s, bytes, &peer));
            clock.steps(1);
            // Sync: the window ends with the step before a logged one, added before this
            // push counts (the chief reads once the step is published); async: at the
            // first step claimed past a logged one.
            let due = match cfg.sync {
                true => every > 0 && (s + 1).is_multiple_of(every),
                false => every > 0 && s / every > reported / every,
            };
            if due {
                self.report_times(ctl, roles.workers[w], &clock.take())?;
                reported = s;
            }
            if cfg.sync {
                for r in &roles.ps {
                    // Ordered before the count (same origin and target: accumulate order).
                    if let Some(found) = &found {
                        ctl.fetch_and_add(*r, NON_FINITE, non_finite_code(found))?;
                    }
                    ctl.fetch_and_add(*r, PUSHES + w, 1)?;
                    ctl.fetch_and_add(*r, ARRIVALS, 1)?;
                }
            }
        }
        if !cfg.sync {
            ctl.fetch_and_add(roles.ps[0], DONE, 1)?;
        }
        if chief {
            if !cfg.sync {
                // The final parameters are those after every worker's last push.
                let _wait = self.waiting("finish", cfg.train.steps, 0);
                wait_until(
                    &self.progress,
                    cfg.peer_timeout * 2,
                    || Ok(ctl.fetch_and_add(roles.ps[0], DONE, 0)?),
                    |d| d >= nw as i64,
                    || self.lost(me.clone(), "a worker (not done)".into()),
                )?;
            }
            self.pull(model, data)?;
            crate::train::finish(
                model,
                test,
                cfg.train.steps,
                cfg.train.save_params.as_deref(),
                events,
            )
            .map_err(|e| PsError::Setup(e.to_string()))?;
        }
        Ok(())
    }

    /// This worker stops at global step `s` (a ps announced `signal`): it tells every ps
    /// (sync: a ps still waiting for this step's pushes ends, keeping step `s`; async: ps
    /// tasks end when every worker is done), and the chief commits the checkpoint of `s`.
    fn stop_at(
        &self,
        chief: bool,
        ctl: &Epoch<'_, i64>,
        signal: i32,
        start: u64,
        s: u64,
        events: &mut dyn FnMut(&Event),
    ) -> Result<(), PsError> {
        let roles = self.roles;
        if !self.cfg.sync {
            ctl.fetch_and_add(roles.ps[0], DONE, 1)?;
            return Err(self.stopped(signal, s));
        }
        for r in &roles.ps {
            ctl.compare_and_swap(*r, STOP, 0, i64::from(signal))?;
            ctl.fetch_and_add(*r, ARRIVALS, MARK)?;
        }
        let written = checkpoint_due(self.cfg, start, s);
        if chief && self.cfg.train.checkpoint_dir.is_some() && s > start && !written {
            self.commit(ctl, s, events)?;
        }
        Err(self.stopped(signal, s))
    }

    /// What a pull or a push moves (bytes of every shard) and with whom, for the
    /// timeline.
    fn moved(&self) -> (usize, std::sync::Arc<str>) {
        let bytes = 4 * self.pieces.iter().map(|p| p.len).sum::<usize>();
        let peer = match self.roles.ps.as_slice() {
            [one] => self.roles.task_name(*one),
            all => format!("{} ps tasks", all.len()),
        };
        (bytes, peer.into())
    }

    /// Marks a wait of `op` at `step` on ps `k` (for stall reports).
    fn waiting(&self, op: &'static str, step: u64, k: usize) -> stall::Waiting<'static> {
        stall::wait(|| Wait {
            op,
            step,
            what: None,
            peer: Some(self.roles.task_name(self.roles.ps[k]).into()),
            bytes: 0,
        })
    }

    /// Gets every shard straight into the model's tensors (one `MPI_Get` each).
    fn pull(&self, model: &mut Replica<'_>, data: &Epoch<'_, f32>) -> Result<(), PsError> {
        let targets = slices_mut(&mut model.params, self.pieces);
        data.batch(|b| -> Result<(), RmaError> {
            for (p, dst) in targets {
                b.get_into(self.roles.ps[p.ps], p.at, dst)?;
            }
            Ok(())
        })??;
        Ok(())
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
