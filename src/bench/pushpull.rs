//! `pushpull`: one round of push plus pull of a model of S bytes, sliced evenly over P ps
//! tasks, by each of W workers (the other ranks), through:
//! - `mpi`: plain rsmpi messages of the same pattern (push: S/P bytes to each ps, a
//!   1-byte ack back; pull: a 1-byte request, S/P bytes back), served by a matched-probe
//!   loop that does nothing else: the transfer ceiling;
//! - `mpiflow`: the parameter-server protocol (headers, checks, the SGD update on the ps)
//!   with `--transport p2p`, as training drives it: each push and the pull after it in one
//!   request where that is safe (`crate::train::ps::worker::Client::push_pull`); with
//!   `--transport rma`, one-sided accumulate and get on the ps tasks' windows
//!   ([`crate::train::ps::rma::bench_pushpull`]);
//! - `mpi-sgd`: the `mpi` pattern whose ps receives each push into a gradient buffer and
//!   applies `params -= lr * grad` before the ack, answering pulls from `params`: what any
//!   ps that updates costs (the `mpiflow/mpi-sgd` ratio line is the protocol's own cost).
//!
//! Bandwidth is the bytes all workers move per second: `W x 2S / mean round time`.

use std::time::{Duration, Instant};

use mpi::traits::*;

use super::osu::{self, BenchOptions, Path};
use super::{best_of_rounds, BenchError, Better, Row};
use crate::cluster::{Layout, MappingOptions};
use crate::tensor::{DType, Tensor};
use crate::train::optim::{Optimizer, OptimizerKind};
use crate::train::ps::placement::{DeviceSetter, Strategy};
use crate::train::ps::{self, PsError, PsTransport, Roles};
use crate::transport::mpi::MpiComm;
use crate::transport::{Algorithm, Collectives, Comm, ReduceOp};

const TAG: i32 = 7;

/// A ps rank of `layout` serves until the workers are done and returns `None`; a worker
/// gets the roles and its index among the workers.
pub(super) fn serve_or_work<C: Comm>(
    comm: &C,
    layout: &Layout,
    timeout: Duration,
) -> Result<Option<(Roles, usize)>, PsError> {
    let roles = Roles::new(layout)?;
    let me = comm.rank();
    if let Some(k) = roles.ps_index(me) {
        return ps::server::serve(comm, &roles, k, timeout).map(|_| None);
    }
    Ok(roles.worker_index(me).map(|w| (roles, w)))
}

/// The mpiflow path over messages: ps ranks serve, workers run `warmup + rounds` rounds of
/// one push and the pull after it of `floats` floats, sliced evenly over the ps tasks,
/// through the real protocol (async, SGD). Workers return the mean seconds of a
/// timed round; ps ranks return `None`.
fn p2p_rounds<C: Comm>(
    comm: &C,
    layout: &Layout,
    floats: usize,
    rounds: usize,
    warmup: usize,
) -> Result<Option<f64>, PsError> {
    let timeout = Duration::from_secs(60);
    let Some((roles, w)) = serve_or_work(comm, layout, timeout)? else {
        return Ok(None);
    };
    let vars = vec![("model".to_string(), floats)];
    let setter = DeviceSetter {
        strategy: Strategy::Partition,
        partition_bytes: floats.div_ceil(roles.ps.len()).max(1) * 4,
    };
    let client =
        ps::worker::Client::new(comm, &roles, setter.place(&vars, roles.ps.len()), timeout);
    let zeros = Tensor::zeros(crate::tensor::DType::F32, &[floats])
        .map_err(|e| PsError::Setup(e.to_string()))?
        .named("model");
    let mut params = vec![zeros];
    // Gradients that hold data, as the plain paths' (see `raw`).
    let mut grads = params.clone();
    grads[0].as_mut_slice::<f32>().expect("f32").fill(1.0);
    if w == 0 {
        let setup = ps::protocol::Setup {
            shards: client.shards.clone(),
            optimizer: Optimizer::new(OptimizerKind::Sgd, 1e-12),
            sync: None,
            stage: None,
            tables: Vec::new(),
            sparse: None,
            seed: 0,
        };
        client.init(&setup, &mut params)?;
    }
    // Like training: every worker's first pull waits for the chief's initialisation.
    client.pull(0, false, &mut params)?;
    let mut start = Instant::now();
    for i in 0..warmup + rounds {
        if i == warmup {
            start = Instant::now();
        }
        let push = ps::worker::Gradients {
            step: 0,
            samples: 1,
            loss: 0.0,
            note: Default::default(),
        };
        let then = ps::protocol::Then {
            step: 0,
            report: false,
        };
        client.push_pull(push, &mut grads, then, &mut params)?;
    }
    let secs = start.elapsed().as_secs_f64() / rounds.max(1) as f64;
    client.done(None)?;
    Ok(Some(secs))
}

/// The plain-MPI paths: returns mean seconds per round on workers, `None` on ps ranks.
/// With `sgd`, the ps receives each push into a gradient buffer and applies
/// `params -= lr * grad` before the ack, and pulls are answered from `params`.
fn raw(
    comm: &MpiComm,
    ps: usize,
    bytes: usize,
    rounds: usize,
    warmup: usize,
    sgd: bool,
) -> Option<f64> {
    let world = comm.raw();
    let (me, n) = (comm.rank(), comm.size());
    let slice = bytes.div_ceil(ps).max(1);
    if me < ps {
        if sgd {
            raw_sgd_ps(comm, n - ps, slice.div_ceil(4));
        } else {
            raw_ps(comm, n - ps, slice);
        }
        return None;
    }
    // The plain pattern's push leads with a 0 byte; the sgd variant's is the floats. What
    // is sent holds data, as OSU's buffers do (`memset` with 'a') and a backward pass's
    // gradients do: memory never written maps the kernel's one zero page, which the ps's
    // copy would read from its own cache at any size.
    let floats = slice.div_ceil(4);
    let mut push = vec![b'a'; slice + 1];
    let grad = vec![1f32; floats];
    let mut back = vec![0u8; slice];
    let mut back_f = vec![0f32; floats];
    let mut ack = [0u8; 1];
    let mut start = std::time::Instant::now();
    for i in 0..warmup + rounds {
        if i == warmup {
            start = std::time::Instant::now();
        }
        push[0] = 0;
        for p in 0..ps {
            let to = world.process_at_rank(p as i32);
            if sgd {
                to.send_with_tag(&grad[..], TAG);
            } else {
                to.send_with_tag(&push[..], TAG);
            }
        }
        for p in 0..ps {
            world
                .process_at_rank(p as i32)
                .receive_into_with_tag(&mut ack[..], TAG);
        }
        for p in 0..ps {
            world
                .process_at_rank(p as i32)
                .send_with_tag(&[1u8][..], TAG);
        }
        for p in 0..ps {
            let from = world.process_at_rank(p as i32);
            if sgd {
                from.receive_into_with_tag(&mut back_f[..], TAG);
            } else {
                from.receive_into_with_tag(&mut back[..], TAG);
            }
        }
    }
    let secs = start.elapsed().as_secs_f64() / rounds.max(1) as f64;
    for p in 0..ps {
        world
            .process_at_rank(p as i32)
            .send_with_tag(&[2u8][..], TAG);
    }
    Some(secs)
}

/// The plain pattern's ps: a matched-probe loop that does nothing else.
fn raw_ps(comm: &MpiComm, workers: usize, slice: usize) {
    let world = comm.raw();
    let reply = vec![1u8; slice];
    let mut done = 0;
    while done < workers {
        let (data, status) = world
            .any_process()
            .matched_probe_with_tag(TAG)
            .matched_receive_vec::<u8>();
        let from = world.process_at_rank(status.source_rank());
        match data.first() {
            Some(0) => from.send_with_tag(&[1u8][..], TAG),
            Some(1) => from.send_with_tag(&reply[..], TAG),
            _ => done += 1,
        }
    }
}

/// The sgd variant's ps: a push (more than one byte) lands in the gradient buffer and is
/// applied to the parameters at once; a 1-byte request is answered from the parameters.
fn raw_sgd_ps(comm: &MpiComm, workers: usize, floats: usize) {
    let world = comm.raw();
    // Parameters that hold data from the start (see `raw`); the update writes them anyway.
    let mut params = vec![1f32; floats];
    let mut grad = vec![0f32; floats];
    let lr = 1e-12f32;
    let mut done = 0;
    while done < workers {
        let (msg, status) = world.any_process().matched_probe_with_tag(TAG);
        let from = world.process_at_rank(status.source_rank());
        if status.count(u8::equivalent_datatype()) > 1 {
            msg.matched_receive_into(&mut grad[..]);
            params.iter_mut().zip(&grad).for_each(|(p, g)| *p -= lr * g);
            from.send_with_tag(&[1u8][..], TAG);
            continue;
        }
        let mut what = [0u8; 1];
        msg.matched_receive_into(&mut what[..]);
        match what[0] {
            1 => from.send_with_tag(&params[..], TAG),
            _ => done += 1,
        }
    }
}

/// Mean over workers of their round time (collective).
pub(super) fn mean_over_workers(
    coll: &Collectives<MpiComm>,
    mine: Option<f64>,
) -> Result<f64, BenchError> {
    let mut buf = crate::tensor::AlignedBuf::zeroed(16);
    let (t, w) = (mine.unwrap_or(0.0), if mine.is_some() { 1.0 } else { 0.0 });
    buf.as_mut_slice()[..8].copy_from_slice(&t.to_le_bytes());
    buf.as_mut_slice()[8..16].copy_from_slice(&f64::to_le_bytes(w));
    coll.allreduce(
        &mut buf.as_mut_slice()[..16],
        DType::F64,
        ReduceOp::Sum,
        Algorithm::Auto,
    )?;
    let total = f64::from_le_bytes(buf.as_slice()[..8].try_into().expect("8"));
    let workers = f64::from_le_bytes(buf.as_slice()[8..16].try_into().expect("8"));
    Ok(total / workers.max(1.0))
}

/// The job as `--ps` ps tasks (the first ranks) and workers on one host: the layout, the
/// ps tasks and the workers.
pub(super) fn ps_layout(
    comm: &MpiComm,
    opts: &BenchOptions,
) -> Result<(Layout, usize, usize), BenchError> {
    let (n, ps) = (comm.size(), opts.ps.max(1));
    let options = MappingOptions {
        ps,
        ..Default::default()
    };
    let layout =
        Layout::single_host(n, &options).map_err(|e| BenchError::Validation(e.to_string()))?;
    Ok((layout, ps, n - ps))
}

pub fn run(
    comm: &MpiComm,
    coll: &Collectives<MpiComm>,
    opts: &BenchOptions,
) -> Result<String, BenchError> {
    let (l, ps, workers) = ps_layout(comm, opts)?;
    let (min, max) = opts.sizes.unwrap_or((4096, 16 << 20));
    let (mut paths, rounds) = opts.plan();
    if opts.path == Path::Both {
        paths.push(Path::MpiSgd);
    }
    // Whole floats.
    let sizes = osu::sizes(min.max(4), max).into_iter().map(|s| s / 4 * 4);
    let measured = best_of_rounds(
        coll,
        sizes,
        &paths,
        rounds,
        Better::Higher,
        opts.progress,
        |path, size| {
            let (iters, warmup) = osu::iterations(opts, size, (100, 10), (20, 2), 1 << 20);
            let mine = match path {
                Path::Mpi => raw(comm, ps, size, iters, warmup, false),
                Path::MpiSgd => raw(comm, ps, size, iters, warmup, true),
                _ => match opts.transport {
                    PsTransport::P2p => p2p_rounds(comm, &l, size / 4, iters, warmup),
                    PsTransport::Rma => {
                        crate::train::ps::rma::bench_pushpull(comm, &l, size / 4, iters, warmup)
                    }
                }
                .map_err(|e| BenchError::Validation(e.to_string()))?,
            };
            let secs = mean_over_workers(coll, mine)?;
            Ok(Row::point(
                size,
                (workers * 2 * size) as f64 / 1e6 / secs,
                0,
            ))
        },
    )?;
    let how = match opts.transport {
        PsTransport::P2p => "p2p",
        PsTransport::Rma => "rma",
    };
    let title = format!("Push-Pull Bandwidth Test ({workers} workers, {ps} ps, transport {how})");
    let mut out = measured.render(|rows| {
        osu::p2p_table(
            &title,
            "MPI_FLOAT",
            "Bandwidth (MB/s)",
            rows,
            false,
            opts.digits,
        )
    });
    if paths.len() == 3 {
        // The protocol's cost alone: mpiflow beside plain MPI doing the same update.
        out += &measured.ratio(1, 2);
    }
    Ok(out)
}
