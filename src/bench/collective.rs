//! `allreduce`, `bcast` and `allreduce-fused`: every rank, OSU's method.

use std::time::Instant;

use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::osu::{self, BenchOptions, Element, Path, ShmStores};
use super::{best_of_rounds, secs, BenchError, Better, Label, Row, Schedule};
use crate::named::Named;
use crate::tensor::{AlignedBuf, DType, Tensor};
use crate::transport::fusion::{Fusion, FusionConfig};
use crate::transport::mpi::MpiComm;
use crate::transport::{Algorithm, Collectives, ReduceOp};

/// Mean microseconds per call of `f` over `iters` timed calls after `warmup`, each call
/// timed on its own; with `barrier`, an untimed `MPI_Barrier` follows every call, as in
/// OSU's collective benchmarks (so that no rank starts a call while others still finish
/// the previous one).
fn time_loop(
    iters: usize,
    warmup: usize,
    barrier: Option<&SimpleCommunicator>,
    mut f: impl FnMut() -> Result<(), BenchError>,
) -> Result<f64, BenchError> {
    let mut total = 0.0;
    for i in 0..warmup + iters {
        let t = Instant::now();
        f()?;
        if i >= warmup {
            total += secs(t);
        }
        if let Some(world) = barrier {
            world.barrier();
        }
    }
    Ok(total * 1e6 / iters.max(1) as f64)
}

/// OSU's statistics over ranks: average of the ranks' means, min and max.
fn over_ranks(
    coll: &Collectives<MpiComm>,
    size: usize,
    us: f64,
    iters: usize,
) -> Result<Row, BenchError> {
    let mut v = [
        AlignedBuf::zeroed(8),
        AlignedBuf::zeroed(8),
        AlignedBuf::zeroed(8),
    ];
    let mut out = [0.0; 3];
    for (k, op) in [ReduceOp::Average, ReduceOp::Min, ReduceOp::Max]
        .into_iter()
        .enumerate()
    {
        v[k].as_mut_slice()[..8].copy_from_slice(&us.to_le_bytes());
        coll.allreduce(
            &mut v[k].as_mut_slice()[..8],
            DType::F64,
            op,
            Algorithm::Mpi,
        )?;
        out[k] = f64::from_le_bytes(v[k].as_slice()[..8].try_into().expect("8 bytes"));
    }
    Ok(Row {
        size,
        value: out[0],
        min: out[1],
        max: out[2],
        iterations: iters,
    })
}

/// The first `n` elements of `b` as `T` (a plain number type: every bit pattern valid).
fn elements<T: Copy>(b: &mut AlignedBuf, n: usize) -> &mut [T] {
    // SAFETY: AlignedBuf is at least 64-byte aligned and initialised, and the callers' T
    // are i8, i32 and f32, for which every bit pattern is a value; n elements fit
    // (checked by the slice bound below).
    let (_, mid, _) = unsafe { b.as_mut_slice().align_to_mut::<T>() };
    &mut mid[..n]
}

/// OSU's timed loop of `MPI_Allreduce` (sum) on `n` elements of `T` of its buffers.
fn mpi_allreduce<T: Copy + Equivalence>(
    world: &SimpleCommunicator,
    bufs: &mut OsuBuffers,
    n: usize,
    iters: usize,
    warmup: usize,
) -> Result<f64, BenchError> {
    let send = &*elements::<T>(&mut bufs.send, n);
    let recv = elements::<T>(&mut bufs.recv, n);
    time_loop(iters, warmup, Some(world), || {
        world.all_reduce_into(send, &mut recv[..], SystemOperation::sum());
        Ok(())
    })
}

/// A path of the allreduce and bcast tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arm {
    /// Plain `MPI_Allreduce` / `MPI_Bcast`.
    Mpi,
    /// mpiflow's bcast.
    Mpiflow,
    /// mpiflow's allreduce with this algorithm.
    Allreduce(Algorithm),
}

impl Label for Arm {
    fn label(&self) -> String {
        match self {
            Arm::Mpi => "mpi".into(),
            Arm::Mpiflow => "mpiflow".into(),
            Arm::Allreduce(a) => format!("mpiflow (algorithm {})", a.name()),
        }
    }
}

/// The arms of `name` for the paths asked for: allreduce has one mpiflow arm per
/// `--algorithm`.
fn arms(name: &str, paths: &[Path], opts: &BenchOptions) -> Vec<Arm> {
    let mut out = Vec::new();
    for path in paths {
        match (path, name) {
            (Path::Mpi, _) => out.push(Arm::Mpi),
            (_, "allreduce") => out.extend(opts.algorithms.iter().map(|&a| Arm::Allreduce(a))),
            _ => out.push(Arm::Mpiflow),
        }
    }
    out
}

/// The `mpi` arm's buffers, as `osu_allreduce.c` and `osu_bcast.c` allocate them: once
/// for the run, at its largest size, page-aligned; the send buffer's bytes set to 1, the
/// receive buffer's to 0 (the mpiflow arms use tensors as the runtime makes them).
struct OsuBuffers {
    send: AlignedBuf,
    recv: AlignedBuf,
}

impl OsuBuffers {
    fn new(max: usize) -> OsuBuffers {
        OsuBuffers {
            send: AlignedBuf::paged(max, 1),
            recv: AlignedBuf::paged(max, 0),
        }
    }
}

/// One measurement of allreduce or bcast on one path.
fn measure(
    coll: &Collectives<MpiComm>,
    name: &str,
    arm: Arm,
    size: usize,
    opts: &BenchOptions,
    osu_bufs: &mut OsuBuffers,
) -> Result<Row, BenchError> {
    let (iters, warmup) = osu::iterations(opts, size, (1000, 100), (100, 10), 8192);
    let world = coll.comm().raw();
    let barrier = Some(world);
    let us = match (name, arm) {
        ("allreduce", Arm::Mpi) => {
            let n = size / opts.element.dtype().size();
            match opts.element {
                Element::Char => mpi_allreduce::<i8>(world, osu_bufs, n, iters, warmup)?,
                Element::Int => mpi_allreduce::<i32>(world, osu_bufs, n, iters, warmup)?,
                Element::Float => mpi_allreduce::<f32>(world, osu_bufs, n, iters, warmup)?,
            }
        }
        (_, Arm::Allreduce(algorithm)) => {
            let dtype = opts.element.dtype();
            let mut t = Tensor::zeros(dtype, &[size / dtype.size()])?.named("bench");
            time_loop(iters, warmup, barrier, || {
                coll.allreduce_tensor(&mut t, ReduceOp::Sum, algorithm)?;
                Ok(())
            })?
        }
        (_, Arm::Mpi) => {
            let b = &mut osu_bufs.send;
            let root = world.process_at_rank(0);
            time_loop(iters, warmup, barrier, || {
                root.broadcast_into(&mut b.as_mut_slice()[..size]);
                Ok(())
            })?
        }
        (_, Arm::Mpiflow) => {
            let mut t = Tensor::zeros(DType::U8, &[size])?.named("bench");
            time_loop(iters, warmup, barrier, || {
                coll.bcast_tensor(&mut t, 0)?;
                Ok(())
            })?
        }
    };
    over_ranks(coll, size, us, iters)
}

/// The three arms of `allreduce-fused`, each N tensors of `size` bytes per iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FusedArm {
    /// N raw `MPI_Allreduce` calls.
    Mpi,
    /// N mpiflow allreduces.
    OneByOne,
    /// One fused mpiflow allreduce of the N (with negotiation).
    Fused,
}

impl Label for FusedArm {
    fn label(&self) -> String {
        match self {
            FusedArm::Mpi => "mpi (one MPI_Allreduce per tensor)",
            FusedArm::OneByOne => "mpiflow (one allreduce per tensor)",
            FusedArm::Fused => "mpiflow (fused)",
        }
        .into()
    }
}

/// One arm of `allreduce-fused` at `size` bytes per tensor.
fn measure_fused(
    coll: &Collectives<MpiComm>,
    arm: FusedArm,
    size: usize,
    opts: &BenchOptions,
) -> Result<Row, BenchError> {
    let (iters, warmup) = osu::iterations(opts, size, (100, 10), (100, 10), 8192);
    let n = opts.count.max(1);
    // One algorithm (checked by `validate`).
    let algorithm = opts.algorithms[0];
    let elems = size / 4;
    let us = if arm == FusedArm::Mpi {
        let world = coll.comm().raw();
        let send: Vec<Vec<f32>> = (0..n).map(|i| vec![i as f32; elems]).collect();
        let mut recv: Vec<Vec<f32>> = vec![vec![0.0; elems]; n];
        time_loop(iters, warmup, None, || {
            for (s, r) in send.iter().zip(recv.iter_mut()) {
                world.all_reduce_into(&s[..], &mut r[..], SystemOperation::sum());
            }
            Ok(())
        })?
    } else {
        let mut tensors: Vec<Tensor> = (0..n)
            .map(|i| Tensor::zeros(DType::F32, &[elems]).map(|t| t.named(&format!("grad/{i}"))))
            .collect::<Result<_, _>>()?;
        if arm == FusedArm::OneByOne {
            time_loop(iters, warmup, None, || {
                for t in tensors.iter_mut() {
                    coll.allreduce_tensor(t, ReduceOp::Sum, algorithm)?;
                }
                Ok(())
            })?
        } else {
            let mut fusion = Fusion::new(FusionConfig {
                algorithm,
                ..FusionConfig::default()
            });
            time_loop(iters, warmup, None, || {
                let mut refs: Vec<&mut Tensor> = tensors.iter_mut().collect();
                fusion.allreduce(coll, &mut refs, ReduceOp::Sum)?;
                Ok(())
            })?
        }
    };
    over_ranks(coll, size, us, iters)
}

/// `allreduce-fused`: the three arms alternating as every table's paths do
/// ([`best_of_rounds`], `--rounds` and `--rotate`), each arm's table, then the speed-up of
/// fusion over each one-by-one arm, paired in time.
fn run_fused(coll: &Collectives<MpiComm>, opts: &BenchOptions) -> Result<String, BenchError> {
    let (min, max) = opts.sizes.unwrap_or((10240, 10240));
    let arms = [FusedArm::Mpi, FusedArm::OneByOne, FusedArm::Fused];
    let schedule = Schedule {
        rounds: opts.rounds.max(1),
        first: opts.rotate,
    };
    let measured = best_of_rounds(
        coll,
        osu::sizes(min.max(4), max),
        &arms,
        schedule,
        Better::Lower,
        opts.progress,
        |arm, size| measure_fused(coll, arm, size, opts),
    )?;
    let title = format!(
        "Allreduce Latency Test ({} tensors per round)",
        opts.count.max(1)
    );
    let mut out = osu::tables(&measured.tables, |rows| {
        osu::collective_table(&title, "MPI_FLOAT", rows, opts.full, opts.digits)
    });
    let fused = &measured.tables[2].1;
    out.push_str(&osu::ratio_table(
        &format!("one-by-one/fused (speed-up of fusion) {}", osu::PAIRED),
        fused,
        &measured.paired(1, 2),
    ));
    out.push_str(&osu::ratio_table(
        &format!("mpi one-by-one/fused {}", osu::PAIRED),
        fused,
        &measured.paired(0, 2),
    ));
    out.push_str(&stores_line(coll, opts));
    Ok(out)
}

pub fn run(
    coll: &Collectives<MpiComm>,
    name: &str,
    opts: &BenchOptions,
) -> Result<String, BenchError> {
    if name == "allreduce-fused" {
        return run_fused(coll, opts);
    }
    let mut out = String::new();
    let (title, datatype) = if name == "allreduce" {
        ("Allreduce Latency Test", opts.element.mpi_name())
    } else {
        ("Broadcast Latency Test", "MPI_CHAR")
    };
    let (min, max) = opts.sizes.unwrap_or((1, 1 << 20));
    let (paths, rounds) = opts.plan();
    let element = opts.element.dtype().size();
    let sizes = osu::sizes(min, max)
        .into_iter()
        .filter_map(|size| match name {
            "allreduce" if size < element => None, // OSU skips sizes below one element
            "allreduce" => Some(size / element * element),
            _ => Some(size),
        });
    let arms = arms(name, &paths, opts);
    let mut osu_bufs = OsuBuffers::new(max);
    let measured = best_of_rounds(
        coll,
        sizes,
        &arms,
        rounds,
        Better::Lower,
        opts.progress,
        |arm, size| measure(coll, name, arm, size, opts, &mut osu_bufs),
    )?;
    out.push_str(
        &measured
            .render(|rows| osu::collective_table(title, datatype, rows, opts.full, opts.digits)),
    );
    if name == "allreduce" {
        out.push_str(&stores_line(coll, opts));
    }
    Ok(out)
}

/// What this rank measured for the shared-memory allreduce's steps with each kind of store
/// (see `transport::collectives::stores`), or the mode `--shm-stores` forced, and the slot size, as a
/// comment line; empty where it did not run.
fn stores_line(coll: &Collectives<MpiComm>, opts: &BenchOptions) -> String {
    let Some((cached, streaming)) = coll.shm_store_costs() else {
        return String::new();
    };
    let slot = coll.tuning.shm_slot();
    if opts.shm_stores != ShmStores::Auto {
        return format!(
            "# shared-memory allreduce: {slot}-byte slots, stores forced {:?} (--shm-stores)\n",
            opts.shm_stores
        )
        .to_lowercase();
    }
    let show = |c: Option<f64>| c.map_or("not measured".into(), |c| format!("{c:.3} ns/B"));
    format!(
        "# shared-memory allreduce, cost of a step per byte (rank {}, last measured): cached stores {}, streaming stores {}; {slot}-byte slots\n",
        coll.rank(),
        show(cached),
        show(streaming)
    )
}
