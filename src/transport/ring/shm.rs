//! A ring's shared-memory object: created by the rank that receives on it (POSIX
//! `shm_open`, its pages allocated at once), mapped by its sender, and unmapped when
//! dropped.

use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Geometry, GEOMETRY, MAGIC};

/// A ring's shared object mapped into this process; unmapped when dropped. Neither `Send`
/// nor `Sync` (a raw pointer): a ring has one producer and one consumer, so a channel on
/// rings stays on the thread that opened it.
#[derive(Debug)]
pub(super) struct Mapping {
    pub(super) base: *mut u8,
    len: usize,
}

impl Mapping {
    /// Maps `len` bytes of the shared object `fd`.
    fn of(fd: &std::os::fd::OwnedFd, len: usize) -> std::io::Result<Mapping> {
        use std::os::fd::AsRawFd;
        // Populated: the page tables are filled here, not at a slot's first message.
        // SAFETY: a fresh shared mapping of an open descriptor; the kernel picks the
        // address, so no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping {
            base: base.cast(),
            len,
        })
    }

    /// The word at `offset` (8-byte aligned, inside the mapping).
    #[inline(always)]
    pub(super) fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= self.len);
        // SAFETY: the base is page-aligned and every offset the ring uses is a multiple of
        // 8 within the mapping, which lives as long as `self`; both processes access these
        // words only through atomics.
        unsafe { &*self.base.add(offset).cast::<AtomicU64>() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is this mapping, and nothing borrows it any more.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn c_name(name: &str) -> std::io::Result<CString> {
    CString::new(name).map_err(|_| std::io::Error::other("a ring's name holds a NUL"))
}

/// Opens the shared object `name` with `flags`.
fn shm_open(name: &str, flags: libc::c_int) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let c = c_name(name)?;
    // SAFETY: `c` is a NUL-terminated name; the call opens or creates an object by name.
    let fd = unsafe { libc::shm_open(c.as_ptr(), flags, 0o600) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

pub(super) fn unlink(name: &str) {
    if let Ok(c) = c_name(name) {
        // SAFETY: a NUL-terminated name; removing a name touches no memory of ours.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

/// Creates a ring for `geo` under a fresh name: zero-filled, its geometry written.
pub(super) fn create(geo: Geometry) -> std::io::Result<(Mapping, String)> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "/mpiflow-ring-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let fd = shm_open(&name, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR)?;
    // The pages are allocated now, not when first touched: a shared-memory file system
    // that is full (a container's 64 MiB /dev/shm) refuses the ring here, and the channel
    // stays on MPI, instead of a store into the ring faulting (SIGBUS) later.
    let sized = {
        use std::os::fd::AsRawFd;
        // SAFETY: sizing an object this process just created (zero-filled by the kernel).
        unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, geo.len() as libc::off_t) }
    };
    let map = if sized == 0 {
        Mapping::of(&fd, geo.len())
    } else {
        Err(std::io::Error::from_raw_os_error(sized))
    };
    let map = map.inspect_err(|_| unlink(&name))?;
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
    let fd = shm_open(name, libc::O_RDWR)?;
    let size = {
        use std::os::fd::AsRawFd;
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstat writes a `stat` into the buffer it is given.
        if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fstat returned 0, so it filled the struct.
        unsafe { st.assume_init() }.st_size
    };
    if size != geo.len() as libc::off_t {
        return Err(std::io::Error::other("the peer's ring has another size"));
    }
    let map = Mapping::of(&fd, geo.len())?;
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
