//! One module per command; the cluster resolution they share.

pub(crate) mod bench;
pub(crate) mod check;
pub(crate) mod launch;
pub(crate) mod plot;
pub(crate) mod scale;
pub(crate) mod spec;
pub(crate) mod supervise;
pub(crate) mod topo;
pub(crate) mod train;
pub(crate) mod train_ctr;

use std::collections::BTreeMap;

use mpiflow::cluster::resolve::{
    resolve_bound, resolve_mpi, resolve_offline, under_mpi_launcher, Request,
};
use mpiflow::cluster::{Resolved, Source};
use mpiflow::transport::Context;

use crate::args::ClusterArgs;
use crate::out::{say, Failure};

/// Resolves the cluster; under MPI returns the live context too.
pub(crate) fn resolve(
    args: &ClusterArgs,
    env: &BTreeMap<String, String>,
) -> Result<(Resolved, Option<Context>), Failure> {
    resolve_with(args, Vec::new(), env, false, false).map(|(r, c, _)| (r, c))
}

/// As [`resolve`], with the command's own flags that every rank must be given alike
/// (`agreed`, compared with the mapping flags); with `threaded`, MPI is asked for
/// `MPI_THREAD_MULTIPLE` and the last value says whether it was granted; with `bind`, a
/// cluster from TF_CONFIG or the seeds' flags under an MPI launcher is matched to the
/// ranks (each process's task to its rank).
pub(crate) fn resolve_with(
    args: &ClusterArgs,
    agreed: Vec<(String, String)>,
    env: &BTreeMap<String, String>,
    threaded: bool,
    bind: bool,
) -> Result<(Resolved, Option<Context>, bool), Failure> {
    let req = Request {
        agreed,
        ..args.request()
    };
    let source = req.pick_source(env);
    if let Some(unused) = args.unused_flag(source) {
        return Err(Failure::local(unused));
    }
    match source {
        Source::Mpi => {
            let (ctx, multiple) = init(threaded)?;
            // Every error of the MPI resolver is collective: all ranks hold the same one.
            let r = resolve_mpi(&ctx, &req).map_err(|e| Failure::agreed(e, &ctx))?;
            Ok((r, Some(ctx), multiple))
        }
        // Training needs ranks: a cluster described per process (TF_CONFIG, the seeds'
        // flags) under an MPI launcher is matched to them, as `Server::start` does.
        Source::TfConfig | Source::Flags if bind && under_mpi_launcher(env) => {
            let (ctx, multiple) = init(threaded)?;
            let layout = resolve_bound(&ctx, &req, source, env);
            let layout = layout.map_err(|e| Failure::agreed(e, &ctx))?;
            let r = Resolved {
                source,
                layout,
                me: Some(ctx.rank()),
                outside: None,
                size: Some(ctx.size()),
                port_guard: None,
            };
            Ok((r, Some(ctx), multiple))
        }
        source => {
            let r = resolve_offline(&req, source, env).map_err(Failure::local)?;
            Ok((r, None, false))
        }
    }
}

/// Starts MPI (asking for `MPI_THREAD_MULTIPLE` when `threaded`; the flag says whether it
/// was granted); rank 0 prints the start's warnings.
pub(crate) fn init(threaded: bool) -> Result<(Context, bool), Failure> {
    let (ctx, multiple) = if threaded {
        Context::init_threaded().map_err(Failure::local)?
    } else {
        (Context::init().map_err(Failure::local)?, false)
    };
    for w in ctx.warnings().iter().filter(|_| ctx.rank() == 0) {
        say!("mpiflow: warning: {w}");
    }
    Ok((ctx, multiple))
}
