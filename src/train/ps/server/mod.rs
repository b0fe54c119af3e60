//! A ps task's server: holds its shards of the variables, applies the optimizer, and
//! answers workers' requests as they arrive (`MPI_Improbe` + `MPI_Mrecv` on any source);
//! pulls that must wait for a step are parked, never block the loop.
//!
//! A request's payload (see [`super::protocol`]; a small one is read out of its header's
//! message instead) is received where it goes: initial values
//! into the parameters, an asynchronous gradient piece by piece into a piece buffer and
//! applied while it is in cache, a synchronous one into that worker's buffer for the
//! step (summed in worker order once the step is complete: one update per step, the same
//! bits whatever order the pushes arrived in). A rejected or stale push's payload is still
//! taken, so the next one starts clean. Pulls are answered from the parameters' memory.
//!
//! It needs no model and no settings of its own: the chief's `Init` or `Restore` says
//! which shards it holds, the optimizer and whether replicas are synchronous (see
//! [`super::protocol::Setup`]). It serves until every worker is done, or stops, telling
//! every worker why, when one is lost or aborts.
//!
//! **Stops** (a preemption signal): a ps learns that the job is asked to stop from a
//! push that carries a signal, or from a stop signal of its own. From then on its pull
//! replies carry the signal, from the first global step `S` no reply has yet been sent
//! for (synchronous: the step after the current one, so every worker's pull of one step
//! gets the same answer and all stop after the same step; asynchronous: at once). Every
//! worker stops at the first reply that carries it (the chief checkpoints), and says so
//! when it is done; the ps then ends with the stop too.
//!
//! **Steps not finite**: a push may say its worker's loss or gradients were not finite.
//! Synchronous, when the step is complete and any push said so, nothing is applied;
//! asynchronous, the first such push is not applied. Every pull, from then on, is
//! answered with the verdict (the first such worker's finding and, synchronous, how many
//! of the step's workers had one; asynchronous, which worker), every push is dropped, and
//! the ps ends with the verdict once every worker said it is done: one error on every
//! rank.
//! **Agreed errors**: an abort marked agreed (every worker stops with it and prints it, a
//! pipeline's replica tasks) only marks its worker done; the ps ends with it, quietly.

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::placement::Shard;
use super::protocol::{encode, reply_tag, request_tag, Reply, Setup};
use super::roles::Roles;
use super::store::Store;
use super::wire::{notify, send_all_taking, Outgoing, Sent};
use super::{shards, PsError};
use crate::model::embedding::Table;
use crate::observe::phases::{Clock, Phase, Times};
use crate::observe::stall;
use crate::observe::timeline::{self, Detail};
use crate::train::checkpoint;
use crate::train::guard::NonFinite;
use crate::train::optim::{Optimizer, OptimizerKind, Slots};
use crate::train::resources::Share;
use crate::train::tables::Served;
use crate::transport::comm::{Backoff, Comm, TransportError, ANY_SOURCE};
use crate::transport::messages;
use flight::Flights;

mod files;
mod flight;
mod payload;
mod requests;
mod rows;
mod steps;
use steps::{apply_all, Parked};

/// Serves ps task `k` (this rank) until every worker is done. The error names the lost
/// or aborting task, or is [`PsError::Stopped`] when the workers stopped for a signal.
pub fn serve<C: Comm>(comm: &C, roles: &Roles, k: usize, timeout: Duration) -> Result<(), PsError> {
    serve_many(&[(comm, roles)], k, timeout, None)
}

/// [`serve`] within `memory`, this task's share of its node: a request that makes the
/// tables' rows grow past it fails, naming the table, and so does training.
pub fn serve_within<C: Comm>(
    comm: &C,
    roles: &Roles,
    k: usize,
    timeout: Duration,
    memory: Option<Share>,
) -> Result<(), PsError> {
    serve_many(&[(comm, roles)], k, timeout, memory)
}

/// Serves ps task `k` of several jobs at once, from this thread: each a communicator with
/// its roles (a pipeline's stages, each stage's workers with the ps tasks on a
/// communicator of their own), polled in turn until every worker of every job is done.
pub fn serve_many<C: Comm>(
    jobs: &[(&C, &Roles)],
    k: usize,
    timeout: Duration,
    memory: Option<Share>,
) -> Result<(), PsError> {
    let mut servers: Vec<Server<'_, C>> = jobs
        .iter()
        .map(|(comm, roles)| Server::new(*comm, roles, k, timeout))
        .collect();
    for s in &mut servers {
        s.memory.clone_from(&memory);
    }
    let mut backoff = Backoff::polling_mpi(Duration::from_micros(200));
    let mut idle_since = vec![None; servers.len()];
    while !servers.iter().all(Server::finished) {
        let mut handled = false;
        for (server, idle) in servers.iter_mut().zip(&mut idle_since) {
            if !server.finished() {
                handled |= server.poll(idle)?;
            }
        }
        match handled {
            true => backoff.reset(),
            false => backoff.idle(),
        }
    }
    for s in &mut servers {
        s.land_flights()?;
    }
    if let Some(why) = servers.iter().find_map(|s| s.refused.clone()) {
        return Err(PsError::NotApplied(why));
    }
    if let Some(message) = servers.iter().find_map(|s| s.ended.clone()) {
        return Err(PsError::Ended(message));
    }
    match servers
        .iter()
        .find_map(|s| s.stopped.map(|sig| (sig, s.global_step)))
    {
        Some((signal, step)) => Err(PsError::Stopped(crate::train::Stopped {
            signal: crate::signals::name(signal),
            step,
            checkpoint: None,
        })),
        None => Ok(()),
    }
}

/// What a worker's gradient for the current step brought besides the gradient (kept in
/// [`Server::staged`]): its samples and loss.
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
    /// The pipeline stage whose variables this server holds (see [`Setup::stage`]).
    stage: Option<usize>,
    global_step: u64,
    initialized: bool,
    /// Parked pulls.
    pending: Vec<Parked>,
    /// Workers whose gradient for the current step arrived, with its samples and loss.
    accum: BTreeMap<usize, Pushed>,
    /// Those of them whose loss or gradients were not finite, with what they found.
    non_finite: BTreeMap<usize, NonFinite>,
    /// A step not applied for them: every pull from then on is answered with this.
    refused: Option<NonFinite>,
    /// The error every worker stopped with, agreed among them (see `Request::Abort`).
    ended: Option<String>,
    /// Per worker, its gradient for the current step, received there.
    staged: Vec<Vec<f32>>,
    /// Where a piece applied as it arrives (or dropped) is received.
    piece: Vec<f32>,
    /// The step's gradients, each weighted by its samples, summed in worker order when
    /// the step is complete: one buffer and one update per step, and the same bits
    /// whatever order the pushes arrived in.
    sum: Vec<f32>,
    /// Where requests land, reused from one to the next.
    inbox: Vec<u8>,
    /// Replies of rows (each its header's words, then the rows gathered in place) still
    /// being sent, and messages for the next ones.
    flights: Flights<C::Request>,
    /// Requests taken while this ps's replies were being sent, served before any new one
    /// (see [`send_all_taking`]).
    backlog: RefCell<VecDeque<(usize, Vec<u8>)>>,
    /// This ps's rows of the embedding tables (see [`Setup::tables`]).
    tables: Vec<Table>,
    /// The requests each table served.
    served: Vec<Served>,
    /// The memory this task may use: rows beyond it fail the request that made them.
    memory: Option<Share>,
    /// Rows pulled or a sparse gradient pushed, reused from one request to the next.
    rows: Vec<f32>,
    last_loss: f32,
    /// A stop signal, and the first global step whose pull replies announce it.
    stop: Option<(i32, u64)>,
    /// The stop signal a worker said it stopped for when done.
    stopped: Option<i32>,
    done: Vec<bool>,
    heard: Vec<Instant>,
    timeout: Duration,
    /// A save's or a restore's file work under way (see [`files`]).
    background: Option<files::Background>,
    /// The worker whose latest request was a save or a restore: the checkpoint is under
    /// way until its next request, and no worker is waited on meanwhile (see [`files`]).
    excused: Option<usize>,
    /// This ps's own phase times since the chief last asked.
    clock: Clock,
    /// The workers' phase times reported to this ps since the chief last asked, by rank.
    reports: BTreeMap<usize, Times>,
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
            stage: None,
            global_step: 0,
            initialized: false,
            pending: Vec::new(),
            accum: BTreeMap::new(),
            non_finite: BTreeMap::new(),
            refused: None,
            ended: None,
            staged: vec![Vec::new(); nw],
            piece: Vec::new(),
            sum: Vec::new(),
            inbox: Vec::new(),
            flights: Flights::default(),
            backlog: RefCell::new(VecDeque::new()),
            tables: Vec::new(),
            served: Vec::new(),
            memory: None,
            rows: Vec::new(),
            last_loss: f32::NAN,
            stop: None,
            stopped: None,
            done: vec![false; nw],
            heard: vec![Instant::now(); nw],
            timeout,
            background: None,
            excused: None,
            clock: Clock::new(),
            reports: BTreeMap::new(),
        }
    }

    fn me(&self) -> String {
        self.roles.task(self.comm.rank())
    }

    fn reply(&self, to: usize, reply: &Reply) -> Result<(), PsError> {
        let message = encode(reply);
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
        match self.send_all(&[(message, to, tag)])? {
            Sent::Done => Ok(()),
            // Not taken within the timeout, or a request meanwhile from a worker that
            // stopped halfway (no peer is watched: nothing interrupts).
            Sent::TimedOut { to: gone } => Err(self.lose(gone)),
            Sent::Interrupted(_) => Err(self.lose(to)),
        }
    }

    /// Sends `out` within the timeout, taking the requests that arrive meanwhile into the
    /// backlog ([`send_all_taking`]).
    fn send_all(&self, out: &[Outgoing<'_>]) -> Result<Sent, TransportError> {
        let mut backlog = self.backlog.borrow_mut();
        send_all_taking(self.comm, out, self.timeout, &mut backlog)
    }

    /// Tells every worker but `except` (and those done) that training stops, and why.
    fn abort_all(&self, except: usize, message: &str) {
        let m = encode(&Reply::Error {
            message: message.to_string(),
        });
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

    /// Checks a push's variable list (what its payload holds) against this ps's shards.
    fn check_vars(&self, got: &[(String, usize)]) -> Result<(), String> {
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
        self.tables = rows::tables(setup)?;
        self.served = vec![Served::default(); self.tables.len()];
        self.opt = setup.optimizer;
        self.stage = setup.stage;
        self.sync = setup.sync.map(|s| s.replicas_to_aggregate);
        self.store = Store::new(mine.iter().map(|s| s.len));
        self.slots = mine.iter().map(|s| self.opt.state(s.len)).collect();
        self.shards = mine;
        self.accum.clear();
        self.non_finite.clear();
        self.sum = vec![0.0; self.store.len()];
        self.global_step = 0;
        Ok(())
    }

    fn snapshot(&self) -> checkpoint::Arrays {
        let mut a = shards::arrays(
            self.k,
            &self.shards,
            &self.store.shards(),
            &self.slots,
            self.global_step,
        );
        a.arrays
            .extend(checkpoint::tables::table_arrays(&self.tables));
        a
    }

    /// Tells a stall watch whether this ps waits on a step's pushes (then since when) or
    /// is idle.
    fn mark_board(&self) {
        let board = stall::Board::global();
        if self.background.is_some() {
            board.serving(|| stall::Wait {
                op: "checkpoint file",
                step: self.global_step,
                what: None,
                peer: None,
                bytes: 0,
            });
        } else if self.sync.is_some() && (!self.accum.is_empty() || !self.pending.is_empty()) {
            board.serving(|| stall::Wait {
                op: "gather of pushes",
                step: self.global_step,
                what: None,
                peer: None,
                bytes: 0,
            });
        } else {
            board.idle();
        }
    }

    /// A worker this ps waits on and has not heard from within the timeout, at `now`;
    /// none while a checkpoint is under way (see [`files`]).
    fn lost(&self, now: Instant) -> Option<usize> {
        if self.background.is_some() || self.excused.is_some() {
            return None;
        }
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
        (0..self.done.len()).find(|w| waiting_on(*w) && now - self.heard[*w] > self.timeout)
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

    /// Tests the replies of rows in flight; a worker that has not taken one within the
    /// timeout is lost.
    fn tend_flights(&mut self) -> Result<(), PsError> {
        match self.flights.tend(self.comm, self.timeout)? {
            Some(gone) => Err(self.lose(gone)),
            None => Ok(()),
        }
    }

    /// Waits for the replies of rows in flight when every worker is done (each took its
    /// replies before it said so: they complete at once).
    fn land_flights(&mut self) -> Result<(), PsError> {
        match self.flights.drain(self.comm, self.timeout)? {
            Some(gone) => Err(self.lose(gone)),
            None => Ok(()),
        }
    }

    /// True once every worker is done.
    fn finished(&self) -> bool {
        self.done.iter().all(|d| *d)
    }

    /// Takes one request if one has arrived and handles it; `false`: none had. `idle_since`:
    /// since when this server has polled with no request (one span on the timeline).
    fn poll(&mut self, idle_since: &mut Option<Instant>) -> Result<bool, PsError> {
        if let Some(signal) = crate::signals::stop_requested() {
            self.note_stop(signal);
        }
        self.tend()?;
        self.tend_flights()?;
        let mut inbox = std::mem::take(&mut self.inbox);
        let t = Instant::now();
        let backlogged = self.backlog.borrow_mut().pop_front();
        let got = match backlogged {
            Some((from, bytes)) => {
                inbox = bytes;
                Some(from)
            }
            None => match messages::try_receive_into(
                self.comm,
                ANY_SOURCE,
                request_tag(self.comm),
                self.timeout,
                &mut inbox,
            ) {
                Err(TransportError::Timeout { peer, .. }) => return Err(self.lose(peer)),
                other => other?,
            },
        };
        // Handling a request is communication but for the updates it makes (compute,
        // charged where they are made); polling for one is waiting.
        let computed = self.clock.charged(Phase::Compute);
        let handled = got.map(|from| self.handle(from, &inbox));
        self.inbox = inbox;
        match handled {
            Some(handled) => {
                let end = Instant::now();
                let d = (end - t).as_secs_f64() - (self.clock.charged(Phase::Compute) - computed);
                self.clock
                    .charge(Phase::Comm, std::time::Duration::from_secs_f64(d.max(0.0)));
                if let Some(i) = idle_since.take() {
                    timeline::span("idle", "wait", i, t, Detail::default());
                }
                let at = Detail::at(self.global_step);
                timeline::span("request", "comm", t, end, at);
                handled.map(|()| true)
            }
            None => {
                self.mark_board();
                let now = Instant::now();
                if let Some(w) = self.lost(now) {
                    return Err(self.lose(self.roles.workers[w]));
                }
                self.clock.charge(Phase::Wait, now - t);
                *idle_since = idle_since.or(Some(t));
                Ok(false)
            }
        }
    }
}
