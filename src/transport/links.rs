//! A communicator's link memory: per (peer, tag), the tensor last sent and last received,
//! so [`super::p2p`] can leave out headers that say nothing new (see its module
//! documentation), and the link's rings where the peer runs on this node
//! ([`super::ring`]). The data lives here, below the [`super::comm::Comm`] trait that
//! hands each communicator's memory out; what p2p does with it lives in p2p.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::tensor::{header_payload_len, Tensor};

/// What one side of a link last sent or received: enough to leave out the next header.
#[derive(Debug, Clone)]
pub(super) struct Last {
    pub(super) signature: u64,
    pub(super) nbytes: usize,
    pub(super) header: Vec<u8>,
}

impl Last {
    pub(super) fn of(t: &Tensor) -> Last {
        Last {
            signature: t.signature(),
            nbytes: t.nbytes(),
            header: t.wire_header().to_vec(),
        }
    }

    pub(super) fn from_header(header: Vec<u8>) -> Option<Last> {
        Some(Last {
            signature: crate::hash::fnv1a(&header),
            nbytes: header_payload_len(&header)?,
            header,
        })
    }
}

/// Hashes a link key (peer and tag in one `u64`) with one multiplication: SipHash would
/// cost more than the header it saves on a small message.
#[derive(Default)]
pub(super) struct LinkHasher(u64);

impl Hasher for LinkHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b) ^ self.0.rotate_left(8));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = mix(v);
    }
}

#[inline]
fn mix(v: u64) -> u64 {
    let x = (v ^ (v >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

/// A map by link key (see [`link_key`]), hashed by [`LinkHasher`].
pub(super) type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<LinkHasher>>;
type LinkMap = KeyMap<Last>;

/// Slots of the direct-mapped memo in front of each side's map.
const HOT: usize = 64;
/// A memo slot that holds no link (no link has this key: tags are not negative).
const NO_LINK: (u64, u64) = (u64::MAX, 0);

/// One direction of a communicator's links: the tensor of each (peer, tag), and a memo of
/// (key, signature) pairs in front of it, so that a repeat costs two loads, not a hash
/// lookup (a noticeable share of a small message's round trip). A memo slot is only ever a
/// pair that the map holds.
#[derive(Debug)]
pub(super) struct Side {
    map: RefCell<LinkMap>,
    hot: [Cell<(u64, u64)>; HOT],
}

impl Default for Side {
    fn default() -> Side {
        Side {
            map: RefCell::default(),
            hot: std::array::from_fn(|_| Cell::new(NO_LINK)),
        }
    }
}

impl Side {
    #[inline]
    fn slot(&self, key: u64) -> &Cell<(u64, u64)> {
        &self.hot[(mix(key) >> 58) as usize % HOT]
    }

    /// True if the memo says the link `key` holds the tensor of `signature` (false may
    /// still be a hold: ask [`Side::map_holds`]).
    #[inline]
    pub(super) fn memo_holds(&self, key: u64, signature: u64) -> bool {
        self.slot(key).get() == (key, signature)
    }

    /// True if the map says the link `key` holds the tensor of `signature` (after the
    /// memo said no: its slot went to another link); a hold goes back into the memo.
    pub(super) fn map_holds(&self, key: u64, signature: u64) -> bool {
        let held = self
            .map
            .borrow()
            .get(&key)
            .is_some_and(|l| l.signature == signature);
        if held {
            self.slot(key).set((key, signature));
        }
        held
    }

    /// Payload length of the link's tensor, if it has one.
    pub(super) fn nbytes(&self, key: u64) -> Option<usize> {
        self.map.borrow().get(&key).map(|l| l.nbytes)
    }

    /// Makes the link hold `last`; returns what it held.
    pub(super) fn set(&self, key: u64, last: Last) -> Option<Last> {
        self.slot(key).set((key, last.signature));
        self.map.borrow_mut().insert(key, last)
    }

    pub(super) fn forget(&self, key: u64) {
        let slot = self.slot(key);
        if slot.get().0 == key {
            slot.set(NO_LINK);
        }
        self.map.borrow_mut().remove(&key);
    }
}

/// A communicator's memory of the tensor last sent to and last received from each (peer,
/// tag), and of the rings its links to ranks of this node use; see the module
/// documentation.
#[derive(Debug, Default)]
pub struct Links {
    pub(super) sent: Side,
    pub(super) received: Side,
    pub(super) rings: super::ring::LinkRings,
}

#[inline]
pub(super) fn link_key(peer: usize, tag: i32) -> u64 {
    ((peer as u64) << 32) | u64::from(tag as u32)
}
