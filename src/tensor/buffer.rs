//! Aligned, zero-initialised byte buffers.
//!
//! Every buffer is 64-byte aligned (a cache line). Buffers of a page (4 KiB) and more are
//! page-aligned, as OSU's benchmarks allocate theirs: a message that starts on a page
//! boundary crosses one page fewer in the kernel's single copy. Buffers of 2 MiB and
//! more are 2 MiB-aligned and advised onto transparent huge pages: fewer TLB misses in
//! the single-copy path (`benches/results/2026-11-25-osu.md` has what each was worth).

use std::alloc::{alloc, alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// Huge-page size: allocations from this size are aligned to it.
pub const HUGE: usize = 2 << 20;
/// Page size (the smallest on the machines MPI runs on): allocations from this size to
/// [`HUGE`] are aligned to it.
pub const PAGE: usize = 4096;

/// An owned, aligned, zeroed byte buffer.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is uniquely owned memory, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (at least 1 byte is allocated).
    pub fn zeroed(len: usize) -> AlignedBuf {
        let align = if len >= HUGE {
            HUGE
        } else if len >= PAGE {
            PAGE
        } else {
            64
        };
        let size = len.max(1).next_multiple_of(align);
        let layout = Layout::from_size_align(size, align).expect("buffer size overflows");
        if align < HUGE {
            // SAFETY: the layout has a non-zero size.
            let raw = unsafe { alloc_zeroed(layout) };
            let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
            return AlignedBuf { ptr, layout };
        }
        // The advice must come before the first touch: zeroing (which the allocator does
        // itself for over-aligned zeroed requests) faults the pages in, as small pages
        // when not yet advised, and which of them khugepaged later merges is luck.
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        // SAFETY: ptr..ptr+size is this allocation; madvise only changes paging advice, and
        // failure (no THP support) is harmless; zeroing then writes only our own bytes.
        unsafe {
            libc::madvise(ptr.as_ptr().cast(), size, libc::MADV_HUGEPAGE);
            std::ptr::write_bytes(ptr.as_ptr(), 0, size);
        }
        AlignedBuf { ptr, layout }
    }

    /// A buffer of `len` bytes (at least 1) aligned to the page size and filled with `byte`,
    /// on the pages the system gives (no huge-page advice): how OSU's benchmarks allocate
    /// theirs (`posix_memalign(sysconf(_SC_PAGESIZE))`, then `memset`), for measurements
    /// that must reproduce them.
    pub fn paged(len: usize, byte: u8) -> AlignedBuf {
        // SAFETY: sysconf only reads a configuration value.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .ok()
            .filter(|p| p.is_power_of_two())
            .unwrap_or(4096);
        let layout = Layout::from_size_align(len.max(1), page).expect("buffer size overflows");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        // SAFETY: ptr..ptr+size is this allocation; filling initialises every byte.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), byte, layout.size()) };
        AlignedBuf { ptr, layout }
    }

    /// Usable length: at least the requested length (`zeroed` rounds it up to the
    /// alignment).
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for layout.size() initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` or `paged` with exactly this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl Clone for AlignedBuf {
    fn clone(&self) -> Self {
        let mut b = AlignedBuf::zeroed(self.len());
        b.as_mut_slice().copy_from_slice(self.as_slice());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_and_zeroing() {
        for len in [0, 1, 63, 64, 65, 4095, 4096, 5000, 3 << 20] {
            let b = AlignedBuf::zeroed(len);
            assert!(b.len() >= len.max(1));
            let align = match len {
                HUGE.. => HUGE,
                PAGE.. => PAGE,
                _ => 64,
            };
            assert_eq!(b.as_ptr() as usize % align, 0, "len {len}");
            assert!(b.as_slice().iter().all(|x| *x == 0));
        }
    }

    #[test]
    fn paged_buffers_are_page_aligned_and_filled() {
        for len in [0, 1, 4095, 4097, 3 << 20] {
            let b = AlignedBuf::paged(len, b'a');
            assert_eq!(b.len(), len.max(1));
            assert_eq!(b.as_ptr() as usize % 4096, 0, "len {len}");
            assert!(b.as_slice().iter().all(|x| *x == b'a'));
        }
    }
}
