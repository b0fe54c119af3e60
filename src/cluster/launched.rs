//! The job as its MPI launcher's variables tell it, without initialising MPI.
//!
//! A process that initialises MPI takes its rank's identity: after that, a program it
//! `exec`s (an mpi4py script, Horovod, a C MPI code) cannot initialise MPI as the same rank
//! (Open MPI's `MPI_Init` fails with "getting local rank failed"). `mpiflow launch` must
//! therefore learn the cluster from what the launcher already exported where it can:
//!
//! - Open MPI's `mpirun`: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` and
//!   `OMPI_COMM_WORLD_LOCAL_SIZE`. When the local size is the whole job, every rank runs on
//!   this host. Across hosts the variables hold no host list: MPI (or a hostfile) must say.
//! - MPICH's Hydra: `PMI_RANK`, `PMI_SIZE` and `MPI_LOCALNRANKS`, likewise.
//! - Slurm's `srun`: its variables describe the whole step ([`super::slurm`]).

use std::collections::BTreeMap;

/// Where this process stands in a job whose every rank runs on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OneHost {
    pub rank: usize,
    pub size: usize,
}

/// What the launcher's variables say about the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Launched {
    /// Every rank on this host.
    OneHost(OneHost),
    /// Ranks on several hosts, which the variables do not name (`launcher`: whose).
    Hosts {
        launcher: &'static str,
        nodes: usize,
    },
    /// No MPI launcher's variables (or Slurm's step: [`super::slurm`] reads those).
    Unknown,
}

fn number(env: &BTreeMap<String, String>, var: &str) -> Option<usize> {
    env.get(var)?.trim().parse().ok()
}

/// This process's rank and the job's size, as Open MPI's or Hydra's variables say.
pub fn rank_and_size(env: &BTreeMap<String, String>) -> Option<(usize, usize)> {
    [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
    ]
    .iter()
    .find_map(|(r, s)| Some((number(env, r)?, number(env, s)?)))
    .filter(|(r, s)| r < s)
}

/// The job as Open MPI's or Hydra's variables describe it.
pub fn from_env(env: &BTreeMap<String, String>) -> Launched {
    let launchers = [
        (
            "Open MPI's mpirun",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        ("MPICH's mpiexec", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"),
    ];
    for (launcher, rank, size, local) in launchers {
        let (Some(rank), Some(size), Some(local)) =
            (number(env, rank), number(env, size), number(env, local))
        else {
            continue;
        };
        if rank >= size || local == 0 || local > size {
            return Launched::Unknown;
        }
        if local == size {
            return Launched::OneHost(OneHost { rank, size });
        }
        let nodes = number(env, "OMPI_MCA_orte_num_nodes").unwrap_or(0);
        return Launched::Hosts { launcher, nodes };
    }
    Launched::Unknown
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::env;

    #[test]
    fn one_host_jobs_are_known_from_their_launchers_variables() {
        let ompi = env(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ]);
        assert_eq!(
            from_env(&ompi),
            Launched::OneHost(OneHost { rank: 2, size: 4 })
        );
        let hydra = env(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "3"),
            ("MPI_LOCALNRANKS", "3"),
        ]);
        assert_eq!(
            from_env(&hydra),
            Launched::OneHost(OneHost { rank: 0, size: 3 })
        );
    }

    #[test]
    fn jobs_across_hosts_and_nonsense_are_not_guessed() {
        let two = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("OMPI_MCA_orte_num_nodes", "2"),
        ]);
        assert_eq!(
            from_env(&two),
            Launched::Hosts {
                launcher: "Open MPI's mpirun",
                nodes: 2
            }
        );
        let bad = env(&[
            ("OMPI_COMM_WORLD_RANK", "4"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ]);
        assert_eq!(from_env(&bad), Launched::Unknown);
        assert_eq!(from_env(&env(&[("SLURM_PROCID", "0")])), Launched::Unknown);
    }
}
