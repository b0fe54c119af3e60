//! One checkpoint format for every mode, under real `mpirun`: a run checkpointed locally,
//! continued by the ps (two ps tasks, variables partitioned), and finished by allreduce
//! ends with the parameters of one uninterrupted local run; a checkpoint of another model
//! is refused in every mode with one line naming both sides.

mod common;

use common::{max_relative_difference, mpiflow, mpiflow_alone, mpirun, tmpdir};
use mpiflow::observe::metrics::{read, Record};

#[test]
fn a_run_moves_between_modes_through_its_checkpoints_and_equals_local_training() {
    let dir = tmpdir("ckpt-modes");
    let ckpt = dir.join("ckpt");
    let _ = std::fs::remove_dir_all(&ckpt);
    let c = ckpt.to_str().unwrap();
    let straight = dir.join("straight.bin");
    common::train_local_reference("80", &straight, &[]);

    // Steps 0-40 in one process.
    let run = mpiflow_alone(&["train", "--steps", "40", "--checkpoint-dir", c], &[]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("ckpt-40 written"), "{}", run.stdout);

    // Steps 40-60 by two ps tasks holding slices: restored from the local checkpoint.
    let run = mpirun(&[
        "-np",
        "5",
        mpiflow(),
        "train",
        "--mode",
        "ps",
        "--ps",
        "2",
        "--var-placement",
        "partition",
        "--partition-bytes",
        "4096",
        "--steps",
        "60",
        "--checkpoint-dir",
        c,
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.contains("ckpt-40 (global step 40)") && run.stdout.contains("ckpt-60 written"),
        "{}",
        run.stdout
    );

    // Steps 60-80 by three replicas: restored from the ps tasks' shard files.
    let out = dir.join("resumed.bin");
    let run = mpirun(&[
        "-np",
        "3",
        mpiflow(),
        "train",
        "--mode",
        "allreduce",
        "--steps",
        "80",
        "--checkpoint-dir",
        c,
        "--save-params",
        out.to_str().unwrap(),
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.contains("ckpt-60 (global step 60)"),
        "{}",
        run.stdout
    );
    // Parameters and Adam's moments and step count all crossed: a lost moment or a reset
    // bias correction moves the parameters by far more than rounding.
    let worst = max_relative_difference(&straight, &out);
    assert!(worst < 1e-4, "largest relative difference {worst}");
}

#[test]
fn a_checkpoint_of_another_model_is_one_line_in_every_mode() {
    let dir = tmpdir("ckpt-other");
    let ckpt = dir.join("ckpt");
    let _ = std::fs::remove_dir_all(&ckpt);
    let c = ckpt.to_str().unwrap();
    let run = mpiflow_alone(
        &[
            "train",
            "--steps",
            "10",
            "--hidden",
            "32",
            "--checkpoint-dir",
            c,
        ],
        &[],
    );
    assert_eq!(run.code, 0, "{run:?}");
    let want = "was written for another model: its variable 0 is layer0/w (2048 elements), \
                this model's is layer0/w (8192 elements)";
    let run = mpiflow_alone(&["train", "--steps", "20", "--checkpoint-dir", c], &[]);
    run.assert_one_line_error(want);
    for mode in [
        "-np 3 train --mode allreduce",
        "-np 3 train --mode ps --ps 1",
        "-np 3 train --mode ps --ps 1 --transport rma",
        "-np 2 train --mode allreduce --stages 2",
        "-np 3 train --mode ps --ps 1 --stages 2",
    ] {
        // mpiflow after the rank count.
        let mut mode: Vec<&str> = mode.split(' ').collect();
        mode.insert(2, mpiflow());
        let mut args = mode.to_vec();
        args.extend_from_slice(&["--steps", "20", "--checkpoint-dir", c]);
        let run = mpirun(&args);
        assert_ne!(run.code, 0, "{mode:?}: {run:?}");
        let lines = run.error_lines();
        assert!(
            !lines.is_empty() && lines.iter().all(|l| l.contains(want)),
            "{mode:?}: {run:?}"
        );
    }
}

#[test]
fn a_checkpoint_directory_that_cannot_hold_checkpoints_is_one_line_before_training() {
    // A file where the directory should be: each rank failed on its own when it first
    // looked (the ps modes printed a line per rank, "stopped by a ps").
    let dir = tmpdir("ckpt-file");
    let file = dir.join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let f = file.to_str().unwrap();
    let want = format!("all ranks: checkpoint directory {f}: is a file, not a directory");
    for mode in [
        "train --mode ps --ps 1",
        "train --mode ps --ps 1 --transport rma",
    ] {
        let mut args = vec!["-np", "3", mpiflow()];
        args.extend(mode.split(' '));
        args.extend_from_slice(&["--steps", "20", "--checkpoint-dir", f]);
        mpirun(&args).assert_one_line_error(&want);
    }
}

/// The evaluator task (TensorFlow's side-car evaluation): in every mode it evaluates the
/// checkpoints the chief commits while the others train, newest first, the last one the
/// final step's, which reads exactly the chief's own final accuracy (the same
/// parameters); a run that stops on an error ends it too (no hang).
#[test]
fn an_evaluator_evaluates_each_new_checkpoint_and_the_last_equals_the_chiefs() {
    let dir = tmpdir("ckpt-evaluator");
    let modes: [&[&str]; 3] = [
        &["--mode", "ps", "--ps", "1"],
        &["--mode", "ps", "--ps", "1", "--transport", "rma"],
        &["--mode", "allreduce"],
    ];
    let metrics = dir.join("run.csv");
    let m = metrics.to_str().unwrap();
    for mode in modes {
        let ckpt = dir.join("ckpt");
        let _ = std::fs::remove_dir_all(&ckpt);
        let c = ckpt.to_str().unwrap();
        let mut args = vec!["-np", "4", mpiflow(), "train", "--evaluator"];
        args.extend_from_slice(mode);
        args.extend_from_slice(&["--steps", "400", "--checkpoint-dir", c]);
        let run = mpirun(&[&args[..], &["--checkpoint-every", "100", "--metrics", m]].concat());
        assert_eq!(run.code, 0, "{mode:?}: {run:?}");
        // `evaluated ckpt-400: accuracy 0.9889 (355/359 held-out samples) at global step 400`
        let evaluated: Vec<(u64, &str)> = (run.stdout.lines())
            .filter_map(|l| l.strip_prefix("evaluated ckpt-"))
            .map(|l| {
                let (step, rest) = l.split_once(": accuracy ").unwrap();
                (step.parse().unwrap(), rest.split(" at ").next().unwrap())
            })
            .collect();
        let steps: Vec<u64> = evaluated.iter().map(|e| e.0).collect();
        assert!(steps.windows(2).all(|w| w[0] < w[1]), "{mode:?}: {run:?}");
        assert_eq!(steps.last(), Some(&400), "{mode:?}: {run:?}");
        assert!(steps.iter().all(|s| s % 100 == 0), "{mode:?}: {run:?}");
        let chief = (run.stdout.lines())
            .find_map(|l| l.strip_prefix("accuracy "))
            .unwrap_or_else(|| panic!("{mode:?}: no final accuracy: {run:?}"));
        assert!(
            chief.starts_with(evaluated.last().unwrap().1),
            "{mode:?}: the chief's {chief:?}, the evaluator's {evaluated:?}"
        );
        // The evaluator's metrics file beside the chief's: an `eval` record per line it
        // printed, the same steps and accuracies.
        let records = read(&dir.join("run.evaluator.csv")).unwrap();
        let evals: Vec<(u64, String)> = (records.iter())
            .map(|r| match r {
                Record::Eval {
                    step,
                    accuracy,
                    correct,
                    total,
                    ..
                } => (*step, format!("{accuracy:.4} ({correct}/{total}")),
                other => panic!("{mode:?}: the evaluator wrote {other:?}"),
            })
            .collect();
        let printed: Vec<(u64, String)> = (evaluated.iter())
            .map(|(s, a)| (*s, a.split(" held-out").next().unwrap().to_string()))
            .collect();
        assert_eq!(evals, printed, "{mode:?}");
        // The chief's own file has its steps and its final evaluation.
        let chiefs = read(&metrics).unwrap();
        assert!(
            chiefs.iter().any(|r| matches!(r, Record::Step { .. })),
            "{mode:?}"
        );
        let last = chiefs.iter().rev().find_map(|r| match r {
            Record::Eval { step, .. } => Some(*step),
            _ => None,
        });
        assert_eq!(last, Some(400), "{mode:?}");
        // An error that ends training (a step not finite) ends the evaluator too.
        std::fs::remove_dir_all(&ckpt).unwrap();
        let bad = mpirun(&[&args[..], &["--lr", "1e30", "--optimizer", "sgd"]].concat());
        assert_ne!(bad.code, 0, "{mode:?}: {bad:?}");
        assert!(bad.stderr.contains("is NaN at step"), "{mode:?}: {bad:?}");
    }
}

/// `train --from tf-config` under mpirun: each process's TF_CONFIG task is matched to its
/// rank (as `Server::start` does), an evaluator outside the cluster (as TensorFlow has
/// it) included.
#[test]
fn train_from_tf_config_binds_each_task_to_its_rank_and_an_evaluator_outside_the_cluster() {
    let dir = tmpdir("ckpt-tf-config");
    let ckpt = dir.join("ckpt");
    let _ = std::fs::remove_dir_all(&ckpt);
    let c = ckpt.to_str().unwrap();
    let cluster = r#""cluster": {"ps": ["localhost:23400"], "worker": ["localhost:23401"]}"#;
    let tasks = [("worker", 0), ("evaluator", 0), ("ps", 0)];
    let train = [mpiflow(), "train", "--mode", "ps", "--from", "tf-config"];
    let program = [&train[..], &["--steps", "100", "--checkpoint-dir", c]].concat();
    let args = common::tf_config_processes(cluster, &tasks, &program);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = mpirun(&refs);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout
            .contains("# ranks: 0=worker:0 1=evaluator:0 2=ps:0"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("evaluated ckpt-100: accuracy "),
        "{}",
        run.stdout
    );
}
