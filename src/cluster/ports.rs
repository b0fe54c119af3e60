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
