//! `mpiflow launch`: run any program as this rank's task.

use std::collections::BTreeMap;
use std::time::Duration;

use mpiflow::cluster::resolve::{resolve_hostfile_rank, resolve_launched, ResolveError, Resolved};
use mpiflow::cluster::{Source, TaskId};
use mpiflow::launch::child::{self, ChildProgram};
use mpiflow::launch::lifetime::{self, Lifetime, Supervision};
use mpiflow::launch::notices::{Notices, OverMpi};
use mpiflow::launch::star::{self, Star};
use mpiflow::launch::{self as launcher, watch};
use mpiflow::transport::mpi::MpiComm;

use super::resolve;
use crate::args::LaunchArgs;
use crate::out::{say, Failure};

/// What a program that initialises MPI is told where the launcher took the rank's MPI.
const MPI_TAKEN: &str = "mpiflow: error: the program initialises MPI itself, but `launch` had to initialise it to learn the cluster (ranks on several hosts under mpirun): give launch the hostfile mpirun was given (mpirun --hostfile H -np N mpiflow launch --hostfile H -- PROGRAM), or start the job with srun --mpi=pmix";

/// How often a supervising launcher looks at its program and at the other tasks' news.
const POLL: Duration = Duration::from_millis(20);

/// Why `--stop-evaluator` has nothing to do in this job, if it was given: no evaluator
/// task, or no task is stopped at the end at all (`supervised`: the launchers can stop
/// tasks, which they cannot outside an MPI launcher's job).
fn idle_stop_evaluator(
    args: &LaunchArgs,
    layout: &mpiflow::cluster::Layout,
    supervised: bool,
) -> Option<&'static str> {
    let evaluators = layout.spec.num_tasks("evaluator").unwrap_or(0);
    match args.stop_evaluator {
        false => None,
        true if evaluators == 0 => Some("the cluster has no evaluator task"),
        true if args.ps_lifetime == crate::args::PsLifetimeArg::Forever => {
            Some("--ps-lifetime forever stops no task")
        }
        true if !supervised => Some("without MPI (mpirun, srun --mpi=pmix) no task is stopped"),
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
fn prepare(
    args: &LaunchArgs,
    resolved: &Resolved,
    me: usize,
    supervised: bool,
    warns: bool,
) -> Prepared {
    let layout = &resolved.layout;
    let info = &layout.ranks[me];
    let argv = launcher::task_args(layout, info, &args.program, args.legacy_flags).and_then(|a| {
        launcher::find_program(&a[0], std::env::var_os("PATH").as_ref())?;
        Ok(a)
    });
    if warns {
        warn_idle_stop_evaluator(args, layout, supervised);
    }
    (argv, launcher::task_env(layout, info, resolved.size))
}

/// Says why `--stop-evaluator` does nothing here, if it does not.
fn warn_idle_stop_evaluator(
    args: &LaunchArgs,
    layout: &mpiflow::cluster::Layout,
    supervised: bool,
) {
    if let Some(why) = idle_stop_evaluator(args, layout, supervised) {
        say!("mpiflow: warning: --stop-evaluator stops nothing here: {why}");
    }
}

/// Under an MPI launcher whose variables describe the whole job (one host, or Slurm's
/// step), runs the program without MPI ever initialised here, so the program may
/// initialise it as the rank (mpi4py, Horovod, a C MPI code): it becomes the program, or,
/// where tasks are stopped at the end, supervises it with the other launchers over
/// sockets of their own. Returns only if that cannot be done (the cluster needs MPI to be
/// learned) or something is wrong, which the ranks then agree on over MPI.
fn run_without_mpi(args: &LaunchArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    let req = args.cluster.request();
    let source = req.pick_source(env);
    if args.cluster.unused_flag(source).is_some() {
        return Ok(());
    }
    // Errors every rank finds alike (a mapping, a program not found) are left to the path
    // over MPI, where the ranks agree on them: one line, not one per rank. A port in use
    // is this rank's alone: it ends this rank (the MPI launcher then ends the job), as a
    // rank that went to MPI while the others did not would wait for them for ever. A
    // hostfile's job has no MPI to fall back to: its errors are each rank's.
    let resolved = match source {
        Source::Mpi => match resolve_launched(&req, env) {
            Ok(Some(resolved)) => resolved,
            Err(e @ ResolveError::Port(_)) => return Err(Failure::local(e)),
            Ok(None) | Err(_) => return Ok(()),
        },
        Source::Hostfile => match resolve_hostfile_rank(&req, env).map_err(Failure::local)? {
            Some(resolved) => resolved,
            None => return Ok(()),
        },
        _ => return Ok(()),
    };
    let layout = &resolved.layout;
    let supervised = launcher::lifetimes(layout, args.ps_lifetime.into(), args.stop_evaluator);
    let Some(me) = resolved.me else {
        return Ok(());
    };
    let (argv, task_env) = prepare(args, &resolved, me, supervised.is_some(), false);
    let Ok(argv) = argv else {
        return Ok(());
    };
    if me == 0 {
        warn_idle_stop_evaluator(args, layout, supervised.is_some());
    }
    drop(resolved.port_guard);
    let Some(tasks) = supervised else {
        return Err(Failure::local(launcher::exec(&argv, &task_env)));
    };
    // The launchers supervise over sockets of their own: within rank 0's host, and over
    // TCP from other hosts.
    let token = star::job_token(env, &layout.spec.to_string(), layout.ranks.len());
    let one_host = layout.ranks.iter().all(|r| r.host == layout.ranks[0].host);
    let tcp = match one_host {
        true => None,
        false => {
            let port = star::tcp_port(env, &token).map_err(Failure::local)?;
            Some((layout.ranks[0].host.clone(), port))
        }
    };
    let join = Star::join(&token, me, layout.ranks.len(), tcp);
    let mut star = join.map_err(|e| Failure::local(e.to_string()))?;
    let how = supervision(args, tasks);
    // The program may use MPI: watched, so that its MPI_Finalize and the ps tasks' stop
    // do not wait for each other.
    let end = match ChildProgram::spawn_watched(&argv, &task_env) {
        Ok(mut program) => watch(&mut star, &mut program, &how),
        Err(e) => {
            say!(
                "mpiflow: error: cannot run {:?} for {}: {e}",
                argv[0],
                layout.ranks[me].task
            );
            watch(&mut star, &mut NotStarted, &how)
        }
    };
    child::exit_as(end)
}

/// A program that could not be started: it failed at once (status 127, as a shell says),
/// so the other tasks stop.
struct NotStarted;

impl lifetime::Program for NotStarted {
    fn try_wait(&mut self) -> std::io::Result<Option<lifetime::Outcome>> {
        Ok(Some(lifetime::Outcome::Exited(127)))
    }
    fn stop(&mut self, _grace: Duration) -> std::io::Result<()> {
        Ok(())
    }
    fn forward_signals(&mut self) {}
}

pub(crate) fn run(args: &LaunchArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    run_without_mpi(args, env)?;
    let (resolved, ctx) = resolve(&args.cluster, env)?;
    let Some(me) = resolved.me else {
        return Err(Failure::local(
            "launch starts a task in a running job; a hostfile only previews one (run: mpirun --hostfile H mpiflow launch -- PROGRAM)",
        ));
    };
    let layout = &resolved.layout;
    let info = &layout.ranks[me];
    let warns = ctx.as_ref().is_none_or(|c| c.rank() == 0);
    let (prepared, mut task_env) = prepare(args, &resolved, me, ctx.is_some(), warns);
    if ctx.is_some() {
        // This launcher took the rank's MPI: a program that initialises MPI too is told
        // why it cannot, in one line (rank 0's), not in the MPI library's pages of help.
        // (Without the memory file for it, the MPI library says it its own way: no rank
        // stops here while the others go on to agree.)
        let line = if warns { MPI_TAKEN } else { "" };
        task_env.extend(watch::mpi_taken_env(line).unwrap_or_default());
    }
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
    let how = supervision(args, tasks);
    let mut notices = OverMpi::new(&comm, 0).map_err(|e| Failure::local(e.to_string()))?;
    let end = watch(&mut notices, &mut program, &how);
    drop(notices);
    drop(comm);
    drop(ctx);
    child::exit_as(end)
}

/// The options of the supervising loop.
fn supervision(args: &LaunchArgs, tasks: Vec<(TaskId, Lifetime)>) -> Supervision {
    Supervision {
        tasks,
        grace: Duration::from_secs_f64(args.stop_grace),
        poll: POLL,
    }
}

/// Supervises `program` with the other launchers over `notices` until the job's verdict;
/// the program's outcome. On an error of the channel the program is stopped and the
/// launcher exits 1 (the other launchers may be waiting for this one: no `MPI_Finalize`,
/// which could wait for them; the MPI launcher then ends the job).
fn watch<N: Notices, P: lifetime::Program>(
    notices: &mut N,
    program: &mut P,
    how: &Supervision,
) -> lifetime::Outcome {
    match lifetime::supervise(notices, program, how) {
        Ok(end) => end.mine,
        Err(e) => {
            let _ = program.stop(Duration::ZERO);
            say!("mpiflow: error: {e}");
            std::process::exit(1)
        }
    }
}
