//! Any model through every mode, under real `mpirun`: the convolutional network trained
//! locally, by the ps over messages and over one-sided windows, and by allreduce, with the
//! synchronous modes equal to local training of the combined batch; its data checked
//! against the model, on every rank.

mod common;

use common::{accuracy, max_relative_difference, mpiflow, mpiflow_alone, mpirun, tmpdir};

const CNN: [&str; 2] = ["--model", "cnn"];

#[test]
fn the_cnn_in_every_synchronous_mode_equals_local_training() {
    let dir = tmpdir("cnn-equal");
    // SGD: every mode sums the replicas' gradients in another order than one process
    // (per worker, by arrival for MPI_Accumulate, by the allreduce's chunks), and with
    // Adam, which divides by the root of tiny second moments, and max pooling, where a
    // rounding can flip which input wins, that rounding grows into 1.5e-3 after 40 steps
    // (measured for allreduce and the one-sided ps alike). With SGD it stays rounding.
    let sgd = ["--optimizer", "sgd", "--lr", "0.05"];
    let local = dir.join("local.bin");
    let mut reference = CNN.to_vec();
    reference.extend_from_slice(&sgd);
    common::train_local_reference("40", &local, &reference);
    for (np, mode) in [
        (
            "4",
            &["--mode", "ps", "--ps", "1", "--transport", "p2p"][..],
        ),
        (
            "5",
            &["--mode", "ps", "--ps", "2", "--transport", "rma"][..],
        ),
        ("3", &["--mode", "allreduce"][..]),
        ("3", &["--mode", "allreduce", "--fusion-threshold", "1"][..]),
    ] {
        let out = dir.join("dist.bin");
        let _ = std::fs::remove_file(&out);
        let mut args = vec!["-np", np, mpiflow(), "train", "--steps", "40"];
        args.extend_from_slice(&CNN);
        args.extend_from_slice(mode);
        args.extend_from_slice(&sgd);
        args.extend_from_slice(&["--save-params", out.to_str().unwrap()]);
        let run = mpirun(&args);
        assert_eq!(run.code, 0, "{mode:?}: {run:?}");
        assert!(
            run.stdout.contains("cnn: input 8x8x1, conv 5x5x16/1 pad 2"),
            "{mode:?}: the log names the model\n{}",
            run.stdout
        );
        let worst = max_relative_difference(&local, &out);
        assert!(
            worst < 1e-4,
            "{mode:?}: largest relative difference {worst}"
        );
    }
}

#[test]
fn the_cnn_learns_digits_asynchronously_and_by_allreduce() {
    // Asynchronous updates are stale and arrive in any order, the last ones too: the
    // learning rate decays to zero (cosine), so that a late stale update cannot undo the
    // end of training. Allreduce is deterministic.
    for (steps, mode) in [
        (
            "800",
            &[
                "--mode",
                "ps",
                "--ps",
                "1",
                "--async",
                "--lr-decay",
                "cosine",
            ][..],
        ),
        ("400", &["--mode", "allreduce"][..]),
    ] {
        let mut args = vec!["-np", "4", mpiflow(), "train", "--steps", steps];
        args.extend_from_slice(&CNN);
        args.extend_from_slice(mode);
        let run = mpirun(&args);
        assert_eq!(run.code, 0, "{mode:?}: {run:?}");
        let acc = accuracy(&run.stdout);
        assert!(acc >= 0.95, "{mode:?}: accuracy {acc}\n{}", run.stdout);
    }
}

#[test]
fn data_that_does_not_fit_the_model_is_one_line_on_every_rank() {
    // Vectors for a network of images: refused before training, agreed by all ranks.
    let run = mpirun(&[
        "-np",
        "3",
        mpiflow(),
        "train",
        "--mode",
        "allreduce",
        "--model",
        "cnn",
        "--data",
        "synthetic",
    ]);
    run.assert_one_line_error("--model cnn takes images; data synthetic has samples of shape [64]");
    // A data set that is not there names the package that brings it.
    let run = mpiflow_alone(
        &[
            "train",
            "--data",
            "fashion-mnist:/nonexistent",
            "--steps",
            "1",
        ],
        &[],
    );
    run.assert_one_line_error(
        "/nonexistent/train-images-idx3-ubyte.gz is missing; install Debian's package dataset-fashion-mnist",
    );
}
