//! A training step predicted: a worker's compute and the communication it waits for, by
//! mode, on any number of hosts.

use super::cost::{hierarchical, ps_step, Cluster, Links};
use super::workload::Workload;

/// How the workers combine their gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Synchronous replicas: the hierarchical allreduce, then each applies the update.
    Allreduce,
    /// Synchronous parameter servers: push, the ps sums and applies, pull.
    Ps,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Allreduce => "allreduce",
            Mode::Ps => "ps",
        })
    }
}

/// One worker's step, seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    /// Work a worker does alone (gradients; in allreduce mode also the update).
    pub compute: f64,
    /// What it waits for: the allreduce, or push, the ps's update and pull. None of it
    /// overlaps the compute.
    pub comm: f64,
}

impl Step {
    pub fn total(&self) -> f64 {
        self.compute + self.comm
    }

    /// Weak-scaling efficiency: the step alone over the step with communication.
    pub fn efficiency(&self) -> f64 {
        self.compute / self.total()
    }
}

/// The communication of a step of `mode` on `c` for parameters of `w.param_bytes`.
pub fn comm(c: &Cluster, w: &Workload, mode: Mode) -> f64 {
    match mode {
        Mode::Allreduce => hierarchical(c, w.param_bytes, w.update.add_per_byte),
        Mode::Ps => ps_step(c, w.param_bytes, w.update).total(),
    }
}

/// A step of `mode` on `c`: the workload's compute (with the update in allreduce mode,
/// where every replica applies it) and [`comm`].
pub fn step(c: &Cluster, w: &Workload, mode: Mode) -> Step {
    let compute = match mode {
        Mode::Allreduce => w.compute + w.apply(),
        Mode::Ps => w.compute,
    };
    Step {
        compute,
        comm: comm(c, w, mode),
    }
}

/// Weak scaling at one host count: the same per-worker batch on every worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Row {
    pub hosts: usize,
    /// `workers_per_host` workers per host.
    pub allreduce: Step,
    /// The same workers and one ps per host, the parameters sliced over them all.
    pub ps: Step,
}

/// [`Row`]s for each count of `hosts`.
pub fn weak_scaling(
    hosts: &[usize],
    workers_per_host: usize,
    w: &Workload,
    links: Links,
) -> Vec<Row> {
    hosts
        .iter()
        .map(|&h| Row {
            hosts: h,
            allreduce: step(
                &Cluster::uniform(h, workers_per_host, 0, links),
                w,
                Mode::Allreduce,
            ),
            ps: step(
                &Cluster::uniform(h, workers_per_host, 1, links),
                w,
                Mode::Ps,
            ),
        })
        .collect()
}

impl Row {
    /// The mode of the shorter step (allreduce on a tie).
    pub fn faster(&self) -> Mode {
        if self.ps.total() < self.allreduce.total() {
            Mode::Ps
        } else {
            Mode::Allreduce
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::cost::Update;
    use super::super::fixtures::*;
    use super::*;

    const LINKS: Links = Links {
        shm: SHM,
        net: NET,
        exchange: NET,
    };

    fn workload(mb: f64, compute: f64) -> Workload {
        Workload {
            param_bytes: mb * 1e6,
            compute,
            update: Update {
                add_per_byte: 1.0 / 5e9,
                apply_per_byte: 1.0 / 1e9,
            },
        }
    }

    #[test]
    fn efficiency_falls_with_hosts_and_with_the_models_size() {
        let hosts = [2, 4, 16, 64, 256, 1024];
        let big = weak_scaling(&hosts, 2, &workload(7.5, 0.01), LINKS);
        let small = weak_scaling(&hosts, 2, &workload(0.4, 0.01), LINKS);
        for rows in [&big, &small] {
            for pair in rows.windows(2) {
                assert!(pair[1].allreduce.efficiency() <= pair[0].allreduce.efficiency());
                assert!(pair[1].ps.efficiency() <= pair[0].ps.efficiency());
            }
        }
        for (b, s) in big.iter().zip(&small) {
            assert!(b.allreduce.efficiency() < s.allreduce.efficiency());
        }
        // Allreduce's bandwidth term is bounded: 2 m over the network at any size.
        let last = big.last().unwrap();
        assert!(
            last.allreduce.comm < 3.0 * 7.5e6 * NET.per_byte + 0.01,
            "{last:?}"
        );
        // The update is compute in allreduce mode, the ps's in ps mode.
        assert!(last.allreduce.compute > last.ps.compute);
    }

    #[test]
    fn a_sharded_ps_wins_by_splitting_the_update_until_its_messages_dominate() {
        // One worker and one ps per host: both move the same bytes through a port, but
        // each replica applies the whole update while each ps applies its slice.
        let w = workload(7.5, 0.01);
        let rows = weak_scaling(&[2, 8, 1024], 1, &w, LINKS);
        assert_eq!(rows[0].faster(), Mode::Ps, "{rows:?}");
        assert_eq!(rows[1].faster(), Mode::Ps, "{rows:?}");
        // At 1024 hosts each ps serves 1023 messages per phase.
        assert!(
            rows[2].ps.total() > rows[2].allreduce.total(),
            "{:?}",
            rows[2]
        );
        // An update for free: the allreduce is the faster from the start.
        let free = Workload {
            update: Update {
                add_per_byte: 0.0,
                apply_per_byte: 0.0,
            },
            ..w
        };
        let rows = weak_scaling(&[2, 8, 1024], 1, &free, LINKS);
        assert!(
            rows.iter().all(|r| r.ps.total() >= r.allreduce.total()),
            "{rows:?}"
        );
        assert_eq!(Mode::Ps.to_string(), "ps");
    }
}
