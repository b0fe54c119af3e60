//! What becomes of the errors MPI raises on `MPI_COMM_WORLD`.
//!
//! mpiflow's traffic runs on duplicates with `MPI_ERRORS_RETURN` ([`super::MpiComm`]), so
//! that a truncated receive is an error value naming both tensors. MPICH 4.0 (Debian 12's)
//! raises the errors of request completions (`MPI_Wait`, `MPI_Waitall`) on
//! `MPI_COMM_WORLD` instead of the request's communicator, and the world's handler is
//! fatal: a truncated non-blocking receive ended the job with MPICH's error stack instead
//! of mpiflow's one line. [`return_receive_errors`] gives the world communicator a handler
//! that lets those errors reach the call, which checks every code, and ends the job on
//! any other error, as `MPI_ERRORS_ARE_FATAL` does. (Open MPI raises them on the request's
//! communicator: there the handler only ever sees the world's own errors.)

use std::os::raw::c_int;

use mpi::ffi;

/// The classes the handler lets a call return: a truncated receive, and a completion of
/// several requests whose statuses hold the errors (`MPI_ERR_IN_STATUS`).
fn returned(class: c_int) -> bool {
    class == ffi::MPI_ERR_TRUNCATE as c_int || class == ffi::MPI_ERR_IN_STATUS as c_int
}

/// The handler: returns for [`returned`] classes (MPI then returns the code from the
/// call); otherwise says the error in one line and aborts the job.
///
/// The C type of a handler is variadic, `void (MPI_Comm *, int *, ...)`, which Rust cannot
/// define; this one takes the two fixed arguments alone, which every supported C ABI passes
/// to a variadic callee exactly as to a non-variadic one, and MPI passes nothing else.
unsafe extern "C" fn on_world_error(comm: *mut ffi::MPI_Comm, code: *mut c_int) {
    // SAFETY: MPI calls the handler with valid pointers to the communicator and the code.
    let (comm, code) = unsafe { (*comm, *code) };
    let mut class = 0;
    // SAFETY: code is an error code MPI raised; class is a valid out-pointer.
    unsafe { ffi::MPI_Error_class(code, &mut class) };
    if returned(class) {
        return;
    }
    let mut rank = -1;
    // SAFETY: comm is the communicator the error was raised on; rank is a valid out-pointer.
    unsafe { ffi::MPI_Comm_rank(comm, &mut rank) };
    eprintln!("rank {rank}: MPI error: {}", super::error_string(code));
    // SAFETY: as MPI_ERRORS_ARE_FATAL would; MPI_Abort does not return.
    unsafe { ffi::MPI_Abort(comm, code) };
}

/// Installs the handler on `world` (`MPI_COMM_WORLD`); returns MPI's code on failure.
pub(crate) fn return_receive_errors(world: ffi::MPI_Comm) -> Result<(), c_int> {
    type Fixed = unsafe extern "C" fn(*mut ffi::MPI_Comm, *mut c_int);
    type Variadic = unsafe extern "C" fn(*mut ffi::MPI_Comm, *mut c_int, ...);
    // SAFETY: the same function pointer under the variadic type MPI calls it through; see
    // on_world_error for why that call is sound.
    let handler = unsafe { std::mem::transmute::<Fixed, Variadic>(on_world_error) };
    let mut eh = std::mem::MaybeUninit::<ffi::MPI_Errhandler>::uninit();
    // SAFETY: handler has the signature MPI expects; eh is a valid out-pointer.
    let rc = unsafe { ffi::MPI_Comm_create_errhandler(Some(handler), eh.as_mut_ptr()) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return Err(rc);
    }
    // SAFETY: MPI_Comm_create_errhandler succeeded and wrote the handle.
    let mut eh = unsafe { eh.assume_init() };
    // SAFETY: world is a valid communicator and eh a valid handler; freeing the handle
    // after setting it leaves the communicator's own reference (MPI-4 8.3.4).
    let rc = unsafe { ffi::MPI_Comm_set_errhandler(world, eh) };
    // SAFETY: eh is the handle created above, not used again.
    unsafe { ffi::MPI_Errhandler_free(&mut eh) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return Err(rc);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_receive_errors_are_returned() {
        assert!(returned(ffi::MPI_ERR_TRUNCATE as c_int));
        assert!(returned(ffi::MPI_ERR_IN_STATUS as c_int));
        for other in [ffi::MPI_ERR_OTHER, ffi::MPI_ERR_COMM, ffi::MPI_ERR_BUFFER] {
            assert!(!returned(other as c_int));
        }
    }
}
