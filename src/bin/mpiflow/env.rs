//! The environment the libraries read before `main` can act (OpenBLAS when it loads,
//! OpenMPI in `MPI_Init`), set by re-executing the process, for the commands that compute.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;

use crate::args::Cmd;
use crate::out::say;

/// Variables that must be set before the libraries read them (OpenBLAS when it loads,
/// before `main`; OpenMPI in `MPI_Init`), for the commands that compute. Empty when the
/// environment already has them (a user's own choice is inherited as it is).
///
/// - `OPENBLAS_NUM_THREADS` (default: every core) and `OPENBLAS_CORETYPE` (see
///   [`mpiflow::kernels::openblas_coretype`]): threads OpenBLAS does not use still compete
///   with the other ranks of the node (measured: 2 pinned ranks train 1.4x faster with the
///   variable set). Set from the rank's share of the node: the launcher's binding, or
///   cores divided by the ranks the launcher put on this node.
/// - `OMPI_MCA_osc` (one-sided windows), when the machine has no RDMA device: OpenMPI's
///   default `osc rdma` then emulates atomics over shared memory and crashes in
///   `MPI_Compare_and_swap` (OpenMPI 4.1.4), and fails over TCP. `sm,pt2pt` picks shared
///   memory within a node and point-to-point emulation across nodes.
pub(crate) fn env_before_init(
    cmd: &Cmd,
    env: &BTreeMap<String, String>,
) -> Vec<(&'static str, String)> {
    let computes = match cmd {
        Cmd::Train(_) | Cmd::Bench(_) | Cmd::Check(_) | Cmd::Topo(_) => true,
        Cmd::Spec(_) | Cmd::Launch(_) | Cmd::Supervise(_) | Cmd::Plot(_) => false,
    };
    let mut set = Vec::new();
    if !computes {
        return set;
    }
    if !env.contains_key("OMPI_MCA_osc") && mpiflow::transport::rma::rdma_devices().is_empty() {
        set.push((
            "OMPI_MCA_osc",
            mpiflow::transport::rma::OSC_WITHOUT_RDMA.to_string(),
        ));
    }
    if env.contains_key("OPENBLAS_NUM_THREADS") {
        return set;
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
    set
}

/// Sets [`env_before_init`]'s variables by re-executing the same process (same PID, so
/// mpirun and srun keep tracking it), before MPI is initialised.
pub(crate) fn reexec_with_env(cmd: &Cmd, env: &BTreeMap<String, String>) {
    let set = env_before_init(cmd, env);
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
