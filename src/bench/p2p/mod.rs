//! `latency`, `bw`, `bibw`: ranks 0 and 1, OSU 7.4's method; other ranks wait.
//!
//! The method, on every path (`osu_latency.c`, `osu_bw.c`, `osu_bibw.c`):
//! - **Buffers**: a send and a receive buffer per rank, never the same one (sending and
//!   receiving one buffer was measured 1.3-1.4x slower at 8-128 KiB here: the two copies
//!   fight over its cache lines). With `-b single` (the default) one of each, reused by
//!   every message of a window; with `-b multiple` one per message. The `mpi` path's
//!   buffers are page-aligned on ordinary pages, filled with `a` and `b` at each size, and,
//!   single, allocated once at the largest size (`AlignedBuf::paged`), multiple, at each
//!   size (latency too, as `osu_latency -b multiple`); the mpiflow paths' are tensors as
//!   the runtime makes them, filled the same way.
//! - **Loop**: `-x` untimed iterations, then `-i` timed ones, each timed on its own by rank
//!   0 (the sum of the iterations' times), after a barrier; OSU's counts by default.
//! - **latency**: rank 0 sends and receives, rank 1 receives and sends; half the round trip.
//! - **bw**: rank 0 posts a window of `-W` sends and waits for them, then for rank 1's
//!   1-byte reply; rank 1 receives the window, then replies.
//! - **bibw**: both ranks post the window's receives, then its sends, wait for the sends,
//!   then the receives; both directions count.
//! - **`-c`**: each iteration's messages carry a pattern of the iteration, written before
//!   and checked after the timed part (a mismatch ends the run with an error naming the
//!   byte); the table gains OSU's `Validation` column.
//!
//! The `mpi` path makes OSU's calls on raw buffers through `mpi::ffi` (module `raw`), including
//! several pending receives into one buffer under `-b single`. A tensor cannot be the
//! target of two pending receives (a receive borrows it exclusively), so the mpiflow paths
//! receive a single-buffer window message by message into the one tensor, with every send
//! of the window in flight. Measured with plain MPI (`benches/compare/receive_order.c`),
//! that order is as fast as OSU's from 4 KiB on an AMD VM and 0.94-0.97x at 4-16 KiB on an
//! Intel one; below, where messages go eagerly and arrive before their receive is posted
//! (MPI's unexpected-message path, one more copy), it reads 0.8-0.95x of OSU's bandwidth
//! at 1-32 B (and faster at 64-256 B, where OSU's window overflows Open MPI's fast box).
//! The `inbox` path receives the same way from an
//! [`Inbox`](crate::transport::inbox::Inbox) whose receives were posted a window ahead
//! (within 1 MiB of buffers), each message moved into the one tensor without a copy. The
//! mpiflow paths' buffers and ways are in `tensors`, the `mpi` path's in `raw`.

use std::time::Instant;

use super::osu::{self, BenchOptions, Buffers, Path};
use super::{best_of_rounds, secs, BenchError, Better, Row};
use crate::transport::mpi::MpiComm;
use crate::transport::{p2p, Collectives, Comm};

mod raw;
mod tensors;

use raw::{Raw, RawBuffers};
use tensors::{inbox_depth, Tensors, Via};

const TAG: i32 = 1;
const ACK_TAG: i32 = 2;

/// The three benchmarks of this module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Latency,
    Bw,
    Bibw,
}

impl Kind {
    fn of(name: &str) -> Kind {
        match name {
            "latency" => Kind::Latency,
            "bw" => Kind::Bw,
            _ => Kind::Bibw,
        }
    }

    /// Messages per iteration and direction.
    fn window(self, opts: &BenchOptions) -> usize {
        match self {
            Kind::Latency => 1,
            _ => opts.window.max(1),
        }
    }

    /// OSU's (iterations, warm-up) at `size`.
    fn iterations(self, opts: &BenchOptions, size: usize) -> (usize, usize) {
        match self {
            Kind::Latency => osu::iterations(opts, size, (10000, 100), (1000, 10), 8192),
            _ => osu::iterations(opts, size, (100, 10), (20, 2), 8192),
        }
    }

    /// Buffers per side: one, or one per message of the window (`-b multiple`).
    fn buffers(self, opts: &BenchOptions) -> usize {
        match (self, opts.buffers) {
            (Kind::Latency, _) | (_, Buffers::Single) => 1,
            (_, Buffers::Multiple) => self.window(opts),
        }
    }

    /// Does rank `me` send, receive, in the timed part?
    fn roles(self, me: usize) -> (bool, bool) {
        match self {
            Kind::Bw => (me == 0, me == 1),
            _ => (true, true),
        }
    }
}

/// The byte message `j` of iteration `i` carries under `-c` (never `b`, the receive
/// buffers' filler, so a message that did not arrive shows).
fn pattern(i: usize, j: usize) -> u8 {
    match ((i * 31 + j * 7) % 251) as u8 {
        b'b' => 0,
        x => x,
    }
}

/// Counts the bytes of `got` that differ from message `j` of iteration `i`: the first
/// one's index, and how many.
fn mismatches(got: &[u8], i: usize, j: usize) -> Option<(usize, usize)> {
    let want = pattern(i, j);
    let first = got.iter().position(|&b| b != want)?;
    Some((first, got[first..].iter().filter(|&&b| b != want).count()))
}

/// The buffer of each of `n` messages among `len` buffers used in turn (`0, 1, .., len-1,
/// 0, ..`), without a division per message: a window of small messages is posted at tens
/// of nanoseconds each, where one `div` shows.
fn turns(len: usize, n: usize) -> impl Iterator<Item = usize> {
    (0..len).cycle().take(n)
}

/// One rank's buffers on one path.
enum Side<'a> {
    Raw(&'a mut RawBuffers),
    /// Boxed: a side of tensors (and their channel) is large beside a reference.
    Tensors(Box<(Tensors, Via<'a>)>),
}

impl Side<'_> {
    fn send_bytes(&mut self, j: usize) -> &mut [u8] {
        match self {
            Side::Raw(b) => {
                let n = b.send.len();
                b.send[j % n].as_mut_slice()
            }
            Side::Tensors(tv) => {
                let t = &mut tv.0;
                let n = t.send.len();
                t.send[j % n].bytes_mut()
            }
        }
    }

    fn recv_bytes(&mut self, j: usize) -> &mut [u8] {
        match self {
            Side::Raw(b) => {
                let n = b.recv.len();
                b.recv[j % n].as_mut_slice()
            }
            Side::Tensors(tv) => {
                let t = &mut tv.0;
                let n = t.recv.len();
                t.recv[j % n].bytes_mut()
            }
        }
    }
}

/// One measurement of one path at one size, on ranks 0 and 1: microseconds (latency) or
/// MB/s. `single` holds the `mpi` path's buffers of `-b single`, allocated once.
fn measure(
    comm: &MpiComm,
    kind: Kind,
    path: Path,
    size: usize,
    opts: &BenchOptions,
    single: &mut RawBuffers,
) -> Result<f64, BenchError> {
    let (iters, warmup) = kind.iterations(opts, size);
    let window = kind.window(opts);
    let me = comm.rank();
    let peer = 1 - me;
    let (sends, receives) = kind.roles(me);
    let (sends, receives) = (window * sends as usize, window * receives as usize);
    let count = kind.buffers(opts);
    let mut multiple;
    let mut bufs = match path {
        // OSU's `-b single`: buffers allocated once at the largest size; `-b multiple`:
        // allocated at each size (osu_latency), a buffer per message (osu_bw, osu_bibw).
        Path::Mpi if opts.buffers == Buffers::Single => {
            single.fill(size);
            Side::Raw(single)
        }
        Path::Mpi => {
            multiple = RawBuffers::new(count, size);
            Side::Raw(&mut multiple)
        }
        _ => {
            let t = Tensors::new(count, size)?;
            let depth = if receives > 0 {
                inbox_depth(window, size)
            } else {
                0
            };
            let via = Via::open(comm, path, &t.send[0], peer, depth)?;
            Side::Tensors(Box::new((t, via)))
        }
    };
    let mut raw = Raw::new(comm, peer);
    let mut total = 0.0;
    // Rank 0 reads the clock, as in OSU's loops; its peer's turnaround stays MPI's alone.
    let timed = me == 0;
    for i in 0..warmup + iters {
        if opts.validate {
            for j in 0..sends.min(count) {
                bufs.send_bytes(j)[..size].fill(pattern(i, j));
            }
            for j in 0..receives.min(count) {
                bufs.recv_bytes(j)[..size].fill(b'b');
            }
        }
        let start = timed.then(Instant::now);
        match (&mut bufs, kind) {
            (Side::Raw(b), Kind::Latency) => {
                if me == 0 {
                    raw.send(&b.send[0].as_slice()[..size], TAG)?;
                    raw.recv(&mut b.recv[0].as_mut_slice()[..size], TAG)?;
                } else {
                    raw.recv(&mut b.recv[0].as_mut_slice()[..size], TAG)?;
                    raw.send(&b.send[0].as_slice()[..size], TAG)?;
                }
            }
            (Side::Raw(b), _) => {
                raw.window(b, size, receives, sends)?;
                if kind == Kind::Bw && me == 0 {
                    raw.recv(&mut b.recv[0].as_mut_slice()[..1], ACK_TAG)?;
                } else if kind == Kind::Bw {
                    raw.send(&b.send[0].as_slice()[..1], ACK_TAG)?;
                }
            }
            (Side::Tensors(tv), Kind::Latency) => {
                let (t, via) = (&mut tv.0, &mut tv.1);
                t.round_trip(comm, via, peer, me == 0)?;
            }
            (Side::Tensors(tv), _) => {
                let (t, via) = (&mut tv.0, &mut tv.1);
                t.window(comm, via, peer, receives, sends)?;
                if kind == Kind::Bw && me == 0 {
                    p2p::receive_into(comm, &mut t.ack_in, peer, ACK_TAG)?;
                } else if kind == Kind::Bw {
                    p2p::send(comm, &t.ack, peer, ACK_TAG)?;
                }
            }
        }
        if i >= warmup {
            total += start.map_or(0.0, secs);
        }
        if opts.validate {
            // Message j of the window went from send buffer j to receive buffer j (from the
            // one to the one under `-b single`).
            for j in 0..receives.min(count) {
                if let Some((at, n)) = mismatches(&bufs.recv_bytes(j)[..size], i, j) {
                    return Err(BenchError::Validation(format!(
                        "{} path, {size}-byte message {j} of iteration {i}: {n} bytes differ, the first at byte {at}",
                        super::Label::label(&path)
                    )));
                }
            }
        }
    }
    if let Side::Tensors(tv) = bufs {
        tv.1.close()?;
    }
    Ok(match kind {
        Kind::Latency => total * 1e6 / (2.0 * iters as f64),
        // Both directions count, as in OSU's bibw.
        Kind::Bibw => size as f64 / 1e6 * iters as f64 * (2 * window) as f64 / total,
        Kind::Bw => size as f64 / 1e6 * iters as f64 * window as f64 / total,
    })
}

/// Buffers a measuring rank holds per side at once: one, or a window's (`-b multiple`).
pub(super) fn buffers(name: &str, opts: &BenchOptions) -> usize {
    Kind::of(name).buffers(opts)
}

/// Runs latency, bw or bibw over the sizes; returns the text rank 0 prints.
pub fn run(comm: &MpiComm, name: &str, opts: &BenchOptions) -> Result<String, BenchError> {
    let kind = Kind::of(name);
    let (min, max) = opts.sizes.unwrap_or((1, 1 << 22));
    let (mut paths, nrounds) = opts.plan();
    if opts.path == Path::Both {
        paths.extend([Path::Channel, Path::Inbox]);
    }
    let coll = Collectives::new(MpiComm::new(comm.raw()));
    let better = if kind == Kind::Latency {
        Better::Lower
    } else {
        Better::Higher
    };
    // OSU's single buffers: allocated once, at the largest size.
    let mut single = RawBuffers::new(1, if comm.rank() < 2 { max } else { 1 });
    let rounds = best_of_rounds(
        &coll,
        osu::sizes(min, max),
        &paths,
        nrounds,
        better,
        opts.progress,
        |path, size| {
            // Ranks 0 and 1 measure; the others only keep the barriers company.
            match comm.rank() {
                0 | 1 => measure(comm, kind, path, size, opts, &mut single),
                _ => Ok(0.0),
            }
            .map(|v| Row::point(size, v, 0))
        },
    )?;
    coll.barrier()?;
    let (title, column) = match kind {
        Kind::Latency => ("Latency Test", "Avg Latency(us)"),
        Kind::Bw => ("Bandwidth Test", "Bandwidth (MB/s)"),
        Kind::Bibw => ("Bi-Directional Bandwidth Test", "Bandwidth (MB/s)"),
    };
    Ok(rounds
        .render(|rows| osu::p2p_table(title, "MPI_CHAR", column, rows, opts.validate, opts.digits)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_from_the_receive_filler_and_between_messages() {
        for i in 0..600 {
            assert_ne!(pattern(i, 0), b'b');
            assert_ne!(pattern(i, 0), pattern(i + 1, 0));
            assert_ne!(pattern(i, 0), pattern(i, 1));
        }
        let mut got = vec![pattern(3, 2); 10];
        assert_eq!(mismatches(&got, 3, 2), None);
        got[4] = b'b';
        got[7] = 0;
        assert_eq!(mismatches(&got, 3, 2), Some((4, 2)));
        assert_eq!(mismatches(&got, 3, 1), Some((0, 10)));
    }

    #[test]
    fn an_inbox_holds_the_window_within_a_megabyte() {
        assert_eq!(inbox_depth(64, 1), 64);
        assert_eq!(inbox_depth(64, 16384), 64);
        assert_eq!(inbox_depth(64, 65536), 16);
        assert_eq!(inbox_depth(64, 1 << 20), 2);
        assert_eq!(inbox_depth(64, 4 << 20), 2);
        assert_eq!(inbox_depth(1, 8), 2);
    }

    #[test]
    fn roles_and_buffers_follow_osu() {
        let multiple = BenchOptions {
            buffers: Buffers::Multiple,
            window: 8,
            ..BenchOptions::default()
        };
        assert_eq!(Kind::Bw.buffers(&multiple), 8);
        assert_eq!(Kind::Latency.buffers(&multiple), 1);
        assert_eq!(Kind::Bibw.buffers(&BenchOptions::default()), 1);
        assert_eq!(Kind::Bw.roles(0), (true, false));
        assert_eq!(Kind::Bw.roles(1), (false, true));
        assert_eq!(Kind::Bibw.roles(1), (true, true));
        assert_eq!(Kind::Bw.iterations(&multiple, 8192), (100, 10));
        assert_eq!(Kind::Bw.iterations(&multiple, 8193), (20, 2));
        assert_eq!(Kind::Latency.iterations(&multiple, 8193), (1000, 10));
    }
}
