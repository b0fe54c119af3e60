//! `mpiflow launch`: run any program as this rank's task.

use std::collections::BTreeMap;
use std::time::Duration;

use mpiflow::launch::child::{self, ChildProgram};
use mpiflow::launch::lifetime::{self, Supervision};
use mpiflow::launch::{self as launcher};
use mpiflow::transport::mpi::MpiComm;

use mpiflow::cluster::resolve::{resolve_launched, Resolved};
use mpiflow::cluster::Source;

use super::resolve;
use crate::args::LaunchArgs;
use crate::out::{say, Failure};

/// How often a supervising launcher looks at its program and at the other tasks' news.
const POLL: Duration = Duration::from_millis(20);

/// Why `--stop-evaluator` has nothing to do in this job, if it was given: no evaluator
/// task, or no task is stopped at the end at all.
fn idle_stop_evaluator(
    args: &LaunchArgs,
    layout: &mpiflow::cluster::Layout,
    mpi: bool,
) -> Option<&'static str> {
    let evaluators = layout.spec.num_tasks("evaluator").unwrap_or(0);
    match args.stop_evaluator {
        false => None,
        true if evaluators == 0 => Some("the cluster has no evaluator task"),
        true if args.ps_lifetime == crate::args::PsLifetimeArg::Forever => {
            Some("--ps-lifetime forever stops no task")
        }
        true if !mpi => Some("without MPI (mpirun, srun --mpi=pmix) no task is stopped"),
        true => None,
    }
}

/// The program's arguments, checked to run (as this rank's task), and its environment.
type Prepared = (
    Result<Vec<String>, launcher::LaunchError>,
    Vec<(String, String)>,
);

/// What the program of rank `me` of `resolved` runs with; the job's warnings said by the
/// rank that `warns`.
fn prepare(args: &LaunchArgs, resolved: &Resolved, me: usize, mpi: bool, warns: bool) -> Prepared {
    let layout = &resolved.layout;
    let info = &layout.ranks[me];
    let argv = launcher::task_args(layout, info, &args.program, args.legacy_flags).and_then(|a| {
        launcher::find_program(&a[0], std::env::var_os("PATH").as_ref())?;
        Ok(a)
    });
    if warns {
        if let Some(why) = idle_stop_evaluator(args, layout, mpi) {
            say!("mpiflow: warning: --stop-evaluator stops nothing here: {why}");
        }
    }
    (argv, launcher::task_env(layout, info, resolved.size))
}

/// Under an MPI launcher whose variables describe the whole job (one host, or Slurm's
/// step), a job that needs no supervision starts its program without MPI ever initialised
/// here, so the program may initialise it as the rank (mpi4py, Horovod, a C MPI code).
/// Returns only if that cannot be done (the cluster needs MPI to be learned, or tasks to
/// be stopped at the end).
fn exec_without_mpi(args: &LaunchArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    let req = args.cluster.request();
    if req.pick_source(env) != Source::Mpi || args.cluster.unused_flag(Source::Mpi).is_some() {
        return Ok(());
    }
    let Some(resolved) = resolve_launched(&req, env).map_err(Failure::local)? else {
        return Ok(());
    };
    let layout = &resolved.layout;
    let supervised = launcher::lifetimes(layout, args.ps_lifetime.into(), args.stop_evaluator);
    let Some(me) = resolved.me.filter(|_| supervised.is_none()) else {
        return Ok(());
    };
    let (argv, task_env) = prepare(args, &resolved, me, false, me == 0);
    let argv = argv.map_err(Failure::local)?;
    drop(resolved.port_guard);
    Err(Failure::local(launcher::exec(&argv, &task_env)))
}

pub(crate) fn run(args: &LaunchArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    exec_without_mpi(args, env)?;
    let (resolved, ctx) = resolve(&args.cluster, env)?;
    let Some(me) = resolved.me else {
        return Err(Failure::local(
            "launch starts a task in a running job; a hostfile only previews one (run: mpirun --hostfile H mpiflow launch -- PROGRAM)",
        ));
    };
    let layout = &resolved.layout;
    let info = &layout.ranks[me];
    let warns = ctx.as_ref().is_none_or(|c| c.rank() == 0);
    let (prepared, task_env) = prepare(args, &resolved, me, ctx.is_some(), warns);
    let argv = match &ctx {
        Some(c) => c.agree(prepared).map_err(|e| Failure::agreed(e, c))?,
        None => prepared.map_err(Failure::local)?,
    };
    let tasks = launcher::lifetimes(layout, args.ps_lifetime.into(), args.stop_evaluator);
    // Free the probed port for the program's server.
    drop(resolved.port_guard);
    let (Some(ctx), Some(tasks)) = (ctx, tasks) else {
        // Nothing to stop at the end (or no MPI to agree over): become the program,
        // after finalising MPI.
        return Err(Failure::local(launcher::exec(&argv, &task_env)));
    };
    let comm = MpiComm::new(ctx.world());
    // Every rank runs its program or none does: a failed start is one line on each.
    let started = ChildProgram::spawn(&argv, &task_env)
        .map_err(|e| format!("cannot run {:?} for {}: {e}", argv[0], info.task));
    let verdict = ctx.agree(started.as_ref().map(|_| ()).map_err(Clone::clone));
    let mut program = match (started, verdict) {
        (Ok(p), Ok(())) => p,
        (started, verdict) => {
            if let Ok(mut p) = started {
                let _ = lifetime::Program::stop(&mut p, Duration::ZERO);
            }
            return Err(match verdict {
                Err(e) => Failure::agreed(e, &ctx),
                Ok(()) => Failure::local("the ranks disagree on starting the program"),
            });
        }
    };
    let how = Supervision {
        tasks,
        grace: Duration::from_secs_f64(args.stop_grace),
        poll: POLL,
        tag: 0,
    };
    match lifetime::supervise(&comm, &mut program, &how) {
        Ok(end) => {
            drop(comm);
            drop(ctx);
            child::exit_as(end.mine)
        }
        Err(e) => {
            // The other launchers may be waiting for this one: no MPI_Finalize (it could
            // wait for them); exiting without it makes mpirun or srun end the job, and the
            // program dies with its launcher.
            let _ = lifetime::Program::stop(&mut program, Duration::ZERO);
            say!("mpiflow: error: {e}");
            std::process::exit(1)
        }
    }
}
