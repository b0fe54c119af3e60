//! Allreduce training under real `mpirun`: equality with local training at 2, 3 and 4
//! replicas, accuracy at 4 ranks, and resume after SIGKILL with the same final parameters.

mod common;

use common::{
    accuracy, kill_one_rank_when, max_relative_difference, mpiflow, mpiflow_alone, mpirun, tmpdir,
};

#[test]
fn n_replicas_equal_local_training_on_the_global_batch() {
    let dir = tmpdir("ar-equal");
    let local = dir.join("local.bin");
    let run = mpiflow_alone(
        &[
            "train",
            "--steps",
            "80",
            "--save-params",
            local.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(run.code, 0, "{run:?}");
    for np in ["2", "3", "4"] {
        let out = dir.join(format!("ar{np}.bin"));
        let run = mpirun(&[
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
            "--save-params",
            out.to_str().unwrap(),
        ]);
        assert_eq!(run.code, 0, "{run:?}");
        // Float32 sums in another grouping (per replica, then across): rounding only.
        let worst = max_relative_difference(&local, &out);
        assert!(
            worst < 1e-4,
            "{np} replicas: largest relative difference {worst}"
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
