//! Training that goes wrong, under real `mpirun`: a non-finite loss or gradient stops
//! every mode with one line naming the step and the tensor, and the newest checkpoint stays
//! the last good one (a rerun with a sane learning rate resumes from it).

mod common;

use common::{mpiflow, mpiflow_alone, mpirun, tmpdir};

/// The checkpoint steps in `dir` (`ckpt-N` directories), ascending.
fn checkpoint_steps(dir: &std::path::Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| {
                e.ok()?
                    .file_name()
                    .to_str()?
                    .strip_prefix("ckpt-")?
                    .parse()
                    .ok()
            })
            .collect()
        })
        .unwrap_or_default();
    steps.sort();
    steps
}

/// The step named by a non-finite stop (`... at step S ...`).
fn stopped_at(stderr: &str) -> u64 {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("mpiflow:") && l.contains("training stopped before applying"))
        .unwrap_or_else(|| panic!("no non-finite stop in {stderr}"));
    let after = line.split(" at step ").nth(1).unwrap();
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().unwrap()
}

fn run_mode(np: Option<&str>, mode: &[&str], rest: &[&str]) -> common::Run {
    let Some(np) = np else {
        let mut args = vec!["train"];
        args.extend_from_slice(rest);
        return mpiflow_alone(&args, &[]);
    };
    let mut args = vec!["-np", np, mpiflow(), "train"];
    args.extend_from_slice(mode);
    args.extend_from_slice(rest);
    mpirun(&args)
}

#[test]
fn a_non_finite_loss_stops_every_mode_and_the_last_good_checkpoint_stays_newest() {
    let modes: [(&str, Option<&str>, &[&str]); 5] = [
        ("local", None, &[]),
        ("allreduce", Some("2"), &["--mode", "allreduce"]),
        ("ps", Some("3"), &["--mode", "ps", "--ps", "1"]),
        (
            "ps-async",
            Some("3"),
            &["--mode", "ps", "--ps", "1", "--async"],
        ),
        (
            "ps-rma",
            Some("3"),
            &["--mode", "ps", "--ps", "1", "--transport", "rma"],
        ),
    ];
    for (name, np, mode) in modes {
        let dir = tmpdir(&format!("nonfinite-{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        let c = dir.to_str().unwrap();
        let good = run_mode(np, mode, &["--steps", "20", "--checkpoint-dir", c]);
        assert_eq!(good.code, 0, "{name}: {good:?}");
        // Asynchronous workers may push past the last step together: 20 or a few more.
        let saved = checkpoint_steps(&dir);
        assert!(saved.len() == 1 && saved[0] >= 20, "{name}: {saved:?}");
        let first = saved[0];

        // A learning rate that blows up within a step or two of the restored state.
        let bad = run_mode(
            np,
            mode,
            &["--steps", "60", "--lr", "1e30", "--checkpoint-dir", c],
        );
        assert_ne!(bad.code, 0, "{name}: {bad:?}");
        assert!(!bad.stderr.contains("panicked"), "{name}: {bad:?}");
        let step = stopped_at(&bad.stderr);
        assert!((first..60).contains(&step), "{name}: step {step}: {bad:?}");
        assert!(
            bad.stderr.contains("the loss is") || bad.stderr.contains("gradient '"),
            "{name}: {bad:?}"
        );
        // One verdict: one line, counting the replicas or workers (2 of either here) that
        // saw the value; the asynchronous ps names the worker whose finding came first.
        if name != "local" {
            let lines: Vec<&str> = (bad.stderr.lines())
                .filter(|l| l.starts_with("mpiflow: error:"))
                .collect();
            assert_eq!(lines.len(), 1, "{name}: {bad:?}");
            let whose = match name {
                "ps-async" => " on worker:",
                _ if lines[0].contains(" replicas:") => " of 2 replicas:",
                _ => " of 2 workers:",
            };
            assert!(lines[0].contains(whose), "{name}: {bad:?}");
        }
        assert_eq!(checkpoint_steps(&dir), [first], "{name}: {bad:?}");

        // A sane rerun resumes from the last good checkpoint and finishes.
        let again = run_mode(np, mode, &["--steps", "40", "--checkpoint-dir", c]);
        assert_eq!(again.code, 0, "{name}: {again:?}");
        let resumed = format!("ckpt-{first} (global step {first})");
        assert!(again.stdout.contains(&resumed), "{name}: {again:?}");
        assert!(
            checkpoint_steps(&dir).last() >= Some(&40),
            "{name}: {again:?}"
        );
    }
    // Rank 0 an idle ps task (allreduce leaves it out): the chief still says it, once.
    let ps_first = ["--mode", "allreduce", "--ps", "1"];
    let bad = run_mode(Some("3"), &ps_first, &["--steps", "20", "--lr", "1e30"]);
    bad.assert_one_line_error(" of 2 replicas: training stopped before applying it");
    // The one-sided asynchronous ps (no checkpoints): four workers that each find the NaN
    // on their own, one line (it was a line from each finder, 3-4 here).
    let rma_async = ["--mode", "ps", "--ps", "1", "--transport", "rma", "--async"];
    let rest = ["--steps", "20", "--lr", "1e30", "--optimizer", "sgd"];
    let bad = run_mode(Some("5"), &rma_async, &rest);
    bad.assert_one_line_error("the loss is NaN at step");
}

#[test]
fn a_model_too_large_for_the_node_is_one_line_before_anything_is_allocated() {
    // 64 x 10^8 weights: 25.6 GB for the first layer alone, against this machine's memory.
    let run = mpiflow_alone(&["train", "--hidden", "100000000", "--steps", "1"], &[]);
    run.assert_one_line_error("training needs at least 273.6 GB (parameters 30.0 GB");
    assert!(run.stderr.contains("available on this node"), "{run:?}");
    for (np, mode, want) in [
        (
            "2",
            &["--mode", "allreduce"][..],
            "rank 0: worker:0 needs at least",
        ),
        (
            "3",
            &["--mode", "ps", "--ps", "1"][..],
            "rank 0: ps:0 needs at least",
        ),
    ] {
        let mut args = vec!["-np", np, mpiflow(), "train"];
        args.extend_from_slice(mode);
        args.extend_from_slice(&["--hidden", "100000000", "--steps", "1"]);
        let run = mpirun(&args);
        run.assert_one_line_error(want);
        assert!(run.stderr.contains("but may use"), "{run:?}");
    }
}

/// Starts `cmd` (under `timeout`), waits until `dir` holds a checkpoint, sends `signal` to
/// the first process `pgrep PATTERN...` finds, and returns the exit status and output.
fn signal_when_checkpointed(
    cmd: &[&str],
    dir: &std::path::Path,
    signal: &str,
    pattern: &[&str],
) -> (Option<i32>, String, String) {
    use std::process::{Command, Stdio};
    let _guard = common::lock();
    let child = common::bounded(120)
        .args(cmd)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while checkpoint_steps(dir).is_empty() && t.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let pids = Command::new("pgrep").args(pattern).output().unwrap().stdout;
    let pids = String::from_utf8(pids).unwrap();
    let pid = pids
        .split_whitespace()
        .next()
        .expect("no process to signal");
    assert!(Command::new("kill")
        .args([signal, pid])
        .status()
        .unwrap()
        .success());
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The step of `mpiflow: stopped by ... at step S, ...`.
fn stop_step(stderr: &str) -> u64 {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("mpiflow: stopped by "))
        .unwrap_or_else(|| panic!("no stop line in {stderr}"));
    common::step_of_stop(line).unwrap_or_else(|| panic!("no step in {line}"))
}

/// A name, the job's start and mode flags, the signal, the `pgrep` arguments of what to
/// signal, and how the stop line names the signal.
type Case<'a> = (
    &'a str,
    &'a [&'a str],
    &'a [&'a str],
    &'a str,
    &'a [&'a str],
    &'a str,
);

#[test]
fn a_signal_stops_training_at_a_step_boundary_and_a_rerun_resumes_there() {
    let m = mpiflow();
    let mpirun2 = ["mpirun", "--oversubscribe", "-np", "2", m];
    let mpirun3 = ["mpirun", "--oversubscribe", "-np", "3", m];
    let mpirun4 = ["mpirun", "--oversubscribe", "-np", "4", m];
    let stages = ["--mode", "allreduce", "--stages", "2"];
    let mpirun5 = ["mpirun", "--oversubscribe", "-np", "5", m];
    let ps_stages = ["--mode", "ps", "--ps", "1", "--stages", "2"];
    // Where the job's command starts, and what to signal: mpirun itself (which passes
    // SIGUSR1 on to every rank), or one rank only (a ps task, or a worker: the newest
    // process).
    let ps = ["--mode", "ps", "--ps", "1"];
    let cases: [Case; 10] = [
        (
            "local",
            &[m],
            &[],
            "-USR1",
            &["-f", "^[^ ]*mpiflow train --steps"],
            "SIGUSR1",
        ),
        (
            "allreduce-mpirun",
            &mpirun2,
            &["--mode", "allreduce"],
            "-USR1",
            &["-f", "^mpirun "],
            "SIGUSR1",
        ),
        (
            "allreduce-one-rank",
            &mpirun2,
            &["--mode", "allreduce"],
            "-TERM",
            &["-n", "-f", "^[^ ]*mpiflow train --mode allreduce"],
            "SIGTERM",
        ),
        (
            "ps-sync-ps-rank",
            &mpirun3,
            &ps,
            "-TERM",
            &["-o", "-f", "^[^ ]*mpiflow train --mode ps"],
            "SIGTERM",
        ),
        (
            "ps-async-mpirun",
            &mpirun3,
            &["--mode", "ps", "--ps", "1", "--async"],
            "-USR1",
            &["-f", "^mpirun "],
            "SIGUSR1",
        ),
        (
            "ps-rma-worker",
            &mpirun3,
            &["--mode", "ps", "--ps", "1", "--transport", "rma"],
            "-INT",
            &["-n", "-f", "^[^ ]*mpiflow train --mode ps"],
            "SIGINT",
        ),
        (
            "pipeline-mpirun",
            &mpirun4,
            &stages,
            "-USR1",
            &["-f", "^mpirun "],
            "SIGUSR1",
        ),
        (
            "pipeline-one-stage",
            &mpirun4,
            &stages,
            "-TERM",
            &["-n", "-f", "^[^ ]*mpiflow train --mode allreduce --stages"],
            "SIGTERM",
        ),
        (
            "pipeline-ps-ps-rank",
            &mpirun5,
            &ps_stages,
            "-TERM",
            &["-o", "-f", "^[^ ]*mpiflow train --mode ps --ps 1 --stages"],
            "SIGTERM",
        ),
        (
            "pipeline-ps-one-stage",
            &mpirun5,
            &ps_stages,
            "-USR1",
            &["-n", "-f", "^[^ ]*mpiflow train --mode ps --ps 1 --stages"],
            "SIGUSR1",
        ),
    ];
    for (name, start, mode, signal, pattern, said) in cases {
        let dir = tmpdir(&format!("signal-{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        let c = dir.to_str().unwrap();
        let command = |steps: &str| -> Vec<String> {
            let mut v: Vec<&str> = start.to_vec();
            v.push("train");
            v.extend_from_slice(mode);
            v.extend_from_slice(&["--steps", steps, "--checkpoint-every", "50"]);
            v.extend_from_slice(&["--log-every", "0", "--checkpoint-dir", c]);
            v.into_iter().map(String::from).collect()
        };
        let long = command("1000000");
        let long: Vec<&str> = long.iter().map(String::as_str).collect();
        // Only this job's processes (other tests run mpiflow at the same time): the
        // pattern ends with this case's own checkpoint directory.
        let mut pattern: Vec<String> = pattern.iter().map(|p| p.to_string()).collect();
        let last = pattern.last_mut().expect("a pattern");
        last.push_str(&format!(".*--checkpoint-dir {c}$"));
        let pattern: Vec<&str> = pattern.iter().map(String::as_str).collect();
        let (code, stdout, stderr) = signal_when_checkpointed(&long, &dir, signal, &pattern);
        assert_eq!(code, Some(75), "{name}: {stdout}\n{stderr}");
        let lines: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("mpiflow:"))
            .collect();
        assert_eq!(lines.len(), 1, "{name}: {stderr}");
        assert!(
            lines[0].contains(&format!("stopped by {said} at step ")),
            "{name}: {stderr}"
        );
        let step = stop_step(&stderr);
        assert_eq!(
            checkpoint_steps(&dir).last(),
            Some(&step),
            "{name}: {stderr}"
        );
        // Written at the stop, or by the periodic checkpoint of that very step.
        assert!(
            stdout.contains(&format!("ckpt-{step} written")),
            "{name}: {stdout}"
        );
        assert!(
            lines[0].contains(&format!("checkpoint {c}/ckpt-{step}:")),
            "{name}: {stderr}"
        );

        // The same command with a nearer end resumes at the step it stopped at.
        let again = command(&(step + 20).to_string());
        let again: Vec<&str> = again.iter().map(String::as_str).collect();
        let again = if start.len() == 1 {
            mpiflow_alone(&again[1..], &[])
        } else {
            mpirun(&again[2..])
        };
        assert_eq!(again.code, 0, "{name}: {again:?}");
        assert!(
            again
                .stdout
                .contains(&format!("ckpt-{step} (global step {step})")),
            "{name}: {again:?}"
        );
    }
}

/// A small tmpfs mounted for one test, unmounted when dropped (also when the test fails).
struct SmallDisk(common::TempDir);

impl SmallDisk {
    /// A tmpfs of `size` (`mount -o size=`) at a fresh directory; `None` (the test is
    /// skipped) when this is not root.
    fn mount(name: &str, size: &str) -> Option<SmallDisk> {
        if !common::as_root("mounting a small tmpfs") {
            return None;
        }
        let dir = tmpdir(name);
        let opts = format!("size={size}");
        let run = common::run_bounded(
            30,
            &["mount", "-t", "tmpfs", "-o", &opts, "tmpfs", dir.to_str()?],
            &[],
        );
        assert_eq!(run.code, 0, "mount: {run:?}");
        Some(SmallDisk(dir))
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = common::run_bounded(30, &["umount", self.0.to_str().unwrap()], &[]);
    }
}

/// A disk too small for the next checkpoint: one line names the step not written, the
/// disk's error and the newest checkpoint, which stays valid (a rerun resumes from it);
/// what the failed checkpoint had written is removed; the job ends non-zero, every mode.
#[test]
fn a_checkpoint_that_does_not_fit_keeps_the_previous_one_and_ends_the_run() {
    let modes: [(&str, Option<&str>, &[&str]); 4] = [
        ("local", None, &[]),
        ("allreduce", Some("2"), &["--mode", "allreduce"]),
        ("ps", Some("3"), &["--mode", "ps", "--ps", "1"]),
        (
            "rma",
            Some("3"),
            &["--mode", "ps", "--ps", "1", "--transport", "rma"],
        ),
    ];
    for (name, np, mode) in modes {
        // One checkpoint of the digits MLP (parameters and Adam state) takes ~120 KB.
        let Some(disk) = SmallDisk::mount(&format!("ckfull-{name}"), "200k") else {
            return;
        };
        let dir = disk.0.join("ck");
        let d = dir.to_str().unwrap();
        let rest = ["--steps", "3000", "--checkpoint-every", "500"];
        let rest: Vec<&str> = rest
            .iter()
            .copied()
            .chain(["--log-every", "0", "--checkpoint-dir", d])
            .collect();
        let run = run_mode(np, mode, &rest);
        assert!(run.code != 0 && run.code != 75, "{name}: {run:?}");
        let lines: Vec<&str> = run
            .stderr
            .lines()
            .filter(|l| l.starts_with("mpiflow: error: "))
            .collect();
        let chief = lines
            .iter()
            .find(|l| l.contains("checkpoint of step 1000 not written ("))
            .unwrap_or_else(|| panic!("{name}: {run:?}"));
        assert!(chief.contains("No space left on device"), "{name}: {chief}");
        assert!(
            chief.ends_with(&format!("; the newest checkpoint is still {d}/ckpt-500")),
            "{name}: {chief}"
        );
        if name != "ps" {
            // (ps: the ps tasks and the other workers also say why they stop.)
            assert_eq!(lines.len(), 1, "{name}: {run:?}");
        }
        let left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, ["ckpt-500"], "{name}: staging left behind");

        // The kept checkpoint, on a disk with room: a rerun resumes from it.
        let roomy = tmpdir(&format!("ckroom-{name}"));
        let copy = common::run_bounded(
            30,
            &[
                "cp",
                "-r",
                &format!("{d}/ckpt-500"),
                roomy.to_str().unwrap(),
            ],
            &[],
        );
        assert_eq!(copy.code, 0, "{copy:?}");
        drop(disk);
        let r = roomy.to_str().unwrap();
        let again = run_mode(
            np,
            mode,
            &["--steps", "600", "--log-every", "0", "--checkpoint-dir", r],
        );
        assert_eq!(again.code, 0, "{name}: {again:?}");
        assert!(
            again
                .stdout
                .contains(&format!("restored {r}/ckpt-500 (global step 500)")),
            "{name}: {again:?}"
        );
    }
}
