use super::test_support::{cfg, layout};
use super::*;
use crate::cluster::MappingOptions;
use crate::transport::local::LocalComm;

#[test]
fn sync_ps_training_equals_local_training_of_the_combined_batch() {
    let data = Dataset::load("digits", 0).unwrap();
    let (train, test) = data.split_holdout(1);
    let steps = 40;
    let mlp = crate::model::mlp(64, &[128], 10).unwrap();
    let local =
        super::super::train_local(&mlp, &cfg(steps, true).train, &train, &test, &mut |_| {})
            .unwrap();
    let dir = std::env::temp_dir().join(format!("mpiflow-ps-eq-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("params.bin");
    let l = layout(5, 2);
    let mut c = cfg(steps, true);
    c.train.save_params = Some(out.clone());
    c.strategy = Strategy::Partition;
    c.partition_bytes = 4096; // slices, so partitioned variables are exercised too
    LocalComm::run(5, |comm| {
        run(&comm, &l, &mlp, &c, &train, &test, &mut |_| {}).unwrap()
    });
    let worst = crate::train::max_relative_difference(&local.model, &out);
    assert!(worst < 1e-4, "largest relative difference {worst}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn workers_of_different_models_fail_together() {
    let data = Dataset::load("digits", 0).unwrap();
    let (train, test) = data.split_holdout(1);
    let l = layout(3, 1); // ps:0, worker:0, worker:1
    let c = cfg(5, true);
    // Every rank's result when worker:1 (rank 2) builds `other` and the rest `model`,
    // within 5 s: at once, not at a timeout.
    let mixed = |model: &dyn crate::model::Model, other: &dyn crate::model::Model| {
        let t = std::time::Instant::now();
        let out = LocalComm::run(3, |comm| {
            let m = if comm.rank() == 2 { other } else { model };
            run(&comm, &l, m, &c, &train, &test, &mut |_| {}).map_err(|e| e.to_string())
        });
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        out
    };
    let wide = crate::model::mlp(64, &[32], 10).unwrap();
    let narrow = crate::model::mlp(64, &[16], 10).unwrap();
    let out = mixed(&wide, &narrow);
    // Every rank, naming the worker and what differs (the others heard "left its
    // training session without closing it", the worker "sent parameters of another
    // length than its shards").
    let why = "worker:1 (rank 2): its model is another than the chief's: ps:0 (rank 0) \
               holds 2410 values of the variables it serves here, this model 1210";
    assert_eq!(out[2], Err(why.to_string()));
    assert_eq!(
        out[0],
        Err(format!("ps:0 (rank 0): stopped by a worker: {why}"))
    );
    assert_eq!(
        out[1],
        Err(format!("worker:0 (rank 1): stopped by a ps: {why}"))
    );
    // Large enough for the parameters to come in pieces, and the worker the wider.
    let big = crate::model::mlp(64, &[1024], 10).unwrap();
    let bigger = crate::model::mlp(64, &[2048], 10).unwrap();
    let pieces = mixed(&big, &bigger);
    let why = "worker:1 (rank 2): its model is another than the chief's: ps:0 (rank 0) \
               sent a piece of the parameters it serves here of another length than this \
               model's 524288 bytes";
    assert_eq!(pieces[2], Err(why.to_string()));
    assert_eq!(
        pieces[1],
        Err(format!("worker:0 (rank 1): stopped by a ps: {why}"))
    );
}

/// The chief's logged steps carry every rank's phase times: its own, the other
/// workers' (reported with their pushes) and the ps tasks' (with their pull replies);
/// sync, each logged window holds exactly its steps on every worker; async, every rank
/// is heard from and no step is counted twice.
#[test]
fn logged_steps_carry_every_ranks_phase_times() {
    let data = Dataset::load("digits", 0).unwrap();
    let (train, test) = data.split_holdout(1);
    let mlp = crate::model::mlp(64, &[32], 10).unwrap();
    let l = layout(4, 1); // ps:0, worker:0..2
                          // One run: the chief's logged steps, and per rank its task and the steps its
                          // reports counted.
    type Heard = std::collections::BTreeMap<usize, (String, u64)>;
    let once = |sync: bool, steps: u64| -> (Vec<crate::train::StepLog>, Heard) {
        let mut c = cfg(steps, sync);
        c.train.log_every = steps / 3;
        let logs = LocalComm::run(4, |comm| {
            let mut steps = Vec::new();
            run(&comm, &l, &mlp, &c, &train, &test, &mut |e| {
                if let Event::Step(s) = e {
                    steps.push(s.clone())
                }
            })
            .unwrap();
            steps
        });
        let logged: Vec<crate::train::StepLog> = logs.into_iter().flatten().collect();
        let mut per_rank = Heard::new();
        for s in &logged {
            for r in &s.ranks {
                let t = &r.times;
                assert!(t.compute >= 0.0 && t.comm >= 0.0 && t.wait >= 0.0, "{r:?}");
                let e = per_rank.entry(r.rank).or_insert((r.task.clone(), 0));
                e.1 += t.steps;
            }
        }
        (logged, per_rank)
    };
    for sync in [true, false] {
        let steps = if sync { 60 } else { 600 };
        let (mut logged, mut per_rank) = once(sync, steps);
        // Async: a worker is heard from once it takes a step after the first log line,
        // and the workers are threads here, scheduled as the machine pleases: on two
        // cores busy with other tests one may not run before the chief's last step.
        // Each try is a fresh run; reports that never arrive fail every one.
        for _ in 0..4 {
            if sync || per_rank.len() == 4 {
                break;
            }
            (logged, per_rank) = once(sync, steps);
        }
        assert_eq!(logged.len(), 3, "sync {sync}: {logged:?}");
        if sync {
            for s in &logged {
                // Every worker's window is the logged window: 20 steps each.
                let workers: Vec<u64> = (1..4)
                    .map(|w| s.ranks.iter().find(|r| r.rank == w).unwrap().times.steps)
                    .collect();
                assert_eq!(workers, [steps / 3; 3], "{s:?}");
                let ps = s.ranks.iter().find(|r| r.rank == 0).unwrap();
                assert_eq!((ps.task.as_str(), ps.times.steps), ("ps:0", steps / 3));
                assert!(ps.times.compute > 0.0, "the ps applied updates: {ps:?}");
            }
        }
        let tasks: Vec<&str> = per_rank.values().map(|v| v.0.as_str()).collect();
        assert_eq!(
            tasks,
            ["ps:0", "worker:0", "worker:1", "worker:2"],
            "sync {sync}"
        );
        // Sync: every worker took each of the steps, the ps made as many updates.
        // Async: the ps counts the updates it applied, the workers their own steps
        // (the steps in all); what was not reported by the last log line is not
        // counted.
        let worker_steps: Vec<u64> = (1..4).map(|w| per_rank[&w].1).collect();
        if sync {
            assert_eq!((worker_steps, per_rank[&0].1), (vec![steps; 3], steps));
        } else {
            let sum: u64 = worker_steps.iter().sum();
            assert!(sum <= steps && per_rank[&0].1 <= steps, "{per_rank:?}");
        }
    }
}

/// Payloads above the inline size travel as pieces (a variable of more than one piece
/// too), sync and async, with a backup worker whose late pushes are taken and dropped,
/// each push with its pull in one request (one ps) or apart (two): the parameters
/// still equal local training's (async: one worker, the same updates in the same
/// order).
#[test]
fn large_variables_travel_as_pieces_and_training_still_equals_local() {
    let data = Dataset::load("digits", 0).unwrap();
    let (train, test) = data.split_holdout(1);
    let steps = 4;
    let hidden = protocol::PIECE_FLOATS / 64 + 100;
    let mlp = crate::model::mlp(64, &[hidden], 10).unwrap();
    let dir = std::env::temp_dir().join(format!("mpiflow-ps-big-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("params.bin");
    let cases = [
        (2, false, false),
        (3, true, false),
        (3, true, true),
        (4, true, false),
        (4, true, true),
    ];
    for (n, sync, backup) in cases {
        let mut c = cfg(steps, sync);
        if backup {
            // Two workers, one aggregated per step: the other's push is stale.
            c.replicas_to_aggregate = Some(1);
        }
        let local = super::super::train_local(&mlp, &c.train, &train, &test, &mut |_| {}).unwrap();
        c.train.save_params = Some(out.clone());
        let l = layout(n, if n == 4 { 2 } else { 1 });
        LocalComm::run(n, |comm| {
            run(&comm, &l, &mlp, &c, &train, &test, &mut |_| {}).unwrap()
        });
        if !backup {
            let worst = crate::train::max_relative_difference(&local.model, &out);
            assert!(
                worst < 1e-4,
                "{n} ranks, sync {sync}: largest difference {worst}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An evaluator task evaluates the chief's checkpoints as they come, the last the
/// final step's, with the chief's final accuracy; without checkpoints it says it is
/// idle.
#[test]
fn an_evaluator_evaluates_the_chiefs_checkpoints() {
    let data = Dataset::synthetic(400, 8, 3, 1);
    let (train, test) = data.split_holdout(1);
    let mlp = crate::model::mlp(8, &[16], 3).unwrap();
    let opts = MappingOptions {
        ps: 1,
        evaluator: true,
        ..Default::default()
    };
    let l = Layout::single_host(4, &opts).unwrap(); // ps:0, worker:0, worker:1, evaluator:0
    let dir = std::env::temp_dir().join(format!("mpiflow-ps-eval-{}", std::process::id()));
    for with_dir in [true, false] {
        let _ = std::fs::remove_dir_all(&dir);
        let mut c = cfg(30, true);
        c.train.checkpoint_every = 10;
        c.train.checkpoint_dir = with_dir.then(|| dir.clone());
        let out = LocalComm::run(4, |comm| {
            let mut seen = Vec::new();
            run(&comm, &l, &mlp, &c, &train, &test, &mut |e| match e {
                Event::Evaluated { step, accuracy, .. } => seen.push((*step, *accuracy)),
                Event::Accuracy { step, accuracy, .. } => seen.push((*step, *accuracy)),
                Event::Warning(w) if w.contains("evaluator") => seen.push((0, -1.0)),
                _ => {}
            })
            .unwrap();
            seen
        });
        let (chief, evaluator) = (&out[1], &out[3]);
        if !with_dir {
            assert_eq!(evaluator, &[(0, -1.0)], "the idle warning");
            continue;
        }
        assert_eq!(chief.len(), 1, "{chief:?}");
        assert_eq!(evaluator.last(), chief.last(), "{evaluator:?}");
        assert!(
            evaluator.windows(2).all(|w| w[0].0 < w[1].0),
            "{evaluator:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A worker whose loss is not finite (its data here), one ps and two: every rank, the
/// ps tasks too, ends with the same verdict at once, synchronous counting the workers
/// that saw it, asynchronous naming the worker (`tests/mpirun_faults.rs` checks that no
/// checkpoint follows).
#[test]
fn a_non_finite_step_is_one_verdict_on_every_rank() {
    let data = Dataset::synthetic(200, 8, 3, 1);
    let (train, test) = data.split_holdout(1);
    let mut poisoned = train.clone();
    poisoned.x.iter_mut().for_each(|v| *v = f32::NAN);
    let mlp = crate::model::mlp(8, &[4], 3).unwrap();
    // Every rank's outcome, the last worker's data NaN from the first step; at once.
    let outcomes = |n: usize, ps: usize, c: &PsConfig| {
        let l = layout(n, ps);
        let t = std::time::Instant::now();
        let out = LocalComm::run(n, |comm| {
            let mine = if comm.rank() == n - 1 {
                &poisoned
            } else {
                &train
            };
            run(&comm, &l, &mlp, c, mine, &test, &mut |_| {}).map_err(|e| e.to_string())
        });
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        out
    };
    for (n, ps) in [(4, 1), (5, 2)] {
        let out = outcomes(n, ps, &cfg(5, true));
        // (ReLU takes NaN to 0: the loss stays finite, the first layer's gradient not.)
        let verdict = "gradient 'layer0/w' holds NaN at step 0 on 1 of 3 workers: \
                       training stopped before applying it (no checkpoint follows it: \
                       lower --lr and resume from the newest)";
        assert_eq!(out, vec![Err(verdict.to_string()); n], "{n} ranks, {ps} ps");
    }
    // Asynchronous: the first finding refuses training from there on, on every rank
    // (steps enough that no healthy worker can finish before the finding arrives).
    for (n, ps) in [(4, 1), (5, 2)] {
        let out = outcomes(n, ps, &cfg(1_000_000, false));
        // The same verdict on every rank, at the global step the worker had pulled.
        assert!(
            out.iter().all(|o| *o == out[0]),
            "async, {n} ranks, {ps} ps: {out:?}"
        );
        let verdict = out[0].clone().unwrap_err();
        let whose = format!(" on worker:2 (rank {}): training stopped before", n - 1);
        assert!(
            verdict.starts_with("gradient 'layer0/w' holds NaN at step ")
                && verdict.contains(&whose),
            "{verdict}"
        );
    }
}

#[test]
fn bad_pushes_are_rejected_and_the_ps_keeps_serving() {
    let data = Dataset::synthetic(200, 8, 3, 1);
    let (train, test) = data.split_holdout(1);
    let l = layout(3, 1);
    let c = cfg(5, true);
    let mlp = crate::model::mlp(8, &[4], 3).unwrap();
    let out = LocalComm::run(3, |comm| {
        if comm.rank() == 2 {
            // worker:1 waits for the chief's initialisation, then misbehaves before
            // taking part: an unknown variable, a wrong length.
            let pull = protocol::encode(&protocol::Request::Pull(protocol::Then {
                step: 0,
                report: false,
            }));
            let req = protocol::request_tag(&comm);
            crate::transport::messages::send(&comm, &pull, 0, req).unwrap();
            let reply = protocol::reply_tag(&comm);
            let mut inbox = Vec::new();
            wire::receive_within_into(&comm, 0, reply, Duration::from_secs(10), &mut inbox)
                .unwrap()
                .unwrap();

            let bad = |vars: Vec<(String, usize)>, n: usize| {
                let push = protocol::Request::Push {
                    step: 0,
                    samples: 1,
                    loss: Some(0.0),
                    vars,
                    stop: None,
                    times: None,
                    non_finite: None,
                    pull: None,
                };
                // A small payload rides in the header's message.
                let m = protocol::encode_with(&push, &[&vec![0.0; n]]);
                let req = protocol::request_tag(&comm);
                crate::transport::messages::send(&comm, &m, 0, req).unwrap();
                let reply = protocol::reply_tag(&comm);
                let mut r = Vec::new();
                wire::receive_within_into(&comm, 0, reply, Duration::from_secs(10), &mut r)
                    .unwrap()
                    .unwrap();
                wire::reply_of(&r).unwrap_err()
            };
            let e1 = bad(vec![("nope@0".into(), 3)], 3);
            let e2 = bad(vec![("layer0/w@0".into(), 5)], 5);
            run(&comm, &l, &mlp, &c, &train, &test, &mut |_| {}).unwrap();
            format!("{e1}\n{e2}")
        } else {
            run(&comm, &l, &mlp, &c, &train, &test, &mut |_| {}).unwrap();
            String::new()
        }
    });
    assert!(out[2].contains("unknown variable 'nope@0'"), "{}", out[2]);
    assert!(
        out[2].contains("'layer0/w@0' has 32 elements on ps:0, the push has 5"),
        "{}",
        out[2]
    );
}
