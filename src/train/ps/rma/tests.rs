//! The one-sided ps in process, over the in-process transport's windows: the same code
//! that runs under `mpirun`.

use super::*;
use crate::tensor::DType;
use crate::train::optim::Optimizer;
use crate::train::ps::test_support::layout;
use crate::transport::local::LocalComm;

/// The ps tests' configuration, with a longer wait for a peer.
fn cfg(steps: u64, sync: bool) -> PsConfig {
    PsConfig {
        peer_timeout: Duration::from_secs(20),
        ..crate::train::ps::test_support::cfg(steps, sync)
    }
}

/// Every rank's run of `c` over `l` on `ranks` in-process ranks; the chief's events.
fn run_all(ranks: usize, l: &Layout, model: &dyn Model, c: &PsConfig) -> Vec<Event> {
    let data = Dataset::load("digits", 0).unwrap();
    let (train, test) = data.split_holdout(1);
    let events = LocalComm::run(ranks, |comm| {
        let mut seen = Vec::new();
        run(&comm, l, model, c, &train, &test, &mut |e| {
            seen.push(e.clone())
        })
        .unwrap();
        seen
    });
    events.into_iter().flatten().collect()
}

#[test]
fn sync_training_in_process_equals_local_training_and_resumes_from_its_checkpoint() {
    let data = Dataset::load("digits", 0).unwrap();
    let (train, test) = data.split_holdout(1);
    let mlp = crate::model::mlp(64, &[32], 10).unwrap();
    let local = crate::train::train_local(&mlp, &cfg(30, true).train, &train, &test, &mut |_| {});
    let local = local.unwrap();
    let dir = std::env::temp_dir().join(format!("mpiflow-rma-local-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // 2 ps tasks, 3 workers; variables cut into slices across both.
    let l = layout(5, 2);
    let mut c = cfg(20, true);
    c.train.checkpoint_dir = Some(dir.join("ckpt"));
    c.train.checkpoint_every = 10;
    c.strategy = placement::Strategy::Partition;
    c.partition_bytes = 4096;
    run_all(5, &l, &mlp, &c);
    for step in [10, 20] {
        let found = crate::train::checkpoint::verify(&dir.join(format!("ckpt/ckpt-{step}")));
        assert_eq!(found.unwrap().step, step);
    }
    // The rest of the run resumes from the newest, and ends where local training does.
    c.train.steps = 30;
    c.train.save_params = Some(dir.join("params.bin"));
    let events = run_all(5, &l, &mlp, &c);
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::Restored { step: 20, .. })),
        "{events:?}"
    );
    let worst = crate::train::max_relative_difference(&local.model, &dir.join("params.bin"));
    assert!(worst < 1e-4, "largest relative difference {worst}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn async_training_in_process_learns() {
    let mlp = crate::model::mlp(64, &[32], 10).unwrap();
    let mut c = cfg(600, false);
    c.train.optimizer = Optimizer::new(OptimizerKind::Sgd, 0.1);
    c.train.log_every = 100;
    let events = run_all(3, &layout(3, 1), &mlp, &c);
    let accuracy = events.iter().find_map(|e| match e {
        Event::Accuracy { accuracy, .. } => Some(*accuracy),
        _ => None,
    });
    assert!(accuracy.unwrap() > 0.85, "{events:?}");
    // Every logged loss is a trained step's: the chief's claim past the last step (the
    // other worker took it), which trains nothing, does not log a loss of 0.
    let losses: Vec<f32> = (events.iter())
        .filter_map(|e| match e {
            Event::Step(l) => Some(l.loss),
            _ => None,
        })
        .collect();
    assert!(!losses.is_empty(), "{events:?}");
    assert!(losses.iter().all(|l| *l > 0.0), "{losses:?}");
}

#[test]
fn async_training_checkpoints_snapshots_and_resumes_from_them() {
    let mlp = crate::model::mlp(64, &[32], 10).unwrap();
    let dir = std::env::temp_dir().join(format!("mpiflow-rma-async-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // 2 ps tasks, one worker (every global step the chief's: checkpoints on schedule);
    // variables cut into slices across both.
    let l = layout(3, 2);
    let mut c = cfg(300, false);
    c.train.optimizer = Optimizer::new(OptimizerKind::Sgd, 0.1);
    c.train.checkpoint_dir = Some(dir.join("ckpt"));
    c.train.checkpoint_every = 100;
    c.strategy = placement::Strategy::Partition;
    c.partition_bytes = 4096;
    c.train.save_params = Some(dir.join("trained.bin"));
    run_all(3, &l, &mlp, &c);
    // A checkpoint every hundred steps, the last written once every worker was done
    // (the trained parameters).
    let mut steps: Vec<u64> = (std::fs::read_dir(dir.join("ckpt")).unwrap())
        .filter_map(|e| {
            e.unwrap()
                .file_name()
                .to_str()?
                .strip_prefix("ckpt-")?
                .parse()
                .ok()
        })
        .collect();
    steps.sort();
    assert_eq!(steps, [100, 200, 300]);
    for step in &steps {
        let found = crate::train::checkpoint::verify(&dir.join(format!("ckpt/ckpt-{step}")));
        assert_eq!(found.unwrap().step, *step);
    }
    // Restored with nothing left to train: the parameters are the trained ones, exactly.
    c.train.save_params = Some(dir.join("restored.bin"));
    let events = run_all(3, &l, &mlp, &c);
    assert!(
        (events.iter()).any(|e| matches!(e, Event::Restored { step: 300, .. })),
        "{events:?}"
    );
    let read = |f: &str| crate::train::checkpoint::read_file(&dir.join(f), None).unwrap();
    let (trained, restored) = (read("trained.bin"), read("restored.bin"));
    for p in Replica::new(&mlp, 0).params {
        assert_eq!(
            trained.get(p.name()),
            restored.get(p.name()),
            "{}",
            p.name()
        );
    }
    // Resumed by two workers, training goes on from the global step restored and learns.
    c.train.steps = 600;
    let events = run_all(4, &layout(4, 2), &mlp, &c);
    assert!(
        (events.iter()).any(|e| matches!(e, Event::Restored { step: 300, .. })),
        "{events:?}"
    );
    let accuracy = events.iter().find_map(|e| match e {
        Event::Accuracy { accuracy, step, .. } => Some((*accuracy, *step)),
        _ => None,
    });
    let (accuracy, step) = accuracy.unwrap();
    assert_eq!(step, 600);
    assert!(accuracy > 0.85, "{accuracy}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pieces_number_each_ps_from_zero_and_slices_cover_the_tensors() {
    let shards = placement::place(
        &[("a".into(), 10), ("b".into(), 6)],
        2,
        placement::Strategy::Partition,
        16,
    );
    let ps = pieces(&shards);
    for k in 0..2 {
        let mut at: Vec<(usize, usize)> = ps
            .iter()
            .filter(|p| p.ps == k)
            .map(|p| (p.at, p.len))
            .collect();
        at.sort_unstable();
        let mut next = 0;
        for (a, l) in at {
            assert_eq!(a, next);
            next += l;
        }
    }
    let mut t = vec![
        Tensor::zeros(DType::F32, &[10]).unwrap(),
        Tensor::zeros(DType::F32, &[6]).unwrap(),
    ];
    for (i, (p, s)) in slices_mut(&mut t, &ps).into_iter().enumerate() {
        assert_eq!(s.len(), p.len);
        s.fill(i as f32 + 1.0);
    }
    // Every element written exactly by its own piece.
    for p in &ps {
        let v = &t[p.var].as_slice::<f32>().unwrap()[p.offset..p.offset + p.len];
        let i = ps.iter().position(|q| std::ptr::eq(q, p)).unwrap();
        assert!(v.iter().all(|x| *x == i as f32 + 1.0));
    }
}

/// One-sided training of 10 steps on 1 ps and 2 workers (ranks 1, 2), where the ranks
/// `refuses` says fail their third step at once (a refusal) and the others push it later:
/// every rank's outcome, within seconds (the wait for a peer is 20 s).
fn refusing_the_third_step(refuses: impl Fn(usize) -> bool + Sync) -> Vec<Result<(), String>> {
    let v = crate::tensor::Tensor::from_slice(&[4], &[0f32; 4])
        .unwrap()
        .named("v");
    let ext = crate::model::External::new("v", vec![v]).unwrap();
    let l = layout(3, 1);
    let c = cfg(10, true);
    let none = Dataset::synthetic(0, 0, 1, 0);
    let t = std::time::Instant::now();
    let out = LocalComm::run(3, |comm| {
        let w = comm.rank();
        let ran = scope(&comm, &l, &ext, &c, &none, &mut |_| {}, |mut sess| {
            while !sess.should_stop() {
                if sess.global_step() == 2 {
                    match refuses(w) {
                        true => return Err(ext.refuse(&mut sess, "no gradient".into())),
                        false => std::thread::sleep(Duration::from_millis(300)),
                    }
                }
                ext.run(&mut sess, &[&[1.0; 4]], 1.0, 2)?;
            }
            Ok(())
        });
        ran.map(|_| ()).map_err(|e| e.to_string())
    });
    let took = t.elapsed();
    assert!(took < Duration::from_secs(10), "{took:?}: {out:?}");
    out
}

/// Every worker failing the same step (each its own refusal) is no end of training to the
/// ps: it ends with an error naming how many failed, and nobody waits for the others at
/// the windows' release (which the failed never reach).
#[test]
fn every_worker_failing_one_step_ends_the_ps_with_an_error() {
    let out = refusing_the_third_step(|_| true);
    let said = |r: usize| out[r].as_ref().unwrap_err().clone();
    assert!(
        said(0).ends_with("stopped by a worker: 2 of 2 workers failed (their errors say why)"),
        "{out:?}"
    );
    assert!(
        said(1).contains("no gradient") && said(2).contains("no gradient"),
        "{out:?}"
    );
}

/// Worker 1 (rank 2) fails its third step at once; worker 0 pushes that step later. Both
/// learn within seconds, worker 0 naming worker 1.
#[test]
fn a_worker_failing_before_the_others_push_is_named_to_them_at_once() {
    let out = refusing_the_third_step(|w| w == 2);
    let said = |r: usize| out[r].as_ref().unwrap_err().clone();
    assert!(said(2).contains("no gradient"), "{out:?}");
    assert!(
        said(1).contains("worker:1 (rank 2) ended at step 2"),
        "{out:?}"
    );
    assert!(
        said(0).contains("worker:1 (rank 2) ended at step 2"),
        "{out:?}"
    );
}
