//! `mpiflow check`: the data plane verified on a live job.

use std::collections::BTreeMap;

use super::resolve;
use crate::args::CheckArgs;
use crate::out::{emit, say, Failure};

pub(crate) fn run(args: &CheckArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    let (resolved, ctx) = resolve(&args.cluster, env)?;
    let Some(ctx) = ctx else {
        return Err(Failure::local(
            "check runs under mpirun (or srun --mpi=pmix)",
        ));
    };
    drop(resolved.port_guard);
    let coll =
        mpiflow::transport::Collectives::new(mpiflow::transport::mpi::MpiComm::new(ctx.world()));
    let report = mpiflow::check::run(&coll, &resolved.layout, args.mismatch_rank)
        .and_then(|mut rep| {
            mpiflow::check::run_rma(coll.comm(), &mut rep)?;
            Ok(rep)
        })
        .and_then(|rep| {
            emit(&(rep.json(ctx.rank(), ctx.size()) + "\n"));
            match rep.failures.first() {
                Some(f) => Err(format!(
                    "{} of {} checks failed, first: {f}",
                    rep.failures.len(),
                    rep.checks
                )),
                None => Ok(rep),
            }
        });
    let rep = ctx.agree(report).map_err(|e| Failure::agreed(e, &ctx))?;
    if ctx.rank() == 0 {
        say!(
            "mpiflow check: {} checks passed on each of {} ranks",
            rep.checks,
            ctx.size()
        );
    }
    Ok(())
}
