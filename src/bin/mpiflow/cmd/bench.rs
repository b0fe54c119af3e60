//! `mpiflow bench`: OSU-style benchmarks.

use crate::args::BenchArgs;
use crate::out::{say, Failure};
use mpiflow::train::resources;

pub(crate) fn run(args: &BenchArgs) -> Result<(), Failure> {
    let (ctx, _) = super::init(false)?;
    ctx.agree(mpiflow::bench::validate(
        &args.name,
        ctx.size(),
        &args.options(),
    ))
    .map_err(|e| Failure::agreed(e, &ctx))?;
    // Before anything is allocated: a window of large messages can exceed the node.
    let need = mpiflow::bench::need(&args.name, &args.options());
    let share = resources::share(ctx.machine_local().1);
    let advice = "use smaller messages (-m), a smaller window (-W) or --count, -b single, or fewer ranks per node";
    let task = format!("bench {}", args.name);
    ctx.agree(resources::check_advised(
        &task,
        &need,
        share.as_ref(),
        advice,
    ))
    .map_err(|e| Failure::agreed(e, &ctx))?;
    let comm = mpiflow::transport::mpi::MpiComm::new(ctx.world());
    if let Err(e) = mpiflow::bench::run(&comm, &args.name, &args.options()) {
        // The peer may be blocked in a transfer with this rank: no collective agreement and
        // no MPI_Finalize, which could wait forever; exiting makes mpirun end the job.
        say!("mpiflow: error: rank {}: {e}", ctx.rank());
        std::process::exit(1);
    }
    Ok(())
}
