//! The monitored training session of a ps worker: TensorFlow's
//! `MonitoredTrainingSession`, over the ps protocol.
//!
//! The chief (worker 0) initialises the variables on the ps tasks, or restores them from
//! the newest valid checkpoint; the other workers wait for it in their first pull. Each
//! [`MonitoredSession::run`] is one step: gradients of the caller's batch, pushed to the
//! ps tasks, and the parameters pulled back (in synchronous mode, those of the next
//! global step). Hooks run after each step: stop at a step, checkpoint every N steps or
//! seconds (the chief), log every N steps (the chief), and always a stop with a one-line
//! error, on every rank, at the first non-finite loss. [`MonitoredSession::close`] writes
//! the last checkpoint and tells the ps tasks this worker is done.
//!
//! ```no_run
//! # use mpiflow::train::ps::session::{MonitoredSession, SessionOptions};
//! # fn batch(step: u64) -> (Vec<f32>, Vec<u8>) { unimplemented!() }
//! # fn f(comm: &mpiflow::transport::local::LocalComm, roles: &mpiflow::train::ps::Roles,
//! #      model: &dyn mpiflow::model::Model) -> Result<(), mpiflow::train::ps::PsError> {
//! let opts = SessionOptions { stop_at_step: Some(1000), ..SessionOptions::default() };
//! let mut sess = MonitoredSession::new(comm, roles, model, opts)?;
//! while !sess.should_stop() {
//!     let (x, y) = batch(sess.global_step());
//!     sess.run(&x, &y)?;
//! }
//! let trained = sess.close()?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::placement::DeviceSetter;
use super::protocol::{Setup, SyncReplicas, Then};
use super::roles::Roles;
use super::worker::{Client, Gradients, PushNote};
use super::{shards, PsError};
use crate::model::{Model, Replica};
use crate::observe::phases::{Clock, Phase, RankTimes, Times};
use crate::observe::timeline::{self, Detail};
use crate::train::events::Event;
use crate::train::optim::{Optimizer, OptimizerKind};
use crate::train::sidecar::EndNotice;
use crate::train::StepLog;
use crate::transport::comm::Comm;

/// How a session trains and what its hooks do.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// The update rule the ps tasks apply (with its learning rate and decay).
    pub optimizer: Optimizer,
    /// Synchronous replicas, or `None` for asynchronous training.
    pub sync: Option<SyncReplicas>,
    /// Where the variables go on the ps tasks.
    pub placement: DeviceSetter,
    /// Seed of the initial values (the chief's).
    pub seed: u64,
    /// Where the chief checkpoints and restores from; `None`: no checkpoints.
    pub checkpoint_dir: Option<PathBuf>,
    /// Stop-at-step hook: stop once the global step reaches this.
    pub stop_at_step: Option<u64>,
    /// Checkpoint hook: every this many global steps (0: only at close).
    pub checkpoint_every_steps: u64,
    /// Checkpoint hook: at least this often.
    pub checkpoint_every_secs: Option<Duration>,
    /// Keep the newest this many checkpoints (0: all).
    pub keep_checkpoints: usize,
    /// Logging hook: every this many global steps (0: never).
    pub log_every: u64,
    /// How long to wait for a ps before calling it lost.
    pub peer_timeout: Duration,
    /// Stop hook: a stop signal ([`crate::signals::STOP`], caught by the caller) noted by
    /// this process asks the whole job to stop at the next step boundary (see
    /// [`MonitoredSession::stop_signal`]).
    pub stop_on_signal: bool,
    /// Threads computing this worker's gradients ([`crate::model::towers`]).
    pub towers: usize,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            optimizer: Optimizer::new(OptimizerKind::Adam, 0.003),
            sync: None,
            placement: DeviceSetter::default(),
            seed: 1,
            checkpoint_dir: None,
            stop_at_step: None,
            checkpoint_every_steps: 0,
            checkpoint_every_secs: None,
            keep_checkpoints: 5,
            log_every: 0,
            peer_timeout: Duration::from_secs(60),
            stop_on_signal: false,
            towers: 1,
        }
    }
}

/// What a hook sees after each step.
#[derive(Debug, Clone, Copy)]
pub struct StepInfo {
    /// The global step after this worker's step.
    pub global_step: u64,
    /// This worker's loss of the step.
    pub loss: f32,
    /// The loss of the update the pulled parameters came from (NaN if unknown).
    pub applied_loss: f32,
}

/// A user's hook: runs after each step; `true` asks the session to stop.
pub trait Hook {
    fn after_step(&mut self, step: &StepInfo) -> bool;
}

impl<F: FnMut(&StepInfo) -> bool> Hook for F {
    fn after_step(&mut self, step: &StepInfo) -> bool {
        self(step)
    }
}

/// A worker's training session: `'s` borrows the cluster and the model, `'e` the event
/// sink and hooks.
pub struct MonitoredSession<'s, 'e, C: Comm> {
    client: Client<'s, C>,
    replica: Replica<'s>,
    grads: Vec<crate::tensor::Tensor>,
    towers: crate::model::towers::Towers,
    opts: SessionOptions,
    chief: bool,
    step: u64,
    stop: bool,
    /// The job stops at this step, asked by this signal (the ps tasks' word).
    signal: Option<i32>,
    closed: bool,
    hooks: Vec<Box<dyn Hook + 'e>>,
    events: Box<dyn FnMut(&Event) + 'e>,
    last_ckpt: (u64, Instant),
    /// Global steps and samples since the last log line, and since when.
    window: (u64, u64, Instant),
    /// This worker's phase times since it last reported them (the chief: logged them).
    clock: Clock,
    /// The global step and the time this worker last reported its times (the chief:
    /// asked for the others').
    reported: (u64, Instant),
    /// The chief: the other ranks' times heard since the last log line, by rank.
    heard: BTreeMap<usize, RankTimes>,
    /// The chief, synchronous: its own window, closed where the workers close theirs.
    mine: Option<Times>,
    /// Whom pushes and pulls go to (the timeline's spans name it).
    peers: Arc<str>,
    /// The chief's notice to side-car evaluators, sent when the session is dropped.
    _end: Option<EndNotice<'s, C>>,
}

/// In asynchronous training a worker reports its phase times, and the chief asks for
/// them, once a log step passed since it last did, or this often (synchronous workers
/// report with the push before each logged step, so every window holds the same steps).
const REPORT_EVERY: Duration = Duration::from_millis(250);

impl<'s, 'e, C: Comm> MonitoredSession<'s, 'e, C> {
    /// Starts this worker's session (`roles` says which worker; worker 0 is the chief).
    /// The chief initialises or restores the variables; every worker then pulls them.
    pub fn new(
        comm: &'s C,
        roles: &'s Roles,
        model: &'s dyn Model,
        opts: SessionOptions,
    ) -> Result<Self, PsError> {
        let w = roles.worker_index(comm.rank()).ok_or_else(|| {
            PsError::Setup(format!(
                "{} is not a worker: only workers run a training session",
                roles.task(comm.rank())
            ))
        })?;
        // First: dropped on every way out of the session, failures too, it tells the
        // evaluators training ended (after the chief's last checkpoint, in `close`).
        let dir = opts.checkpoint_dir.as_deref();
        let end = EndNotice::by(w == 0, comm, roles.evaluators(), dir);
        let replica = Replica::new(model, opts.seed);
        let vars = replica.variables();
        let client = Client::new(
            comm,
            roles,
            opts.placement.place(&vars, roles.ps.len()),
            opts.peer_timeout,
        );
        let grads = replica.zeros_like();
        let mut sess = MonitoredSession {
            client,
            replica,
            grads,
            towers: crate::model::towers::Towers::new(opts.towers),
            opts,
            chief: w == 0,
            step: 0,
            stop: false,
            signal: None,
            closed: false,
            hooks: Vec::new(),
            events: Box::new(|e| {
                println!("{e}");
            }),
            last_ckpt: (0, Instant::now()),
            window: (0, 0, Instant::now()),
            clock: Clock::new(),
            reported: (0, Instant::now()),
            heard: BTreeMap::new(),
            mine: None,
            peers: match roles.ps.len() {
                1 => roles.task_name(roles.ps[0]).into(),
                n => format!("{n} ps tasks").into(),
            },
            _end: end,
        };
        if sess.chief {
            sess.emit(&Event::Placement(super::placement::report(
                &sess.client.shards,
                &vars,
                roles.ps.len(),
            )));
            match sess.init_or_restore() {
                Ok(on_disk) => sess.last_ckpt.0 = on_disk,
                Err(e) => {
                    sess.stop_with(&e);
                    return Err(e);
                }
            }
        }
        // A failed first pull (a model other than the chief's) is told to every rank as
        // what it is, not as a session left unclosed.
        let pulled = match sess.client.pull(0, false, &mut sess.replica.params) {
            Ok(p) => p,
            Err(e) => {
                sess.stop_with(&e);
                return Err(e);
            }
        };
        sess.step = pulled.step;
        // The last checkpoint is the one on disk, not the step pulled: asynchronous workers
        // may have trained from the restored state before this first pull (even to the
        // stop step), and the chief's close must still write their steps.
        sess.last_ckpt.1 = Instant::now();
        sess.window = (0, 0, Instant::now());
        sess.clock = Clock::new();
        sess.reported = (pulled.step, Instant::now());
        Ok(sess)
    }

    /// Sends the session's events (log lines, checkpoints, warnings) to `sink` instead of
    /// stdout.
    pub fn with_events(mut self, sink: impl FnMut(&Event) + 'e) -> Self {
        self.events = Box::new(sink);
        self
    }

    /// Adds a hook run after every step.
    pub fn with_hook(mut self, hook: impl Hook + 'e) -> Self {
        self.hooks.push(Box::new(hook));
        self
    }

    fn emit(&mut self, e: &Event) {
        if self.chief {
            (self.events)(e);
        }
    }

    fn setup(&self) -> Setup {
        Setup {
            shards: self.client.shards.clone(),
            optimizer: self.opts.optimizer,
            sync: self.opts.sync,
            stage: None,
        }
    }

    /// The chief: restore the newest valid checkpoint, or initialise; returns the global
    /// step of the checkpoint restored (0 when initialised).
    fn init_or_restore(&mut self) -> Result<u64, PsError> {
        let dir = self.opts.checkpoint_dir.clone();
        let vars = self.replica.variables();
        let (found, warnings) = shards::newest(dir.as_deref(), &vars)?;
        for w in warnings {
            self.emit(&Event::Warning(w));
        }
        match found {
            Some(f) => {
                self.client.restore(&self.setup(), &f.path)?;
                self.emit(&Event::Restored {
                    path: f.path,
                    step: f.step,
                });
                Ok(f.step)
            }
            None => {
                self.client.init(&self.setup(), &mut self.replica.params)?;
                Ok(0)
            }
        }
    }

    /// Whether training is over: a hook asked, the stop step is reached, or the job is
    /// asked to stop by a signal.
    pub fn should_stop(&self) -> bool {
        self.stop || self.signal.is_some() || self.opts.stop_at_step.is_some_and(|s| self.step >= s)
    }

    /// The signal that stops the job at this step, if one does: a stop signal noted by
    /// any worker (with `stop_on_signal`) or ps task. Every worker learns it at the same
    /// step in synchronous training (see [`super::server`]); the chief's
    /// [`MonitoredSession::close`] writes the checkpoint a rerun resumes from.
    /// A signal that comes at the stop step ends nothing early: `None`.
    pub fn stop_signal(&self) -> Option<i32> {
        let finished = self.opts.stop_at_step.is_some_and(|s| self.step >= s);
        self.signal.filter(|_| !finished)
    }

    /// The global step of the parameters this worker holds.
    pub fn global_step(&self) -> u64 {
        self.step
    }

    /// True on the chief.
    pub fn is_chief(&self) -> bool {
        self.chief
    }

    /// The parameters this worker holds (the latest pulled).
    pub fn replica(&self) -> &Replica<'s> {
        &self.replica
    }

    /// One training step on this worker's batch `x`, `y`; returns its loss. Any error
    /// stops training on every rank: the ps tasks are told and tell the other workers.
    pub fn run(&mut self, x: &[f32], y: &[u8]) -> Result<f32, PsError> {
        let result = self.step_once(x, y);
        if let Err(e) = &result {
            self.stop_with(e);
        }
        result
    }

    /// Closes the session on error `e`, telling every ps: done, when it is the ps tasks'
    /// own verdict on a step not finite (every rank has it; asynchronous, even a worker's
    /// first pull may bring it), else an abort they pass on to the other workers.
    fn stop_with(&mut self, e: &PsError) {
        match e {
            PsError::NotApplied(_) => {
                let _ = self.client.done(None);
            }
            e => self.client.abort(&e.to_string()),
        }
        self.closed = true;
    }

    fn step_once(&mut self, x: &[f32], y: &[u8]) -> Result<f32, PsError> {
        let t = Instant::now();
        let loss = self
            .towers
            .gradients_into(&self.replica, x, y, &mut self.grads)
            .map_err(|e| PsError::Setup(format!("{}: {e}", self.client.me())))?;
        let found = crate::train::guard::check_step(self.step, loss, &self.grads);
        // The ps tasks refuse a step not finite in both modes (asynchronous: from the
        // first worker's finding on).
        let non_finite = super::non_finite_rule(found, true, || self.client.me())?;
        let noted = crate::signals::stop_requested_if(self.opts.stop_on_signal);
        let step = self.step;
        let t = self
            .clock
            .since_as(Phase::Compute, t, "gradients", Detail::at(step));
        self.clock.steps(1);
        // Phase times go out with the push of the step before each logged step
        // (synchronous: every worker's window then holds the same steps; the chief keeps
        // its own for the log line), or every REPORT_EVERY (asynchronous).
        let every = self.opts.log_every;
        let report = every > 0
            && match self.opts.sync {
                Some(_) => (self.step + 1).is_multiple_of(every),
                None => {
                    self.step / every > self.reported.0 / every
                        || self.reported.1.elapsed() >= REPORT_EVERY
                }
            };
        let mut times = None;
        if report {
            self.reported = (self.step, Instant::now());
            if self.opts.sync.is_some() || !self.chief {
                times = Some(self.clock.take());
            }
        }
        if self.chief {
            self.mine = self.mine.or(times.take());
        }
        let note = PushNote {
            stop: noted,
            times,
            non_finite,
        };
        let (bytes, peers) = self.moved();
        // Sync: the pull asks for the update of this step (the ps gathers every worker's
        // push of it).
        let then = Then {
            step: self.opts.sync.map_or(0, |_| self.step + 1),
            report: report && self.chief,
        };
        let push = Gradients {
            step: self.step,
            samples: y.len(),
            loss,
            note,
        };
        let wait = self.client.waiting("push and pull", self.step, bytes);
        let (pulled, sent) =
            self.client
                .push_pull(push, &mut self.grads, then, &mut self.replica.params)?;
        drop(wait);
        // The push until its gradients are sent; the pull from there.
        let moved = Detail::moved(step, bytes, &peers);
        timeline::span("push", "comm", t, sent, moved.clone());
        self.clock.charge(Phase::Comm, sent - t);
        let t = sent;
        // The time the pull waited at the ps tasks is waiting; the rest, communication.
        let took = t.elapsed();
        timeline::span("pull", "comm", t, t + took, moved);
        let held = pulled.held.min(took);
        self.clock.charge(Phase::Wait, held);
        self.clock.charge(Phase::Comm, took - held);
        for r in pulled.reports {
            match self.heard.get_mut(&r.rank) {
                Some(h) => h.times.add(&r.times),
                None => {
                    self.heard.insert(r.rank, r);
                }
            }
        }
        let (next, applied_loss) = (pulled.step, pulled.loss);
        self.signal = self.signal.or(pulled.stop);
        let prev = std::mem::replace(&mut self.step, next);
        let per_step =
            y.len() as u64 * self.opts.sync.map_or(1, |s| s.replicas_to_aggregate as u64);
        self.window.0 += next.saturating_sub(prev);
        self.window.1 += next.saturating_sub(prev) * per_step;
        let info = StepInfo {
            global_step: next,
            loss,
            applied_loss,
        };
        for h in &mut self.hooks {
            self.stop |= h.after_step(&info);
        }
        if self.chief {
            self.chief_hooks(prev, applied_loss)?;
        }
        Ok(loss)
    }

    /// Logging and checkpoint hooks, on the chief after each step.
    fn chief_hooks(&mut self, prev: u64, loss: f32) -> Result<(), PsError> {
        let step = self.step;
        let every = self.opts.log_every;
        if every > 0 && step / every > prev / every {
            let secs = self.window.2.elapsed().as_secs_f64().max(1e-9);
            let log = StepLog {
                step,
                loss,
                steps_per_sec: self.window.0 as f64 / secs,
                samples_per_sec: self.window.1 as f64 / secs,
                comm_fraction: None,
                ranks: self.ranks(),
            };
            self.emit(&Event::Step(log));
            self.window = (0, 0, Instant::now());
        }
        let by_steps = self.opts.checkpoint_every_steps;
        let due = (by_steps > 0 && step / by_steps > self.last_ckpt.0 / by_steps)
            || self
                .opts
                .checkpoint_every_secs
                .is_some_and(|d| self.last_ckpt.1.elapsed() >= d);
        if due && !self.should_stop() {
            self.checkpoint()?;
        }
        Ok(())
    }

    /// The bytes a push or a pull moves, and with whom (the timeline's detail).
    fn moved(&self) -> (usize, Arc<str>) {
        let bytes = self.grads.iter().map(|g| g.nbytes()).sum();
        (bytes, self.peers.clone())
    }

    /// The chief's times and those heard from the other ranks since the last log line,
    /// in rank order.
    fn ranks(&mut self) -> Vec<RankTimes> {
        let me = self.client.comm.rank();
        let mine = RankTimes {
            rank: me,
            task: self.client.roles.task_name(me),
            times: self.mine.take().unwrap_or_else(|| self.clock.take()),
        };
        self.heard.insert(me, mine);
        std::mem::take(&mut self.heard).into_values().collect()
    }

    fn checkpoint(&mut self) -> Result<(), PsError> {
        let Some(dir) = self.opts.checkpoint_dir.clone() else {
            return Ok(());
        };
        let (step, keep) = (self.step, self.opts.keep_checkpoints);
        let meta = crate::train::checkpoint::state::model_meta(
            &self.replica.model.describe(),
            &self.replica.variables(),
        );
        let t = Instant::now();
        let written = crate::train::checkpoint::begin(&dir, step)
            .map_err(PsError::from)
            .and_then(|tmp| self.client.save(&tmp))
            .and_then(|files| shards::commit(&dir, step, &files, meta, keep));
        let written = written.map_err(|e| match e {
            // Disk errors, here or on a ps (its error names its shard file).
            PsError::Checkpoint(e) => {
                PsError::Checkpoint(crate::train::checkpoint::abandoned(&dir, step, e))
            }
            PsError::Remote { message, .. } => {
                PsError::Checkpoint(crate::train::checkpoint::abandoned(&dir, step, message))
            }
            other => other,
        })?;
        timeline::span("checkpoint", "other", t, Instant::now(), Detail::at(step));
        self.emit(&written);
        self.last_ckpt = (step, Instant::now());
        Ok(())
    }

    /// Ends this worker's session: the chief writes the last checkpoint (if any steps
    /// came since one); every ps is told this worker is done. Returns the parameters.
    pub fn close(mut self) -> Result<Replica<'s>, PsError> {
        if self.chief && self.last_ckpt.0 != self.step {
            if let Err(e) = self.checkpoint() {
                self.stop_with(&e);
                return Err(e);
            }
        }
        self.closed = true;
        self.client.done(self.stop_signal())?;
        Ok(self.replica.clone())
    }
}

impl<C: Comm> Drop for MonitoredSession<'_, '_, C> {
    /// A session dropped unclosed (an early return, a panic) stops the job at once
    /// instead of leaving the ps tasks to time out.
    fn drop(&mut self) {
        if !self.closed {
            self.client.abort(&format!(
                "{} left its training session without closing it",
                self.client.me()
            ));
        }
    }
}
