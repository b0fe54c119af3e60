//! Memory shared by the ranks of one communicator: one segment per rank, each readable and
//! writable by every rank. The [`super::comm::Comm`] backends allocate it (an MPI shared
//! window, or plain allocations in-process); [`super::collectives::shm`] builds its allreduce on it.

/// One segment per rank of a communicator, each readable and writable by every rank.
pub struct SharedSegments {
    ptrs: Vec<*mut u8>,
    len: usize,
    /// Whatever keeps the memory alive (an MPI window, or the in-process allocations).
    _owner: Box<dyn std::any::Any>,
}

impl SharedSegments {
    /// # Safety
    /// Every pointer must point to `len` bytes, 64-byte aligned and zero-filled, that stay
    /// valid while `owner` lives, and rank `r` of the communicator must see the same
    /// memory at `ptrs[r]` (in its own address space) as every other rank.
    pub unsafe fn new(ptrs: Vec<*mut u8>, len: usize, owner: Box<dyn std::any::Any>) -> Self {
        SharedSegments {
            ptrs,
            len,
            _owner: owner,
        }
    }

    /// Ranks, one segment each.
    pub fn ranks(&self) -> usize {
        self.ptrs.len()
    }

    /// Where rank `r`'s segment starts in this process.
    pub fn ptr(&self, r: usize) -> *mut u8 {
        self.ptrs[r]
    }

    /// Bytes per segment.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
