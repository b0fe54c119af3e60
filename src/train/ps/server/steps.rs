//! A ps's steps: pulls parked until their step, answered together once it is applied;
//! the step's gradients summed and applied once every worker pushed; stop signals
//! announced from a step on.

use std::time::Instant;

use super::Server;
use crate::observe::phases::{Phase, RankTimes};
use crate::observe::stall;
use crate::observe::timeline::Detail;
use crate::train::optim::{Optimizer, Slots};
use crate::train::ps::protocol::{
    encode, encode_with, f32_bytes, finite, inline, payload_tag, reply_tag, Reply, Then,
    PIECE_FLOATS,
};
use crate::train::ps::store::Store;
use crate::train::ps::wire::Sent;
use crate::train::ps::PsError;
use crate::transport::comm::Comm;

/// A pull waiting for its step.
#[derive(Debug, Clone, Copy)]
pub(super) struct Parked {
    pub(super) from: usize,
    pub(super) step: u64,
    pub(super) since: Instant,
    /// When its worker was last told this ps is alive (see [`files`]).
    pub(super) told: Instant,
    /// The chief asks for the phase times gathered here.
    pub(super) report: bool,
}

impl Parked {
    /// Worker rank `from`'s pull `then`, parked now.
    pub(super) fn new(from: usize, then: Then) -> Parked {
        let since = Instant::now();
        Parked {
            from,
            step: then.step,
            since,
            told: since,
            report: then.report,
        }
    }
}

impl<C: Comm> Server<'_, C> {
    /// The job is asked to stop by `signal`: announced from the first global step no pull
    /// has been answered at yet (see the module's stop rule).
    pub(super) fn note_stop(&mut self, signal: i32) {
        if self.stop.is_none() {
            let at = self.global_step + u64::from(self.sync.is_some());
            self.stop = Some((signal, at));
        }
    }

    /// The stop pull replies at the current global step announce.
    pub(super) fn announced_stop(&self) -> Option<i32> {
        let (signal, at) = self.stop?;
        (self.global_step >= at).then_some(signal)
    }

    pub(super) fn ready(&self, step: u64) -> bool {
        self.refused.is_some()
            || self.initialized && (self.sync.is_none() || self.global_step >= step)
    }

    pub(super) fn answer_pending(&mut self) -> Result<(), PsError> {
        let (ready, waiting): (Vec<Parked>, Vec<Parked>) =
            self.pending.iter().partition(|p| self.ready(p.step));
        self.pending = waiting;
        if ready.is_empty() {
            return Ok(());
        }
        // A worker can send nothing while its pull waits: its silence counts from now.
        let now = Instant::now();
        for w in ready.iter().filter_map(|p| self.roles.worker_index(p.from)) {
            self.heard[w] = now;
        }
        if let Some(why) = self.refused.clone() {
            // No parameters after a step not applied: the verdict, to every pull.
            let verdict = Reply::NotApplied { why };
            return ready.iter().try_for_each(|p| self.reply(p.from, &verdict));
        }
        // Every ready pull at once: its header (how long it waited; the chief's, the phase
        // times), then the parameters from their memory (small ones in the header's
        // message).
        let mut reports: Vec<Vec<RankTimes>> = ready
            .iter()
            .map(|p| match p.report {
                true => self.take_reports(),
                false => Vec::new(),
            })
            .collect();
        let shards = self.store.shards();
        let small = inline(shards.iter().map(|s| s.len()));
        let headers: Vec<Vec<u8>> = ready
            .iter()
            .zip(&mut reports)
            .map(|(p, reports)| {
                let params = Reply::Params {
                    step: self.global_step,
                    loss: finite(self.last_loss),
                    stop: self.announced_stop(),
                    held_us: p.since.elapsed().as_micros() as u64,
                    reports: std::mem::take(reports),
                };
                match small {
                    true => encode_with(&params, &shards),
                    false => encode(&params),
                }
            })
            .collect();
        let (rep, data) = (reply_tag(self.comm), payload_tag(self.comm));
        let mut out = Vec::new();
        for (header, p) in headers.iter().zip(&ready) {
            let to = &p.from;
            out.push((&header[..], *to, rep));
            if small {
                continue;
            }
            for piece in shards.iter().flat_map(|s| s.chunks(PIECE_FLOATS)) {
                out.push((f32_bytes(piece), *to, data));
            }
        }
        let waiting = stall::wait(|| stall::Wait {
            op: "reply",
            step: self.global_step,
            what: None,
            peer: Some(
                ready
                    .iter()
                    .map(|p| self.roles.task_name(p.from))
                    .collect::<Vec<_>>()
                    .join(", ")
                    .into(),
            ),
            bytes: shards.iter().map(|s| 4 * s.len() as u64).sum(),
        });
        let sent = self.send_all(&out);
        drop(waiting);
        if matches!(sent, Ok(Sent::Done)) {
            return Ok(());
        }
        // Sends may still be in flight: MPI may read the parameters' memory and the
        // header for as long as the process lives.
        drop(out);
        std::mem::forget(headers);
        std::mem::forget(std::mem::replace(&mut self.store, Store::new([])));
        let to = match sent? {
            Sent::TimedOut { to } => to,
            // No peer is watched: nothing interrupts.
            Sent::Done | Sent::Interrupted(_) => ready[0].from,
        };
        Err(self.lose(to))
    }

    /// One update from the step's gradients, averaged weighted by each worker's samples
    /// (the gradient of the combined batch), summed in worker order (the same bits
    /// whatever order the pushes arrived in) from where they were received. Nothing is
    /// applied if a worker found its loss or gradients not finite: the step is refused,
    /// named by the first such worker's finding (in worker order: every ps names the same
    /// one) and how many of the step's workers had one.
    pub(super) fn apply_accumulated(&mut self) {
        if let Some((_, first)) = self.non_finite.first_key_value() {
            let on = format!(
                " on {} of {} workers",
                self.non_finite.len(),
                self.accum.len()
            );
            self.refused = Some(first.clone().seen(on));
            self.accum.clear();
            self.non_finite.clear();
            return;
        }
        let t = Instant::now();
        let total: f32 = self.accum.values().map(|a| a.0).sum();
        let loss = self.accum.values().map(|(n, l)| l * n / total).sum();
        for (k, (&w, &(n, _))) in self.accum.iter().enumerate() {
            let weighted = self.sum.iter_mut().zip(&self.staged[w]);
            if k == 0 {
                weighted.for_each(|(s, g)| *s = g * n);
            } else {
                weighted.for_each(|(s, g)| *s += g * n);
            }
        }
        self.accum.clear();
        let scale = 1.0 / total;
        self.sum.iter_mut().for_each(|g| *g *= scale);
        apply_all(&self.opt, &mut self.store, &mut self.slots, &self.sum);
        self.global_step += 1;
        self.last_loss = loss;
        let at = Detail::at(self.global_step);
        self.clock.since_as(Phase::Compute, t, "update", at);
        self.clock.steps(1);
    }

    /// This ps's phase times and the workers' reported to it, since the chief last asked.
    pub(super) fn take_reports(&mut self) -> Vec<RankTimes> {
        let me = self.comm.rank();
        let mut out = vec![RankTimes {
            rank: me,
            task: self.roles.task_name(me),
            times: self.clock.take(),
        }];
        out.extend(
            std::mem::take(&mut self.reports)
                .into_iter()
                .map(|(rank, times)| RankTimes {
                    rank,
                    task: self.roles.task_name(rank),
                    times,
                }),
        );
        out
    }
}

/// One update of every shard of `store` from `grads`, the shards' gradients end to end.
pub(super) fn apply_all(opt: &Optimizer, store: &mut Store, slots: &mut [Slots], grads: &[f32]) {
    for (i, s) in slots.iter_mut().enumerate() {
        let r = store.range(i);
        opt.apply(&mut store.all_mut()[r.clone()], &grads[r], s);
    }
}
