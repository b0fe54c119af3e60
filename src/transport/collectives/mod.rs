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
//! - `shm`: through memory shared by the ranks of one node ([`shm`]): what peers
//!   reduce is copied once into a slot, each rank reduces its sub-slice in place and
//!   publishes it, peers copy it out; pipelined in 256 KiB chunks; one step for calls up to
//!   16 KiB. Where ranks span nodes, `shm` runs as `auto` among the others.
//! - `hierarchical`: across nodes, the ranks of each node reduce through shared memory, one
//!   leader per node allreduces with the other leaders, and broadcasts inside its node
//!   ([`hierarchical`]); on one node it runs as `auto`.
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

pub mod hierarchical;
mod recursive_doubling;
mod ring;
pub mod shm;
pub mod stores;
mod tuning;

pub use tuning::{Algorithm, AutoTuning};

use self::hierarchical::Hierarchy;
use self::shm::ShmAllreduce;
use self::stores::StoreMode;
use super::comm::{recv, send, sendrecv, Comm, ReduceOp, TransportError};
use super::reduce::divide_bytes;
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
    /// as each rank measures, [`stores`]); `false` where there is none. Collective
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
                // auto runs without one (recursive doubling below `small_bytes`: 0.37-0.52
                // us against the ring's 0.58-0.94 at 1-256 bytes).
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
            for op in ReduceOp::ALL {
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
    fn hierarchical_across_nodes_equals_a_serial_sum_with_identical_bits() {
        // Nodes of equal and unequal size, leaders not rank-ordered by node, one rank per
        // node; every op that divides or wraps.
        for nodes in [
            &[0, 0, 1, 1][..],
            &[0, 0, 0, 1],
            &[1, 0, 1, 0, 2],
            &[0, 1, 2],
        ] {
            for len in [1usize, 7, 4097, 70000] {
                let out = LocalComm::run_on_nodes(nodes, |c| {
                    let mut coll = Collectives::new(c);
                    coll.tuning.segment_bytes = 4096;
                    coll.tuning.ring_min_bytes = 8192; // the leaders' ring for the largest
                    let r = coll.rank();
                    let mut t = Tensor::from_slice(&[len], &input(r, len)).unwrap();
                    let ran = coll
                        .allreduce_tensor(&mut t, ReduceOp::Average, Algorithm::Hierarchical)
                        .unwrap();
                    let mut w =
                        Tensor::from_slice(&[3], &[(r as u8).wrapping_mul(100), 1, r as u8])
                            .unwrap();
                    coll.allreduce_tensor(&mut w, ReduceOp::Sum, Algorithm::Hierarchical)
                        .unwrap();
                    let mut m = Tensor::from_slice(&[2], &[r as i64, -(r as i64)]).unwrap();
                    coll.allreduce_tensor(&mut m, ReduceOp::Max, Algorithm::Hierarchical)
                        .unwrap();
                    (
                        ran,
                        t.as_slice::<f32>().unwrap().to_vec(),
                        w.as_slice::<u8>().unwrap().to_vec(),
                        m.as_slice::<i64>().unwrap().to_vec(),
                    )
                });
                let n = nodes.len();
                for (ran, avg, wrapped, max) in &out {
                    assert_eq!(*ran, Algorithm::Hierarchical, "{nodes:?}");
                    assert_eq!(
                        avg.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        out[0].1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "identical bits on {nodes:?}, len {len}"
                    );
                    let sum: usize = (0..n).map(|r| r * 100).sum();
                    let ids: usize = (0..n).sum();
                    assert_eq!(wrapped, &[(sum % 256) as u8, n as u8, ids as u8]);
                    assert_eq!(max, &[n as i64 - 1, 0]);
                }
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, len)).collect();
                for (i, got) in out[0].1.iter().enumerate() {
                    let want = inputs.iter().map(|x| x[i] as f64).sum::<f64>() / n as f64;
                    assert!(
                        (*got as f64 - want).abs() < 1e-4,
                        "{nodes:?} len {len} i {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn auto_goes_hierarchical_across_nodes_from_its_threshold_and_never_on_one_node() {
        let picks = |nodes: &[usize]| {
            LocalComm::run_on_nodes(nodes, |c| {
                let coll = Collectives::new(c);
                let min = coll.tuning.hierarchical_min_bytes;
                (coll.choose(min - 4).unwrap(), coll.choose(min).unwrap())
            })
        };
        for p in picks(&[0, 0, 1, 1]) {
            assert_ne!(p.0, Algorithm::Hierarchical);
            assert_eq!(p.1, Algorithm::Hierarchical);
        }
        // One rank per node: nothing to gain from a second level.
        for p in picks(&[0, 1, 2]) {
            assert_eq!(p.1, Algorithm::RecursiveDoubling);
        }
        // One node: shared memory, and `hierarchical` asked for runs as that.
        for p in picks(&[0, 0, 0]) {
            assert_eq!(p.1, Algorithm::Shm);
        }
        let ran = LocalComm::run(3, |c| {
            let coll = Collectives::new(c);
            let mut t = Tensor::from_slice(&[300000], &vec![1f32; 300000]).unwrap();
            coll.allreduce_tensor(&mut t, ReduceOp::Sum, Algorithm::Hierarchical)
                .unwrap()
        });
        assert!(ran.iter().all(|a| *a == Algorithm::Shm), "{ran:?}");
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
