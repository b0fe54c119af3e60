//! Messages of any length on a link's ring, received from one peer or from any
//! ([`crate::transport::messages`]): a server's requests, which come from whichever client
//! sends first, and its replies.
//!
//! The sender's side is a link's ([`LinkRings::put`]), with the ring made at the link's
//! first message whatever its length (a request's first message says nothing of the
//! rest). A receive polls the ring of the peer it names, or, from any peer, the ring of
//! every peer that has sent on the tag (from the one after the peer it took last, so that
//! none waits behind peers that send again at once), and then MPI. A message MPI delivers
//! from a peer with a ring may have overtaken the ring's: the ring's protocol numbers
//! every message, so a message the ring says went by MPI is the next MPI message from
//! that peer, and one that arrives before the ring's that precede it waits in the link's
//! stash until its turn. A message of several slots is taken once it is whole in the ring
//! (never waiting on a sender that may have died halfway: its receiver learns of that by
//! its own deadline, as of a sender gone quiet).

use std::time::Duration;

use super::{LinkRings, Receiving, State};
use crate::transport::comm::{Comm, TransportError, ANY_SOURCE};
use crate::transport::links::link_key;
use crate::transport::ring::Next;

/// The peers whose rings a receive from any peer on one tag polls, and where it starts.
#[derive(Debug, Default)]
pub(super) struct Turn {
    peers: Vec<usize>,
    next: usize,
}

/// Where a link's next message is, as [`LinkRings::next_of`] found it.
enum Found {
    /// In `buf`.
    Taken,
    /// Sent by MPI and not received yet: the caller receives it from the peer.
    ByMpi,
    /// In the ring, not whole yet.
    Partial,
    /// Not sent yet.
    No,
}

impl LinkRings {
    /// Puts the message `bytes` to `dst` on `tag` into the link's ring: `true` if it went
    /// there (the send is complete), `false` if the caller sends it by MPI. The ring is
    /// made at the link's first message, whatever its length.
    #[inline]
    pub(crate) fn put_message<C: Comm>(
        &self,
        c: &C,
        bytes: &[u8],
        dst: usize,
        tag: i32,
    ) -> Result<bool, TransportError> {
        self.put_first(c, bytes, dst, tag, 0)
    }

    /// The next message on `tag` from `src` (or any peer: [`ANY_SOURCE`]) into `buf`,
    /// resized to it, if one is here or has begun to arrive; the sender. A message whose
    /// transfer does not complete within `within` (or a link's offer that does not come)
    /// is a timeout naming its sender.
    pub(crate) fn try_receive_message<C: Comm>(
        &self,
        c: &C,
        src: usize,
        tag: i32,
        within: Duration,
        buf: &mut Vec<u8>,
    ) -> Result<Option<usize>, TransportError> {
        if src == ANY_SOURCE {
            if let Some(from) = self.poll_rings(tag, buf) {
                return Ok(Some(from));
            }
        } else if self.receives_by_ring(src, tag) {
            // Every message of the link is numbered: nothing comes by MPI unannounced.
            return match self.next_of(src, tag, buf) {
                Found::Taken => Ok(Some(src)),
                Found::ByMpi => self.receive_announced(c, src, tag, within, buf),
                Found::Partial | Found::No => {
                    c.progress();
                    Ok(None)
                }
            };
        }
        match c.try_receive_into(src, tag, within, buf)? {
            Some(from) => self.arrived_by_mpi(c, from, tag, within, buf),
            None => Ok(None),
        }
    }

    /// The rings of every peer that has sent on `tag`, each once, from the one after the
    /// peer last taken.
    fn poll_rings(&self, tag: i32, buf: &mut Vec<u8>) -> Option<usize> {
        let key = u64::from(tag as u32);
        let n = self
            .message_rings
            .borrow()
            .get(&key)
            .map_or(0, |t| t.peers.len());
        for _ in 0..n {
            let peer = {
                let mut turns = self.message_rings.borrow_mut();
                let turn = turns.get_mut(&key).expect("a tag with rings");
                let peer = turn.peers[turn.next % n];
                turn.next = (turn.next + 1) % n;
                peer
            };
            // A message sent by MPI is taken below, from any source, with the others.
            if let Found::Taken = self.next_of(peer, tag, buf) {
                return Some(peer);
            }
        }
        None
    }

    /// A message MPI delivered (into `buf`) from `from` on `tag`: where `from` has a ring,
    /// the message due next from it (which may be the ring's, this one then waiting in
    /// the stash for its turn; `None` while the ring's is not whole). The link's first
    /// message is preceded by its offer, read here.
    fn arrived_by_mpi<C: Comm>(
        &self,
        c: &C,
        from: usize,
        tag: i32,
        within: Duration,
        buf: &mut Vec<u8>,
    ) -> Result<Option<usize>, TransportError> {
        if !c.same_node(from) {
            return Ok(Some(from));
        }
        let key = link_key(from, tag);
        self.entry(key);
        let first = matches!(self.receiving.borrow()[&key].state, State::Unknown);
        if first {
            self.resolve_within(c, from, tag, Some(within))?;
        }
        let ring = self.receives_by_ring(from, tag);
        if first && ring {
            let mut turns = self.message_rings.borrow_mut();
            turns
                .entry(u64::from(tag as u32))
                .or_default()
                .peers
                .push(from);
        }
        if !ring {
            return Ok(Some(from));
        }
        self.with(from, tag, |r| r.stash.push_back(std::mem::take(buf)));
        match self.next_of(from, tag, buf) {
            Found::Taken => Ok(Some(from)),
            Found::Partial => Ok(None),
            // Not a message the ring's protocol numbered (none is sent so): as it came.
            Found::No | Found::ByMpi => {
                *buf = self
                    .with(from, tag, |r| r.stash.pop_back())
                    .unwrap_or_default();
                Ok(Some(from))
            }
        }
    }

    /// The next message of the link from `peer` on `tag` (which has a ring), into `buf`
    /// where it is in the ring or in the stash.
    fn next_of(&self, peer: usize, tag: i32, buf: &mut Vec<u8>) -> Found {
        self.with(peer, tag, |r| {
            let State::Ring(inb) = &r.state else {
                return Found::No;
            };
            match inb.poll() {
                Next::Ring => {
                    let Some(len) = inb.whole() else {
                        return Found::Partial;
                    };
                    buf.resize(len, 0);
                    inb.take(buf);
                    Found::Taken
                }
                Next::Mpi => match r.stash.pop_front() {
                    Some(m) => {
                        inb.skip();
                        *buf = m;
                        Found::Taken
                    }
                    None => Found::ByMpi,
                },
                Next::NotYet => Found::No,
            }
        })
    }

    /// The message from `peer` on `tag` that its ring says went by MPI, if it has begun to
    /// arrive (its send starts right after the ring said so: a receiver that waited for it
    /// would wait on a sender the scheduler may have put aside, while other peers'
    /// messages are here).
    fn receive_announced<C: Comm>(
        &self,
        c: &C,
        peer: usize,
        tag: i32,
        within: Duration,
        buf: &mut Vec<u8>,
    ) -> Result<Option<usize>, TransportError> {
        let got = c.try_receive_into(peer, tag, within, buf)?;
        if got.is_some() {
            self.with(peer, tag, |r| {
                if let State::Ring(inb) = &r.state {
                    inb.skip();
                }
            });
        }
        Ok(got)
    }

    fn with<R>(&self, peer: usize, tag: i32, f: impl FnOnce(&mut Receiving) -> R) -> R {
        let mut map = self.receiving.borrow_mut();
        f(map
            .get_mut(&link_key(peer, tag))
            .expect("a link with a receiving side"))
    }
}
