//! Which thread level a job may ask MPI for, decided before `MPI_Init`.
//!
//! A second thread that talks MPI (the stall watch, the overlapped allreduce) needs
//! `MPI_THREAD_MULTIPLE`. Open MPI before 5 keeps the one-sided windows of a job whose ranks
//! span hosts without an RDMA network in its `osc pt2pt` component, which refuses to create
//! a window in a process holding that level (`MPI_Win_allocate` fails with `MPI_ERR_WIN`).
//! The level is fixed at initialisation, so the question is answered from the launcher's
//! variables and the library's version string, both readable before `MPI_Init`.

use std::collections::BTreeMap;

/// How many hosts the launcher says the job spans, when it says (at least that many when
/// the ranks are spread unevenly: only this host's count is known).
pub fn hosts(env: &BTreeMap<String, String>) -> Option<usize> {
    let num = |v: &str| env.get(v).and_then(|x| x.trim().parse::<usize>().ok());
    // Open MPI's mpirun: ranks on this host against ranks in all.
    if let (Some(local), Some(size)) = (
        num("OMPI_COMM_WORLD_LOCAL_SIZE"),
        num("OMPI_COMM_WORLD_SIZE"),
    ) {
        return Some(if local >= size {
            1
        } else {
            2.max(size.div_ceil(local.max(1)))
        });
    }
    // MPICH's hydra.
    if let (Some(local), Some(size)) = (num("MPI_LOCALNRANKS"), num("PMI_SIZE")) {
        return Some(if local >= size {
            1
        } else {
            2.max(size.div_ceil(local.max(1)))
        });
    }
    // srun (a step), or mpirun inside an allocation that did not say.
    num("SLURM_STEP_NUM_NODES").or_else(|| num("SLURM_NNODES"))
}

/// The major version of Open MPI named by `MPI_Get_library_version`'s string, `None` for
/// another library.
pub fn open_mpi_major(library: &str) -> Option<u32> {
    let rest = &library[library.find("Open MPI v")? + "Open MPI v".len()..];
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// Why this job's one-sided windows cannot live in a process with `MPI_THREAD_MULTIPLE`,
/// or `None` when they can: Open MPI before 5, ranks on more than one host, and the
/// one-sided components limited to a list naming `pt2pt` (`OMPI_MCA_osc`, as mpiflow sets
/// it on a machine without an RDMA device) without UCX (`osc ucx`, or `pml ucx`). On an
/// RDMA cluster the default component (`osc ucx` or `osc rdma`) takes the level.
pub fn windows_refuse_threads(library: &str, env: &BTreeMap<String, String>) -> Option<String> {
    let major = open_mpi_major(library)?;
    if major >= 5 {
        return None;
    }
    hosts(env).filter(|n| *n > 1)?;
    let named = |v: &str, what: &str| env.get(v).is_some_and(|x| x.contains(what));
    if !named("OMPI_MCA_osc", "pt2pt")
        || named("OMPI_MCA_osc", "ucx")
        || named("OMPI_MCA_pml", "ucx")
    {
        return None;
    }
    Some(format!(
        "Open MPI {major}'s one-sided windows between hosts (osc pt2pt) refuse \
         MPI_THREAD_MULTIPLE"
    ))
}

/// The version string of the MPI library this process runs (callable before `MPI_Init`).
pub fn library() -> String {
    mpi::environment::library_version().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::env;

    const OMPI4: &str =
        "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022";
    const OMPI5: &str = "Open MPI v5.0.3, package: Open MPI, ident: 5.0.3";
    const MPICH: &str = "MPICH Version:      4.0\nMPICH Release date: Fri Jan 21 10:42:29 CST 2022";

    #[test]
    fn the_launchers_say_how_many_hosts() {
        let two = [
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
        ];
        assert_eq!(hosts(&env(&two)), Some(2));
        let one = [
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
        ];
        assert_eq!(hosts(&env(&one)), Some(1));
        // Uneven: 1 here of 4 still spans at least two hosts.
        let uneven = [
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
        ];
        assert_eq!(hosts(&env(&uneven)), Some(2));
        assert_eq!(
            hosts(&env(&[("MPI_LOCALNRANKS", "1"), ("PMI_SIZE", "3")])),
            Some(3)
        );
        assert_eq!(hosts(&env(&[("SLURM_STEP_NUM_NODES", "3")])), Some(3));
        assert_eq!(hosts(&env(&[("SLURM_NNODES", "x")])), None);
        assert_eq!(hosts(&env(&[])), None);
    }

    #[test]
    fn the_library_string_names_open_mpi_and_its_major_version() {
        assert_eq!(open_mpi_major(OMPI4), Some(4));
        assert_eq!(open_mpi_major(OMPI5), Some(5));
        assert_eq!(open_mpi_major(MPICH), None);
        assert_eq!(open_mpi_major(""), None);
    }

    #[test]
    fn only_open_mpi_4_between_hosts_without_ucx_refuses() {
        let spans = [
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_MCA_osc", "sm,pt2pt"),
        ];
        let why = windows_refuse_threads(OMPI4, &env(&spans)).expect("refused");
        assert!(
            why.contains("between hosts") && why.contains("MPI_THREAD_MULTIPLE"),
            "{why}"
        );
        assert_eq!(windows_refuse_threads(OMPI5, &env(&spans)), None);
        assert_eq!(windows_refuse_threads(MPICH, &env(&spans)), None);
        let one = [
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
        ];
        assert_eq!(windows_refuse_threads(OMPI4, &env(&one)), None);
        let mut ucx = env(&spans);
        ucx.insert("OMPI_MCA_pml".into(), "ucx".into());
        assert_eq!(windows_refuse_threads(OMPI4, &ucx), None);
        // An RDMA cluster: the library's own choice of component (osc ucx or rdma).
        let mut default = env(&spans);
        default.remove("OMPI_MCA_osc");
        assert_eq!(windows_refuse_threads(OMPI4, &default), None);
    }
}
