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
//! - `shm`: through memory shared by the ranks of one node (`shm`): what peers
//!   reduce is copied once into a slot, each rank reduces its sub-slice in place and
//!   publishes it, peers copy it out; pipelined in 256 KiB chunks; one step for calls up to
//!   16 KiB. Where ranks span nodes, `shm` runs as `auto` among the others.
//! - `hierarchical`: across nodes, the ranks of each node reduce through shared memory, one
//!   leader per node allreduces with the other leaders, and broadcasts inside its node
//!   (`hierarchical`); on one node it runs as `auto`.
//! - `auto` (default): by size, rank count and placement, from the thresholds in
//!   [`AutoTuning`]. All ranks on one node with a core each: `shm` from 512 B up, the
//!   library's own below; more ranks than cores: `shm` at every size. Across nodes: the
//!   ring from 256 KiB at up to 8 ranks, the library's own below (where each was faster
//!   than the library's `MPI_Allreduce`: `benches/results/`). Re-measure on other
//!   machines with
//!   `mpiflow bench allreduce --algorithm shm` (and `ring`, `recursive-doubling`).
//!
//! Every rank ends with identical bits: each element is reduced along one chain (ring), by
//! both partners from the same two operands (recursive doubling, where `a + b == b + a`
//! holds exactly in IEEE arithmetic), or by one rank, or by all in rank order (shm).

use std::cell::RefCell;

pub(crate) mod hierarchical;
mod recursive_doubling;
mod ring;
pub(crate) mod shm;
pub(crate) mod stores;
mod symmetric;
mod tuning;

pub use tuning::{Algorithm, AutoTuning};

use self::hierarchical::Hierarchy;
use self::shm::ShmAllreduce;
use self::stores::StoreMode;
use super::comm::{recv, send, sendrecv, Comm, ReduceOp, TransportError};
use super::reduce::divide_bytes;
use super::symmetric::Regions;
use super::tags::Reserved;
use crate::tensor::{AlignedBuf, DType, Tensor};

/// The tag of one kind of collective traffic: reserved at the top of the communicator's
/// tag range, above any caller's tag.
fn tag<C: Comm>(c: &C, r: Reserved) -> i32 {
    c.tags().reserved(r)
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
    /// The node and leader communicators, set up by the first allreduce across nodes.
    hierarchy: std::cell::OnceCell<Option<Box<Hierarchy<C>>>>,
    /// The symmetric memory made over this communicator ([`Collectives::symmetric`]).
    regions: Regions,
}

/// How long the shared-memory allreduce waits for a rank (unless the transport says).
const SHM_PATIENCE: std::time::Duration = std::time::Duration::from_secs(300);

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
            hierarchy: std::cell::OnceCell::new(),
            regions: Regions::default(),
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

    /// Broadcast of a byte string of any length from `root` (`mine` is read there only).
    pub fn bcast_varlen(&self, mine: Vec<u8>, root: usize) -> Result<Vec<u8>, TransportError> {
        let mut len = (mine.len() as u64).to_le_bytes();
        self.bcast(&mut len, root)?;
        let mut buf = if self.rank() == root {
            mine
        } else {
            vec![0u8; u64::from_le_bytes(len) as usize]
        };
        self.bcast(&mut buf, root)?;
        Ok(buf)
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

    /// The two levels of a communicator across nodes, `None` on one node. Collective the
    /// first time (it splits the communicator).
    fn hierarchy(&self) -> Result<Option<&Hierarchy<C>>, TransportError> {
        if let Some(h) = self.hierarchy.get() {
            return Ok(h.as_deref());
        }
        let made = if self.size() > 1 {
            Hierarchy::build(self)?
        } else {
            None
        };
        Ok(self.hierarchy.get_or_init(|| made).as_deref())
    }

    /// Makes the shared-memory allreduce store by `mode` from now on (`None`, the default:
    /// as each rank measures, `stores`); `false` where there is none. Collective
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
            match parts {
                [one] => match self.symmetric_call(shm, None, one, dtype, op) {
                    Some(done) => done?,
                    None => shm.allreduce(parts, dtype, op)?,
                },
                _ => shm.allreduce(parts, dtype, op)?,
            }
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

    /// The allreduce of `src` into `dst` (as long; they do not overlap), `src` left as it
    /// is: [`Collectives::allreduce`] of a copy of `src` in `dst`, the same bits. The
    /// shared-memory algorithm reads `src` where it is and reduces straight into `dst`;
    /// the others copy first.
    pub fn allreduce_into(
        &self,
        src: &[u8],
        dst: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
    ) -> Result<Algorithm, TransportError> {
        assert_eq!(src.len(), dst.len(), "allreduce_into: src and dst lengths");
        let algo = self.resolve(algo, src.len())?;
        if algo == Algorithm::Shm {
            let shm = self.shm()?.expect("resolve picks shm only where it exists");
            match self.symmetric_call(shm, Some(src), dst, dtype, op) {
                Some(done) => done?,
                None => shm.allreduce_into(src, dst, dtype, op)?,
            }
            return Ok(algo);
        }
        dst.copy_from_slice(src);
        self.allreduce_one(dst, dtype, op, algo)?;
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
            Algorithm::Hierarchical => {
                if let Some(h) = self.hierarchy()? {
                    // Divides an average itself, once.
                    return h.allreduce(buf, dtype, op);
                }
                self.ring(buf, dtype, op)?
            }
            Algorithm::Mpi => match self.comm.native_allreduce(buf, dtype, op) {
                Some(r) => r?,
                // No native allreduce for this dtype (8-bit: see `native_allreduce`): what
                // auto runs without one (recursive doubling below `small_bytes`, where it
                // takes fewer rounds than the ring).
                None => return self.allreduce_one(buf, dtype, op, self.by_messages(buf.len())),
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
}

#[cfg(test)]
mod tests;
