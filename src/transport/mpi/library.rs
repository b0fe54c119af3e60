//! What this process's MPI library does, read once when a communicator is made: where
//! it keeps a receive's count in `MPI_Status`, its `MPI_IN_PLACE`, its tag bound, and
//! whether a blocking send is better made as a request.

use std::os::raw::{c_int, c_void};

use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::byte;
use crate::transport::tags::{TagError, Tags, STANDARD_TAG_UB, TAG_UB_VAR};

pub(super) fn library_in_place(v: &str) -> Option<*mut c_void> {
    // MPI_IN_PLACE is a macro, absent from the bindings: OpenMPI defines it as (void *) 1
    // and MPICH as (void *) -1. With another library, in-place collectives copy instead.
    if v.contains("Open MPI") {
        Some(std::ptr::without_provenance_mut(1))
    } else if v.contains("MPICH") {
        Some(std::ptr::without_provenance_mut(usize::MAX))
    } else {
        None
    }
}

/// Under Open MPI's `pml ucx`, blocking sends of this many bytes or more to a rank of the
/// same node are an `MPI_Isend` and its `MPI_Wait`, not an `MPI_Send`. `pml ucx`
/// (InfiniBand's default) makes `MPI_Send` a UCX send with fast completion, which UCX
/// keeps on its eager protocol up to `UCX_RNDV_SEND_NBR_THRESH` (256 KiB): a copy into
/// UCX's fragments and another out of them, where `MPI_Isend` turns to rendezvous at
/// `UCX_RNDV_THRESH` (one copy on shared memory): the request is faster on shared memory
/// from 16 KiB, slower between hosts over TCP (rendezvous over TCP), so sends to other
/// nodes keep `MPI_Send`, the library's own choice; under `pml ob1` (whose blocking send
/// keeps a request ready) and under MPICH sends keep `MPI_Send` too
/// (`benches/compare/persistent.c`; `benches/results/2026-11-27-receive.md` has the
/// measurements). A user's own `UCX_RNDV_SEND_NBR_THRESH` is kept too.
pub const SEND_AS_REQUEST_FROM: usize = 4096;

/// The size from which this process's blocking sends to its node are requests:
/// [`SEND_AS_REQUEST_FROM`] under Open MPI's `pml ucx` unless the user set
/// `UCX_RNDV_SEND_NBR_THRESH`, else one more than the largest count MPI takes (a larger
/// send is then an error). One comparison on a send's path decides both.
pub(super) fn sends_as_requests_from(
    open_mpi: bool,
    pml: Option<&str>,
    user_threshold: bool,
) -> usize {
    match (open_mpi, pml, user_threshold) {
        (true, Some("ucx"), false) => SEND_AS_REQUEST_FROM,
        _ => c_int::MAX as usize + 1,
    }
}

/// The low 32 bits of the `MPI_Status` field at byte offset `at`.
#[inline(always)]
pub(super) fn status_u32(status: &ffi::MPI_Status, at: usize) -> u32 {
    // SAFETY: the status is plain data of size_of::<MPI_Status>() bytes, and callers only
    // pass offsets with 4 bytes inside it (checked in count_offset).
    let bytes = unsafe {
        std::slice::from_raw_parts(
            (status as *const ffi::MPI_Status).cast::<u8>(),
            std::mem::size_of::<ffi::MPI_Status>(),
        )
    };
    u32::from_ne_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

/// Where the library keeps a receive's byte count in `MPI_Status`: OpenMPI's `_ucount`
/// (after four ints), MPICH's `count_lo` (first). Trusted only after two messages to
/// ourselves showed it equal to `MPI_Get_count`'s answer. Reading it saves that call on
/// every receive, a measurable share of a small message's latency on shared memory.
/// `None`: receives ask `MPI_Get_count`.
pub(super) fn count_offset(comm: &SimpleCommunicator, version: &str) -> Option<usize> {
    let at = if version.contains("Open MPI") {
        16
    } else if version.contains("MPICH") {
        0
    } else {
        return None;
    };
    if at + 4 > std::mem::size_of::<ffi::MPI_Status>() {
        return None;
    }
    let me = comm.rank();
    for n in [5usize, 1003] {
        let out = vec![0u8; n];
        let mut inb = vec![0u8; n];
        // SAFETY: a zeroed status is a valid out-parameter.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: both buffers hold n bytes; a message to ourselves completes locally.
        let rc = unsafe {
            ffi::MPI_Sendrecv(
                out.as_ptr().cast(),
                n as c_int,
                byte(),
                me,
                0,
                inb.as_mut_ptr().cast(),
                n as c_int,
                byte(),
                me,
                0,
                comm.as_raw(),
                &mut status,
            )
        };
        let mut count: c_int = -1;
        // SAFETY: status was filled by the completed call.
        unsafe { ffi::MPI_Get_count(&status, byte(), &mut count) };
        if rc != ffi::MPI_SUCCESS as c_int
            || count != n as c_int
            || status_u32(&status, at) != n as u32
        {
            return None;
        }
    }
    Some(at)
}

/// The library's `MPI_TAG_UB` (an attribute of `MPI_COMM_WORLD`); the standard's
/// minimum if the library does not say.
pub fn library_tag_ub() -> i32 {
    let mut value: *mut c_int = std::ptr::null_mut();
    let mut flag: c_int = 0;
    // SAFETY: MPI is initialised (an MpiComm or Context exists); for a predefined integer
    // attribute MPI stores a pointer to the int in `value`, valid for the process's life.
    let rc = unsafe {
        ffi::MPI_Comm_get_attr(
            ffi::RSMPI_COMM_WORLD,
            ffi::MPI_TAG_UB as c_int,
            (&mut value as *mut *mut c_int).cast::<c_void>(),
            &mut flag,
        )
    };
    if rc != ffi::MPI_SUCCESS as c_int || flag == 0 || value.is_null() {
        return STANDARD_TAG_UB;
    }
    // SAFETY: flag says the attribute is set, so value points to its int.
    unsafe { *value }
}

/// The tag scheme of this job: the library's bound, lowered by `MPIFLOW_TAG_UB` if set.
pub fn tag_scheme() -> Result<Tags, TagError> {
    Tags::with_override(library_tag_ub(), std::env::var(TAG_UB_VAR).ok().as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocking_sends_are_requests_under_pml_ucx_alone() {
        let from = |open_mpi, pml, user| sends_as_requests_from(open_mpi, pml, user);
        let never = c_int::MAX as usize + 1;
        assert_eq!(from(true, Some("ucx"), false), SEND_AS_REQUEST_FROM);
        assert_eq!(from(true, Some("ob1"), false), never);
        assert_eq!(from(true, None, false), never);
        assert_eq!(from(false, Some("ucx"), false), never);
        assert_eq!(
            from(true, Some("ucx"), true),
            never,
            "the user's threshold stands"
        );
    }
}
