//! The environment the libraries read before `main` can act (OpenBLAS when it loads,
//! OpenMPI in `MPI_Init`), set by re-executing the process, for the commands that compute.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;

use mpiflow::cluster::resolve::launcher_rank_hint;
use mpiflow::named::Named;
use mpiflow::transport::stack::{self, Facts, RdmaStack, Settings, StackError};

use crate::args::Cmd;
use crate::out::say;

/// Variables that must be set before the libraries read them (OpenBLAS when it loads,
/// before `main`; OpenMPI in `MPI_Init`), for the commands that compute. Empty when the
/// environment already has them (a user's own choice is inherited as it is).
///
/// - `OPENBLAS_NUM_THREADS` (default: every core) and `OPENBLAS_CORETYPE` (see
///   [`mpiflow::kernels::openblas_coretype`]): threads OpenBLAS does not use still compete
///   with the other ranks of the node. Set from the rank's share of the node: the launcher's binding, or
///   cores divided by the ranks the launcher put on this node.
/// - Open MPI's components (`OMPI_MCA_pml`, `OMPI_MCA_osc`, ...) for `stack`
///   ([`mpiflow::transport::stack`]): by default only `OMPI_MCA_osc=sm,pt2pt` on a machine
///   without an RDMA device, where Open MPI's default `osc rdma` crashes in
///   `MPI_Compare_and_swap` over shared memory (OpenMPI 4.1.4) and fails over TCP.
///
/// Also returns the line that says what was chosen, when there is one to say.
pub(crate) fn env_before_init(
    cmd: &Cmd,
    stack: RdmaStack,
    env: &BTreeMap<String, String>,
) -> Result<Settings, StackError> {
    let computes = match cmd {
        Cmd::Train(_) | Cmd::Bench(_) | Cmd::Check(_) | Cmd::Topo(_) => true,
        Cmd::Spec(_) | Cmd::Launch(_) | Cmd::Supervise(_) | Cmd::Plot(_) | Cmd::Scale(_) => false,
    };
    if !computes {
        return Ok(Settings::default());
    }
    let mut settings = stack::settings(stack, &Facts::detect(), env)?;
    let set = &mut settings.vars;
    if env.contains_key("OPENBLAS_NUM_THREADS") {
        return Ok(settings);
    }
    if !env.contains_key("OPENBLAS_CORETYPE") {
        if let Some(c) = mpiflow::kernels::openblas_coretype() {
            set.push(("OPENBLAS_CORETYPE", c.to_string()));
        }
    }
    let all = mpiflow::topology::Machine::detect().map_or(1, |m| m.cores().len().max(1));
    let mine = mpiflow::topology::current_affinity().len().max(1);
    let local = [
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MPI_LOCALNRANKS",
        "SLURM_NTASKS_PER_NODE",
    ]
    .iter()
    .find_map(|v| env.get(*v).and_then(|x| x.parse::<usize>().ok()))
    .unwrap_or(1)
    .max(1);
    let threads = if mine < all {
        mine
    } else {
        (all / local).max(1)
    };
    set.push(("OPENBLAS_NUM_THREADS", threads.to_string()));
    Ok(settings)
}

/// `--rdma-stack`, else `MPIFLOW_RDMA_STACK`, else `auto`.
pub(crate) fn rdma_stack(
    flag: Option<RdmaStack>,
    env: &BTreeMap<String, String>,
) -> Result<RdmaStack, String> {
    match (flag, env.get("MPIFLOW_RDMA_STACK")) {
        (Some(s), _) => Ok(s),
        (None, None) => Ok(RdmaStack::Auto),
        (None, Some(v)) => RdmaStack::from_name(v.trim())
            .ok_or_else(|| format!("MPIFLOW_RDMA_STACK={v}: not one of auto, ucx, ompi")),
    }
}

/// Sets [`env_before_init`]'s variables by re-executing the same process (same PID, so
/// mpirun and srun keep tracking it), before MPI is initialised.
/// Says what was chosen (rank 0, or a process outside a launcher), or exits with one line
/// when the choice cannot be made (`prefix` names the rank).
pub(crate) fn reexec_with_env(
    cmd: &Cmd,
    flag: Option<RdmaStack>,
    env: &BTreeMap<String, String>,
    prefix: &str,
) {
    let chosen =
        rdma_stack(flag, env).and_then(|s| env_before_init(cmd, s, env).map_err(|e| e.to_string()));
    let Settings { vars: set, note } = match chosen {
        Ok(s) => s,
        Err(e) => {
            say!("mpiflow: error: {prefix}{e}");
            std::process::exit(2);
        }
    };
    if let Some(note) = note.filter(|_| launcher_rank_hint(env).is_none_or(|r| r.trim() == "0")) {
        println!("{note}");
    }
    if set.is_empty() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.args(std::env::args_os().skip(1)).envs(set);
    let err = cmd.exec();
    // Could not re-execute: carry on with the environment as it is.
    say!("mpiflow: warning: could not re-execute to set the environment: {err}");
}
