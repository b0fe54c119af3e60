//! Serving a ps's rows beside its windows: each poll applies a step every worker pushed or
//! writes a checkpoint asked for, and sees a worker lost or ended.

use std::time::Instant;

use super::super::worker::AGREED;
use super::super::RowsOnPs;
use super::super::*;
use super::{fresh_tables, Serving};
use crate::transport::comm::Backoff;
use crate::transport::window::Access;

/// What a poll of a ps's rows found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::train::ps::rma::rows) enum Polled {
    /// Nothing to do.
    Idle,
    /// A step applied, or a checkpoint written.
    Worked,
    /// Every worker ended ([`Beside::verdict`] says how).
    Ended,
}

/// A ps's rows with what serving them takes: its windows, the job's roles and layout.
pub(in crate::train::ps::rma) struct Beside<'a, D: Access<f32>, K: Access<i64>> {
    pub(in crate::train::ps::rma::rows) ps: Serving,
    pub(in crate::train::ps::rma::rows) roles: &'a Roles,
    pub(in crate::train::ps::rma::rows) cfg: &'a RowsConfig,
    pub(in crate::train::ps::rma::rows) lay: &'a Layout,
    pub(in crate::train::ps::rma::rows) data: &'a mut D,
    pub(in crate::train::ps::rma::rows) ctl: &'a K,
}

impl<D: Access<f32>, K: Access<i64>> Beside<'_, D, K> {
    /// Serves what has come: a step every worker pushed is applied, a checkpoint the
    /// chief asked for written; a worker that ended while the others pushed, or that
    /// pushed nothing within the timeout of a step the others pushed, ends this ps.
    pub(in crate::train::ps::rma::rows) fn poll(&mut self) -> Result<Polled, PsError> {
        let (roles, cfg, lay, ctl) = (self.roles, self.cfg, self.lay, self.ctl);
        let ps = &mut self.ps;
        let me = roles.ps[ps.k];
        let nw = lay.nw as i64;
        ctl.poke()?;
        let mut words = [0i64; 8];
        ctl.read_atomic(me, STEP, &mut words)?;
        let (arrived, ended) = (
            words[ARRIVALS],
            words[ENDED] % AGREED + words[ENDED] / AGREED,
        );
        ps.ended = words[ENDED];
        if ended >= nw {
            return Ok(Polled::Ended);
        }
        if cfg.asynchronous {
            let asked = words[SAVE_AT] as u64;
            return ps.save_when_pushed((roles, cfg, lay), self.data, ctl, asked);
        }
        if arrived >= nw {
            ps.apply(roles, cfg, lay, self.data, ctl)?;
            return Ok(Polled::Worked);
        }
        if arrived > 0 && arrived + ended >= nw {
            // Some pushed this step and one ended: if it ended without pushing the step,
            // it failed (it says why); if every one that ended pushed it first, the step
            // waits for the others' pushes as any step does.
            if let Some(late) = ps.late(lay, ctl, me, (ABORT_ENDED, true))? {
                return Err(PsError::Aborted {
                    task: roles.task(me),
                    message: format!(
                        "{} ended at step {}, which the others pushed",
                        roles.task(roles.workers[late]),
                        ps.step
                    ),
                });
            }
        }
        if words[SAVE_AT] as u64 == ps.step && ps.saved < ps.step {
            ps.save(cfg, ctl, me)?;
            return Ok(Polled::Worked);
        }
        if words != ps.last.0 {
            ps.last = (words, Instant::now());
        } else if arrived > 0 && ps.last.1.elapsed() > cfg.peer_timeout {
            let late = ps.late(lay, ctl, me, (ABORT_LOST, false))?.unwrap_or(0);
            return Err(PsError::Lost {
                task: roles.task(me),
                lost: format!(
                    "{} (no push of step {})",
                    roles.task(roles.workers[late]),
                    ps.step
                ),
                secs: cfg.peer_timeout.as_secs(),
            });
        }
        Ok(Polled::Idle)
    }

    /// Serves the workers until every one ended; how they ended.
    pub(in crate::train::ps::rma::rows) fn serve(mut self) -> Result<(), PsError> {
        let ended = |b: &Self, p: Polled| (p == Polled::Ended).then(|| b.verdict());
        self.serve_until(None, ended, |_| unreachable!("no deadline"))
    }

    /// Polls until `done` says how serving ends, or `deadline` passes (then `late` says
    /// why).
    fn serve_until(
        &mut self,
        deadline: Option<std::time::Duration>,
        mut done: impl FnMut(&Self, Polled) -> Option<Result<(), PsError>>,
        late: impl Fn(&Self) -> PsError,
    ) -> Result<(), PsError> {
        let mut backoff = Backoff::polling_mpi(std::time::Duration::from_micros(200));
        let since = Instant::now();
        loop {
            let polled = self.poll()?;
            if let Some(end) = done(self, polled) {
                return end;
            }
            if deadline.is_some_and(|d| since.elapsed() > d) {
                return Err(late(self));
            }
            match polled {
                Polled::Worked => backoff.reset(),
                _ => backoff.idle(),
            }
        }
    }

    /// Every worker ended: a failure one had alone, the stop they had, or done.
    fn verdict(&self) -> Result<(), PsError> {
        self.ps.finish(self.roles, self.ctl, self.ps.ended)
    }
}

impl<D: Access<f32>, K: Access<i64>> RowsOnPs for Beside<'_, D, K> {
    fn poll(&mut self) -> Result<(), PsError> {
        Beside::poll(self).map(drop)
    }

    fn reach(&mut self, step: u64) -> Result<(), PsError> {
        let not_pushed = |b: &Self| {
            PsError::Setup(format!(
                "{}: the rows of step {step} were not pushed by every worker",
                b.roles.task(b.roles.ps[b.ps.k])
            ))
        };
        let reached = |b: &Self, p: Polled| match (b.ps.step >= step, p) {
            (true, _) => Some(Ok(())),
            (false, Polled::Ended) => Some(Err(not_pushed(b))),
            _ => None,
        };
        let timeout = self.cfg.peer_timeout;
        self.serve_until(Some(timeout), reached, not_pushed)
    }

    fn arrays(&self) -> Vec<(String, Vec<f32>)> {
        checkpoint::tables::table_arrays(&self.ps.tables)
    }

    fn snapshot(&mut self) -> Result<Vec<(String, Vec<f32>)>, PsError> {
        let me = self.roles.ps[self.ps.k];
        (self.ps).read_window((self.cfg, self.lay, me), self.data, self.ctl)?;
        let arrays = self.arrays();
        // Read anew at each checkpoint: the window holds the rows meanwhile.
        self.ps.tables = fresh_tables(self.cfg);
        Ok(arrays)
    }

    fn finish(&mut self) -> Result<(), PsError> {
        let ended = |b: &Self, p: Polled| (p == Polled::Ended).then(|| b.verdict());
        let lost = |b: &Self| PsError::Lost {
            task: b.roles.task(b.roles.ps[b.ps.k]),
            lost: "a worker (its rows not ended)".into(),
            secs: b.cfg.peer_timeout.as_secs(),
        };
        let timeout = 2 * self.cfg.peer_timeout;
        self.serve_until(Some(timeout), ended, lost)
    }
}
