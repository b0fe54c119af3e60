//! What a step's communication costs on a cluster of hosts: allreduce algorithms and the
//! synchronous parameter-server step, in Hockney's model of each link.

use super::link::Link;

/// The tasks one host runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostTasks {
    pub workers: usize,
    pub ps: usize,
}

/// The link classes between tasks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Links {
    /// Between tasks of one host.
    pub shm: Link,
    /// Between hosts, one way: each host has one port of this link, shared by its tasks.
    pub net: Link,
    /// Between hosts, a message each way at once (the steps of an allreduce): on a
    /// full-duplex port what one way costs; measured where the two directions interfere.
    pub exchange: Link,
}

impl Links {
    /// Links whose network ports are full duplex: an exchange costs a one-way message.
    pub fn full_duplex(shm: Link, net: Link) -> Links {
        Links {
            shm,
            net,
            exchange: net,
        }
    }
}

/// Hosts with their tasks, and the links between tasks.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    pub hosts: Vec<HostTasks>,
    pub links: Links,
}

impl Cluster {
    /// `hosts` hosts of `workers` workers and `ps` parameter servers each.
    pub fn uniform(hosts: usize, workers: usize, ps: usize, links: Links) -> Cluster {
        Cluster {
            hosts: vec![HostTasks { workers, ps }; hosts],
            links,
        }
    }

    pub fn workers(&self) -> usize {
        self.hosts.iter().map(|h| h.workers).sum()
    }

    pub fn ps(&self) -> usize {
        self.hosts.iter().map(|h| h.ps).sum()
    }

    /// The hosts that run workers, and the most workers on one of them.
    fn worker_hosts(&self) -> (usize, usize) {
        let with = self.hosts.iter().filter(|h| h.workers > 0).count();
        let most = self.hosts.iter().map(|h| h.workers).max().unwrap_or(0);
        (with, most)
    }
}

/// A ring allreduce of `bytes` over `p` ranks on `link`, adding at `add` seconds per byte:
/// 2(p−1) steps of one `bytes/p` chunk, the first p−1 adding the chunk that arrived.
pub fn ring(p: usize, link: Link, bytes: f64, add: f64) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let (p, chunk) = (p as f64, bytes / p as f64);
    2.0 * (p - 1.0) * link.time(chunk) + (p - 1.0) * chunk * add
}

/// Recursive doubling of `bytes` over `p` ranks on `link`: ⌈log2 p⌉ exchanges of the
/// whole buffer, each added.
pub fn recursive_doubling(p: usize, link: Link, bytes: f64, add: f64) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    (p as f64).log2().ceil() * (link.time(bytes) + bytes * add)
}

/// Rabenseifner's allreduce (a reduce-scatter by recursive halving, an allgather by
/// recursive doubling): 2 log2 p steps moving 2(p−1)/p of the buffer in all; a `p` that is
/// not a power of two first folds the extra ranks in and finally sends them the result
/// (two whole-buffer messages more, one added). Adds (q−1)/q of the buffer.
pub fn rabenseifner(p: usize, link: Link, bytes: f64, add: f64) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let pow = 1usize << (usize::BITS - 1 - p.leading_zeros());
    let q = pow as f64;
    let share = (q - 1.0) / q * bytes;
    let mut t = 2.0 * q.log2() * link.latency + 2.0 * share * link.per_byte + share * add;
    if pow != p {
        t += 2.0 * link.time(bytes) + bytes * add;
    }
    t
}

/// An allreduce among `p` ranks, one per host, as a tuned MPI library or mpiflow's `auto`
/// picks it: the fastest of [`ring`], [`recursive_doubling`] and [`rabenseifner`].
pub fn across(p: usize, link: Link, bytes: f64, add: f64) -> f64 {
    ring(p, link, bytes, add)
        .min(recursive_doubling(p, link, bytes, add))
        .min(rabenseifner(p, link, bytes, add))
}

/// The flat ring over every worker of `c`, ranks ordered by host: each step waits for the
/// chunks that cross a host boundary, each rank sending while it receives.
pub fn flat_ring(c: &Cluster, bytes: f64, add: f64) -> f64 {
    let (hosts, _) = c.worker_hosts();
    let link = if hosts > 1 {
        c.links.exchange
    } else {
        c.links.shm
    };
    ring(c.workers(), link, bytes, add)
}

/// The hierarchical allreduce (`transport::collectives::hierarchical`) of the workers:
/// each host's workers reduce over its shared memory (as a ring), one leader per host
/// allreduces over the network ([`across`], each step an exchange), and each leader
/// broadcasts inside its host
/// (a binomial tree). With one worker per host it is the allreduce among hosts alone.
pub fn hierarchical(c: &Cluster, bytes: f64, add: f64) -> f64 {
    let (hosts, r) = c.worker_hosts();
    let within = ring(r, c.links.shm, bytes, add);
    let bcast = if r > 1 {
        (r as f64).log2().ceil() * c.links.shm.time(bytes)
    } else {
        0.0
    };
    within + across(hosts, c.links.exchange, bytes, add) + bcast
}

/// The work of a ps step on the ps side, per byte of the parameters: summing one
/// worker's gradients into the step's buffer, and applying the optimizer to the sum.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Update {
    /// Seconds per byte to add one gradient into the sum.
    pub add_per_byte: f64,
    /// Seconds per byte of the optimizer's update.
    pub apply_per_byte: f64,
}

/// The parts of a synchronous ps step after the workers' gradients are computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PsStep {
    /// Every worker's slices reach their ps tasks.
    pub push: f64,
    /// Each ps sums its slices and applies the update.
    pub update: f64,
    /// The workers pull the new parameters back.
    pub pull: f64,
}

impl PsStep {
    pub fn total(&self) -> f64 {
        self.push + self.update + self.pull
    }
}

/// A synchronous parameter-server step of parameters of `bytes`, sliced evenly over the
/// ps tasks of `c`. Each worker sends a slice to every ps and pulls it back. A phase takes,
/// on its slowest host, the time its port carries what crosses it (into the host: its ps
/// tasks' slices from other hosts' workers; out: its workers' slices to other hosts' ps
/// tasks) or its shared memory the copies inside it, whichever is longer (they proceed side
/// by side), plus the messages: a ps handles one from every worker (a latency each, through
/// shared memory from its own host's workers), a worker sends one to every ps. Pull mirrors
/// push. Push and pull do not overlap: the ps replies once the step's update is applied.
pub fn ps_step(c: &Cluster, bytes: f64, update: Update) -> PsStep {
    let (w, p) = (c.workers(), c.ps());
    if w == 0 || p == 0 {
        return PsStep {
            push: 0.0,
            update: 0.0,
            pull: 0.0,
        };
    }
    let slice = bytes / p as f64;
    let Links { shm, net, .. } = c.links;
    let phase = c
        .hosts
        .iter()
        .map(|h| {
            let remote_workers = (w - h.workers) as f64;
            let remote_ps = (p - h.ps) as f64;
            let into = h.ps as f64 * remote_workers * slice;
            let out = h.workers as f64 * remote_ps * slice;
            let local = (h.ps * h.workers) as f64 * slice;
            let port = (into.max(out) * net.per_byte).max(local * shm.per_byte);
            // One ps serves every worker's message; one worker sends to every ps.
            let serve = if h.ps > 0 {
                remote_workers * net.latency + h.workers as f64 * shm.latency
            } else {
                0.0
            };
            let send = if h.workers > 0 {
                remote_ps * net.latency + h.ps as f64 * shm.latency
            } else {
                0.0
            };
            port + serve.max(send)
        })
        .fold(0.0, f64::max);
    PsStep {
        push: phase,
        update: slice * (w as f64 * update.add_per_byte + update.apply_per_byte),
        pull: phase,
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::*;

    const ONE: Link = Link {
        latency: 1.0,
        per_byte: 0.0,
    };
    const BW: Link = Link {
        latency: 0.0,
        per_byte: 1.0,
    };
    const FREE: Update = Update {
        add_per_byte: 0.0,
        apply_per_byte: 0.0,
    };

    #[test]
    fn collective_costs_follow_their_step_counts() {
        assert_eq!(ring(4, ONE, 1.0, 0.0), 6.0);
        assert_eq!(recursive_doubling(5, ONE, 1.0, 0.0), 3.0);
        assert_eq!(ring(1, ONE, 1.0, 0.0), 0.0);
        assert_eq!(rabenseifner(8, ONE, 1.0, 0.0), 6.0);
        // 6 ranks: the 4-rank algorithm and two whole-buffer messages.
        assert_eq!(rabenseifner(6, ONE, 1.0, 0.0), 4.0 + 2.0);
        // Bandwidth terms: 2(p−1)/p of the buffer for ring and Rabenseifner.
        assert!((ring(4, BW, 400.0, 0.0) - 600.0).abs() < 1e-9);
        assert!((rabenseifner(4, BW, 400.0, 0.0) - 600.0).abs() < 1e-9);
        // Adding: the ring and Rabenseifner add (p−1)/p of the buffer, doubling log2 p times it.
        let free = Link {
            latency: 0.0,
            per_byte: 0.0,
        };
        assert!((ring(4, free, 400.0, 1.0) - 300.0).abs() < 1e-9);
        assert!((rabenseifner(4, free, 400.0, 1.0) - 300.0).abs() < 1e-9);
        assert!((recursive_doubling(4, free, 400.0, 1.0) - 800.0).abs() < 1e-9);
        // At 1024 hosts the ring's 2046 latencies lose to Rabenseifner's 20.
        let m = 4.0 * 1048576.0;
        assert_eq!(across(1024, NET, m, 0.0), rabenseifner(1024, NET, m, 0.0));
        assert_eq!(
            across(2, NET, 8.0, 0.0),
            recursive_doubling(2, NET, 8.0, 0.0)
        );
    }

    #[test]
    fn two_levels_beat_the_flat_ring_on_a_slow_network() {
        let c = Cluster::uniform(2, 2, 0, Links::full_duplex(SHM, NET));
        let m = 4.0 * 1048576.0;
        let (flat, two) = (flat_ring(&c, m, 0.0), hierarchical(&c, m, 0.0));
        assert!(two < flat, "hierarchical {two} flat {flat}");
        // Flat: 6 steps of m/4 over the network = 1.5 m; two levels: m over it once, plus
        // two passes over shared memory.
        assert!(flat / two > 1.15 && flat / two < 1.5, "{}", flat / two);
        // Ports whose two directions interfere: every allreduce step costs the exchange.
        let slow = Links {
            exchange: Link {
                per_byte: 2.0 * NET.per_byte,
                ..NET
            },
            ..Links::full_duplex(SHM, NET)
        };
        let ring2 = hierarchical(&Cluster::uniform(2, 1, 0, slow), m, 0.0);
        assert!(
            (ring2 / across(2, NET, m, 0.0) - 2.0).abs() < 0.01,
            "{ring2}"
        );
        // ...but a ps phase goes one way.
        let ps = |links| ps_step(&Cluster::uniform(2, 1, 1, links), m, FREE).total();
        assert_eq!(ps(slow), ps(Links::full_duplex(SHM, NET)));
        // One worker per host: only the hosts' allreduce.
        let one = Cluster::uniform(3, 1, 0, Links::full_duplex(SHM, NET));
        assert_eq!(hierarchical(&one, m, 0.0), across(3, NET, m, 0.0));
    }

    #[test]
    fn a_ps_step_counts_ports_and_messages() {
        // A ps host and two worker hosts (the namespace cluster's ps runs): the ps port
        // takes both workers' whole buffers per phase.
        let mut c = Cluster::uniform(3, 1, 0, Links::full_duplex(SHM, BW));
        c.hosts[0] = HostTasks { workers: 0, ps: 1 };
        let s = ps_step(&c, 100.0, FREE);
        assert_eq!((s.push, s.pull, s.update), (200.0, 200.0, 0.0));
        // One ps per host, one worker each: a port carries (H−1)/H of the buffer each way.
        let c = Cluster::uniform(4, 1, 1, Links::full_duplex(SHM, BW));
        let s = ps_step(&c, 400.0, FREE);
        assert!((s.push - 300.0).abs() < 1e-6, "{s:?}");
        // Messages: a ps serves every worker in turn.
        let c = Cluster::uniform(4, 2, 1, Links::full_duplex(SHM, ONE));
        let s = ps_step(&c, 400.0, FREE);
        assert!((s.push - 6.0).abs() < 1e-5, "{s:?}");
        // The update: every worker's slice summed, then applied once.
        let u = Update {
            add_per_byte: 1.0,
            apply_per_byte: 10.0,
        };
        let s = ps_step(
            &Cluster::uniform(2, 1, 1, Links::full_duplex(SHM, NET)),
            100.0,
            u,
        );
        assert!((s.update - 50.0 * (2.0 + 10.0)).abs() < 1e-9, "{s:?}");
        assert_eq!(
            ps_step(
                &Cluster::uniform(2, 1, 0, Links::full_duplex(SHM, NET)),
                1.0,
                u
            )
            .total(),
            0.0
        );
    }

    #[test]
    fn at_scale_the_ps_step_loses_to_allreduce_by_its_messages() {
        let m = 4.0 * 1048576.0;
        let small = Cluster::uniform(2, 1, 1, Links::full_duplex(SHM, NET));
        let big = Cluster::uniform(1024, 1, 1, Links::full_duplex(SHM, NET));
        // Two hosts: the same bytes cross a port either way.
        let (ps2, ar2) = (
            ps_step(&small, m, FREE).total(),
            hierarchical(&small, m, 0.0),
        );
        assert!((ps2 / ar2 - 1.0).abs() < 0.05, "ps {ps2} allreduce {ar2}");
        // 1024: each ps serves 1023 remote messages per phase.
        let (ps, ar) = (ps_step(&big, m, FREE).total(), hierarchical(&big, m, 0.0));
        assert!(ps > ar, "ps {ps} allreduce {ar}");
    }
}
