//! A model of your own, trained by synchronous replicas: every rank holds the model,
//! computes gradients on its share of each batch, and a fused allreduce averages them.
//! With `--stages S`, each replica is S tasks, each holding some of the model's layers
//! (pipeline stages; the replicas' stage-k tasks allreduce their stage's gradients): the
//! same loop drives the stage's session.
//!
//! ```text
//! mpirun -np 3 target/release/examples/allreduce [--steps N] [--data SPEC]
//! mpirun -np 4 target/release/examples/allreduce --stages 2     # 2 replicas of 2 stages
//! ```
//! The chief prints the held-out `accuracy` at the end.

use mpiflow::prelude::*;

/// This program's network: one 3x3 convolution block, then two dense layers.
fn model(data: &Dataset) -> Result<Sequential, Error> {
    let layers: Vec<Box<dyn Layer>> = vec![
        Box::new(Conv2d {
            kh: 3,
            kw: 3,
            filters: 8,
            stride: 1,
            pad: 1,
        }),
        Box::new(Relu),
        Box::new(MaxPool2d { size: 2, stride: 2 }),
        Box::new(Flatten),
        Box::new(Dense { units: 32 }),
        Box::new(Relu),
        Box::new(Dense {
            units: data.classes,
        }),
    ];
    Ok(Sequential::new("example-cnn", &data.shape, layers)?)
}

fn value(args: &[String], name: &str) -> Option<String> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).cloned()
}

/// The training loop, the same for every mode: each replica's share of each global
/// batch, the held-out evaluation at the end.
fn drive<'m, S: Strategy<'m>>(
    mut sess: Session<'m, '_, S>,
    cfg: &TrainConfig,
    (train, test): (&Dataset, &Dataset),
) -> Result<(), TrainError> {
    let (replicas, me) = sess.data_shard();
    let mut batches = Batches::new(train.len(), cfg.batch, cfg.seed);
    while !sess.should_stop() {
        let global = batches.global(sess.global_step());
        let (x, y) = train.rows(shard(global, me, replicas));
        sess.run(&x, &y)?;
    }
    sess.evaluate(test)?;
    sess.close()?;
    Ok(())
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let stages = value(&args, "--stages").and_then(|s| s.parse().ok());
    // Every rank a worker (no ps tasks), or a replica's stage: roles from MPI, TF_CONFIG
    // or the seeds' flags.
    let mapping = MappingOptions {
        stages,
        ..MappingOptions::default()
    };
    let server = Server::start(&args, mapping)?;
    if server.layout().ranks.len() > 1 && server.is_chief() {
        for w in server.warnings() {
            eprintln!("warning: {w}");
        }
    }
    let steps = value(&args, "--steps").and_then(|s| s.parse().ok());
    let spec = value(&args, "--data").unwrap_or_else(|| "digits".into());
    let (train, test) = Dataset::load_split(&spec, 1)?;
    let net = model(&train)?;
    if server.is_chief() {
        println!("# {}", net.describe());
    }
    let cfg = AllreduceConfig {
        train: TrainConfig {
            steps: steps.unwrap_or(600),
            log_every: 200,
            ..TrainConfig::default()
        },
        ..AllreduceConfig::default()
    };
    // The session prints what the chief reports; the loop feeds each replica its share of
    // each global batch.
    let data = (&train, &test);
    if stages.is_some() {
        let cfg = PipelineConfig {
            train: cfg.train.clone(),
            ..PipelineConfig::default()
        };
        server.stages(&net, &cfg, data, |sess| drive(sess, &cfg.train, data))?;
        return Ok(());
    }
    let sess = server.allreduce_session(&net, &cfg)?;
    drive(sess, &cfg.train, data)?;
    Ok(())
}
