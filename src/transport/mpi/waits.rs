//! Completing requests: one (`MPI_Wait`, `MPI_Test`) or a window at once (`MPI_Waitall`,
//! with or without the receives' statuses), and reading what a status says.

use std::mem::MaybeUninit;
use std::os::raw::c_int;

use mpi::ffi;

use super::{byte, null_request, status_u32, MpiComm, MpiRequest};
use crate::transport::comm::{Completion, TransportError};

/// Handles per `MPI_Waitall`, copied to the stack (requests carry their length too).
const CHUNK: usize = 64;

impl MpiComm {
    /// Reads a finished receive's status: a truncation is reported, not an error.
    /// Inlined into every receive, the error path out of line (see [`Completion`] for the
    /// result's layout).
    #[inline(always)]
    pub(super) fn completion(
        &self,
        call: &'static str,
        rc: c_int,
        status: &ffi::MPI_Status,
        len: usize,
    ) -> Result<Completion, TransportError> {
        if rc == ffi::MPI_SUCCESS as c_int {
            return Ok(self.arrived(status, len, false));
        }
        self.truncation(call, rc)
            .map(|()| self.arrived(status, len, true))
    }

    /// A return code other than `MPI_SUCCESS`: a truncation (`Ok`), or an error.
    #[cold]
    #[inline(never)]
    fn truncation(&self, call: &'static str, rc: c_int) -> Result<(), TransportError> {
        let mut class: c_int = rc;
        // SAFETY: rc is an error code returned by MPI.
        unsafe { ffi::MPI_Error_class(rc, &mut class) };
        if class == ffi::MPI_ERR_TRUNCATE as c_int {
            return Ok(());
        }
        self.check(call, rc)
    }

    /// What a status says arrived in a receive of `len` bytes.
    #[inline(always)]
    fn arrived(&self, status: &ffi::MPI_Status, len: usize, truncated: bool) -> Completion {
        let count = match self.count_at {
            Some(at) => status_u32(status, at) as i64,
            None => {
                let mut count: c_int = 0;
                // SAFETY: status was filled by the completed call.
                unsafe { ffi::MPI_Get_count(status, byte(), &mut count) };
                i64::from(count)
            }
        };
        // After a truncation some libraries report the full length, others the buffer's.
        let count = if count < 0 {
            len
        } else {
            (count as usize).min(len)
        };
        Completion::new(count, truncated, status.MPI_SOURCE.max(0) as usize)
    }

    #[inline]
    pub(super) fn wait_one(&self, mut r: MpiRequest) -> Result<Completion, TransportError> {
        // SAFETY: a zeroed status is a valid out-parameter.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: r.req is an active request from isend/irecv; waiting completes it.
        let rc = unsafe { ffi::MPI_Wait(&mut r.req, &mut status) };
        self.completion("MPI_Wait", rc, &status, r.len)
    }

    pub(super) fn test_one(
        &self,
        r: &mut MpiRequest,
    ) -> Result<Option<Completion>, TransportError> {
        let mut flag: c_int = 0;
        // SAFETY: a zeroed status is a valid out-parameter.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: r.req is an active (or already completed, then null) request of ours.
        let rc = unsafe { ffi::MPI_Test(&mut r.req, &mut flag, &mut status) };
        if flag == 0 && rc == ffi::MPI_SUCCESS as c_int {
            return Ok(None);
        }
        self.completion("MPI_Test", rc, &status, r.len).map(Some)
    }

    /// [`Comm::cancel_receive`]: `MPI_Cancel`, `MPI_Wait`, then `MPI_Test_cancelled` says
    /// whether the receive was withdrawn or had matched a message.
    ///
    /// [`Comm::cancel_receive`]: crate::transport::Comm::cancel_receive
    pub(super) fn cancel_one(
        &self,
        mut r: MpiRequest,
    ) -> Result<Option<Completion>, TransportError> {
        // SAFETY: r.req is an active receive of ours; cancelling only marks it.
        let rc = unsafe { ffi::MPI_Cancel(&mut r.req) };
        if let Err(e) = self.check("MPI_Cancel", rc) {
            // Still complete it: its buffer must not stay in MPI's hands.
            let _ = self.wait_one(r);
            return Err(e);
        }
        // SAFETY: a zeroed status is a valid out-parameter.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: a cancelled request still completes; waiting frees it.
        let rc = unsafe { ffi::MPI_Wait(&mut r.req, &mut status) };
        let done = self.completion("MPI_Wait", rc, &status, r.len)?;
        let mut cancelled: c_int = 0;
        // SAFETY: status was written by the wait above.
        let rc = unsafe { ffi::MPI_Test_cancelled(&status, &mut cancelled) };
        self.check("MPI_Test_cancelled", rc)?;
        Ok((cancelled == 0).then_some(done))
    }

    /// Completes every request of `reqs` and empties it: one `MPI_Waitall` per [`CHUNK`]
    /// requests. With `each`, each request's [`Completion`] is handed to it in order (a
    /// truncated receive is a completion that says so, as from `MPI_Wait`) until one
    /// fails; without it MPI writes no statuses (what sends need). On an error every
    /// request is still completed before this returns (no buffer is left in MPI's hands).
    pub(super) fn wait_every(
        &self,
        reqs: &mut Vec<MpiRequest>,
        mut each: Option<impl FnMut(Completion)>,
    ) -> Result<(), TransportError> {
        let mut result = Ok(());
        for chunk in reqs.chunks(CHUNK) {
            let mut handles = [null_request(); CHUNK];
            for (h, r) in handles.iter_mut().zip(chunk) {
                *h = r.req;
            }
            let handles = &mut handles[..chunk.len()];
            let Some(each) = each.as_mut() else {
                result = result.and(self.wait_handles(handles));
                continue;
            };
            // Not zeroed (a window's worth of memset per call): MPI_Waitall writes one
            // status per handle, and only those are read.
            let mut statuses = [const { MaybeUninit::<ffi::MPI_Status>::uninit() }; CHUNK];
            // SAFETY: each handle is an active request of this rank (or already null);
            // MPI_Waitall completes and frees them, writing null handles back and one
            // status per handle into `statuses[..handles.len()]`.
            let rc = unsafe {
                ffi::MPI_Waitall(
                    handles.len() as c_int,
                    handles.as_mut_ptr(),
                    statuses.as_mut_ptr().cast(),
                )
            };
            if rc != ffi::MPI_SUCCESS as c_int && rc != ffi::MPI_ERR_IN_STATUS as c_int {
                self.wait_each(handles);
                result = result.and(self.check("MPI_Waitall", rc));
                continue;
            }
            // SAFETY: MPI_Waitall returned MPI_SUCCESS or MPI_ERR_IN_STATUS, having written
            // the first handles.len() statuses.
            let statuses = unsafe {
                std::slice::from_raw_parts_mut(
                    statuses.as_mut_ptr().cast::<ffi::MPI_Status>(),
                    handles.len(),
                )
            };
            // Each status holds its request's outcome where some failed; MPI_ERR_PENDING
            // marks one not yet complete (another failed first), waited for on its own.
            for ((h, status), r) in handles.iter_mut().zip(statuses.iter_mut()).zip(chunk) {
                let mut code = rc;
                if rc != ffi::MPI_SUCCESS as c_int {
                    code = status.MPI_ERROR;
                    if code == ffi::MPI_ERR_PENDING as c_int {
                        // SAFETY: h is the pending request; waiting completes it.
                        code = unsafe { ffi::MPI_Wait(h, status) };
                    }
                }
                match self.completion("MPI_Waitall", code, status, r.len) {
                    Ok(c) if result.is_ok() => each(c),
                    Ok(_) => {}
                    Err(e) => result = result.and(Err(e)),
                }
            }
        }
        reqs.clear();
        result
    }

    /// `MPI_Waitall` on `handles` without statuses; on an error every handle is still
    /// completed before this returns.
    pub(super) fn wait_handles(
        &self,
        handles: &mut [ffi::MPI_Request],
    ) -> Result<(), TransportError> {
        // SAFETY: each handle is an active request of this rank (or already null);
        // MPI_Waitall completes and frees them, writing null handles back.
        let rc = unsafe {
            ffi::MPI_Waitall(
                handles.len() as c_int,
                handles.as_mut_ptr(),
                ffi::RSMPI_STATUSES_IGNORE,
            )
        };
        if rc != ffi::MPI_SUCCESS as c_int {
            self.wait_each(handles);
        }
        self.check("MPI_Waitall", rc)
    }

    /// Waits one by one for the requests a failed `MPI_Waitall` left pending
    /// (`MPI_ERR_PENDING`): their buffers must not be released while MPI may use them.
    fn wait_each(&self, handles: &mut [ffi::MPI_Request]) {
        for h in handles {
            // SAFETY: an active request of this rank or a null handle (returns at once).
            unsafe { ffi::MPI_Wait(h, ffi::RSMPI_STATUS_IGNORE) };
        }
    }
}
