//! `examples/trainer.rs`, the seeds' trainer written with mpiflow's library, under real
//! `mpirun -np 4` (1 ps, 3 workers), with its role from each of the three sources: the
//! MPI mapping, the seeds' flags (one app context per task, ranks not in task order),
//! and TF_CONFIG per process, over messages and over one-sided windows. The chief prints
//! `accuracy X`. `examples/allreduce.rs`, a
//! model of its own trained by allreduce, under `mpirun -np 3`.

mod common;

use common::{accuracy, mpirun};

/// An example's binary, built beside mpiflow's by `cargo test`.
fn example(name: &str) -> String {
    let bin = std::path::Path::new(common::mpiflow());
    bin.parent()
        .expect("a target directory")
        .join("examples")
        .join(name)
        .display()
        .to_string()
}

fn trainer() -> String {
    example("trainer")
}

fn assert_trained(out: &common::Run, what: &str) {
    assert_eq!(out.code, 0, "{what}: {out:?}");
    let acc = accuracy(&out.stdout);
    assert!(acc >= 0.95, "{what}: accuracy {acc}\n{}", out.stdout);
    // Only the chief reports.
    assert_eq!(out.stdout.matches("accuracy").count(), 1, "{}", out.stdout);
}

#[test]
fn the_trainer_reaches_the_target_with_roles_from_mpi() {
    let t = trainer();
    let out = mpirun(&["-np", "4", &t, "--steps", "400"]);
    assert_trained(&out, "MPI roles");
    assert!(
        out.stdout.contains("# bytes per ps: ps:0="),
        "{}",
        out.stdout
    );
}

/// The same program over one-sided windows (`Server::one_sided`: every task takes part,
/// the workers drive the session in a closure): synchronous training is the same
/// training, so the chief ends at the same accuracy as over messages.
#[test]
fn the_trainer_trains_the_same_over_one_sided_windows() {
    let t = trainer();
    let messages = mpirun(&["-np", "4", &t, "--steps", "300"]);
    let windows = mpirun(&["-np", "4", &t, "--steps", "300", "--transport", "rma"]);
    let runs = [
        (&messages, "ps over messages"),
        (&windows, "ps over windows"),
    ];
    assert_same_training(runs, "# one-sided:", 0.005);
}

/// Two runs of the same training by two paths: both trained, the second's output shows
/// `marker` (the path it took), and their accuracies are within `tolerance`.
fn assert_same_training(runs: [(&common::Run, &str); 2], marker: &str, tolerance: f64) {
    for (run, what) in runs {
        assert_trained(run, what);
    }
    let [(a, what_a), (b, what_b)] = runs;
    assert!(b.stdout.contains(marker), "{what_b}: {}", b.stdout);
    let (x, y) = (accuracy(&a.stdout), accuracy(&b.stdout));
    assert!((x - y).abs() < tolerance, "{what_a} {x}, {what_b} {y}");
}

#[test]
fn the_trainer_takes_its_role_from_the_seeds_flags_and_from_tf_config() {
    let t = trainer();
    let hosts =
        "--ps_hosts=localhost:23100 --worker_hosts=localhost:23101,localhost:23102,localhost:23103";
    let mut args: Vec<String> = Vec::new();
    // Ranks 0..3 get ps:0, worker:2, worker:0, worker:1: the task order is the flags'.
    for (i, (job, index)) in [("ps", 0), ("worker", 2), ("worker", 0), ("worker", 1)]
        .iter()
        .enumerate()
    {
        if i > 0 {
            args.push(":".into());
        }
        args.extend(["-np".into(), "1".into(), t.clone()]);
        args.extend(hosts.split(' ').map(String::from));
        args.extend([
            format!("--job_name={job}"),
            format!("--task_index={index}"),
            "--steps".into(),
            "400".into(),
        ]);
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_trained(&mpirun(&refs), "seeds' flags");

    let cluster = r#""cluster": {"ps": ["localhost:23200"], "worker": ["localhost:23201", "localhost:23202", "localhost:23203"]}"#;
    let tasks = [("worker", 1), ("ps", 0), ("worker", 0), ("worker", 2)];
    let args = common::tf_config_processes(cluster, &tasks, &[&t, "--steps", "400"]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_trained(&mpirun(&refs), "TF_CONFIG");

    // With an evaluator task (outside the cluster, as in TensorFlow) and checkpoints: it
    // evaluates them as the chief writes them (every 200 steps), the last the final one.
    let dir = common::tmpdir("trainer-evaluator");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let tasks = [
        ("worker", 1),
        ("ps", 0),
        ("evaluator", 0),
        ("worker", 0),
        ("worker", 2),
    ];
    let program = [&t[..], "--steps", "400", "--checkpoint_dir", c];
    let args = common::tf_config_processes(cluster, &tasks, &program);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = mpirun(&refs);
    assert_eq!(out.code, 0, "evaluator: {out:?}");
    let chief: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("accuracy "))
        .collect();
    assert_eq!(chief.len(), 1, "{}", out.stdout);
    let last = (out.stdout.lines())
        .filter_map(|l| l.strip_prefix("evaluated ckpt-"))
        .next_back()
        .unwrap_or_else(|| panic!("no evaluation: {out:?}"));
    assert!(last.starts_with("400: accuracy "), "{}", out.stdout);
}

#[test]
fn a_task_missing_from_the_job_is_the_same_one_line_error_on_every_rank() {
    // The flags name three workers but the job has two worker processes.
    let t = trainer();
    let hosts =
        "--ps_hosts=localhost:23300 --worker_hosts=localhost:23301,localhost:23302,localhost:23303";
    let mut args: Vec<String> = Vec::new();
    for (i, (job, index)) in [("ps", 0), ("worker", 0), ("worker", 1)].iter().enumerate() {
        if i > 0 {
            args.push(":".into());
        }
        args.extend(["-np".into(), "1".into(), t.clone()]);
        args.extend(hosts.split(' ').map(String::from));
        args.extend([format!("--job_name={job}"), format!("--task_index={index}")]);
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = mpirun(&refs);
    assert_ne!(out.code, 0, "{out:?}");
    let lines: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.starts_with("trainer:"))
        .collect();
    // Every rank reaches the same verdict, but mpirun ends the job as soon as the first
    // rank exits non-zero, so 1 to 3 of the lines get printed.
    assert!(
        (1..=3).contains(&lines.len()),
        "one line per rank at most: {}",
        out.stderr
    );
    for l in lines {
        assert!(
            l.contains("task worker:2 of the cluster has no process"),
            "{l}"
        );
        assert!(!l.contains("panicked"), "{l}");
    }
}

#[test]
fn the_allreduce_example_trains_its_own_model() {
    let out = mpirun(&["-np", "3", &example("allreduce"), "--steps", "600"]);
    assert_trained(&out, "allreduce example");
    assert!(
        out.stdout
            .contains("example-cnn: input 8x8x1, conv 3x3x8/1 pad 1"),
        "its own model: {}",
        out.stdout
    );
}

/// The same program with `--stages 2` (`Server::stages`: every task takes part, each
/// replica task drives its stage's session with the same loop): 2 replicas of 2 stages
/// train on the same global batches as 2 plain replicas, so they end where those do.
#[test]
fn the_allreduce_example_drives_pipeline_stages_with_the_same_loop() {
    let plain = mpirun(&["-np", "2", &example("allreduce"), "--steps", "400"]);
    let staged = [
        "-np",
        "4",
        &example("allreduce"),
        "--steps",
        "400",
        "--stages",
        "2",
    ];
    let staged = mpirun(&staged);
    let runs = [(&plain, "2 replicas"), (&staged, "2 replicas of 2 stages")];
    assert_same_training(runs, "# pipeline: 2 replicas x 2 stages", 0.01);
}
