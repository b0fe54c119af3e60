//! The Slurm resolver for steps started by `srun` without MPI: rank, task count and the
//! host of every rank from Slurm's environment variables.
//!
//! Without MPI a process cannot ask the others where they run, so the host of each rank is
//! derived from the node list, the tasks per node and `SLURM_DISTRIBUTION` (block, the
//! default, or cyclic), as TensorFlow's `SlurmClusterResolver` does. Unlike it, mpiflow
//! checks the derivation against this process's own node (`SLURMD_NODENAME`) and refuses
//! a mismatch instead of building a wrong cluster.
//!
//! Under `mpirun` inside an allocation `SLURM_PROCID` is the node index, not the rank: the
//! MPI resolver is used there, never this one.

use std::collections::BTreeMap;

use super::hostlist::{expand_hosts, expand_tasks_per_node, HostlistError};

/// Errors from reading Slurm's environment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlurmError {
    #[error("Slurm: {var} is not set (not inside an srun step?)")]
    Missing { var: String },
    #[error("Slurm: {var}={value:?} is not a non-negative integer")]
    NotNumber { var: String, value: String },
    #[error("Slurm: {0}")]
    Hostlist(#[from] HostlistError),
    #[error(
        "Slurm: node list has {hosts} nodes but tasks per node {tasks:?} has {counts} entries"
    )]
    CountMismatch {
        hosts: usize,
        tasks: String,
        counts: usize,
    },
    #[error("Slurm: requested {requested} tasks but only {assigned} were assigned")]
    TaskMismatch { requested: usize, assigned: usize },
    #[error("Slurm: SLURM_PROCID={rank} is not below the number of tasks {ntasks}")]
    RankOutOfRange { rank: usize, ntasks: usize },
    #[error("Slurm: this process was started by mpirun ({var}={rank}), where SLURM_PROCID={procid} numbers nodes, not ranks; take the cluster from MPI (--from mpi)")]
    StartedByMpirun {
        var: String,
        rank: String,
        procid: String,
    },
    #[error("Slurm: rank {rank}: distribution {dist:?} is not supported without MPI (use srun --mpi=pmix)")]
    Distribution { rank: usize, dist: String },
    #[error("Slurm: rank {rank} runs on {actual} but the {dist} distribution puts it on {expected}; launch with srun --mpi=pmix so hosts come from MPI")]
    WrongNode {
        rank: usize,
        actual: String,
        expected: String,
        dist: String,
    },
}

/// What Slurm tells one task about its step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmStep {
    pub rank: usize,
    /// Host of every rank of the step.
    pub hosts: Vec<String>,
}

fn first<'a>(env: &'a BTreeMap<String, String>, vars: &[&str]) -> Result<&'a str, SlurmError> {
    vars.iter()
        .find_map(|v| env.get(*v).map(String::as_str))
        .ok_or_else(|| SlurmError::Missing {
            var: vars.join(" or "),
        })
}

fn number(env: &BTreeMap<String, String>, vars: &[&str]) -> Result<usize, SlurmError> {
    let value = first(env, vars)?;
    value.trim().parse().map_err(|_| SlurmError::NotNumber {
        var: vars
            .iter()
            .find(|v| env.contains_key(**v))
            .unwrap_or(&vars[0])
            .to_string(),
        value: value.into(),
    })
}

/// True if the environment looks like a Slurm step (or batch script).
pub fn detected(env: &BTreeMap<String, String>) -> bool {
    env.contains_key("SLURM_PROCID") && env.contains_key("SLURM_JOB_ID")
}

impl SlurmStep {
    /// Reads the step from environment variables (pass `std::env::vars().collect()`).
    pub fn from_env(env: &BTreeMap<String, String>) -> Result<SlurmStep, SlurmError> {
        let rank = number(env, &["SLURM_PROCID"])?;
        // mpirun inside an allocation starts one daemon per node with srun: its ranks see
        // that daemon's step (SLURM_PROCID = node index, one task per node).
        if let Some((var, r)) = ["OMPI_COMM_WORLD_RANK", "MPI_LOCALNRANKS"]
            .iter()
            .find_map(|v| env.get(*v).map(|r| (*v, r)))
        {
            return Err(SlurmError::StartedByMpirun {
                var: var.into(),
                rank: r.clone(),
                procid: rank.to_string(),
            });
        }
        let ntasks = number(env, &["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"])?;
        let nodes = expand_hosts(first(
            env,
            &[
                "SLURM_STEP_NODELIST",
                "SLURM_JOB_NODELIST",
                "SLURM_NODELIST",
            ],
        )?)?;
        let tasks_text = first(env, &["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"])?;
        let per_node = expand_tasks_per_node(tasks_text)?;
        if per_node.len() != nodes.len() {
            return Err(SlurmError::CountMismatch {
                hosts: nodes.len(),
                tasks: tasks_text.into(),
                counts: per_node.len(),
            });
        }
        let assigned: usize = per_node.iter().sum();
        if assigned != ntasks {
            return Err(SlurmError::TaskMismatch {
                requested: ntasks,
                assigned,
            });
        }
        if rank >= ntasks {
            return Err(SlurmError::RankOutOfRange { rank, ntasks });
        }
        let dist_full = env
            .get("SLURM_DISTRIBUTION")
            .map_or("block", String::as_str);
        let dist = dist_full.split([':', ',']).next().unwrap_or("block");
        let hosts = match dist {
            "block" | "" => nodes
                .iter()
                .zip(&per_node)
                .flat_map(|(h, n)| std::iter::repeat_n(h.clone(), *n))
                .collect::<Vec<_>>(),
            "cyclic" => {
                let mut left = per_node.clone();
                let mut out = Vec::with_capacity(ntasks);
                while out.len() < ntasks {
                    for (h, l) in nodes.iter().zip(left.iter_mut()) {
                        if *l > 0 {
                            out.push(h.clone());
                            *l -= 1;
                        }
                    }
                }
                out
            }
            _ => {
                return Err(SlurmError::Distribution {
                    rank,
                    dist: dist_full.into(),
                })
            }
        };
        if let Some(actual) = env.get("SLURMD_NODENAME") {
            if *actual != hosts[rank] {
                return Err(SlurmError::WrongNode {
                    rank,
                    actual: actual.clone(),
                    expected: hosts[rank].clone(),
                    dist: dist.into(),
                });
            }
        }
        Ok(SlurmStep { rank, hosts })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::env;

    #[test]
    fn block_and_cyclic() {
        let mut e = env(&[
            ("SLURM_JOB_ID", "7"),
            ("SLURM_PROCID", "3"),
            ("SLURM_STEP_NUM_TASKS", "5"),
            ("SLURM_STEP_NODELIST", "node[1-3]"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2),1"),
            ("SLURMD_NODENAME", "node2"),
        ]);
        assert!(detected(&e));
        let s = SlurmStep::from_env(&e).unwrap();
        assert_eq!(s.hosts, ["node1", "node1", "node2", "node2", "node3"]);
        e.insert("SLURM_DISTRIBUTION".into(), "cyclic".into());
        e.insert("SLURMD_NODENAME".into(), "node1".into());
        let s = SlurmStep::from_env(&e).unwrap();
        assert_eq!(s.hosts, ["node1", "node2", "node3", "node1", "node2"]);
    }

    #[test]
    fn falls_back_to_job_variables() {
        let e = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "n[009-010]"),
            ("SLURM_TASKS_PER_NODE", "1(x2)"),
        ]);
        assert_eq!(SlurmStep::from_env(&e).unwrap().hosts, ["n009", "n010"]);
    }

    #[test]
    fn bad_slurm_environments() {
        let base = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_JOB_NODELIST", "node[1-2]"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
        ];
        let with = |k: &str, v: Option<&str>| {
            let mut e = env(&base);
            match v {
                Some(v) => e.insert(k.into(), v.into()),
                None => e.remove(k),
            };
            SlurmStep::from_env(&e).unwrap_err().to_string()
        };
        assert!(with("SLURM_PROCID", None).contains("SLURM_PROCID is not set"));
        assert!(with("SLURM_PROCID", Some("x")).contains("SLURM_PROCID=\"x\""));
        assert!(with("SLURM_PROCID", Some("4")).contains("not below the number of tasks 4"));
        assert!(
            with("SLURM_NTASKS", Some("6")).contains("requested 6 tasks but only 4 were assigned")
        );
        assert!(
            with("SLURM_JOB_NODELIST", Some("node[1-3]")).contains("3 nodes but tasks per node")
        );
        assert!(with("SLURM_JOB_NODELIST", Some("node[1-")).contains("unclosed"));
        assert!(with("SLURM_TASKS_PER_NODE", Some("2(x")).contains("not N or N(xM)"));
        assert!(with("OMPI_COMM_WORLD_RANK", Some("5"))
            .contains("started by mpirun (OMPI_COMM_WORLD_RANK=5), where SLURM_PROCID=0"));
        assert!(with("SLURM_DISTRIBUTION", Some("plane=2")).contains("not supported without MPI"));
        assert!(with("SLURMD_NODENAME", Some("node2"))
            .contains("rank 0 runs on node2 but the block distribution puts it on node1"));
    }
}
