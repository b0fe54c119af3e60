//! Collective operations, written once against [`Comm`] so the same code runs on MPI and
//! on the in-process transport.
//!
//! Allreduce algorithms ([`Algorithm`]):
//! - `mpi`: the library's own `MPI_Allreduce` (only where the communicator has one).
//! - `ring`: reduce-scatter then allgather around a ring. Each step's chunk travels as
//!   segments, and each segment is reduced as soon as it arrives while the next ones are
//!   still in flight. Chunk boundaries are `i * len / n`, so lengths that do not divide by
//!   the number of ranks work (chunks differ by at most one element).
//! - `recursive-doubling`: log2(n) exchanges of the whole buffer; best for small tensors.
//!   Ranks beyond the largest power of two first fold into a partner and get the result
//!   back at the end.
//! - `shm`: through memory shared by the ranks of one node ([`super::shm`]): what peers
//!   reduce is copied once into a slot, each rank reduces its sub-slice in place and
//!   publishes it, peers copy it out; pipelined in 256 KiB chunks; one step for calls up to
//!   16 KiB. Where ranks span nodes, `shm` runs as `auto` among the others.
//! - `auto` (default): by size, rank count and placement, from the thresholds in
//!   [`AutoTuning`]. All ranks on one node with a core each: `shm` from 512 B up, the
//!   library's own below; more ranks than cores: `shm` at every size (measured here
//!   against OpenMPI 4.1's `MPI_Allreduce`: shm 0.25-0.76x of its time from 8 KiB to
//!   16 MiB at 2 ranks; 0.20-0.79x at every size at 4 ranks on 2 cores). Across nodes:
//!   the ring from 256 KiB at up to 8 ranks, the library's
//!   own below (the ring is 0.54-0.82x of OpenMPI's time from 256 KiB to 16 MiB, slower
//!   below 64 KiB). Re-measure on other machines with
//!   `mpiflow bench allreduce --algorithm shm` (and `ring`, `recursive-doubling`).
//!
//! Every rank ends with identical bits: each element is reduced along one chain (ring), by
//! both partners from the same two operands (recursive doubling, where `a + b == b + a`
//! holds exactly in IEEE arithmetic), or by one rank, or by all in rank order (shm).

use std::cell::RefCell;

use super::comm::{recv, send, sendrecv, Comm, ReduceOp, TransportError};
use super::shm::{self, ShmAllreduce};
use super::stores::StoreMode;
use super::tags::Reserved;
use crate::tensor::{AlignedBuf, DType, Element, Tensor};

/// The tag of one kind of collective traffic: reserved at the top of the communicator's
/// tag range, above any caller's tag.
fn tag<C: Comm>(c: &C, r: Reserved) -> i32 {
    c.tags().reserved(r)
}

/// An allreduce algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Algorithm {
    #[default]
    Auto,
    Mpi,
    Ring,
    RecursiveDoubling,
    /// Through memory shared by the ranks of one node (see [`super::shm`]).
    Shm,
}

impl crate::named::Named for Algorithm {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (
            Algorithm::Auto,
            "auto",
            "By message size and ranks (see AutoTuning)",
        ),
        (Algorithm::Mpi, "mpi", "The MPI library's MPI_Allreduce"),
        (
            Algorithm::Ring,
            "ring",
            "Reduce-scatter and allgather around a ring",
        ),
        (
            Algorithm::RecursiveDoubling,
            "recursive-doubling",
            "Pairwise exchanges, log2 ranks rounds",
        ),
        (
            Algorithm::Shm,
            "shm",
            "Through memory shared by the ranks of one node",
        ),
    ];
}

/// When `auto` picks which algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AutoTuning {
    /// Below this many bytes: the library's own (or recursive doubling without one).
    pub small_bytes: usize,
    /// From this many bytes, with at most `ring_max_ranks` ranks: the ring.
    pub ring_min_bytes: usize,
    pub ring_max_ranks: usize,
    /// Ring segment size in bytes.
    pub segment_bytes: usize,
    /// `auto` takes the shared-memory allreduce when every rank is on one node...
    pub shm: bool,
    /// ...from `shm_min_bytes` up to and including `shm_max_bytes` (default: no limit),
    /// or for every size when the node has more ranks than cores. With a core per rank the
    /// library's own is faster below (0.6 against 0.75 us at 2 ranks here). Above, shm was
    /// the faster in 14 of 15 pairs from 1 to 16 MiB against the ring (0.34-0.68x of
    /// `MPI_Allreduce` against 0.55-0.92x; three jobs with both as paths, `bench allreduce
    /// --algorithm ring,shm`), since it copies each rank's sub-slice once and stores by
    /// measured mode ([`super::stores`]).
    pub shm_min_bytes: usize,
    pub shm_max_bytes: usize,
    /// Bytes per shared-memory slot (the pipeline's chunk). 256 KiB: against 64 KiB a
    /// fused 1 MiB call took 80-98 us instead of 115-122 (fewer steps to wait for), and
    /// plain calls from 16 KiB to 16 MiB were as fast or faster at 2 and 4 ranks; 512 KiB
    /// and 1 MiB pipeline too little (`benches/results/2026-11-23b.md`).
    pub shm_slot_bytes: usize,
}

impl Default for AutoTuning {
    fn default() -> Self {
        AutoTuning {
            small_bytes: 64 << 10,
            ring_min_bytes: 256 << 10,
            ring_max_ranks: 8,
            segment_bytes: 256 << 10,
            shm: true,
            shm_min_bytes: 512,
            shm_max_bytes: usize::MAX,
            shm_slot_bytes: 256 << 10,
        }
    }
}

impl AutoTuning {
    /// The slot size the shared-memory allreduce uses: `shm_slot_bytes` rounded up to
    /// whole pages (at least one).
    pub fn shm_slot(&self) -> usize {
        self.shm_slot_bytes.next_multiple_of(4096).max(4096)
    }
}

/// Collective operations over one communicator, with reusable scratch memory.
pub struct Collectives<C: Comm> {
    comm: C,
    pub tuning: AutoTuning,
    scratch: RefCell<AlignedBuf>,
    /// Where a list of buffers is packed for algorithms that take one buffer.
    packed: RefCell<AlignedBuf>,
    /// The shared-memory allreduce, set up by the first allreduce that may use it.
    shm: std::cell::OnceCell<Option<ShmAllreduce>>,
}

/// How long the shared-memory allreduce waits for a rank (unless the transport says).
const SHM_PATIENCE: std::time::Duration = std::time::Duration::from_secs(300);

/// Reinterprets an aligned byte slice as elements.
fn typed<T: Element>(b: &[u8]) -> &[T] {
    // SAFETY: align_to only yields a middle part that is correctly aligned; we require
    // that part to cover the whole slice (all mpiflow buffers are 64-byte aligned and chunk
    // boundaries are element multiples).
    let (head, mid, tail) = unsafe { b.align_to::<T>() };
    assert!(
        head.is_empty() && tail.is_empty(),
        "unaligned reduction buffer"
    );
    mid
}

fn typed_mut<T: Element>(b: &mut [u8]) -> &mut [T] {
    // SAFETY: as in `typed`.
    let (head, mid, tail) = unsafe { b.align_to_mut::<T>() };
    assert!(
        head.is_empty() && tail.is_empty(),
        "unaligned reduction buffer"
    );
    mid
}

fn reduce_typed<T: Element>(op: ReduceOp, acc: &mut [u8], inc: &[u8]) {
    let (acc, inc) = (typed_mut::<T>(acc), typed::<T>(inc));
    match op {
        ReduceOp::Sum | ReduceOp::Average => {
            acc.iter_mut().zip(inc).for_each(|(a, b)| *a = a.add(*b))
        }
        ReduceOp::Min => acc.iter_mut().zip(inc).for_each(|(a, b)| {
            if *b < *a {
                *a = *b
            }
        }),
        ReduceOp::Max => acc.iter_mut().zip(inc).for_each(|(a, b)| {
            if *b > *a {
                *a = *b
            }
        }),
    }
}

/// `acc = acc (op) inc`, element-wise.
pub fn reduce_bytes(dtype: DType, op: ReduceOp, acc: &mut [u8], inc: &[u8]) {
    match dtype {
        DType::F32 => reduce_typed::<f32>(op, acc, inc),
        DType::F64 => reduce_typed::<f64>(op, acc, inc),
        DType::I32 => reduce_typed::<i32>(op, acc, inc),
        DType::I64 => reduce_typed::<i64>(op, acc, inc),
        DType::U8 => reduce_typed::<u8>(op, acc, inc),
    }
}

fn divide_typed<T: Element>(buf: &mut [u8], n: usize) {
    typed_mut::<T>(buf)
        .iter_mut()
        .for_each(|x| *x = x.div_count(n));
}

/// Divides every element by `n` (the second half of an average).
pub fn divide_bytes(dtype: DType, buf: &mut [u8], n: usize) {
    match dtype {
        DType::F32 => divide_typed::<f32>(buf, n),
        DType::F64 => divide_typed::<f64>(buf, n),
        DType::I32 => divide_typed::<i32>(buf, n),
        DType::I64 => divide_typed::<i64>(buf, n),
        DType::U8 => divide_typed::<u8>(buf, n),
    }
}

/// Byte range of chunk `i` of `n` over `elems` elements of `esize` bytes.
fn chunk(i: usize, n: usize, elems: usize, esize: usize) -> std::ops::Range<usize> {
    (i * elems / n) * esize..((i + 1) * elems / n) * esize
}

/// Ring allgather of equal blocks: `out` is `size` blocks of `mine.len()` bytes, by rank.
pub fn allgather_bytes<C: Comm>(c: &C, mine: &[u8], out: &mut [u8]) -> Result<(), TransportError> {
    let (n, r, b) = (c.size(), c.rank(), mine.len());
    assert_eq!(
        out.len(),
        n * b,
        "allgather output must hold one block per rank"
    );
    out[r * b..(r + 1) * b].copy_from_slice(mine);
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n.saturating_sub(1) {
        let send_blk = (r + n - s) % n;
        let recv_blk = (r + n - s - 1) % n;
        let (sb, rb) = disjoint(
            out,
            send_blk * b..(send_blk + 1) * b,
            recv_blk * b..(recv_blk + 1) * b,
        );
        sendrecv(c, sb, right, rb, left, tag(c, Reserved::Allgather))?;
    }
    Ok(())
}

/// Splits `buf` into a shared and a mutable view of two disjoint ranges.
fn disjoint(
    buf: &mut [u8],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[u8], &mut [u8]) {
    assert!(a.end <= b.start || b.end <= a.start, "ranges overlap");
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

impl<C: Comm> Collectives<C> {
    pub fn new(comm: C) -> Self {
        Collectives {
            comm,
            tuning: AutoTuning::default(),
            scratch: RefCell::new(AlignedBuf::zeroed(64)),
            packed: RefCell::new(AlignedBuf::zeroed(64)),
            shm: std::cell::OnceCell::new(),
        }
    }

    pub fn comm(&self) -> &C {
        &self.comm
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// Scratch memory of at least `len` bytes, kept between calls (allocating and faulting
    /// in fresh pages costs as much as a medium allreduce).
    fn scratch(&self, len: usize) -> std::cell::RefMut<'_, AlignedBuf> {
        let mut s = self.scratch.borrow_mut();
        if s.len() < len {
            *s = AlignedBuf::zeroed(len);
        }
        s
    }

    /// `MPI_Barrier`, or a dissemination barrier.
    pub fn barrier(&self) -> Result<(), TransportError> {
        if let Some(r) = self.comm.native_barrier() {
            return r;
        }
        let (n, r) = (self.size(), self.rank());
        let mut k = 1;
        while k < n {
            sendrecv(
                &self.comm,
                &[],
                (r + k) % n,
                &mut [],
                (r + n - k) % n,
                tag(&self.comm, Reserved::Barrier),
            )?;
            k <<= 1;
        }
        Ok(())
    }

    /// Broadcast from `root`: `MPI_Bcast`, or a binomial tree.
    pub fn bcast(&self, buf: &mut [u8], root: usize) -> Result<(), TransportError> {
        if let Some(r) = self.comm.native_bcast(buf, root) {
            return r;
        }
        let (n, r) = (self.size(), self.rank());
        let vr = (r + n - root) % n;
        let mut mask = 1;
        while mask < n {
            if vr & mask != 0 {
                recv(
                    &self.comm,
                    buf,
                    (r + n - mask) % n,
                    tag(&self.comm, Reserved::Bcast),
                )?;
                break;
            }
            mask <<= 1;
        }
        mask >>= 1;
        while mask > 0 {
            if vr + mask < n {
                send(
                    &self.comm,
                    buf,
                    (r + mask) % n,
                    tag(&self.comm, Reserved::Bcast),
                )?;
            }
            mask >>= 1;
        }
        Ok(())
    }

    /// Broadcast of a tensor's payload from `root` (every rank passes a tensor of the same
    /// dtype and shape; the fused-allreduce negotiation is the place that checks lists).
    pub fn bcast_tensor(&self, t: &mut Tensor, root: usize) -> Result<(), TransportError> {
        self.bcast(t.bytes_mut(), root)
    }

    /// Allgather of equal-size blocks.
    pub fn allgather(&self, mine: &[u8], out: &mut [u8]) -> Result<(), TransportError> {
        allgather_bytes(&self.comm, mine, out)
    }

    /// Allgather of byte strings of any length, by rank.
    pub fn allgather_varlen(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, TransportError> {
        let n = self.size();
        let mut lens = vec![0u8; 8 * n];
        self.allgather(&(mine.len() as u64).to_le_bytes(), &mut lens)?;
        let lens: Vec<usize> = lens
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
            .collect();
        let max = lens.iter().copied().max().unwrap_or(0);
        let mut padded = mine.to_vec();
        padded.resize(max, 0);
        let mut all = vec![0u8; max * n];
        self.allgather(&padded, &mut all)?;
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, l)| all[r * max..r * max + l].to_vec())
            .collect())
    }

    /// The shared-memory allreduce, if every rank is on one node. Collective the first
    /// time (it allocates the segments); `None` with one rank.
    fn shm(&self) -> Result<Option<&ShmAllreduce>, TransportError> {
        if let Some(s) = self.shm.get() {
            return Ok(s.as_ref());
        }
        let slot = self.tuning.shm_slot();
        let made = if self.size() > 1 {
            self.comm
                .shared_segments(shm::segment_bytes(slot))?
                .map(|segs| {
                    let patience = self.comm.wait_limit().unwrap_or(SHM_PATIENCE);
                    ShmAllreduce::new(segs, self.rank(), slot, patience)
                })
        } else {
            None
        };
        Ok(self.shm.get_or_init(|| made).as_ref())
    }

    /// Makes the shared-memory allreduce store by `mode` from now on (`None`, the default:
    /// as each rank measures, [`super::stores`]); `false` where there is none. Collective
    /// the first time, like [`Self::choose`]; afterwards local (ranks need not agree).
    pub fn force_shm_stores(&self, mode: Option<StoreMode>) -> Result<bool, TransportError> {
        Ok(self.shm()?.map(|s| s.stores.force(mode)).is_some())
    }

    /// The shared-memory allreduce's recent cost per byte of cached and of streaming
    /// stores on this rank (`None` each until measured); `None` if it has not been made.
    pub fn shm_store_costs(&self) -> Option<(Option<f64>, Option<f64>)> {
        let shm = self.shm.get()?.as_ref()?;
        Some((
            shm.stores.cost(StoreMode::Cached),
            shm.stores.cost(StoreMode::Streaming),
        ))
    }

    /// The algorithm `auto` picks for `bytes` bytes on this communicator (collective the
    /// first time: it finds out whether the ranks share a node).
    pub fn choose(&self, bytes: usize) -> Result<Algorithm, TransportError> {
        let native = self.comm.has_native();
        let t = &self.tuning;
        Ok(if self.size() <= 1 {
            Algorithm::RecursiveDoubling
        } else if t.shm
            && self.shm()?.is_some_and(|s| {
                s.oversubscribed()
                    || (bytes >= t.shm_min_bytes || !native)
                        && (bytes <= t.shm_max_bytes || self.size() > t.ring_max_ranks)
            })
        {
            Algorithm::Shm
        } else if bytes >= t.ring_min_bytes && self.size() <= t.ring_max_ranks {
            Algorithm::Ring
        } else if bytes < t.small_bytes && !native {
            Algorithm::RecursiveDoubling
        } else if native {
            Algorithm::Mpi
        } else {
            Algorithm::Ring
        })
    }

    /// The algorithm that runs when `algo` is asked for: `auto` chosen by size, `shm`
    /// only where the ranks share a node (otherwise as `auto`).
    fn resolve(&self, algo: Algorithm, bytes: usize) -> Result<Algorithm, TransportError> {
        match algo {
            Algorithm::Auto => self.choose(bytes),
            // Not on one node (or one rank): whatever auto picks among the others.
            Algorithm::Shm if self.shm()?.is_none() => self.choose(bytes),
            a => Ok(a),
        }
    }

    /// In-place allreduce of `buf` (elements of `dtype`, 64-byte aligned). Returns the
    /// algorithm that ran.
    pub fn allreduce(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
    ) -> Result<Algorithm, TransportError> {
        self.allreduce_parts(&mut [buf], dtype, op, algo)
    }

    /// Allreduce of a list of buffers as one message (their concatenation), in place:
    /// the shared-memory algorithm streams straight from and into them, the others pack
    /// them into one buffer first. Each part holds whole elements of `dtype`.
    pub fn allreduce_parts(
        &self,
        parts: &mut [&mut [u8]],
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
    ) -> Result<Algorithm, TransportError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let algo = self.resolve(algo, total)?;
        if algo == Algorithm::Shm {
            let shm = self.shm()?.expect("resolve picks shm only where it exists");
            shm.allreduce(parts, dtype, op)?;
            return Ok(algo);
        }
        if let [one] = parts {
            self.allreduce_one(one, dtype, op, algo)?;
            return Ok(algo);
        }
        let mut packed = self.packed.borrow_mut();
        if packed.len() < total {
            *packed = AlignedBuf::zeroed(total);
        }
        let buf = &mut packed.as_mut_slice()[..total];
        let mut stream = shm::Stream::new(parts);
        stream.read_into(0, buf, StoreMode::Cached);
        self.allreduce_one(buf, dtype, op, algo)?;
        stream.write_from(0, buf);
        Ok(algo)
    }

    /// One buffer by a message-passing algorithm.
    fn allreduce_one(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
    ) -> Result<(), TransportError> {
        let n = self.size();
        match algo {
            Algorithm::Mpi => match self.comm.native_allreduce(buf, dtype, op) {
                Some(r) => r?,
                None => self.ring(buf, dtype, op)?,
            },
            Algorithm::Ring | Algorithm::Shm => self.ring(buf, dtype, op)?,
            Algorithm::RecursiveDoubling | Algorithm::Auto => {
                self.recursive_doubling(buf, dtype, op)?
            }
        }
        if op == ReduceOp::Average && n > 1 {
            divide_bytes(dtype, buf, n);
        }
        Ok(())
    }

    /// Allreduce of a whole tensor.
    pub fn allreduce_tensor(
        &self,
        t: &mut Tensor,
        op: ReduceOp,
        algo: Algorithm,
    ) -> Result<Algorithm, TransportError> {
        let dtype = t.dtype();
        self.allreduce(t.bytes_mut(), dtype, op, algo)
    }

    fn ring(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), TransportError> {
        let (n, r, es) = (self.size(), self.rank(), dtype.size());
        if n == 1 {
            return Ok(());
        }
        let elems = buf.len() / es;
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        let seg = (self.tuning.segment_bytes / es).max(1) * es;
        let max_chunk = chunk(0, n, elems, es).len() + es;
        let mut scratch = self.scratch(max_chunk);
        let c = &self.comm;
        let ring_tag = tag(c, Reserved::Ring);
        // Reduce-scatter: after n-1 steps rank r holds the full reduction of chunk r+1.
        for s in 0..n - 1 {
            let send_c = chunk((r + n - s) % n, n, elems, es);
            let recv_c = chunk((r + n - s - 1) % n, n, elems, es);
            let incoming = &mut scratch.as_mut_slice()[..recv_c.len()];
            let segs_in: Vec<(usize, usize)> = (0..recv_c.len())
                .step_by(seg)
                .map(|o| (o, seg.min(recv_c.len() - o)))
                .collect();
            let mut recvs = Vec::with_capacity(segs_in.len());
            for (o, l) in &segs_in {
                // SAFETY: each segment is a disjoint part of `incoming`, not touched until
                // its request is waited on below; all requests are waited on.
                recvs.push(unsafe { c.irecv(incoming.as_mut_ptr().add(*o), *l, left, ring_tag)? });
            }
            let mut sends = Vec::new();
            for o in (0..send_c.len()).step_by(seg) {
                let l = seg.min(send_c.len() - o);
                // SAFETY: the send chunk is disjoint from the receive chunk being reduced
                // (different chunk indices) and is not modified before the sends complete.
                sends.push(unsafe {
                    c.isend(buf.as_ptr().add(send_c.start + o), l, right, ring_tag)?
                });
            }
            for ((o, l), req) in segs_in.iter().zip(recvs) {
                c.wait(req)?;
                let dst = &mut buf[recv_c.start + o..recv_c.start + o + l];
                reduce_bytes(dtype, op, dst, &incoming[*o..o + l]);
            }
            for s in sends {
                c.wait(s)?;
            }
        }
        // Allgather of the reduced chunks, straight into place.
        for s in 0..n - 1 {
            let send_c = chunk((r + 1 + n - s) % n, n, elems, es);
            let recv_c = chunk((r + n - s) % n, n, elems, es);
            let (sb, rb) = disjoint(buf, send_c, recv_c);
            sendrecv(c, sb, right, rb, left, ring_tag)?;
        }
        Ok(())
    }

    fn recursive_doubling(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), TransportError> {
        let (n, r) = (self.size(), self.rank());
        if n == 1 {
            return Ok(());
        }
        let c = &self.comm;
        let p = 1 << (usize::BITS - 1 - n.leading_zeros()); // largest power of two <= n
        let rem = n - p;
        let mut scratch = self.scratch(buf.len());
        let tmp = &mut scratch.as_mut_slice()[..buf.len()];
        // Fold: among the first 2*rem ranks, evens hand their data to the next odd rank.
        let vrank = if r < 2 * rem {
            if r % 2 == 0 {
                send(c, buf, r + 1, tag(c, Reserved::RecursiveDoubling))?;
                None
            } else {
                recv(c, tmp, r - 1, tag(c, Reserved::RecursiveDoubling))?;
                reduce_bytes(dtype, op, buf, tmp);
                Some(r / 2)
            }
        } else {
            Some(r - rem)
        };
        if let Some(v) = vrank {
            let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
            let mut mask = 1;
            while mask < p {
                let partner = real(v ^ mask);
                sendrecv(
                    c,
                    buf,
                    partner,
                    tmp,
                    partner,
                    tag(c, Reserved::RecursiveDoubling),
                )?;
                reduce_bytes(dtype, op, buf, tmp);
                mask <<= 1;
            }
        }
        // Unfold: odd ranks give the result back to their even partner.
        if r < 2 * rem {
            if r % 2 == 0 {
                recv(c, buf, r + 1, tag(c, Reserved::RecursiveDoubling))?;
            } else {
                send(c, buf, r - 1, tag(c, Reserved::RecursiveDoubling))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::local::LocalComm;
    use super::*;

    fn input(rank: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((rank * 31 + i * 7) % 97) as f32 * 0.37 - 11.0)
            .collect()
    }

    #[test]
    fn allreduce_algorithms_agree_with_a_serial_sum() {
        for n in 1..=6 {
            for len in [1usize, 2, 5, 7, 64, 1000, 4097] {
                for algo in [
                    Algorithm::Ring,
                    Algorithm::RecursiveDoubling,
                    Algorithm::Shm,
                    Algorithm::Auto,
                ] {
                    let out = LocalComm::run(n, |c| {
                        let mut coll = Collectives::new(c);
                        coll.tuning.segment_bytes = 64; // many segments even for small tests
                        coll.tuning.shm_slot_bytes = 4096; // many chunks, slots reused
                        let mut t = Tensor::from_slice(&[len], &input(coll.rank(), len)).unwrap();
                        coll.allreduce_tensor(&mut t, ReduceOp::Sum, algo).unwrap();
                        t.as_slice::<f32>().unwrap().to_vec()
                    });
                    for o in &out {
                        assert_eq!(
                            o.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            out[0].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            "identical bits, n={n} len={len} {algo:?}"
                        );
                    }
                    for (i, got) in out[0].iter().enumerate() {
                        let want: f64 = (0..n).map(|r| input(r, len)[i] as f64).sum();
                        assert!(
                            (*got as f64 - want).abs() < 1e-3,
                            "n={n} len={len} {algo:?} i={i}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_op_and_dtype() {
        let out = LocalComm::run(3, |c| {
            let coll = Collectives::new(c);
            let r = coll.rank() as i64;
            let mut res = Vec::new();
            for op in [
                ReduceOp::Sum,
                ReduceOp::Average,
                ReduceOp::Min,
                ReduceOp::Max,
            ] {
                for algo in [
                    Algorithm::Ring,
                    Algorithm::RecursiveDoubling,
                    Algorithm::Shm,
                ] {
                    let mut a = Tensor::from_slice(&[3], &[r, 10 - r, r * r]).unwrap();
                    coll.allreduce_tensor(&mut a, op, algo).unwrap();
                    let mut b = Tensor::from_slice(&[2], &[r as f64 + 0.5, -(r as f64)]).unwrap();
                    coll.allreduce_tensor(&mut b, op, algo).unwrap();
                    let mut u = Tensor::from_slice(&[1], &[r as u8 * 100]).unwrap();
                    coll.allreduce_tensor(&mut u, op, algo).unwrap();
                    res.push((
                        op,
                        a.as_slice::<i64>().unwrap().to_vec(),
                        b.as_slice::<f64>().unwrap().to_vec(),
                        u.as_slice::<u8>().unwrap()[0],
                    ));
                }
            }
            res
        });
        for (op, a, b, u) in &out[0] {
            let (wa, wb, wu): (Vec<i64>, Vec<f64>, u8) = match op {
                ReduceOp::Sum => (vec![3, 27, 5], vec![4.5, -3.0], 44), // 0+100+200 wraps to 44
                ReduceOp::Average => (vec![1, 9, 1], vec![1.5, -1.0], 14),
                ReduceOp::Min => (vec![0, 8, 0], vec![0.5, -2.0], 0),
                ReduceOp::Max => (vec![2, 10, 4], vec![2.5, 0.0], 200),
            };
            assert_eq!((a, b, *u), (&wa, &wb, wu), "{op:?}");
        }
        assert!(out.iter().all(|o| o == &out[0]));
    }

    #[test]
    fn parts_reduce_as_one_message_across_chunks() {
        // 3 ranks, parts of odd lengths (one empty) crossing 4 KiB chunks and slot reuse;
        // then 64 KiB slots, where a rank's sub-slice of one chunk spans several parts.
        let lens = [1usize, 1500, 0, 3001, 7, 2048, 9000];
        let run = |algo: Algorithm, slot: usize, stores: Option<StoreMode>| {
            LocalComm::run(3, move |c| {
                // A fresh communicator per slot size: the segments are made once.
                let mut coll = Collectives::new(c);
                coll.tuning.shm_slot_bytes = slot;
                coll.force_shm_stores(stores).unwrap();
                let r = coll.rank();
                let mut ts: Vec<Tensor> = lens
                    .iter()
                    .enumerate()
                    .map(|(k, &l)| Tensor::from_slice(&[l], &input(r + 10 * k, l)).unwrap())
                    .collect();
                let mut parts: Vec<&mut [u8]> = ts.iter_mut().map(|t| t.bytes_mut()).collect();
                let ran = coll
                    .allreduce_parts(&mut parts, DType::F32, ReduceOp::Average, algo)
                    .unwrap();
                assert_eq!(ran, algo);
                ts.iter()
                    .map(|t| t.as_slice::<f32>().unwrap().to_vec())
                    .collect::<Vec<_>>()
            })
        };
        let runs = [
            run(Algorithm::Shm, 4096, Some(StoreMode::Cached)),
            run(Algorithm::Shm, 64 << 10, Some(StoreMode::Cached)),
            run(Algorithm::Shm, 4096, Some(StoreMode::Streaming)),
            run(Algorithm::Shm, 64 << 10, Some(StoreMode::Streaming)),
            run(Algorithm::Shm, 4096, None),
            run(Algorithm::Ring, 4096, None),
        ];
        for (k, &l) in lens.iter().enumerate() {
            for i in 0..l {
                let want: f64 = (0..3).map(|r| input(r + 10 * k, l)[i] as f64).sum::<f64>() / 3.0;
                for (j, out) in runs.iter().enumerate() {
                    for rank in out {
                        let got = rank[k][i] as f64;
                        assert!((got - want).abs() < 1e-4, "run {j} part {k} elem {i}");
                    }
                }
            }
        }
        // Shared memory: one rank reduces each element, so all ranks hold the same bits,
        // and the same whichever stores carried them (for one slot size: the slot size
        // decides which rank reduces an element, so the order of operands).
        for (i, out) in runs[..5].iter().enumerate() {
            let first = &runs[i % 2][0];
            assert!(out.iter().all(|o| o == first), "run {i}");
        }
    }

    #[test]
    fn shm_mismatch_is_the_same_error_everywhere_and_later_calls_work() {
        let out = LocalComm::run(3, |c| {
            let coll = Collectives::new(c);
            let r = coll.rank();
            let len = if r == 2 { 5 } else { 4 };
            let mut t = Tensor::from_slice(&[len], &vec![1f32; len]).unwrap();
            let e = coll
                .allreduce_tensor(&mut t, ReduceOp::Sum, Algorithm::Shm)
                .unwrap_err()
                .to_string();
            let e = e.replacen(&format!("rank {r}: "), "rank R: ", 1);
            let mut ok = Tensor::from_slice(&[70000], &vec![r as f32; 70000]).unwrap();
            coll.allreduce_tensor(&mut ok, ReduceOp::Max, Algorithm::Shm)
                .unwrap();
            (e, ok.as_slice::<f32>().unwrap()[69999])
        });
        for o in &out {
            assert_eq!(
                o,
                &(
                    "rank R: allreduce mismatch: rank 2 passed 20 bytes of f32 (sum) \
                     where rank 0 passed 16 bytes of f32 (sum)"
                        .to_string(),
                    2.0
                )
            );
        }
    }

    #[test]
    fn shm_names_a_rank_that_never_comes() {
        let comms = LocalComm::create(2, std::time::Duration::from_millis(300));
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let coll = Collectives::new(c);
                        // Both set the segments up; then rank 1 skips the allreduce.
                        coll.shm().unwrap();
                        let mut t = Tensor::from_slice(&[8], &[1f64; 8]).unwrap();
                        if coll.rank() == 0 {
                            coll.allreduce_tensor(&mut t, ReduceOp::Sum, Algorithm::Shm)
                                .unwrap_err()
                                .to_string()
                        } else {
                            String::new()
                        }
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(
            errs[0],
            "rank 0: rank 1 did not reach the shared-memory allreduce within 0.3 s"
        );
    }

    #[test]
    fn bcast_allgather_barrier() {
        for n in 1..=5 {
            let out = LocalComm::run(n, |c| {
                let coll = Collectives::new(c);
                let r = coll.rank();
                coll.barrier().unwrap();
                let mut b = if r == n - 1 {
                    vec![7u8, 8, 9]
                } else {
                    vec![0u8; 3]
                };
                coll.bcast(&mut b, n - 1).unwrap();
                let mut all = vec![0u8; 2 * n];
                coll.allgather(&[r as u8, 1], &mut all).unwrap();
                let var = coll.allgather_varlen(&vec![r as u8; r]).unwrap();
                (b, all, var)
            });
            for (b, all, var) in out {
                assert_eq!(b, [7, 8, 9]);
                assert_eq!(all, (0..n).flat_map(|r| [r as u8, 1]).collect::<Vec<_>>());
                assert_eq!(var, (0..n).map(|r| vec![r as u8; r]).collect::<Vec<_>>());
            }
        }
    }
}
