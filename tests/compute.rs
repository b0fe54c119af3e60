//! Compute through the real binary: local training on digits (accuracy, determinism),
//! bad data input, and CPU binding read back from the OS under `mpirun -np 2`.

mod common;

use common::{mpiflow, mpiflow_alone, mpirun};
use serde_json::json;

fn final_line(stdout: &str) -> &str {
    stdout
        .lines()
        .find(|l| l.starts_with("accuracy "))
        .expect("an accuracy line")
}

#[test]
fn local_training_reaches_95_percent_and_is_deterministic() {
    let a = mpiflow_alone(&["train", "--mode", "local"], &[]);
    assert_eq!(a.code, 0, "{a:?}");
    let line = final_line(&a.stdout);
    let acc: f64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(acc >= 0.95, "{line}");
    // The loss falls between the first and the last logged step.
    let losses: Vec<f64> = a
        .stdout
        .lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| l.split_whitespace().nth(3).unwrap().parse().unwrap())
        .collect();
    assert!(
        losses.len() >= 5 && losses[0] > *losses.last().unwrap(),
        "{losses:?}"
    );
    let b = mpiflow_alone(&["train", "--mode", "local"], &[]);
    let strip = |l: &str| l.split(", ").take(2).collect::<Vec<_>>().join(", ");
    assert_eq!(
        strip(final_line(&b.stdout)),
        strip(line),
        "same seed, same accuracy and loss"
    );
    // Other optimizers and the synthetic data train too.
    let c = mpiflow_alone(
        &[
            "train",
            "--optimizer",
            "momentum",
            "--lr",
            "0.05",
            "--data",
            "synthetic",
            "--steps",
            "300",
        ],
        &[],
    );
    let acc: f64 = final_line(&c.stdout)
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert!(acc > 0.9, "{c:?}");
}

#[test]
fn bad_training_input_is_one_line() {
    mpiflow_alone(&["train", "--data", "cifar"], &[])
        .assert_one_line_error("unknown data set \"cifar\"");
    mpiflow_alone(
        &["train", "--data", "idx:/nonexistent/a,/nonexistent/b"],
        &[],
    )
    .assert_one_line_error("data /nonexistent/a: cannot read");
    mpiflow_alone(&["train", "--batch", "0"], &[]).assert_one_line_error("0 is not in 1..");
    // It was cut to the data silently, and samples/s counted the batch asked for.
    mpiflow_alone(&["train", "--batch", "1439"], &[])
        .assert_one_line_error("--batch 1439 is larger than the 1438 training samples of digits");
    mpiflow_alone(&["train", "--steps", "0"], &[]).assert_one_line_error("0 is not in 1..");
    mpiflow_alone(&["train", "--hidden", "64,0"], &[])
        .assert_one_line_error("\"0\" is not a positive integer");
    mpiflow_alone(&["train", "--lr=-1"], &[])
        .assert_one_line_error("\"-1\" is not a positive number");
    mpiflow_alone(&["train", "--mode", "ps"], &[])
        .assert_one_line_error("ps mode needs at least one ps task (--ps N)");
    let bad = std::env::temp_dir().join(format!("mpiflow-bad-digits-{}.csv", std::process::id()));
    std::fs::write(&bad, "1,2,3\n").unwrap();
    let spec = format!("digits:{}", bad.display());
    mpiflow_alone(&["train", "--data", &spec], &[])
        .assert_one_line_error(":1: 3 fields, expected 64 pixels and a label");
    let _ = std::fs::remove_file(&bad);
}

#[test]
fn binding_is_applied_and_read_back_from_the_os() {
    // The launcher binds nothing: mpiflow binds each rank to its own core.
    let run = mpirun(&[
        "-np",
        "2",
        "--bind-to",
        "none",
        mpiflow(),
        "topo",
        "--format",
        "json",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let mut lines = run.json_lines();
    lines.sort_by_key(|l| l["rank"].as_u64());
    let cores = std::thread::available_parallelism().unwrap().get();
    if cores >= 2 {
        assert_eq!(lines[0]["bound_by"], json!("mpiflow"));
        assert_ne!(
            lines[0]["cpus"], lines[1]["cpus"],
            "two ranks, two cores: no sharing"
        );
        assert_eq!(lines[0]["blas_threads"], json!(cores / 2));
    }
    // The launcher binds: mpiflow keeps its binding and sizes BLAS to it.
    let run = mpirun(&[
        "-np",
        "2",
        "--bind-to",
        "core",
        mpiflow(),
        "topo",
        "--format",
        "json",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    for l in run.json_lines() {
        assert_eq!(l["bound_by"], json!("launcher"), "{l}");
        assert_eq!(l["blas_threads"], json!(1));
        assert_eq!(l["rdma"], json!([]), "{l}");
        assert!(
            l["ucx_transports"]
                .as_array()
                .is_some_and(|t| t.contains(&json!("tcp"))),
            "{l}"
        );
    }
    // The table: node summary and one row per rank.
    let run = mpirun(&["-np", "3", mpiflow(), "topo", "--bind", "scatter"]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.starts_with("# node "), "{}", run.stdout);
    assert_eq!(run.stdout.lines().count(), 6);
    // No RDMA device here; UCX (ucx-utils, installed by the setup) offers shared memory
    // and TCP.
    let rdma = run.stdout.lines().nth(1).unwrap();
    assert!(rdma.starts_with("# rdma: no device"), "{rdma}");
    for t in ["self", "tcp", "posix"] {
        assert!(rdma.contains(t), "{rdma}");
    }
}
