//! `mpiflow scale`'s flags.

use std::path::PathBuf;

use clap::Args;

use super::{named, positive_usize, ModelChoice};
use mpiflow::train::optim::OptimizerKind;

/// `mpiflow scale`: links fitted to latencies, models measured here, predictions by hosts.
#[derive(Args)]
pub(crate) struct ScaleArgs {
    /// OSU-format latency output between two ranks of one host (`osu_latency`, or
    /// `mpiflow bench latency --path mpiflow`): the shared-memory link.
    #[arg(long, value_name = "FILE")]
    pub(crate) shm: PathBuf,
    /// The same between two hosts: the network link.
    #[arg(long, value_name = "FILE")]
    pub(crate) net: PathBuf,
    /// OSU-format bidirectional bandwidth between two hosts, one message each way at a
    /// time (`osu_bibw -W 1`, `mpiflow bench bibw -W 1`): what an exchange costs (each
    /// allreduce step is one). Without it the ports are taken as full duplex.
    #[arg(long, value_name = "FILE")]
    pub(crate) net_bibw: Option<PathBuf>,
    /// The models to predict, comma-separated (mlp, cnn).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "mlp")]
    pub(crate) model: Vec<ModelChoice>,
    /// The data the models are shaped for and measured on (as `train --data`).
    #[arg(long, default_value = "fashion-mnist")]
    pub(crate) data: String,
    /// Hidden layer widths of the MLP, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128", value_parser = positive_usize)]
    pub(crate) hidden: Vec<usize>,
    /// Samples per worker and step (weak scaling: the global batch grows with the workers).
    #[arg(long, default_value_t = 64, value_parser = positive_usize)]
    pub(crate) batch: usize,
    /// The optimizer whose update is timed (as `train --optimizer`).
    #[arg(long, value_parser = named::<OptimizerKind>(), default_value = "adam")]
    pub(crate) optimizer: OptimizerKind,
    /// Workers per host (each with a core).
    #[arg(long, default_value_t = 1, value_parser = positive_usize)]
    pub(crate) workers_per_host: usize,
    /// Host counts to predict, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = positive_usize,
          default_value = "2,4,8,16,32,64,128,256,512,1024")]
    pub(crate) hosts: Vec<usize>,
    /// A measured run to check the model against: MODEL:HOSTS:FILE, the metrics file
    /// (`train --metrics`) of a run of MODEL over HOSTS hosts by `mpirun --map-by node`
    /// (sync ps or allreduce, with this --batch per worker). Repeatable.
    #[arg(long, value_name = "MODEL:HOSTS:FILE")]
    pub(crate) run: Vec<String>,
    /// How far a prediction may be from a measured run, as a fraction: beyond it the
    /// command fails.
    #[arg(long, default_value_t = 0.25, value_parser = fraction)]
    pub(crate) tolerance: f64,
    /// Timed repetitions of a model's step (the median counts).
    #[arg(long, default_value_t = 20, value_parser = positive_usize)]
    pub(crate) reps: usize,
    /// OpenBLAS threads while measuring the models (a worker's core: 1).
    #[arg(long, default_value_t = 1, value_parser = positive_usize)]
    pub(crate) blas_threads: usize,
    /// Draw the predictions (and the runs) as an SVG here.
    #[arg(long, value_name = "SVG")]
    pub(crate) svg: Option<PathBuf>,
}

/// A fraction of 0 or more (`--tolerance`).
fn fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f.is_finite() && f >= 0.0 => Ok(f),
        _ => Err(format!("{s} is not a fraction of 0 or more (0.25 is 25%)")),
    }
}
