//! Memory shared by the ranks of one node (`MPI_Win_allocate_shared`), for the
//! shared-memory collectives.

use std::os::raw::{c_int, c_void};

use mpi::ffi;

use super::MpiComm;
use crate::transport::comm::TransportError;
use crate::transport::segments::SharedSegments;

impl MpiComm {
    /// This node's ranks of the communicator, in its order
    /// (`MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`; collective). The caller frees it.
    fn node_comm(&self) -> Result<ffi::MPI_Comm, TransportError> {
        // SAFETY: a null handle, filled in by MPI_Comm_split_type.
        let mut node: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: a valid communicator; keyed by our rank, so node ranks keep our order.
        let rc = unsafe {
            ffi::MPI_Comm_split_type(
                self.handle,
                ffi::RSMPI_COMM_TYPE_SHARED,
                self.rank as c_int,
                ffi::RSMPI_INFO_NULL,
                &mut node,
            )
        };
        self.check("MPI_Comm_split_type", rc)?;
        Ok(node)
    }

    /// By rank of this communicator: whether it runs on this rank's node (collective).
    pub(super) fn node_ranks(&self) -> Result<Vec<bool>, TransportError> {
        let mut node = self.node_comm()?;
        let mut n: c_int = 0;
        // SAFETY: node is the valid communicator just created.
        unsafe { ffi::MPI_Comm_size(node, &mut n) };
        let ours: Vec<c_int> = (0..n).collect();
        let mut theirs = vec![0 as c_int; ours.len()];
        // SAFETY: null handles, filled in by MPI_Comm_group.
        let (mut node_group, mut group) = unsafe { (ffi::RSMPI_GROUP_NULL, ffi::RSMPI_GROUP_NULL) };
        // SAFETY: valid communicators; the rank arrays hold n ints each; every handle made
        // here is freed before returning.
        let rc = unsafe {
            ffi::MPI_Comm_group(node, &mut node_group);
            ffi::MPI_Comm_group(self.handle, &mut group);
            let rc = ffi::MPI_Group_translate_ranks(
                node_group,
                n,
                ours.as_ptr(),
                group,
                theirs.as_mut_ptr(),
            );
            ffi::MPI_Group_free(&mut node_group);
            ffi::MPI_Group_free(&mut group);
            ffi::MPI_Comm_free(&mut node);
            rc
        };
        self.check("MPI_Group_translate_ranks", rc)?;
        let mut on = vec![false; self.size];
        for r in theirs {
            if let Some(b) = usize::try_from(r).ok().and_then(|r| on.get_mut(r)) {
                *b = true;
            }
        }
        Ok(on)
    }

    /// [`Comm::shared_segments`]: one segment per rank of this node's ranks, when they are
    /// all of the communicator (`MPI_Win_allocate_shared`).
    pub(super) fn node_segments(
        &self,
        len: usize,
    ) -> Result<Option<SharedSegments>, TransportError> {
        let mut node = self.node_comm()?;
        let mut node_size: c_int = 0;
        // SAFETY: node is the valid communicator just created.
        unsafe { ffi::MPI_Comm_size(node, &mut node_size) };
        if node_size as usize != self.size {
            // Ranks on several nodes: every rank sees a node smaller than the communicator.
            // SAFETY: node is ours and not used again.
            unsafe { ffi::MPI_Comm_free(&mut node) };
            return Ok(None);
        }
        // OpenMPI's segments start 8-byte aligned: room to align them to cache lines.
        let room = len + 64;
        let mut base: *mut u8 = std::ptr::null_mut();
        // SAFETY: a null handle, filled in by MPI_Win_allocate_shared.
        let mut win: ffi::MPI_Win = unsafe { ffi::RSMPI_WIN_NULL };
        // SAFETY: node is valid; MPI returns `room` bytes at `base`, owned by the window.
        let rc = unsafe {
            ffi::MPI_Win_allocate_shared(
                room as ffi::MPI_Aint,
                1,
                ffi::RSMPI_INFO_NULL,
                node,
                (&mut base as *mut *mut u8).cast::<c_void>(),
                &mut win,
            )
        };
        // Not every one-sided component makes shared windows (`--mca osc ucx` alone
        // refuses with MPI_ERR_INTERN): then the node has no shared segments and the
        // allreduce takes another algorithm. The ranks of the node decide together.
        let mut ok: c_int = c_int::from(rc == ffi::MPI_SUCCESS as c_int);
        // SAFETY: node is valid; MPI_IN_PLACE is not used (separate send and receive ints).
        let send = ok;
        let agreed = unsafe {
            ffi::MPI_Allreduce(
                (&send as *const c_int).cast(),
                (&mut ok as *mut c_int).cast(),
                1,
                ffi::RSMPI_INT32_T,
                ffi::RSMPI_MIN,
                node,
            )
        };
        self.check("MPI_Allreduce", agreed)?;
        if ok == 0 {
            // A window that did open on some rank stays until MPI_Finalize: freeing it is
            // collective over ranks that have none.
            return Ok(None);
        }
        // SAFETY: base holds `room` bytes of ours; nobody reads them before the barrier below.
        unsafe { std::ptr::write_bytes(base, 0, room) };
        let mut ptrs = Vec::with_capacity(self.size);
        for r in 0..self.size {
            let (mut size, mut unit, mut ptr): (ffi::MPI_Aint, c_int, *mut u8) =
                (0, 0, std::ptr::null_mut());
            // SAFETY: win is a valid shared window; out-parameters are valid.
            let rc = unsafe {
                ffi::MPI_Win_shared_query(
                    win,
                    r as c_int,
                    &mut size,
                    &mut unit,
                    (&mut ptr as *mut *mut u8).cast::<c_void>(),
                )
            };
            self.check("MPI_Win_shared_query", rc)?;
            let skip = ptr.align_offset(64);
            if ptr.is_null() || (size as usize) < skip + len {
                return Err(TransportError::Mpi {
                    call: "MPI_Win_shared_query",
                    rank: self.rank,
                    message: format!("segment of rank {r}: {size} bytes at {ptr:p}, need {len} bytes from a 64-byte boundary"),
                });
            }
            // SAFETY: skip + len <= size: still inside rank r's segment.
            ptrs.push(unsafe { ptr.add(skip) });
        }
        // Every segment is zeroed before anyone uses it.
        // SAFETY: node is valid.
        let rc = unsafe { ffi::MPI_Barrier(node) };
        self.check("MPI_Barrier", rc)?;
        // The window (and `node`) live until MPI_Finalize: freeing is collective, and no destructor
        // may block on other ranks (an error on one rank would hang it).
        // SAFETY: every pointer maps `len` zeroed, 64-byte aligned bytes of rank r's segment.
        Ok(Some(unsafe {
            SharedSegments::new(ptrs, len, Box::new(()))
        }))
    }
}
