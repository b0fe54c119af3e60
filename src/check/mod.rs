//! `mpiflow check`: verifies the data plane on the job it runs in.
//!
//! Under `mpirun` (any number of ranks) every rank runs the same list of checks, with
//! inputs every rank can recompute for every other rank:
//! - point-to-point (module `p2p`): a ring of tensors by rank and by task, a deliberately
//!   mismatched receive that must fail naming both tensors, links that follow changes, and
//!   a stream through a channel's inbox;
//! - allreduce for every dtype, op and algorithm at sizes 1, 7, 1000 and 65 537 elements,
//!   compared with a serial reduction (exact for integers, min and max; within float
//!   rounding for sums of floats), with a digest of the result bits that must be equal on
//!   all ranks; the shared-memory allreduce again with cached and with streaming stores;
//! - broadcast, allgather, barrier, a fused allreduce of ten named tensors, and an
//!   allreduce within each job's own communicator (split by job).
//!
//! Each rank prints one JSON line: rank, checks run, digest, the tag bound, failures.

use serde_json::json;

mod p2p;

use crate::cluster::Layout;
use crate::tensor::{DType, Element, Tensor};
use crate::transport::collectives::stores::StoreMode;
use crate::transport::fusion::Fusion;
use crate::transport::{Algorithm, Collectives, Comm, ReduceOp};

/// The outcome on one rank.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub checks: usize,
    pub digest: u64,
    pub failures: Vec<String>,
    /// Whether `--algorithm shm` ran through shared memory (all ranks on one node).
    pub shm: Option<bool>,
    /// Whether `--algorithm hierarchical` ran in two levels (ranks on several nodes).
    pub hierarchical: Option<bool>,
    /// Whether both of this rank's channels of the ring stream were on rings in shared
    /// memory (ranks of one node with room in it).
    pub rings: Option<bool>,
    /// Whether the link stream's link from the left neighbour took a ring in shared
    /// memory (ranks of one node).
    pub link_rings: Option<bool>,
    /// The tag bound every scheme ran under (`MPI_TAG_UB`, or `MPIFLOW_TAG_UB`).
    pub tag_ub: i32,
}

impl Report {
    fn expect(&mut self, ok: bool, what: impl FnOnce() -> String) {
        self.checks += 1;
        if !ok {
            self.failures.push(what());
        }
    }

    fn absorb(&mut self, bytes: &[u8]) {
        self.digest = crate::hash::fnv1a_from(self.digest ^ crate::hash::FNV_OFFSET, bytes);
    }

    /// One JSON line.
    pub fn json(&self, rank: usize, size: usize) -> String {
        json!({"rank": rank, "size": size, "checks": self.checks, "digest": format!("{:016x}", self.digest), "shm": self.shm, "hierarchical": self.hierarchical, "rings": self.rings, "link_rings": self.link_rings, "tag_ub": self.tag_ub, "failures": self.failures}).to_string()
    }
}

/// Rank `r`'s deterministic input value at index `i`, as f64 (exact in every dtype used).
fn input(r: usize, i: usize) -> f64 {
    (((r * 37 + i * 11) % 23) as f64) - 7.0
}

fn values<T: Element>(r: usize, n: usize, conv: impl Fn(f64) -> T) -> Vec<T> {
    (0..n).map(|i| conv(input(r, i))).collect()
}

fn expected(op: ReduceOp, ranks: &[usize], i: usize, dtype: DType) -> f64 {
    let xs = ranks.iter().map(|r| input(*r, i));
    let conv = |x: f64| {
        if dtype == DType::U8 {
            (x as i64).rem_euclid(256) as f64
        } else {
            x
        }
    };
    match op {
        ReduceOp::Sum | ReduceOp::Average => {
            let s: f64 = xs.map(conv).sum();
            let s = if dtype == DType::U8 {
                s.rem_euclid(256.0)
            } else {
                s
            };
            if op == ReduceOp::Average {
                let n = ranks.len() as f64;
                if matches!(dtype, DType::F32 | DType::F64) {
                    s / n
                } else {
                    (s / n).trunc()
                }
            } else {
                s
            }
        }
        ReduceOp::Min => xs.map(conv).fold(f64::INFINITY, f64::min),
        ReduceOp::Max => xs.map(conv).fold(f64::NEG_INFINITY, f64::max),
    }
}

pub(crate) fn tensor_of(dtype: DType, r: usize, n: usize) -> Tensor {
    let shape = [n];
    match dtype {
        DType::F32 => Tensor::from_slice(&shape, &values(r, n, |x| x as f32)),
        DType::F64 => Tensor::from_slice(&shape, &values(r, n, |x| x)),
        DType::I32 => Tensor::from_slice(&shape, &values(r, n, |x| x as i32)),
        DType::I64 => Tensor::from_slice(&shape, &values(r, n, |x| x as i64)),
        DType::U8 => {
            Tensor::from_slice(&shape, &values(r, n, |x| (x as i64).rem_euclid(256) as u8))
        }
    }
    .expect("shape matches")
}

fn as_f64(t: &Tensor) -> Vec<f64> {
    match t.dtype() {
        DType::F32 => t
            .as_slice::<f32>()
            .map(|s| s.iter().map(|x| f64::from(*x)).collect()),
        DType::F64 => t.as_slice::<f64>().map(<[f64]>::to_vec),
        DType::I32 => t
            .as_slice::<i32>()
            .map(|s| s.iter().map(|x| f64::from(*x)).collect()),
        DType::I64 => t
            .as_slice::<i64>()
            .map(|s| s.iter().map(|x| *x as f64).collect()),
        DType::U8 => t
            .as_slice::<u8>()
            .map(|s| s.iter().map(|x| f64::from(*x)).collect()),
    }
    .expect("dtype matches")
}

/// Checks one allreduce result against the serial reduction over `ranks`.
fn check_reduced(rep: &mut Report, label: &str, t: &Tensor, op: ReduceOp, ranks: &[usize]) {
    let got = as_f64(t);
    let float = matches!(t.dtype(), DType::F32 | DType::F64);
    let bad = got.iter().enumerate().find(|(i, g)| {
        let want = expected(op, ranks, *i, t.dtype());
        let tol = if float {
            1e-4 * (1.0 + want.abs())
        } else {
            0.0
        };
        (**g - want).abs() > tol
    });
    rep.expect(bad.is_none(), || {
        let (i, g) = bad.expect("failed");
        format!(
            "{label}: element {i} is {g}, expected {}",
            expected(op, ranks, i, t.dtype())
        )
    });
    rep.absorb(label.as_bytes());
    rep.absorb(t.bytes());
}

/// Runs every check on this rank (collective over `coll`).
///
/// `mismatch_rank`: that rank submits its fused list in another order, to exercise the
/// negotiation's error path (every rank must then fail with the same message).
pub fn run<C: Comm>(
    coll: &Collectives<C>,
    layout: &Layout,
    mismatch_rank: Option<usize>,
) -> Result<Report, String> {
    let (n, r) = (coll.size(), coll.rank());
    let c = coll.comm();
    let mut rep = Report::default();
    let all: Vec<usize> = (0..n).collect();
    let e = |x: &dyn std::fmt::Display| x.to_string();

    rep.tag_ub = c.tags().ub();
    p2p::run(c, layout, &mut rep)?;
    let me = &layout.ranks[r].task;

    // Allreduce: every dtype, op, algorithm, and awkward sizes.
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            for algo in Algorithm::all() {
                for len in [1usize, 7, 1000, 65537] {
                    let mut t = tensor_of(dtype, r, len);
                    let ran = coll.allreduce_tensor(&mut t, op, algo).map_err(|x| e(&x))?;
                    if algo == Algorithm::Shm && n > 1 {
                        rep.shm = Some(ran == Algorithm::Shm);
                    }
                    if algo == Algorithm::Hierarchical && n > 1 {
                        rep.hierarchical = Some(ran == Algorithm::Hierarchical);
                    }
                    check_reduced(
                        &mut rep,
                        &format!("allreduce {dtype} {op:?} {algo:?} {len}"),
                        &t,
                        op,
                        &all,
                    );
                }
            }
        }
    }

    // The shared-memory allreduce with either kind of store forced (it otherwise picks by
    // measuring, so a run need not exercise both).
    for mode in [StoreMode::Cached, StoreMode::Streaming] {
        if !coll.force_shm_stores(Some(mode)).map_err(|x| e(&x))? {
            break;
        }
        for dtype in [DType::F32, DType::F64, DType::I32] {
            for op in [ReduceOp::Sum, ReduceOp::Average] {
                for len in [1000usize, 65537] {
                    let mut t = tensor_of(dtype, r, len);
                    coll.allreduce_tensor(&mut t, op, Algorithm::Shm)
                        .map_err(|x| e(&x))?;
                    let what = format!("allreduce {dtype} {op:?} shm {mode:?} stores {len}");
                    check_reduced(&mut rep, &what, &t, op, &all);
                }
            }
        }
        coll.force_shm_stores(None).map_err(|x| e(&x))?;
    }

    // Broadcast from the last rank, allgather, barrier.
    let mut b = if r == n - 1 {
        tensor_of(DType::F64, 99, 333)
    } else {
        Tensor::zeros(DType::F64, &[333]).map_err(|x| e(&x))?
    };
    coll.bcast_tensor(&mut b, n - 1).map_err(|x| e(&x))?;
    rep.expect(b.bytes() == tensor_of(DType::F64, 99, 333).bytes(), || {
        "bcast: data differs".into()
    });
    rep.absorb(b.bytes());
    let mut all_bytes = vec![0u8; 3 * n];
    coll.allgather(&[r as u8, 7, (r * 3) as u8], &mut all_bytes)
        .map_err(|x| e(&x))?;
    let want: Vec<u8> = (0..n).flat_map(|q| [q as u8, 7, (q * 3) as u8]).collect();
    rep.expect(all_bytes == want, || format!("allgather: {all_bytes:?}"));
    rep.absorb(&all_bytes);
    coll.barrier().map_err(|x| e(&x))?;

    // Fused allreduce of ten named tensors of two dtypes.
    let mut grads: Vec<Tensor> = (0..10)
        .map(|i| {
            tensor_of(
                if i % 3 == 0 { DType::F64 } else { DType::F32 },
                r,
                50 + i * 13,
            )
            .named(&format!("grad/{i}"))
        })
        .collect();
    if mismatch_rank == Some(r) {
        grads.swap(1, 2);
    }
    let mut refs: Vec<&mut Tensor> = grads.iter_mut().collect();
    Fusion::default()
        .allreduce(coll, &mut refs, ReduceOp::Average)
        .map_err(|x| e(&x))?;
    for (i, g) in grads.iter().enumerate() {
        check_reduced(
            &mut rep,
            &format!("fused grad/{i}"),
            g,
            ReduceOp::Average,
            &all,
        );
    }

    // Within each job's own communicator.
    let jobs = layout.spec.jobs();
    let color = jobs
        .iter()
        .position(|j| *j == me.job)
        .expect("my job is in the spec") as u32;
    let sub = Collectives::new(coll.comm().split(color, r).map_err(|x| e(&x))?);
    let members: Vec<usize> = layout
        .ranks
        .iter()
        .filter(|x| x.task.job == me.job)
        .filter_map(|x| x.rank)
        .collect();
    rep.expect(sub.size() == members.len(), || {
        format!(
            "job {}: communicator of {} ranks, job has {}",
            me.job,
            sub.size(),
            members.len()
        )
    });
    let mut t = tensor_of(DType::I64, r, 100);
    sub.allreduce_tensor(&mut t, ReduceOp::Sum, Algorithm::Auto)
        .map_err(|x| e(&x))?;
    let before = rep.digest;
    check_reduced(
        &mut rep,
        &format!("job {} allreduce", me.job),
        &t,
        ReduceOp::Sum,
        &members,
    );
    // Job results differ between jobs: keep them out of the digest every rank must share.
    rep.digest = before;
    Ok(rep)
}

/// One-sided checks (MPI only): windows of different length on every rank, `get` of
/// every rank's window, `put` to the right neighbour, `accumulate` from every rank (whole
/// and in scattered blocks),
/// atomic `fetch_and_add` (every returned ticket is unique), `compare_and_swap` (exactly
/// one winner), a batch of gets, and out-of-range and unknown-rank errors.
pub fn run_rma(comm: &crate::transport::mpi::MpiComm, rep: &mut Report) -> Result<(), String> {
    use crate::transport::rma::Window;
    use mpi::collective::SystemOperation;
    use mpi::traits::*;
    let world = comm.raw();
    let (n, r) = (world.size() as usize, world.rank() as usize);
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let value = |rank: usize, i: usize| (rank * 100 + i) as f32;
    let len_of = |rank: usize| 8 * (rank + 1);

    let mut data = Window::<f32>::allocate(comm, len_of(r)).map_err(|x| e(&x))?;
    // SAFETY: no rank opens an epoch before the barrier below.
    for (i, x) in unsafe { data.local_mut() }.iter_mut().enumerate() {
        *x = value(r, i);
    }
    world.barrier();
    let mut counters = Window::<i64>::allocate(comm, 2).map_err(|x| e(&x))?;
    let mut sums = Window::<f64>::allocate(comm, 8).map_err(|x| e(&x))?;
    {
        let ep = data.lock_all().map_err(|x| e(&x))?;
        for t in 0..n {
            let mut got = vec![0f32; len_of(t)];
            ep.get_into(t, 0, &mut got).map_err(|x| e(&x))?;
            let want: Vec<f32> = (0..len_of(t)).map(|i| value(t, i)).collect();
            rep.expect(got == want, || format!("rma get from rank {t}: {got:?}"));
            rep.absorb(
                &got.iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<u8>>(),
            );
        }
        // Two halves of rank 0's window in one batch.
        let mut both = vec![0f32; 8];
        let (a, b) = both.split_at_mut(4);
        ep.batch(|bt| -> Result<(), String> {
            bt.get_into(0, 4, b).map_err(|x| e(&x))?;
            bt.get_into(0, 0, a).map_err(|x| e(&x))
        })
        .map_err(|x| e(&x))??;
        let want: Vec<f32> = (0..8).map(|i| value(0, i)).collect();
        rep.expect(both == want, || format!("rma batch of gets: {both:?}"));
        // Errors, named, with nothing sent.
        let mut big = vec![0f32; len_of(0) + 1];
        let err = ep
            .get_into(0, 0, &mut big)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        rep.expect(err.contains("are outside rank 0's window of 8"), || {
            format!("rma out-of-range error: {err}")
        });
        let err = ep.put(n, 0, &[1.0]).unwrap_err().to_string();
        rep.expect(
            err.contains(&format!("rank {n} is not in the window's group of {n}")),
            || format!("rma unknown-rank error: {err}"),
        );
        world.barrier();
        // Everyone puts its rank into the first 4 elements of its right neighbour.
        ep.put((r + 1) % n, 0, &[r as f32; 4]).map_err(|x| e(&x))?;
    }
    world.barrier();
    {
        let mut ep = data.lock_all().map_err(|x| e(&x))?;
        // SAFETY: every put was flushed before the barrier, and no rank touches this
        // window again before the next barrier.
        let mine = unsafe { ep.with_local(|m| m[..4].to_vec()) }.map_err(|x| e(&x))?;
        let left = ((r + n - 1) % n) as f32;
        rep.expect(mine == vec![left; 4], || {
            format!("rma put from the left: {mine:?}")
        });
        drop(ep);
        world.barrier();
    }
    {
        let mut ep = sums.lock_all().map_err(|x| e(&x))?;
        // Then scattered blocks (one indexed accumulate a target): rows 3 and 1 of 2.
        let (a, b) = ((r + 1) as f64, 10.0 * (r + 1) as f64);
        let blocks = [a, a, b, b];
        for t in 0..n {
            ep.accumulate_sum(t, 0, &[(r + 1) as f64; 8])
                .map_err(|x| e(&x))?;
        }
        ep.batch(|bt| -> Result<(), String> {
            for t in 0..n {
                (bt.accumulate_blocks_sum(t, &[6, 2], 2, &blocks)).map_err(|x| e(&x))?;
            }
            Ok(())
        })
        .map_err(|x| e(&x))??;
        world.barrier();
        // SAFETY: all accumulates were flushed before the barrier; none follow.
        let mine = unsafe { ep.with_local(|m| m.to_vec()) }.map_err(|x| e(&x))?;
        let s = (n * (n + 1) / 2) as f64;
        let want = [s, s, 11.0 * s, 11.0 * s, s, s, 2.0 * s, 2.0 * s];
        rep.expect(mine == want, || {
            format!("rma accumulate and indexed accumulate: {mine:?}, want {want:?}")
        });
        drop(ep);
        world.barrier();
    }
    {
        let ep = counters.lock_all().map_err(|x| e(&x))?;
        let tickets: Vec<i64> = (0..10)
            .map(|_| ep.fetch_and_add(0, 0, 1))
            .collect::<Result<_, _>>()
            .map_err(|x| e(&x))?;
        let mut all = vec![0i64; 10 * n];
        world.all_gather_into(&tickets[..], &mut all[..]);
        all.sort_unstable();
        rep.expect(all == (0..10 * n as i64).collect::<Vec<_>>(), || {
            format!("rma fetch_and_add tickets not unique: {all:?}")
        });
        world.barrier();
        let old = ep
            .compare_and_swap(0, 1, 0, r as i64 + 1)
            .map_err(|x| e(&x))?;
        let mut winners = 0i64;
        world.all_reduce_into(&i64::from(old == 0), &mut winners, SystemOperation::sum());
        rep.expect(winners == 1, || {
            format!("rma compare_and_swap: {winners} winners")
        });
        world.barrier();
        let now = ep.fetch_and_add(0, 1, 0).map_err(|x| e(&x))?;
        rep.expect((1..=n as i64).contains(&now), || {
            format!("rma cas value {now}")
        });
    }
    world.barrier();
    for w in [data.free(), counters.free(), sums.free()] {
        w.map_err(|x| e(&x))?;
    }
    Ok(())
}
