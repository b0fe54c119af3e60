//! The `mpiflow` binary without an MPI launcher: hostfile previews, Slurm steps, TF_CONFIG,
//! legacy flags, and every kind of bad input giving one clear line and a non-zero exit.

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::net::TcpListener;

use common::mpiflow_alone as run;
use serde_json::{json, Value};

fn tmpfile(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("mpiflow-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::File::create(&p)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    p
}

fn rows(table: &str) -> Vec<Vec<String>> {
    table
        .lines()
        .skip(2)
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

#[test]
fn every_shipped_hostfile_previews() {
    for (file, np) in [
        ("hostfiles/localhost", "6"),
        ("hostfiles/openmpi-cluster", "12"),
        ("hostfiles/mpich-cluster", "11"),
        ("hostfiles/netns-3hosts", "6"),
    ] {
        let r = run(&["spec", "--hostfile", file, "-np", np, "--ps", "2"], &[]);
        assert_eq!(r.code, 0, "{file}: {r:?}");
        assert_eq!(
            rows(&r.stdout).len(),
            np.parse::<usize>().unwrap(),
            "{file}"
        );
    }
}

#[test]
fn hostfile_preview_spread_puts_ps_on_distinct_hosts() {
    let r = run(
        &[
            "spec",
            "--hostfile",
            "hostfiles/openmpi-cluster",
            "-np",
            "12",
            "--ps",
            "3",
            "--placement",
            "spread",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let rows = rows(&r.stdout);
    let ps_hosts: Vec<&str> = rows
        .iter()
        .filter(|r| r[3] == "ps")
        .map(|r| r[1].as_str())
        .collect();
    assert_eq!(ps_hosts, ["node01", "node02", "node03"]);
    // By-slot mapping: 4 on node01, 4 on node02, 2 and 2.
    let hosts: Vec<&str> = rows.iter().map(|r| r[1].as_str()).collect();
    assert_eq!(
        hosts[..5],
        ["node01", "node01", "node01", "node01", "node02"]
    );
    // Ports count up per host.
    let node02: Vec<&str> = rows
        .iter()
        .filter(|r| r[1] == "node02")
        .map(|r| r[5].as_str())
        .collect();
    assert_eq!(
        node02,
        ["node02:2222", "node02:2223", "node02:2224", "node02:2225"]
    );
}

#[test]
fn hostfile_preview_map_by_node_and_json() {
    let r = run(
        &[
            "spec",
            "--hostfile",
            "hostfiles/netns-3hosts",
            "-np",
            "6",
            "--map-by",
            "node",
            "--format",
            "json",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let hosts: Vec<Value> = r.json_lines().iter().map(|l| l["host"].clone()).collect();
    assert_eq!(
        hosts,
        [
            json!("h1"),
            json!("h2"),
            json!("h3"),
            json!("h1"),
            json!("h2"),
            json!("h3")
        ]
    );
}

#[test]
fn bad_hostfiles_and_previews() {
    let bad = tmpfile("bad-hostfile", "# ok\nnode1 slots=2\nnode2 slots=two\n");
    let bad = bad.to_str().unwrap();
    for (args, want) in [
        (
            vec!["spec", "--hostfile", bad, "-np", "2"],
            "bad-hostfile:3: slots=\"two\" must be a positive integer",
        ),
        (
            vec!["spec", "--hostfile", "/nonexistent/h", "-np", "2"],
            "hostfile /nonexistent/h: cannot read",
        ),
        (
            vec!["spec", "--hostfile", "hostfiles/netns-3hosts"],
            "--hostfile needs -np N",
        ),
        (
            vec!["spec", "--hostfile", "hostfiles/netns-3hosts", "-np", "7"],
            "7 ranks requested but only 6 slots",
        ),
        (
            vec![
                "spec",
                "--hostfile",
                "hostfiles/netns-3hosts",
                "-np",
                "3",
                "--ps",
                "3",
            ],
            "--ps 3 must be smaller",
        ),
        (
            vec![
                "spec",
                "--hostfile",
                "hostfiles/netns-3hosts",
                "-np",
                "2",
                "--port-base",
                "65535",
            ],
            "above 65535",
        ),
        (vec!["spec", "--port-base", "0"], "0 is not in 1..=65535"),
        (
            vec!["spec", "--port-base", "70000"],
            "70000 is not in 1..=65535",
        ),
        (
            vec!["spec", "--placement", "diagonal"],
            "invalid value 'diagonal'",
        ),
        (
            vec![
                "launch",
                "--hostfile",
                "hostfiles/localhost",
                "-np",
                "2",
                "--",
                "true",
            ],
            "a hostfile only previews",
        ),
    ] {
        run(&args, &[]).assert_one_line_error(want);
    }
}

const SLURM: [(&str, &str); 6] = [
    ("SLURM_JOB_ID", "42"),
    ("SLURM_STEP_ID", "0"),
    ("SLURM_STEP_NUM_TASKS", "5"),
    ("SLURM_STEP_NODELIST", "node[1,3-4]"),
    ("SLURM_STEP_TASKS_PER_NODE", "2(x2),1"),
    ("SLURM_PROCID", "0"),
];

fn slurm_env(procid: &str, extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, String)> {
    let mut env: Vec<(&str, String)> = SLURM.iter().map(|(k, v)| (*k, v.to_string())).collect();
    env.retain(|(k, _)| *k != "SLURM_PROCID");
    env.push(("SLURM_PROCID", procid.to_string()));
    env.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    env
}

fn with_env<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'a str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

#[test]
fn slurm_step_without_mpi() {
    // Every task of the step sees the same cluster and its own role.
    let mut clusters = Vec::new();
    for procid in 0..5 {
        let p = procid.to_string();
        let env = slurm_env(&p, &[]);
        let base = (31000 + procid * 10).to_string();
        let r = run(
            &[
                "spec",
                "--ps",
                "2",
                "--placement",
                "spread",
                "--port-base",
                &base,
                "--format",
                "json",
            ],
            &with_env(&env),
        );
        assert_eq!(r.code, 0, "{r:?}");
        let l = &r.json_lines()[0];
        assert_eq!(l["source"], json!("slurm"));
        assert_eq!(l["rank"], json!(procid));
        clusters.push((
            l["task"].clone(),
            l["host"].clone(),
            l["cluster"]["ps"].clone(),
        ));
    }
    let hosts: Vec<&Value> = clusters.iter().map(|c| &c.1).collect();
    assert_eq!(
        hosts,
        [
            &json!("node1"),
            &json!("node1"),
            &json!("node3"),
            &json!("node3"),
            &json!("node4")
        ]
    );
    assert_eq!(clusters[0].0, json!({"type": "ps", "index": 0}));
    assert_eq!(clusters[2].0, json!({"type": "ps", "index": 1}));
    assert_eq!(clusters[1].0, json!({"type": "worker", "index": 0}));
    assert_eq!(clusters[0].2, json!(["node1:31000", "node3:31000"]));
}

#[test]
fn slurm_table_and_bad_slurm_variables() {
    let env = slurm_env("0", &[]);
    let r = run(
        &["spec", "--ps", "1", "--port-base", "31100"],
        &with_env(&env),
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout
            .starts_with("# mpiflow cluster (slurm): 5 tasks on 3 hosts: ps=1 worker=4"),
        "{}",
        r.stdout
    );
    for (extra, want) in [
        (
            vec![("SLURM_STEP_NODELIST", "node[1,3-")],
            "host list \"node[1,3-\": unclosed '['",
        ),
        (
            vec![("SLURM_STEP_TASKS_PER_NODE", "1(x3)")],
            "requested 5 tasks but only 3 were assigned",
        ),
        (
            vec![("SLURM_STEP_TASKS_PER_NODE", "2(x4),1")],
            "3 nodes but tasks per node",
        ),
        (
            vec![("SLURM_STEP_NUM_TASKS", "five")],
            "SLURM_STEP_NUM_TASKS=\"five\"",
        ),
        (
            vec![("SLURMD_NODENAME", "node4")],
            "rank 0 runs on node4 but the block distribution puts it on node1",
        ),
        (
            vec![("SLURM_DISTRIBUTION", "arbitrary")],
            "not supported without MPI",
        ),
    ] {
        let env = slurm_env("0", &extra);
        run(&["spec", "--from", "slurm"], &with_env(&env)).assert_one_line_error(want);
    }
    let env = slurm_env("7", &[]);
    run(&["spec"], &with_env(&env))
        .assert_one_line_error("SLURM_PROCID=7 is not below the number of tasks 5");
    // A rank that is no number is named by the error, not put in front of it as a rank.
    let r = run(&["spec"], &with_env(&slurm_env("abc", &[])));
    r.assert_one_line_error(
        "mpiflow: error: Slurm: SLURM_PROCID=\"abc\" is not a non-negative integer",
    );
    run(&["spec", "--ps", "5"], &with_env(&slurm_env("0", &[]))).assert_one_line_error(
        "Slurm job 42 has 5 tasks, too few for --ps 5: ask for at least 6 (sbatch/srun -n 6)",
    );
}

#[test]
fn slurm_jobs_number_their_ports_from_a_base_of_their_own() {
    // Without --port-base a Slurm job's tasks take ports from 10000 + 64 x (job id mod
    // 350): two jobs sharing a node do not number theirs alike. Outside Slurm: 2222.
    let cluster = |job: &'static str| {
        let env = slurm_env("0", &[("SLURM_JOB_ID", job)]);
        let r = run(&["spec", "--ps", "1", "--format", "json"], &with_env(&env));
        assert_eq!(r.code, 0, "{r:?}");
        r.json_lines()[0]["cluster"].clone()
    };
    assert_eq!(cluster("42")["ps"], json!(["node1:12688"]));
    assert_eq!(cluster("42")["worker"][0], json!("node1:12689"));
    assert_eq!(cluster("43")["ps"], json!(["node1:12752"]));
    assert_eq!(cluster("392")["ps"], json!(["node1:12688"]));
    let env = slurm_env("0", &[]);
    let r = run(
        &[
            "spec",
            "--ps",
            "1",
            "--port-base",
            "2222",
            "--format",
            "json",
        ],
        &with_env(&env),
    );
    assert_eq!(
        r.json_lines()[0]["cluster"]["ps"],
        json!(["node1:2222"]),
        "{r:?}"
    );
}

#[test]
fn slurm_port_in_use_is_an_error_naming_the_task() {
    let held = TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    // The check runs where the node is this machine (a node list naming this host).
    let me = common::hostname();
    let mut env = slurm_env("0", &[]);
    for (k, v) in env.iter_mut() {
        match *k {
            "SLURM_JOB_NODELIST" | "SLURM_STEP_NODELIST" => *v = format!("{me},other"),
            "SLURM_TASKS_PER_NODE" | "SLURM_STEP_TASKS_PER_NODE" => *v = "3,2".into(),
            "SLURMD_NODENAME" => *v = me.clone(),
            _ => {}
        }
    }
    run(&["spec", "--port-base", &port], &with_env(&env)).assert_one_line_error(&format!(
        "rank 0: port {port} of worker:0 on {me} is already in use"
    ));
    // On a node that is not this machine (a fake node) there is nothing to check.
    let env = slurm_env("0", &[]);
    let r = run(&["spec", "--port-base", &port], &with_env(&env));
    assert_eq!(r.code, 0, "{r:?}");
}

#[test]
fn tf_config_source_validates_and_re_emits() {
    let cfg = r#"{"cluster": {"worker": ["w1:2222", "w0:2222"], "ps": ["p:2222"]}, "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc"}"#;
    let r = run(&["spec", "--format", "tf-config"], &[("TF_CONFIG", cfg)]);
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(
        r.stdout.trim(),
        r#"{"cluster":{"ps":["p:2222"],"worker":["w1:2222","w0:2222"]},"task":{"type":"worker","index":1},"rpc_layer":"grpc"}"#
    );
    let r = run(&["spec", "--format", "flags"], &[("TF_CONFIG", cfg)]);
    assert_eq!(
        r.stdout.trim(),
        "--ps_hosts=p:2222 --worker_hosts=w1:2222,w0:2222 --job_name=worker --task_index=1"
    );
    for (cfg, want) in [
        ("{not json", "TF_CONFIG is not valid JSON"),
        (
            r#"{"cluster": {"worker": ["a:1"]}}"#,
            "TF_CONFIG has no \"task\"",
        ),
        (
            r#"{"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}}"#,
            "chief job has 2 tasks",
        ),
        (
            r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 4}}"#,
            "task worker:4 is not in the cluster",
        ),
        (
            r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "trainer", "index": 0}}"#,
            "unknown job type \"trainer\"",
        ),
        (
            r#"{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}"#,
            "duplicate address a:1",
        ),
        (
            r#"{"cluster": {"worker": ["a:65536"]}, "task": {"type": "worker", "index": 0}}"#,
            "port 65536 is out of range",
        ),
    ] {
        run(&["spec"], &[("TF_CONFIG", cfg)]).assert_one_line_error(want);
    }
    run(&["spec", "--from", "tf-config"], &[])
        .assert_one_line_error("TF_CONFIG is not set, and the cluster is to come from it");
    // A chief cannot be written as legacy flags.
    let chief = r#"{"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}"#;
    run(&["spec", "--format", "flags"], &[("TF_CONFIG", chief)])
        .assert_one_line_error("cannot express a chief job");
}

#[test]
fn tf_config_for_this_host_checks_the_port() {
    let held = TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let port = held.local_addr().unwrap().port();
    let cfg = format!(
        r#"{{"cluster": {{"worker": ["localhost:{port}"]}}, "task": {{"type": "worker", "index": 0}}}}"#
    );
    run(&["spec"], &[("TF_CONFIG", &cfg)]).assert_one_line_error(&format!(
        "port {port} of worker:0 on localhost is already in use"
    ));
}

#[test]
fn legacy_flags_source() {
    let r = run(
        &[
            "spec",
            "--ps_hosts",
            "a:1,b:1",
            "--worker_hosts=c:1",
            "--job_name",
            "ps",
            "--task_index",
            "1",
            "--format",
            "tf-config",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(
        r.stdout.trim(),
        r#"{"cluster":{"ps":["a:1","b:1"],"worker":["c:1"]},"task":{"type":"ps","index":1}}"#
    );
    run(
        &[
            "spec",
            "--worker_hosts=c:1",
            "--job_name",
            "worker",
            "--task_index",
            "1",
        ],
        &[],
    )
    .assert_one_line_error("task worker:1 is not in the cluster");
    run(
        &[
            "spec",
            "--worker_hosts=c:1",
            "--job_name",
            "boss",
            "--task_index",
            "0",
        ],
        &[],
    )
    .assert_one_line_error("--job_name \"boss\" must be ps or worker");
}

#[test]
fn launch_from_tf_config_execs_with_the_task_environment() {
    let cfg = r#"{"cluster": {"worker": ["w0:2222", "w1:2222"], "ps": ["p:2222"]}, "task": {"type": "worker", "index": 1}}"#;
    let script = format!("{}/launcher/examples/check_role.py", common::root());
    let r = run(
        &["launch", "--legacy-flags", "--", "python3", &script],
        &[("TF_CONFIG", cfg)],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let l = &r.json_lines()[0];
    assert_eq!(l["type"], json!("worker"));
    assert_eq!(l["index"], json!(1));
    assert_eq!(l["legacy_flags"], json!(true));
    assert_eq!(l["rank"], Value::Null, "no rank is known from TF_CONFIG");
}

#[test]
fn unknown_flags_are_one_line() {
    run(&["spec", "--bogus"], &[]).assert_one_line_error("unexpected argument '--bogus'");
    // What clap lists under its first line, and the command's help.
    run(&["plot", "run.csv"], &[]).assert_one_line_error(
        "the following required arguments were not provided: --out <SVG> (see mpiflow plot --help)",
    );
    // A negative number reaches the flag's own check (clap took it for a flag).
    run(&["train", "--lr", "-0.1"], &[]).assert_one_line_error(
        "invalid value '-0.1' for '--lr <LR>': \"-0.1\" is not a positive number",
    );
    // As a hostfile's `slots=0` is (it was taken as 1).
    run(&["spec", "--default-slots", "0"], &[])
        .assert_one_line_error("invalid value '0' for '--default-slots <DEFAULT_SLOTS>'");
    run(&["launch", "--ps", "1"], &[])
        .assert_one_line_error("required arguments were not provided");
}

#[test]
fn bad_fusion_settings_are_one_line() {
    run(
        &["train", "--mode", "allreduce", "--fusion-threshold", "0"],
        &[],
    )
    .assert_one_line_error("\"0\" is not a positive integer");
    run(
        &[
            "train",
            "--mode",
            "allreduce",
            "--allreduce-algorithm",
            "tree",
        ],
        &[],
    )
    .assert_one_line_error("invalid value 'tree' for '--allreduce-algorithm");
}

#[test]
fn outputs_that_cannot_be_written_are_refused_before_training() {
    // It was found after the last step, the run's result lost.
    run(&["train", "--save-params", "/proc/none/params.bin"], &[]).assert_one_line_error(
        "parameters file /proc/none/params.bin: cannot create its directory /proc/none",
    );
    run(&["train", "--save-params", "/tmp"], &[])
        .assert_one_line_error("parameters file /tmp: is a directory");
    // A checkpoint directory that cannot be one was found at the first checkpoint.
    run(&["train", "--checkpoint-dir", "/proc/none/ckpt"], &[])
        .assert_one_line_error("checkpoint directory /proc/none/ckpt: cannot create it: ");
    run(&["train", "--checkpoint-dir", "/etc/hostname"], &[])
        .assert_one_line_error("checkpoint directory /etc/hostname: is a file, not a directory");
    // The metrics and the timeline too, before the run's header: the error is all it says.
    for (flag, want) in [
        (
            "--metrics",
            "metrics file /proc/none/m.csv: cannot create it: ",
        ),
        ("--timeline", "timeline /proc/none/m.csv: cannot write it: "),
    ] {
        let bad = run(&["train", flag, "/proc/none/m.csv"], &[]);
        bad.assert_one_line_error(want);
        assert_eq!(bad.stdout, "", "{bad:?}");
    }
}

#[test]
fn flags_of_another_mode_are_one_line_errors() {
    // Each was ignored silently before: the run trained, without what the flag asked for.
    // (mode, flags, the error)
    let other_mode = |flag: &str, wanted: &str, mode: &str| {
        format!("{flag} is for --mode {wanted}, not --mode {mode}")
    };
    let replicas = |flag: &str, mode: &str| {
        format!("{flag} is for --mode allreduce or hybrid, or --stages, not --mode {mode} without --stages")
    };
    let cluster = |flag: &str| {
        format!("{flag} is for --mode ps, allreduce or hybrid, not --mode local (one process, no cluster)")
    };
    let stages = |flag: &str| {
        format!("{flag} is for --stages (a model cut into stages); without it each task holds the whole model")
    };
    for (mode, flags, error) in [
        ("local", "--async", other_mode("--async", "ps or hybrid", "local")),
        (
            "allreduce",
            "--async",
            other_mode("--async", "ps or hybrid", "allreduce"),
        ),
        (
            "allreduce",
            "--transport rma",
            other_mode("--transport rma", "ps or hybrid", "allreduce"),
        ),
        (
            "ps",
            "--window-rows 64",
            "--window-rows sizes the embedding rows' windows of --model dlrm --transport rma, not --mode ps over messages".to_string(),
        ),
        (
            "ps",
            "--model dlrm --transport rma --rows-ahead on",
            "--rows-ahead is for the embedding rows of --model dlrm on ps tasks over messages, not --mode ps --transport rma".to_string(),
        ),
        (
            "local",
            "--model dlrm --rows-ahead off",
            "--rows-ahead is for the embedding rows of --model dlrm on ps tasks over messages, not --mode local".to_string(),
        ),
        (
            "allreduce",
            "--replicas-to-aggregate 2",
            other_mode("--replicas-to-aggregate", "ps", "allreduce"),
        ),
        (
            "local",
            "--var-placement partition",
            other_mode("--var-placement", "ps", "local"),
        ),
        (
            "allreduce",
            "--partition-bytes 4096",
            other_mode("--partition-bytes", "ps", "allreduce"),
        ),
        (
            "allreduce",
            "--peer-timeout 3",
            other_mode("--peer-timeout", "ps or hybrid", "allreduce"),
        ),
        (
            "allreduce",
            "--stages 2 --peer-timeout 3",
            other_mode("--peer-timeout", "ps or hybrid", "allreduce"),
        ),
        (
            "ps",
            "--overlap",
            other_mode("--overlap", "allreduce", "ps"),
        ),
        (
            "local",
            "--overlap",
            other_mode("--overlap", "allreduce", "local"),
        ),
        ("ps", "--check-every 5", replicas("--check-every", "ps")),
        (
            "ps",
            "--fusion-threshold 1",
            replicas("--fusion-threshold", "ps"),
        ),
        (
            "local",
            "--allreduce-algorithm ring",
            replicas("--allreduce-algorithm", "local"),
        ),
        ("allreduce", "--micro-batches 2", stages("--micro-batches")),
        ("ps", "--schedule gpipe", stages("--schedule")),
        ("local", "--balance counted", stages("--balance")),
        ("local", "--ps 1", cluster("--ps")),
        ("local", "--chief", cluster("--chief")),
        (
            "local",
            "--hostfile hostfiles/openmpi-cluster",
            cluster("--hostfile"),
        ),
        ("local", "--stall-warning 5", cluster("--stall-warning")),
        (
            "local",
            "--checkpoint-every 5",
            "--checkpoint-every 5 writes into --checkpoint-dir: give the directory too".into(),
        ),
        (
            "local",
            "--model cnn --data fashion-mnist --hidden 64",
            "--hidden is for --model mlp (the CNN's layers are fixed; DLRM's MLPs: --bottom, --top)".into(),
        ),
        ("local", "--embedding-dim 8", "--embedding-dim is for --model dlrm".into()),
        ("ps", "--sparse-lr 0.1", "--sparse-lr is for --model dlrm".into()),
        (
            "hybrid",
            "--model mlp",
            "--mode hybrid trains models with embedding tables: --model dlrm".into(),
        ),
        (
            "allreduce",
            "--model dlrm",
            "--model dlrm trains in --mode local, ps or hybrid (its tables live in one process or on ps tasks)".into(),
        ),
        (
            "local",
            "--model dlrm --data digits:/nonexistent --steps 5",
            "--model dlrm takes click data".into(),
        ),
    ] {
        let mut args = vec!["train", "--mode", mode];
        args.extend(flags.split(' '));
        run(&args, &[]).assert_one_line_error(&error);
    }
    // A default spelled out is no request of another mode's, nor is turning off what the
    // mode does not do.
    let r = run(
        &[
            "train",
            "--mode",
            "local",
            "--transport",
            "p2p",
            "--micro-batches",
            "4",
            "--check-every",
            "0",
            "--stall-warning",
            "0",
            "--checkpoint-every",
            "500",
            "--steps",
            "2",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
}

#[test]
fn cluster_flags_the_source_does_not_read_are_one_line_errors() {
    // The cluster came from elsewhere and these were ignored: the hostfile was not read.
    let cfg = r#"{"cluster":{"worker":["a:1","b:2"]},"task":{"type":"worker","index":0}}"#;
    let tf = [("TF_CONFIG", cfg)];
    run(&["spec", "--from", "tf-config", "--hostfile", "hostfiles/openmpi-cluster", "-np", "4"], &tf)
        .assert_one_line_error("--hostfile is for --from hostfile (a preview of mpirun: --hostfile H -np N), but this cluster comes from tf-config");
    run(&["spec", "--np", "4", "--ps", "1"], &tf).assert_one_line_error(
        "--np is for --from hostfile (a preview of mpirun: --hostfile H -np N), but this cluster comes from tf-config",
    );
    run(
        &["spec", "--hostfile", "hostfiles/openmpi-cluster", "-np", "4", "--job_name", "ps"],
        &[],
    )
    .assert_one_line_error("--job_name is for --from flags (the seeds' flags: --ps_hosts, --worker_hosts, --job_name, --task_index), but this cluster comes from hostfile");
    // Their own source reads them.
    let r = run(
        &[
            "spec",
            "--hostfile",
            "hostfiles/openmpi-cluster",
            "-np",
            "4",
            "--map-by",
            "node",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
}

#[test]
fn stages_preview_keeps_replicas_inside_hosts_and_tf_config_takes_replica_jobs() {
    // openmpi-cluster: node01 and node02 of 4 slots, node03 and node04 of 2.
    let r = run(
        &[
            "spec",
            "--hostfile",
            "hostfiles/openmpi-cluster",
            "-np",
            "9",
            "--ps",
            "1",
            "--stages",
            "2",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let got: Vec<(String, String)> = rows(&r.stdout)
        .into_iter()
        .map(|row| (row[1].clone(), format!("{}:{}", row[3], row[4])))
        .collect();
    let replica_hosts = |job: &str| -> BTreeSet<String> {
        got.iter()
            .filter(|(_, t)| t.starts_with(&format!("{job}:")))
            .map(|(h, _)| h.clone())
            .collect()
    };
    // Four replicas of two stages; three inside one host, node01's leftover with node03.
    let spans: Vec<usize> = (0..4)
        .map(|i| replica_hosts(&format!("replica_{i}")).len())
        .collect();
    assert_eq!(spans.iter().filter(|n| **n == 1).count(), 3, "{}", r.stdout);
    assert_eq!(spans.iter().filter(|n| **n == 2).count(), 1, "{}", r.stdout);
    // TF_CONFIG with replica jobs is read back; one that TensorFlow would not name is refused.
    let tf = r#"{"cluster":{"ps":["a:1"],"replica_0":["b:1","b:2"]},"task":{"type":"replica_0","index":1}}"#;
    let r = run(
        &["spec", "--from", "tf-config", "--format", "json"],
        &[("TF_CONFIG", tf)],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(
        r.json_lines()[0]["task"],
        json!({"type": "replica_0", "index": 1})
    );
    let tf = r#"{"cluster":{"replica_01":["b:1"]},"task":{"type":"replica_01","index":0}}"#;
    let r = run(&["spec", "--from", "tf-config"], &[("TF_CONFIG", tf)]);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(
        r.stderr.contains(r#"unknown job type "replica_01""#),
        "{r:?}"
    );
    // The legacy flags know only ps and worker jobs.
    let r = run(
        &[
            "spec",
            "--hostfile",
            "hostfiles/localhost",
            "-np",
            "3",
            "--ps",
            "1",
            "--stages",
            "2",
            "--format",
            "flags",
        ],
        &[],
    );
    assert_ne!(r.code, 0, "{r:?}");
    assert!(
        r.stderr
            .contains("legacy flags cannot express a replica_0 job"),
        "{r:?}"
    );
}

#[test]
fn towers_beyond_the_batch_are_named_in_the_run() {
    let out = run(
        &[
            "train", "--data", "digits", "--steps", "2", "--batch", "2", "--towers", "3",
        ],
        &[],
    );
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains(", batch 2, towers 3, "), "{out:?}");
    assert_eq!(
        out.stderr.trim(),
        "mpiflow: warning: --towers 3: the batch is 2 sample(s), so 2 tower(s) compute and the rest sit out"
    );
    let out = run(
        &["train", "--data", "digits", "--steps", "2", "--towers", "2"],
        &[],
    );
    assert_eq!((out.code, out.stderr.as_str()), (0, ""), "{out:?}");
}

#[test]
fn a_blas_pool_beyond_the_ranks_cpus_is_a_warning_and_zero_an_error() {
    // The CPUs a rank runs on, as the header lists them: "(CPUs 0-1,4)".
    let plain = run(&["train", "--data", "digits", "--steps", "1"], &[]);
    let list = plain
        .stdout
        .split("(CPUs ")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap();
    let cpus: usize = list
        .split(',')
        .map(|r| match r.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
            None => 1,
        })
        .sum();
    let n = (cpus + 1).to_string();
    let out = run(
        &[
            "train",
            "--data",
            "digits",
            "--steps",
            "2",
            "--blas-threads",
            &n,
        ],
        &[],
    );
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(
        out.stderr.trim(),
        format!(
            "mpiflow: warning: --blas-threads {n} is more than the {cpus} CPU(s) a rank runs on: its threads share them"
        )
    );
    assert!(
        out.stdout.contains(&format!("BLAS threads {n} ")),
        "{out:?}"
    );
    run(&["train", "--blas-threads", "0"], &[])
        .assert_one_line_error("invalid value '0' for '--blas-threads <BLAS_THREADS>'");
}
