//! A training mode of the test's own, through the one step loop: local SGD (each replica
//! applies its own gradients; every K steps the replicas average their parameters),
//! written against the public [`Strategy`] trait and run in-process on `LocalComm`. It
//! gets what every mode shares without code of its own: the agreed stop on a signal (with
//! the checkpoint a rerun resumes from), checkpoints kept to the newest few, evaluation and
//! a target accuracy, the non-finite guard, hooks, the log window.

use mpiflow::model::{Model, Replica, Targets};
use mpiflow::observe::phases::{Clock, Phase, RankTimes, Times};
use mpiflow::tensor::Tensor;
use mpiflow::train::checkpoint::State;
use mpiflow::train::data::{shard, Batches, Dataset};
use mpiflow::train::engine::{Session, Started, StepInfo, StepWord, Strategy, TrainError};
use mpiflow::train::events::Event;
use mpiflow::train::optim::{Optimizer, OptimizerKind, Slots};
use mpiflow::train::TrainConfig;
use mpiflow::transport::local::LocalComm;
use mpiflow::transport::{Algorithm, Collectives, Comm, ReduceOp};

/// Local SGD: gradients applied where computed, parameters averaged every `k` steps.
struct LocalSgd<'m> {
    coll: Collectives<LocalComm>,
    replica: Replica<'m>,
    opt: Optimizer,
    slots: Vec<Slots>,
    grads: Vec<Tensor>,
    k: u64,
}

impl<'m> LocalSgd<'m> {
    fn new(comm: LocalComm, model: &'m dyn Model, cfg: &TrainConfig, k: u64) -> Self {
        let replica = Replica::new(model, cfg.seed);
        LocalSgd {
            coll: Collectives::new(comm),
            slots: replica
                .params
                .iter()
                .map(|p| cfg.optimizer.state(p.numel()))
                .collect(),
            grads: replica.zeros_like(),
            replica,
            opt: cfg.optimizer,
            k,
        }
    }
}

impl<'m> Strategy<'m> for LocalSgd<'m> {
    fn ranks(&self) -> (usize, usize) {
        (self.coll.size(), self.coll.rank())
    }

    fn replica(&self) -> &Replica<'m> {
        &self.replica
    }

    fn into_replica(self) -> Replica<'m> {
        self.replica
    }

    fn start(
        &mut self,
        dir: Option<&std::path::Path>,
        events: &mut dyn FnMut(&Event),
    ) -> Result<Started, TrainError> {
        // The chief's restored parameters (the optimizer state stays each replica's own).
        let chief = self.coll.rank() == 0;
        let restored = mpiflow::train::engine::restore(dir, chief, &self.replica, events)?;
        let mut step = [0u8; 8];
        if let Some(s) = &restored {
            s.apply_to(&mut self.replica, &mut self.slots, &self.opt);
            step = s.step.to_le_bytes();
        }
        self.coll.bcast(&mut step, 0)?;
        for p in &mut self.replica.params {
            self.coll.bcast_tensor(p, 0)?;
        }
        Ok(Started {
            step: u64::from_le_bytes(step),
            restored: restored.map(|s| s.step),
        })
    }

    fn gradients(
        &mut self,
        _: u64,
        x: &[f32],
        y: Targets<'_>,
        word: StepWord,
        clock: &mut Clock,
        _: &mut dyn FnMut(&Event),
    ) -> Result<StepWord, TrainError> {
        let t = std::time::Instant::now();
        let loss = self.replica.gradients_into(x, y, &mut self.grads)?;
        let t = clock.since(Phase::Compute, t);
        let rows = y.rows(self.replica.model.classes());
        let mine = word.with_loss(loss, rows).with_gradients(&self.grads);
        let agreed = mine.agree(&self.coll)?;
        clock.since(Phase::Comm, t);
        Ok(agreed)
    }

    fn pending(&self) -> &[Tensor] {
        &self.grads
    }

    fn apply(&mut self, step: u64) -> Result<u64, TrainError> {
        for ((p, g), s) in self
            .replica
            .params
            .iter_mut()
            .zip(&self.grads)
            .zip(&mut self.slots)
        {
            let g = g.as_slice::<f32>()?;
            self.opt.apply(p.as_mut_slice::<f32>()?, g, s);
        }
        Ok(step + 1)
    }

    fn after_step(&mut self, done: u64) -> Result<(), TrainError> {
        if done.is_multiple_of(self.k) {
            for p in &mut self.replica.params {
                self.coll
                    .allreduce_tensor(p, ReduceOp::Average, Algorithm::Auto)?;
            }
        }
        Ok(())
    }

    fn state(&mut self, step: u64) -> Result<State, TrainError> {
        Ok(State::of_replica(&self.replica, &self.slots, step))
    }

    fn sum(&mut self, values: &mut [f64]) -> Result<(), TrainError> {
        let mut t = Tensor::from_slice(&[values.len()], values)?;
        self.coll
            .allreduce_tensor(&mut t, ReduceOp::Sum, Algorithm::Auto)?;
        values.copy_from_slice(t.as_slice::<f64>()?);
        Ok(())
    }

    fn window(&mut self, _: u64, clock: &mut Clock) -> Result<(Times, Vec<RankTimes>), TrainError> {
        let mine = clock.take();
        let task = format!("replica {}", self.coll.rank());
        let rank = self.coll.rank();
        Ok((
            mine,
            vec![RankTimes {
                rank,
                task,
                times: mine,
            }],
        ))
    }
}

const REPLICAS: usize = 3;

fn config(steps: u64, dir: Option<&std::path::Path>) -> TrainConfig {
    TrainConfig {
        steps,
        batch: 48,
        log_every: 20,
        checkpoint_dir: dir.map(std::path::Path::to_path_buf),
        checkpoint_every: 20,
        keep_checkpoints: 2,
        optimizer: Optimizer::new(OptimizerKind::Adam, 0.003),
        ..TrainConfig::default()
    }
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("mpiflow-engine-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn checkpoints(dir: &std::path::Path) -> Vec<u64> {
    let mut steps: Vec<u64> = mpiflow::train::checkpoint::listed(dir)
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    steps.sort();
    steps
}

/// What one replica's session saw: its events, the step it ended at, its result.
struct Ran {
    events: Vec<Event>,
    step: u64,
    result: Result<Option<Vec<f32>>, TrainError>,
}

/// What a run sets up besides the config.
#[derive(Default, Clone, Copy)]
struct Setup {
    /// Evaluate every this many steps, and stop at this accuracy.
    eval_every: u64,
    target: Option<f64>,
    /// This replica is sent SIGTERM before its step this many.
    signal: Option<(usize, u64)>,
    /// This replica's hook asks to stop after this step.
    hook: Option<(usize, u64)>,
    /// Replica 1 is fed NaN samples from this step on.
    poison: Option<u64>,
}

/// Each replica trains its share of each global batch in a session of `LocalSgd` (K = 5)
/// until it stops.
fn train(cfg: &TrainConfig, train: &Dataset, test: &Dataset, setup: Setup) -> Vec<Ran> {
    let model = mpiflow::model::mlp(64, &[32], 10).unwrap();
    LocalComm::run(REPLICAS, |c| {
        let rank = c.rank();
        let mut events = Vec::new();
        let mut step = 0;
        let result = || -> Result<Option<Vec<f32>>, TrainError> {
            let strategy = LocalSgd::new(c, &model, cfg, 5);
            let sink = |e: &Event| events.push(e.clone());
            let mut sess =
                Session::with_events(strategy, cfg, sink)?.evaluate_every(setup.eval_every, test);
            if let Some(t) = setup.target {
                sess = sess.stop_at_accuracy(t);
            }
            let mut calls = 0;
            sess = sess.with_signals(move || {
                calls += 1;
                let sent = setup.signal.is_some_and(|(r, at)| r == rank && calls > at);
                sent.then_some(15)
            });
            if let Some((r, at)) = setup.hook {
                sess = sess.with_hook(move |i: &StepInfo| rank == r && i.global_step == at);
            }
            let mut batches = Batches::new(train.len(), cfg.batch, cfg.seed);
            while !sess.should_stop() {
                step = sess.global_step();
                let global = batches.global(step);
                let (mut x, y) = train.rows(shard(global, rank, REPLICAS));
                if rank == 1 && setup.poison.is_some_and(|p| step >= p) {
                    x[0] = f32::NAN;
                }
                sess.run(&x, &y)?;
            }
            let trained = sess.close()?;
            step = trained.step;
            let flat = trained
                .replica
                .params
                .iter()
                .flat_map(|p| p.as_slice::<f32>().unwrap().to_vec())
                .collect();
            Ok(Some(flat))
        };
        let result = result();
        Ran {
            events,
            step,
            result,
        }
    })
}

fn digits() -> (Dataset, Dataset) {
    Dataset::load("digits", 0).unwrap().split_holdout(1)
}

#[test]
fn a_strategy_of_its_own_trains_evaluates_and_keeps_checkpoints_through_the_loop() {
    let (data, test) = digits();
    let dir = tmpdir("train");
    let cfg = config(100, Some(&dir));
    let setup = Setup {
        eval_every: 50,
        ..Setup::default()
    };
    let runs = train(&cfg, &data, &test, setup);
    let params: Vec<Vec<f32>> = runs
        .iter()
        .map(|r| r.result.clone().unwrap().unwrap())
        .collect();
    // Step 100 is a multiple of K: every replica holds the averaged parameters.
    assert!(params.iter().all(|p| *p == params[0]));
    // The chief logged every 20 steps, its loss falling; it evaluated at 50 and 100.
    let chief = &runs[0].events;
    let losses: Vec<f32> = chief
        .iter()
        .filter_map(|e| match e {
            Event::Step(l) => Some(l.loss),
            _ => None,
        })
        .collect();
    assert_eq!(losses.len(), 5, "{chief:?}");
    assert!(losses[4] < losses[0] * 0.5, "{losses:?}");
    let evals: Vec<(u64, f64, usize)> = chief
        .iter()
        .filter_map(|e| match e {
            Event::Accuracy {
                step,
                accuracy,
                total,
                ..
            } => Some((*step, *accuracy, *total)),
            _ => None,
        })
        .collect();
    assert_eq!(evals.iter().map(|e| e.0).collect::<Vec<_>>(), [50, 100]);
    assert!(evals.iter().all(|e| e.2 == test.len()), "{evals:?}");
    assert!(evals[1].1 >= 0.85, "{evals:?}");
    // The others report nothing; checkpoints every 20 steps, the newest 2 kept.
    assert!(runs[1].events.is_empty(), "{:?}", runs[1].events);
    assert_eq!(checkpoints(&dir), [80, 100]);
    // A rerun with more steps resumes from step 100 (the chief's restore, broadcast).
    let more = config(120, Some(&dir));
    let runs = train(&more, &data, &test, Setup::default());
    assert!(matches!(
        &runs[0].events[0],
        Event::Restored { step: 100, .. }
    ));
    assert!(runs.iter().all(|r| r.step == 120));
    assert_eq!(checkpoints(&dir), [100, 120]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_signal_on_one_replica_stops_every_replica_after_the_same_step_with_a_checkpoint() {
    let (data, test) = digits();
    let dir = tmpdir("signal");
    let cfg = config(1000, Some(&dir));
    // Replica 2 is sent SIGTERM before its step 34 (after 33 steps).
    let setup = Setup {
        signal: Some((2, 33)),
        ..Setup::default()
    };
    let runs = train(&cfg, &data, &test, setup);
    for r in &runs {
        match &r.result {
            Err(TrainError::Stopped(s)) => {
                assert_eq!((s.signal.as_str(), s.step), ("SIGTERM", 34));
                assert_eq!(s.checkpoint.as_deref(), Some(&*dir.join("ckpt-34")));
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(runs[0].result.as_ref().unwrap_err().is_agreed());
    assert_eq!(checkpoints(&dir), [20, 34]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_non_finite_gradient_on_one_replica_stops_every_replica_before_the_update() {
    let (data, test) = digits();
    let dir = tmpdir("guard");
    let cfg = config(100, Some(&dir));
    let setup = Setup {
        poison: Some(45),
        ..Setup::default()
    };
    let runs = train(&cfg, &data, &test, setup);
    // A NaN sample: the replica's loss stays finite (softmax's max skips it), its gradients
    // do not; it says so in its word.
    let want = "a gradient holds a non-finite value at step 45 on 1 of 3 replicas: training \
                stopped before applying it (no checkpoint follows it: lower --lr and resume from the newest)";
    for r in &runs {
        let e = r.result.as_ref().unwrap_err();
        assert!(e.is_agreed(), "{e}");
        assert_eq!(e.to_string(), want);
    }
    assert_eq!(checkpoints(&dir), [20, 40]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_target_accuracy_or_one_replicas_hook_stops_every_replica_together() {
    let (data, test) = digits();
    let cfg = config(2000, None);
    let setup = Setup {
        eval_every: 10,
        target: Some(0.8),
        ..Setup::default()
    };
    let runs = train(&cfg, &data, &test, setup);
    let steps: Vec<u64> = runs.iter().map(|r| r.step).collect();
    assert!(
        steps[0] < 2000 && steps.iter().all(|s| *s == steps[0]),
        "{steps:?}"
    );
    let last = runs[0].events.iter().rev().find_map(|e| match e {
        Event::Accuracy { accuracy, step, .. } => Some((*accuracy, *step)),
        _ => None,
    });
    assert!(
        matches!(last, Some((a, s)) if a >= 0.8 && s == steps[0]),
        "{last:?}"
    );
    // Replica 1's hook asks at step 7: every replica stops after step 8 (the word of step
    // 8 carries the request).
    let setup = Setup {
        hook: Some((1, 7)),
        ..Setup::default()
    };
    let runs = train(&cfg, &data, &test, setup);
    assert!(runs.iter().all(|r| r.step == 8 && r.result.is_ok()));
}

/// A regression (values, not labels) through the same model interface and step loop: a
/// dense layer learns a planted linear map, its mean squared error falling to nothing and
/// its parameters reaching the map's.
#[test]
fn a_regression_trains_through_the_session_on_values() {
    let (features, outputs, n) = (4, 2, 512);
    let truth = [0.5f32, -1.0, 2.0, 0.25, -0.75, 1.5, 0.0, -2.0];
    let bias = [0.3f32, -0.2];
    let mut rng = mpiflow::rng::Rng::new(3);
    let x: Vec<f32> = (0..n * features).map(|_| rng.normal() as f32).collect();
    let t: Vec<f32> = x
        .chunks(features)
        .flat_map(|row| {
            (0..outputs).map(move |o| {
                let dot: f32 = (0..features).map(|f| row[f] * truth[f * outputs + o]).sum();
                dot + bias[o]
            })
        })
        .collect();
    let model = mpiflow::model::mlp(features, &[], outputs).unwrap();
    let cfg = TrainConfig {
        steps: 600,
        batch: 32,
        log_every: 0,
        optimizer: Optimizer::new(OptimizerKind::Adam, 0.05),
        ..TrainConfig::default()
    };
    let mut sess = Session::new(mpiflow::Local::new(&model, &cfg).unwrap(), &cfg).unwrap();
    let mut batches = Batches::new(n, cfg.batch, cfg.seed);
    let mut losses = Vec::new();
    while !sess.should_stop() {
        let rows = batches.global(sess.global_step());
        let xb: Vec<f32> = rows
            .iter()
            .flat_map(|r| &x[r * features..(r + 1) * features])
            .copied()
            .collect();
        let tb: Vec<f32> = rows
            .iter()
            .flat_map(|r| &t[r * outputs..(r + 1) * outputs])
            .copied()
            .collect();
        losses.push(sess.run(&xb, &tb).unwrap().loss);
    }
    let trained = sess.close().unwrap();
    assert!(losses[0] > 1.0, "{:?}", &losses[..5]);
    assert!(
        *losses.last().unwrap() < 1e-4,
        "{:?}",
        &losses[losses.len() - 5..]
    );
    let w = trained.replica.params[0].as_slice::<f32>().unwrap();
    let b = trained.replica.params[1].as_slice::<f32>().unwrap();
    for (got, want) in w.iter().zip(&truth).chain(b.iter().zip(&bias)) {
        assert!((got - want).abs() < 1e-2, "{w:?} {b:?}");
    }
    // Labels where the model regresses values, or values of another width: one line.
    let mut sess = Session::new(mpiflow::Local::new(&model, &cfg).unwrap(), &cfg).unwrap();
    let e = sess.run(&x[..3 * features], &t[..5]).unwrap_err();
    assert!(
        e.to_string()
            .contains("5 target values are not a whole number of rows of its 2 outputs"),
        "{e}"
    );
}
