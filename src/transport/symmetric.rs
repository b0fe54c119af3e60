//! Symmetric memory: a region of the same length on every rank of a node's communicator,
//! allocated by all of them together, each rank's region mapped by every rank. An
//! allreduce of a buffer that lies in a region (in place, or from one region into another,
//! at the same offset on every rank) reads every rank's input where it is and writes every
//! rank's result where it goes, with no copy through a slot
//! ([`super::collectives::Collectives::symmetric`]): the idea of SHMEM's symmetric heap and
//! of NCCL's registered buffers.
//!
//! A region is a POSIX shared object per rank (`transport::shm_object`), its name unlinked
//! once every rank has mapped it: nothing is left behind by a rank that dies. Dropping a
//! region unmaps it on this rank only (no other rank waits): a peer still mapping it keeps
//! the memory until it drops its own.

use std::sync::{Arc, Weak};

use super::shm_object::Mapping;

/// One region of symmetric memory, this rank's share: `len` bytes, page-aligned, zeroed
/// when made. See the module.
pub struct Symmetric {
    region: Arc<Region>,
}

/// Every rank's mapping of one region.
pub(crate) struct Region {
    /// Its number in its communicator's sequence of regions (the same on every rank).
    pub(crate) id: u64,
    rank: usize,
    len: usize,
    maps: Vec<Mapping>,
}

// SAFETY: the mappings are the process's, valid until dropped with the region; who reads
// and writes their bytes from which thread is governed by the allreduce's protocol (every
// rank's writes into a peer's region fall between two waits of that call) and, for this
// rank's own bytes, by `Symmetric`'s borrows.
unsafe impl Send for Region {}
// SAFETY: as for Send: `&Region` hands out raw pointers only.
unsafe impl Sync for Region {}

impl Region {
    /// Over `maps` (every rank's, by rank, each `len` bytes), this rank's being `maps[rank]`.
    pub(crate) fn new(id: u64, rank: usize, len: usize, maps: Vec<Mapping>) -> Region {
        assert!(maps.iter().all(|m| m.len() >= len) && rank < maps.len());
        Region {
            id,
            rank,
            len,
            maps,
        }
    }

    /// Where rank `r`'s region starts in this process.
    pub(crate) fn ptr(&self, r: usize) -> *mut u8 {
        self.maps[r].base
    }

    /// The offset of `len` bytes at `p` in this rank's region, if they lie in it.
    pub(crate) fn offset_of(&self, p: *const u8, len: usize) -> Option<usize> {
        let at = (p as usize).checked_sub(self.ptr(self.rank) as usize)?;
        (at.checked_add(len)? <= self.len).then_some(at)
    }
}

impl Symmetric {
    pub(crate) fn new(region: Region) -> Symmetric {
        Symmetric {
            region: Arc::new(region),
        }
    }

    /// A weak handle, for the communicator's list of regions.
    pub(crate) fn downgrade(&self) -> Weak<Region> {
        Arc::downgrade(&self.region)
    }

    /// Bytes in this rank's region.
    pub fn len(&self) -> usize {
        self.region.len
    }

    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }

    /// Where this rank's region starts (valid while `self` lives).
    pub fn as_ptr(&self) -> *mut u8 {
        self.region.ptr(self.region.rank)
    }

    /// This rank's region.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the region's `len` bytes are mapped while `self` lives; peers write into
        // them only inside an allreduce this rank is in, which takes `&mut` of them.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }

    /// This rank's region, to fill or to reduce in place.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len()) }
    }
}

impl std::fmt::Debug for Symmetric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Symmetric")
            .field("id", &self.region.id)
            .field("len", &self.region.len)
            .finish()
    }
}

/// A communicator's regions, to find the one a buffer lies in.
#[derive(Default)]
pub(crate) struct Regions {
    next: std::cell::Cell<u64>,
    live: std::cell::RefCell<Vec<Weak<Region>>>,
}

impl Regions {
    /// The next region's number (the same on every rank: regions are made collectively).
    pub(crate) fn next_id(&self) -> u64 {
        let id = self.next.get();
        self.next.set(id + 1);
        id
    }

    pub(crate) fn add(&self, s: &Symmetric) {
        let mut live = self.live.borrow_mut();
        live.retain(|w| w.strong_count() > 0);
        live.push(s.downgrade());
    }

    /// The region `len` bytes at `p` lie in, and their offset there.
    pub(crate) fn find(&self, p: *const u8, len: usize) -> Option<(Arc<Region>, usize)> {
        let live = self.live.borrow();
        live.iter().filter_map(Weak::upgrade).find_map(|r| {
            let at = r.offset_of(p, len)?;
            Some((r, at))
        })
    }
}
