//! `rows`: embedding rows pulled and pushed between W workers and P ps tasks (the first
//! ranks), as DLRM training moves them: per round each worker pulls `size / 64` rows of
//! 16 floats (size in bytes of the rows, each id to the ps `id % P` holds), then pushes a
//! gradient row for each, which its ps applies by SGD. Through:
//! - `mpi`: plain rsmpi messages of the same pattern (per ps: the ids, the rows back; the
//!   ids and the gradient rows, a 1-byte ack back), served by a matched-probe loop from a
//!   dense array of rows: the cost of the transfer plus the least a ps that serves rows
//!   does (copy them out, apply the update);
//! - `mpiflow`: the parameter server's rows protocol as training drives it: a round's push
//!   carries the next round's pull, one request per ps (`Client::push_pull_rows`);
//!   typed headers, ownership checks, rows kept by id and made on first touch, the
//!   per-table counters. A round's ids go in the order a training batch's
//!   [`crate::model::embedding::Unique`] gives them (each ps's one run), put so by a
//!   pass over them as the plain path's split by ps is.
//!
//! Ids differ between workers and repeat every 4 rounds (the warm-up makes them), so the
//! rounds measure a ps serving rows it holds. The rate is rows moved per second by all
//! workers: `W x 2 x rows / mean round time` (a row pulled and its gradient pushed count
//! two).

use std::time::{Duration, Instant};

use mpi::traits::*;

use super::osu::{self, BenchOptions, Path};
use super::{best_of_rounds, BenchError, Better, Row};
use crate::cluster::Layout;
use crate::model::embedding::{SparseGrad, SparseOptimizer, TableSpec};
use crate::train::optim::{Optimizer, OptimizerKind};
use crate::train::ps::protocol::{row_owner, Setup};
use crate::train::ps::worker::Client;
use crate::train::ps::PsError;
use crate::transport::mpi::MpiComm;
use crate::transport::{Collectives, Comm};

/// Values per row.
const DIM: usize = 16;
/// Bytes per row.
const ROW_BYTES: usize = DIM * 4;
/// Rounds before the ids repeat.
const CYCLE: usize = 4;
const LR: f32 = 1e-12;
const PULL: i32 = 11;
const PUSH: i32 = 12;
const VALUES: i32 = 13;
const DONE: i32 = 14;

/// The rows of the table: `R`, the power of 2 at or above the ids a cycle of rounds
/// touches (`CYCLE x workers x rows`).
fn table_rows(workers: usize, rows: usize) -> u64 {
    ((CYCLE * workers * rows) as u64).next_power_of_two()
}

/// The ids worker `w` of `workers` pulls and pushes in round `i`, `rows` of them (a power
/// of 2): the workers' chunks of a cycle of rounds are disjoint and together touch the same
/// ids in every cycle, scattered over the table by an odd multiplier (a bijection modulo
/// the table's power-of-2 rows), each chunk in another order every cycle, so rows are read
/// in no order their making left in memory, as a click model's ids are.
fn ids(w: usize, workers: usize, rows: usize, i: usize) -> Vec<u64> {
    let (chunk, cycle) = (((i % CYCLE) * workers + w) as u64, (i / CYCLE) as u64);
    let (n, mask) = (rows as u64, table_rows(workers, rows) - 1);
    let order = (2 * cycle + 1).wrapping_mul(0x9E37_79B9);
    (0..n)
        .map(|j| {
            let j = (j.wrapping_mul(order) + cycle) & (n - 1);
            (chunk * n + j).wrapping_mul(0x9E37_79B9_7F4A_7C15) & mask
        })
        .collect()
}

/// `ids` into `out` with each ps's (of `ps`) one run, in the order of the ps: split by ps
/// into `parts` (as the plain path splits them), then joined.
fn in_runs(ids: &[u64], ps: usize, parts: &mut [Vec<u64>], out: &mut Vec<u64>) {
    parts.iter_mut().for_each(Vec::clear);
    for id in ids {
        parts[row_owner(*id, ps)].push(*id);
    }
    out.clear();
    parts.iter().for_each(|p| out.extend_from_slice(p));
}

/// The mpiflow path: ps ranks serve; workers run `warmup + rounds` rounds of a pull and a
/// push of `rows` rows. Workers return the mean seconds of a timed round; ps ranks `None`.
fn mpiflow_rounds(
    comm: &MpiComm,
    layout: &Layout,
    rows: usize,
    rounds: usize,
    warmup: usize,
) -> Result<Option<f64>, PsError> {
    let timeout = Duration::from_secs(60);
    let Some((roles, w)) = super::pushpull::serve_or_work(comm, layout, timeout)? else {
        return Ok(None);
    };
    let workers = roles.workers.len();
    let client = Client::new(comm, &roles, Vec::new(), timeout);
    let table = TableSpec::new("rows", table_rows(workers, rows), DIM);
    if w == 0 {
        let setup = Setup {
            shards: Vec::new(),
            optimizer: Optimizer::new(OptimizerKind::Sgd, LR),
            sync: None,
            stage: None,
            tables: vec![table.clone()],
            sparse: Some(SparseOptimizer::Sgd { lr: LR }),
            seed: 0,
        };
        client.init(&setup, &mut Vec::new())?;
    }
    // Every worker's first request waits for the chief's setup.
    client.pull(0, false, &mut Vec::new())?;
    let specs = [table];
    let mut out = vec![Vec::new()];
    let mut grad = SparseGrad {
        ids: Vec::new(),
        values: vec![1.0; rows * DIM],
    };
    let nps = roles.ps.len();
    let (mut parts, mut next) = (vec![Vec::new(); nps], Vec::new());
    in_runs(&ids(w, workers, rows, 0), nps, &mut parts, &mut next);
    client.pull_tables(&specs, &[(0, &next)], &mut out, true)?;
    let mut start = Instant::now();
    for i in 0..warmup + rounds {
        if i == warmup {
            start = Instant::now();
        }
        std::mem::swap(&mut grad.ids, &mut next);
        in_runs(&ids(w, workers, rows, i + 1), nps, &mut parts, &mut next);
        client.push_pull_tables(&specs, (&[(0, &grad)], 1.0), &[(0, &next[..])], &mut out)?;
    }
    let secs = start.elapsed().as_secs_f64() / rounds.max(1) as f64;
    client.done(None)?;
    Ok(Some(secs))
}

/// The plain-MPI path: returns mean seconds per round on workers, `None` on ps ranks.
fn mpi_rounds(comm: &MpiComm, ps: usize, rows: usize, rounds: usize, warmup: usize) -> Option<f64> {
    let world = comm.raw();
    let (me, n) = (comm.rank(), comm.size());
    let workers = n - ps;
    if me < ps {
        mpi_ps(comm, ps, workers, table_rows(workers, rows) as usize);
        return None;
    }
    let w = me - ps;
    let mut owned: Vec<Vec<u64>> = vec![Vec::new(); ps];
    let mut back: Vec<Vec<f32>> = vec![Vec::new(); ps];
    let mut ack = [0u8; 1];
    let mut start = Instant::now();
    for i in 0..warmup + rounds {
        if i == warmup {
            start = Instant::now();
        }
        owned.iter_mut().for_each(Vec::clear);
        for id in ids(w, workers, rows, i) {
            owned[row_owner(id, ps)].push(id);
        }
        for (p, ids) in owned.iter().enumerate() {
            world
                .process_at_rank(p as i32)
                .send_with_tag(&ids[..], PULL);
        }
        for (p, rows) in back.iter_mut().enumerate() {
            rows.resize(owned[p].len() * DIM, 0.0);
            (world.process_at_rank(p as i32)).receive_into_with_tag(&mut rows[..], PULL);
        }
        // The gradient rows: the pulled values themselves, as good as any.
        for (p, ids) in owned.iter().enumerate() {
            let to = world.process_at_rank(p as i32);
            to.send_with_tag(&ids[..], PUSH);
            to.send_with_tag(&back[p][..], VALUES);
        }
        for p in 0..ps {
            (world.process_at_rank(p as i32)).receive_into_with_tag(&mut ack[..], PUSH);
        }
    }
    let secs = start.elapsed().as_secs_f64() / rounds.max(1) as f64;
    for p in 0..ps {
        world
            .process_at_rank(p as i32)
            .send_with_tag(&[0u8][..], DONE);
    }
    Some(secs)
}

/// The plain path's ps: its rows (`id / ps`) in one dense array holding data; a pull's
/// ids answered with their rows, a push's gradient rows applied by SGD, then acked.
fn mpi_ps(comm: &MpiComm, ps: usize, workers: usize, ids: usize) {
    let world = comm.raw();
    let mut table = vec![1f32; ids.div_ceil(ps) * DIM];
    let (mut want, mut rows, mut grad) = (Vec::<u64>::new(), Vec::new(), Vec::new());
    let mut done = 0;
    while done < workers {
        let (msg, status) = world.any_process().matched_probe();
        let from = world.process_at_rank(status.source_rank());
        let count = status.count(u64::equivalent_datatype()) as usize;
        match status.tag() {
            PULL => {
                want.resize(count, 0);
                msg.matched_receive_into(&mut want[..]);
                rows.clear();
                for id in &want {
                    let at = (*id as usize / ps) * DIM;
                    rows.extend_from_slice(&table[at..at + DIM]);
                }
                from.send_with_tag(&rows[..], PULL);
            }
            PUSH => {
                want.resize(count, 0);
                msg.matched_receive_into(&mut want[..]);
                grad.resize(count * DIM, 0f32);
                from.receive_into_with_tag(&mut grad[..], VALUES);
                for (id, g) in want.iter().zip(grad.chunks_exact(DIM)) {
                    let at = (*id as usize / ps) * DIM;
                    let row = &mut table[at..at + DIM];
                    row.iter_mut().zip(g).for_each(|(w, g)| *w -= LR * g);
                }
                from.send_with_tag(&[1u8][..], PUSH);
            }
            _ => {
                let mut byte = [0u8; 1];
                msg.matched_receive_into(&mut byte[..]);
                done += 1;
            }
        }
    }
}

/// The largest power of 2 at or below `n` (at least 1).
fn prev_power_of_two(n: usize) -> usize {
    1 << n.max(1).ilog2()
}

pub fn run(
    comm: &MpiComm,
    coll: &Collectives<MpiComm>,
    opts: &BenchOptions,
) -> Result<String, BenchError> {
    let (layout, ps, workers) = super::pushpull::ps_layout(comm, opts)?;
    let (min, max) = opts.sizes.unwrap_or((ROW_BYTES, 4 << 20));
    let (paths, rounds) = opts.plan();
    // Powers of 2 of whole rows (see `ids`).
    let mut sizes: Vec<usize> = (osu::sizes(min.max(ROW_BYTES), max).into_iter())
        .map(|s| prev_power_of_two(s / ROW_BYTES) * ROW_BYTES)
        .collect();
    sizes.dedup();
    let measured = best_of_rounds(
        coll,
        sizes,
        &paths,
        rounds,
        Better::Higher,
        opts.progress,
        |path, size| {
            let rows = size / ROW_BYTES;
            let (iters, warmup) = osu::iterations(opts, size, (100, 10), (20, 4), 1 << 20);
            let warmup = warmup.max(CYCLE);
            let mine = match path {
                Path::Mpi => mpi_rounds(comm, ps, rows, iters, warmup),
                _ => mpiflow_rounds(comm, &layout, rows, iters, warmup)
                    .map_err(|e| BenchError::Validation(e.to_string()))?,
            };
            let secs = super::pushpull::mean_over_workers(coll, mine)?;
            let rate = (workers * 2 * rows) as f64 / 1e6 / secs;
            Ok(Row::point(size, rate, 0))
        },
    )?;
    let title = format!(
        "Rows Pull-Push Test ({workers} workers, {ps} ps, rows of {DIM} floats, size: a worker's rows per round)"
    );
    Ok(measured
        .render(|rows| osu::p2p_table(&title, "MPI_FLOAT", "Rows/s (M)", rows, false, opts.digits)))
}
