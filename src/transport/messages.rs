//! Messages of any length on a tag: sent to one peer, received from one peer or from any
//! (a server's requests come from whichever client sends first), with MPI's order from
//! each sender. Between ranks of one node they go through the ring of the link (peer and
//! tag) that [`super::p2p`]'s tensors use ([`super::ring`]), whole messages of up to 32 KiB
//! (longer ones, and any while the ring is full, by MPI, in order with the ring's);
//! otherwise by MPI.
//!
//! Every message on such a tag between two ranks must go through here on both sides: a
//! link's first message is preceded by the offer of its ring, and its messages are
//! numbered by the ring, so a receive knows which way each went. The tag is its users' own
//! (a tensor link on it would share its ring).

use std::time::Duration;

use super::comm::{Comm, TransportError};

/// Puts `bytes` for `dst` on `tag` into the link's ring: `true` if it went there (the
/// send is complete); `false`: the caller sends it by MPI (`isend`), now, before any
/// other message on the tag to `dst`.
#[inline]
pub(crate) fn put<C: Comm>(
    c: &C,
    bytes: &[u8],
    dst: usize,
    tag: i32,
) -> Result<bool, TransportError> {
    c.links().rings.put_message(c, bytes, dst, tag)
}

/// Sends `bytes` to `dst` on `tag`: through the ring, or by a blocking MPI send.
pub(crate) fn send<C: Comm>(
    c: &C,
    bytes: &[u8],
    dst: usize,
    tag: i32,
) -> Result<(), TransportError> {
    match put(c, bytes, dst, tag)? {
        true => Ok(()),
        false => c.send_blocking(bytes, dst, tag),
    }
}

/// The next message on `tag` from `src` (or [`super::comm::ANY_SOURCE`]) if one is here or
/// has begun to arrive, into `buf` (replaced by the message, its allocation reused); the
/// sender. A message whose transfer does not complete within `within` (its sender died
/// halfway) is a [`TransportError::Timeout`] naming the sender, never a hang.
#[inline]
pub(crate) fn try_receive_into<C: Comm>(
    c: &C,
    src: usize,
    tag: i32,
    within: Duration,
    buf: &mut Vec<u8>,
) -> Result<Option<usize>, TransportError> {
    c.links()
        .rings
        .try_receive_message(c, src, tag, within, buf)
}

/// [`try_receive_into`] into a buffer of its own.
pub(crate) fn try_receive<C: Comm>(
    c: &C,
    src: usize,
    tag: i32,
    within: Duration,
) -> Result<Option<(usize, Vec<u8>)>, TransportError> {
    let mut buf = Vec::new();
    Ok(try_receive_into(c, src, tag, within, &mut buf)?.map(|from| (from, buf)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::comm::ANY_SOURCE;
    use crate::transport::local::LocalComm;

    /// Rank 0 takes `n` messages from each of the other ranks (from any, until all are
    /// in), each a sender's count and a length that cycles through `lens`; the messages
    /// in the order each sender's came, and whether each sender's came through a ring.
    fn gather(nodes: &[usize], n: usize, lens: &[usize]) -> (Vec<Vec<(usize, usize)>>, Vec<bool>) {
        let size = nodes.len();
        let out = LocalComm::run_on_nodes(nodes, |c| {
            let within = Duration::from_secs(20);
            if c.rank() == 0 {
                let mut got = vec![Vec::new(); size];
                let mut buf = Vec::new();
                while got.iter().skip(1).map(Vec::len).sum::<usize>() < n * (size - 1) {
                    if let Some(from) =
                        try_receive_into(&c, ANY_SOURCE, 5, within, &mut buf).unwrap()
                    {
                        let k = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
                        assert!(buf[4..].iter().all(|b| *b == k as u8), "from {from}");
                        got[from].push((k, buf.len()));
                    }
                }
                // Done: every sender may go (its ring lives as long as its communicator).
                for r in 1..size {
                    send(&c, b"done", r, 6).unwrap();
                }
                let rings = (0..size).map(|r| c.links().rings.receives_by_ring(r, 5));
                (got, rings.collect())
            } else {
                for k in 0..n {
                    let len = lens[k % lens.len()].max(4);
                    let mut m = vec![k as u8; len];
                    m[..4].copy_from_slice(&(k as u32).to_le_bytes());
                    send(&c, &m, 0, 5).unwrap();
                }
                let mut buf = Vec::new();
                while try_receive_into(&c, 0, 6, within, &mut buf)
                    .unwrap()
                    .is_none()
                {}
                assert_eq!(buf, b"done");
                (Vec::new(), Vec::new())
            }
        });
        out.into_iter().next().unwrap()
    }

    #[test]
    fn messages_from_any_sender_keep_each_senders_order_through_rings_and_mpi() {
        // Short ones (the ring), ones of several slots, longer than the ring carries (MPI),
        // and more than the ring holds before the receiver takes any (the rest by MPI).
        let lens = [4, 100, 9000, 40_000, 3, 4096];
        for nodes in [&[0, 0, 0, 0][..], &[0, 1, 0, 1]] {
            let (got, rings) = gather(nodes, 150, &lens);
            let same_node: Vec<bool> = (0..4).map(|r| r > 0 && nodes[r] == 0).collect();
            assert_eq!(rings, same_node, "nodes {nodes:?}");
            for (r, msgs) in got.iter().enumerate().skip(1) {
                let want: Vec<(usize, usize)> =
                    (0..150).map(|k| (k, lens[k % lens.len()].max(4))).collect();
                assert_eq!(msgs, &want, "rank {r} on nodes {nodes:?}");
            }
        }
    }

    #[test]
    fn a_named_sender_is_taken_alone_and_others_wait_their_turn() {
        let out = LocalComm::run(3, |c| {
            let within = Duration::from_secs(20);
            let mut buf = Vec::new();
            match c.rank() {
                0 => {
                    // Both have sent; take rank 2's first, then whatever is left.
                    let mut order = Vec::new();
                    while try_receive_into(&c, 2, 5, within, &mut buf)
                        .unwrap()
                        .is_none()
                    {}
                    order.push(buf.clone());
                    while order.len() < 3 {
                        if try_receive_into(&c, ANY_SOURCE, 5, within, &mut buf)
                            .unwrap()
                            .is_some()
                        {
                            order.push(buf.clone());
                        }
                    }
                    send(&c, b"done", 1, 6).unwrap();
                    send(&c, b"done", 2, 6).unwrap();
                    order
                }
                r => {
                    send(&c, &[r as u8; 10], 0, 5).unwrap();
                    if r == 1 {
                        send(&c, &[9; 20], 0, 5).unwrap();
                    }
                    while try_receive_into(&c, 0, 6, within, &mut buf)
                        .unwrap()
                        .is_none()
                    {}
                    Vec::new()
                }
            }
        });
        assert_eq!(out[0], vec![vec![2u8; 10], vec![1; 10], vec![9; 20]]);
    }
}
