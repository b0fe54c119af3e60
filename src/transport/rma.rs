//! One-sided communication (MPI RMA): memory windows, passive-target epochs, `get`, `put`,
//! `accumulate` and atomics, over the raw `mpi::ffi` calls (rsmpi has no RMA).
//!
//! On InfiniBand or RoCE these are RDMA reads, writes and atomics that the target's CPU
//! takes no part in; over shared memory and TCP, MPI emulates them (see `docs/rma.md`,
//! which names the OpenMPI components that do it).
//!
//! Safety comes from lifetimes:
//! - A [`Window`] owns memory from `MPI_Win_allocate`. [`Window::lock_all`] borrows it
//!   mutably and returns an [`Epoch`] (`MPI_Win_lock_all`), whose drop calls
//!   `MPI_Win_unlock_all`: the window cannot be freed while an epoch is open.
//! - Blocking calls ([`Epoch::get_into`], [`Epoch::put`], [`Epoch::accumulate_sum`], and the
//!   atomics [`Epoch::fetch_and_add`], [`Epoch::compare_and_swap`]) complete at the target
//!   (`MPI_Win_flush`) before they return.
//! - Non-blocking calls exist only inside [`Epoch::batch`]: buffers lent to a batch must
//!   outlive it, and the batch ends with a flush of every rank it touched, even when its closure panics,
//!   so no buffer is reused or freed with an operation on it in flight. This is the
//!   pattern of `std::thread::scope`: unlike a request guard, it cannot be skipped with
//!   `mem::forget`.
//! - Every displacement and length is checked against the target's window size (gathered
//!   when the window is allocated) before MPI sees it, and every return code is checked.
//!
//! Freeing a window (`MPI_Win_free`) is collective: only [`Window::free`] does it. A window
//! dropped without it (an error path, where the other ranks may never free theirs) is left
//! to process exit, because freeing it alone could wait forever.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::os::raw::{c_int, c_void};
use std::ptr::NonNull;

use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::traits::*;

use super::mpi::{error_string, MpiComm};

mod batch;
pub use batch::Batch;

/// OpenMPI's one-sided components when there is no RDMA device: `osc sm` within a node,
/// `osc pt2pt` (emulation over point-to-point messages) across nodes. mpiflow sets
/// `OMPI_MCA_osc` to this before `MPI_Init` unless the user set it.
pub const OSC_WITHOUT_RDMA: &str = "sm,pt2pt";

/// The most elements [`Epoch::read_atomic`] reads in one `MPI_Get_accumulate`.
pub const ATOMIC_CHUNK: usize = 1 << 16;

/// The RDMA devices of this machine (`/sys/class/infiniband`: InfiniBand, RoCE, iWARP).
pub fn rdma_devices() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// One line saying which one-sided path this job takes, for logs.
pub fn path_note() -> String {
    let devices = rdma_devices();
    match std::env::var("OMPI_MCA_osc") {
        Ok(osc) if devices.is_empty() && osc == OSC_WITHOUT_RDMA => format!(
            "# one-sided: no RDMA device, so OpenMPI's osc {osc} (shared memory in a node, emulated over point-to-point across nodes); on InfiniBand/RoCE run with --mca pml ucx --mca osc ucx"
        ),
        Ok(osc) if devices.is_empty() && osc == "ucx" => "# one-sided: osc ucx without an RDMA device (UCX over shared memory and TCP): atomics and accumulates are emulated on the target, which must poll; osc sm,pt2pt (--rdma-stack auto) is faster here".to_string(),
        Ok(osc) => format!("# one-sided: osc {osc} (OMPI_MCA_osc); RDMA devices: {devices:?}"),
        Err(_) => format!("# one-sided: the MPI library's default; RDMA devices: {devices:?}"),
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Element types a window can hold, with their MPI datatype.
pub trait RmaType:
    sealed::Sealed + Copy + Default + PartialEq + std::fmt::Debug + Send + Sync + 'static
{
    /// The MPI datatype handle (`MPI_FLOAT`, `MPI_INT64_T`, ...).
    fn datatype() -> ffi::MPI_Datatype;

    /// `a + b` as `MPI_SUM` adds (integers wrap).
    fn sum(a: Self, b: Self) -> Self;
}

macro_rules! rma_type {
    ($t:ty, $handle:ident, $sum:expr) => {
        impl sealed::Sealed for $t {}
        impl RmaType for $t {
            fn datatype() -> ffi::MPI_Datatype {
                // SAFETY: the RSMPI_* handles are constants set up by the MPI library.
                unsafe { ffi::$handle }
            }

            fn sum(a: Self, b: Self) -> Self {
                $sum(a, b)
            }
        }
    };
}
rma_type!(u8, RSMPI_UINT8_T, u8::wrapping_add);
rma_type!(f32, RSMPI_FLOAT, |a: f32, b: f32| a + b);
rma_type!(f64, RSMPI_DOUBLE, |a: f64, b: f64| a + b);
rma_type!(i32, RSMPI_INT32_T, i32::wrapping_add);
rma_type!(i64, RSMPI_INT64_T, i64::wrapping_add);
rma_type!(u64, RSMPI_UINT64_T, u64::wrapping_add);

/// Errors from [`Window::allocate`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    #[error("rank {rank}: MPI_Win_allocate of {bytes} bytes failed: {message}")]
    Mpi {
        rank: usize,
        bytes: usize,
        message: String,
    },
    #[error("rank {rank}: a window of {len} elements is too large for this MPI")]
    TooLarge { rank: usize, len: usize },
    #[error("rank {rank}: {message}")]
    Other { rank: usize, message: String },
}

/// Errors from operations on a window.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RmaError {
    #[error("rank {rank}: {call} failed: {message}")]
    Mpi {
        call: &'static str,
        rank: usize,
        message: String,
    },
    #[error(
        "rank {rank}: {call}: elements {offset}..{end} are outside rank {target}'s window of {len}"
    )]
    OutOfRange {
        call: &'static str,
        rank: usize,
        target: usize,
        offset: usize,
        end: usize,
        len: usize,
    },
    #[error("rank {rank}: {call}: rank {target} is not in the window's group of {size}")]
    NoSuchRank {
        call: &'static str,
        rank: usize,
        target: usize,
        size: usize,
    },
}

/// Memory every rank of a communicator exposes to the others' one-sided operations.
pub struct Window<T: RmaType> {
    win: ffi::MPI_Win,
    base: NonNull<T>,
    len: usize,
    /// Window length (elements) of every rank, for bounds checks.
    lens: Vec<usize>,
    rank: usize,
}

// SAFETY: an MPI window handle is valid in any thread; a Window is used by one thread at
// a time (its methods take &self or &mut self and it is not Sync).
unsafe impl<T: RmaType> Send for Window<T> {}

impl<T: RmaType> Window<T> {
    /// `MPI_Win_allocate`: `len` zeroed elements on this rank, exposed to every rank of
    /// `comm` (collective; lengths may differ by rank, 0 included).
    pub fn allocate(comm: &MpiComm, len: usize) -> Result<Window<T>, AllocateError> {
        let rank = comm.raw().rank() as usize;
        let unit = std::mem::size_of::<T>();
        let bytes = len
            .checked_mul(unit)
            .filter(|b| isize::try_from(*b).is_ok())
            .ok_or(AllocateError::TooLarge { rank, len })?;
        let mut base: *mut T = std::ptr::null_mut();
        // SAFETY: a null handle, filled in by MPI_Win_allocate.
        let mut win: ffi::MPI_Win = unsafe { ffi::RSMPI_WIN_NULL };
        // SAFETY: comm is a valid communicator; `base` receives a pointer to `bytes` bytes
        // that MPI owns until MPI_Win_free; `win` receives the handle.
        let rc = unsafe {
            ffi::MPI_Win_allocate(
                bytes as ffi::MPI_Aint,
                unit as c_int,
                ffi::RSMPI_INFO_NULL,
                comm.raw().as_raw(),
                (&mut base as *mut *mut T).cast::<c_void>(),
                &mut win,
            )
        };
        if rc != ffi::MPI_SUCCESS as c_int {
            return Err(AllocateError::Mpi {
                rank,
                bytes,
                message: error_string(rc),
            });
        }
        // Errors on this window come back as codes, never abort the job.
        // SAFETY: win is the valid window just created; MPI_ERRORS_RETURN is a constant.
        unsafe { ffi::MPI_Win_set_errhandler(win, ffi::RSMPI_ERRORS_RETURN) };
        let base = match NonNull::new(base) {
            Some(b) if len > 0 => {
                // SAFETY: MPI returned `bytes` bytes at `b`, aligned for any basic type;
                // nothing else refers to them yet.
                unsafe { std::ptr::write_bytes(b.as_ptr(), 0, len) };
                b
            }
            // A zero-length window may have a null base: never dereferenced.
            _ => NonNull::dangling(),
        };
        let mut lens = vec![0u64; comm.raw().size() as usize];
        comm.raw().all_gather_into(&(len as u64), &mut lens[..]);
        Ok(Window {
            win,
            base,
            len,
            lens: lens.into_iter().map(|l| l as usize).collect(),
            rank,
        })
    }

    /// Elements on this rank.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements on rank `target`.
    pub fn len_of(&self, target: usize) -> Option<usize> {
        self.lens.get(target).copied()
    }

    /// This rank's window memory, outside any epoch of this rank.
    ///
    /// # Safety
    /// Other ranks' epochs are theirs: `&mut self` cannot stop them. The caller's protocol
    /// must guarantee that no rank accesses this rank's window meanwhile (for example:
    /// initialise, then a barrier before any rank opens an epoch).
    pub unsafe fn local_mut(&mut self) -> &mut [T] {
        // SAFETY: base points to len initialised elements owned by the window; &mut self
        // excludes local access, the caller remote access.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr(), self.len) }
    }

    /// Opens a passive-target epoch to every rank (`MPI_Win_lock_all` with
    /// `MPI_MODE_NOCHECK`: this layer never takes exclusive locks, so no lock can conflict).
    pub fn lock_all(&mut self) -> Result<Epoch<'_, T>, RmaError> {
        // SAFETY: a valid window, not already locked (lock_all borrows it mutably).
        let rc = unsafe { ffi::MPI_Win_lock_all(ffi::MPI_MODE_NOCHECK as c_int, self.win) };
        check("MPI_Win_lock_all", self.rank, rc)?;
        Ok(Epoch { win: self })
    }

    /// `MPI_Win_free` (collective over the window's communicator).
    pub fn free(mut self) -> Result<(), RmaError> {
        // SAFETY: a valid window with no open epoch (an Epoch would borrow self).
        let rc = unsafe { ffi::MPI_Win_free(&mut self.win) };
        check("MPI_Win_free", self.rank, rc)
    }
}

fn check(call: &'static str, rank: usize, rc: c_int) -> Result<(), RmaError> {
    if rc == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(RmaError::Mpi {
            call,
            rank,
            message: error_string(rc),
        })
    }
}

/// An open passive-target epoch on a window; dropping it calls `MPI_Win_unlock_all`,
/// which completes every operation of this rank on the window.
pub struct Epoch<'w, T: RmaType> {
    win: &'w mut Window<T>,
}

impl<T: RmaType> Drop for Epoch<'_, T> {
    fn drop(&mut self) {
        // SAFETY: the window is locked by this epoch. A failure here cannot be reported
        // from drop; the operations it would complete were already flushed by every call.
        unsafe { ffi::MPI_Win_unlock_all(self.win.win) };
    }
}

impl<'w, T: RmaType> Epoch<'w, T> {
    /// This rank's number in the window's group.
    pub fn rank(&self) -> usize {
        self.win.rank
    }

    /// Checks `offset..offset+count` against rank `target`'s window, and that `count`
    /// fits an MPI count.
    fn range(
        &self,
        call: &'static str,
        target: usize,
        offset: usize,
        count: usize,
    ) -> Result<(c_int, ffi::MPI_Aint, c_int), RmaError> {
        let len = self.win.len_of(target).ok_or(RmaError::NoSuchRank {
            call,
            rank: self.win.rank,
            target,
            size: self.win.lens.len(),
        })?;
        let end = offset.saturating_add(count);
        let out_of_range = || RmaError::OutOfRange {
            call,
            rank: self.win.rank,
            target,
            offset,
            end,
            len,
        };
        if end > len {
            return Err(out_of_range());
        }
        let count = c_int::try_from(count).map_err(|_| out_of_range())?;
        let disp = ffi::MPI_Aint::try_from(offset).map_err(|_| out_of_range())?;
        Ok((target as c_int, disp, count))
    }

    /// `MPI_Win_flush`: completes this rank's operations to `target`, at the target.
    pub fn flush(&self, target: usize) -> Result<(), RmaError> {
        // SAFETY: a valid, locked window.
        let rc = unsafe { ffi::MPI_Win_flush(target as c_int, self.win.win) };
        check("MPI_Win_flush", self.win.rank, rc)
    }

    /// `MPI_Win_flush_all`: completes every operation of this rank on the window.
    pub fn flush_all(&self) -> Result<(), RmaError> {
        // SAFETY: a valid, locked window.
        let rc = unsafe { ffi::MPI_Win_flush_all(self.win.win) };
        check("MPI_Win_flush_all", self.win.rank, rc)
    }

    /// `MPI_Win_sync`: makes this rank's window memory and its RMA view agree (needed
    /// around direct loads and stores, see [`Epoch::with_local`]).
    pub fn sync(&self) -> Result<(), RmaError> {
        // SAFETY: a valid, locked window.
        let rc = unsafe { ffi::MPI_Win_sync(self.win.win) };
        check("MPI_Win_sync", self.win.rank, rc)
    }

    /// `MPI_Get` of `buf.len()` elements from `target` at element `offset`, completed.
    pub fn get_into(&self, target: usize, offset: usize, buf: &mut [T]) -> Result<(), RmaError> {
        // SAFETY: buf is borrowed until the flush below completes the get.
        unsafe { self.start(Op::Get, target, offset, buf.as_mut_ptr(), buf.len()) }?;
        self.flush(target)
    }

    /// `MPI_Put` of `buf` to `target` at element `offset`, completed at the target.
    pub fn put(&self, target: usize, offset: usize, buf: &[T]) -> Result<(), RmaError> {
        // SAFETY: buf is borrowed until the flush below; MPI only reads it.
        unsafe { self.start(Op::Put, target, offset, buf.as_ptr().cast_mut(), buf.len()) }?;
        self.flush(target)
    }

    /// `MPI_Accumulate` with `MPI_SUM` of `buf` into `target` at element `offset`
    /// (element-wise atomic with respect to other accumulates), completed at the target.
    pub fn accumulate_sum(&self, target: usize, offset: usize, buf: &[T]) -> Result<(), RmaError> {
        // SAFETY: buf is borrowed until the flush below; MPI only reads it.
        unsafe {
            self.start(
                Op::AccumulateSum,
                target,
                offset,
                buf.as_ptr().cast_mut(),
                buf.len(),
            )
        }?;
        self.flush(target)
    }

    /// Starts one operation on `count` elements at `buf` (range-checked first).
    ///
    /// # Safety
    /// `buf` must point to `count` elements that stay valid (and, for `Get`, unaliased)
    /// until a flush of `target` completes the operation.
    unsafe fn start(
        &self,
        op: Op,
        target: usize,
        offset: usize,
        buf: *mut T,
        count: usize,
    ) -> Result<(), RmaError> {
        let call = op.call();
        let (t, disp, n) = self.range(call, target, offset, count)?;
        let (dt, win) = (T::datatype(), self.win.win);
        // SAFETY: the caller keeps buf valid until the completing flush; the target range
        // was checked against the target's window; the window is locked by this epoch.
        let rc = unsafe {
            match op {
                Op::Get => ffi::MPI_Get(buf.cast(), n, dt, t, disp, n, dt, win),
                Op::Put => ffi::MPI_Put(buf.cast(), n, dt, t, disp, n, dt, win),
                Op::AccumulateSum => {
                    ffi::MPI_Accumulate(buf.cast(), n, dt, t, disp, n, dt, ffi::RSMPI_SUM, win)
                }
            }
        };
        check(call, self.win.rank, rc)
    }

    /// `MPI_Fetch_and_op` with `MPI_SUM`: atomically adds `value` to one element of
    /// `target`'s window and returns the element's previous value (`value` = 0 reads it).
    pub fn fetch_and_add(&self, target: usize, offset: usize, value: T) -> Result<T, RmaError> {
        let (t, disp, _) = self.range("MPI_Fetch_and_op", target, offset, 1)?;
        let mut old = T::default();
        // SAFETY: both buffers hold one T and live until the flush below completes the
        // operation; the displacement was checked against the target's window.
        let rc = unsafe {
            ffi::MPI_Fetch_and_op(
                (&value as *const T).cast::<c_void>(),
                (&mut old as *mut T).cast::<c_void>(),
                T::datatype(),
                t,
                disp,
                ffi::RSMPI_SUM,
                self.win.win,
            )
        };
        check("MPI_Fetch_and_op", self.win.rank, rc)?;
        self.flush(target)?;
        Ok(old)
    }

    /// `MPI_Get_accumulate` of zeros with `MPI_SUM`: reads `out.len()` elements of
    /// `target`'s window at `offset`, each atomically with respect to accumulates landing
    /// meanwhile (as `fetch_and_add` of 0 would); up to [`ATOMIC_CHUNK`] elements in one
    /// operation, more in several.
    pub fn read_atomic(&self, target: usize, offset: usize, out: &mut [T]) -> Result<(), RmaError> {
        // A few words (a poll's) from the stack, more from the heap.
        let (few, many);
        let zeros: &[T] = match out.len() <= 8 {
            true => {
                few = [T::default(); 8];
                &few
            }
            false => {
                many = vec![T::default(); out.len().min(ATOMIC_CHUNK)];
                &many
            }
        };
        for (i, chunk) in out.chunks_mut(ATOMIC_CHUNK).enumerate() {
            let at = offset + i * ATOMIC_CHUNK;
            let (t, at, n) = self.range("MPI_Get_accumulate", target, at, chunk.len())?;
            // SAFETY: `zeros` and `chunk` hold at least `n` elements and live until the
            // flush below completes the operation; the range was checked against the
            // target's window.
            let rc = unsafe {
                ffi::MPI_Get_accumulate(
                    zeros.as_ptr().cast::<c_void>(),
                    n,
                    T::datatype(),
                    chunk.as_mut_ptr().cast::<c_void>(),
                    n,
                    T::datatype(),
                    t,
                    at,
                    n,
                    T::datatype(),
                    ffi::RSMPI_SUM,
                    self.win.win,
                )
            };
            check("MPI_Get_accumulate", self.win.rank, rc)?;
        }
        self.flush(target)
    }

    /// `MPI_Compare_and_swap`: if the element equals `compare`, it becomes `swap`; returns
    /// the element's previous value either way.
    pub fn compare_and_swap(
        &self,
        target: usize,
        offset: usize,
        compare: T,
        swap: T,
    ) -> Result<T, RmaError> {
        let (t, disp, _) = self.range("MPI_Compare_and_swap", target, offset, 1)?;
        let mut old = T::default();
        // SAFETY: the three buffers hold one T each and live until the flush below; the
        // displacement was checked against the target's window.
        let rc = unsafe {
            ffi::MPI_Compare_and_swap(
                (&swap as *const T).cast::<c_void>(),
                (&compare as *const T).cast::<c_void>(),
                (&mut old as *mut T).cast::<c_void>(),
                T::datatype(),
                t,
                disp,
                self.win.win,
            )
        };
        check("MPI_Compare_and_swap", self.win.rank, rc)?;
        self.flush(target)?;
        Ok(old)
    }

    /// Runs `f` with direct access to this rank's window memory, between two
    /// `MPI_Win_sync` calls (the memory model's rule for loads and stores inside an epoch).
    ///
    /// # Safety
    /// No rank may have an operation on this rank's window in flight, or start one, until
    /// `f` returns: the caller's protocol must guarantee it (for example, every other rank
    /// is waiting on a counter that only this rank advances afterwards). MPI cannot enforce
    /// this, and a concurrent remote write would be a data race.
    pub unsafe fn with_local<R>(&mut self, f: impl FnOnce(&mut [T]) -> R) -> Result<R, RmaError> {
        self.sync()?;
        // SAFETY: the memory is the window's own; the caller guarantees no concurrent
        // remote access, and &mut self excludes local ones.
        let mem = unsafe { std::slice::from_raw_parts_mut(self.win.base.as_ptr(), self.win.len) };
        let r = f(mem);
        self.sync()?;
        Ok(r)
    }

    /// Runs `f` with a read-only view of the first `len` elements of this rank's window
    /// memory, between two `MPI_Win_sync` calls: other ranks may meanwhile read anything
    /// and write past `len`.
    ///
    /// # Safety
    /// No rank may write the first `len` elements (`MPI_Put`, `MPI_Accumulate`) until `f`
    /// returns: the caller's protocol must guarantee it.
    pub unsafe fn with_local_prefix<R>(
        &self,
        len: usize,
        f: impl FnOnce(&[T]) -> R,
    ) -> Result<R, RmaError> {
        assert!(len <= self.win.len, "a prefix of the window");
        self.sync()?;
        // SAFETY: the memory is the window's own and `len` within it; the caller
        // guarantees no remote write to it, and only shared borrows exist locally (this
        // epoch gives out no mutable view while `&self` is borrowed).
        let mem = unsafe { std::slice::from_raw_parts(self.win.base.as_ptr(), len) };
        let r = f(mem);
        self.sync()?;
        Ok(r)
    }

    /// Runs `f`, in which operations are only started (`MPI_Get`, `MPI_Put`,
    /// `MPI_Accumulate`), then completes them (`MPI_Win_flush` of each rank the batch
    /// touched) before returning, also if `f` panics (then `MPI_Win_flush_all`). Buffers
    /// lent to the batch must outlive it.
    ///
    /// Flushing only the touched ranks matters where one-sided operations are emulated
    /// (OpenMPI's `osc pt2pt`): a flush of a rank waits until that rank calls into MPI.
    pub fn batch<'e, F, R>(&'e self, f: F) -> Result<R, RmaError>
    where
        F: for<'s> FnOnce(&'s Batch<'s, 'e, 'w, T>) -> R,
    {
        struct FlushOnExit<'a, 'w, T: RmaType>(&'a Epoch<'w, T>);
        impl<T: RmaType> Drop for FlushOnExit<'_, '_, T> {
            fn drop(&mut self) {
                // Reached only while unwinding (the normal path forgets the guard after
                // flushing): complete operations on buffers about to be freed.
                let _ = self.0.flush_all();
            }
        }
        let batch = Batch {
            epoch: self,
            first: Cell::new(None),
            more: RefCell::new(Vec::new()),
            _scope: PhantomData,
            _env: PhantomData,
        };
        let guard = FlushOnExit(self);
        let r = f(&batch);
        std::mem::forget(guard);
        // Ranks touched: usually one, kept without allocating.
        let mut touched = std::mem::take(&mut *batch.more.borrow_mut());
        touched.extend(batch.first.get());
        touched.sort_unstable();
        touched.dedup();
        for t in touched {
            self.flush(t)?;
        }
        Ok(r)
    }
}

/// The operations a batch or a blocking call starts.
#[derive(Clone, Copy)]
enum Op {
    Get,
    Put,
    AccumulateSum,
}

impl Op {
    fn call(self) -> &'static str {
        match self {
            Op::Get => "MPI_Get",
            Op::Put => "MPI_Put",
            Op::AccumulateSum => "MPI_Accumulate",
        }
    }
}
