//! Finding a free TCP port on this host, really: by binding it.
//!
//! A port is free if a listening socket can be bound to it on all interfaces. The probe
//! keeps the socket open and returns it, so ranks probing the same host at once can never
//! pick the same port; the caller drops it once every rank has agreed on its port, right
//! before the task's server binds it.

use std::net::TcpListener;

/// Errors from probing ports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PortError {
    #[error("no free port on {host} from {base} up (tried {tried} ports with stride {stride})")]
    NoFreePort {
        host: String,
        base: u16,
        tried: usize,
        stride: usize,
    },
    #[error("port {port} of {task} on {host} is already in use")]
    InUse {
        port: u16,
        task: String,
        host: String,
    },
}

/// The first port when the user gives none outside a Slurm job: TensorFlow's examples'.
pub const DEFAULT_BASE: u16 = 2222;

/// Where the bases of Slurm jobs start, how far apart consecutive job ids are, and how
/// many there are before they repeat: 10000-32336, below Linux's default ephemeral range
/// (32768-60999), where outgoing connections would take ports between probe and bind.
const JOB_BASES: (u64, u64, u64) = (10_000, 64, 350);

/// The first port of a job's tasks when the user gives none: [`DEFAULT_BASE`], or, inside
/// a Slurm job (`SLURM_JOB_ID`), `10000 + 64 x (job id mod 350)`.
///
/// Jobs sharing a node would otherwise all start at 2222: under `srun` without MPI ports
/// are numbered, not probed, so two jobs collide for certain; under MPI every rank
/// probes, but lets go of its port before its program's server binds it (a program
/// cannot be handed the socket), and a job starting at that moment takes it. Jobs
/// submitted around the same time have nearby ids: theirs are 64 ports apart, 64 tasks
/// per node each before their ranges touch.
pub fn default_base(slurm_job_id: Option<&str>) -> u16 {
    let (start, stride, slots) = JOB_BASES;
    match slurm_job_id.and_then(|id| id.trim().parse::<u64>().ok()) {
        // At most 10000 + 64 x 349 = 32336: fits.
        Some(id) => (start + stride * (id % slots)) as u16,
        None => DEFAULT_BASE,
    }
}

/// Binds `0.0.0.0:port`, returning the listener if the port is free.
pub fn try_bind(port: u16) -> Option<TcpListener> {
    TcpListener::bind(("0.0.0.0", port)).ok()
}

/// Probes `base + local_rank`, then upward in steps of `local_count`, so that the ranks of
/// one host search disjoint sequences of ports.
pub fn probe(
    host: &str,
    base: u16,
    local_rank: usize,
    local_count: usize,
) -> Result<(TcpListener, u16), PortError> {
    let stride = local_count.max(1);
    let mut tried = 0;
    let mut port = base as usize + local_rank;
    while port <= u16::MAX as usize {
        tried += 1;
        if let Some(l) = try_bind(port as u16) {
            return Ok((l, port as u16));
        }
        port += stride;
    }
    Err(PortError::NoFreePort {
        host: host.into(),
        base,
        tried,
        stride,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_base_is_the_jobs_own_inside_slurm() {
        assert_eq!(default_base(None), 2222);
        assert_eq!(default_base(Some("not a number")), 2222);
        assert_eq!(default_base(Some("0")), 10_000);
        assert_eq!(default_base(Some("1")), 10_064);
        assert_eq!(default_base(Some("349")), 32_336);
        assert_eq!(default_base(Some("350")), 10_000);
        // 1234567 = 3527 x 350 + 117.
        assert_eq!(default_base(Some("1234567")), 10_000 + 64 * 117);
        // Consecutive jobs: ranges of 64 ports that do not overlap.
        let bases: Vec<u16> = (100..110)
            .map(|j| default_base(Some(&j.to_string())))
            .collect();
        assert!(bases.windows(2).all(|w| w[1] - w[0] == 64), "{bases:?}");
    }

    #[test]
    fn probe_skips_busy_ports_and_never_repeats() {
        let (held, p) = probe("here", 20000, 0, 2).unwrap();
        // The held port is busy now, so a second probe from the same start skips it.
        let (_held2, p2) = probe("here", p, 0, 2).unwrap();
        assert_ne!(p, p2);
        assert_eq!((p2 - p) % 2, 0);
        drop(held);
        assert!(try_bind(p).is_some());
        let e = probe("here", 65535, 5, 1).unwrap_err();
        assert!(e.to_string().contains("no free port on here from 65535"));
    }
}
