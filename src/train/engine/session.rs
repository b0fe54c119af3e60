//! The step loop every mode trains in, driven by the program: [`Session::run`] is one
//! step, [`Session::should_stop`] says when to end, [`Session::close`] returns the trained
//! parameters.

use std::path::PathBuf;
use std::time::Instant;

use super::{End, Hook, StepInfo, StepWord, Strategy, TrainError};
use crate::model::{Replica, Targets};
use crate::observe::phases::{Clock, Phase};
use crate::observe::timeline::{self, Detail};
use crate::train::checkpoint;
use crate::train::data::Dataset;
use crate::train::events::Event;
use crate::train::{guard, StepLog, Stopped, TrainConfig};

/// Why a session stopped without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// The configured last step was reached.
    LastStep,
    /// An evaluation reached the target.
    Target,
    /// A hook asked.
    Hook,
    /// A signal stopped training (the step returned [`TrainError::Stopped`]).
    Signal,
    /// A step failed.
    Failed,
}

/// An evaluation on held-out samples: the same on every rank that evaluates together
/// (each its share of the samples, the counts summed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    /// The global step of the parameters evaluated.
    pub step: u64,
    pub accuracy: f64,
    pub correct: usize,
    pub total: usize,
}

/// What a closed session returns: the trained parameters and where training ended.
#[derive(Debug)]
pub struct Trained<'m> {
    /// The trained parameters (every rank's copy is the same in the synchronous modes).
    pub replica: Replica<'m>,
    /// The global step reached.
    pub step: u64,
    /// The step this session started at (restored from a checkpoint, or 0).
    pub first_step: u64,
    /// The last step's loss (NaN if no step ran).
    pub loss: f32,
    /// The newest evaluation, if the session evaluated.
    pub evaluation: Option<Evaluation>,
    /// Samples per second over the steps this session ran (every rank's samples).
    pub samples_per_sec: f64,
    /// The newest checkpoint (the chief's path; the same on every rank), if any.
    pub checkpoint: Option<PathBuf>,
}

/// Evaluation every so many steps on held-out samples, and an accuracy to stop at.
struct Evaluate<'e> {
    every: u64,
    data: &'e Dataset,
    target: Option<f64>,
}

/// The log window: phase times on the clock, and since when, over how many global steps
/// and samples.
struct Window {
    clock: Clock,
    start: Instant,
    steps: u64,
    samples: f64,
}

impl Window {
    fn new() -> Window {
        Window {
            clock: Clock::new(),
            start: Instant::now(),
            steps: 0,
            samples: 0.0,
        }
    }
}

/// The step loop of one rank, over a strategy `S` that trains a model borrowed for `'m`;
/// `'e` borrows the event sink, hooks and evaluation data.
pub struct Session<'m, 'e, S: Strategy<'m>> {
    /// `None` once closed.
    strategy: Option<S>,
    cfg: TrainConfig,
    chief: bool,
    /// The global step: steps done, those before a restored checkpoint included.
    step: u64,
    first: u64,
    loss: f32,
    window: Window,
    /// The step of the newest checkpoint, and when it was written.
    saved: (Option<u64>, Instant),
    stop: Option<Stop>,
    /// The strategy was told how training ended.
    ended: bool,
    /// A hook on this rank asked to stop: said with the next step's word.
    asked: bool,
    /// The signal that stopped training, if one did.
    stopped_by: Option<i32>,
    events: Box<dyn FnMut(&Event) + 'e>,
    hooks: Vec<Box<dyn Hook + 'e>>,
    evaluate: Option<Evaluate<'e>>,
    evaluation: Option<Evaluation>,
    signals: Box<dyn FnMut() -> Option<i32> + 'e>,
    started: Instant,
    samples: f64,
    _model: std::marker::PhantomData<&'m ()>,
}

impl<'m, 'e, S: Strategy<'m>> Session<'m, 'e, S> {
    /// A session of `strategy` as `cfg` says, its events printed by the chief.
    pub fn new(strategy: S, cfg: &TrainConfig) -> Result<Self, TrainError> {
        let chief = strategy.reports();
        Session::with_events(strategy, cfg, move |e: &Event| {
            if chief {
                println!("{e}")
            }
        })
    }

    /// A session of `strategy` as `cfg` says, its events (every rank's: most come from the
    /// chief) told to `events`. Every rank starts from the newest valid checkpoint in
    /// `cfg.checkpoint_dir`, if there is one.
    pub fn with_events(
        mut strategy: S,
        cfg: &TrainConfig,
        events: impl FnMut(&Event) + 'e,
    ) -> Result<Self, TrainError> {
        let mut events: Box<dyn FnMut(&Event) + 'e> = Box::new(events);
        let chief = strategy.reports();
        let started = match strategy.start(cfg.checkpoint_dir.as_deref(), &mut *events) {
            Ok(s) => s,
            Err(e) => {
                let _ = strategy.end(End::Failed(&e));
                return Err(e);
            }
        };
        let stop_on_signal = cfg.stop_on_signal;
        Ok(Session {
            strategy: Some(strategy),
            cfg: cfg.clone(),
            chief,
            step: started.step,
            first: started.step,
            loss: f32::NAN,
            window: Window::new(),
            saved: (started.restored, Instant::now()),
            stop: (started.step >= cfg.steps).then_some(Stop::LastStep),
            ended: false,
            asked: false,
            stopped_by: None,
            events,
            hooks: Vec::new(),
            evaluate: None,
            evaluation: None,
            signals: Box::new(move || crate::signals::stop_requested_if(stop_on_signal)),
            started: Instant::now(),
            samples: 0.0,
            _model: std::marker::PhantomData,
        })
    }

    fn strategy_mut(&mut self) -> &mut S {
        self.strategy.as_mut().expect("open until closed")
    }

    /// Adds a hook run after every step.
    pub fn with_hook(mut self, hook: impl Hook + 'e) -> Self {
        self.hooks.push(Box::new(hook));
        self
    }

    /// Evaluates on `data` every `every` steps (0: never), reporting each
    /// ([`Event::Accuracy`]).
    pub fn evaluate_every(mut self, every: u64, data: &'e Dataset) -> Self {
        let target = self.evaluate.as_ref().and_then(|e| e.target);
        self.evaluate = Some(Evaluate {
            every,
            data,
            target,
        });
        self
    }

    /// Stops once an evaluation ([`Session::evaluate_every`]) reaches `accuracy`.
    pub fn stop_at_accuracy(mut self, accuracy: f64) -> Self {
        if let Some(e) = &mut self.evaluate {
            e.target = Some(accuracy);
        }
        self
    }

    /// Where stop signals come from (by default, the signals [`crate::signals`] noted if
    /// `stop_on_signal` is set): a program embedding mpiflow, or a test, may stop training
    /// by its own means.
    pub fn with_signals(mut self, signals: impl FnMut() -> Option<i32> + 'e) -> Self {
        self.signals = Box::new(signals);
        self
    }

    /// The global step: steps done, those before a restored checkpoint included.
    pub fn global_step(&self) -> u64 {
        self.step
    }

    /// True on the chief (it checkpoints and reports).
    pub fn is_chief(&self) -> bool {
        self.chief
    }

    /// The ranks that train together, and this rank's place among them.
    pub fn ranks(&self) -> (usize, usize) {
        self.strategy().ranks()
    }

    /// The shares each global batch is cut into, and this rank's (what
    /// [`crate::train::fit`] feeds [`Session::run`]).
    pub fn data_shard(&self) -> (usize, usize) {
        self.strategy().data_shard()
    }

    /// The mode's own state (what a strategy reports beyond the loop's).
    pub fn strategy(&self) -> &S {
        self.strategy.as_ref().expect("open until closed")
    }

    /// Tells `event` to the session's event sink (on this rank).
    pub fn report(&mut self, event: &Event) {
        (self.events)(event)
    }

    /// This rank's parameters.
    pub fn replica(&self) -> &Replica<'m> {
        self.strategy().replica()
    }

    /// True if this rank takes part in evaluations: the chief, and every rank where the
    /// ranks evaluate together (each its share of the samples).
    pub fn evaluates(&self) -> bool {
        self.chief || self.strategy().evaluation_ranks().0 > 1
    }

    /// The ranks that evaluate together (each its share of the held-out samples) and this
    /// rank's place: an evaluation of the program's own takes its share and sums its counts
    /// with [`Session::sum`].
    pub fn evaluation_ranks(&self) -> (usize, usize) {
        self.strategy().evaluation_ranks()
    }

    /// Sums `values` over the ranks that evaluate together (a collective of theirs where
    /// there are several).
    pub fn sum(&mut self, values: &mut [f64]) -> Result<(), TrainError> {
        self.strategy_mut().sum(values)
    }

    /// Charges `from..to` to `phase` of this step (`name` on the timeline): a program's
    /// own work for the step outside [`Session::run`] (gradients computed by itself, rows
    /// pulled and pushed) counted in the log's phases.
    pub fn charge(&mut self, phase: Phase, from: Instant, to: Instant, name: &'static str) {
        self.window
            .clock
            .charge(phase, to.saturating_duration_since(from));
        let category = timeline::category(phase);
        timeline::span(name, category, from, to, Detail::at(self.step));
    }

    /// The newest evaluation, if any.
    pub fn evaluation(&self) -> Option<Evaluation> {
        self.evaluation
    }

    /// True once training is over: the last step reached, an evaluation's target met, or
    /// a hook's request agreed (or a step failed).
    pub fn should_stop(&self) -> bool {
        self.stop.is_some()
    }

    /// One step on this rank's samples `x` and their targets `y` (its share of the global
    /// batch; class labels, `&[u8]`, or values, `&[f32]`: [`Targets`]). An error ends
    /// training on this rank, and (the mode sees to it) on every rank.
    pub fn run<'y>(
        &mut self,
        x: &[f32],
        y: impl Into<Targets<'y>>,
    ) -> Result<StepInfo, TrainError> {
        let y = y.into();
        if let Some(why) = self.stop {
            return Err(TrainError::Usage(format!(
                "run() after the session stopped ({why:?} at step {}): check should_stop()",
                self.step
            )));
        }
        let ran = self.step_once(x, y);
        if let Err(e) = &ran {
            self.stop = Some(match e {
                TrainError::Stopped(_) => Stop::Signal,
                _ => Stop::Failed,
            });
            // The step's error is what the caller sees; the mode's own trouble telling its
            // peers (a ps already gone) adds nothing to it.
            let _ = self.end(match e {
                TrainError::Stopped(_) => End::Stopped(self.stopped_by.unwrap_or(0)),
                e => End::Failed(e),
            });
        }
        ran
    }

    /// Tells the strategy how training ended, once.
    fn end(&mut self, how: End<'_>) -> Result<(), TrainError> {
        if std::mem::replace(&mut self.ended, true) {
            return Ok(());
        }
        self.strategy_mut().end(how)
    }

    fn step_once(&mut self, x: &[f32], y: Targets<'_>) -> Result<StepInfo, TrainError> {
        let step = self.step;
        let word = StepWord::asking((self.signals)(), self.asked);
        let (events, clock) = (&mut *self.events, &mut self.window.clock);
        // Counted as it starts: a mode that reports its window during the step (the ps,
        // with its push) counts it there.
        clock.steps(1);
        let strategy = self.strategy.as_mut().expect("open until closed");
        let agreed = strategy.gradients(step, x, y, word, clock, events)?;
        self.guard(step, &agreed)?;
        let t = Instant::now();
        let next = self.strategy_mut().apply(step)?;
        let clock = &mut self.window.clock;
        clock.since_as(Phase::Compute, t, "update", Detail::at(step));
        self.step = next;
        // A step that trained no sample (an asynchronous worker's claim past the last
        // step) has no loss to report: the last one stands.
        if agreed.samples > 0.0 || self.loss.is_nan() {
            self.loss = agreed.loss();
        }
        self.window.steps += next.saturating_sub(step);
        self.window.samples += f64::from(agreed.samples);
        self.samples += f64::from(agreed.samples);
        self.strategy_mut().after_step(next)?;
        self.log_if_due(step)?;
        // A signal that comes with the last step ends nothing early.
        if let Some(signal) = agreed.stop_signal().filter(|_| next < self.cfg.steps) {
            return Err(self.stopped(signal)?.into());
        }
        self.checkpoint_if_due()?;
        self.evaluate_if_due(step)?;
        let info = StepInfo {
            global_step: next,
            loss: self.loss,
            applied_loss: self.strategy().reported_loss().unwrap_or(self.loss),
        };
        let mut asked = false;
        for h in &mut self.hooks {
            asked |= h.after_step(&info);
        }
        self.asked |= asked;
        let apart = !self.strategy().agrees() || self.strategy().ranks().0 == 1;
        if agreed.stop_asked() || (apart && self.asked) {
            self.stop.get_or_insert(Stop::Hook);
        }
        if next >= self.cfg.steps {
            self.stop.get_or_insert(Stop::LastStep);
        }
        Ok(info)
    }

    /// The guard: a non-finite loss on any rank, a rank's own non-finite gradients (said
    /// in its word), or a non-finite gradient about to be applied, stops every rank before
    /// the update. The last is checked on each rank alone: it is one verdict where the
    /// gradients applied are the same on every rank (a reduced sum); a strategy whose ranks
    /// apply their own says so in the word ([`StepWord::with_gradients`]).
    fn guard(&self, step: u64, agreed: &StepWord) -> Result<(), TrainError> {
        let n = self.strategy().data_shard().0;
        let whose = |k: usize| match n {
            1 => String::new(),
            n => format!(" on {k} of {n} replicas"),
        };
        let (nan, inf) = agreed.non_finite();
        if nan + inf > 0 {
            let value = if nan > 0 { f32::NAN } else { f32::INFINITY };
            guard::check_loss(step, value, whose(nan + inf))?;
        }
        if agreed.bad_gradients() > 0 {
            let whose = whose(agreed.bad_gradients());
            return Err(guard::NonFinite::Gradients { step, whose }.into());
        }
        guard::check_gradients(step, self.strategy().pending())?;
        Ok(())
    }

    /// True if the global step passed a multiple of `every` going from `prev` to the
    /// current step (every step of a synchronous mode; the ps's may jump).
    fn passed(&self, prev: u64, every: u64) -> bool {
        every > 0 && self.step / every > prev / every
    }

    /// The log line of the window closing now, if one is due (every rank's times gathered
    /// to the chief).
    fn log_if_due(&mut self, prev: u64) -> Result<(), TrainError> {
        if !self.passed(prev, self.cfg.log_every) {
            return Ok(());
        }
        let step = self.step;
        let closed = std::mem::replace(&mut self.window, Window::new());
        let mut clock = closed.clock;
        let (mine, ranks) = self.strategy_mut().window(step, &mut clock)?;
        if self.chief {
            let secs = closed.start.elapsed().as_secs_f64().max(1e-9);
            let strategy = self.strategy();
            let log = StepLog {
                step,
                loss: strategy.reported_loss().unwrap_or(self.loss),
                steps_per_sec: closed.steps as f64 / secs,
                samples_per_sec: closed.samples / secs,
                comm_fraction: strategy
                    .communicates()
                    .then(|| mine.comm / mine.total().max(1e-9)),
                ranks,
            };
            (self.events)(&Event::Step(log));
        }
        // What the clock kept running for the mode (its own report of times) goes on.
        self.window.clock = clock;
        Ok(())
    }

    /// The periodic checkpoint, by steps or by time (the last step's is written by
    /// [`Session::close`]).
    fn checkpoint_if_due(&mut self) -> Result<(), TrainError> {
        let saved = self.saved.0.unwrap_or(self.first);
        let by_steps = self.passed(saved, self.cfg.checkpoint_every);
        let by_time = self
            .cfg
            .checkpoint_every_secs
            .is_some_and(|d| self.saved.1.elapsed() >= d);
        if (by_steps || by_time) && self.step < self.cfg.steps {
            self.checkpoint()?;
        }
        Ok(())
    }

    /// Checkpoints this step now (every rank calls it; nothing if this step's is written,
    /// or there is no checkpoint directory); returns its path. [`Session::close`] does it
    /// too: a program that evaluates at the end saves first, so that the newest checkpoint
    /// is what it evaluated.
    pub fn save(&mut self) -> Result<Option<PathBuf>, TrainError> {
        let saved = self.checkpoint();
        if let Err(e) = &saved {
            self.stop = Some(Stop::Failed);
            let _ = self.end(End::Failed(e));
        }
        saved
    }

    /// The checkpoint of this step (once), as the mode writes it; its path.
    fn checkpoint(&mut self) -> Result<Option<PathBuf>, TrainError> {
        let Some(dir) = self.cfg.checkpoint_dir.clone() else {
            return Ok(None);
        };
        if self.saved.0 == Some(self.step) {
            return Ok(Some(checkpoint::path_of(&dir, self.step)));
        }
        let (step, keep) = (self.step, self.cfg.keep_checkpoints);
        let events = &mut *self.events;
        let strategy = self.strategy.as_mut().expect("open until closed");
        let path = strategy.checkpoint(&dir, step, keep, events)?;
        self.saved = (Some(step), Instant::now());
        Ok(Some(path))
    }

    /// Every rank stops after this step, asked by `signal`; the chief keeps the step.
    fn stopped(&mut self, signal: i32) -> Result<Stopped, TrainError> {
        self.stopped_by = Some(signal);
        let checkpoint = self.checkpoint()?;
        Ok(Stopped {
            signal: crate::signals::name(signal),
            step: self.step,
            checkpoint,
        })
    }

    fn evaluate_if_due(&mut self, prev: u64) -> Result<(), TrainError> {
        let Some(e) = &self.evaluate else {
            return Ok(());
        };
        if !self.passed(prev, e.every) {
            return Ok(());
        }
        let (data, target) = (e.data, e.target);
        let eval = self.evaluate(data)?;
        if target.is_some_and(|t| eval.accuracy >= t) {
            self.stop.get_or_insert(Stop::Target);
        }
        Ok(())
    }

    /// Evaluates the current parameters on `data` (every rank that evaluates together its
    /// share: a collective where several do) and reports it ([`Event::Accuracy`], the
    /// chief).
    pub fn evaluate(&mut self, data: &Dataset) -> Result<Evaluation, TrainError> {
        let t = Instant::now();
        let (correct, total) = self.strategy_mut().evaluate(data)?;
        let eval = Evaluation {
            step: self.step,
            accuracy: correct as f64 / total.max(1) as f64,
            correct,
            total,
        };
        timeline::span(
            "evaluate",
            "other",
            t,
            Instant::now(),
            Detail::at(self.step),
        );
        if self.chief {
            (self.events)(&Event::Accuracy {
                accuracy: eval.accuracy,
                correct,
                total,
                step: self.step,
            });
        }
        self.evaluation = Some(eval);
        Ok(eval)
    }

    /// The evaluation of the current step on `data`: the newest one if it is of this step
    /// (a periodic evaluation that just ran), else a new one ([`Session::evaluate`]).
    pub fn evaluate_now(&mut self, data: &Dataset) -> Result<Evaluation, TrainError> {
        match self.evaluation {
            Some(e) if e.step == self.step => Ok(e),
            _ => self.evaluate(data),
        }
    }

    /// Ends the session: the last checkpoint (if not written at this step), the mode told
    /// (the ps tasks: this worker is done), the chief's parameters to `save_params`;
    /// returns the trained parameters.
    pub fn close(mut self) -> Result<Trained<'m>, TrainError> {
        let checkpoint = self.save()?;
        self.end(End::Done)?;
        if let Some(p) = self.cfg.save_params.clone() {
            let step = self.step;
            self.strategy_mut().save_params(&p, step)?;
        }
        let strategy = self.strategy.take().expect("open until closed");
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        Ok(Trained {
            step: self.step,
            first_step: self.first,
            loss: self.loss,
            evaluation: self.evaluation,
            samples_per_sec: self.samples / secs,
            checkpoint,
            replica: strategy.into_replica(),
        })
    }
}

impl<'m, S: Strategy<'m>> Drop for Session<'m, '_, S> {
    /// A session dropped unclosed (an early return, a panic) tells its mode, which stops
    /// the job at once where peers would otherwise wait for it (the ps tasks).
    fn drop(&mut self) {
        if self.strategy.is_some() {
            let _ = self.end(End::Abandoned);
        }
    }
}
