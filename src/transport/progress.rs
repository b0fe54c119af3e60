//! Driving MPI's progress engine on a rank that only waits.
//!
//! Some one-sided operations complete only while their target is inside MPI: Open MPI's
//! `osc pt2pt` sends each one as a message the target must receive, and `osc ucx` without
//! device atomics (shared memory, TCP) emulates atomics in software on the target. A ps
//! that polls its own counters with atomics does not serve them: under `osc ucx` an
//! atomic on one's own window progresses only this thread's UCX worker, not the one that
//! remote ranks reach (a remote `MPI_Fetch_and_op` waits for as long as its target polls
//! its own window, and completes once the target tests a pending receive:
//! `benches/results/2026-11-24-ucx.md`).
//!
//! [`Progress`] holds a receive that never matches, on a private duplicate of
//! `MPI_COMM_SELF`; each [`Progress::poke`] tests it, and `MPI_Test` of an incomplete
//! request runs the library's whole progress engine once (Open MPI's `opal_progress`,
//! MPICH's progress loop). Dropping it cancels the receive and frees the communicator.

use std::cell::Cell;
use std::os::raw::c_int;

use mpi::ffi;

use super::mpi::error_string;

/// Errors from [`Progress::new`] and [`Progress::poke`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank}: {call} failed: {message}")]
pub struct ProgressError {
    pub rank: usize,
    pub call: &'static str,
    pub message: String,
}

fn check(rank: usize, call: &'static str, rc: c_int) -> Result<(), ProgressError> {
    match rc == ffi::MPI_SUCCESS as c_int {
        true => Ok(()),
        false => Err(ProgressError {
            rank,
            call,
            message: error_string(rc),
        }),
    }
}

/// A receive that never matches, tested to let MPI progress (see the module's text).
/// Not `Send`: it belongs to the thread that made it.
pub struct Progress {
    comm: ffi::MPI_Comm,
    request: Cell<ffi::MPI_Request>,
    rank: usize,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Progress {
    /// Duplicates `MPI_COMM_SELF` and posts an empty receive on it (MPI must be
    /// initialised); `rank` names this process in errors.
    pub fn new(rank: usize) -> Result<Progress, ProgressError> {
        // SAFETY: a null handle, filled in by MPI_Comm_dup.
        let mut comm: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: MPI_COMM_SELF is valid after MPI_Init; `comm` receives the duplicate.
        check(rank, "MPI_Comm_dup", unsafe {
            ffi::MPI_Comm_dup(ffi::RSMPI_COMM_SELF, &mut comm)
        })?;
        // SAFETY: a communicator just made; errors on it come back as codes.
        unsafe { ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN) };
        // SAFETY: a null handle, filled in by MPI_Irecv.
        let mut request: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: a receive of zero bytes never writes to its buffer (null is allowed
        // with count 0); nothing is ever sent on this private communicator, so it stays
        // pending until Drop cancels it.
        let rc = unsafe {
            ffi::MPI_Irecv(
                std::ptr::null_mut(),
                0,
                ffi::RSMPI_UINT8_T,
                0,
                0,
                comm,
                &mut request,
            )
        };
        if let Err(e) = check(rank, "MPI_Irecv", rc) {
            // SAFETY: the duplicate made above, with no request on it.
            unsafe { ffi::MPI_Comm_free(&mut comm) };
            return Err(e);
        }
        Ok(Progress {
            comm,
            request: Cell::new(request),
            rank,
            _not_send: std::marker::PhantomData,
        })
    }

    /// Runs MPI's progress engine once (`MPI_Test` of the pending receive).
    pub fn poke(&self) -> Result<(), ProgressError> {
        let (mut request, mut flag) = (self.request.get(), 0);
        // SAFETY: a valid pending request owned by self; status is ignored.
        let rc = unsafe { ffi::MPI_Test(&mut request, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        self.request.set(request);
        check(self.rank, "MPI_Test", rc)
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // SAFETY: the pending receive and the duplicate are owned by self; a cancelled
        // receive completes locally (MPI_Wait returns at once), then the communicator
        // has no request left and can be freed.
        unsafe {
            let request = self.request.get_mut();
            if *request != ffi::RSMPI_REQUEST_NULL {
                ffi::MPI_Cancel(request);
                ffi::MPI_Wait(request, ffi::RSMPI_STATUS_IGNORE);
            }
            ffi::MPI_Comm_free(&mut self.comm);
        }
    }
}
