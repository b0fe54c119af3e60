//! A recommendation model (DLRM) under real `mpirun`: its embedding tables' rows on the
//! ps tasks, its dense layers by allreduce among the workers (`--mode hybrid`) or on the
//! ps tasks too (`--mode ps`), trained to the held-out AUC of local training; a ps killed
//! mid-run costs only the steps since the last checkpoint, whose rows come back. Hybrid's
//! rows go over messages and over one-sided windows (`--transport rma`).

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::{mpiflow, mpiflow_alone, mpirun, signal, tmpdir, with_rank_when};
use mpiflow::observe::metrics::{read, Record};

/// The model and data of every run here: 8 features of 2000 rows, 400000 samples.
const RUN: &[&str] = &[
    "train",
    "--model",
    "dlrm",
    "--data",
    "synthetic-ctr:samples=400000,features=8,rows=2000,seed=4",
    "--batch",
    "256",
    "--lr",
    "0.003",
    "--sparse-lr",
    "0.2",
    "--embedding-dim",
    "8",
    "--bottom",
    "32",
    "--top",
    "32",
    "--log-every",
    "200",
    "--progress",
    "lines",
];

/// The last held-out AUC in metrics file `path`.
fn last_auc(path: &Path) -> f64 {
    let records = read(path).unwrap();
    records
        .iter()
        .rev()
        .find_map(|r| match r {
            Record::Ctr { auc, total, .. } => {
                assert_eq!(*total, 20_000, "held-out samples");
                Some(*auc)
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no AUC in {}: {records:?}", path.display()))
}

/// RUN with plain SGD's learning rate for the dense layers: SGD takes a larger step than
/// RUN's Adam.
fn sgd_run() -> Vec<&'static str> {
    (RUN.iter().zip([""].iter().chain(RUN)))
        .map(|(a, before)| if *before == "--lr" { "0.1" } else { *a })
        .collect()
}

/// `mpirun -np N mpiflow RUN --steps STEPS` with `extra` flags.
fn distributed(np: &str, steps: &str, extra: &[&str]) -> common::Run {
    distributed_from(RUN, np, steps, extra)
}

/// [`distributed`] of `run` instead of [`RUN`].
fn distributed_from(run: &[&str], np: &str, steps: &str, extra: &[&str]) -> common::Run {
    let mut args = vec!["-np", np, mpiflow()];
    args.extend_from_slice(run);
    args.extend_from_slice(&["--steps", steps]);
    args.extend_from_slice(extra);
    mpirun(&args)
}

#[test]
fn dlrm_reaches_the_auc_of_local_training_in_hybrid_and_ps_mode() {
    let dir = tmpdir("ctr-modes");
    let metrics = |name: &str| dir.join(format!("{name}.csv"));
    let m = |name: &str| metrics(name).to_str().unwrap().to_string();
    let local = m("local");
    let mut args = RUN.to_vec();
    args.extend_from_slice(&["--steps", "1200", "--metrics", &local]);
    let run = mpiflow_alone(&args, &[]);
    assert_eq!(run.code, 0, "{run:?}");
    let last = run.stdout.lines().last().unwrap_or_default();
    assert!(last.starts_with("auc 0."), "{}", run.stdout);
    let local = last_auc(&metrics("local"));
    assert!(local > 0.8, "local AUC {local}");
    for (mode, np, ps, transport) in [
        ("hybrid", "4", "2", "p2p"),
        ("hybrid", "4", "2", "rma"),
        ("ps", "3", "1", "p2p"),
        ("ps", "3", "1", "rma"),
    ] {
        let name = format!("{mode}-{transport}");
        let out = m(&name);
        let flags = ["--mode", mode, "--ps", ps, "--transport", transport];
        // Hybrid's rows asked for ahead of each step's gradients (on this machine's
        // shared CPUs they are not by default: ps mode's are not).
        let ahead: &[&str] = match (mode, transport) {
            ("hybrid", "p2p") => &["--rows-ahead", "on"],
            _ => &[],
        };
        let run = distributed(
            np,
            "1200",
            &[&flags[..], ahead, &["--metrics", &out]].concat(),
        );
        assert_eq!(run.code, 0, "{run:?}");
        let auc = last_auc(&metrics(&name));
        assert!(
            (auc - local).abs() < 0.01,
            "{name}: AUC {auc}, local {local}"
        );
        if transport == "rma" {
            // Each step's rows applied once, summed over the workers: local training's
            // update, so its AUC to rounding.
            assert!(
                (auc - local).abs() < 1e-3,
                "{name}: AUC {auc}, local {local}"
            );
            assert!(
                run.stdout.contains("pulls unseen (one-sided gets)"),
                "{}",
                run.stdout
            );
        }
    }
}

/// Asynchronous rows over windows (each push added into the rows by `MPI_Accumulate` as
/// it arrives, plain SGD) reach the AUC of local training with the same optimizers, in
/// hybrid training (2 ps + 2 workers) and in ps training (1 ps + 2 workers, the dense
/// variables asynchronous by plain SGD too); another sparse optimizer is refused at the
/// start in one line.
#[test]
fn asynchronous_rows_over_windows_reach_the_auc_of_local_training() {
    let dir = tmpdir("ctr-async-rma");
    let metrics = |name: &str| dir.join(format!("{name}.csv"));
    let m = |name: &str| metrics(name).to_str().unwrap().to_string();
    let hybrid = [
        "--mode",
        "hybrid",
        "--ps",
        "2",
        "--transport",
        "rma",
        "--async",
    ];
    let ps = ["--mode", "ps", "--ps", "1", "--transport", "rma", "--async"];
    let sgd = ["--sparse-optimizer", "sgd"];
    let dense_sgd = ["--sparse-optimizer", "sgd", "--optimizer", "sgd"];
    let sgd_run = sgd_run();
    for (name, np, flags, optimizers, base) in [
        ("hybrid", "4", &hybrid[..], &sgd[..], RUN),
        ("ps", "3", &ps[..], &dense_sgd[..], &sgd_run[..]),
    ] {
        let local = m(&format!("{name}-local"));
        let mut args = base.to_vec();
        args.extend_from_slice(&["--steps", "1200", "--metrics", &local]);
        args.extend_from_slice(optimizers);
        let run = mpiflow_alone(&args, &[]);
        assert_eq!(run.code, 0, "{run:?}");
        let local = last_auc(&metrics(&format!("{name}-local")));
        assert!(local > 0.75, "{name}: local AUC {local}");
        let out = m(name);
        let extra = [flags, optimizers, &["--metrics", &out]].concat();
        let run = distributed_from(base, np, "1200", &extra);
        assert_eq!(run.code, 0, "{run:?}");
        let auc = last_auc(&metrics(name));
        assert!(
            (auc - local).abs() < 0.01,
            "{name}: AUC {auc}, local {local}"
        );
    }

    let run = distributed("4", "10", &hybrid);
    assert_ne!(run.code, 0, "{run:?}");
    let line = "mpiflow: error: --transport rma --async adds each push into the rows with MPI_Accumulate, plain SGD: use --sparse-optimizer sgd, or --sync (not adagrad)";
    assert!(run.stderr.lines().any(|l| l == line), "{}", run.stderr);
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
}

/// Every row id of every table in checkpoint `path`.
fn row_ids(path: &Path) -> BTreeSet<(String, u64)> {
    let (_, files) = mpiflow::train::checkpoint::open(path).unwrap();
    let mut ids = BTreeSet::new();
    for f in &files {
        for (name, values) in &f.arrays {
            let Some(table) = name
                .strip_prefix("table:")
                .and_then(|n| n.strip_suffix(":ids"))
            else {
                continue;
            };
            for pair in values.chunks_exact(2) {
                let id = u64::from(pair[0].to_bits()) | (u64::from(pair[1].to_bits()) << 32);
                ids.insert((table.to_string(), id));
            }
        }
    }
    ids
}

#[test]
fn a_ps_killed_mid_run_costs_only_the_steps_since_the_checkpoint_and_its_rows_come_back() {
    for (mode, transport) in [
        ("hybrid", "p2p"),
        ("hybrid", "rma"),
        ("hybrid", "rma --async"),
        ("ps", "rma --async"),
    ] {
        killed_ps_resumes(mode, transport);
    }
}

/// Training in `mode` (hybrid, or ps) with its rows over `transport` (asynchronous rows
/// over windows: `rma --async`, with sparse SGD; in ps mode the dense variables too),
/// ps:0 SIGKILLed once a checkpoint is written, then run again.
fn killed_ps_resumes(mode: &str, transport: &str) {
    let name = format!("ctr-kill-{mode}-{}", transport.replace(" --", "-"));
    let dir = tmpdir(&name);
    let ckpt = dir.join("ckpt");
    let (c, metrics) = (ckpt.to_str().unwrap(), dir.join("resumed.csv"));
    let base = match mode {
        "ps" => sgd_run(),
        _ => RUN.to_vec(),
    };
    let mut args = vec!["-np", "4", mpiflow()];
    args.extend_from_slice(&base);
    let mut flags = vec!["--mode", mode, "--ps", "2", "--transport"];
    flags.extend(transport.split(' '));
    if transport.ends_with("--async") {
        flags.extend(["--sparse-optimizer", "sgd"]);
    }
    if mode == "ps" {
        flags.extend(["--optimizer", "sgd"]);
    }
    args.extend_from_slice(&flags);
    args.extend_from_slice(&["--steps", "3000"]);
    args.extend_from_slice(&["--checkpoint-dir", c, "--checkpoint-every", "200"]);
    // ps:0 is rank 0; killed once a checkpoint is written (said, or on disk).
    let written = |out: &str| {
        out.contains("# checkpoint") || !mpiflow::train::checkpoint::listed(&ckpt).is_empty()
    };
    let (text, code) = with_rank_when(&args, Some(0), written, |pid, _| signal(pid, "-KILL"));
    assert_ne!(code, Some(0), "{text}");
    let listed = mpiflow::train::checkpoint::listed(&ckpt);
    let (saved, path) = listed.first().cloned().expect("a checkpoint");
    assert!(saved > 0 && saved < 3000, "{listed:?}");
    let before = row_ids(&path);
    assert!(before.len() > 1000, "{} rows", before.len());

    let m = metrics.to_str().unwrap();
    let mut extra = flags.to_vec();
    extra.extend_from_slice(&["--checkpoint-dir", c, "--metrics", m]);
    let run = distributed_from(&base, "4", "3000", &extra);
    assert_eq!(run.code, 0, "{run:?}");
    let restored = format!("ckpt-{saved} (global step {saved})");
    assert!(run.stdout.contains(&restored), "{}", run.stdout);
    // Only the steps since the checkpoint were trained again.
    let steps: Vec<u64> = (read(&metrics).unwrap().iter())
        .filter_map(|r| match r {
            Record::Step { step, .. } => Some(*step),
            _ => None,
        })
        .collect();
    assert!(steps.first().is_some_and(|s| *s > saved), "{steps:?}");
    let after = row_ids(&ckpt.join("ckpt-3000"));
    assert!(
        before.is_subset(&after),
        "{mode} {transport}: rows lost in the restore"
    );
    assert!(last_auc(&metrics) > 0.8);
}

/// Tables of 10^8 rows of 16 values (6.4 GB each if dense; 51 GB for the 8) train on 4 ps
/// tasks of this machine: only the touched rows exist, spread evenly, each ps task within
/// its share (checked as rows are made), and the checkpoint holds just those rows.
#[test]
fn tables_of_a_hundred_million_rows_train_on_four_ps_tasks_holding_only_touched_rows() {
    let dir = tmpdir("ctr-big");
    let (metrics, ckpt) = (dir.join("big.csv"), dir.join("ckpt"));
    let run = mpirun(&[
        "-np",
        "6",
        mpiflow(),
        "train",
        "--mode",
        "hybrid",
        "--ps",
        "4",
        "--model",
        "dlrm",
        "--data",
        "synthetic-ctr:samples=400000,features=8,rows=100000000",
        "--embedding-dim",
        "16",
        "--batch",
        "512",
        "--steps",
        "600",
        "--metrics",
        metrics.to_str().unwrap(),
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let records = read(&metrics).unwrap();
    let mut per_ps = std::collections::BTreeMap::<String, (u64, u64)>::new();
    for r in &records {
        if let Record::Rows {
            task, rows, bytes, ..
        } = r
        {
            let e = per_ps.entry(task.clone()).or_default();
            *e = (e.0 + rows, e.1 + bytes);
        }
    }
    assert_eq!(per_ps.len(), 4, "{per_ps:?}");
    let rows: Vec<u64> = per_ps.values().map(|v| v.0).collect();
    let (least, most) = (rows.iter().min().unwrap(), rows.iter().max().unwrap());
    // At most 8 x 600 x 512 ids were named; rows spread within 5% over the ps tasks.
    assert!(*least > 100_000 && *most < 8 * 600 * 512, "{rows:?}");
    assert!((most - least) * 20 < *most, "unbalanced: {rows:?}");
    for (task, (_, bytes)) in &per_ps {
        assert!(*bytes < 200_000_000, "{task} holds {bytes} bytes");
    }
    let saved: u64 = std::fs::read_dir(ckpt.join("ckpt-600"))
        .unwrap()
        .map(|f| f.unwrap().metadata().unwrap().len())
        .sum();
    assert!(saved < 300_000_000, "the checkpoint takes {saved} bytes");
    let auc = last_auc(&metrics);
    assert!(auc > 0.7, "AUC {auc}");
}

/// Requests and replies larger than MPI sends eagerly (a batch of 1024 over 8 tables of
/// 10^5 rows: each ps's share of the ids and of the rows is tens of KB) between 2 ps tasks
/// and 2 workers: each ps takes requests while its replies are in flight, so a worker's
/// request never waits on a ps that waits on another worker (which deadlocked both modes).
#[test]
fn large_row_requests_between_two_ps_tasks_and_two_workers_never_deadlock() {
    for mode in ["hybrid", "ps"] {
        let run = mpirun(&[
            "-np",
            "4",
            mpiflow(),
            "train",
            "--mode",
            mode,
            "--ps",
            "2",
            "--model",
            "dlrm",
            "--data",
            "synthetic-ctr:samples=300000,features=8,rows=100000",
            "--batch",
            "1024",
            "--steps",
            "120",
            "--peer-timeout",
            "10",
        ]);
        assert_eq!(run.code, 0, "{mode}: {run:?}");
        assert!(
            run.stdout
                .lines()
                .last()
                .unwrap_or_default()
                .starts_with("auc "),
            "{}",
            run.stdout
        );
    }
}

/// A hybrid worker (rank 3) stopped (SIGSTOP) for 4 s: the chief names it in stall reports, with
/// the step and what the others wait in (the dense layers' allreduce, or the rows), until
/// it continues; SIGUSR1 then stops the job (exit 75).
#[test]
fn a_stopped_hybrid_worker_is_named_in_a_stall_report() {
    let dir = tmpdir("ctr-stall");
    let metrics = dir.join("stall.csv");
    let mut args = vec!["-np", "4", mpiflow()];
    args.extend_from_slice(RUN);
    args.extend_from_slice(&["--mode", "hybrid", "--ps", "1", "--steps", "100000000"]);
    args.extend_from_slice(&[
        "--stall-warning",
        "1",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    let start = std::time::Instant::now();
    let ready =
        |out: &str| start.elapsed() > std::time::Duration::from_secs(1) && out.contains("\nstep ");
    let (text, code) = with_rank_when(&args, Some(3), ready, |pid, mpirun| {
        signal(pid, "-STOP");
        std::thread::sleep(std::time::Duration::from_secs(4));
        signal(pid, "-CONT");
        std::thread::sleep(std::time::Duration::from_secs(2));
        signal(mpirun, "-USR1");
    });
    assert_eq!(code, Some(75), "{text}");
    // Ranks 1-3 are the workers after ps:0 (rank 0).
    let victim = "worker:2";
    let reports: Vec<&str> = (text.lines())
        .filter(|l| l.starts_with("# warning: stall at step ") && !l.contains("cleared"))
        .collect();
    assert!(reports.len() >= 2, "{text}");
    for r in &reports {
        assert!(
            r.ends_with(&format!("; not arrived: {victim} (no answer)")),
            "{r}"
        );
        let ops = ["allreduce", "rows push and pull", "rows pull", "allgather"];
        assert!(ops.iter().any(|op| r.contains(&format!(" in {op}"))), "{r}");
    }
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("# warning: stall at step ") && l.contains("cleared"))
            .count(),
        1,
        "{text}"
    );
    let records = read(&metrics).unwrap();
    // The reports name the worker; the last record says the stall cleared.
    let stalls: Vec<(&Vec<String>, bool)> = (records.iter())
        .filter_map(|r| match r {
            Record::Stall {
                missing, cleared, ..
            } => Some((missing, *cleared)),
            _ => None,
        })
        .collect();
    let (cleared, reported) = stalls.split_last().expect("stall records");
    assert!(cleared.1 && reported.len() >= 2, "{stalls:?}");
    assert!(
        reported.iter().all(|(m, c)| m.as_slice() == [victim] && !c),
        "{stalls:?}"
    );
}
