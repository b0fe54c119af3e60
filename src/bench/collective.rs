//! `allreduce`, `bcast` and `allreduce-fused`: every rank, OSU's method.

use std::time::Instant;

use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::osu::{self, BenchOptions, Element, Path, ShmStores};
use super::{best_of_rounds, secs, verify, BenchError, Better, Label, Row, Schedule};
use crate::named::Named;
use crate::tensor::{AlignedBuf, DType, Tensor};
use crate::transport::fusion::{Fusion, FusionConfig};
use crate::transport::mpi::MpiComm;
use crate::transport::{Algorithm, Collectives, ReduceOp};

/// A part of one iteration of [`time_loop`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Under `-c`, before the call: put the iteration's data into the buffer.
    Fill,
    /// The call, timed.
    Call,
    /// Under `-c`, after the call: check what it left.
    Check,
}

/// Mean microseconds per call of `f` over `iters` timed calls after `warmup`, each call
/// timed on its own; with `barrier`, an untimed `MPI_Barrier` follows every call, as in
/// OSU's collective benchmarks (so that no rank starts a call while others still finish
/// the previous one). With `validate` (`-c`), every iteration `i` is also filled and
/// checked by `f(i, Step::Fill)` and `f(i, Step::Check)`, outside the timed call.
fn time_loop(
    iters: usize,
    warmup: usize,
    barrier: Option<&SimpleCommunicator>,
    validate: bool,
    mut f: impl FnMut(usize, Step) -> Result<(), BenchError>,
) -> Result<f64, BenchError> {
    let mut total = 0.0;
    for i in 0..warmup + iters {
        if validate {
            f(i, Step::Fill)?;
        }
        let t = Instant::now();
        f(i, Step::Call)?;
        if i >= warmup {
            total += secs(t);
        }
        if validate {
            f(i, Step::Check)?;
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
fn elements<T: Copy>(b: &mut [u8], n: usize) -> &mut [T] {
    // SAFETY: the callers' T are u8, i8, i32 and f32, for which every bit pattern is a
    // value; the buffers (AlignedBuf, a tensor's payload) are at least 64-byte aligned,
    // so `align_to_mut` leaves no prefix, and n elements fit (the slice bound below).
    let (head, mid, _) = unsafe { b.align_to_mut::<T>() };
    debug_assert!(head.is_empty(), "an aligned buffer");
    &mut mid[..n]
}

/// `-c`'s verdict on one iteration of a path, named.
fn checked(
    arm: Arm,
    size: usize,
    op: &str,
    i: usize,
    verdict: Result<(), verify::Mismatch>,
) -> Result<(), BenchError> {
    verdict.map_err(|m| {
        BenchError::Validation(format!(
            "{} path, {size}-byte {op} of iteration {i}: {} of {} elements wrong, the first (element {}) is {}, expected {}",
            arm.label(),
            m.wrong,
            m.of,
            m.first,
            m.got,
            m.want
        ))
    })
}

/// OSU's timed loop of `MPI_Allreduce` (sum) on `n` elements of `T` of its buffers.
fn mpi_allreduce<T: verify::Value + Equivalence>(
    world: &SimpleCommunicator,
    bufs: &mut OsuBuffers,
    n: usize,
    (iters, warmup): (usize, usize),
    validate: bool,
) -> Result<f64, BenchError> {
    let (rank, ranks) = (world.rank() as usize, world.size() as usize);
    let send = elements::<T>(bufs.send.as_mut_slice(), n);
    let recv = elements::<T>(bufs.recv.as_mut_slice(), n);
    time_loop(iters, warmup, Some(world), validate, |i, step| match step {
        Step::Fill => {
            verify::fill_sum_input(&mut send[..], rank, i);
            Ok(())
        }
        Step::Call => {
            world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
            Ok(())
        }
        Step::Check => {
            let size = n * std::mem::size_of::<T>();
            checked(
                Arm::Mpi,
                size,
                "allreduce",
                i,
                verify::check_sum(&recv[..], ranks, i),
            )
        }
    })
}

/// mpiflow's timed loop of its allreduce (sum, in place) on a tensor of `T`.
fn mpiflow_allreduce<T: verify::Value>(
    coll: &Collectives<MpiComm>,
    t: &mut Tensor,
    algorithm: Algorithm,
    (iters, warmup): (usize, usize),
    validate: bool,
) -> Result<f64, BenchError> {
    let (rank, ranks) = (coll.rank(), coll.size());
    let (size, n) = (t.nbytes(), t.nbytes() / std::mem::size_of::<T>());
    let barrier = Some(coll.comm().raw());
    time_loop(iters, warmup, barrier, validate, |i, step| match step {
        Step::Fill => {
            verify::fill_sum_input(elements::<T>(t.bytes_mut(), n), rank, i);
            Ok(())
        }
        Step::Call => {
            coll.allreduce_tensor(&mut *t, ReduceOp::Sum, algorithm)?;
            Ok(())
        }
        Step::Check => {
            let got = verify::check_sum(elements::<T>(t.bytes_mut(), n), ranks, i);
            checked(Arm::Allreduce(algorithm), size, "allreduce", i, got)
        }
    })
}

/// The timed loop of a broadcast from rank 0 by `call` into `buf`, whose bytes `bytes`
/// gives (for `-c`).
fn bcast_loop<B: ?Sized>(
    coll: &Collectives<MpiComm>,
    arm: Arm,
    (iters, warmup): (usize, usize),
    validate: bool,
    buf: &mut B,
    bytes: fn(&mut B) -> &mut [u8],
    mut call: impl FnMut(&mut B) -> Result<(), BenchError>,
) -> Result<f64, BenchError> {
    let root = coll.rank() == 0;
    let size = bytes(buf).len();
    let world = coll.comm().raw();
    time_loop(iters, warmup, Some(world), validate, |i, step| match step {
        Step::Fill => {
            verify::fill_bcast(bytes(buf), root, i);
            Ok(())
        }
        Step::Call => call(buf),
        Step::Check => checked(arm, size, "bcast", i, verify::check_bcast(bytes(buf), i)),
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
    let counts = osu::iterations(opts, size, (1000, 100), (100, 10), 8192);
    let world = coll.comm().raw();
    let validate = opts.validate;
    let us = match (name, arm) {
        ("allreduce", Arm::Mpi) => {
            let (b, n) = (osu_bufs, size / opts.element.dtype().size());
            match opts.element {
                Element::Char => mpi_allreduce::<i8>(world, b, n, counts, validate)?,
                Element::Int => mpi_allreduce::<i32>(world, b, n, counts, validate)?,
                Element::Float => mpi_allreduce::<f32>(world, b, n, counts, validate)?,
            }
        }
        (_, Arm::Allreduce(algorithm)) => {
            let dtype = opts.element.dtype();
            let t = &mut Tensor::zeros(dtype, &[size / dtype.size()])?.named("bench");
            match opts.element {
                Element::Char => mpiflow_allreduce::<u8>(coll, t, algorithm, counts, validate)?,
                Element::Int => mpiflow_allreduce::<i32>(coll, t, algorithm, counts, validate)?,
                Element::Float => mpiflow_allreduce::<f32>(coll, t, algorithm, counts, validate)?,
            }
        }
        (_, Arm::Mpi) => {
            let b = &mut osu_bufs.send.as_mut_slice()[..size];
            let at = world.process_at_rank(0);
            bcast_loop(
                coll,
                arm,
                counts,
                validate,
                b,
                |b| b,
                |b| {
                    at.broadcast_into(b);
                    Ok(())
                },
            )?
        }
        (_, Arm::Mpiflow) => {
            let t = &mut Tensor::zeros(DType::U8, &[size])?.named("bench");
            bcast_loop(coll, arm, counts, validate, t, Tensor::bytes_mut, |t| {
                coll.bcast_tensor(t, 0)?;
                Ok(())
            })?
        }
    };
    over_ranks(coll, size, us, counts.0)
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
        time_loop(iters, warmup, None, false, |_, _| {
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
            time_loop(iters, warmup, None, false, |_, _| {
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
            time_loop(iters, warmup, None, false, |_, _| {
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
        osu::collective_table(&title, "MPI_FLOAT", rows, opts.full, false, opts.digits)
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
    out.push_str(&measured.render(|rows| {
        osu::collective_table(title, datatype, rows, opts.full, opts.validate, opts.digits)
    }));
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
