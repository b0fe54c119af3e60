//! The `mpi` path of `latency`, `bw` and `bibw`: OSU 7.4's buffers and calls on them,
//! through `mpi::ffi` as OSU makes them.

use std::os::raw::c_int;

use mpi::ffi;
use mpi::raw::AsRaw;

use super::{turns, TAG};
use crate::tensor::AlignedBuf;
use crate::transport::mpi::MpiComm;
use crate::transport::TransportError;

/// The `mpi` path's buffers: OSU's, as `osu_util_mpi.c` allocates them.
pub(super) struct RawBuffers {
    pub(super) send: Vec<AlignedBuf>,
    pub(super) recv: Vec<AlignedBuf>,
}

impl RawBuffers {
    pub(super) fn new(count: usize, len: usize) -> RawBuffers {
        RawBuffers {
            send: (0..count).map(|_| AlignedBuf::paged(len, b'a')).collect(),
            recv: (0..count).map(|_| AlignedBuf::paged(len, b'b')).collect(),
        }
    }

    /// OSU's `set_buffer_pt2pt` at each size: `a` to send, `b` to receive into.
    pub(super) fn fill(&mut self, size: usize) {
        self.send
            .iter_mut()
            .for_each(|b| b.as_mut_slice()[..size].fill(b'a'));
        self.recv
            .iter_mut()
            .for_each(|b| b.as_mut_slice()[..size].fill(b'b'));
    }
}

/// OSU's calls on raw buffers, through `mpi::ffi` as OSU makes them, each return code
/// checked (mpiflow's communicator returns errors instead of aborting).
pub(super) struct Raw<'c> {
    mpi: &'c MpiComm,
    comm: ffi::MPI_Comm,
    peer: c_int,
    requests: Vec<ffi::MPI_Request>,
    /// OSU's `reqstat`: the statuses its `MPI_Recv` and `MPI_Waitall` write, one per
    /// request of a window (OSU never passes `MPI_STATUS_IGNORE`, and a status written
    /// is work the library does: sends' too).
    statuses: Vec<ffi::MPI_Status>,
}

impl<'c> Raw<'c> {
    pub(super) fn new(comm: &'c MpiComm, peer: usize) -> Raw<'c> {
        Raw {
            mpi: comm,
            comm: comm.raw().as_raw(),
            peer: peer as c_int,
            requests: Vec::new(),
            // SAFETY: a zeroed status is a valid out-parameter (OSU's is a zeroed global).
            statuses: vec![unsafe { std::mem::zeroed() }; 1],
        }
    }

    pub(super) fn send(&self, buf: &[u8], tag: i32) -> Result<(), TransportError> {
        // SAFETY: buf is valid for its length during the blocking call.
        let rc = unsafe {
            ffi::MPI_Send(
                buf.as_ptr().cast(),
                buf.len() as c_int,
                byte(),
                self.peer,
                tag,
                self.comm,
            )
        };
        self.mpi.check("MPI_Send", rc)
    }

    pub(super) fn recv(&mut self, buf: &mut [u8], tag: i32) -> Result<(), TransportError> {
        // SAFETY: buf is valid and exclusively ours during the blocking call; the status,
        // written as OSU's `&reqstat[0]`, is ours.
        let rc = unsafe {
            ffi::MPI_Recv(
                buf.as_mut_ptr().cast(),
                buf.len() as c_int,
                byte(),
                self.peer,
                tag,
                self.comm,
                self.statuses.as_mut_ptr(),
            )
        };
        self.mpi.check("MPI_Recv", rc)
    }

    /// Posts request `j` of a window by `start` (`MPI_Irecv` or `MPI_Isend` into the
    /// handle it is given, in place in the window's array, as OSU's `request[j]`); after a
    /// failure, the requests already posted are waited for (their buffers must outlive
    /// them) before the error is returned. As OSU's loop to the instruction, nearly: at
    /// 16-32 B Open MPI's shared-memory fast box runs in one of two regimes, and a handle
    /// written to the stack and pushed onto a `Vec` per message (a few nanoseconds) put
    /// this path in the slow one, 0.65x of `osu_bw` on an Intel VM
    /// (`benches/results/2026-11-25-osu.md`).
    #[inline(always)]
    fn post(
        &mut self,
        j: usize,
        call: &'static str,
        start: impl FnOnce(&mut ffi::MPI_Request) -> c_int,
    ) -> Result<(), TransportError> {
        let rc = start(&mut self.requests[j]);
        if rc != ffi::MPI_SUCCESS as c_int {
            waitall(&mut self.requests[..j], &mut []);
            return self.mpi.check(call, rc);
        }
        Ok(())
    }

    /// One side of a window: `receives` receives of `size` bytes posted into the receive
    /// buffers in turn (the same one again and again when there is one, as OSU's `-b
    /// single`), then `sends` sends from the send buffers in turn; waits for the sends,
    /// then the receives (`MPI_Waitall`, as OSU).
    pub(super) fn window(
        &mut self,
        bufs: &mut RawBuffers,
        size: usize,
        receives: usize,
        sends: usize,
    ) -> Result<(), TransportError> {
        let (peer, comm) = (self.peer, self.comm);
        // Handles written in place by `post` (a handle from an earlier window is null:
        // `MPI_Waitall` freed it).
        self.requests.resize(receives + sends, null_request());
        let most = receives.max(sends).max(1);
        if self.statuses.len() < most {
            // SAFETY: as in `new`.
            self.statuses.resize(most, unsafe { std::mem::zeroed() });
        }
        for (j, k) in turns(bufs.recv.len(), receives).enumerate() {
            let buf = bufs.recv[k].as_mut_ptr();
            // SAFETY: the buffer (at least `size` bytes) belongs to `bufs`, borrowed
            // mutably until this function returns, and every request is completed by the
            // `waitall` below before it does (after a failed call too, see `post`).
            // Several pending receives may write one buffer: MPI writes raw bytes, and no
            // Rust reference to it exists meanwhile.
            self.post(j, "MPI_Irecv", |req| unsafe {
                ffi::MPI_Irecv(buf.cast(), size as c_int, byte(), peer, TAG, comm, req)
            })?;
        }
        for (j, k) in turns(bufs.send.len(), sends).enumerate() {
            let buf = bufs.send[k].as_ptr();
            // SAFETY: as above; send buffers are only read.
            self.post(receives + j, "MPI_Isend", |req| unsafe {
                ffi::MPI_Isend(buf.cast(), size as c_int, byte(), peer, TAG, comm, req)
            })?;
        }
        let (recvs, sends) = self.requests.split_at_mut(receives);
        let statuses = &mut self.statuses;
        self.mpi.check("MPI_Waitall", waitall(sends, statuses))?;
        self.mpi.check("MPI_Waitall", waitall(recvs, statuses))
    }
}

fn byte() -> ffi::MPI_Datatype {
    // SAFETY: a constant handle.
    unsafe { ffi::RSMPI_UINT8_T }
}

fn null_request() -> ffi::MPI_Request {
    // SAFETY: a zeroed handle is a valid out-parameter, overwritten by MPI.
    unsafe { std::mem::zeroed() }
}

/// `MPI_Waitall`'s return code, its statuses written into `statuses` as OSU's (or
/// ignored when `statuses` is empty, as after a failure).
fn waitall(reqs: &mut [ffi::MPI_Request], statuses: &mut [ffi::MPI_Status]) -> c_int {
    if reqs.is_empty() {
        return ffi::MPI_SUCCESS as c_int;
    }
    let out = if statuses.is_empty() {
        // SAFETY: a constant.
        unsafe { ffi::RSMPI_STATUSES_IGNORE }
    } else {
        assert!(statuses.len() >= reqs.len(), "a status per request");
        statuses.as_mut_ptr()
    };
    // SAFETY: every handle is an active request of this rank; MPI completes and frees
    // them, writing one status per request into `out` (checked long enough above).
    unsafe { ffi::MPI_Waitall(reqs.len() as c_int, reqs.as_mut_ptr(), out) }
}
