//! `mpiflow supervise` over a real `mpirun` job: a rank SIGKILLed mid-run costs a restart
//! from the newest checkpoint, and the job still reaches its last step and its accuracy; a
//! job that fails the same way twice is not restarted again.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{accuracy, lock, mpiflow, tmpdir};

/// The pids of the processes whose command line holds `needle` and whose environment says
/// they are MPI rank `rank`.
fn rank_pids(needle: &str, rank: usize) -> Vec<u32> {
    let out = Command::new("pgrep").args(["-f", needle]).output().unwrap();
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.parse().ok())
        .filter(|pid: &u32| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .map(|env| env.split(|b| *b == 0).any(|kv| kv == want.as_bytes()))
                .unwrap_or(false)
        })
        .collect()
}

#[test]
fn a_killed_rank_costs_one_restart_from_the_newest_checkpoint() {
    let _g = lock();
    let dir = tmpdir("supervise-kill");
    let d = dir.to_str().unwrap();
    let child = common::bounded(240)
        .args([mpiflow(), "supervise", "--max-restarts", "2"])
        .args(["--restart-delay", "0.5", "--"])
        .args(["mpirun", "--oversubscribe", "-np", "2", mpiflow(), "train"])
        .args([
            "--mode",
            "allreduce",
            "--steps",
            "40000",
            "--log-every",
            "1000",
        ])
        .args(["--checkpoint-every", "10000", "--checkpoint-dir", d])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once a checkpoint exists, kill rank 1 of the running job.
    let start = Instant::now();
    let victims = loop {
        let checkpointed = std::fs::read_dir(&dir)
            .map(|mut e| {
                e.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with("ckpt-")))
            })
            .unwrap_or(false);
        let pids = rank_pids(d, 1);
        if checkpointed && !pids.is_empty() {
            break pids;
        }
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "no checkpoint to kill after"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    for pid in victims {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let restarts: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("mpiflow supervise: "))
        .collect();
    assert_eq!(restarts.len(), 1, "{stderr}");
    let line = restarts[0];
    assert!(
        line.contains("; restart 1 of 2, resuming from step "),
        "{line}"
    );
    assert!(line.contains("steps lost"), "{line}");
    // The rerun resumed from the checkpoint the line names, and finished.
    let from: String = line
        .rsplit("resuming from step ")
        .next()
        .unwrap()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    assert!(from.parse::<u64>().unwrap() >= 10000, "{line}");
    assert!(
        stdout.contains(&format!("# restored {d}/ckpt-{from} (global step {from})")),
        "{stdout}"
    );
    assert!(accuracy(&stdout) >= 0.95, "{stdout}");
    let last = mpiflow::train::checkpoint::latest(&dir)
        .0
        .expect("a final checkpoint");
    assert_eq!(last.step, 40000);
}

#[test]
fn a_job_that_fails_twice_at_the_same_checkpoint_is_not_restarted_again() {
    let dir = tmpdir("supervise-same");
    let d = dir.to_str().unwrap();
    // A learning rate that makes the first step's loss NaN: every run stops there.
    let run = common::run_bounded(
        60,
        &[
            mpiflow(),
            "supervise",
            "--max-restarts",
            "5",
            "--restart-delay",
            "0",
            "--",
            mpiflow(),
            "train",
            "--lr",
            "1e30",
            "--steps",
            "50",
            "--checkpoint-dir",
            d,
        ],
        &[],
    );
    assert_eq!(run.code, 1, "{run:?}");
    let said: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.starts_with("mpiflow supervise: "))
        .collect();
    assert_eq!(said.len(), 2, "{}", run.stderr);
    assert!(
        said[0].ends_with("restart 1 of 5, resuming from step 0"),
        "{}",
        said[0]
    );
    assert!(
        said[1].ends_with("it failed twice without passing that checkpoint: not restarting"),
        "{}",
        said[1]
    );

    // No checkpoint directory: refused up front, in one line.
    let run = common::run_bounded(10, &[mpiflow(), "supervise", "--", "true"], &[]);
    run.assert_one_line_error("names no --checkpoint-dir");
    // One that cannot hold checkpoints: refused before the job runs.
    let args = [
        mpiflow(),
        "supervise",
        "--",
        "true",
        "--checkpoint-dir",
        "/etc/hostname",
    ];
    common::run_bounded(10, &args, &[]).assert_one_line_error(
        "supervise: checkpoint directory /etc/hostname: is a file, not a directory",
    );
}
