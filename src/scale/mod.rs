//! A scale model of a training step across hosts.
//!
//! Each link class (shared memory within a host, the network between hosts) costs a
//! message of `m` bytes `latency + m × per_byte` ([`Link`], Hockney's model), fitted to
//! measured one-way latencies ([`Link::fit`]). On H hosts of R ranks the model gives the
//! time of an allreduce by the flat ring ([`flat_ring`]) and by the hierarchical algorithm
//! ([`hierarchical`]), of a synchronous parameter-server step ([`ps_step`]), and with a
//! step's compute time the weak-scaling efficiency ([`efficiency`]). Plain arithmetic on
//! plain numbers, unit tested here; what it is fitted to and checked against lives in
//! `benches/results/`.

/// The cost of one message on a link: `latency + bytes × per_byte` seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Seconds per message.
    pub latency: f64,
    /// Seconds per byte (the inverse of the bandwidth).
    pub per_byte: f64,
}

/// Errors from [`Link::fit`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    #[error("a link needs measurements at 2 or more sizes, got {0}")]
    TooFewSizes(usize),
    #[error("the measured times do not grow with the size (slope {0:e} s/B)")]
    NotIncreasing(f64),
    #[error("measurement {bytes} B, {secs} s: sizes and times must be finite, times positive")]
    Bad { bytes: f64, secs: f64 },
}

impl Link {
    /// The time of one message of `bytes`.
    pub fn time(&self, bytes: f64) -> f64 {
        self.latency + bytes * self.per_byte
    }

    /// Bytes per second.
    pub fn bandwidth(&self) -> f64 {
        1.0 / self.per_byte
    }

    /// The link that best fits `(bytes, seconds)` measurements in relative error
    /// (least squares of `(model − t) / t`, so 8-byte latencies count as much as 4 MiB
    /// transfers); a negative latency is clamped to 0 and the slope refitted through 0.
    pub fn fit(points: &[(f64, f64)]) -> Result<Link, FitError> {
        if let Some(&(bytes, secs)) = points
            .iter()
            .find(|(b, t)| !b.is_finite() || !t.is_finite() || *b < 0.0 || *t <= 0.0)
        {
            return Err(FitError::Bad { bytes, secs });
        }
        let mut sizes: Vec<f64> = points.iter().map(|p| p.0).collect();
        sizes.sort_by(f64::total_cmp);
        sizes.dedup();
        if sizes.len() < 2 {
            return Err(FitError::TooFewSizes(sizes.len()));
        }
        // Weighted normal equations, weights 1/t²: minimise Σ ((a + b·m − t)/t)².
        let (mut s1, mut sm, mut smm, mut st, mut smt) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for &(m, t) in points {
            let w = 1.0 / (t * t);
            s1 += w;
            sm += w * m;
            smm += w * m * m;
            st += w * t;
            smt += w * m * t;
        }
        let det = s1 * smm - sm * sm;
        let mut b = (s1 * smt - sm * st) / det;
        let mut a = (st - b * sm) / s1;
        if a < 0.0 {
            a = 0.0;
            b = smt / smm;
        }
        if b <= 0.0 || !b.is_finite() {
            return Err(FitError::NotIncreasing(b));
        }
        Ok(Link {
            latency: a,
            per_byte: b,
        })
    }
}

/// The `(bytes, seconds)` rows of OSU-format latency output (`osu_latency`, `mpiflow bench
/// latency`): lines of a size and a time in microseconds; `#` lines and anything else
/// skipped. What [`Link::fit`] takes.
pub fn latency_rows(text: &str) -> Vec<(f64, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let bytes: u64 = f.next()?.parse().ok()?;
            let us: f64 = f.next()?.parse().ok()?;
            Some((bytes as f64, us * 1e-6))
        })
        .collect()
}

/// Hosts, ranks per host, and their two links.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cluster {
    pub hosts: usize,
    pub ranks_per_host: usize,
    /// Between ranks of one host.
    pub shm: Link,
    /// Between hosts; one link per host, shared by its ranks.
    pub net: Link,
}

impl Cluster {
    pub fn ranks(&self) -> usize {
        self.hosts * self.ranks_per_host
    }
}

/// A ring allreduce of `bytes` over `p` ranks on `link`: 2(p−1) steps of one `bytes/p` chunk.
pub fn ring(p: usize, link: Link, bytes: f64) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let steps = 2.0 * (p as f64 - 1.0);
    steps * link.time(bytes / p as f64)
}

/// Recursive doubling of `bytes` over `p` ranks on `link`: ⌈log2 p⌉ exchanges of the whole buffer.
pub fn recursive_doubling(p: usize, link: Link, bytes: f64) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    (p as f64).log2().ceil() * link.time(bytes)
}

/// The flat ring over every rank of `c`, ranks ordered by host: each step waits for the
/// chunks that cross a host boundary, one per host link at a time.
pub fn flat_ring(c: &Cluster, bytes: f64) -> f64 {
    let link = if c.hosts > 1 { c.net } else { c.shm };
    ring(c.ranks(), link, bytes)
}

/// The hierarchical allreduce (`transport::collectives::hierarchical`): the ranks of a host
/// reduce over its shared memory (as a ring), the host leaders allreduce over the network
/// (recursive doubling below `ring_from` bytes, the ring from there), and each leader
/// broadcasts inside its host (a binomial tree).
pub fn hierarchical(c: &Cluster, bytes: f64, ring_from: f64) -> f64 {
    let r = c.ranks_per_host;
    let within = ring(r, c.shm, bytes);
    let across = if bytes >= ring_from {
        ring(c.hosts, c.net, bytes)
    } else {
        recursive_doubling(c.hosts, c.net, bytes)
    };
    let bcast = if r > 1 {
        (r as f64).log2().ceil() * c.shm.time(bytes)
    } else {
        0.0
    };
    within + across + bcast
}

/// A synchronous parameter-server step: every rank a worker, one ps per host (placement
/// `spread`), the parameters (`bytes`) sliced evenly over the ps. Each worker pushes a
/// slice to every ps and pulls it back; a host's link carries its workers' pushes to the
/// other hosts and its ps's replies to the other hosts' workers, the ps serves its
/// messages one after another, and push and pull do not overlap.
pub fn ps_step(c: &Cluster, bytes: f64) -> f64 {
    let (h, r) = (c.hosts as f64, c.ranks_per_host as f64);
    let slice = bytes / h;
    let workers = h * r;
    // Per phase: the ps handles one message per worker; of the slices, those of the
    // other hosts' workers cross this host's link.
    let remote = workers - r;
    let phase = workers * c.net.latency.max(c.shm.latency)
        + remote * slice * c.net.per_byte
        + r * slice * c.shm.per_byte;
    2.0 * phase
}

/// Weak-scaling efficiency: a step's compute over compute plus the communication it waits
/// for (none of it overlapped).
pub fn efficiency(compute: f64, comm: f64) -> f64 {
    compute / (compute + comm)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NET: Link = Link {
        latency: 6e-6,
        per_byte: 1.0 / 1.19e9,
    };
    const SHM: Link = Link {
        latency: 0.4e-6,
        per_byte: 1.0 / 10e9,
    };

    #[test]
    fn a_fit_recovers_the_link_it_was_measured_on_and_refuses_nonsense() {
        let sizes = [8.0, 1024.0, 65536.0, 1048576.0, 4194304.0];
        let points: Vec<(f64, f64)> = sizes.iter().map(|m| (*m, NET.time(*m))).collect();
        let fit = Link::fit(&points).unwrap();
        assert!((fit.latency - NET.latency).abs() < 1e-9, "{fit:?}");
        assert!((fit.per_byte / NET.per_byte - 1.0).abs() < 1e-9, "{fit:?}");
        // Noise of ±5% still gives both within 10%.
        let noisy: Vec<(f64, f64)> = points
            .iter()
            .enumerate()
            .map(|(i, (m, t))| (*m, t * if i % 2 == 0 { 1.05 } else { 0.95 }))
            .collect();
        let fit = Link::fit(&noisy).unwrap();
        assert!((fit.latency / NET.latency - 1.0).abs() < 0.1, "{fit:?}");
        assert!((fit.per_byte / NET.per_byte - 1.0).abs() < 0.1, "{fit:?}");
        // Pure bandwidth: the latency clamps at 0.
        let fit = Link::fit(&[(1e6, 1e-3), (2e6, 2e-3), (4e6, 4.1e-3)]).unwrap();
        assert_eq!(fit.latency, 0.0);
        assert_eq!(
            Link::fit(&[(8.0, 1e-6), (8.0, 2e-6)]),
            Err(FitError::TooFewSizes(1))
        );
        assert!(matches!(
            Link::fit(&[(8.0, 2e-6), (1e6, 1e-6)]),
            Err(FitError::NotIncreasing(_))
        ));
        assert!(matches!(
            Link::fit(&[(8.0, 0.0), (16.0, 1e-6)]),
            Err(FitError::Bad { .. })
        ));
    }

    #[test]
    fn osu_output_gives_rows_in_seconds() {
        let text = "# OSU MPI Latency Test v7.4\n# Size          Latency (us)\n\
                    1                       5.92\n4096                    9.07\n\
                    bench: round 1 of 1\n# mpiflow path: mpi\n1048576               423.23\n";
        let rows = latency_rows(text);
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].0, 1.0);
        assert!((rows[2].1 - 423.23e-6).abs() < 1e-12);
        // The two-host TCP link of benches/results/2026-11-24-hosts.md, unshaped: ~6 us.
        let fit = Link::fit(&rows).unwrap();
        assert!(fit.latency > 4e-6 && fit.latency < 8e-6, "{fit:?}");
    }

    #[test]
    fn collective_costs_follow_their_step_counts() {
        let one = Link {
            latency: 1.0,
            per_byte: 0.0,
        };
        assert_eq!(ring(4, one, 1.0), 6.0);
        assert_eq!(recursive_doubling(5, one, 1.0), 3.0);
        assert_eq!(ring(1, one, 1.0), 0.0);
        // Bandwidth term: 2(p−1)/p of the buffer.
        let bw = Link {
            latency: 0.0,
            per_byte: 1.0,
        };
        assert!((ring(4, bw, 400.0) - 600.0).abs() < 1e-9);
    }

    #[test]
    fn two_levels_beat_the_flat_ring_on_a_slow_network_and_ps_loses_to_both_at_scale() {
        let c = Cluster {
            hosts: 2,
            ranks_per_host: 2,
            shm: SHM,
            net: NET,
        };
        let m = 4.0 * 1048576.0;
        let (flat, two) = (flat_ring(&c, m), hierarchical(&c, m, 262144.0));
        assert!(two < flat, "hierarchical {two} flat {flat}");
        // Flat: 6 steps of m/4 over the network = 1.5 m; two levels: m over it once, plus
        // two passes over shared memory.
        assert!(flat / two > 1.15 && flat / two < 1.5, "{}", flat / two);
        // At 1024 hosts the ps serves 2048 messages per phase; allreduce stays near 2 m.
        let big = Cluster { hosts: 1024, ..c };
        assert!(ps_step(&big, m) > hierarchical(&big, m, 262144.0));
        let e = efficiency(0.01, hierarchical(&big, m, 262144.0));
        assert!(e > 0.0 && e < 1.0);
    }
}
