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
    line.split(" at step ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no step in {line}"))
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
