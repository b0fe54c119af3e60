//! `mpiflow launch`: run any program as this rank's task.

use std::collections::BTreeMap;

use mpiflow::launch;

use super::resolve;
use crate::args::LaunchArgs;
use crate::out::Failure;

pub(crate) fn run(args: &LaunchArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    let (resolved, ctx) = resolve(&args.cluster, env)?;
    let Some(me) = resolved.me else {
        return Err(Failure::local(
            "launch starts a task in a running job; a hostfile only previews one (run: mpirun --hostfile H mpiflow launch -- PROGRAM)",
        ));
    };
    let layout = &resolved.layout;
    let info = &layout.ranks[me];
    let prepared =
        launch::task_args(layout, info, &args.program, args.legacy_flags).and_then(|a| {
            launch::find_program(&a[0], std::env::var_os("PATH").as_ref())?;
            Ok(a)
        });
    let argv = match &ctx {
        Some(c) => c.agree(prepared).map_err(|e| Failure::agreed(e, c))?,
        None => prepared.map_err(Failure::local)?,
    };
    let task_env = launch::task_env(layout, info, resolved.size);
    // Free the probed port for the program's server, and finalise MPI before the exec.
    drop(resolved.port_guard);
    drop(ctx);
    Err(Failure::local(launch::exec(&argv, &task_env)))
}
