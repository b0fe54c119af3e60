//! A click model trained in every mode that holds tables reaches the AUC of local
//! training on the same steps.

use super::*;
use crate::model::dlrm::Dlrm;
use crate::model::embedding::{SparseOptimizer, TableSpec};
use crate::train::events::Event;
use crate::train::hybrid::HybridConfig;
use crate::train::optim::{Optimizer, OptimizerKind};
use crate::train::ps::test_support::layout;
use crate::train::ps::PsConfig;
use crate::train::TrainConfig;
use crate::transport::local::LocalComm;

fn model(data: &SyntheticCtr) -> Dlrm {
    let tables = (data.tables.iter().enumerate())
        .map(|(f, rows)| TableSpec::new(&format!("emb{f}"), *rows, 8))
        .collect();
    Dlrm::new(data.dense, tables, &[32], &[32]).unwrap()
}

fn cfg(steps: u64) -> TrainConfig {
    TrainConfig {
        batch: 256,
        steps,
        optimizer: Optimizer::new(OptimizerKind::Adam, 0.003),
        log_every: 0,
        ..TrainConfig::default()
    }
}

/// The AUC each rank that evaluated reached.
fn aucs(reports: Vec<Option<CtrReport>>) -> Vec<f64> {
    (reports.into_iter().flatten())
        .filter_map(|r| r.evaluation.and_then(|e| e.auc))
        .collect()
}

#[test]
fn hybrid_and_ps_training_reach_the_auc_of_local_training() {
    let data = SyntheticCtr::parse("samples=420000,features=8,rows=2000,seed=4").unwrap();
    let (train, test) = Part::split(&data, 20_000);
    let m = model(&data);
    let cfg = cfg(1200);
    // Rows pulled ahead here; under mpirun on this machine's shared CPUs they are not.
    let run = CtrRun::new(&m, (&train, &test), &cfg, SparseOptimizer::adagrad(0.2))
        .rows_ahead(RowsAhead::On);
    let local = run
        .local(&mut |_| {})
        .unwrap()
        .evaluation
        .unwrap()
        .auc
        .unwrap();
    let l = layout(4, 2);
    let hybrid_cfg = HybridConfig::default();
    let hybrid = aucs(LocalComm::run(4, |comm| {
        run.hybrid(&comm, &l, &hybrid_cfg, &mut |_| {}).unwrap()
    }));
    let l = layout(3, 1);
    let ps_cfg = PsConfig::default();
    let ps = aucs(LocalComm::run(3, |comm| {
        run.ps(&comm, &l, &ps_cfg, &mut |_| {}).unwrap()
    }));
    eprintln!("local {local} hybrid {hybrid:?} ps {ps:?}");
    assert!(local > 0.8, "local AUC {local}");
    // Both hybrid workers evaluate (their shares summed); the ps chief alone.
    assert_eq!(hybrid.len(), 2);
    assert_eq!(hybrid[0], hybrid[1]);
    assert_eq!(ps.len(), 1);
    for (mode, auc) in [("hybrid", hybrid[0]), ("ps", ps[0])] {
        assert!(
            (auc - local).abs() < 0.01,
            "{mode} AUC {auc}, local {local}"
        );
    }
}

/// With one worker, rows pulled ahead of a step's gradients (those its push does not
/// touch) are the rows pulled with its push: hybrid and ps training end the same either
/// way, to the last bit, on one ps task and on two.
#[test]
fn rows_pulled_ahead_train_as_rows_pulled_with_the_push() {
    let data = SyntheticCtr::parse("samples=120000,features=8,rows=2000,seed=4").unwrap();
    let (train, test) = Part::split(&data, 5000);
    let m = model(&data);
    let cfg = cfg(300);
    for ps in [1, 2] {
        let l = layout(ps + 1, ps);
        let ends = |ahead: RowsAhead| {
            let run = CtrRun::new(&m, (&train, &test), &cfg, SparseOptimizer::adagrad(0.2))
                .rows_ahead(ahead);
            // The pull requests the ps tasks served: two a step where rows come ahead.
            let pulls = std::sync::Mutex::new(0);
            let count = |e: &Event| {
                if let Event::Rows { reports, .. } = e {
                    let served = reports.iter().flat_map(|r| &r.tables).map(|t| t.pulls);
                    *pulls.lock().unwrap() += served.sum::<u64>();
                }
            };
            let hybrid = LocalComm::run(ps + 1, |comm| {
                run.hybrid(&comm, &l, &HybridConfig::default(), &mut count.clone())
                    .unwrap()
            });
            let ps_mode = LocalComm::run(ps + 1, |comm| {
                run.ps(&comm, &l, &PsConfig::default(), &mut |_| {})
                    .unwrap()
            });
            let end = |r: Vec<Option<CtrReport>>| {
                let r = r.into_iter().flatten().next().unwrap();
                let e = r.evaluation.unwrap();
                (
                    r.steps,
                    r.loss.to_bits(),
                    e.auc.unwrap().to_bits(),
                    e.logloss.to_bits(),
                )
            };
            let pulls = pulls.into_inner().unwrap();
            (end(hybrid), end(ps_mode), pulls)
        };
        let (on, off) = (ends(RowsAhead::On), ends(RowsAhead::Off));
        assert_eq!(on.0 .0, 300);
        assert_eq!((on.0, on.1), (off.0, off.1), "{ps} ps");
        // Each of the 8 tables on each ps: a pull a step with the push, one ahead too.
        let per_step = 8 * ps as u64;
        assert!(
            off.2 < 2 * 299 * per_step && on.2 >= 2 * 299 * per_step,
            "{on:?} {off:?}"
        );
    }
}

/// Local training stopped at a checkpoint and resumed from it ends where one
/// uninterrupted run ends: the dense state and every row with its Adagrad state come back
/// (the same evaluation to the last bit).
#[test]
fn local_training_resumed_from_its_checkpoint_equals_one_run() {
    let data = SyntheticCtr::parse("samples=120000,features=8,rows=2000,seed=4").unwrap();
    let (train, test) = Part::split(&data, 5000);
    let m = model(&data);
    let dir = std::env::temp_dir().join(format!("mpiflow-ctr-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = |steps: u64, dir: Option<&std::path::Path>| {
        let cfg = TrainConfig {
            checkpoint_dir: dir.map(|d| d.to_path_buf()),
            ..cfg(steps)
        };
        let run = CtrRun::new(&m, (&train, &test), &cfg, SparseOptimizer::adagrad(0.2));
        run.local(&mut |_| {}).unwrap().evaluation.unwrap()
    };
    let straight = run(400, None);
    let first = run(200, Some(&dir));
    assert_eq!(first.step, 200);
    let resumed = run(400, Some(&dir));
    assert_eq!(
        (resumed.step, resumed.auc, resumed.logloss),
        (400, straight.auc, straight.logloss)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Rows that outgrow a ps task's memory share stop training on every rank within the
/// step, with one line naming the table and the share.
#[test]
fn rows_outgrowing_a_ps_tasks_share_stop_every_rank_naming_the_table() {
    let data = SyntheticCtr::parse("samples=100000,features=8,rows=2000,seed=4").unwrap();
    let (train, test) = Part::split(&data, 2000);
    let m = model(&data);
    let cfg = cfg(400);
    let share = crate::train::resources::Share {
        bytes: 200_000,
        why: "the test's limit".into(),
    };
    let run =
        CtrRun::new(&m, (&train, &test), &cfg, SparseOptimizer::adagrad(0.2)).within(Some(share));
    let l = layout(3, 1);
    let t = std::time::Instant::now();
    let out = LocalComm::run(3, |comm| {
        run.hybrid(&comm, &l, &HybridConfig::default(), &mut |_| {})
            .map(drop)
            .map_err(|e| e.to_string())
    });
    assert!(
        t.elapsed() < std::time::Duration::from_secs(20),
        "{:?}",
        t.elapsed()
    );
    // The worker whose request outgrew the share names the table; a worker whose
    // requests all fit stops by the step's agreement, which carries that reason.
    for (rank, r) in out.iter().enumerate() {
        let e = r.as_ref().expect_err("a rank trained on");
        assert!(
            e.contains("table emb")
                && e.contains("ps:0's rows")
                && e.contains("200.0 KB (the test's limit)"),
            "rank {rank}: {e}"
        );
    }
}

/// Hybrid settings with the rows over one-sided windows.
fn hybrid_over_windows() -> HybridConfig {
    HybridConfig {
        transport: crate::train::ps::PsTransport::Rma,
        ..HybridConfig::default()
    }
}

/// Over windows each ps applies a step once every worker pushed it, the sum of their
/// shares: the update of local training on the global batch, so hybrid and ps training
/// over windows end where local training does (to rounding), on 1 ps and on 2, with every
/// sparse optimizer.
#[test]
fn rows_over_windows_train_as_local_training_does() {
    let data = SyntheticCtr::parse("samples=64000,features=4,rows=500,seed=7").unwrap();
    let (train, test) = Part::split(&data, 4000);
    let m = model(&data);
    let cfg = cfg(150);
    for sparse in [
        SparseOptimizer::adagrad(0.2),
        SparseOptimizer::Sgd { lr: 0.5 },
        SparseOptimizer::lazy_adam(0.01),
    ] {
        let run = CtrRun::new(&m, (&train, &test), &cfg, sparse);
        let local = run.local(&mut |_| {}).unwrap().evaluation.unwrap();
        for (mode, np, ps) in [
            ("hybrid", 3, 1),
            ("hybrid", 4, 2),
            ("ps", 3, 1),
            ("ps", 4, 2),
        ] {
            let l = layout(np, ps);
            let out = LocalComm::run(np, |comm| over_windows(&run, mode, &comm, &l, &mut |_| {}));
            let evals: Vec<CtrEvaluation> = (out.into_iter().flatten())
                .filter_map(|r| r.evaluation)
                .collect();
            // Hybrid's workers evaluate their shares (summed); the ps mode's chief alone.
            let evaluating = if mode == "hybrid" { 2 } else { 1 };
            assert_eq!(evals.len(), evaluating, "{mode} {sparse:?}");
            for e in evals {
                assert_eq!((e.step, e.total), (local.step, local.total));
                let (auc, want) = (e.auc.unwrap(), local.auc.unwrap());
                assert!(
                    (auc - want).abs() < 1e-3 && (e.logloss - local.logloss).abs() < 1e-3,
                    "{mode} {sparse:?} on {ps} ps: AUC {auc} log loss {}, local {want} {}",
                    e.logloss,
                    local.logloss
                );
            }
        }
    }
}

/// `run` in `mode` (hybrid, or ps) with the rows over windows, on this rank of `comm`.
fn over_windows(
    run: &CtrRun<'_>,
    mode: &str,
    comm: &LocalComm,
    l: &crate::cluster::Layout,
    events: &mut dyn FnMut(&crate::train::events::Event),
) -> Option<CtrReport> {
    let asynchronous = HybridConfig {
        asynchronous: true,
        ..hybrid_over_windows()
    };
    let ps_async = PsConfig {
        sync: false,
        ..PsConfig::default()
    };
    let ran = match mode {
        "hybrid" => run.hybrid(comm, l, &hybrid_over_windows(), events),
        "hybrid-async" => run.hybrid(comm, l, &asynchronous, events),
        "ps-async" => run.ps_over_windows(comm, l, (&ps_async, 1 << 21), events),
        _ => run.ps_over_windows(comm, l, (&PsConfig::default(), 1 << 21), events),
    };
    ran.unwrap()
}

/// Asynchronous rows over windows: each worker's push is added into the rows as it
/// arrives. With one worker that is local training's SGD (to rounding), on 1 ps and on
/// 2; with two, whose reads may miss the other's last push, within 0.01 of local
/// training's AUC; every ps's report counts the rows the workers made and pushed. In
/// hybrid training (the dense layers by allreduce) and in ps training (the dense
/// variables asynchronous on the ps tasks too, plain SGD).
#[test]
fn asynchronous_rows_over_windows_train_as_local_training_does() {
    let data = SyntheticCtr::parse("samples=64000,features=4,rows=500,seed=7").unwrap();
    let (train, test) = Part::split(&data, 4000);
    let m = model(&data);
    let sgd = TrainConfig {
        optimizer: Optimizer::new(OptimizerKind::Sgd, 0.1),
        ..cfg(150)
    };
    for (mode, cfg) in [("hybrid-async", cfg(150)), ("ps-async", sgd)] {
        let run = CtrRun::new(&m, (&train, &test), &cfg, SparseOptimizer::Sgd { lr: 0.5 });
        let local = run.local(&mut |_| {}).unwrap().evaluation.unwrap();
        for (np, ps, within) in [(2, 1, 1e-3), (3, 2, 1e-3), (3, 1, 0.01), (4, 2, 0.01)] {
            trains_as_local_training_does(&run, mode, layout(np, ps), (&local, within));
        }
    }
}

/// `run` in `mode` on `l` ends within `within` of `local`'s AUC (ten times that of its log
/// loss), and the chief's report of the rows counts what the workers made and pushed.
fn trains_as_local_training_does(
    run: &CtrRun<'_>,
    mode: &str,
    l: crate::cluster::Layout,
    (local, within): (&CtrEvaluation, f64),
) {
    let (np, ps) = (l.ranks.len(), l.spec.num_tasks("ps").unwrap());
    let out = LocalComm::run(np, |comm| {
        let mut reports = Vec::new();
        let mut seen = |e: &crate::train::events::Event| {
            if let crate::train::events::Event::Rows { reports: r, .. } = e {
                reports.extend(r.iter().cloned());
            }
        };
        (over_windows(run, mode, &comm, &l, &mut seen), reports)
    });
    let reports: Vec<_> = out.iter().flat_map(|(_, r)| r.clone()).collect();
    let evals: Vec<CtrEvaluation> = (out.into_iter().filter_map(|(r, _)| r))
        .filter_map(|r| r.evaluation)
        .collect();
    // Hybrid's workers evaluate their shares (summed); the ps mode's chief alone.
    let evaluating = if mode.starts_with("hybrid") {
        np - ps
    } else {
        1
    };
    assert_eq!(evals.len(), evaluating, "{mode}: {np} ranks, {ps} ps");
    let (want, want_loss) = (local.auc.unwrap(), local.logloss);
    for e in evals {
        let auc = e.auc.unwrap();
        assert_eq!((e.step, e.total), (local.step, local.total));
        assert!(
            (auc - want).abs() < within && (e.logloss - want_loss).abs() < 10.0 * within,
            "{mode}: {np} ranks, {ps} ps: AUC {auc} log loss {}, local {want} {want_loss}",
            e.logloss
        );
    }
    // Each ps's rows: those of its share that the steps touched, each pushed.
    assert_eq!(reports.len(), ps, "{reports:?}");
    for r in &reports {
        for t in &r.tables {
            assert!(t.rows > 0 && t.rows <= 500, "{mode}: {r:?}");
            assert!(t.pushes >= 150 && t.rows_pushed >= t.rows, "{mode}: {r:?}");
        }
    }
}

/// Hybrid and ps training over windows stopped at a checkpoint and resumed from it end
/// where one uninterrupted run ends: the ps tasks wrote their rows with their optimizer
/// state (in ps mode beside their dense shards) and put them back into their windows.
/// Asynchronous (one worker, so that one run is one order of pushes), the rows (and in
/// ps mode the dense shards) the ps tasks read from their windows.
#[test]
fn rows_over_windows_resumed_from_a_checkpoint_equal_one_run() {
    for mode in ["hybrid", "ps", "hybrid-async", "ps-async"] {
        resumed_over_windows_equals_one_run(mode);
    }
}

fn resumed_over_windows_equals_one_run(mode: &str) {
    let data = SyntheticCtr::parse("samples=64000,features=4,rows=500,seed=7").unwrap();
    let (train, test) = Part::split(&data, 4000);
    let m = model(&data);
    let dir = std::env::temp_dir().join(format!("mpiflow-ctr-rma-{mode}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (l, sparse) = match mode {
        "hybrid-async" | "ps-async" => (layout(3, 2), SparseOptimizer::Sgd { lr: 0.5 }),
        _ => (layout(4, 2), SparseOptimizer::adagrad(0.2)),
    };
    let np = l.ranks.len();
    let run = |steps: u64, dir: Option<&std::path::Path>| {
        let mut cfg = TrainConfig {
            checkpoint_dir: dir.map(|d| d.to_path_buf()),
            ..cfg(steps)
        };
        if mode == "ps-async" {
            // The dense variables asynchronous on the ps tasks too: plain SGD.
            cfg.optimizer = Optimizer::new(OptimizerKind::Sgd, 0.1);
        }
        let run = CtrRun::new(&m, (&train, &test), &cfg, sparse);
        let out = LocalComm::run(np, |comm| {
            let mut restored = Vec::new();
            let mut seen = |e: &crate::train::events::Event| {
                if let crate::train::events::Event::Restored { step, .. } = e {
                    restored.push(*step);
                }
            };
            let report = over_windows(&run, mode, &comm, &l, &mut seen);
            (report, restored)
        });
        let restored: Vec<u64> = out.iter().flat_map(|(_, r)| r.clone()).collect();
        let eval = (out.into_iter().filter_map(|(r, _)| r))
            .find_map(|r| r.evaluation)
            .unwrap();
        (eval, restored)
    };
    let (straight, _) = run(200, None);
    assert_eq!(run(100, Some(&dir)).0.step, 100);
    let (resumed, restored) = run(200, Some(&dir));
    assert!(restored.contains(&100), "{mode}: {restored:?}");
    assert_eq!(
        (resumed.step, resumed.auc, resumed.logloss),
        (200, straight.auc, straight.logloss),
        "{mode}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Windows larger than a ps task's memory share stop every rank before training, the ps
/// naming the table.
#[test]
fn rows_windows_beyond_a_ps_tasks_share_stop_every_rank_at_the_start() {
    let data = SyntheticCtr::parse("samples=20000,features=4,rows=2000,seed=7").unwrap();
    let (train, test) = Part::split(&data, 1000);
    let m = model(&data);
    let cfg = cfg(50);
    let share = crate::train::resources::Share {
        bytes: 100_000,
        why: "the test's limit".into(),
    };
    let run =
        CtrRun::new(&m, (&train, &test), &cfg, SparseOptimizer::adagrad(0.2)).within(Some(share));
    let l = layout(3, 1);
    let out = LocalComm::run(3, |comm| {
        run.hybrid(&comm, &l, &hybrid_over_windows(), &mut |_| {})
            .map(drop)
            .map_err(|e| e.to_string())
    });
    let ps = out[0].as_ref().expect_err("the ps refused its windows");
    assert!(
        ps.contains("table emb") && ps.contains("100.0 KB (the test's limit)"),
        "{ps}"
    );
    for r in &out[1..] {
        let e = r.as_ref().expect_err("a worker trained on");
        assert!(e.contains("could not set up one-sided training"), "{e}");
    }
}

/// `inner`'s samples, sample `bad`'s first id beyond its table.
struct OneBadId<'a> {
    inner: &'a dyn CtrData,
    bad: usize,
}

impl CtrData for OneBadId<'_> {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn dense(&self) -> usize {
        self.inner.dense()
    }
    fn tables(&self) -> &[u64] {
        self.inner.tables()
    }
    fn push(&self, i: usize, batch: &mut CtrBatch) {
        self.inner.push(i, batch);
        if i == self.bad {
            let at = batch.ids.len() - batch.features;
            batch.ids[at] = self.inner.tables()[0];
        }
    }
}

/// A sample naming a row beyond its table, in one worker's share of step 3: over windows
/// the other worker's rows step must not wait for it; every rank stops within the step,
/// the worker that found it naming the row, in hybrid and in ps mode.
#[test]
fn a_bad_id_on_one_worker_stops_every_rank_over_windows() {
    let data = SyntheticCtr::parse("samples=24000,features=4,rows=500,seed=7").unwrap();
    let (train, test) = Part::split(&data, 4000);
    let m = model(&data);
    let cfg = cfg(50);
    let mut batches = crate::train::data::Batches::new(train.len(), cfg.batch, cfg.seed);
    let bad = crate::train::data::shard(batches.global(3), 1, 2)[0];
    let bad = OneBadId { inner: &train, bad };
    let run = CtrRun::new(&m, (&bad, &test), &cfg, SparseOptimizer::adagrad(0.2));
    for (mode, np, ps) in [("hybrid", 4, 2), ("ps", 3, 1)] {
        let l = layout(np, ps);
        let t = std::time::Instant::now();
        let out = LocalComm::run(np, |comm| {
            let ran = match mode {
                "hybrid" => run.hybrid(&comm, &l, &hybrid_over_windows(), &mut |_| {}),
                _ => run.ps_over_windows(&comm, &l, (&PsConfig::default(), 1 << 21), &mut |_| {}),
            };
            ran.map(drop).map_err(|e| e.to_string())
        });
        assert!(
            t.elapsed() < std::time::Duration::from_secs(20),
            "{mode}: {:?}",
            t.elapsed()
        );
        // The worker that found it names the row; the other says so too (hybrid: the
        // step's agreement carries the line) or names that worker (ps: its ps does).
        let errors: Vec<String> = (out[ps..].iter())
            .map(|r| r.clone().expect_err("a worker trained on"))
            .collect();
        assert!(errors[1].contains("id 500 is no row"), "{mode}: {errors:?}");
        assert!(
            errors[0].contains("id 500 is no row") || errors[0].contains("worker:1 (rank"),
            "{mode}: {errors:?}"
        );
    }
}

/// Hybrid training whose ps task takes two and a half peer timeouts to write or read its
/// rows' file (a test-only slow disk): the other worker, waiting on the chief in the
/// allreduce meanwhile, is not taken for lost, and a rerun resumes from the checkpoint.
#[test]
fn a_hybrid_checkpoint_slower_than_the_peer_timeout_loses_no_worker() {
    let data = SyntheticCtr::parse("samples=20000,features=4,rows=500,seed=4").unwrap();
    let (train, test) = Part::split(&data, 2000);
    let m = model(&data);
    let dir = std::env::temp_dir().join(format!("mpiflow-ctr-slow-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let hybrid = HybridConfig {
        peer_timeout: std::time::Duration::from_secs(1),
        ..HybridConfig::default()
    };
    let l = layout(3, 1);
    // Every rank's outcome (the workers' final steps) and the chief's restored step.
    let job = |steps: u64| {
        let cfg = TrainConfig {
            checkpoint_dir: Some(dir.clone()),
            checkpoint_every: 3,
            ..cfg(steps)
        };
        let run = CtrRun::new(&m, (&train, &test), &cfg, SparseOptimizer::adagrad(0.2));
        LocalComm::run(3, |comm| {
            if crate::transport::comm::Comm::rank(&comm) == 0 {
                crate::train::checkpoint::SLOW_DISK.set(hybrid.peer_timeout * 5 / 2);
            }
            let mut restored = None;
            let events = &mut |e: &crate::train::Event| {
                if let crate::train::Event::Restored { step, .. } = e {
                    restored = Some(*step);
                }
            };
            let out = run.hybrid(&comm, &l, &hybrid, events);
            let out = out.map(|r| r.map(|r| r.steps)).map_err(|e| e.to_string());
            (out, restored)
        })
    };
    let first = job(4);
    assert!(first.iter().all(|r| r.0.is_ok()), "{first:?}");
    let resumed = job(5);
    assert!(resumed.iter().all(|r| r.0.is_ok()), "{resumed:?}");
    assert_eq!(resumed[1].1, Some(4), "{resumed:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
