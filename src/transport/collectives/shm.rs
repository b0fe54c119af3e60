//! Allreduce through memory the ranks of one node share (MPI-3 shared-memory windows).
//!
//! When every rank of a communicator runs on one node, data need not travel as messages:
//! each rank loads its peers' data straight from their segments
//! (`MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)` + `MPI_Win_allocate_shared`, or plain
//! shared allocations in the in-process transport). On this 2-core machine a message
//! costs two copies through OpenMPI's shared-memory transport plus a handshake; here a
//! byte that a peer needs is copied once into a slot, and the result once out.
//!
//! Protocol: every rank's segment has three counters (`arrived`, `reduced`, `done`) and
//! [`SLOTS`] slots. A buffer (or a list of buffers, as one stream: the fusion path packs
//! nothing) streams through the slots in chunks, and chunk `g` of the communicator's life
//! uses slot `g % SLOTS`. Rank `r` owns sub-slice `r * E / n .. (r + 1) * E / n` of a
//! chunk of `E` elements:
//! 1. wait until every rank is `done` with chunk `g - SLOTS` (the slot's previous use);
//! 2. copy the peers' sub-slices of my part of the stream into my slot (my own sub-slice
//!    stays where it is), with a header (total bytes, dtype, op); publish `arrived = g + 1`;
//! 3. wait until every rank has arrived; on a call's first chunk compare every header
//!    with rank 0's, so a mismatched call is the same error on every rank;
//! 4. reduce my sub-slice in place in my stream, mine first and then every other rank's
//!    from its slot in rank order, and copy the result into my slot; publish
//!    `reduced = g + 1`;
//! 5. wait until every rank has reduced; copy every peer's sub-slice out of its slot;
//!    publish `done = g + 1`.
//!
//! Copies into slots use cached or streaming stores, as measured to be cheaper
//! ([`super::stores`], timing whole chunks): the slot was last read by peers, so on cores
//! that share no cache a cached store must first take every line back.
//!
//! Calls of at most `direct_max_bytes` (16 KiB) take one step instead: in 2. a rank copies
//! its whole part, and after 3. every rank reduces the whole chunk from every slot in rank
//! order, then publishes `done`.
//!
//! Each element is reduced by one rank, so every rank ends with identical bits. The next
//! chunk goes to another slot while slower ranks still copy out, so chunks pipeline.
//! Waiting spins briefly, then yields (more ranks than cores is normal here), and fails
//! after the timeout naming a rank that never came, instead of hanging.
//!
//! Maintainer note: counters are atomics in the shared memory; a `Release` store after
//! writing data and an `Acquire` load before reading it order the plain copies, which is
//! what `MPI_Win_sync` amounts to in MPI's unified memory model (the only model of
//! `MPI_Win_allocate_shared` memory on cache-coherent nodes). Streaming stores are not
//! ordered by it: [`stores::fence`] comes between them and the `Release` store.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::stores::{self, StoreChooser, StoreMode};
use crate::tensor::{AlignedBuf, DType};
use crate::transport::comm::{ReduceOp, TransportError};
use crate::transport::reduce::{divide_bytes, reduce_bytes, reduce_into_bytes};
use crate::transport::segments::SharedSegments;

/// Slots per rank: chunks in flight.
pub const SLOTS: usize = 4;
/// Bytes at the start of every segment: three counters, then the slots' headers (a cache
/// line each); the slots' data follow, page-aligned.
const CONTROL: usize = 4096;
/// Where slot headers start in the control block.
const HEADERS: usize = 192;

/// Segment bytes needed for slots of `slot_bytes`.
pub fn segment_bytes(slot_bytes: usize) -> usize {
    CONTROL + SLOTS * slot_bytes
}

/// What a rank passed to one allreduce, as its slot header carries it: four words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CallHeader {
    pub(super) bytes: u64,
    pub(super) dtype: DType,
    pub(super) op: ReduceOp,
    /// Where the input and the output lie in symmetric memory ([`Place::code`]; 0: not).
    pub(super) places: [u64; 2],
}

/// Bytes at `at` of a region of symmetric memory.
#[derive(Clone, Copy)]
pub(super) struct Place<'r> {
    pub(super) region: &'r crate::transport::symmetric::Region,
    pub(super) at: usize,
}

impl Place<'_> {
    /// The region's number and the offset, for the call's header.
    pub(super) fn code(&self) -> u64 {
        // Never 0 (which says "not symmetric"): the number's low 23 bits, plus one.
        const LOW: u64 = (1 << 40) - 1;
        ((self.region.id & 0x7f_ffff) + 1) << 40 | (self.at as u64 & LOW)
    }

    fn describe(code: u64) -> String {
        format!(
            "region {} at byte {}",
            (code >> 40) - 1,
            code & ((1 << 40) - 1)
        )
    }
}

impl CallHeader {
    fn words(&self) -> [u64; 4] {
        [self.bytes, self.code(), self.places[0], self.places[1]]
    }

    fn describe_words(w: [u64; 4]) -> String {
        let call = Self::describe_code(w[0], w[1]);
        match (w[2], w[3]) {
            (0, 0) => call,
            (0, to) => format!("{call} in symmetric memory ({})", Place::describe(to)),
            (from, to) => format!(
                "{call} from symmetric memory ({}) into {}",
                Place::describe(from),
                match to {
                    0 => "memory of its own".to_string(),
                    to => Place::describe(to),
                }
            ),
        }
    }

    fn code(&self) -> u64 {
        let op = match self.op {
            ReduceOp::Sum => 0,
            ReduceOp::Average => 1,
            ReduceOp::Min => 2,
            ReduceOp::Max => 3,
        };
        u64::from(self.dtype.code()) << 8 | op
    }

    fn describe_code(bytes: u64, code: u64) -> String {
        let dtype = DType::from_code((code >> 8) as u8).map_or("?".into(), |d| d.to_string());
        let op = ["sum", "average", "min", "max"]
            .get((code & 0xff) as usize)
            .unwrap_or(&"?");
        format!("{bytes} bytes of {dtype} ({op})")
    }
}

/// Which counter of a segment.
#[derive(Debug, Clone, Copy)]
pub(super) enum Counter {
    Arrived = 0,
    Reduced = 1,
    Done = 2,
}

/// The shared-memory allreduce of one communicator.
pub struct ShmAllreduce {
    segs: SharedSegments,
    rank: usize,
    slot_bytes: usize,
    /// The next chunk number (the same on every rank between calls).
    next: Cell<u64>,
    pub timeout: Duration,
    /// Calls of at most this many bytes take the one-step protocol.
    pub direct_max_bytes: usize,
    /// Busy polls before a waiting rank yields its core: none when the node has more
    /// ranks than cores (a spinning rank would only delay the one it waits for).
    spins: u32,
    /// The one-step protocol's accumulator.
    scratch: std::cell::RefCell<AlignedBuf>,
    /// How this rank copies into its slots ([`super::stores`]).
    pub stores: StoreChooser,
}

/// Online CPUs of this machine (`sysconf(_SC_NPROCESSORS_ONLN)`): ranks are often bound
/// to one core each, so the process's own affinity says nothing about the node.
fn online_cpus() -> usize {
    // SAFETY: sysconf only reads a system value.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).unwrap_or(1).max(1)
}

impl ShmAllreduce {
    /// Over `segs` (of at least [`segment_bytes`]`(slot_bytes)` each); `slot_bytes` is a
    /// multiple of 4096.
    pub fn new(segs: SharedSegments, rank: usize, slot_bytes: usize, timeout: Duration) -> Self {
        assert!(
            slot_bytes.is_multiple_of(4096) && slot_bytes > 0,
            "slot size"
        );
        assert!(segs.len() >= segment_bytes(slot_bytes), "segment too small");
        // 256 PAUSEs cover about a peer's chunk copy; then the core goes to whoever needs
        // it (a training's compute thread, say).
        let spins = if segs.ranks() > online_cpus() { 0 } else { 256 };
        ShmAllreduce {
            segs,
            rank,
            slot_bytes,
            next: Cell::new(0),
            timeout,
            direct_max_bytes: 16 << 10,
            spins,
            scratch: std::cell::RefCell::new(AlignedBuf::zeroed(64)),
            stores: StoreChooser::default(),
        }
    }

    pub(super) fn size(&self) -> usize {
        self.segs.ranks()
    }

    pub(super) fn rank(&self) -> usize {
        self.rank
    }

    /// More ranks share the node than it has cores.
    pub fn oversubscribed(&self) -> bool {
        self.spins == 0
    }

    pub(super) fn counter(&self, r: usize, c: Counter) -> &AtomicU64 {
        // SAFETY: every segment starts with CONTROL bytes of 64-byte aligned counters
        // (one cache line each), valid while `segs` lives; only atomics touch them.
        unsafe { &*self.segs.ptr(r).add(64 * c as usize).cast::<AtomicU64>() }
    }

    fn slot(&self, r: usize, g: u64) -> *mut u8 {
        let s = (g % SLOTS as u64) as usize;
        // SAFETY: slot s of segment r lies within the segment (checked in `new`).
        unsafe { self.segs.ptr(r).add(CONTROL + s * self.slot_bytes) }
    }

    /// The header of the slot of chunk `g` on rank `r`: two u64.
    fn slot_header(&self, r: usize, g: u64) -> *mut u64 {
        let s = (g % SLOTS as u64) as usize;
        // SAFETY: the headers lie in the control block of segment r.
        unsafe { self.segs.ptr(r).add(HEADERS + 64 * s).cast() }
    }

    /// Waits until every rank's counter `c` is at least `at`.
    pub(super) fn wait_all(&self, c: Counter, at: u64) -> Result<(), TransportError> {
        let start = Instant::now();
        for r in 0..self.size() {
            let mut polls = 0u32;
            while self.counter(r, c).load(Ordering::Acquire) < at {
                polls = polls.wrapping_add(1);
                if polls < self.spins {
                    std::hint::spin_loop();
                } else {
                    // Another rank may need this core (oversubscription).
                    std::thread::yield_now();
                    if polls.is_multiple_of(1024) && start.elapsed() > self.timeout {
                        return Err(TransportError::Stalled {
                            rank: self.rank,
                            peer: r,
                            what: "the shared-memory allreduce",
                            millis: self.timeout.as_millis() as u64,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks every rank's header of chunk `g` against rank 0's: the same answer on every
    /// rank, since all read the same headers.
    pub(super) fn check_headers(&self, g: u64) -> Result<(), TransportError> {
        let read = |r: usize| {
            // SAFETY: the header precedes the slot's data; rank r wrote it before publishing
            // `arrived` (acquired by the caller) and rewrites it only after every rank is
            // done with this chunk.
            unsafe {
                let h = self.slot_header(r, g);
                [h.read(), h.add(1).read(), h.add(2).read(), h.add(3).read()]
            }
        };
        let first = read(0);
        for r in 1..self.size() {
            let theirs = read(r);
            if theirs != first {
                return Err(TransportError::CallMismatch {
                    rank: self.rank,
                    peer: r,
                    theirs: CallHeader::describe_words(theirs),
                    ours: CallHeader::describe_words(first),
                });
            }
        }
        Ok(())
    }

    /// Writes this rank's header of chunk `g` (waiting first until the slot is free) and
    /// publishes `arrived`.
    pub(super) fn arrive(&self, g: u64, header: &CallHeader) -> Result<(), TransportError> {
        self.claim(g, header)?;
        self.counter(self.rank, Counter::Arrived)
            .store(g + 1, Ordering::Release);
        Ok(())
    }

    /// Waits until every rank is done with the slot of chunk `g`'s previous use, then
    /// writes this rank's header of chunk `g` there.
    fn claim(&self, g: u64, header: &CallHeader) -> Result<(), TransportError> {
        if g >= SLOTS as u64 {
            self.wait_all(Counter::Done, g + 1 - SLOTS as u64)?;
        }
        // SAFETY: every rank is done with this slot's previous chunk (waited above) and
        // nobody reads the header before `arrived` says so: it is ours to write.
        unsafe {
            let h = self.slot_header(self.rank, g);
            for (i, w) in header.words().into_iter().enumerate() {
                h.add(i).write(w);
            }
        }
        Ok(())
    }

    /// Ends chunk `g` without data after `e` (every rank has the same): the counters stay in
    /// step for the next call.
    pub(super) fn abandon(&self, g: u64, e: TransportError) -> Result<(), TransportError> {
        self.next.set(g + 1);
        self.counter(self.rank, Counter::Reduced)
            .store(g + 1, Ordering::Release);
        self.wait_all(Counter::Reduced, g + 1)?;
        self.counter(self.rank, Counter::Done)
            .store(g + 1, Ordering::Release);
        Err(e)
    }

    /// The accumulator, at least `len` bytes.
    pub(super) fn scratch(&self, len: usize) -> std::cell::RefMut<'_, AlignedBuf> {
        let mut scratch = self.scratch.borrow_mut();
        if scratch.len() < len {
            *scratch = AlignedBuf::zeroed(len.next_multiple_of(64));
        }
        scratch
    }

    /// How a call of `total` bytes of elements of `es` bytes is cut: bytes per chunk, and
    /// whether it takes the one-step protocol (whose reduction runs in rank order).
    pub(super) fn cut(&self, total: usize, es: usize) -> (usize, bool) {
        let chunk_bytes = self.slot_bytes / es * es;
        let direct = total <= chunk_bytes && total <= self.direct_max_bytes;
        (chunk_bytes, direct)
    }

    /// The next chunk's number.
    pub(super) fn next_chunk(&self) -> u64 {
        self.next.get()
    }

    /// Chunks up to `g` are over.
    pub(super) fn finish(&self, g: u64) {
        self.next.set(g + 1);
    }

    /// Allreduces the concatenation of `parts` in place (every part a whole number of
    /// `dtype` elements). Collective; every rank passes the same total, dtype and op.
    pub fn allreduce(
        &self,
        parts: &mut [&mut [u8]],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), TransportError> {
        self.allreduce_from(None, parts, dtype, op)
    }

    /// The reduction of `src` into `dst` (of its length): [`ShmAllreduce::allreduce`] of a
    /// copy of `src` in `dst`, without the copy (the input is read where it is, and this
    /// rank's sub-slices reduced from it straight into `dst`), the same bits.
    pub fn allreduce_into(
        &self,
        src: &[u8],
        dst: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), TransportError> {
        assert_eq!(src.len(), dst.len(), "allreduce_into: src and dst lengths");
        self.allreduce_from(Some(src), &mut [dst], dtype, op)
    }

    /// The allreduce of `parts`, its input read from `from` where given (one part, as
    /// long), else from the parts themselves.
    fn allreduce_from(
        &self,
        from: Option<&[u8]>,
        parts: &mut [&mut [u8]],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), TransportError> {
        let (n, me, es) = (self.size(), self.rank, dtype.size());
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let header = CallHeader {
            bytes: total as u64,
            dtype,
            op,
            places: [0, 0],
        };
        let (chunk_bytes, direct) = self.cut(total, es);
        // A call of zero bytes still takes one (empty) chunk: its header is compared.
        let chunks = total.div_ceil(chunk_bytes).max(1) as u64;
        let base = self.next.get();
        let mut stream = Stream::new(parts);
        for c in 0..chunks {
            let g = base + c;
            let off = c as usize * chunk_bytes;
            let len = chunk_bytes.min(total - off);
            self.claim(g, &header)?;
            let mine = self.slot(me, g);
            let elems = len / es;
            let sub = |r: usize| (r * elems / n) * es..((r + 1) * elems / n) * es;
            let own = sub(me);
            // Peers read this slot next: the step is timed, from the copy in to the copy
            // out, to choose how to store (the peers' reads of what was stored count).
            let mode = if direct {
                StoreMode::Cached
            } else {
                self.stores.pick(g, len)
            };
            // Only timed where the mode was chosen: small calls need no clock reads.
            let start = (!direct).then(Instant::now);
            // SAFETY: every rank is done with this slot's previous chunk (waited above) and
            // nobody reads it before `arrived` says so: it is ours to write.
            unsafe {
                let slot = std::slice::from_raw_parts_mut(mine, len);
                let read = |at: usize, into: &mut [u8]| match from {
                    Some(src) => stores::copy(mode, into, &src[off + at..off + at + into.len()]),
                    None => stream.read_into(off + at, into, mode),
                };
                if direct {
                    read(0, slot);
                } else {
                    // Only what peers reduce: this rank's own sub-slice is reduced from the
                    // input itself.
                    read(0, &mut slot[..own.start]);
                    read(own.end, &mut slot[own.end..]);
                }
            }
            stores::fence(mode);
            self.counter(me, Counter::Arrived)
                .store(g + 1, Ordering::Release);
            self.wait_all(Counter::Arrived, g + 1)?;
            if c == 0 {
                if let Err(e) = self.check_headers(g) {
                    return self.abandon(g, e);
                }
            }
            if direct {
                self.reduce_whole(&mut stream, g, len, dtype, op);
                self.counter(me, Counter::Done)
                    .store(g + 1, Ordering::Release);
                break;
            }
            // Reduce my sub-slice in the stream (in place: its own values are there), in
            // the order mine, then every other rank's; then publish it in my slot.
            stream.for_each_mut(off + own.start, own.len(), |acc, at| {
                let at = own.start + at;
                let len = acc.len();
                // SAFETY: between `arrived` and `done` nobody writes rank r's slot outside
                // its own sub-slice, and `at..at + len` lies in mine.
                let peer =
                    |r: usize| unsafe { std::slice::from_raw_parts(self.slot(r, g).add(at), len) };
                let mut others = (0..n).filter(|&r| r != me);
                if let Some(src) = from {
                    let own_input = &src[off + at..off + at + len];
                    match others.next() {
                        Some(r) => reduce_into_bytes(dtype, op, acc, own_input, peer(r)),
                        None => acc.copy_from_slice(own_input),
                    }
                }
                for r in others {
                    reduce_bytes(dtype, op, acc, peer(r));
                }
                if op == ReduceOp::Average && n > 1 {
                    divide_bytes(dtype, acc, n);
                }
                // SAFETY: only this rank writes its own sub-slice of its slot, and peers
                // read it only after `reduced`.
                let out = unsafe { std::slice::from_raw_parts_mut(mine.add(at), acc.len()) };
                stores::copy(mode, out, acc);
            });
            stores::fence(mode);
            self.counter(me, Counter::Reduced)
                .store(g + 1, Ordering::Release);
            self.wait_all(Counter::Reduced, g + 1)?;
            for r in (0..n).filter(|&r| r != me) {
                let s = sub(r);
                // SAFETY: rank r finished its sub-slice (acquired above) and nobody writes
                // any slot of chunk g until every rank is done with it.
                let src =
                    unsafe { std::slice::from_raw_parts(self.slot(r, g).add(s.start), s.len()) };
                stream.write_from(off + s.start, src);
            }
            if let Some(start) = start {
                self.stores.record(mode, len, start.elapsed());
            }
            self.counter(me, Counter::Done)
                .store(g + 1, Ordering::Release);
        }
        self.next.set(base + chunks);
        Ok(())
    }

    /// The one-step protocol for small calls: every rank reduces the whole chunk from every
    /// slot, in rank order (so all get the same bits), into its own output. One wait per
    /// call instead of two; the work it repeats on every rank is small.
    fn reduce_whole(&self, stream: &mut Stream, g: u64, len: usize, dtype: DType, op: ReduceOp) {
        let n = self.size();
        let mut scratch = self.scratch(len);
        let acc = &mut scratch.as_mut_slice()[..len];
        // SAFETY: every rank has arrived (acquired by the caller) and no slot of chunk g is
        // written again until every rank is done with it.
        unsafe {
            acc.copy_from_slice(std::slice::from_raw_parts(self.slot(0, g), len));
            for r in 1..n {
                reduce_bytes(
                    dtype,
                    op,
                    acc,
                    std::slice::from_raw_parts(self.slot(r, g), len),
                );
            }
        }
        if op == ReduceOp::Average {
            divide_bytes(dtype, acc, n);
        }
        stream.write_from(0, acc);
    }
}

/// A list of buffers read and written as one byte stream.
pub(crate) struct Stream<'a, 'b> {
    parts: &'a mut [&'b mut [u8]],
    /// Stream offset where each part starts, and the total at the end.
    bounds: Vec<usize>,
}

/// Calls `f(part, range in part, offset in off..off + len)` for every part overlapping
/// `off..off + len`, in order, given the parts' stream `bounds`.
fn visit(
    bounds: &[usize],
    off: usize,
    len: usize,
    mut f: impl FnMut(usize, std::ops::Range<usize>, usize),
) {
    let first = bounds.partition_point(|&s| s <= off).saturating_sub(1);
    for i in first..bounds.len().saturating_sub(1) {
        let (s, e) = (bounds[i], bounds[i + 1]);
        if s >= off + len {
            break;
        }
        let (lo, hi) = (off.max(s), (off + len).min(e));
        if lo < hi {
            f(i, lo - s..hi - s, lo - off);
        }
    }
}

impl<'a, 'b> Stream<'a, 'b> {
    pub(crate) fn new(parts: &'a mut [&'b mut [u8]]) -> Self {
        let mut bounds = vec![0];
        for p in parts.iter() {
            bounds.push(bounds[bounds.len() - 1] + p.len());
        }
        Stream { parts, bounds }
    }

    /// Copies stream bytes `off..off + dst.len()` into `dst` with `mode`'s stores.
    pub(crate) fn read_into(&self, off: usize, dst: &mut [u8], mode: StoreMode) {
        visit(&self.bounds, off, dst.len(), |i, r, at| {
            stores::copy(mode, &mut dst[at..at + r.len()], &self.parts[i][r]);
        });
    }

    /// Calls `f(piece, at)` for the stream bytes `off..off + len`, piece by piece (one
    /// per part they span), `at` being the piece's offset from `off`.
    pub(crate) fn for_each_mut(
        &mut self,
        off: usize,
        len: usize,
        mut f: impl FnMut(&mut [u8], usize),
    ) {
        let parts = &mut *self.parts;
        visit(&self.bounds, off, len, |i, r, at| f(&mut parts[i][r], at));
    }

    /// Copies `src` over stream bytes `off..off + src.len()`.
    pub(crate) fn write_from(&mut self, off: usize, src: &[u8]) {
        let parts = &mut *self.parts;
        visit(&self.bounds, off, src.len(), |i, r, at| {
            let l = r.len();
            parts[i][r].copy_from_slice(&src[at..at + l]);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_spans_parts() {
        let (mut a, mut b, mut c) = (vec![1u8, 2, 3], vec![], vec![4u8, 5, 6, 7]);
        let mut parts: Vec<&mut [u8]> = vec![&mut a, &mut b, &mut c];
        let mut s = Stream::new(&mut parts);
        let mut d = [0u8; 4];
        s.read_into(1, &mut d, StoreMode::Cached);
        assert_eq!(d, [2, 3, 4, 5]);
        s.write_from(2, &[30, 40, 50]);
        assert_eq!((a, c), (vec![1, 2, 30], vec![40, 50, 6, 7]));
    }
}
