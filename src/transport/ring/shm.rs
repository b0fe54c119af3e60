//! A ring's shared-memory object ([`crate::transport::shm_object`]): created by the rank
//! that receives on it, mapped by its sender, and unmapped when dropped.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Geometry, GEOMETRY, MAGIC};
use crate::transport::shm_object;
pub(super) use crate::transport::shm_object::{unlink, Mapping};

impl Mapping {
    /// The word at `offset` (8-byte aligned, inside the mapping).
    #[inline(always)]
    pub(super) fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= self.len());
        // SAFETY: the base is page-aligned and every offset the ring uses is a multiple of
        // 8 within the mapping, which lives as long as `self`; both processes access these
        // words only through atomics.
        unsafe { &*self.base.add(offset).cast::<AtomicU64>() }
    }
}

/// Creates a ring for `geo` under a fresh name: zero-filled, its geometry written.
pub(super) fn create(geo: Geometry) -> std::io::Result<(Mapping, String)> {
    let (map, name) = shm_object::create("ring", geo.len())?;
    for (i, v) in [
        MAGIC,
        geo.nbytes as u64,
        geo.slots as u64,
        geo.stride as u64,
    ]
    .into_iter()
    .enumerate()
    {
        map.word(GEOMETRY + 8 * i).store(v, Ordering::Relaxed);
    }
    Ok((map, name))
}

/// Maps the peer's ring `name`, which must be one for `geo`.
pub(super) fn open(name: &str, geo: Geometry) -> std::io::Result<Mapping> {
    let map = shm_object::open(name, geo.len()).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidData => {
            std::io::Error::other("the peer's ring has another size")
        }
        _ => e,
    })?;
    let want = [
        MAGIC,
        geo.nbytes as u64,
        geo.slots as u64,
        geo.stride as u64,
    ];
    if (0..4).any(|i| map.word(GEOMETRY + 8 * i).load(Ordering::Relaxed) != want[i]) {
        return Err(std::io::Error::other(
            "the peer's ring has another geometry",
        ));
    }
    Ok(map)
}
