//! Model parallelism under real `mpirun` (`train --stages`): replicas of S stages equal
//! local training of the same global batch, by both schedules; a rank started with other
//! pipeline settings stops every rank with one line naming it.

mod common;

use common::{accuracy, max_relative_difference, mpiflow, mpirun, tmpdir};

#[test]
fn replicas_of_stages_equal_local_training_under_mpirun() {
    let dir = tmpdir("pipeline-equal");
    // The CNN with SGD (see mpirun_models.rs: Adam turns summation-order rounding into
    // visible differences); the MLP with the default Adam.
    let cnn = ["--model", "cnn", "--optimizer", "sgd", "--lr", "0.05"];
    let mlp = ["--model", "mlp", "--hidden", "64,32"];
    for (name, model, runs) in [
        (
            "cnn",
            &cnn[..],
            // (ranks, --ps, --stages, --micro-batches, --schedule, --towers); with ps
            // tasks by --mode ps (the ps tasks hold each stage's variables).
            &[
                ("4", "0", "2", "4", "1f1b", "1"),
                ("5", "1", "2", "3", "gpipe", "1"),
                ("2", "0", "2", "2", "1f1b", "3"),
            ][..],
        ),
        (
            "mlp",
            &mlp[..],
            &[
                ("3", "0", "3", "4", "1f1b", "1"),
                ("4", "0", "2", "2", "gpipe", "1"),
                ("5", "2", "3", "2", "1f1b", "1"),
            ][..],
        ),
    ] {
        let local = dir.join(format!("{name}-local.bin"));
        common::train_local_reference("40", &local, model);
        for (np, ps, stages, micro, schedule, towers) in runs {
            let out = dir.join(format!("{name}-{np}-{stages}-{towers}.bin"));
            let mode = if *ps == "0" { "allreduce" } else { "ps" };
            let mut args = vec!["-np", np, mpiflow(), "train", "--mode", mode];
            args.extend_from_slice(&["--ps", ps, "--stages", stages, "--steps", "40"]);
            args.extend_from_slice(&["--micro-batches", micro, "--schedule", schedule]);
            args.extend_from_slice(&["--towers", towers]);
            args.extend_from_slice(model);
            args.extend_from_slice(&["--log-every", "20", "--check-every", "10"]);
            args.extend_from_slice(&["--save-params", out.to_str().unwrap()]);
            let run = mpirun(&args);
            let case = format!(
                "{name} -np {np} --ps {ps} --stages {stages} M={micro} {schedule} K={towers}"
            );
            assert_eq!(run.code, 0, "{case}: {run:?}");
            // The partition, two logged steps, the memory per stage, the accuracy: once.
            for prefix in ["# pipeline: ", "step ", "# memory per task: ", "accuracy "] {
                let n = run.stdout.lines().filter(|l| l.starts_with(prefix)).count();
                let want = if prefix == "step " { 2 } else { 1 };
                assert_eq!(n, want, "{case}: {prefix:?}\n{}", run.stdout);
            }
            assert!(accuracy(&run.stdout) > 0.5, "{case}\n{}", run.stdout);
            let worst = max_relative_difference(&local, &out);
            assert!(worst < 1e-4, "{case}: largest relative difference {worst}");
        }
    }
}

#[test]
fn pipeline_settings_that_differ_or_cannot_run_stop_the_job_in_one_line() {
    let m = mpiflow();
    // Rank 2 with other micro-batches: the flags are compared before anything else.
    let cmd = format!(
        "-np 2 {m} train --mode allreduce --stages 2 --steps 5 : -np 2 {m} train --mode allreduce --stages 2 --steps 5 --micro-batches 2"
    );
    let run = mpirun(&cmd.split(' ').collect::<Vec<_>>());
    run.assert_one_line_error(
        "rank 2 was started with --micro-batches=2 but rank 0 with --micro-batches=4: all ranks must get the same flags",
    );
    // More micro-batches than a replica's share; more stages than layers.
    let train = |extra: &str| {
        let cmd = format!("-np 4 {m} train --mode allreduce {extra}");
        mpirun(&cmd.split(' ').collect::<Vec<_>>())
    };
    let run = train("--stages 2 --batch 8 --micro-batches 5");
    run.assert_one_line_error(
        "--micro-batches 5: each of the 2 replicas' share of batch 8 is 4 samples; take 1 to 4 micro-batches",
    );
    // With a ps task: it hears of the error and stops too (no hang), without a line of
    // its own (the replica tasks agreed on the error and print it).
    let cmd = format!("-np 3 {m} train --mode ps --ps 1 --stages 2 --batch 8 --micro-batches 9");
    let run = mpirun(&cmd.split(' ').collect::<Vec<_>>());
    run.assert_one_line_error(
        "--micro-batches 9: each of the 1 replicas' share of batch 8 is 8 samples; take 1 to 8 micro-batches",
    );
    let run = train("--stages 4");
    run.assert_one_line_error("--stages 4: the model has 3 layers, fewer than the stages");
}

#[test]
fn a_killed_stage_ends_the_job_and_a_rerun_resumes_from_the_stage_shards() {
    let dir = tmpdir("pipeline-kill");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let m = mpiflow();
    let train = |steps: &'static str| {
        vec![
            "-np",
            "4",
            m,
            "train",
            "--mode",
            "allreduce",
            "--stages",
            "2",
            "--steps",
            steps,
            "--checkpoint-every",
            "200",
            "--log-every",
            "0",
            "--checkpoint-dir",
            c,
        ]
    };
    // SIGKILL the last rank (a stage of replica 1) once a checkpoint is committed.
    let marker = ckpt.join("ckpt-200").join("manifest.json");
    let mut killed = None;
    let (text, code) = common::with_rank_when(
        &train("1000000"),
        None,
        |_| marker.exists(),
        |pid, _| {
            killed = Some(std::time::Instant::now());
            common::signal(pid, "-KILL")
        },
    );
    assert_ne!(code, Some(0), "{text}");
    // Every other rank stops within 30 s of the kill.
    let secs = killed.expect("killed").elapsed().as_secs_f64();
    assert!(secs < 30.0, "the job ended {secs} s after the kill: {text}");
    // The job's map names the task of the rank mpirun reports dead.
    assert!(text.contains("3=replica_1:1"), "{text}");
    let newest: u64 = std::fs::read_dir(&ckpt)
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("ckpt-")?.parse::<u64>().ok()?;
            e.path().join("manifest.json").exists().then_some(step)
        })
        .max()
        .unwrap();
    // Rerun: every task restores its stage from the newest committed checkpoint.
    let end = (newest + 200).to_string();
    let end: &'static str = Box::leak(end.into_boxed_str());
    let run = mpirun(&train(end));
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout
            .contains(&format!("ckpt-{newest} (global step {newest})")),
        "{}",
        run.stdout
    );
    assert!(accuracy(&run.stdout) > 0.9, "{}", run.stdout);
}

#[test]
fn a_model_larger_than_a_task_trains_with_enough_stages() {
    let m = mpiflow();
    // 64-256-256-10: layers of 66,560, 263,168 and 10,280 parameter bytes, 340,008 in all.
    let model = "--hidden 256,256 --max-param-bytes 270000";
    let train = |np: &str, extra: &str| {
        let cmd = format!("-np {np} {m} train {model} --steps 300 --log-every 100 {extra}");
        mpirun(&cmd.split(' ').collect::<Vec<_>>())
    };
    // Whole, it fits no task: the error names the stages it takes.
    let run = train("2", "--mode allreduce");
    run.assert_one_line_error(
        "the model holds 340008 parameter bytes, more than --max-param-bytes 270000: split it into stages (--mode allreduce --stages 3 or more)",
    );
    let run = train("2", "--mode allreduce --stages 2");
    run.assert_one_line_error(
        "--stages 2: no split keeps each stage's parameters within --max-param-bytes 270000 (the model's 340008 bytes take at least 3 stages)",
    );
    // In three stages each holds at most the limit, and it learns.
    let run = train("3", "--mode allreduce --stages 3");
    assert_eq!(run.code, 0, "{run:?}");
    let memory = run
        .stdout
        .lines()
        .find(|l| l.starts_with("# memory per task: "))
        .unwrap_or_else(|| panic!("{}", run.stdout));
    let held: Vec<u64> = memory
        .split("parameters ")
        .skip(1)
        .map(|s| s.split(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(held.len(), 3, "{memory}");
    assert!(held.iter().all(|b| *b <= 270_000), "{memory}");
    assert_eq!(held.iter().sum::<u64>(), 340_008, "{memory}");
    assert!(accuracy(&run.stdout) > 0.9, "{}", run.stdout);
}

#[test]
fn the_timeline_shows_every_stage_pass_of_every_micro_batch() {
    let dir = tmpdir("pipeline-timeline");
    let trace = dir.join("trace.json");
    let args = "-np 4 {m} train --mode allreduce --stages 2 --steps 5 --micro-batches 3 --timeline";
    let mut args: Vec<&str> = args.split(' ').collect();
    args[2] = mpiflow();
    args.push(trace.to_str().unwrap());
    let run = mpirun(&args);
    assert_eq!(run.code, 0, "{run:?}");
    let text = std::fs::read_to_string(&trace).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = v["traceEvents"].as_array().or(v.as_array()).unwrap();
    // 4 ranks x 5 steps x 3 micro-batches, each forward and backward once.
    for pass in ["forward", "backward"] {
        let n = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["name"] == pass)
            .count();
        assert_eq!(n, 4 * 5 * 3, "{pass} spans");
    }
    // Stage 1 of each replica waits for activations, stage 0 for gradients.
    for wait in ["wait for activations", "wait for gradients"] {
        let n = events.iter().filter(|e| e["name"] == wait).count();
        assert_eq!(n, 2 * 5 * 3, "{wait} spans");
    }
}
