//! Rank-to-role mapping and the resulting [`Layout`]: which rank is which task, where.
//!
//! Policies (`--placement`):
//! - `block`: the first `ps` ranks are the ps tasks, as TensorFlow's Slurm resolver does.
//! - `spread`: ps tasks are dealt round-robin over hosts (in order of each host's first
//!   rank), each host giving its lowest free rank, so two ps never share a host while a host
//!   without one remains.
//!
//! Of the ranks left, in rank order: the chief (with `--chief`) takes the lowest, the
//! evaluator (with `--evaluator`) the highest, and the workers the rest. ps task indices
//! follow rank order.
//!
//! With `--stages S` the rest are not workers but R model replicas of S stages each (the
//! seeds' mapping: a job per replica, a task per stage): jobs `replica_0` to
//! `replica_{R-1}`, task s of each its stage s. Each host holds as many whole replicas as
//! its ranks allow (pipeline traffic stays inside a node); the hosts' leftover ranks, in
//! host order, make the others. Replicas are numbered by their lowest rank.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::spec::{replica_job, Address, ClusterSpec, SpecError, TaskId};
use super::tf_config::TfConfig;

/// Errors from mapping ranks onto roles.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MappingError {
    #[error("--ps {ps} must be smaller than the number of ranks ({ranks})")]
    TooManyPs { ps: usize, ranks: usize },
    #[error("{ranks} ranks are too few for --ps {ps}{extra}: need at least {need}")]
    TooFewRanks {
        ranks: usize,
        ps: usize,
        extra: String,
        need: usize,
    },
    #[error("--stages {stages}: the {ranks} ranks left for replicas{after} do not divide into replicas of {stages} stages")]
    StagesDoNotDivide {
        stages: usize,
        ranks: usize,
        after: String,
    },
    #[error("--stages must be 1 or more")]
    NoStages,
    #[error("port {base} + {offset} for rank {rank} on {host} is above 65535 (lower --port-base)")]
    PortOutOfRange {
        rank: usize,
        host: String,
        base: u16,
        offset: usize,
    },
    #[error("{0}")]
    Spec(#[from] SpecError),
}

/// Where ps tasks go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// The first N ranks.
    #[default]
    Block,
    /// One per host first, round-robin over hosts.
    Spread,
}

impl crate::named::Named for Placement {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (Placement::Block, "block", "The first N ranks"),
        (
            Placement::Spread,
            "spread",
            "One per host first, round-robin over hosts",
        ),
    ];
}

/// The mapping flags every rank must agree on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MappingOptions {
    pub ps: usize,
    pub chief: bool,
    pub evaluator: bool,
    pub placement: Placement,
    /// Replicas of this many stages instead of workers (`--stages`); `None`: workers.
    pub stages: Option<usize>,
}

/// The task of each rank, given the host of each rank.
pub fn assign_roles(hosts: &[String], opts: &MappingOptions) -> Result<Vec<TaskId>, MappingError> {
    let n = hosts.len();
    if opts.ps > 0 && opts.ps >= n {
        return Err(MappingError::TooManyPs {
            ps: opts.ps,
            ranks: n,
        });
    }
    // At least one task must compute: a chief, or else a worker; with stages, a replica.
    let computing = match opts.stages {
        Some(s) => s,
        None => usize::from(!opts.chief),
    };
    let need = opts.ps + usize::from(opts.chief) + usize::from(opts.evaluator) + computing;
    if need > n {
        let mut extra = role_flags(opts);
        if let Some(s) = opts.stages {
            extra.push_str(&format!(" --stages {s}"));
        }
        return Err(MappingError::TooFewRanks {
            ranks: n,
            ps: opts.ps,
            extra,
            need,
        });
    }
    let mut ps_ranks = match opts.placement {
        Placement::Block => (0..opts.ps).collect::<Vec<_>>(),
        Placement::Spread => spread(hosts, opts.ps),
    };
    ps_ranks.sort_unstable();
    let mut tasks: Vec<Option<TaskId>> = vec![None; n];
    for (i, r) in ps_ranks.iter().enumerate() {
        tasks[*r] = Some(TaskId::new("ps", i));
    }
    let mut rest: Vec<usize> = (0..n).filter(|r| tasks[*r].is_none()).collect();
    if opts.chief {
        tasks[rest.remove(0)] = Some(TaskId::new("chief", 0));
    }
    if opts.evaluator {
        let last = rest.pop().expect("checked above: enough ranks");
        tasks[last] = Some(TaskId::new("evaluator", 0));
    }
    match opts.stages {
        None => {
            for (i, r) in rest.into_iter().enumerate() {
                tasks[r] = Some(TaskId::new("worker", i));
            }
        }
        Some(stages) => {
            for (i, r) in replica_order(hosts, rest, stages, opts)?
                .into_iter()
                .enumerate()
            {
                tasks[r] = Some(TaskId::new(replica_job(i / stages), i % stages));
            }
        }
    }
    Ok(tasks
        .into_iter()
        .map(|t| t.expect("every rank assigned"))
        .collect())
}

/// ` --chief` and ` --evaluator` as they were asked for: what the errors name beside `--ps`.
fn role_flags(opts: &MappingOptions) -> String {
    let mut flags = String::new();
    if opts.chief {
        flags.push_str(" --chief");
    }
    if opts.evaluator {
        flags.push_str(" --evaluator");
    }
    flags
}

/// The ranks left for replicas of `stages` stages, in replica order (taken `stages` at a
/// time they make the replicas, stage by stage): as many whole replicas inside each host as
/// it holds, then the hosts' leftovers together.
fn replica_order(
    hosts: &[String],
    rest: Vec<usize>,
    stages: usize,
    opts: &MappingOptions,
) -> Result<Vec<usize>, MappingError> {
    if stages == 0 {
        return Err(MappingError::NoStages);
    }
    if !rest.len().is_multiple_of(stages) {
        let ps = match opts.ps {
            0 => String::new(),
            n => format!(" --ps {n}"),
        };
        let mut after = ps + &role_flags(opts);
        if !after.is_empty() {
            after = format!(" after{after}");
        }
        return Err(MappingError::StagesDoNotDivide {
            stages,
            ranks: rest.len(),
            after,
        });
    }
    // Whole replicas inside each host first; the hosts' leftovers, in host order, make
    // the rest (each spanning as few hosts as the leftovers allow).
    let mut replicas: Vec<Vec<usize>> = Vec::new();
    let mut leftovers = Vec::new();
    for rs in by_host(hosts, rest) {
        let whole = rs.len() / stages * stages;
        replicas.extend(rs[..whole].chunks(stages).map(<[usize]>::to_vec));
        leftovers.extend_from_slice(&rs[whole..]);
    }
    replicas.extend(leftovers.chunks(stages).map(<[usize]>::to_vec));
    // Replica numbers follow each replica's lowest rank.
    replicas.sort_by_key(|r| r[0]);
    Ok(replicas.concat())
}

/// `ranks` grouped by their host: each host's ranks in the order given, hosts in order of
/// their first rank there.
fn by_host(hosts: &[String], ranks: impl IntoIterator<Item = usize>) -> Vec<Vec<usize>> {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for r in ranks {
        match groups.iter_mut().find(|(h, _)| *h == hosts[r]) {
            Some((_, rs)) => rs.push(r),
            None => groups.push((hosts[r].as_str(), vec![r])),
        }
    }
    groups.into_iter().map(|(_, rs)| rs).collect()
}

/// `count` ranks dealt round-robin over hosts in order of first appearance.
fn spread(hosts: &[String], count: usize) -> Vec<usize> {
    let mut queues: Vec<std::collections::VecDeque<usize>> = by_host(hosts, 0..hosts.len())
        .into_iter()
        .map(Into::into)
        .collect();
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        for q in queues.iter_mut() {
            if out.len() < count {
                if let Some(r) = q.pop_front() {
                    out.push(r);
                }
            }
        }
    }
    out
}

/// Index of each rank among the ranks of its host, in rank order.
pub fn local_ranks(hosts: &[String]) -> Vec<usize> {
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    hosts
        .iter()
        .map(|h| {
            let c = seen.entry(h).or_insert(0);
            *c += 1;
            *c - 1
        })
        .collect()
}

/// Ports `base + local rank`, for layouts that cannot probe (previews, Slurm without MPI).
pub fn sequential_ports(hosts: &[String], base: u16) -> Result<Vec<u16>, MappingError> {
    local_ranks(hosts)
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            u16::try_from(base as usize + l).map_err(|_| MappingError::PortOutOfRange {
                rank,
                host: hosts[rank].clone(),
                base,
                offset: l,
            })
        })
        .collect()
}

/// One process of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    /// The MPI (or Slurm) rank; `None` where the cluster came from TF_CONFIG or flags.
    pub rank: Option<usize>,
    pub host: String,
    pub local_rank: Option<usize>,
    pub task: TaskId,
    pub address: Address,
}

/// The whole cluster: every process, and the ClusterSpec they all share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub ranks: Vec<RankInfo>,
    pub spec: ClusterSpec,
    /// `rpc_layer` and `environment` passed through to every task's TF_CONFIG.
    pub rpc_layer: Option<String>,
    pub environment: Option<String>,
}

impl Layout {
    /// `n` ranks on one host named `node` with ports `1..=n`: the layout of in-process
    /// runs and benchmarks, whose tasks need roles but never addresses.
    pub fn single_host(n: usize, opts: &MappingOptions) -> Result<Layout, MappingError> {
        let hosts = vec!["node".to_string(); n];
        let ports: Vec<u16> = (1..=n as u16).collect();
        Layout::from_ranks(&hosts, &ports, assign_roles(&hosts, opts)?)
    }

    /// Builds the layout of ranks `0..n` from their hosts, ports and tasks.
    pub fn from_ranks(
        hosts: &[String],
        ports: &[u16],
        tasks: Vec<TaskId>,
    ) -> Result<Layout, MappingError> {
        let locals = local_ranks(hosts);
        let mut spec = ClusterSpec::new();
        let mut ranks = Vec::with_capacity(hosts.len());
        for (r, task) in tasks.into_iter().enumerate() {
            let address = Address {
                host: hosts[r].clone(),
                port: ports[r],
            };
            spec.add_task(&task, &address.to_string())?;
            ranks.push(RankInfo {
                rank: Some(r),
                host: hosts[r].clone(),
                local_rank: Some(locals[r]),
                task,
                address,
            });
        }
        spec.validate()?;
        Ok(Layout {
            ranks,
            spec,
            rpc_layer: None,
            environment: None,
        })
    }

    /// The layout described by a TF_CONFIG (ranks unknown); keeps its rpc_layer and environment.
    pub fn from_tf_config(config: &TfConfig) -> Layout {
        let ranks = config
            .cluster
            .tasks()
            .map(|(task, a)| RankInfo {
                rank: None,
                host: a.host.clone(),
                local_rank: None,
                task,
                address: a.clone(),
            })
            .collect();
        Layout {
            ranks,
            spec: config.cluster.clone(),
            rpc_layer: config.rpc_layer.clone(),
            environment: config.environment.clone(),
        }
    }

    /// The entry of a task.
    pub fn find(&self, task: &TaskId) -> Option<&RankInfo> {
        self.ranks.iter().find(|r| &r.task == task)
    }

    /// TF_CONFIG for one process of the layout.
    pub fn tf_config(&self, who: &RankInfo) -> TfConfig {
        TfConfig {
            rpc_layer: self.rpc_layer.clone(),
            environment: self.environment.clone(),
            ..TfConfig::new(self.spec.clone(), who.task.clone())
        }
    }

    /// Number of distinct hosts.
    pub fn num_hosts(&self) -> usize {
        let mut hosts: Vec<&str> = self.ranks.iter().map(|r| r.host.as_str()).collect();
        hosts.sort_unstable();
        hosts.dedup();
        hosts.len()
    }

    /// The table printed by `mpiflow spec --format table`.
    pub fn table(&self, source: &str) -> String {
        let jobs: Vec<String> = self
            .spec
            .jobs()
            .into_iter()
            .map(|j| format!("{j}={}", self.spec.num_tasks(j).unwrap_or(0)))
            .collect();
        let hosts = self.num_hosts();
        let mut out = format!(
            "# mpiflow cluster ({source}): {} tasks on {hosts} host{}: {}\n",
            self.ranks.len(),
            if hosts == 1 { "" } else { "s" },
            jobs.join(" ")
        );
        let w_host = self
            .ranks
            .iter()
            .map(|r| r.host.len())
            .max()
            .unwrap_or(4)
            .max(4);
        let w_addr = self
            .ranks
            .iter()
            .map(|r| r.address.to_string().len())
            .max()
            .unwrap_or(7)
            .max(7);
        let opt = |v: Option<usize>| v.map_or("-".to_string(), |v| v.to_string());
        let _ = writeln!(
            out,
            "{:<5} {:<w_host$} {:<5} {:<9} {:<4} {:<w_addr$}",
            "rank", "host", "local", "job", "task", "address"
        );
        for r in &self.ranks {
            let _ = writeln!(
                out,
                "{:<5} {:<w_host$} {:<5} {:<9} {:<4} {:<w_addr$}",
                opt(r.rank),
                r.host,
                opt(r.local_rank),
                r.task.job,
                r.task.index,
                r.address.to_string()
            );
        }
        out.lines()
            .map(str::trim_end)
            .collect::<Vec<_>>()
            .join("\n")
            + "\n"
    }
}

#[cfg(test)]
mod tests;
