//! `mpiflow spec` and `mpiflow launch` under real `mpirun` with 1, 2, 4 and 6 ranks.

mod common;

use std::collections::BTreeSet;
use std::net::TcpListener;

use common::{hostname, mpiflow, mpirun};
use serde_json::{json, Value};

/// The cluster every rank reported, checked to be identical, plus each rank's line by rank.
fn per_rank(lines: &[Value], np: usize) -> (Value, Vec<Value>) {
    assert_eq!(lines.len(), np, "one line per rank: {lines:?}");
    let mut by_rank = vec![Value::Null; np];
    for l in lines {
        let r = l["rank"].as_u64().expect("rank") as usize;
        assert!(by_rank[r].is_null(), "rank {r} printed twice");
        by_rank[r] = l.clone();
    }
    let cluster = by_rank[0]["cluster"].clone();
    for l in &by_rank {
        assert_eq!(
            l["cluster"], cluster,
            "every rank builds the same ClusterSpec"
        );
        assert_eq!(l["size"], json!(np));
    }
    (cluster, by_rank)
}

fn tasks(by_rank: &[Value]) -> Vec<String> {
    by_rank
        .iter()
        .map(|l| {
            format!(
                "{}:{}",
                l["task"]["type"].as_str().unwrap(),
                l["task"]["index"]
            )
        })
        .collect()
}

#[test]
fn every_rank_builds_the_same_cluster_at_1_2_4_6_ranks() {
    let host = hostname();
    for (np, flags, want) in [
        ("1", vec![], vec!["worker:0"]),
        ("2", vec!["--ps", "1"], vec!["ps:0", "worker:0"]),
        (
            "4",
            vec!["--ps", "1", "--chief"],
            vec!["ps:0", "chief:0", "worker:0", "worker:1"],
        ),
        (
            "6",
            vec!["--ps", "2", "--chief", "--evaluator"],
            vec![
                "ps:0",
                "ps:1",
                "chief:0",
                "worker:0",
                "worker:1",
                "evaluator:0",
            ],
        ),
    ] {
        let mut args = vec!["-np", np, mpiflow(), "spec", "--format", "json"];
        args.extend(flags.iter().copied());
        let run = mpirun(&args);
        assert_eq!(run.code, 0, "{run:?}");
        let n: usize = np.parse().unwrap();
        let (cluster, by_rank) = per_rank(&run.json_lines(), n);
        assert_eq!(tasks(&by_rank), want, "np {np}");
        // Addresses: on this host, unique, and the one the cluster lists for the task.
        let mut seen = BTreeSet::new();
        for l in &by_rank {
            let addr = l["address"].as_str().unwrap();
            assert!(seen.insert(addr.to_string()), "duplicate {addr}");
            assert_eq!(l["host"], json!(host));
            assert!(addr.starts_with(&format!("{host}:")), "{addr}");
            let job = &cluster[l["task"]["type"].as_str().unwrap()];
            assert_eq!(
                job[l["task"]["index"].as_u64().unwrap() as usize],
                json!(addr)
            );
            assert_eq!(
                l["local_rank"], l["rank"],
                "one host: local rank is the rank"
            );
        }
    }
}

#[test]
fn each_rank_prints_its_own_tf_config() {
    let run = mpirun(&[
        "-np",
        "4",
        mpiflow(),
        "spec",
        "--ps",
        "1",
        "--rpc-layer",
        "grpc",
        "--format",
        "tf-config",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let lines = run.json_lines();
    assert_eq!(lines.len(), 4);
    let mut got: Vec<(String, u64)> = lines
        .iter()
        .map(|c| {
            assert_eq!(c["cluster"], lines[0]["cluster"]);
            assert_eq!(c["rpc_layer"], json!("grpc"));
            (
                c["task"]["type"].as_str().unwrap().to_string(),
                c["task"]["index"].as_u64().unwrap(),
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            ("ps".into(), 0),
            ("worker".into(), 0),
            ("worker".into(), 1),
            ("worker".into(), 2)
        ]
    );
    assert_eq!(lines[0]["cluster"]["worker"].as_array().unwrap().len(), 3);
}

#[test]
fn table_is_printed_once_by_rank_0() {
    let run = mpirun(&["-np", "6", mpiflow(), "spec", "--ps", "2", "--chief"]);
    assert_eq!(run.code, 0, "{run:?}");
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(
        lines.len(),
        8,
        "header, column names, six rows: {}",
        run.stdout
    );
    assert!(
        lines[0].starts_with("# mpiflow cluster (mpi): 6 tasks on 1 host: chief=1 ps=2 worker=3")
    );
    let rows: Vec<Vec<&str>> = lines[2..]
        .iter()
        .map(|l| l.split_whitespace().collect())
        .collect();
    let jobs: Vec<String> = rows
        .iter()
        .map(|r| format!("{}:{}:{}", r[0], r[3], r[4]))
        .collect();
    assert_eq!(
        jobs,
        [
            "0:ps:0",
            "1:ps:1",
            "2:chief:0",
            "3:worker:0",
            "4:worker:1",
            "5:worker:2"
        ]
    );
}

#[test]
fn busy_ports_are_skipped_and_ports_stay_unique() {
    // Hold the first port rank 0 would try.
    let held = TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let port = held.local_addr().unwrap().port();
    let base = port.to_string();
    let run = mpirun(&[
        "-np",
        "3",
        mpiflow(),
        "spec",
        "--port-base",
        &base,
        "--format",
        "json",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let (_, by_rank) = per_rank(&run.json_lines(), 3);
    let ports: BTreeSet<u16> = by_rank
        .iter()
        .map(|l| {
            l["address"]
                .as_str()
                .unwrap()
                .rsplit(':')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(ports.len(), 3);
    assert!(
        !ports.contains(&port),
        "held port {port} was handed out: {ports:?}"
    );
    assert!(ports.iter().all(|p| *p > port), "{ports:?}");
}

/// A misspelt flag on the one command line every rank runs is one line, said by rank 0
/// for all; with several command lines (`A : B`), the rank whose line it is says it.
#[test]
fn a_bad_flag_is_one_line_for_all_ranks_or_the_rank_whose_it_is() {
    let m = mpiflow();
    let run = mpirun(&["-np", "4", m, "train", "--stpes", "5"]);
    run.assert_one_line_error(
        "mpiflow: all ranks: unexpected argument '--stpes' found (a similar argument exists: '--steps')",
    );
    let run = mpirun(&["-np", "1", m, "spec", ":", "-np", "1", m, "spec", "--bogus"]);
    run.assert_one_line_error("mpiflow: rank 1: unexpected argument '--bogus' found");
}

#[test]
fn ranks_started_with_different_flags_stop_the_job() {
    let m = mpiflow();
    let run = mpirun(&[
        "-np", "2", m, "spec", "--ps", "1", ":", "-np", "1", m, "spec", "--ps", "0",
    ]);
    run.assert_one_line_error(
        "rank 2 was started with --ps=0 but rank 0 with --ps=1: all ranks must get the same flags",
    );
    let run = mpirun(&[
        "-np",
        "1",
        m,
        "spec",
        ":",
        "-np",
        "1",
        m,
        "spec",
        "--placement",
        "spread",
    ]);
    run.assert_one_line_error(
        "rank 1 was started with --placement=spread but rank 0 with --placement=block",
    );
    let cmd = format!("-np 2 {m} spec --stages 2 : -np 2 {m} spec --stages 4");
    let run = mpirun(&cmd.split(' ').collect::<Vec<_>>());
    run.assert_one_line_error(
        "rank 2 was started with --stages=4 but rank 0 with --stages=2: all ranks must get the same flags",
    );
    // Training's own flags too, before any mode joins a collective of its own; flags of
    // one rank's own (--verbose) may differ.
    let cmd = format!(
        "-np 2 {m} train --mode allreduce --ps 1 --steps 20 : -np 1 {m} train --mode ps --ps 1 --steps 20"
    );
    let run = mpirun(&cmd.split(' ').collect::<Vec<_>>());
    run.assert_one_line_error(
        "rank 2 was started with --mode=ps but rank 0 with --mode=allreduce: all ranks must get the same flags",
    );
    let cmd = format!(
        "-np 1 {m} train --mode allreduce --steps 20 --lr 0.01 : -np 1 {m} train --mode allreduce --steps 20"
    );
    let run = mpirun(&cmd.split(' ').collect::<Vec<_>>());
    run.assert_one_line_error(
        "rank 1 was started with --lr=0.003 but rank 0 with --lr=0.01: all ranks must get the same flags",
    );
    let cmd = format!(
        "-np 1 {m} train --mode allreduce --steps 20 --verbose : -np 1 {m} train --mode allreduce --steps 20"
    );
    let run = mpirun(&cmd.split(' ').collect::<Vec<_>>());
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("at global step 20"), "{run:?}");
}

#[test]
fn too_many_ps_is_one_clear_error() {
    let run = mpirun(&["-np", "3", mpiflow(), "spec", "--ps", "3"]);
    run.assert_one_line_error("--ps 3 must be smaller than the number of ranks (3)");
    let run = mpirun(&[
        "-np",
        "2",
        mpiflow(),
        "spec",
        "--ps",
        "1",
        "--chief",
        "--evaluator",
    ]);
    run.assert_one_line_error(
        "2 ranks are too few for --ps 1 --chief --evaluator: need at least 3",
    );
}

#[test]
fn launch_runs_a_program_that_checks_its_role_like_tensorflow() {
    let script = format!("{}/launcher/examples/check_role.py", common::root());
    // The workers wait for ps:0's line: the job stops its ps when they end.
    let ready = common::tmpdir("role-ps-ready");
    let run = mpirun(&[
        "-np",
        "4",
        mpiflow(),
        "launch",
        "--ps",
        "1",
        "--legacy-flags",
        "--",
        "python3",
        &script,
        "--ps-ready",
        ready.to_str().unwrap(),
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let lines = run.json_lines();
    assert_eq!(lines.len(), 4, "{run:?}");
    let mut by_rank: Vec<&Value> = lines.iter().collect();
    by_rank.sort_by_key(|l| l["rank"].as_u64());
    let got: Vec<(String, u64, bool)> = by_rank
        .iter()
        .map(|l| {
            assert_eq!(l["legacy_flags"], json!(true));
            assert_eq!(l["num_ps"], json!(1));
            assert_eq!(l["num_workers"], json!(3));
            (
                l["type"].as_str().unwrap().into(),
                l["index"].as_u64().unwrap(),
                l["is_chief"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("ps".into(), 0, false),
            ("worker".into(), 0, true),
            ("worker".into(), 1, false),
            ("worker".into(), 2, false)
        ]
    );
}

#[test]
fn launch_with_a_chief_job_makes_chief_the_chief() {
    let script = format!("{}/launcher/examples/check_role.py", common::root());
    let run = mpirun(&[
        "-np",
        "3",
        mpiflow(),
        "launch",
        "--chief",
        "--",
        "python3",
        &script,
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let chiefs: Vec<String> = run
        .json_lines()
        .iter()
        .filter(|l| l["is_chief"] == json!(true))
        .map(|l| format!("{}:{}", l["type"].as_str().unwrap(), l["index"]))
        .collect();
    assert_eq!(chiefs, ["chief:0"]);
}

#[test]
fn launch_passes_the_program_exit_status_to_mpirun() {
    let script = format!("{}/launcher/examples/check_role.py", common::root());
    let run = mpirun(&[
        "-np",
        "2",
        mpiflow(),
        "launch",
        "--",
        "python3",
        &script,
        "--exit-code",
        "3",
    ]);
    assert_eq!(run.code, 3, "{run:?}");
}

#[test]
fn launch_of_a_missing_program_is_one_error_before_anything_runs() {
    let run = mpirun(&[
        "-np",
        "3",
        mpiflow(),
        "launch",
        "--",
        "no-such-program-here",
    ]);
    run.assert_one_line_error("all ranks: program \"no-such-program-here\" not found in PATH");
    let run = mpirun(&[
        "-np",
        "2",
        mpiflow(),
        "launch",
        "--chief",
        "--legacy-flags",
        "--",
        "true",
    ]);
    run.assert_one_line_error("legacy flags cannot express a chief job");
}

#[test]
fn stages_map_replica_jobs_on_every_rank_and_launch_passes_them_on() {
    // spec: every rank the same cluster of a ps job and two replica jobs of two stages.
    let args = ["-np", "5", mpiflow(), "spec", "--ps", "1", "--stages", "2"];
    let run = mpirun(&[&args[..], &["--format", "json"]].concat());
    assert_eq!(run.code, 0, "{run:?}");
    let (cluster, by_rank) = per_rank(&run.json_lines(), 5);
    assert_eq!(
        tasks(&by_rank),
        [
            "ps:0",
            "replica_0:0",
            "replica_0:1",
            "replica_1:0",
            "replica_1:1"
        ]
    );
    for job in ["replica_0", "replica_1"] {
        assert_eq!(cluster[job].as_array().unwrap().len(), 2, "{cluster}");
    }
    assert!(cluster.get("worker").is_none(), "{cluster}");

    // launch: each stage's program gets TF_CONFIG naming its replica job and stage, and
    // the ps is stopped once the replicas' tasks are done (they wait for its line).
    let ready = common::tmpdir("stages-ps-ready");
    let script = format!("{}/launcher/examples/check_role.py", common::root());
    let launch = format!("-np 3 {} launch --ps 1 --stages 2 -- python3", mpiflow());
    let mut cmd: Vec<&str> = launch.split(' ').collect();
    cmd.extend([script.as_str(), "--ps-ready", ready.to_str().unwrap()]);
    let run = mpirun(&cmd);
    assert_eq!(run.code, 0, "{run:?}");
    // check_role.py prints the task its TF_CONFIG names.
    let mut got: Vec<String> = run
        .json_lines()
        .iter()
        .map(|l| format!("{}:{}", l["type"].as_str().unwrap(), l["index"]))
        .collect();
    got.sort();
    assert_eq!(got, ["ps:0", "replica_0:0", "replica_0:1"], "{run:?}");

    // A rank count that does not divide, and --stages by the asynchronous ps (stages
    // train synchronously): one line, no hang.
    let run = mpirun(&["-np", "4", mpiflow(), "spec", "--ps", "1", "--stages", "2"]);
    assert_ne!(run.code, 0, "{run:?}");
    assert_eq!(
        run.error_lines(),
        ["mpiflow: error: --stages 2: the 3 ranks left for replicas after --ps 1 do not divide into replicas of 2 stages"],
        "{run:?}"
    );
    let train = format!(
        "-np 3 {} train --mode ps --ps 1 --stages 2 --async",
        mpiflow()
    );
    let run = mpirun(&train.split(' ').collect::<Vec<_>>());
    assert_ne!(run.code, 0, "{run:?}");
    let lines = run.error_lines();
    assert!(!lines.is_empty(), "{run:?}");
    assert!(
        lines
            .iter()
            .all(|l| l.contains("--stages 2 trains synchronously: drop --async")),
        "{run:?}"
    );
    assert!(!run.stderr.contains("panicked"), "{run:?}");
}
