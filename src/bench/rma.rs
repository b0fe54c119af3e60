//! One-sided benchmarks in the style of OMB's `osu_put_latency`, `osu_get_latency`,
//! `osu_acc_latency` and `osu_get_bw`: `put_latency`, `get_latency`, `acc_latency`,
//! `get_bw`.
//!
//! Rank 0 is the origin and rank 1 the target, which only waits in a barrier (as in OMB:
//! where one-sided operations are emulated, that barrier is what serves them). Windows
//! come from `MPI_Win_allocate`, and they and the origin's buffers hold data (OSU's 'a'
//! bytes; mpiflow's windows start zeroed) before anything is timed; one passive-target
//! epoch spans the timed loop; latency is one operation plus `MPI_Win_flush`, per
//! iteration; bandwidth is a window of `-W` gets, the j-th from offset j x size of a
//! target window of `-W` x size bytes into its own part of the local buffer (a window
//! reads `-W` x size distinct bytes), then one flush; the clock is read around every timed
//! iteration, as OSU does.
//! Paths:
//! - `mpi`: the raw `mpi::ffi` calls as OSU makes them (a shared `MPI_Win_lock` on the
//!   target, not `MPI_Win_lock_all`), checked only after the timed loop;
//! - `mpiflow`: [`crate::transport::rma`], with its bounds checks, checked return codes
//!   and scoped batches.

use std::os::raw::{c_int, c_void};
use std::time::Instant;

use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::traits::*;

use super::osu::{self, BenchOptions, Path};
use super::{best_of_rounds, secs, BenchError, Better, Row};
use crate::transport::mpi::MpiComm;
use crate::transport::rma::{RmaError, RmaType, Window};
use crate::transport::{Collectives, Comm};

/// The one-sided benchmarks.
pub const NAMES: [&str; 4] = ["put_latency", "get_latency", "acc_latency", "get_bw"];

impl From<RmaError> for BenchError {
    fn from(e: RmaError) -> BenchError {
        BenchError::Rma(e.to_string())
    }
}

fn alloc_error(e: impl std::fmt::Display) -> BenchError {
    BenchError::Rma(e.to_string())
}

/// The raw path: a window from `MPI_Win_allocate`, used through `mpi::ffi` only.
struct RawWindow {
    win: ffi::MPI_Win,
}

impl RawWindow {
    fn allocate(comm: &MpiComm, bytes: usize) -> Result<RawWindow, BenchError> {
        let mut base: *mut c_void = std::ptr::null_mut();
        // SAFETY: a null handle, filled in below.
        let mut win = unsafe { ffi::RSMPI_WIN_NULL };
        // SAFETY: valid communicator; base and win receive MPI's pointer and handle.
        let rc = unsafe {
            ffi::MPI_Win_allocate(
                bytes as ffi::MPI_Aint,
                1,
                ffi::RSMPI_INFO_NULL,
                comm.raw().as_raw(),
                (&mut base as *mut *mut c_void).cast::<c_void>(),
                &mut win,
            )
        };
        if rc != ffi::MPI_SUCCESS as c_int {
            return Err(BenchError::Rma(format!(
                "rank {}: MPI_Win_allocate of {bytes} bytes failed: {}",
                comm.rank(),
                crate::transport::mpi::error_string(rc)
            )));
        }
        if bytes > 0 && !base.is_null() {
            // OSU fills its window with 'a': memory never written maps the kernel's zero
            // page, which a get would read from cache at any size.
            // SAFETY: MPI returned `bytes` bytes at `base`, which nothing accesses yet.
            unsafe { std::ptr::write_bytes(base.cast::<u8>(), b'a', bytes) };
        }
        Ok(RawWindow { win })
    }

    fn free(mut self) {
        // SAFETY: a valid window with no open epoch; collective like the allocation.
        unsafe { ffi::MPI_Win_free(&mut self.win) };
    }
}

fn elements(name: &str, size: usize) -> usize {
    if name == "acc_latency" {
        (size / 4).max(1)
    } else {
        size
    }
}

/// Rank 0's timed loop on the raw path: seconds.
fn raw_loop(
    name: &str,
    w: &RawWindow,
    size: usize,
    iters: usize,
    warmup: usize,
    window: usize,
) -> f64 {
    let n = elements(name, size);
    // Filled as OSU's buffers ('a' in every byte).
    let mut bytes = vec![b'a'; size * window.max(1)];
    let mut ints = vec![i32::from_ne_bytes([b'a'; 4]); n];
    // SAFETY: constant handles.
    let (u8t, i32t, sum) = unsafe { (ffi::RSMPI_UINT8_T, ffi::RSMPI_INT32_T, ffi::RSMPI_SUM) };
    // SAFETY: the window is valid; rank 1's window holds `size` bytes (`window` x `size`
    // for get_bw, n i32 for acc), so every displacement and count below is in range; each
    // operation's local buffer lives until the flush that follows it; return codes are
    // checked after the loop (a failed call leaves rc non-zero).
    unsafe {
        let mut rc = ffi::MPI_Win_lock(ffi::MPI_LOCK_SHARED as c_int, 1, 0, w.win);
        let mut start = Instant::now();
        for i in 0..warmup + iters {
            if i == warmup {
                start = Instant::now();
            }
            let graph = osu_graph_start(i, warmup);
            rc |= match name {
                "put_latency" => ffi::MPI_Put(
                    bytes.as_ptr().cast(),
                    size as c_int,
                    u8t,
                    1,
                    0,
                    size as c_int,
                    u8t,
                    w.win,
                ),
                "get_latency" => ffi::MPI_Get(
                    bytes.as_mut_ptr().cast(),
                    size as c_int,
                    u8t,
                    1,
                    0,
                    size as c_int,
                    u8t,
                    w.win,
                ),
                "acc_latency" => ffi::MPI_Accumulate(
                    ints.as_mut_ptr().cast(),
                    n as c_int,
                    i32t,
                    1,
                    0,
                    n as c_int,
                    i32t,
                    sum,
                    w.win,
                ),
                _ => {
                    let mut r = 0;
                    for (j, chunk) in bytes.chunks_mut(size).enumerate() {
                        r |= ffi::MPI_Get(
                            chunk.as_mut_ptr().cast(),
                            size as c_int,
                            u8t,
                            1,
                            (j * size) as ffi::MPI_Aint,
                            size as c_int,
                            u8t,
                            w.win,
                        );
                    }
                    r
                }
            };
            rc |= ffi::MPI_Win_flush(1, w.win);
            osu_graph_end(graph);
        }
        let t = secs(start);
        rc |= ffi::MPI_Win_unlock(1, w.win);
        assert_eq!(rc, ffi::MPI_SUCCESS as c_int, "raw one-sided loop");
        t
    }
}

/// Rank 0's timed loop through mpiflow's layer: seconds.
fn our_loop<T: RmaType>(
    name: &str,
    w: &mut Window<T>,
    (n, fill): (usize, T),
    iters: usize,
    warmup: usize,
    window: usize,
) -> Result<f64, BenchError> {
    let mut buf = vec![fill; n * window.max(1)];
    let ep = w.lock_all()?;
    let mut start = Instant::now();
    for i in 0..warmup + iters {
        if i == warmup {
            start = Instant::now();
        }
        let graph = osu_graph_start(i, warmup);
        match name {
            "put_latency" => ep.put(1, 0, &buf[..n])?,
            "get_latency" => ep.get_into(1, 0, &mut buf[..n])?,
            "acc_latency" => ep.accumulate_sum(1, 0, &buf[..n])?,
            _ => ep.batch(|b| -> Result<(), RmaError> {
                for (j, chunk) in buf.chunks_mut(n).enumerate() {
                    b.get_into(1, j * n, chunk)?;
                }
                Ok(())
            })??,
        }
        osu_graph_end(graph);
    }
    Ok(secs(start))
}

/// OSU 7.4's one-sided loops read the clock before and after every timed operation (for
/// their graph and tail-latency options, whether or not those are on), inside the timed
/// loop: about 50 ns of a 0.1 us put here. Both paths do the same, so that they measure
/// what OSU measures.
fn osu_graph_start(i: usize, warmup: usize) -> Option<Instant> {
    (i >= warmup).then(Instant::now)
}

/// The second clock read of [`osu_graph_start`].
fn osu_graph_end(start: Option<Instant>) {
    if let Some(t) = start {
        std::hint::black_box((t, Instant::now()));
    }
}

/// One measurement of one path at one size (on rank 0; other ranks return 0).
fn measure(
    comm: &MpiComm,
    name: &str,
    path: Path,
    size: usize,
    opts: &BenchOptions,
) -> Result<f64, BenchError> {
    let bw = name == "get_bw";
    let (iters, warmup) = if bw {
        osu::iterations(opts, size, (100, 10), (20, 2), 1 << 20)
    } else {
        osu::iterations(opts, size, (10000, 100), (1000, 10), 8192)
    };
    let window = if bw { opts.window.max(1) } else { 1 };
    let me = comm.rank();
    let n = elements(name, size);
    // Only rank 1 exposes memory; the others' windows are empty.
    let here = |len: usize| if me == 1 { len } else { 0 };
    let t = match path {
        Path::Mpi => {
            let bytes = if name == "acc_latency" {
                4 * n
            } else {
                size * window
            };
            let w = RawWindow::allocate(comm, here(bytes))?;
            let t = (me == 0).then(|| raw_loop(name, &w, size, iters, warmup, window));
            comm.raw().barrier();
            w.free();
            t
        }
        _ if name == "acc_latency" => {
            let mut w = Window::<i32>::allocate(comm, here(n)).map_err(alloc_error)?;
            let t = (me == 0)
                .then(|| {
                    our_loop(
                        name,
                        &mut w,
                        (n, i32::from_ne_bytes([b'a'; 4])),
                        iters,
                        warmup,
                        window,
                    )
                })
                .transpose()?;
            comm.raw().barrier();
            w.free()?;
            t
        }
        _ => {
            let mut w = Window::<u8>::allocate(comm, here(size * window)).map_err(alloc_error)?;
            let t = (me == 0)
                .then(|| our_loop(name, &mut w, (size, b'a'), iters, warmup, window))
                .transpose()?;
            comm.raw().barrier();
            w.free()?;
            t
        }
    };
    Ok(match t {
        None => 0.0,
        Some(t) if bw => size as f64 / 1e6 * (iters * window) as f64 / t,
        Some(t) => t * 1e6 / iters as f64,
    })
}

/// Runs one of [`NAMES`] over the sizes; returns the text rank 0 prints.
pub fn run(comm: &MpiComm, name: &str, opts: &BenchOptions) -> Result<String, BenchError> {
    let (min, max) = opts.sizes.unwrap_or((1, 1 << 22));
    // Accumulate moves 32-bit integers: 4 bytes is the smallest message.
    let min = if name == "acc_latency" {
        min.max(4)
    } else {
        min
    };
    let (paths, rounds) = opts.plan();
    let coll = Collectives::new(MpiComm::new(comm.raw()));
    let better = if name == "get_bw" {
        Better::Higher
    } else {
        Better::Lower
    };
    let measured = best_of_rounds(
        &coll,
        osu::sizes(min, max),
        &paths,
        rounds,
        better,
        opts.progress,
        |path, size| Ok(Row::point(size, measure(comm, name, path, size, opts)?, 0)),
    )?;
    let (title, datatype, column) = match name {
        "put_latency" => ("MPI_Put Latency Test", "MPI_CHAR", "Latency (us)"),
        "get_latency" => ("MPI_Get latency Test", "MPI_CHAR", "Latency (us)"),
        "acc_latency" => ("MPI_Accumulate latency Test", "MPI_INT", "Latency (us)"),
        _ => ("MPI_Get Bandwidth Test", "MPI_CHAR", "Bandwidth (MB/s)"),
    };
    let mut out = crate::transport::rma::path_note() + "\n";
    out +=
        &measured.render(|rows| osu::one_sided_table(title, datatype, column, rows, opts.digits));
    Ok(out)
}
