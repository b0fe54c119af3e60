//! A ps worker's part of the step loop: the [`Ps`] strategy. A worker's
//! [`MonitoredSession`] (TensorFlow's `MonitoredTrainingSession`) is the engine's
//! [`Session`] over it.
//!
//! The chief (worker 0) initialises the variables on the ps tasks, or has them restore
//! the newest valid checkpoint; the other workers wait for it in their first pull. Each
//! step computes the gradients of the caller's batch, pushes them to the ps tasks and
//! pulls the parameters back (in synchronous mode, those of the next global step). The
//! ps tasks refuse a step whose loss or gradients were not finite and give every worker
//! one verdict; they announce a stop signal any rank noted, and the session stops every
//! worker at that step. The chief checkpoints (each ps writes its shard, the chief commits
//! the manifest) and logs every rank's phase times, which the workers send with their
//! pushes. When the session ends every ps is told this worker is done, or, on an error,
//! that training stopped (the ps tasks tell the other workers).
//!
//! ```no_run
//! # use mpiflow::train::ps::{MonitoredSession, PsConfig, Roles};
//! # use mpiflow::train::TrainConfig;
//! # fn batch(step: u64) -> (Vec<f32>, Vec<u8>) { unimplemented!() }
//! # fn f(comm: &mpiflow::transport::local::LocalComm, roles: &Roles,
//! #      model: &dyn mpiflow::model::Model) -> Result<(), mpiflow::Error> {
//! let cfg = PsConfig { train: TrainConfig { steps: 1000, ..TrainConfig::default() },
//!                      ..PsConfig::default() };
//! let mut sess = MonitoredSession::for_worker(comm, roles, model, &cfg)?;
//! while !sess.should_stop() {
//!     let (x, y) = batch(sess.global_step());
//!     sess.run(&x, &y)?;
//! }
//! let trained = sess.close()?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::protocol::{Setup, Then};
use super::roles::Roles;
use super::worker::{Client, Gradients, PushNote};
use super::{shards, PsConfig, PsError};
use crate::model::embedding::{SparseGrad, TableSpec};
use crate::model::{Model, Replica, Targets};
use crate::observe::phases::{Clock, Phase, RankTimes, Times};
use crate::observe::timeline::{self, Detail};
use crate::tensor::Tensor;
use crate::train::checkpoint::{self, State};
use crate::train::engine::{End, Session, Started, StepWord, Strategy, TrainError};
use crate::train::events::Event;
use crate::train::sidecar::EndNotice;
use crate::transport::comm::Comm;

/// A ps worker's training session: the step loop over the [`Ps`] strategy.
pub type MonitoredSession<'s, 'e, C> = Session<'s, 'e, Ps<'s, C>>;

/// In asynchronous training a worker reports its phase times, and the chief asks for
/// them, once a log step passed since it last did, or this often (synchronous workers
/// report with the push before each logged step, so every window holds the same steps).
const REPORT_EVERY: Duration = Duration::from_millis(250);

/// A worker of ps training: its parameters are pulled from the ps tasks, which hold the
/// variables and the optimizer state and apply the updates.
pub struct Ps<'s, C: Comm> {
    client: Client<'s, C>,
    replica: Replica<'s>,
    grads: Vec<Tensor>,
    towers: crate::model::towers::Towers,
    cfg: PsConfig,
    /// Workers, and this worker's index (0: the chief).
    workers: (usize, usize),
    /// The global step of the parameters pulled last, and the loss of their update.
    pulled: (u64, f32),
    /// The job stops at the pulled step, asked by this signal (the ps tasks' word).
    signal: Option<i32>,
    /// The global step and the time this worker last reported its times (the chief:
    /// asked for the others').
    reported: (u64, Instant),
    /// The chief: the other ranks' times heard since the last log line, by rank.
    heard: BTreeMap<usize, RankTimes>,
    /// The chief, synchronous: its own window, closed where the workers close theirs.
    mine: Option<Times>,
    /// Whom pushes and pulls go to (the timeline's spans name it).
    peers: Arc<str>,
    /// The chief's notice to side-car evaluators, sent when the strategy is dropped.
    _end: Option<EndNotice<'s, C>>,
}

impl<'s, C: Comm> Session<'s, 's, Ps<'s, C>> {
    /// Starts this worker's session (`roles` says which worker; worker 0 is the chief)
    /// as `cfg` says, its events printed by the chief (`Ps::new`, [`Session::new`]).
    pub fn for_worker(
        comm: &'s C,
        roles: &'s Roles,
        model: &'s dyn Model,
        cfg: &PsConfig,
    ) -> Result<Self, TrainError> {
        Session::new(Ps::new(comm, roles, model, cfg)?, &cfg.train)
    }
}

impl<'s, C: Comm> Ps<'s, C> {
    /// The strategy of this worker of `roles` (an error naming the task where it is no
    /// worker), training `model` as `cfg` says.
    pub fn new(
        comm: &'s C,
        roles: &'s Roles,
        model: &'s dyn Model,
        cfg: &PsConfig,
    ) -> Result<Self, TrainError> {
        let w = roles.worker_index(comm.rank()).ok_or_else(|| {
            PsError::Setup(format!(
                "{} is not a worker: only workers run a training session",
                roles.task(comm.rank())
            ))
        })?;
        // Dropped on every way out of training, failures too, it tells the evaluators
        // training ended (after the chief's last checkpoint, in the session's close).
        let dir = cfg.train.checkpoint_dir.as_deref();
        let end = EndNotice::by(w == 0, comm, roles.evaluators(), dir);
        let replica = Replica::new(model, cfg.train.seed);
        let vars = replica.variables();
        let placement = cfg.device_setter().place(&vars, roles.ps.len());
        let client = Client::new(comm, roles, placement, cfg.peer_timeout);
        Ok(Ps {
            grads: replica.zeros_like(),
            towers: crate::model::towers::Towers::new(cfg.train.towers),
            client,
            replica,
            cfg: cfg.clone(),
            workers: (roles.workers.len(), w),
            pulled: (0, f32::NAN),
            signal: None,
            reported: (0, Instant::now()),
            heard: BTreeMap::new(),
            mine: None,
            peers: match roles.ps.len() {
                1 => roles.task_name(roles.ps[0]).into(),
                n => format!("{n} ps tasks").into(),
            },
            _end: end,
        })
    }

    fn chief(&self) -> bool {
        self.workers.1 == 0
    }

    fn setup(&self) -> Setup {
        Setup {
            shards: self.client.shards.clone(),
            optimizer: self.cfg.train.optimizer,
            sync: self.cfg.sync_replicas(self.workers.0),
            stage: None,
            tables: self.cfg.tables.clone(),
            sparse: Some(self.cfg.sparse),
            seed: self.cfg.train.seed,
        }
    }

    /// Rows `ids` of embedding table `table` (of [`PsConfig::tables`]) into `out`, in the
    /// order of `ids`, each from the ps that holds it.
    pub fn pull_rows(&self, table: usize, ids: &[u64], out: &mut Vec<f32>) -> Result<(), PsError> {
        self.pull_tables(&[(table, ids)], std::slice::from_mut(out), true)
    }

    /// [`Ps::pull_rows`] without making rows: one that does not exist comes as its
    /// initial values (an evaluation's read).
    pub fn read_rows(&self, table: usize, ids: &[u64], out: &mut Vec<f32>) -> Result<(), PsError> {
        self.pull_tables(&[(table, ids)], std::slice::from_mut(out), false)
    }

    /// Pushes table `table`'s sparse gradient `grad` scaled by `scale` (`1 / workers`
    /// for the mean of the workers' gradients, say): each ps applies its rows' part at
    /// once with [`PsConfig::sparse`].
    pub fn push_rows(&self, table: usize, grad: &SparseGrad, scale: f32) -> Result<(), PsError> {
        self.push_tables(&[(table, grad)], scale)
    }

    /// The rows of several tables, each ps asked once (see
    /// [`crate::train::tables::Tables::pull_tables`]).
    pub fn pull_tables(
        &self,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
        make: bool,
    ) -> Result<(), PsError> {
        self.client.pull_tables(&self.cfg.tables, want, out, make)
    }

    /// Sparse gradients of several tables, each ps sent its part of them all at once.
    pub fn push_tables(&self, grads: &[(usize, &SparseGrad)], scale: f32) -> Result<(), PsError> {
        self.client.push_tables(&self.cfg.tables, grads, scale)
    }

    /// The chief: the ps tasks restore the newest valid checkpoint in `dir`, or take the
    /// initial values; returns the global step of the checkpoint restored.
    fn init_or_restore(
        &mut self,
        dir: Option<&Path>,
        events: &mut dyn FnMut(&Event),
    ) -> Result<Option<u64>, PsError> {
        let vars = self.replica.variables();
        let (found, warnings) = shards::newest(dir, &vars)?;
        for w in warnings {
            events(&Event::Warning(w));
        }
        match found {
            Some(f) => {
                self.client.restore(&self.setup(), &f.path)?;
                events(&Event::Restored {
                    path: f.path,
                    step: f.step,
                });
                Ok(Some(f.step))
            }
            None => {
                self.client.init(&self.setup(), &mut self.replica.params)?;
                Ok(None)
            }
        }
    }

    /// Whether this step's push carries this worker's phase times (`Some(times)`, or
    /// `None` on the synchronous chief, which keeps its own), and whether the chief's pull
    /// asks for the others'. Synchronous: with the push before each logged step (every
    /// worker's window then holds the same steps); asynchronous: every [`REPORT_EVERY`].
    fn report(&mut self, step: u64, clock: &mut Clock) -> (Option<Times>, bool) {
        let every = self.cfg.train.log_every;
        let sync = self.cfg.sync;
        let due = every > 0
            && match sync {
                true => (step + 1).is_multiple_of(every),
                false => {
                    step / every > self.reported.0 / every
                        || self.reported.1.elapsed() >= REPORT_EVERY
                }
            };
        if !due {
            return (None, false);
        }
        self.reported = (step, Instant::now());
        let mut times = (sync || !self.chief()).then(|| clock.take());
        if self.chief() {
            self.mine = self.mine.or(times.take());
        }
        (times, self.chief())
    }
}

impl<'s, C: Comm> Strategy<'s> for Ps<'s, C> {
    fn ranks(&self) -> (usize, usize) {
        self.workers
    }

    /// Workers step apart (asynchronous) or in step through the ps tasks, which carry
    /// signals and verdicts but not a hook's request: a hook stops its own worker.
    fn agrees(&self) -> bool {
        false
    }

    fn replica(&self) -> &Replica<'s> {
        &self.replica
    }

    fn into_replica(self) -> Replica<'s> {
        self.replica
    }

    fn start(
        &mut self,
        dir: Option<&Path>,
        events: &mut dyn FnMut(&Event),
    ) -> Result<Started, TrainError> {
        let mut restored = None;
        if self.chief() {
            let vars = self.replica.variables();
            let ps = self.client.roles.ps.len();
            let table = super::placement::report(&self.client.shards, &vars, ps);
            events(&Event::Placement(table));
            restored = self.init_or_restore(dir, events)?;
        }
        // Every worker starts from the chief's variables (a model other than the chief's
        // fails here, as what it is).
        let pulled = self.client.pull(0, false, &mut self.replica.params)?;
        self.pulled = (pulled.step, pulled.loss);
        self.reported = (pulled.step, Instant::now());
        // The newest checkpoint is the one on disk, not the step pulled: asynchronous
        // workers may have trained from the restored state before this first pull (even to
        // the last step), and the chief's close must still write their steps.
        Ok(Started {
            step: pulled.step,
            restored,
        })
    }

    fn gradients(
        &mut self,
        step: u64,
        x: &[f32],
        y: Targets<'_>,
        word: StepWord,
        clock: &mut Clock,
        _: &mut dyn FnMut(&Event),
    ) -> Result<StepWord, TrainError> {
        let t = Instant::now();
        let loss = self
            .towers
            .gradients_into(&self.replica, x, y, &mut self.grads)
            .map_err(|e| PsError::Setup(format!("{}: {e}", self.client.me())))?;
        let found = crate::train::guard::check_step(step, loss, &self.grads);
        // The ps tasks refuse a step not finite in both modes (asynchronous: from the
        // first worker's finding on).
        let non_finite = super::non_finite_rule(found, true, || self.client.me())?;
        let t = clock.since_as(Phase::Compute, t, "gradients", Detail::at(step));
        let (times, report) = self.report(step, clock);
        let bytes = self.grads.iter().map(|g| g.nbytes()).sum();
        let push = Gradients {
            step,
            samples: y.rows(self.replica.model.classes()),
            loss,
            note: PushNote {
                // This worker's own signal goes to the ps tasks, which announce the stop.
                stop: word.stop_signal(),
                times,
                non_finite,
            },
        };
        // Sync: the pull asks for the update of this step (the ps gathers every worker's
        // push of it).
        let then = Then {
            step: if self.cfg.sync { step + 1 } else { 0 },
            report,
        };
        let wait = self.client.waiting("push and pull", step, bytes);
        let (pulled, sent) =
            self.client
                .push_pull(push, &mut self.grads, then, &mut self.replica.params)?;
        drop(wait);
        // The push until its gradients are sent; the pull from there.
        let moved = Detail::moved(step, bytes, &self.peers);
        timeline::span("push", "comm", t, sent, moved.clone());
        clock.charge(Phase::Comm, sent - t);
        // The time the pull waited at the ps tasks is waiting; the rest, communication.
        let took = sent.elapsed();
        timeline::span("pull", "comm", sent, sent + took, moved);
        let held = pulled.held.min(took);
        clock.charge(Phase::Wait, held);
        clock.charge(Phase::Comm, took - held);
        for r in pulled.reports {
            match self.heard.get_mut(&r.rank) {
                Some(h) => h.times.add(&r.times),
                None => {
                    self.heard.insert(r.rank, r);
                }
            }
        }
        self.signal = self.signal.or(pulled.stop);
        // The samples of the global steps this pull advanced (every worker's, in sync).
        let advanced = pulled.step.saturating_sub(step);
        let aggregate = self.cfg.sync_replicas(self.workers.0);
        let rows = y.rows(self.replica.model.classes());
        let per_step = rows * aggregate.map_or(1, |s| s.replicas_to_aggregate);
        self.pulled = (pulled.step, pulled.loss);
        // Applied by the ps tasks, so finite; the signal is the ps tasks' word.
        let said = StepWord::asking(self.signal, false);
        Ok(said.with_loss(loss, per_step * advanced as usize))
    }

    /// Checked before the push: the ps tasks refuse what is not finite.
    fn pending(&self) -> &[Tensor] {
        &[]
    }

    fn apply(&mut self, _: u64) -> Result<u64, TrainError> {
        Ok(self.pulled.0)
    }

    fn state(&mut self, _: u64) -> Result<State, TrainError> {
        Err(TrainError::Setup(
            "the ps tasks hold the training state: each writes its shard".into(),
        ))
    }

    /// Each ps writes its shard of `step` into the checkpoint's staging directory and the
    /// chief commits the manifest.
    fn checkpoint(
        &mut self,
        dir: &Path,
        step: u64,
        keep: usize,
        events: &mut dyn FnMut(&Event),
    ) -> Result<PathBuf, TrainError> {
        if !self.chief() {
            return Ok(checkpoint::path_of(dir, step));
        }
        let meta = checkpoint::state::model_meta(
            &self.replica.model.describe(),
            &self.replica.variables(),
        );
        let t = Instant::now();
        let written = checkpoint::begin(dir, step)
            .map_err(PsError::from)
            .and_then(|tmp| self.client.save(&tmp))
            .and_then(|files| shards::commit(dir, step, &files, meta, keep));
        let written = written.map_err(|e| match e {
            // Disk errors, here or on a ps (its error names its shard file).
            PsError::Checkpoint(e) => PsError::Checkpoint(checkpoint::abandoned(dir, step, e)),
            PsError::Remote { message, .. } => {
                PsError::Checkpoint(checkpoint::abandoned(dir, step, message))
            }
            other => other,
        })?;
        crate::train::engine::checkpointed(step, t, &written, events);
        Ok(checkpoint::path_of(dir, step))
    }

    /// Each worker evaluates alone (the workers share no collective).
    fn sum(&mut self, _: &mut [f64]) -> Result<(), TrainError> {
        Ok(())
    }

    fn evaluation_ranks(&self) -> (usize, usize) {
        (1, 0)
    }

    /// The chief: its own times (kept at its report, or the clock's) and those heard
    /// from the other ranks since the last log line, in rank order; the other workers
    /// report with their pushes instead, their clock running on.
    fn window(&mut self, _: u64, clock: &mut Clock) -> Result<(Times, Vec<RankTimes>), TrainError> {
        if !self.chief() {
            return Ok((Times::default(), Vec::new()));
        }
        let me = self.client.comm.rank();
        let times = self.mine.take().unwrap_or_else(|| clock.take());
        let mine = RankTimes {
            rank: me,
            task: self.client.roles.task_name(me),
            times,
        };
        self.heard.insert(me, mine);
        Ok((
            times,
            std::mem::take(&mut self.heard).into_values().collect(),
        ))
    }

    fn communicates(&self) -> bool {
        false
    }

    /// The loss of the update the pulled parameters came from.
    fn reported_loss(&self) -> Option<f32> {
        Some(self.pulled.1)
    }

    /// Every ps is told: this worker is done (with the signal that stopped the job), or,
    /// on an error, the ps tasks' own verdict on a step not finite (every rank has it)
    /// as done, anything else as an abort they pass on to the other workers.
    fn end(&mut self, how: End<'_>) -> Result<(), TrainError> {
        match how {
            End::Done => Ok(self.client.done(None)?),
            End::Stopped(signal) => Ok(self.client.done(Some(signal))?),
            End::Failed(TrainError::Ps(PsError::NotApplied(_))) => {
                let _ = self.client.done(None);
                Ok(())
            }
            End::Failed(e) => {
                self.client.abort(&e.to_string());
                Ok(())
            }
            End::Abandoned => {
                let me = self.client.me();
                self.client.abort(&format!(
                    "{me} left its training session without closing it"
                ));
                Ok(())
            }
        }
    }
}

/// The ps mode's tables: rows on the ps tasks beside the dense variables, a worker's
/// sparse gradient scaled like its dense one (the mean over the replicas aggregated, or
/// alone when asynchronous).
impl<C: Comm> crate::train::tables::Tables for Ps<'_, C> {
    fn table_specs(&self) -> &[TableSpec] {
        &self.cfg.tables
    }

    fn pull_tables(
        &self,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
        make: bool,
    ) -> Result<(), TrainError> {
        Ok(Ps::pull_tables(self, want, out, make)?)
    }

    fn push_tables(&self, grads: &[(usize, &SparseGrad)], scale: f32) -> Result<(), TrainError> {
        Ok(Ps::push_tables(self, grads, scale)?)
    }

    fn push_pull_tables(
        &self,
        grads: &[(usize, &SparseGrad)],
        scale: f32,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
    ) -> Result<(), TrainError> {
        let specs = &self.cfg.tables;
        Ok(self
            .client
            .push_pull_tables(specs, (grads, scale), want, out)?)
    }

    fn pulls_ahead(&self) -> bool {
        true
    }

    fn pull_ahead(&self, want: &[(usize, &[u64])]) -> Result<(), TrainError> {
        Ok(self.client.pull_tables_ahead(&self.cfg.tables, want)?)
    }

    fn land_tables(
        &self,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
    ) -> Result<(), TrainError> {
        Ok(self.client.land_tables(&self.cfg.tables, want, out)?)
    }

    fn rows_report(&self) -> Result<Vec<crate::train::tables::RowsReport>, TrainError> {
        Ok(self.client.stats()?)
    }

    fn push_scale(&self) -> f32 {
        match self.cfg.sync_replicas(self.workers.0) {
            Some(s) => 1.0 / s.replicas_to_aggregate as f32,
            None => 1.0,
        }
    }
}
