//! A ps task's server: holds its shards of the variables, applies the optimizer, and
//! answers workers' requests as they arrive (`MPI_Improbe` + `MPI_Mrecv` on any source);
//! pulls that must wait for a step are parked, never block the loop.
//!
//! It needs no model and no settings of its own: the chief's `Init` or `Restore` says
//! which shards it holds, the optimizer and whether replicas are synchronous (see
//! [`super::protocol::Setup`]). It serves until every worker is done, or stops, telling
//! every worker why, when one is lost or aborts.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use super::placement::Shard;
use super::protocol::{decode_view, encode, finite, reply_tag, request_tag, Reply, Request, Setup};
use super::roles::Roles;
use super::store::Store;
use super::wire::{notify, send_within, Sent};
use super::{shards, PsError};
use crate::train::checkpoint;
use crate::train::optim::{Optimizer, OptimizerKind, Slots};
use crate::transport::comm::{Backoff, Comm, TransportError, ANY_SOURCE};

/// Serves ps task `k` (this rank) until every worker is done; the error names the lost
/// or aborting task.
pub fn serve<C: Comm>(comm: &C, roles: &Roles, k: usize, timeout: Duration) -> Result<(), PsError> {
    Server::new(comm, roles, k, timeout).serve()
}

/// What a worker's gradient for the current step brought besides the gradient (its
/// message is kept in [`Server::staged`]): its samples and loss.
type Pushed = (f32, f32);

struct Server<'a, C: Comm> {
    comm: &'a C,
    roles: &'a Roles,
    k: usize,
    shards: Vec<Shard>,
    /// The parameters, answered to pulls in place.
    store: Store,
    slots: Vec<Slots>,
    opt: Optimizer,
    /// Gradients per update when synchronous.
    sync: Option<usize>,
    global_step: u64,
    initialized: bool,
    /// Parked pulls: (worker rank, step wanted).
    pending: Vec<(usize, u64)>,
    /// Workers whose gradient for the current step arrived, with its samples and loss.
    accum: BTreeMap<usize, Pushed>,
    /// Per worker, its push for the current step as it arrived (the receive buffer itself,
    /// swapped out of [`Server::inbox`]: no copy).
    staged: Vec<Vec<u8>>,
    /// The step's gradients, each weighted by its samples, summed in worker order when
    /// the step is complete: one buffer and one update per step, and the same bits
    /// whatever order the pushes arrived in.
    sum: Vec<f32>,
    /// Where requests land, reused from one to the next.
    inbox: Vec<u8>,
    last_loss: f32,
    done: Vec<bool>,
    heard: Vec<Instant>,
    timeout: Duration,
}

impl<'a, C: Comm> Server<'a, C> {
    fn new(comm: &'a C, roles: &'a Roles, k: usize, timeout: Duration) -> Self {
        let nw = roles.workers.len();
        Server {
            comm,
            roles,
            k,
            shards: Vec::new(),
            store: Store::new([]),
            slots: Vec::new(),
            opt: Optimizer::new(OptimizerKind::Sgd, 0.0),
            sync: None,
            global_step: 0,
            initialized: false,
            pending: Vec::new(),
            accum: BTreeMap::new(),
            staged: vec![Vec::new(); nw],
            sum: Vec::new(),
            inbox: Vec::new(),
            last_loss: f32::NAN,
            done: vec![false; nw],
            heard: vec![Instant::now(); nw],
            timeout,
        }
    }

    fn me(&self) -> String {
        self.roles.task(self.comm.rank())
    }

    fn reply(&self, to: usize, reply: &Reply) -> Result<(), PsError> {
        let message = encode(reply, &[]);
        let sent = self.send_bytes(to, &message);
        if sent.is_err() {
            // The send may still be in flight: keep its bytes alive.
            std::mem::forget(message);
        }
        sent
    }

    /// Sends a reply's bytes to worker `to` within the timeout; one that does not take
    /// them is lost. After an error the send may still be in flight: the caller keeps the
    /// bytes alive.
    fn send_bytes(&self, to: usize, message: &[u8]) -> Result<(), PsError> {
        let tag = reply_tag(self.comm);
        let sent = send_within(self.comm, message, to, tag, self.timeout, None)?;
        if let Sent::Done(_) = sent {
            return Ok(());
        }
        let err = PsError::Lost {
            task: self.me(),
            lost: self.roles.task(to),
            secs: self.timeout.as_secs(),
        };
        self.abort_all(to, &err.to_string());
        Err(err)
    }

    /// Tells every worker but `except` (and those done) that training stops, and why.
    fn abort_all(&self, except: usize, message: &str) {
        let m = encode(
            &Reply::Error {
                message: message.to_string(),
            },
            &[],
        );
        let others = (self.roles.workers.iter().enumerate())
            .filter(|(i, r)| **r != except && !self.done[*i])
            .map(|(_, r)| *r);
        notify(self.comm, &m, others, reply_tag(self.comm));
    }

    fn error(&self, to: usize, message: String) -> Result<(), PsError> {
        self.reply(to, &Reply::Error { message })
    }

    fn ok(&self, to: usize) -> Result<(), PsError> {
        let step = self.global_step;
        self.reply(to, &Reply::Ok { step })
    }

    fn labels(&self) -> Vec<(String, usize)> {
        self.shards
            .iter()
            .map(|s| (format!("{}@{}", s.var, s.offset), s.len))
            .collect()
    }

    /// Checks a push's variable list and payload against this ps's shards.
    fn check_vars(&self, got: &[(String, usize)], payload: &[f32]) -> Result<(), String> {
        let want = self.labels();
        for (name, len) in got {
            match want.iter().find(|(n, _)| n == name) {
                None => {
                    return Err(format!(
                        "unknown variable '{name}' (ps:{} holds {})",
                        self.k,
                        want.iter()
                            .map(|w| w.0.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                }
                Some((_, l)) if l != len => {
                    return Err(format!(
                        "variable '{name}' has {l} elements on ps:{}, the push has {len}",
                        self.k
                    ))
                }
                _ => {}
            }
        }
        if got.len() != want.len() || got.iter().zip(&want).any(|(a, b)| a.0 != b.0) {
            return Err(format!(
                "push must list ps:{}'s variables in order: {:?}",
                self.k,
                want.iter().map(|w| &w.0).collect::<Vec<_>>()
            ));
        }
        let total: usize = want.iter().map(|w| w.1).sum();
        if payload.len() != total {
            return Err(format!(
                "push carries {} floats, the variables need {total}",
                payload.len()
            ));
        }
        Ok(())
    }

    /// Takes the chief's setup: this ps's shards, fresh optimizer state.
    fn configure(&mut self, setup: &Setup) -> Result<(), String> {
        let mine: Vec<Shard> = setup
            .shards
            .iter()
            .filter(|s| s.ps == self.k)
            .cloned()
            .collect();
        if setup.shards.iter().any(|s| s.ps >= self.roles.ps.len()) {
            return Err(format!(
                "the placement uses more ps tasks than the job's {}",
                self.roles.ps.len()
            ));
        }
        if let Some(rta) = setup.sync.map(|s| s.replicas_to_aggregate) {
            let nw = self.roles.workers.len();
            if rta == 0 || rta > nw {
                return Err(format!(
                    "replicas_to_aggregate {rta} is not between 1 and the {nw} workers"
                ));
            }
        }
        self.opt = setup.optimizer;
        self.sync = setup.sync.map(|s| s.replicas_to_aggregate);
        self.store = Store::new(mine.iter().map(|s| s.len));
        self.slots = mine.iter().map(|s| self.opt.state(s.len)).collect();
        self.shards = mine;
        self.accum.clear();
        self.sum = vec![0.0; self.store.len()];
        self.global_step = 0;
        Ok(())
    }

    fn ready(&self, step: u64) -> bool {
        self.initialized && (self.sync.is_none() || self.global_step >= step)
    }

    fn answer_pending(&mut self) -> Result<(), PsError> {
        let (ready, waiting): (Vec<_>, Vec<_>) =
            self.pending.iter().partition(|(_, s)| self.ready(*s));
        self.pending = waiting;
        if ready.is_empty() {
            return Ok(());
        }
        // One message for every ready pull, straight from the parameters' memory.
        let framed = self.store.frame(&Reply::Params {
            step: self.global_step,
            loss: finite(self.last_loss),
        });
        for (to, _) in ready {
            if let Err(e) = self.send_bytes(to, self.store.message(framed)) {
                // The send may still be in flight: MPI may read the parameters' memory
                // for as long as the process lives.
                std::mem::forget(std::mem::replace(&mut self.store, Store::new([])));
                return Err(e);
            }
        }
        Ok(())
    }

    /// Handles one request; `Err` stops the server (the workers were told).
    /// Handles one request, which arrived in `inbox` (a synchronous push keeps it: `inbox`
    /// is then another buffer to receive into).
    fn handle(&mut self, from: usize, inbox: &mut Vec<u8>) -> Result<(), PsError> {
        let Some(w) = self.roles.worker_index(from) else {
            return Ok(()); // not a worker: ignore
        };
        self.heard[w] = Instant::now();
        let Some((request, payload)) = decode_view::<Request>(inbox) else {
            return self.error(from, "malformed request".into());
        };
        match request {
            Request::Init { setup } => {
                if let Err(e) = self.configure(&setup) {
                    return self.error(from, e);
                }
                let vars = self.labels();
                if let Err(e) = self.check_vars(&vars, &payload) {
                    return self.error(from, e);
                }
                self.store.all_mut().copy_from_slice(&payload);
                self.initialized = true;
                self.ok(from)?;
                self.answer_pending()
            }
            Request::Restore { setup, path } => {
                let restored = self
                    .configure(&setup)
                    .and_then(|()| self.restore(&path, &setup.shards));
                match restored {
                    Ok(()) => {
                        self.ok(from)?;
                        self.answer_pending()
                    }
                    Err(e) => self.error(from, e),
                }
            }
            Request::Pull { step } => {
                self.pending.push((from, step));
                self.answer_pending()
            }
            Request::Push {
                step,
                samples,
                loss,
                vars,
            } => {
                let staged = self.push(from, w, step, samples, loss, &vars, &payload)?;
                if !staged {
                    return Ok(());
                }
                std::mem::swap(inbox, &mut self.staged[w]);
                if self.accum.len() >= self.sync.unwrap_or(1) {
                    self.apply_accumulated();
                    self.answer_pending()?;
                }
                Ok(())
            }
            Request::Save { dir } => {
                let file = shards::file(self.k);
                match checkpoint::write_file(&dir.join(&file), &self.snapshot()) {
                    Ok((bytes, checksum)) => self.reply(
                        from,
                        &Reply::Saved {
                            file,
                            bytes,
                            checksum,
                        },
                    ),
                    Err(e) => self.error(from, e.to_string()),
                }
            }
            Request::Abort { message } => {
                self.done[w] = true;
                self.abort_all(from, &message);
                Err(PsError::Remote {
                    task: self.me(),
                    message,
                })
            }
            Request::Done => {
                self.done[w] = true;
                Ok(())
            }
        }
    }

    /// A push: applied at once (async), or accepted for the current step, then `true`:
    /// the caller keeps its message in [`Server::staged`].
    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        from: usize,
        w: usize,
        step: u64,
        samples: usize,
        loss: Option<f32>,
        vars: &[(String, usize)],
        payload: &[f32],
    ) -> Result<bool, PsError> {
        if !self.initialized {
            self.error(from, "push before the variables were initialised".into())?;
            return Ok(false);
        }
        if let Err(e) = self.check_vars(vars, payload) {
            self.error(from, e)?;
            return Ok(false);
        }
        let loss = loss.unwrap_or(f32::NAN);
        let Some(rta) = self.sync else {
            // Applied from the message where it landed.
            for (i, s) in self.slots.iter_mut().enumerate() {
                let r = self.store.range(i);
                self.opt
                    .apply(&mut self.store.all_mut()[r.clone()], &payload[r], s);
            }
            self.global_step += 1;
            self.last_loss = loss;
            self.ok(from)?;
            self.answer_pending()?;
            return Ok(false);
        };
        if step < self.global_step || self.accum.contains_key(&w) && step == self.global_step {
            let step = self.global_step;
            self.reply(from, &Reply::Stale { step })?;
            return Ok(false);
        }
        if step > self.global_step {
            let ahead = format!(
                "push for step {step} ahead of global step {}",
                self.global_step
            );
            self.error(from, ahead)?;
            return Ok(false);
        }
        debug_assert!(self.accum.len() < rta);
        self.accum.insert(w, (samples as f32, loss));
        self.ok(from)?;
        Ok(true)
    }

    /// One update from the step's gradients, averaged weighted by each worker's samples
    /// (the gradient of the combined batch), summed in worker order (the same bits
    /// whatever order the pushes arrived in) from the messages as they arrived.
    fn apply_accumulated(&mut self) {
        let total: f32 = self.accum.values().map(|a| a.0).sum();
        let loss = self.accum.values().map(|(n, l)| l * n / total).sum();
        for (k, (&w, &(n, _))) in self.accum.iter().enumerate() {
            let (_, g) = decode_view::<Request>(&self.staged[w]).expect("checked on arrival");
            let weighted = self.sum.iter_mut().zip(g.iter());
            if k == 0 {
                weighted.for_each(|(s, g)| *s = g * n);
            } else {
                weighted.for_each(|(s, g)| *s += g * n);
            }
        }
        self.accum.clear();
        let scale = 1.0 / total;
        self.sum.iter_mut().for_each(|g| *g *= scale);
        for (i, s) in self.slots.iter_mut().enumerate() {
            let r = self.store.range(i);
            self.opt
                .apply(&mut self.store.all_mut()[r.clone()], &self.sum[r], s);
        }
        self.global_step += 1;
        self.last_loss = loss;
    }

    fn snapshot(&self) -> checkpoint::Arrays {
        shards::arrays(
            self.k,
            &self.shards,
            &self.store.shards(),
            &self.slots,
            self.global_step,
        )
    }

    /// Loads this ps's shards of checkpoint `dir`, of the variables `all` cut.
    fn restore(&mut self, dir: &Path, all: &[Shard]) -> Result<(), String> {
        let (params, slots, step) =
            shards::read(dir, &self.shards, all, &self.opt).map_err(|e| e.to_string())?;
        // All or nothing: only now replace the live state.
        for (i, p) in params.iter().enumerate() {
            let r = self.store.range(i);
            self.store.all_mut()[r].copy_from_slice(p);
        }
        self.slots = slots;
        self.global_step = step;
        self.initialized = true;
        Ok(())
    }

    /// A worker this ps waits on and has not heard from within the timeout.
    fn lost(&self) -> Option<usize> {
        let waiting_on = |w: usize| -> bool {
            if self.done[w] {
                return false;
            }
            if !self.initialized {
                return w == 0 && !self.pending.is_empty();
            }
            if self.sync.is_some() {
                // Only a step in progress needs gradients.
                (!self.accum.is_empty() || !self.pending.is_empty()) && !self.accum.contains_key(&w)
            } else {
                true
            }
        };
        (0..self.done.len()).find(|w| waiting_on(*w) && self.heard[*w].elapsed() > self.timeout)
    }

    fn lose(&self, rank: usize) -> PsError {
        let err = PsError::Lost {
            task: self.me(),
            lost: self.roles.task(rank),
            secs: self.timeout.as_secs(),
        };
        self.abort_all(rank, &err.to_string());
        err
    }

    fn serve(mut self) -> Result<(), PsError> {
        let mut backoff = Backoff::new(Duration::from_micros(200));
        while !self.done.iter().all(|d| *d) {
            let mut inbox = std::mem::take(&mut self.inbox);
            let got = match self.comm.try_receive_into(
                ANY_SOURCE,
                request_tag(self.comm),
                self.timeout,
                &mut inbox,
            ) {
                Err(TransportError::Timeout { peer, .. }) => return Err(self.lose(peer)),
                other => other?,
            };
            let handled = got.map(|from| self.handle(from, &mut inbox));
            self.inbox = inbox;
            match handled {
                Some(handled) => {
                    backoff.reset();
                    handled?;
                }
                None => {
                    if let Some(w) = self.lost() {
                        return Err(self.lose(self.roles.workers[w]));
                    }
                    backoff.idle();
                }
            }
        }
        Ok(())
    }
}
