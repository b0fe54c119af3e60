//! Whether the MPI library yields the CPU while it waits for a message.
//!
//! Open MPI busy-polls unless told to yield (`mpi_yield_when_idle`), and its launcher tells
//! it only for a host it sees oversubscribed. Hosts that are containers or namespaces of one
//! machine each see their own share, so when together they hold more ranks than the
//! machine has CPUs, every wait spins through its time slice while the rank it waits for
//! cannot run (`benches/results/2026-11-24-hosts.md`). The setting is
//! read at `MPI_Init`; Open MPI's progress engine also takes it afterwards
//! (`opal_progress_set_yield_when_idle`, exported by `libopen-pal`).

use std::ffi::c_void;

/// Looks `name` up among the loaded libraries' symbols.
fn symbol(name: &std::ffi::CStr) -> *mut c_void {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only looks a symbol up.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
}

/// Whether Open MPI's progress engine yields the CPU while it waits (`false` for another
/// library: MPICH busy-polls).
pub fn yields() -> bool {
    let now = symbol(c"opal_progress_yield_when_idle");
    // SAFETY: in Open MPI (opal/runtime/opal_progress.c) this symbol is the engine's
    // `bool opal_progress_yield_when_idle`, written only by its setter (`yield_when_idle`).
    !now.is_null() && unsafe { *now.cast::<bool>() }
}

/// Makes Open MPI's progress engine yield when idle. `Ok(false)` when it already did (the
/// user or the launcher asked for it), an error when the library is not Open MPI.
pub fn yield_when_idle() -> Result<bool, String> {
    let set = symbol(c"opal_progress_set_yield_when_idle");
    if set.is_null() {
        return Err("this MPI library has no Open MPI progress engine to tell".into());
    }
    if yields() {
        return Ok(false);
    }
    // SAFETY: Open MPI declares `bool opal_progress_set_yield_when_idle(bool yieldopt)`
    // (opal/runtime/opal_progress.h); called on the thread that initialised MPI, before
    // any other thread of this process uses it.
    unsafe {
        let f: extern "C" fn(bool) -> bool = std::mem::transmute(set);
        f(true);
    }
    Ok(true)
}
