//! Where each rank runs: the node's topology (hwloc, through `hwlocality`), a pinning plan
//! per local rank, and the number of BLAS threads that plan allows.
//!
//! Policies:
//! - `compact`: the node's cores in order (package, NUMA node, core) are cut into one
//!   contiguous block per local rank;
//! - `scatter`: local ranks are dealt round-robin over NUMA nodes, packages interleaved
//!   first, and each NUMA node's cores are cut into blocks among the ranks it received;
//! - `none`: no binding; BLAS threads = cores / local ranks.
//!
//! Ranks of one node never share a core while free cores remain; with more ranks than
//! cores, rank `i` gets core `i mod cores` (and one BLAS thread). A binding the launcher
//! already applied (`mpirun --bind-to`, `srun --cpu-bind`) is detected (the process's
//! affinity is narrower than the cores it may use) and kept: mpiflow then only sizes the
//! BLAS thread pool to it. Binding that hwloc cannot do here is a warning, not an error.
//!
//! The plan is computed on [`Machine`], a plain description of the node, so it is unit
//! tested on synthetic topologies; [`Machine::detect`] fills it from hwloc.

pub(crate) mod colocated;

use std::fmt::Write as _;

use hwlocality::cpu::binding::CpuBindingFlags;
use hwlocality::cpu::cpuset::CpuSet;
use hwlocality::object::types::ObjectType;
use hwlocality::Topology;

/// Errors from reading the topology.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    #[error("hwloc could not read this node's topology: {0}")]
    Detect(String),
}

/// One processing unit (hardware thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pu {
    /// The OS's CPU number.
    pub os: usize,
    /// Logical indices of its core, NUMA node and package.
    pub core: usize,
    pub numa: usize,
    pub package: usize,
}

/// A node, as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    pub pus: Vec<Pu>,
}

/// A pinning policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    #[default]
    Compact,
    Scatter,
    None,
}

impl crate::named::Named for Policy {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (
            Policy::Compact,
            "compact",
            "Consecutive cores per rank (the default)",
        ),
        (
            Policy::Scatter,
            "scatter",
            "Ranks spread over packages and NUMA nodes",
        ),
        (
            Policy::None,
            "none",
            "No binding; BLAS threads from the launcher's CPU set",
        ),
    ];
}

/// The plan for one local rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// OS CPU numbers to bind to; empty for no binding.
    pub cpus: Vec<usize>,
    pub blas_threads: usize,
}

impl Machine {
    /// `packages x numa x cores x pus` PUs, numbered like Linux numbers them (all first
    /// hardware threads, then the second ones).
    pub fn synthetic(
        packages: usize,
        numa_per_package: usize,
        cores_per_numa: usize,
        pus_per_core: usize,
    ) -> Machine {
        let cores = packages * numa_per_package * cores_per_numa;
        let mut pus = Vec::new();
        for t in 0..pus_per_core {
            for core in 0..cores {
                let numa = core / cores_per_numa;
                pus.push(Pu {
                    os: t * cores + core,
                    core,
                    numa,
                    package: numa / numa_per_package,
                });
            }
        }
        pus.sort_by_key(|p| p.os);
        Machine { pus }
    }

    /// This node, from hwloc (the PUs this process may use).
    pub fn detect() -> Result<Machine, TopologyError> {
        let topo = Topology::new().map_err(|e| TopologyError::Detect(e.to_string()))?;
        Ok(Self::from_topology(&topo))
    }

    fn from_topology(topo: &Topology) -> Machine {
        let allowed = topo.allowed_cpuset();
        let pus = topo
            .objects_with_type(ObjectType::PU)
            .filter_map(|pu| {
                let os = pu.os_index()?;
                if !allowed.is_set(os) {
                    return None;
                }
                let idx = |t: ObjectType| {
                    pu.first_ancestor_with_type(t)
                        .map_or(0, |o| o.logical_index())
                };
                let numa = pu
                    .nodeset()
                    .and_then(|n| n.first_set())
                    .map_or(0, usize::from);
                Some(Pu {
                    os,
                    core: idx(ObjectType::Core),
                    numa,
                    package: idx(ObjectType::Package),
                })
            })
            .collect();
        Machine { pus }
    }

    fn distinct(&self, f: impl Fn(&Pu) -> usize) -> Vec<usize> {
        let mut v: Vec<usize> = self.pus.iter().map(f).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    pub fn cores(&self) -> Vec<usize> {
        self.distinct(|p| p.core)
    }

    /// `1 package, 1 NUMA node, 2 cores, 2 PUs (OS 0-1)`.
    pub fn summary(&self) -> String {
        let n = |v: Vec<usize>| v.len();
        let plural = |k: usize, w: &str| format!("{k} {w}{}", if k == 1 { "" } else { "s" });
        format!(
            "{}, {}, {}, {} (OS {})",
            plural(n(self.distinct(|p| p.package)), "package"),
            plural(n(self.distinct(|p| p.numa)), "NUMA node"),
            plural(n(self.cores()), "core"),
            plural(self.pus.len(), "PU"),
            cpu_list(&self.pus.iter().map(|p| p.os).collect::<Vec<_>>())
        )
    }

    /// OS CPUs of the given cores.
    fn pus_of(&self, cores: &[usize]) -> Vec<usize> {
        let mut v: Vec<usize> = self
            .pus
            .iter()
            .filter(|p| cores.contains(&p.core))
            .map(|p| p.os)
            .collect();
        v.sort_unstable();
        v
    }

    /// The plan of local rank `local` of `count` on this node.
    pub fn plan(&self, local: usize, count: usize, policy: Policy) -> Plan {
        let cores = self.cores();
        let ncores = cores.len().max(1);
        let count = count.max(1);
        if policy == Policy::None {
            return Plan {
                cpus: Vec::new(),
                blas_threads: (ncores / count).max(1),
            };
        }
        if count > ncores {
            // Oversubscribed: no free core remains, so ranks share round-robin.
            let core = cores[local % ncores];
            return Plan {
                cpus: self.pus_of(&[core]),
                blas_threads: 1,
            };
        }
        let block = |list: &[usize], i: usize, n: usize| -> Vec<usize> {
            list[i * list.len() / n..(i + 1) * list.len() / n].to_vec()
        };
        let mine = match policy {
            Policy::Compact => {
                let mut ordered: Vec<(usize, usize, usize)> = cores
                    .iter()
                    .map(|c| {
                        let p = self
                            .pus
                            .iter()
                            .find(|p| p.core == *c)
                            .expect("core has a PU");
                        (p.package, p.numa, *c)
                    })
                    .collect();
                ordered.sort_unstable();
                let list: Vec<usize> = ordered.into_iter().map(|x| x.2).collect();
                block(&list, local, count)
            }
            _ => {
                // NUMA nodes in scatter order: packages interleaved first.
                let mut numas: Vec<(usize, usize)> = Vec::new(); // (rank within package, numa)
                for pkg in self.distinct(|p| p.package) {
                    let in_pkg =
                        self.distinct(|p| if p.package == pkg { p.numa } else { usize::MAX });
                    for (i, n) in in_pkg.into_iter().filter(|n| *n != usize::MAX).enumerate() {
                        numas.push((i, n));
                    }
                }
                let pkg_of = |n: usize| {
                    self.pus
                        .iter()
                        .find(|p| p.numa == n)
                        .map_or(0, |p| p.package)
                };
                numas.sort_by_key(|(i, n)| (*i, pkg_of(*n), *n));
                let domains: Vec<usize> = numas.into_iter().map(|x| x.1).collect();
                let d = local % domains.len();
                let ranks_here: Vec<usize> =
                    (0..count).filter(|r| r % domains.len() == d).collect();
                let pos = ranks_here
                    .iter()
                    .position(|r| *r == local)
                    .expect("rank in its domain");
                let list: Vec<usize> = {
                    let mut v: Vec<usize> = self
                        .pus
                        .iter()
                        .filter(|p| p.numa == domains[d])
                        .map(|p| p.core)
                        .collect();
                    v.sort_unstable();
                    v.dedup();
                    v
                };
                if list.len() >= ranks_here.len() {
                    block(&list, pos, ranks_here.len())
                } else {
                    vec![list[pos % list.len()]]
                }
            }
        };
        Plan {
            blas_threads: mine.len().max(1),
            cpus: self.pus_of(&mine),
        }
    }
}

/// `0-3,6`: a compact CPU list, as Linux writes them.
pub fn cpu_list(cpus: &[usize]) -> String {
    let mut v = cpus.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut out = String::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        if !out.is_empty() {
            out.push(',');
        }
        let _ = if j > i {
            write!(out, "{}-{}", v[i], v[j])
        } else {
            write!(out, "{}", v[i])
        };
        i = j + 1;
    }
    out
}

/// The CPUs this process may run on now (`sched_getaffinity`).
pub fn current_affinity() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity writes at most
    // size_of::<cpu_set_t>() bytes into it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|c| libc::CPU_ISSET(*c, &set))
            .collect()
    }
}

/// What pinning did on this rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pinning {
    pub cpus: Vec<usize>,
    pub blas_threads: usize,
    /// `mpiflow`, `launcher` (kept), or `none`.
    pub bound_by: &'static str,
    pub warning: Option<String>,
}

/// Applies `policy` for local rank `local` of `count`, unless the launcher already bound
/// this process; sets the BLAS thread count either way.
pub fn pin(local: usize, count: usize, policy: Policy) -> Pinning {
    let machine = match Machine::detect() {
        Ok(m) => m,
        Err(e) => {
            return Pinning {
                cpus: current_affinity(),
                blas_threads: 1,
                bound_by: "none",
                warning: Some(e.to_string()),
            };
        }
    };
    let all: Vec<usize> = machine.pus.iter().map(|p| p.os).collect();
    let now = current_affinity();
    let mut result = if !now.is_empty() && now.len() < all.len() {
        let cores: Vec<usize> = machine
            .pus
            .iter()
            .filter(|p| now.contains(&p.os))
            .map(|p| p.core)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        Pinning {
            blas_threads: cores.len().max(1),
            cpus: now,
            bound_by: "launcher",
            warning: None,
        }
    } else {
        let plan = machine.plan(local, count, policy);
        if plan.cpus.is_empty() {
            Pinning {
                cpus: now,
                blas_threads: plan.blas_threads,
                bound_by: "none",
                warning: None,
            }
        } else {
            match bind(&plan.cpus) {
                Ok(()) => Pinning {
                    cpus: current_affinity(),
                    blas_threads: plan.blas_threads,
                    bound_by: "mpiflow",
                    warning: None,
                },
                Err(e) => Pinning {
                    cpus: now,
                    blas_threads: plan.blas_threads,
                    bound_by: "none",
                    warning: Some(format!(
                        "could not bind to CPUs {}: {e}",
                        cpu_list(&plan.cpus)
                    )),
                },
            }
        }
    };
    crate::kernels::set_blas_threads(result.blas_threads);
    result.blas_threads = crate::kernels::blas_threads();
    result
}

/// Lets the whole process run on every CPU it may use (undoes a launcher's binding);
/// returns the CPUs it may run on after.
pub fn unbind() -> Result<Vec<usize>, String> {
    let machine = Machine::detect().map_err(|e| e.to_string())?;
    let all: Vec<usize> = machine.pus.iter().map(|p| p.os).collect();
    bind(&all)?;
    Ok(current_affinity())
}

/// Binds the whole process (threads started later inherit it) with `hwloc_set_cpubind`.
fn bind(cpus: &[usize]) -> Result<(), String> {
    let topo = Topology::new().map_err(|e| e.to_string())?;
    let set: CpuSet = cpus
        .iter()
        .map(|c| hwlocality::bitmap::BitmapIndex::try_from(*c).expect("CPU number fits"))
        .collect();
    topo.bind_cpu(&set, CpuBindingFlags::PROCESS)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_gives_contiguous_cores_and_hyperthreads() {
        let m = Machine::synthetic(2, 1, 4, 2); // 8 cores, 16 PUs, Linux numbering
        let p = m.plan(0, 2, Policy::Compact);
        assert_eq!(p.cpus, [0, 1, 2, 3, 8, 9, 10, 11]);
        assert_eq!(p.blas_threads, 4);
        assert_eq!(
            m.plan(1, 2, Policy::Compact).cpus,
            [4, 5, 6, 7, 12, 13, 14, 15]
        );
        assert_eq!(m.plan(3, 4, Policy::Compact).cpus, [6, 7, 14, 15]);
        assert_eq!(cpu_list(&m.plan(0, 2, Policy::Compact).cpus), "0-3,8-11");
    }

    #[test]
    fn scatter_spreads_over_packages_and_numa_first() {
        let m = Machine::synthetic(2, 2, 2, 1); // 2 packages x 2 NUMA x 2 cores
        let plans: Vec<Vec<usize>> = (0..4).map(|r| m.plan(r, 4, Policy::Scatter).cpus).collect();
        // Packages first: rank 0 on package 0, rank 1 on package 1, then the other NUMA nodes.
        assert_eq!(plans, vec![vec![0, 1], vec![4, 5], vec![2, 3], vec![6, 7]]);
        // Two ranks: one per package, each with a whole NUMA node.
        assert_eq!(m.plan(1, 2, Policy::Scatter).cpus, [4, 5]);
        // Eight ranks: one core each, no sharing.
        let all: Vec<usize> = (0..8)
            .flat_map(|r| m.plan(r, 8, Policy::Scatter).cpus)
            .collect();
        let mut sorted = all.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn no_core_is_shared_while_one_is_free() {
        let m = Machine::synthetic(1, 1, 6, 1);
        for count in 1..=6 {
            for policy in [Policy::Compact, Policy::Scatter] {
                let mut used: Vec<usize> = (0..count)
                    .flat_map(|r| m.plan(r, count, policy).cpus)
                    .collect();
                let n = used.len();
                used.sort_unstable();
                used.dedup();
                assert_eq!(used.len(), n, "{count} ranks {policy:?}");
            }
        }
        // Oversubscribed: 4 ranks on 2 cores share round-robin, one BLAS thread each.
        let two = Machine::synthetic(1, 1, 2, 1);
        let p: Vec<Plan> = (0..4).map(|r| two.plan(r, 4, Policy::Compact)).collect();
        assert_eq!(
            p.iter().map(|x| x.cpus.clone()).collect::<Vec<_>>(),
            vec![vec![0], vec![1], vec![0], vec![1]]
        );
        assert!(p.iter().all(|x| x.blas_threads == 1));
        assert_eq!(
            two.plan(0, 4, Policy::None),
            Plan {
                cpus: vec![],
                blas_threads: 1
            }
        );
    }

    #[test]
    fn this_node_is_readable() {
        let m = Machine::detect().unwrap();
        assert!(!m.pus.is_empty());
        assert!(m.summary().contains("core"));
    }
}
