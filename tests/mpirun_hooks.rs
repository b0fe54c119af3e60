//! The step loop's hooks from the command line, in every mode (local, allreduce, the ps
//! over messages and over windows, pipeline stages): `--eval-every N` evaluates on the held-out
//! samples every N steps (a line and a metrics record each), `--target-accuracy A` stops
//! every rank at the first evaluation that reaches A. Read back from the metrics file.

mod common;

use common::{mpiflow, run_bounded, tmpdir};
use mpiflow::observe::metrics::{self, Record};

/// The evaluations a run recorded: (step, accuracy).
fn evaluations(path: &std::path::Path) -> Vec<(u64, f64)> {
    metrics::read(path)
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            Record::Eval { step, accuracy, .. } => Some((step, accuracy)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_target_accuracy_stops_every_session_mode_at_the_first_evaluation_that_reaches_it() {
    let m = mpiflow();
    let dir = tmpdir("hooks");
    // Each mode's command: local alone, the others under mpirun.
    let modes: [(&str, &str, &[&str]); 5] = [
        ("local", "", &["--mode", "local"]),
        ("allreduce", "2", &["--mode", "allreduce"]),
        ("ps", "3", &["--mode", "ps", "--ps", "1"]),
        (
            "rma",
            "3",
            &["--mode", "ps", "--ps", "1", "--transport", "rma"],
        ),
        ("stages", "4", &["--mode", "allreduce", "--stages", "2"]),
    ];
    let cases = modes.map(|(name, np, flags)| {
        let mut cmd = match np {
            "" => vec![m],
            np => vec!["mpirun", "--oversubscribe", "-np", np, m],
        };
        cmd.push("train");
        cmd.extend_from_slice(flags);
        (name, cmd)
    });
    for (name, start) in cases {
        let file = dir.join(format!("{name}.jsonl"));
        let mut cmd = start;
        cmd.extend_from_slice(&["--steps", "100000", "--log-every", "0"]);
        cmd.extend_from_slice(&["--eval-every", "20", "--target-accuracy", "0.9"]);
        cmd.extend_from_slice(&["--metrics", file.to_str().unwrap()]);
        let _guard = common::lock();
        let run = run_bounded(120, &cmd, &[]);
        assert_eq!(run.code, 0, "{name}: {run:?}");
        let evals = evaluations(&file);
        let (last, before) = evals.split_last().expect("evaluations");
        // Every 20 steps, each short of the target but the last, where training stopped
        // (local mode's closing line evaluates that step once more; the others report the
        // evaluation they stopped at).
        assert!(last.1 >= 0.9, "{name}: {evals:?}");
        let periodic: Vec<&(u64, f64)> = before.iter().filter(|e| e.0 != last.0).collect();
        assert!(!periodic.is_empty(), "{name}: {evals:?}");
        let again = before.len() - periodic.len();
        assert_eq!(again, usize::from(name == "local"), "{name}: {evals:?}");
        for (i, e) in periodic.iter().enumerate() {
            assert_eq!(e.0, 20 * (i as u64 + 1), "{name}: {evals:?}");
            assert!(e.1 < 0.9, "{name}: {evals:?}");
        }
        assert!(last.0 < 2000, "{name}: stopped at step {}", last.0);
        assert!(last.0.is_multiple_of(20), "{name}: {evals:?}");
    }
}

#[test]
fn evaluation_flags_say_where_they_do_not_apply() {
    let m = mpiflow();
    for (args, want) in [
        (
            &["train", "--target-accuracy", "0.9"][..],
            "--target-accuracy needs --eval-every N: how often to evaluate",
        ),
        (
            &["train", "--target-accuracy", "1.5", "--eval-every", "10"][..],
            "is not a fraction in (0, 1]",
        ),
    ] {
        let mut cmd = vec![m];
        cmd.extend_from_slice(args);
        let run = run_bounded(30, &cmd, &[]);
        assert_ne!(run.code, 0, "{args:?}: {run:?}");
        assert!(run.stderr.contains(want), "{args:?}: {}", run.stderr);
        assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    }
}
