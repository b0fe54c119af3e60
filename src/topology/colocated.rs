//! Hosts that are one machine: containers or network namespaces on one kernel, each with a
//! host name of its own and a launcher daemon that binds its ranks as if it had the
//! machine alone.
//!
//! Open MPI's `orted` on each such host binds its first rank to core 0, so ranks of
//! different hosts end up on the same CPU; every message between two of them then waits
//! for the scheduler to switch from one busy-polling rank to the other (a scheduler tick
//! per message; `benches/results/2026-11-24-hosts.md`). mpiflow finds these ranks at
//! start ([`clash`], on what every rank reports in a [`Seat`]) and unbinds them; its own
//! pinning then counts ranks per machine ([`machine_locals`]), not per host name.
//!
//! A machine is known by its kernel's boot id (`/proc/sys/kernel/random/boot_id`), which
//! namespaces and containers share and distinct machines do not.

use serde::{Deserialize, Serialize};

/// Where one rank runs, as it sees it at start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seat {
    /// The kernel's boot id; empty when unreadable (the host name stands for it then).
    pub machine: String,
    /// The rank's host name (as MPI names it).
    pub host: String,
    /// The CPUs this process may run on now.
    pub cpus: Vec<usize>,
    /// The number of CPUs online on the machine.
    pub online: usize,
}

impl Seat {
    /// This process's seat on host `host`.
    pub fn here(host: &str) -> Seat {
        let machine = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        // SAFETY: sysconf has no preconditions; a negative result (unknown) becomes 0.
        let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(0) as usize;
        Seat {
            machine,
            host: host.to_string(),
            cpus: super::current_affinity(),
            online,
        }
    }

    /// The key ranks of one machine share.
    fn machine_key(&self) -> &str {
        if self.machine.is_empty() {
            &self.host
        } else {
            &self.machine
        }
    }

    /// Whether a launcher narrowed this process to some of the machine's CPUs.
    fn bound(&self) -> bool {
        !self.cpus.is_empty() && self.cpus.len() < self.online
    }
}

/// Ranks of different hosts on one machine, bound to CPUs they share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clash {
    /// The ranks bound to a CPU that a rank of another host of the machine is bound to.
    pub ranks: Vec<usize>,
    /// Their hosts, in order of first rank.
    pub hosts: Vec<String>,
    /// The CPUs they share.
    pub cpus: Vec<usize>,
}

impl std::fmt::Display for Clash {
    /// The warning's words after `mpiflow: warning: `.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranks: Vec<String> = self.ranks.iter().map(|r| r.to_string()).collect();
        write!(
            f,
            "hosts {} are one machine (containers or namespaces) whose launchers bound ranks {} to the same CPUs ({}), where each message between them waits for the scheduler",
            self.hosts.join(", "),
            ranks.join(", "),
            super::cpu_list(&self.cpus)
        )
    }
}

/// The ranks of `seats` (indexed by rank) that share a bound CPU with a rank of another
/// host on the same machine, or `None`.
pub fn clash(seats: &[Seat]) -> Option<Clash> {
    let mut ranks = std::collections::BTreeSet::new();
    let mut cpus = std::collections::BTreeSet::new();
    for (i, a) in seats.iter().enumerate() {
        for (j, b) in seats.iter().enumerate().skip(i + 1) {
            if a.machine_key() != b.machine_key() || a.host == b.host {
                continue;
            }
            if !(a.bound() && b.bound()) {
                continue;
            }
            let shared: Vec<usize> = a
                .cpus
                .iter()
                .filter(|c| b.cpus.contains(c))
                .copied()
                .collect();
            if !shared.is_empty() {
                ranks.extend([i, j]);
                cpus.extend(shared);
            }
        }
    }
    if ranks.is_empty() {
        return None;
    }
    let mut hosts: Vec<String> = Vec::new();
    for r in &ranks {
        if !hosts.contains(&seats[*r].host) {
            hosts.push(seats[*r].host.clone());
        }
    }
    Some(Clash {
        ranks: ranks.into_iter().collect(),
        hosts,
        cpus: cpus.into_iter().collect(),
    })
}

/// More ranks on one machine than it has CPUs, under more than one host name: no launcher
/// sees the whole machine, so none tells MPI to yield the CPU while it waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crowding {
    pub hosts: Vec<String>,
    /// The machine's ranks.
    pub ranks: Vec<usize>,
    pub cpus: usize,
}

impl std::fmt::Display for Crowding {
    /// The start of the warning's words after `mpiflow: warning: `.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "hosts {} are one machine with {} CPUs for {} ranks, which no launcher sees",
            self.hosts.join(", "),
            self.cpus,
            self.ranks.len()
        )
    }
}

/// The first machine of `seats` that its ranks of several hosts oversubscribe, or `None`.
pub fn crowding(seats: &[Seat]) -> Option<Crowding> {
    let mut keys: Vec<&str> = seats.iter().map(Seat::machine_key).collect();
    keys.dedup();
    keys.into_iter().find_map(|k| {
        let ranks: Vec<usize> = (0..seats.len())
            .filter(|r| seats[*r].machine_key() == k)
            .collect();
        let here: Vec<&Seat> = ranks.iter().map(|r| &seats[*r]).collect();
        let mut hosts: Vec<String> = Vec::new();
        for s in &here {
            if !hosts.contains(&s.host) {
                hosts.push(s.host.clone());
            }
        }
        let cpus = here.iter().map(|s| s.online).max().unwrap_or(0);
        (hosts.len() > 1 && cpus > 0 && ranks.len() > cpus).then_some(Crowding {
            hosts,
            ranks,
            cpus,
        })
    })
}

/// Whether every rank of `rank`'s machine can have a CPU of its own: no more ranks than
/// the CPUs they may run on together (their affinity masks, which a cgroup narrows too;
/// a rank that could not read its mask counts as free to run on every CPU online).
pub fn cpu_each(seats: &[Seat], rank: usize) -> bool {
    let Some(key) = seats.get(rank).map(Seat::machine_key) else {
        return false;
    };
    let here: Vec<&Seat> = seats.iter().filter(|s| s.machine_key() == key).collect();
    let mut cpus: Vec<usize> = Vec::new();
    for s in &here {
        match s.cpus.is_empty() {
            true => cpus.extend(0..s.online),
            false => cpus.extend(&s.cpus),
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    here.len() <= cpus.len()
}

/// For each rank of `seats`: its index among the ranks of its machine (in rank order) and
/// how many ranks that machine has; what a pinning plan needs.
pub fn machine_locals(seats: &[Seat]) -> Vec<(usize, usize)> {
    let keys: Vec<&str> = seats.iter().map(Seat::machine_key).collect();
    keys.iter()
        .enumerate()
        .map(|(r, k)| {
            let local = keys[..r].iter().filter(|o| *o == k).count();
            let count = keys.iter().filter(|o| *o == k).count();
            (local, count)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seat(machine: &str, host: &str, cpus: &[usize]) -> Seat {
        Seat {
            machine: machine.into(),
            host: host.into(),
            cpus: cpus.to_vec(),
            online: 4,
        }
    }

    #[test]
    fn namespace_hosts_bound_to_one_core_clash() {
        // Each host's launcher bound its first rank to core 0, its second to core 1.
        let seats = [
            seat("boot", "h1", &[0]),
            seat("boot", "h1", &[1]),
            seat("boot", "h2", &[0]),
            seat("boot", "h2", &[1]),
            seat("boot", "h3", &[2, 3]),
        ];
        let c = clash(&seats).expect("clash");
        assert_eq!(c.ranks, [0, 1, 2, 3]);
        assert_eq!(c.hosts, ["h1", "h2"]);
        assert_eq!(c.cpus, [0, 1]);
        let said = c.to_string();
        assert!(said.starts_with("hosts h1, h2 are one machine"), "{said}");
        assert!(
            said.contains("ranks 0, 1, 2, 3 to the same CPUs (0-1)"),
            "{said}"
        );
    }

    #[test]
    fn real_hosts_unbound_ranks_and_one_host_never_clash() {
        // Distinct machines: the same core numbers are different cores.
        let apart = [seat("a", "n1", &[0]), seat("b", "n2", &[0])];
        assert_eq!(clash(&apart), None);
        // Unbound (every online CPU) on one machine: the scheduler spreads them.
        let free = [
            seat("m", "h1", &[0, 1, 2, 3]),
            seat("m", "h2", &[0, 1, 2, 3]),
        ];
        assert_eq!(clash(&free), None);
        // One host binding two ranks to one core is its launcher's own choice.
        let one = [seat("m", "h1", &[0]), seat("m", "h1", &[0])];
        assert_eq!(clash(&one), None);
        // Bound, but to different cores.
        let split = [seat("m", "h1", &[0, 1]), seat("m", "h2", &[2, 3])];
        assert_eq!(clash(&split), None);
        // No boot id: the host name stands for the machine, so nothing is shared.
        let unknown = [seat("", "h1", &[0]), seat("", "h2", &[0])];
        assert_eq!(clash(&unknown), None);
    }

    #[test]
    fn ranks_spin_only_where_each_has_a_cpu() {
        // 4 CPUs online: four unbound ranks fit, a fifth does not (on that machine only).
        let mut seats: Vec<Seat> = (0..4).map(|_| seat("m", "h1", &[0, 1, 2, 3])).collect();
        assert!((0..4).all(|r| cpu_each(&seats, r)));
        seats.push(seat("m", "h2", &[]));
        seats.push(seat("n", "n1", &[0]));
        assert!(!cpu_each(&seats, 0) && !cpu_each(&seats, 4));
        assert!(cpu_each(&seats, 5));
        // A cpuset of 2 CPUs for 3 ranks, whatever the machine has online.
        let narrowed = [
            seat("m", "h1", &[2, 3]),
            seat("m", "h1", &[2, 3]),
            seat("m", "h1", &[3]),
        ];
        assert!(!cpu_each(&narrowed, 1));
        assert!(cpu_each(&narrowed[..2], 0));
        // Bound to one core each: one rank per core.
        let bound = [seat("m", "h1", &[0]), seat("m", "h1", &[1])];
        assert!(cpu_each(&bound, 0));
        assert!(!cpu_each(&bound, 2));
    }

    #[test]
    fn pinning_counts_ranks_per_machine_not_per_host_name() {
        let seats = [
            seat("m", "h1", &[0]),
            seat("m", "h2", &[0]),
            seat("n", "n1", &[0]),
            seat("m", "h3", &[0]),
            seat("", "x", &[0]),
            seat("", "x", &[0]),
        ];
        assert_eq!(
            machine_locals(&seats),
            [(0, 3), (1, 3), (0, 1), (2, 3), (0, 2), (1, 2)]
        );
    }

    #[test]
    fn a_machine_is_crowded_by_hosts_that_each_fit_their_share() {
        // 4 online CPUs: three hosts of two ranks each fit their own slots, not the machine.
        let six: Vec<Seat> = ["h1", "h1", "h2", "h2", "h3", "h3"]
            .iter()
            .map(|h| seat("m", h, &[0, 1, 2, 3]))
            .collect();
        let c = crowding(&six).expect("crowded");
        assert_eq!((c.hosts.len(), c.ranks.len(), c.cpus), (3, 6, 4));
        // Another machine's ranks are not its.
        let mut mixed = six.clone();
        mixed.insert(2, seat("other", "n1", &[0]));
        assert_eq!(crowding(&mixed).expect("crowded").ranks, [0, 1, 3, 4, 5, 6]);
        assert_eq!(
            c.to_string(),
            "hosts h1, h2, h3 are one machine with 4 CPUs for 6 ranks, which no launcher sees"
        );
        // As many ranks as CPUs; one host oversubscribed (its launcher knows); or distinct
        // machines: nothing to say.
        assert_eq!(crowding(&six[..4]), None);
        let one: Vec<Seat> = (0..6).map(|_| seat("m", "h1", &[0, 1, 2, 3])).collect();
        assert_eq!(crowding(&one), None);
        let apart: Vec<Seat> = (0..6)
            .map(|i| seat(&format!("m{i}"), &format!("n{i}"), &[0]))
            .collect();
        assert_eq!(crowding(&apart), None);
    }

    #[test]
    fn this_process_has_a_seat() {
        let s = Seat::here("here");
        assert!(s.online >= 1);
        assert!(!s.cpus.is_empty());
        assert!(s.cpus.len() <= s.online, "{s:?}");
    }
}
