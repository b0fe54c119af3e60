//! UCX under real `mpirun` on one node (`--rdma-stack ucx`: `pml ucx` + `osc ucx` over UCX's
//! shared memory, as no RDMA device exists here): `mpiflow check` with the RMA layer, the
//! one-sided ps sync (equal to local training) and async (accuracy), a killed rank ending
//! the job, and the choice's errors. Across hosts (UCX's TCP transport):
//! `tests/multihost.rs`.

mod common;

use common::{accuracy, mpiflow, mpirun, run_bounded};
use serde_json::json;

const SAID: &str = "# mpi: --rdma-stack ucx: pml ucx, osc ucx, UCX on any transport";

/// `-np NP mpiflow --rdma-stack ucx train --mode ps --transport rma EXTRA...`.
fn ucx_args<'a>(np: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["-np", np, mpiflow(), "--rdma-stack", "ucx", "train"];
    args.extend_from_slice(&["--mode", "ps", "--transport", "rma"]);
    args.extend_from_slice(extra);
    args
}

#[test]
fn check_passes_on_ucx_and_says_so_once() {
    let run = mpirun(&[
        "-np",
        "4",
        mpiflow(),
        "check",
        "--ps",
        "1",
        "--rdma-stack",
        "ucx",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(run.stdout.matches(SAID).count(), 1, "{}", run.stdout);
    let lines = run.json_lines();
    assert_eq!(lines.len(), 4, "{run:?}");
    for l in &lines {
        assert_eq!(l["failures"], json!([]), "{l}");
        assert_eq!(l["digest"], lines[0]["digest"]);
        // The RMA layer's checks ran too (435 of them with `osc ucx`, which makes no
        // shared windows: the shared-memory allreduce is left out).
        assert!(l["checks"].as_u64().unwrap() > 400, "{l}");
    }
}

#[test]
fn one_sided_ps_on_ucx_equals_local_training_sync_and_learns_async() {
    let run = common::one_sided_sync_equals_local("ucx-equal", &["--rdma-stack", "ucx"]);
    assert!(
        run.stdout.contains("# one-sided: osc ucx"),
        "{}",
        run.stdout
    );
    // Async SGD, racy by design (the same bar as osc sm's async runs at 3000 steps).
    let sgd = ["--ps", "1", "--async", "--optimizer", "sgd", "--lr", "0.1"];
    let run = mpirun(&ucx_args("4", &[&sgd[..], &["--steps", "3000"]].concat()));
    assert_eq!(run.code, 0, "{run:?}");
    let acc = accuracy(&run.stdout);
    assert!(acc >= 0.95, "async on UCX: {acc}\n{}", run.stdout);
    // No message left unreceived at MPI_Finalize (UCX warns of those).
    assert!(!run.stderr.contains("UCX  WARN"), "{}", run.stderr);
}

#[test]
fn a_killed_rank_ends_a_ucx_job() {
    // A rank blocked in an operation that UCX emulates on a dead target cannot time out
    // by itself; mpirun's default (no orte_enable_recovery) ends the job.
    let args = ucx_args("4", &["--ps", "1", "--steps", "100000000"]);
    for victim in [0, 3] {
        let (err, secs, _) = common::kill_rank_after_start(&args, victim);
        assert!(secs < 30.0, "rank {victim} killed: took {secs} s\n{err}");
    }
}

#[test]
fn a_stack_that_cannot_be_had_is_one_line() {
    let _guard = common::lock();
    let run = run_bounded(
        60,
        &[
            "mpirun",
            "--oversubscribe",
            "-x",
            "OMPI_MCA_pml=ob1",
            "-np",
            "2",
            mpiflow(),
            "check",
            "--rdma-stack",
            "ucx",
        ],
        &[],
    );
    // Decided before MPI starts, so each rank says it: one line each.
    let each = |run: &common::Run, want: &str| {
        assert_ne!(run.code, 0, "{run:?}");
        let errs = run.error_lines();
        assert_eq!(errs.len(), 2, "{run:?}");
        for (r, e) in errs.iter().enumerate() {
            assert!(e.contains(want), "{e:?} lacks {want:?}");
            assert!(
                errs.iter().any(|e| e.contains(&format!("rank {r}: "))),
                "{errs:?}"
            );
        }
    };
    each(
        &run,
        "--rdma-stack ucx: OMPI_MCA_pml=ob1 says otherwise (unset it, or drop the flag)",
    );
    let run = run_bounded(
        60,
        &["mpirun", "--oversubscribe", "-np", "2", mpiflow(), "check"],
        &[("MPIFLOW_RDMA_STACK", "fast")],
    );
    each(&run, "MPIFLOW_RDMA_STACK=fast: not one of auto, ucx, ompi");
}

#[test]
fn tensors_of_every_size_arrive_whole_on_ucx() {
    // Under pml ucx a blocking send from 4 KiB is an MPI_Isend and its wait, not an
    // MPI_Send (src/transport/mpi/library.rs): latency's round trips move 1 B to 1 MiB
    // through both, on every path, each size's data checked (-c).
    let mut args = vec![
        "-np",
        "2",
        mpiflow(),
        "--rdma-stack",
        "ucx",
        "bench",
        "latency",
    ];
    args.extend("-m 1:1048576 -i 20 -x 2 --rounds 1 -c".split(' '));
    let run = mpirun(&args);
    assert_eq!(run.code, 0, "{run:?}");
    let rows: Vec<&str> = run
        .stdout
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.parse::<u64>().is_ok())
        })
        .collect();
    assert_eq!(rows.len(), 4 * 21, "4 paths x 21 sizes: {}", run.stdout);
    assert!(rows.iter().all(|r| r.ends_with(" Pass")), "{}", run.stdout);
}
