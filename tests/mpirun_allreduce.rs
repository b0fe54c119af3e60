//! Allreduce training under real `mpirun`: equality with local training at 2, 3 and 4
//! replicas, accuracy at 4 ranks, and resume after SIGKILL with the same final parameters.

mod common;

use common::{accuracy, kill_one_rank_when, max_relative_difference, mpiflow, mpirun, tmpdir};

#[test]
fn n_replicas_equal_local_training_on_the_global_batch() {
    let dir = tmpdir("ar-equal");
    let local = dir.join("local.bin");
    common::train_local_reference("80", &local, &[]);
    // (ranks, overlap, one allreduce per tensor by the ring instead of the fused default)
    for (np, overlap, one_by_one) in [
        ("2", false, false),
        ("3", false, false),
        ("4", false, false),
        ("2", true, false),
        ("3", true, false),
        ("3", false, true),
    ] {
        let out = dir.join(format!("ar{np}-{overlap}-{one_by_one}.bin"));
        let mut args = vec![
            "-np",
            np,
            mpiflow(),
            "train",
            "--mode",
            "allreduce",
            "--steps",
            "80",
            "--check-every",
            "10",
        ];
        if overlap {
            // Layer buckets reduced on a communication thread (MPI_THREAD_MULTIPLE).
            args.push("--overlap");
        }
        if one_by_one {
            args.extend(["--fusion-threshold", "1", "--allreduce-algorithm", "ring"]);
        }
        args.extend(["--save-params", out.to_str().unwrap()]);
        let run = mpirun(&args);
        assert_eq!(run.code, 0, "{run:?}");
        assert!(!run.stderr.contains("warning"), "{}", run.stderr);
        // The chief says what a step's reduction took: 2 layers' weights and biases, and the
        // step's verdict (in the fused buffer, or on its own).
        let said = match (overlap, one_by_one) {
            (true, _) => "allreduce calls per step: 3 (one per layer, overlapped, algorithm auto",
            (_, true) => "allreduce calls per step: 5 (fused up to 1 bytes, algorithm ring",
            _ => "allreduce calls per step: 1 (fused up to 67108864 bytes, algorithm auto",
        };
        assert!(run.stdout.contains(said), "{said}: {}", run.stdout);
        // Float32 sums in another grouping (per replica, then across): rounding only.
        let worst = max_relative_difference(&local, &out);
        assert!(
            worst < 1e-4,
            "{np} replicas (overlap {overlap}, one by one {one_by_one}): largest relative \
             difference {worst}"
        );
    }
}

#[test]
fn digits_reach_95_percent_at_4_ranks_and_ps_tasks_are_left_out() {
    let run = mpirun(&["-np", "4", mpiflow(), "train", "--mode", "allreduce"]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(accuracy(&run.stdout) >= 0.95, "{}", run.stdout);
    let run = mpirun(&[
        "-np",
        "3",
        mpiflow(),
        "train",
        "--mode",
        "allreduce",
        "--ps",
        "1",
        "--steps",
        "200",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout
            .contains("ps:0 (rank 0): not a replica in allreduce mode"),
        "{}",
        run.stdout
    );
}

#[test]
fn resume_after_sigkill_gives_the_same_final_parameters() {
    let dir = tmpdir("ar-resume");
    let args = |ckpt: &std::path::Path, out: &std::path::Path| -> Vec<String> {
        [
            "-np",
            "3",
            mpiflow(),
            "train",
            "--mode",
            "allreduce",
            "--steps",
            "3000",
            "--checkpoint-every",
            "200",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
            "--save-params",
            out.to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let (whole, whole_out) = (dir.join("whole"), dir.join("whole.bin"));
    let a = args(&whole, &whole_out);
    let run = mpirun(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(run.code, 0, "{run:?}");
    let (killed, killed_out) = (dir.join("killed"), dir.join("killed.bin"));
    let b = args(&killed, &killed_out);
    let b_args: Vec<&str> = b.iter().map(String::as_str).collect();
    assert!(
        !kill_one_rank_when(&b_args, &killed.join("ckpt-400")),
        "the killed job must fail"
    );
    let resumed = mpirun(&b_args);
    assert_eq!(resumed.code, 0, "{resumed:?}");
    assert!(resumed.stdout.contains("# restored "), "{}", resumed.stdout);
    assert_eq!(
        max_relative_difference(&whole_out, &killed_out),
        0.0,
        "bit-identical after resume"
    );
}

#[test]
fn a_dead_rank_stops_the_others_within_30_seconds_and_is_named() {
    let (text, secs, ok) = common::kill_rank_after_start(
        &[
            "-np",
            "3",
            mpiflow(),
            "train",
            "--mode",
            "allreduce",
            "--steps",
            "1000000",
            "--log-every",
            "1000",
        ],
        1,
    );
    assert!(secs < 30.0, "took {secs} s");
    assert!(!ok);
    // mpirun names the rank; mpiflow's rank map names its task.
    assert!(text.contains("process rank 1 "), "{text}");
    assert!(
        text.contains("# ranks: 0=worker:0 1=worker:1 2=worker:2"),
        "{text}"
    );
}

#[test]
fn a_replica_that_diverges_stops_every_rank_naming_it() {
    let run = mpirun(&[
        "-np",
        "3",
        mpiflow(),
        "train",
        "--mode",
        "allreduce",
        "--steps",
        "100",
        "--check-every",
        "5",
        "--perturb-rank",
        "2",
    ]);
    assert_ne!(run.code, 0, "{run:?}");
    assert!(
        run.stderr.contains(
            "mpiflow: error: replicas diverged at step 5: rank 2's parameters differ from rank 0's"
        ),
        "{}",
        run.stderr
    );
    assert!(!run.stdout.contains("accuracy"), "training must not finish");
}
