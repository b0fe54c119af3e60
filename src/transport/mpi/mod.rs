//! [`Comm`] over a real MPI communicator.
//!
//! mpiflow's traffic runs on its own duplicate of the communicator (`MPI_Comm_dup`), so it
//! never matches a user's messages, with `MPI_ERRORS_RETURN` set on it, so a truncated
//! message is an error value naming both tensors instead of an abort (also where the
//! library raises it on `MPI_COMM_WORLD`: `mpi/errors.rs`). Every return code is checked.
//! Point-to-point uses `MPI_Isend`/`MPI_Irecv`/`MPI_Wait` on raw bytes (`MPI_UINT8_T`);
//! the native collectives are `MPI_Allreduce`, `MPI_Bcast`, `MPI_Barrier`.

use std::os::raw::{c_int, c_void};

use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

pub(crate) mod errors;
pub(crate) mod idle;
mod library;
mod shared;
mod waits;

use super::comm::{
    check_peer, returned, Backoff, Comm, Completion, ReduceOp, TransportError, ANY_SOURCE,
};
use super::links::Links;
use super::segments::SharedSegments;
use super::tags::Tags;
use crate::tensor::DType;
use library::{count_offset, library_in_place, sends_as_requests_from, status_u32};
pub use library::{library_tag_ub, tag_scheme, SEND_AS_REQUEST_FROM};

/// A communicator for mpiflow's own traffic.
pub struct MpiComm {
    comm: SimpleCommunicator,
    /// `comm`'s handle, read once: rsmpi's `as_raw` tells built-in communicators from
    /// others on every call, a branch and two loads on each message's path.
    handle: ffi::MPI_Comm,
    rank: usize,
    size: usize,
    in_place: Option<*mut c_void>,
    /// See [`count_offset`].
    count_at: Option<usize>,
    /// See [`sends_as_requests_from`].
    sends_as_requests_from: usize,
    /// Whether blocking sends to this rank's node may be requests (see
    /// [`Self::send_large`]).
    requests_on_node: bool,
    /// By rank: on this rank's node (`MPI_COMM_TYPE_SHARED`), for [`Comm::same_node`].
    node: Vec<bool>,
    links: Links,
    tags: Tags,
}

// SAFETY: MPI handles are process-wide values, valid in any thread. Using communicators
// from two threads at once needs MPI_THREAD_MULTIPLE: the only code that moves an MpiComm
// to another thread (allreduce training's communication thread) does so only when
// Context::init_threaded reported that level, and then each thread has its own
// communicator.
unsafe impl Send for MpiComm {}

/// An in-flight MPI request.
pub struct MpiRequest {
    req: ffi::MPI_Request,
    len: usize,
}

/// A send of a window in flight: the bare handle (see [`Comm::WindowSend`]); a window's
/// vector of them is the array `MPI_Waitall` takes.
#[repr(transparent)]
pub struct MpiWindowSend(ffi::MPI_Request);

/// The MPI library's text for an error code (`MPI_Error_string`).
pub(crate) fn error_string(rc: c_int) -> String {
    let mut buf = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: buf holds MPI_MAX_ERROR_STRING (at most 512 in OpenMPI and MPICH) bytes.
    unsafe { ffi::MPI_Error_string(rc, buf.as_mut_ptr().cast(), &mut len) };
    String::from_utf8_lossy(&buf[..len.max(0) as usize]).into_owned()
}

fn dtype_raw(d: DType) -> ffi::MPI_Datatype {
    // SAFETY: the RSMPI_* handles are constants initialised by the MPI library.
    unsafe {
        match d {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::U8 => ffi::RSMPI_UINT8_T,
        }
    }
}

fn null_request() -> ffi::MPI_Request {
    // SAFETY: a constant handle.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

fn byte() -> ffi::MPI_Datatype {
    // SAFETY: a constant handle.
    unsafe { ffi::RSMPI_UINT8_T }
}

impl MpiComm {
    /// A private duplicate of `comm` with errors returned, not fatal (collective).
    pub fn new(comm: &SimpleCommunicator) -> MpiComm {
        let dup = comm.duplicate();
        // SAFETY: dup is a valid communicator owned by us; MPI_ERRORS_RETURN is a constant.
        let rc = unsafe { ffi::MPI_Comm_set_errhandler(dup.as_raw(), ffi::RSMPI_ERRORS_RETURN) };
        assert_eq!(rc, ffi::MPI_SUCCESS as c_int, "MPI_Comm_set_errhandler");
        let version = mpi::environment::library_version().unwrap_or_default();
        let pml = super::stack::selected_pml();
        let mut comm = MpiComm {
            rank: dup.rank() as usize,
            size: dup.size() as usize,
            count_at: count_offset(&dup, &version),
            sends_as_requests_from: sends_as_requests_from(
                version.contains("Open MPI"),
                pml,
                std::env::var_os("UCX_RNDV_SEND_NBR_THRESH").is_some(),
            ),
            in_place: library_in_place(&version),
            handle: dup.as_raw(),
            comm: dup,
            links: Links::default(),
            // Context::init refused a bad MPIFLOW_TAG_UB already; the fallback is the
            // standard's minimum, which every library allows.
            tags: tag_scheme().unwrap_or_default(),
            // Every rank of a job runs the same pml, so all or none use this.
            requests_on_node: version.contains("Open MPI") && pml == Some("ucx"),
            node: Vec::new(),
        };
        // Collective, as the duplicate above.
        comm.node = comm.node_ranks().unwrap_or_default();
        comm
    }

    /// The underlying rsmpi communicator (for the plain-MPI benchmark path).
    pub fn raw(&self) -> &SimpleCommunicator {
        &self.comm
    }

    /// `rc` of MPI call `call` as a result: the communicator returns errors (see the
    /// module documentation), so every caller of raw MPI on it checks them.
    #[inline]
    pub(crate) fn check(&self, call: &'static str, rc: c_int) -> Result<(), TransportError> {
        if rc == ffi::MPI_SUCCESS as c_int {
            return Ok(());
        }
        Err(TransportError::Mpi {
            call,
            rank: self.rank,
            message: error_string(rc),
        })
    }

    #[inline]
    fn count(&self, len: usize) -> Result<c_int, TransportError> {
        c_int::try_from(len).map_err(|_| TransportError::TooLarge {
            rank: self.rank,
            len,
        })
    }

    #[inline]
    fn peer(&self, p: usize) -> Result<c_int, TransportError> {
        check_peer(self, p)?;
        Ok(if p == ANY_SOURCE {
            // SAFETY: a constant.
            unsafe { ffi::RSMPI_ANY_SOURCE }
        } else {
            p as c_int
        })
    }
}

impl MpiComm {
    /// Starts a request of `len` bytes with `peer` by `start` (`MPI_Isend` or `MPI_Irecv`,
    /// given the count and the peer as MPI takes them), its handle written by MPI straight
    /// into `slot`, a window's next element: a small message is posted in tens of
    /// nanoseconds, and a handle written to the stack, returned and copied into the window
    /// put `bench bw` at 16-64 B in Open MPI's slower shared-memory regime
    /// (`benches/results/2026-11-25-osu.md`).
    ///
    /// # Safety
    /// `slot` is valid for writes; `start` is an MPI call whose buffer the caller keeps
    /// valid until the request completes.
    #[inline(always)]
    unsafe fn post(
        &self,
        call: &'static str,
        len: usize,
        peer: usize,
        slot: *mut MpiRequest,
        start: impl FnOnce(c_int, c_int, *mut ffi::MPI_Request) -> c_int,
    ) -> Result<(), TransportError> {
        let (n, peer) = (self.count(len)?, self.peer(peer)?);
        // SAFETY: slot is valid for writes (this function's contract); MPI writes the
        // handle in place.
        let rc = unsafe {
            (&raw mut (*slot).len).write(len);
            start(n, peer, &raw mut (*slot).req)
        };
        self.check(call, rc)
    }

    /// A blocking send of [`Self::sends_as_requests_from`] bytes or more: to a rank of
    /// this node an `MPI_Isend`, then `MPI_Wait` (see [`SEND_AS_REQUEST_FROM`]), to
    /// another node an `MPI_Send`; a count MPI cannot take is the error `MPI_Isend`'s
    /// start gives.
    #[inline(never)]
    fn send_large(&self, buf: &[u8], dst: usize, tag: i32) -> Result<(), TransportError> {
        if buf.len() <= c_int::MAX as usize && !(self.requests_on_node && self.same_node(dst)) {
            return self.plain_send(buf, dst, tag);
        }
        // SAFETY: the request is waited on before `buf`'s borrow ends.
        let r = unsafe { self.isend(buf.as_ptr(), buf.len(), dst, tag)? };
        self.wait_one(r).map(|_| ())
    }

    /// `MPI_Send` of `buf`, whose length MPI takes (at most `c_int::MAX`).
    #[inline(always)]
    fn plain_send(&self, buf: &[u8], dst: usize, tag: i32) -> Result<(), TransportError> {
        let (n, dst) = (buf.len() as c_int, self.peer(dst)?);
        // SAFETY: buf is valid for n bytes for the duration of the blocking call.
        let rc = unsafe { ffi::MPI_Send(buf.as_ptr().cast(), n, byte(), dst, tag, self.handle) };
        self.check("MPI_Send", rc)
    }
}

impl Comm for MpiComm {
    type Request = MpiRequest;

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn tags(&self) -> Tags {
        self.tags
    }

    fn links(&self) -> &Links {
        &self.links
    }

    #[inline]
    unsafe fn isend(
        &self,
        buf: *const u8,
        len: usize,
        dst: usize,
        tag: i32,
    ) -> Result<MpiRequest, TransportError> {
        // SAFETY: the caller's contract, passed on; `post` writes the slot it is given
        // exactly when it returns Ok.
        unsafe {
            returned(|slot| {
                self.post("MPI_Isend", len, dst, slot, |n, dst, req| {
                    ffi::MPI_Isend(buf.cast(), n, byte(), dst, tag, self.handle, req)
                })
            })
        }
        .map(|(r, ())| r)
    }

    type WindowSend = MpiWindowSend;

    #[inline(always)]
    unsafe fn isend_window_into(
        &self,
        buf: *const u8,
        len: usize,
        dst: usize,
        tag: i32,
        slot: *mut MpiWindowSend,
    ) -> Result<(), TransportError> {
        let (n, dst) = (self.count(len)?, self.peer(dst)?);
        // SAFETY: the caller keeps buf..buf+len valid until the send completes; MPI writes
        // the handle into slot, valid for writes.
        let rc = unsafe {
            ffi::MPI_Isend(
                buf.cast(),
                n,
                byte(),
                dst,
                tag,
                self.handle,
                &raw mut (*slot).0,
            )
        };
        self.check("MPI_Isend", rc)
    }

    fn wait_window_sends(&self, sends: &mut Vec<MpiWindowSend>) -> Result<(), TransportError> {
        // SAFETY: MpiWindowSend is a transparent MPI_Request, so the vector's elements are
        // the array of handles MPI_Waitall takes.
        let handles =
            unsafe { std::slice::from_raw_parts_mut(sends.as_mut_ptr().cast(), sends.len()) };
        let mut done = Ok(());
        for chunk in handles.chunks_mut(c_int::MAX as usize) {
            done = done.and(self.wait_handles(chunk));
        }
        sends.clear();
        done
    }

    #[inline]
    unsafe fn irecv(
        &self,
        buf: *mut u8,
        len: usize,
        src: usize,
        tag: i32,
    ) -> Result<MpiRequest, TransportError> {
        // SAFETY: the caller's contract, passed on; `irecv_into` writes the slot it is
        // given exactly when it returns Ok.
        unsafe { returned(|slot| self.irecv_into(buf, len, src, tag, slot)) }.map(|(r, ())| r)
    }

    #[inline(always)]
    unsafe fn irecv_into(
        &self,
        buf: *mut u8,
        len: usize,
        src: usize,
        tag: i32,
        slot: *mut MpiRequest,
    ) -> Result<(), TransportError> {
        // SAFETY: the caller keeps buf..buf+len valid and unaliased until the request
        // completes, and slot is valid for writes.
        unsafe {
            self.post("MPI_Irecv", len, src, slot, |n, src, req| {
                ffi::MPI_Irecv(buf.cast(), n, byte(), src, tag, self.handle, req)
            })
        }
    }

    #[inline]
    fn wait(&self, r: MpiRequest) -> Result<Completion, TransportError> {
        self.wait_one(r)
    }

    fn wait_all(&self, reqs: &mut Vec<MpiRequest>) -> Result<(), TransportError> {
        self.wait_every(reqs, None::<fn(Completion)>)
    }

    #[inline]
    fn wait_all_each(
        &self,
        reqs: &mut Vec<MpiRequest>,
        each: impl FnMut(Completion),
    ) -> Result<(), TransportError> {
        self.wait_every(reqs, Some(each))
    }

    fn test(&self, r: &mut MpiRequest) -> Result<Option<Completion>, TransportError> {
        self.test_one(r)
    }

    fn cancel_receive(&self, r: MpiRequest) -> Result<Option<Completion>, TransportError> {
        self.cancel_one(r)
    }

    #[inline]
    fn same_node(&self, peer: usize) -> bool {
        self.node.get(peer).is_some_and(|&b| b)
    }

    fn progress(&self) {
        let mut flag: c_int = 0;
        // SAFETY: a zeroed status is a valid out-parameter; probing matches no message.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: the communicator is valid while self lives; flag and status are ours.
        unsafe {
            ffi::MPI_Iprobe(
                ffi::RSMPI_ANY_SOURCE,
                ffi::RSMPI_ANY_TAG,
                self.handle,
                &mut flag,
                &mut status,
            )
        };
    }

    #[inline]
    fn send_blocking(&self, buf: &[u8], dst: usize, tag: i32) -> Result<(), TransportError> {
        if buf.len() >= self.sends_as_requests_from {
            return self.send_large(buf, dst, tag);
        }
        // `sends_as_requests_from` is at most one more than `c_int::MAX`.
        self.plain_send(buf, dst, tag)
    }

    #[inline(always)]
    fn recv_blocking(
        &self,
        buf: &mut [u8],
        src: usize,
        tag: i32,
    ) -> Result<Completion, TransportError> {
        let (n, src) = (self.count(buf.len())?, self.peer(src)?);
        // SAFETY: a zeroed status is a valid out-parameter.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: buf is valid and exclusively ours for n bytes during the blocking call.
        let rc = unsafe {
            ffi::MPI_Recv(
                buf.as_mut_ptr().cast(),
                n,
                byte(),
                src,
                tag,
                self.handle,
                &mut status,
            )
        };
        self.completion("MPI_Recv", rc, &status, buf.len())
    }

    fn try_receive_into(
        &self,
        src: usize,
        tag: i32,
        complete_within: std::time::Duration,
        buf: &mut Vec<u8>,
    ) -> Result<Option<usize>, TransportError> {
        let src = self.peer(src)?;
        let mut flag: c_int = 0;
        // SAFETY: zeroed message and status handles are valid out-parameters.
        let (mut msg, mut status): (ffi::MPI_Message, ffi::MPI_Status) =
            unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        // SAFETY: valid communicator and out-parameters.
        let rc =
            unsafe { ffi::MPI_Improbe(src, tag, self.handle, &mut flag, &mut msg, &mut status) };
        self.check("MPI_Improbe", rc)?;
        if flag == 0 {
            return Ok(None);
        }
        let source = status.MPI_SOURCE.max(0) as usize;
        let mut count: c_int = 0;
        // SAFETY: status was filled by MPI_Improbe.
        unsafe { ffi::MPI_Get_count(&status, byte(), &mut count) };
        // Not zeroed: MPI writes every byte before anything reads them (large messages
        // would otherwise be written twice).
        let len = count.max(0) as usize;
        buf.clear();
        buf.reserve(len);
        // SAFETY: a zeroed request is a valid out-parameter.
        let mut req = MpiRequest {
            req: unsafe { std::mem::zeroed() },
            len,
        };
        // SAFETY: buf has room for the matched message's length; msg is the matched handle;
        // buf is not touched until the request completes (or is leaked below if it never
        // does).
        let rc = unsafe {
            ffi::MPI_Imrecv(
                buf.as_mut_ptr().cast(),
                count,
                byte(),
                &mut msg,
                &mut req.req,
            )
        };
        self.check("MPI_Imrecv", rc)?;
        // A message that arrived whole (most do) completes at the first test: the clock
        // is read only for one that is still arriving.
        let mut start = None;
        let mut backoff = Backoff::polling_mpi(std::time::Duration::from_micros(50));
        loop {
            if self.test(&mut req)?.is_some() {
                // SAFETY: the completed receive wrote all `len` bytes of the allocation.
                unsafe { buf.set_len(len) };
                return Ok(Some(source));
            }
            if start.get_or_insert_with(std::time::Instant::now).elapsed() > complete_within {
                // MPI may still write into buf: keep it alive for the rest of the process.
                std::mem::forget(std::mem::take(buf));
                return Err(TransportError::Timeout {
                    rank: self.rank,
                    peer: source,
                    tag,
                    secs: complete_within.as_secs(),
                });
            }
            backoff.idle();
        }
    }

    fn has_native(&self) -> bool {
        true
    }

    fn shared_segments(&self, len: usize) -> Result<Option<SharedSegments>, TransportError> {
        self.node_segments(len)
    }

    type Window<T: crate::transport::rma::RmaType> = crate::transport::rma::Window<T>;

    fn window<T: crate::transport::rma::RmaType>(
        &self,
        len: usize,
    ) -> Result<Self::Window<T>, crate::transport::rma::AllocateError> {
        crate::transport::rma::Window::allocate(self, len)
    }

    fn native_allreduce(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Option<Result<(), TransportError>> {
        // 8-bit reductions are wrong in both libraries mpiflow supports: OpenMPI 4.1's AVX
        // code saturates sums instead of wrapping (open-mpi/ompi#8045, closed as won't
        // fix), and MPICH 4.0.2 takes MPI_UINT8_T as signed in MPI_MIN and MPI_MAX
        // (min(249, 0, 254) = 249, found by `mpiflow check`). mpiflow's own algorithms
        // are right for every op.
        if dtype == DType::U8 {
            return None;
        }
        let n = match self.count(buf.len() / dtype.size()) {
            Ok(n) => n,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: constant handles.
        let mpi_op = unsafe {
            match op {
                ReduceOp::Sum | ReduceOp::Average => ffi::RSMPI_SUM,
                ReduceOp::Min => ffi::RSMPI_MIN,
                ReduceOp::Max => ffi::RSMPI_MAX,
            }
        };
        let rc = match self.in_place {
            // SAFETY: buf is valid for n elements of dtype; MPI_IN_PLACE as the library defines it.
            Some(ip) => unsafe {
                ffi::MPI_Allreduce(
                    ip,
                    buf.as_mut_ptr().cast(),
                    n,
                    dtype_raw(dtype),
                    mpi_op,
                    self.handle,
                )
            },
            None => {
                let send = buf.to_vec();
                // SAFETY: send and buf are distinct buffers of n elements.
                unsafe {
                    ffi::MPI_Allreduce(
                        send.as_ptr().cast(),
                        buf.as_mut_ptr().cast(),
                        n,
                        dtype_raw(dtype),
                        mpi_op,
                        self.handle,
                    )
                }
            }
        };
        Some(self.check("MPI_Allreduce", rc))
    }

    fn native_bcast(&self, buf: &mut [u8], root: usize) -> Option<Result<(), TransportError>> {
        let r = self.count(buf.len()).and_then(|n| {
            self.peer(root)?;
            // SAFETY: buf is valid for n bytes on every rank (same length is the caller's contract).
            let rc = unsafe {
                ffi::MPI_Bcast(
                    buf.as_mut_ptr().cast(),
                    n,
                    byte(),
                    root as c_int,
                    self.handle,
                )
            };
            self.check("MPI_Bcast", rc)
        });
        Some(r)
    }

    fn native_barrier(&self) -> Option<Result<(), TransportError>> {
        // SAFETY: a valid communicator.
        let rc = unsafe { ffi::MPI_Barrier(self.handle) };
        Some(self.check("MPI_Barrier", rc))
    }

    fn split_node(&self) -> Result<MpiComm, TransportError> {
        Ok(MpiComm::new(&self.comm.split_shared(self.rank as c_int)))
    }

    fn split(&self, color: u32, key: usize) -> Result<MpiComm, TransportError> {
        let sub = self
            .comm
            .split_by_color_with_key(
                mpi::topology::Color::with_value(color as c_int),
                key as c_int,
            )
            .expect("a color was given, so every rank gets a communicator");
        Ok(MpiComm::new(&sub))
    }
}
