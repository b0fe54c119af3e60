//! Fashion-MNIST (Debian's `dataset-fashion-mnist`, the official 60,000 / 10,000 split):
//! the accuracy targets on the 10,000 test images. The convolutional network reaches 90%
//! at 4 ranks by allreduce (the README's command, and `examples/fashion.rs`); the MLP
//! reaches 87% at 4 ranks by the asynchronous ps. The synchronous modes (local with
//! towers, the ps over messages and over one-sided windows, stages under allreduce and
//! under a ps) train the same parameters as local training, checked step by step in
//! `tests/mpirun_models.rs` and `tests/mpirun_pipeline.rs`, so they reach what these runs
//! reach; running each to 90% here took the suite 4 minutes more.
//!
//! The runs are 2,000 steps of 64 (2.1 epochs) with the learning rate on a cosine decay,
//! which gets there in two thirds of the constant rate's steps (measured locally: 0.9101
//! at 2,000 steps, 0.9040 at 1,500, where the synchronous ps read 0.9017 and 0.9019, too
//! close to assert; a constant 0.003 needed 3,000 steps for 0.9052).

mod common;

use common::{accuracy, mpiflow, run_bounded, Run};

const CNN: [&str; 12] = [
    "train",
    "--model",
    "cnn",
    "--data",
    "fashion-mnist",
    "--steps",
    "2000",
    "--lr-decay",
    "cosine",
    "--log-every",
    "500",
    "--seed",
];

/// `mpiflow ARGS` (under `mpirun -np NP` if given), one job at a time, bounded.
fn run(np: Option<&str>, args: &[&str]) -> Run {
    let _guard = common::lock();
    let mut cmd = match np {
        Some(np) => vec!["mpirun", "--oversubscribe", "-np", np],
        None => Vec::new(),
    };
    cmd.push(mpiflow());
    cmd.extend_from_slice(args);
    run_bounded(400, &cmd, &[])
}

fn assert_reaches(run: &Run, target: f64, what: &str) {
    assert_eq!(run.code, 0, "{what}: {run:?}");
    let acc = accuracy(&run.stdout);
    assert!(acc >= target, "{what}: accuracy {acc}\n{}", run.stdout);
    assert!(
        run.stdout.contains("10000 held-out samples"),
        "{what}: evaluated on the official test set\n{}",
        run.stdout
    );
}

#[test]
fn the_cnn_reaches_90_percent_by_allreduce() {
    let mut args = CNN.to_vec();
    args.extend_from_slice(&["1", "--mode", "allreduce"]);
    assert_reaches(&run(Some("4"), &args), 0.90, "cnn, allreduce");
}

#[test]
fn the_mlp_reaches_87_percent_by_the_asynchronous_ps() {
    let args = [
        "train",
        "--model",
        "mlp",
        "--hidden",
        "256",
        "--data",
        "fashion-mnist",
        "--mode",
        "ps",
        "--ps",
        "1",
        "--async",
        "--steps",
        "12000",
        "--lr-decay",
        "cosine",
        "--log-every",
        "4000",
    ];
    assert_reaches(&run(Some("4"), &args), 0.87, "mlp, async ps");
}

/// `examples/fashion.rs`, a program of one's own on the library's session: the CNN by
/// allreduce at 4 ranks, evaluated every 200 steps, stops as soon as it reaches 90% (the
/// chief's line names the step; every evaluation was on the 10,000 test images).
#[test]
fn the_fashion_example_stops_once_its_cnn_reaches_90_percent() {
    let bin = std::path::Path::new(mpiflow())
        .parent()
        .expect("a target directory")
        .join("examples")
        .join("fashion");
    let out = run_bounded(
        400,
        &[
            "mpirun",
            "--oversubscribe",
            "-np",
            "4",
            bin.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let evals: Vec<(f64, u64)> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("accuracy ") && l.contains("/10000 held-out samples"))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w[1].parse().unwrap(), w.last().unwrap().parse().unwrap())
        })
        .collect();
    let (last, step) = *evals.last().expect("evaluations");
    assert!(last >= 0.90, "{}", out.stdout);
    // Evaluated every 200 steps, stopped at the first that reached it.
    assert!(evals
        .iter()
        .enumerate()
        .all(|(i, e)| e.1 == 200 * (i as u64 + 1)));
    assert!(
        evals[..evals.len() - 1].iter().all(|e| e.0 < 0.90),
        "{}",
        out.stdout
    );
    let said = format!("reached accuracy {last:.4} at step {step} after ");
    assert!(out.stdout.contains(&said), "{}", out.stdout);
}
