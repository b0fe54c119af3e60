use clap::CommandFactory;

use super::*;
use mpiflow::train::optim::{Decay, OptimizerKind};
use mpiflow::train::ps::placement::Strategy;

/// Every flag's default parses (clap checks defaults against the possible values).
#[test]
fn the_command_line_is_consistent() {
    Cli::command().debug_assert();
    let cli =
        Cli::try_parse_from(["mpiflow", "bench", "allreduce", "--algorithm", "ring,shm"]).unwrap();
    let Cmd::Bench(b) = cli.cmd else {
        panic!("bench")
    };
    let o = b.options();
    assert_eq!(o.algorithms, vec![Algorithm::Ring, Algorithm::Shm]);
    assert_eq!(o.path, BenchPath::Both);
    let cli =
        Cli::try_parse_from(["mpiflow", "train", "--lr-decay", "cosine", "--steps", "9"]).unwrap();
    let Cmd::Train(t) = cli.cmd else {
        panic!("train")
    };
    let cfg = t.train_config();
    assert_eq!(cfg.optimizer.kind, OptimizerKind::Adam);
    assert_eq!(cfg.optimizer.decay, Decay::Cosine { steps: 9 });
    assert_eq!(t.var_placement, Strategy::Greedy);
}
