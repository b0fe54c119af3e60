//! POSIX shared-memory objects (`shm_open`): created under a fresh name with their pages
//! allocated at once, mapped by name in other processes of the node, unmapped when
//! dropped. The rings ([`super::ring`]) and symmetric memory ([`super::symmetric`]) are
//! made of them.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// A shared object mapped into this process; unmapped when dropped. Neither `Send` nor
/// `Sync` (a raw pointer): its owner says who may touch it from where.
#[derive(Debug)]
pub(crate) struct Mapping {
    pub(crate) base: *mut u8,
    len: usize,
}

impl Mapping {
    /// Maps `len` bytes of the shared object `fd`.
    fn of(fd: &OwnedFd, len: usize) -> std::io::Result<Mapping> {
        // Populated: the page tables are filled here, not at the first store.
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

    /// Bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is this mapping, and nothing borrows it any more.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn c_name(name: &str) -> std::io::Result<CString> {
    CString::new(name).map_err(|_| std::io::Error::other("a shared object's name holds a NUL"))
}

/// Opens the shared object `name` with `flags`.
fn shm_open(name: &str, flags: libc::c_int) -> std::io::Result<OwnedFd> {
    let c = c_name(name)?;
    // SAFETY: `c` is a NUL-terminated name; the call opens or creates an object by name.
    let fd = unsafe { libc::shm_open(c.as_ptr(), flags, 0o600) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Removes the name `name` (mappings of the object stay).
pub(crate) fn unlink(name: &str) {
    if let Ok(c) = c_name(name) {
        // SAFETY: a NUL-terminated name; removing a name touches no memory of ours.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

/// Creates a zero-filled object of `len` bytes under a fresh name `/mpiflow-KIND-PID-N`
/// and maps it; the mapping and the name.
pub(crate) fn create(kind: &str, len: usize) -> std::io::Result<(Mapping, String)> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "/mpiflow-{kind}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let fd = shm_open(&name, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR)?;
    // The pages are allocated now, not when first touched: a shared-memory file system
    // that is full (a container's 64 MiB /dev/shm) refuses the object here, instead of a
    // store into it faulting (SIGBUS) later.
    // SAFETY: sizing an object this process just created (zero-filled by the kernel).
    let sized = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, len as libc::off_t) };
    let map = if sized == 0 {
        Mapping::of(&fd, len)
    } else {
        Err(std::io::Error::from_raw_os_error(sized))
    };
    let map = map.inspect_err(|_| unlink(&name))?;
    Ok((map, name))
}

/// Maps the object `name`, which must be `len` bytes long (else an `InvalidData` error).
pub(crate) fn open(name: &str, len: usize) -> std::io::Result<Mapping> {
    let fd = shm_open(name, libc::O_RDWR)?;
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a `stat` into the buffer it is given.
    if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fstat returned 0, so it filled the struct.
    let size = unsafe { st.assume_init() }.st_size;
    if size != len as libc::off_t {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{name} holds {size} bytes, not {len}"),
        ));
    }
    Mapping::of(&fd, len)
}
