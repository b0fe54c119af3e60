//! A worker's request, as the server takes it: checked on its header, its payload
//! received where it goes, answered now or parked (see [`super`]).

use std::time::Instant;

use super::super::protocol::{decode_with, Reply, Request};
use super::super::PsError;
use super::{Parked, Server};
use crate::transport::comm::Comm;

/// What becomes of a push, judged on its header.
enum Verdict {
    /// Applied as it arrives (asynchronous replicas).
    Apply,
    /// Kept for the current step (synchronous replicas).
    Accept,
    /// For a step already applied (a backup worker's): dropped, the worker told.
    Stale,
    /// An error to the worker.
    Reject(String),
}

/// Where a payload goes.
pub(super) enum Dest {
    /// Into the parameters (initial values).
    Params,
    /// Applied piece by piece as it arrives (an asynchronous gradient).
    Apply,
    /// Into worker `w`'s buffer for the step (a synchronous gradient).
    Staged(usize),
    /// Into the rows buffer (a sparse gradient, applied once whole).
    Rows,
    /// Nowhere (a rejected or stale push): taken only so the next payload starts clean.
    Drop,
}

impl<C: Comm> Server<'_, C> {
    /// Handles one request, whose header arrived in `inbox` (its payload, if any, follows
    /// from the same worker); `Err` stops the server (the workers were told).
    pub(super) fn handle(&mut self, from: usize, inbox: &[u8]) -> Result<(), PsError> {
        let Some(w) = self.roles.worker_index(from) else {
            return Ok(()); // not a worker: ignore
        };
        self.heard[w] = Instant::now();
        if self.excused == Some(w) {
            // The checkpoint is over: every worker's silence counts from now.
            self.excused = None;
            let now = self.heard[w];
            self.heard.iter_mut().for_each(|h| *h = now);
        }
        let Some((request, inline_bytes)) = decode_with::<Request>(inbox) else {
            return self.error(from, "malformed request".into());
        };
        let lens = request.payload(self.k);
        match request {
            Request::Init { setup } => {
                let configured = self.configure(&setup);
                let into = if configured.is_ok() {
                    Dest::Params
                } else {
                    Dest::Drop
                };
                if let Err(e) =
                    configured.and(self.take_payload(from, &lens, inline_bytes, into)?)
                {
                    return self.error(from, e);
                }
                self.initialized = true;
                self.ok(from)?;
                self.answer_pending()
            }
            Request::Restore { setup, path } => self.start_restore((from, w), &setup, &path),
            Request::Pull(then) => {
                self.pending.push(Parked::new(from, then));
                self.answer_pending()
            }
            request @ Request::Push { .. } => self.push(from, w, request, &lens, inline_bytes),
            Request::PullRows { parts } => self.pull_rows(from, &parts, true),
            Request::ReadRows { parts } => self.pull_rows(from, &parts, false),
            Request::Stats => {
                let tables = (self.served.iter().zip(&self.tables))
                    .map(|(s, t)| s.report(t))
                    .collect();
                self.reply(from, &Reply::Stats { tables })
            }
            Request::PushRows {
                parts, scale, pull, ..
            } => self.push_rows(from, (&parts, scale, &pull), &lens, inline_bytes),
            Request::Save { dir } => self.start_save(from, w, &dir),
            Request::Abort {
                message,
                agreed: true,
            } => {
                // Every worker stops with it and says so: nobody to tell.
                self.done[w] = true;
                self.ended = self.ended.take().or(Some(message));
                Ok(())
            }
            Request::Abort { message, .. } => {
                self.done[w] = true;
                // Named by its sender (a worker's errors mostly name it already).
                let by = self.roles.task(from);
                let message = match message.starts_with(&by) {
                    true => message,
                    false => format!("{by}: {message}"),
                };
                self.abort_all(from, &message);
                Err(PsError::Aborted {
                    task: self.me(),
                    message,
                })
            }
            Request::Done { stop } => {
                self.done[w] = true;
                self.stopped = self.stopped.or(stop);
                Ok(())
            }
        }
    }

    /// A gradient push: its payload taken where its verdict says, its pull (if it came
    /// with one) parked, the update applied once the step is complete.
    fn push(
        &mut self,
        from: usize,
        w: usize,
        request: Request,
        lens: &[usize],
        inline_bytes: &[u8],
    ) -> Result<(), PsError> {
        let Request::Push {
            step,
            samples,
            loss,
            stop,
            times,
            ref non_finite,
            pull,
            ..
        } = request
        else {
            unreachable!("push is called on pushes")
        };
        if let Some(signal) = stop {
            self.note_stop(signal);
        }
        if let Some(t) = times {
            self.reports.entry(from).or_default().add(&t);
        }
        // Asynchronous: the first finding refuses training from here on (a synchronous
        // ps counts a step's findings once it is complete).
        if let (None, None, Some(found)) = (self.sync, &self.refused, non_finite) {
            let on = format!(" on {}", self.roles.task(from));
            self.refused = Some(found.clone().seen(on));
        }
        let verdict = self.judge(w, step, &request);
        let into = match &verdict {
            Verdict::Apply => Dest::Apply,
            Verdict::Accept => Dest::Staged(w),
            Verdict::Stale | Verdict::Reject(_) => Dest::Drop,
        };
        if let Err(e) = self.take_payload(from, lens, inline_bytes, into)? {
            return self.error(from, e);
        }
        // The pull that came with the push is answered in its place (parked first: the
        // update below may make it ready).
        let answered = match pull {
            Some(then) if !matches!(verdict, Verdict::Reject(_)) => {
                self.pending.push(Parked::new(from, then));
                true
            }
            _ => false,
        };
        let found = non_finite.clone();
        let pushed = (samples as f32, loss.unwrap_or(f32::NAN));
        self.settle(from, w, verdict, answered, pushed, found)
    }

    /// What follows a push's `verdict` once its payload is in: an error, the stale reply,
    /// or the update counted (`pushed`: its samples and loss; `found`: what its worker
    /// found not finite); `answered`: its pull is parked.
    fn settle(
        &mut self,
        from: usize,
        w: usize,
        verdict: Verdict,
        answered: bool,
        pushed: (f32, f32),
        found: Option<crate::train::guard::NonFinite>,
    ) -> Result<(), PsError> {
        match verdict {
            Verdict::Reject(e) => self.error(from, e),
            Verdict::Stale if answered => self.answer_pending(),
            Verdict::Stale => {
                let step = self.global_step;
                self.reply(from, &Reply::Stale { step })
            }
            Verdict::Apply => {
                self.global_step += 1;
                self.clock.steps(1);
                self.last_loss = pushed.1;
                if !answered {
                    self.ok(from)?;
                }
                self.answer_pending()
            }
            Verdict::Accept => {
                self.accum.insert(w, pushed);
                if let Some(found) = found {
                    self.non_finite.insert(w, found);
                }
                if !answered {
                    self.ok(from)?;
                }
                if self.accum.len() >= self.sync.unwrap_or(1) {
                    self.apply_accumulated();
                    self.answer_pending()?;
                }
                Ok(())
            }
        }
    }

    /// What becomes of worker `w`'s push `request` for `step` (judged on its header,
    /// before its payload is taken).
    fn judge(&self, w: usize, step: u64, request: &Request) -> Verdict {
        let Request::Push { vars, .. } = request else {
            unreachable!("judge is called on pushes")
        };
        if !self.initialized {
            return Verdict::Reject("push before the variables were initialised".into());
        }
        if let Err(e) = self.check_vars(vars) {
            return Verdict::Reject(e);
        }
        // After a step not applied every push is dropped; its pull gets the verdict.
        if self.refused.is_some() {
            return Verdict::Stale;
        }
        if self.sync.is_none() {
            return Verdict::Apply;
        }
        if step < self.global_step || self.accum.contains_key(&w) && step == self.global_step {
            return Verdict::Stale;
        }
        if step > self.global_step {
            return Verdict::Reject(format!(
                "push for step {step} ahead of global step {}",
                self.global_step
            ));
        }
        Verdict::Accept
    }
}
