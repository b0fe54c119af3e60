//! A program of one's own on mpiflow: a convolutional network trained on Fashion-MNIST by
//! synchronous replicas (allreduce), evaluated on the 10,000 test images every 200 steps,
//! stopped as soon as it reaches 90%; it prints the wall time at which it did.
//!
//! ```text
//! mpirun -np 4 target/release/examples/fashion [--target 0.90] [--steps 3000] [--every 200]
//! ```
//! The chief prints `reached accuracy A at step S after T s`, or `accuracy A at step S (target
//! not reached)` and exits with 2.

use std::time::Instant;

use mpiflow::prelude::*;

/// Two 5x5 convolution blocks, then two dense layers.
fn model(data: &Dataset) -> Result<Sequential, Error> {
    let conv = |filters| Conv2d {
        kh: 5,
        kw: 5,
        filters,
        stride: 1,
        pad: 2,
    };
    let pool = MaxPool2d { size: 2, stride: 2 };
    let layers: Vec<Box<dyn Layer>> = vec![
        Box::new(conv(16)),
        Box::new(Relu),
        Box::new(pool),
        Box::new(conv(32)),
        Box::new(Relu),
        Box::new(pool),
        Box::new(Flatten),
        Box::new(Dense { units: 128 }),
        Box::new(Relu),
        Box::new(Dense {
            units: data.classes,
        }),
    ];
    Ok(Sequential::new("fashion-cnn", &data.shape, layers)?)
}

/// The value after `--name`, parsed, or `default`.
fn flag<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    let at = args.iter().position(|a| a == name);
    at.and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<std::process::ExitCode, Error> {
    let started = Instant::now();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (target, steps, every) = (
        flag(&args, "--target", 0.90),
        flag(&args, "--steps", 3000),
        flag(&args, "--every", 200),
    );
    // Every rank a worker: roles from MPI, TF_CONFIG or the seeds' flags.
    let server = Server::start(&args, MappingOptions::default())?;
    let (train, test) = Dataset::load_split("fashion-mnist", 1)?;
    let net = model(&train)?;
    let cfg = AllreduceConfig {
        train: TrainConfig {
            steps,
            log_every: every,
            checkpoint_every: 0,
            optimizer: Optimizer::new(OptimizerKind::Adam, 0.003)
                .with_decay(Decay::Cosine { steps }),
            ..TrainConfig::default()
        },
        ..AllreduceConfig::default()
    };
    let mut sess = server
        .allreduce_session(&net, &cfg)?
        .evaluate_every(every, &test)
        .stop_at_accuracy(target);
    let (replicas, me) = sess.data_shard();
    let mut batches = Batches::new(train.len(), cfg.train.batch, cfg.train.seed);
    while !sess.should_stop() {
        let global = batches.global(sess.global_step());
        let (x, y) = train.rows(shard(global, me, replicas));
        sess.run(&x, &y)?;
    }
    let trained = sess.close()?;
    let secs = started.elapsed().as_secs_f64();
    let Some(eval) = trained.evaluation else {
        return Ok(std::process::ExitCode::from(2));
    };
    let reached = eval.accuracy >= target;
    if me == 0 {
        match reached {
            true => println!(
                "reached accuracy {:.4} at step {} after {secs:.1} s ({replicas} replicas)",
                eval.accuracy, eval.step
            ),
            false => println!(
                "accuracy {:.4} at step {} (target {target} not reached) after {secs:.1} s",
                eval.accuracy, eval.step
            ),
        }
    }
    Ok(std::process::ExitCode::from(if reached { 0 } else { 2 }))
}
