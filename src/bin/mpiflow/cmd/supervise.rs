//! `mpiflow supervise`: rerun a failed training job from its newest valid checkpoint.

use std::time::Duration;

use mpiflow::launch::child::exit_as;
use mpiflow::supervise::{self, SuperviseConfig};

use crate::args::SuperviseArgs;
use crate::out::{say, Failure};

pub(crate) fn run(args: &SuperviseArgs) -> Result<(), Failure> {
    let dir = args
        .checkpoint_dir
        .clone()
        .or_else(|| supervise::checkpoint_dir_in(&args.command))
        .ok_or_else(|| {
            Failure::local(
                "supervise: the command names no --checkpoint-dir (nor does --checkpoint-dir \
                 before --): a rerun could not resume, so nothing is supervised",
            )
        })?;
    // The directory a rerun resumes from must hold checkpoints: said now, not after the
    // first failure (the job itself stops on it too, but a rerun would repeat that).
    mpiflow::train::checkpoint::prepare_dir(&dir)
        .map_err(|e| Failure::local(format!("supervise: {e}")))?;
    let cfg = SuperviseConfig {
        command: args.command.clone(),
        checkpoint_dir: dir,
        max_restarts: args.max_restarts,
        delay: Duration::from_secs_f64(args.restart_delay),
    };
    let outcome = supervise::run(&cfg, &mut |line| say!("mpiflow supervise: {line}"))
        .map_err(|e| Failure::local(format!("supervise: {e}")))?;
    exit_as(outcome)
}
