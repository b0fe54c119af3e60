//! A model of your own, trained by synchronous replicas: every rank holds the model,
//! computes gradients on its share of each batch, and a fused allreduce averages them.
//!
//! ```text
//! mpirun -np 3 target/release/examples/allreduce [--steps N] [--data SPEC]
//! ```
//! The chief prints the held-out `accuracy` at the end.

use std::process::ExitCode;

use mpiflow::cluster::MappingOptions;
use mpiflow::model::layers::{Conv2d, Dense, Flatten, Layer, MaxPool2d, Relu};
use mpiflow::model::{Model, Sequential};
use mpiflow::train::allreduce::{self, AllreduceConfig};
use mpiflow::train::data::Dataset;
use mpiflow::train::events::Event;
use mpiflow::train::server::Server;
use mpiflow::train::TrainConfig;

/// This program's network: one 3x3 convolution block, then two dense layers.
fn model(data: &Dataset) -> Result<Sequential, String> {
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
    Sequential::new("example-cnn", &data.shape, layers).map_err(|e| e.to_string())
}

fn value(args: &[String], name: &str) -> Option<String> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).cloned()
}

fn run(args: &[String]) -> Result<(), String> {
    // Every rank a worker (no ps tasks): roles from MPI, TF_CONFIG or the seeds' flags.
    let server = Server::start(args, MappingOptions::default()).map_err(|e| e.to_string())?;
    if server.layout().ranks.len() > 1 && server.is_chief() {
        for w in server.warnings() {
            eprintln!("warning: {w}");
        }
    }
    let steps = value(args, "--steps").map_or(Ok(600), |s| s.parse().map_err(|_| s))?;
    let spec = value(args, "--data").unwrap_or_else(|| "digits".into());
    let (train, test) = Dataset::load_split(&spec, 1).map_err(|e| e.to_string())?;
    let net = model(&train)?;
    if server.is_chief() {
        println!("# {}", net.describe());
    }
    let cfg = AllreduceConfig {
        train: TrainConfig {
            steps,
            log_every: 200,
            ..TrainConfig::default()
        },
        ..AllreduceConfig::default()
    };
    let mut log = |e: &Event| println!("{e}");
    allreduce::run(
        server.comm(),
        server.layout(),
        &net,
        &cfg,
        &train,
        &test,
        &mut log,
    )
    .map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("allreduce example: error: {e}");
            ExitCode::FAILURE
        }
    }
}
