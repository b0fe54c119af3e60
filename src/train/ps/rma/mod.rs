//! One-sided parameter server (`mpiflow train --mode ps --transport rma`): each ps shard
//! lives in an MPI window; workers pull with `MPI_Get` and push with `MPI_Accumulate`, so
//! ps processes do no work per request (on RDMA hardware, their CPUs take no part in it).
//!
//! Windows, on each ps `k` (workers expose empty ones):
//! - `data` (f32): `[params | gradient sum | loss sum, sample sum]`, the parameters of
//!   ps `k`'s shards back to back, in placement order;
//! - `ctl` (i64): `[STEP, ARRIVALS, DONE, LOSS (samples and loss bits), ABORT, SAVED step,
//!   its bytes, its checksum, STOP asked, NON_FINITE counts, SAVE_AT step, STOPPED_BY
//!   signal, pushes of worker 0, 1, ...]`.
//!
//! `--sync` (SyncReplicas semantics with every worker aggregated): a worker waits until
//! every ps has published step `s` (`STEP >= s`, read with an atomic `fetch_and_add` of
//! 0), gets the parameters straight into its model's tensors, computes its gradient,
//! scales it in place by its sample count and accumulates it into each ps's gradient sum,
//! with its loss and sample count; after the flush it counts its push (`fetch_and_add` on
//! its slot, then on `ARRIVALS`). The **ps applies the update**, once per step, when
//! `ARRIVALS` reaches the step's count: it divides the sum by the samples (the gradient of
//! the combined batch), runs the optimizer in place on its window memory, clears the sum
//! and publishes `STEP + 1`. Chosen over workers updating under a lock because the
//! optimizer's state (Adam's moments) stays beside the parameters, the update runs once
//! at memory speed instead of once per worker across the network, and no worker holds a
//! lock another must wait for; the ps's CPU works once per step, never per request.
//!
//! `--async`: workers claim steps with `fetch_and_add` on ps 0's `STEP`, get the latest
//! parameters and accumulate `-lr x gradient` into them (plain SGD applied by
//! `MPI_Accumulate`, element-wise atomic); a worker done with the last step adds one to
//! ps 0's `DONE` (the chief then pulls the final parameters), one that ended to its
//! `ARRIVALS`. A ps's CPU works only for checkpoints, until every worker ended.
//!
//! The workers train in the step loop ([`crate::train::engine::Session`]) over the
//! `OneSided` strategy (`worker.rs`). Synchronous, a stop rides with the steps: a
//! worker whose session asks to stop (a signal it noted, a hook's request) writes it into
//! every ps's `STOP` before counting its push; each ps announces it with the next step it
//! publishes (`STEP` marked), so every worker stops after the same step. A worker that
//! ends adds `MARK` to every ps's `ARRIVALS` (and the signal that stopped it to
//! `STOPPED_BY`); a ps ends once every worker has. A ps waits for each worker to push a
//! step or end: where some pushed and another ended, that one failed, and the ps tells
//! the others (`ABORT`: its number, plus `ENDED` where it ended rather than went silent).
//!
//! Checkpoints: every ps restores its shard from the newest valid checkpoint
//! before the windows open. The chief asks for checkpoint `s` (its session's schedule: by
//! steps or seconds, at a stop and at the end) by writing `s` into every ps's `SAVE_AT`;
//! each ps, which holds step `s`'s parameters until every worker pushed step `s`, writes
//! its shard file (parameters and optimizer state, the two-sided ps's format) into the
//! checkpoint's staging directory while it waits, then its size and checksum and the step
//! in `ctl`; the chief commits the manifest when every ps has saved that step.
//! Asynchronous, the chief asks the same way at its own step `s` (a global step: the steps
//! claimed so far), and each ps writes a snapshot of its window read with atomic gets as
//! the pushes go on landing (no optimizer state: plain SGD has none). Resumed, the
//! workers claim from `s`: updates in flight at the snapshot may be in it or done again,
//! as in any asynchronous ps's checkpoint.
//!
//! Every wait has a deadline (`--peer-timeout`): a ps that stops receiving pushes names
//! the worker that did not push, and leaves its number in `ABORT` so that the workers
//! waiting on it stop with the same diagnosis; a worker that sees no new step names the ps.
//!
//! A loss or gradient that is not finite (`--sync`): the worker that found it still
//! pushes, and adds what it found to every ps's `NON_FINITE` before counting its push. A
//! ps that finds that word set applies nothing, leaves it negated in `ABORT`, and ends;
//! every worker reads it there, and all ranks end with the same verdict
//! ([`PsError::NotApplied`], counting the workers) past their last operation, so the
//! windows are freed as after training. Asynchronous (`--async`), where nothing waits for
//! a step: the first worker to find one (a compare-and-swap on ps 0's `NON_FINITE`) stops
//! the job with it; a later finder waits for the job to end on that one line.

mod bench;
mod job;
pub mod rows;
mod serve;
mod worker;

pub use bench::bench_pushpull;
pub use job::{run, scope, scope_with_rows, OneSidedSession};

use std::time::{Duration, Instant};

use super::placement::{self, Shard};
use super::{PsConfig, PsError, Roles};
use crate::cluster::Layout;
use crate::model::{Model, Replica};
use crate::observe::phases::{Clock, Phase, RankTimes, Times};
use crate::observe::stall::{self, Wait};
use crate::observe::timeline::Detail;
use crate::tensor::Tensor;
use crate::train::data::Dataset;
use crate::train::engine::{Session, TrainError};
use crate::train::events::Event;
use crate::train::guard::NonFinite;
use crate::train::optim::{OptimizerKind, Slots};
use crate::transport::comm::{Backoff, Comm};
use crate::transport::rma::{AllocateError, RmaError};
use crate::transport::window::{Access, RmaWindow};
use crate::transport::Collectives;
pub use worker::OneSided;

const STEP: usize = 0;
const ARRIVALS: usize = 1;
const DONE: usize = 2;
const LOSS: usize = 3;
const ABORT: usize = 4;
const SAVED: usize = 5;
const SAVED_BYTES: usize = 6;
const SAVED_SUM: usize = 7;
const STOP: usize = 8;
const NON_FINITE: usize = 9;
const SAVE_AT: usize = 10;
const STOPPED_BY: usize = 11;
/// Workers that ended by a failure (each says why): a ps that sees one ends with an error
/// too, as they do, instead of taking the end for training done.
const FAILED: usize = 12;
const PUSHES: usize = 13;
/// On ps 0's `ctl`, after the pushes: per rank of the job, its phase times summed so far
/// (microseconds of compute, communication, waiting and the rest, then its steps). Each
/// rank adds its window at every logged step; the chief reads them.
const TIME_FIELDS: usize = 5;

/// The unit of the stop marks in counters: `STEP` is `step + signal x MARK` once a ps
/// announces a stop at `step` (async: plus `MARK` per announcement), `ARRIVALS` gains one
/// `MARK` per worker that stopped.
const MARK: i64 = 1 << 40;

/// Added to the late worker's number in `ABORT` where that worker ended (its error says
/// why), not went silent.
const ENDED: i64 = 1 << 32;

/// What a worker writes into `STOP` (and a ps announces) for a hook's request to stop: no
/// signal's number.
const HOOK: i64 = 1 << 16;

impl From<RmaError> for PsError {
    fn from(e: RmaError) -> PsError {
        PsError::Setup(e.to_string())
    }
}

impl From<RmaError> for crate::train::engine::TrainError {
    fn from(e: RmaError) -> Self {
        PsError::from(e).into()
    }
}

/// The `LOSS` word of a step whose combined batch of `samples` had mean `loss`: the
/// samples in the high 32 bits, the loss's bits in the low.
fn loss_word(loss: f32, samples: f32) -> i64 {
    (i64::from(samples as u32) << 32) | i64::from(loss.to_bits())
}

/// The loss and samples of a `LOSS` word ([`loss_word`]).
fn loss_of(word: i64) -> (f32, usize) {
    (f32::from_bits(word as u32), (word >> 32) as usize)
}

/// One shard's place: in the model (`var`, `offset`) and in ps `ps`'s window (`at`).
#[derive(Debug, Clone)]
struct Piece {
    ps: usize,
    at: usize,
    var: usize,
    offset: usize,
    len: usize,
}

fn pieces(shards: &[Shard]) -> Vec<Piece> {
    let mut next = std::collections::BTreeMap::<usize, usize>::new();
    shards
        .iter()
        .map(|s| {
            let at = next.entry(s.ps).or_insert(0);
            let p = Piece {
                ps: s.ps,
                at: *at,
                var: s.var_index,
                offset: s.offset,
                len: s.len,
            };
            *at += s.len;
            p
        })
        .collect()
}

/// Mutable slices of `tensors`, one per piece (pieces of a variable never overlap).
fn slices_mut<'a>(
    tensors: &'a mut [Tensor],
    pieces: &'a [Piece],
) -> Vec<(&'a Piece, &'a mut [f32])> {
    let mut out = Vec::with_capacity(pieces.len());
    for (v, t) in tensors.iter_mut().enumerate() {
        let mut mine: Vec<&Piece> = pieces.iter().filter(|p| p.var == v).collect();
        mine.sort_by_key(|p| p.offset);
        let mut rest = t.as_mut_slice::<f32>().expect("f32 parameters");
        let mut cursor = 0;
        for p in mine {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(p.offset - cursor);
            let (slice, tail) = tail.split_at_mut(p.len);
            out.push((p, slice));
            rest = tail;
            cursor = p.offset + p.len;
        }
    }
    out
}

fn slices<'a>(tensors: &'a [Tensor], pieces: &'a [Piece]) -> Vec<(&'a Piece, &'a [f32])> {
    pieces
        .iter()
        .map(|p| {
            let t = tensors[p.var].as_slice::<f32>().expect("f32 parameters");
            (p, &t[p.offset..p.offset + p.len])
        })
        .collect()
}

/// Polls `read` until `done` holds; `stalled` names the culprit when the value has not
/// changed for `timeout`. Each poll first lets the operations other ranks aim at this one
/// progress (`ctl`'s [`Access::poke`]: MPI's progress engine, which yields the CPU itself
/// where MPI yields when idle: [`Backoff::polling_mpi`]).
fn wait_until(
    ctl: &impl Access<i64>,
    timeout: Duration,
    mut read: impl FnMut() -> Result<i64, PsError>,
    done: impl Fn(i64) -> bool,
    stalled: impl FnOnce() -> PsError,
) -> Result<i64, PsError> {
    wait_alive(ctl, timeout, || Ok((read()?, 0)), done, stalled)
}

/// [`wait_until`] whose `read` also gives a sign of life of the peer waited on: a change
/// of either value is progress. A ps writing a checkpoint counts its `SAVED` word down
/// while it writes ([`write_saving`]): work, not silence.
fn wait_alive(
    ctl: &impl Access<i64>,
    timeout: Duration,
    mut read: impl FnMut() -> Result<(i64, i64), PsError>,
    done: impl Fn(i64) -> bool,
    stalled: impl FnOnce() -> PsError,
) -> Result<i64, PsError> {
    let mut backoff = Backoff::polling_mpi(Duration::from_micros(200));
    let (mut last, mut since) = ((i64::MIN, i64::MIN), Instant::now());
    loop {
        ctl.poke()?;
        let (v, alive) = read()?;
        if done(v) {
            return Ok(v);
        }
        if (v, alive) != last {
            (last, since) = ((v, alive), Instant::now());
        } else if since.elapsed() > timeout {
            return Err(stalled());
        }
        backoff.idle();
    }
}

/// Writes ps `k`'s (rank `me`'s) shard file of checkpoint `step` into its staging
/// directory under `dir`, marking its `SAVED` word (index `saved`) every third of
/// `timeout` meanwhile, one down each time (below any step it will report): what the
/// chief and the workers waiting on this ps read as a sign of life. The file's bytes and
/// checksum, or why it could not be written.
fn write_saving(
    ctl: &impl Access<i64>,
    (me, saved): (usize, usize),
    timeout: Duration,
    (dir, step, k): (&std::path::Path, u64, usize),
    arrays: &crate::train::checkpoint::Arrays,
) -> Result<Result<(u64, u64), String>, PsError> {
    let stage = crate::train::checkpoint::staging_dir(dir, step);
    if let Err(e) = std::fs::create_dir_all(&stage) {
        return Ok(Err(format!("{}: {e}", stage.display())));
    }
    let path = stage.join(super::shards::file(k));
    let beat = || {
        ctl.fetch_and_add(me, saved, -1)
            .map(drop)
            .map_err(PsError::from)
    };
    let written = crate::train::checkpoint::write_file_beating(&path, arrays, timeout / 3, beat)?;
    Ok(written.map_err(|e| e.to_string()))
}

/// Refuses settings the one-sided ps does not implement (the same verdict on every rank,
/// so a launcher can agree on it before starting).
pub fn check_config(cfg: &PsConfig, layout: &Layout) -> Result<(), PsError> {
    super::check_config(cfg, layout)?;
    let nw = Roles::new(layout)?.workers.len();
    if cfg.replicas_to_aggregate.is_some_and(|r| r != nw) {
        return Err(PsError::Setup(format!(
            "--transport rma aggregates every worker's gradient each step: --replicas-to-aggregate must be {nw} (or left out)"
        )));
    }
    if !cfg.sync && cfg.train.optimizer.kind != OptimizerKind::Sgd {
        return Err(PsError::Setup(
            "--transport rma --async applies plain SGD with MPI_Accumulate: use --optimizer sgd, or --sync".into(),
        ));
    }
    if !cfg.tables.is_empty() && !cfg.sync {
        rows::async_lr(&cfg.sparse).map_err(PsError::Setup)?;
    }
    Ok(())
}

/// A window of `T` of communicator `C`, open for one-sided operations.
type Open<'a, C, T> = <<C as Comm>::Window<T> as RmaWindow<T>>::Open<'a>;

/// What a worker adds to every ps's `NON_FINITE` for what it found: three 20-bit counts,
/// of NaN losses, of infinite losses, and of gradients alone not finite.
fn non_finite_code(found: &NonFinite) -> i64 {
    match found {
        NonFinite::Loss { value, .. } if value == "NaN" => 1,
        NonFinite::Loss { .. } => 1 << 20,
        NonFinite::Gradient { .. } | NonFinite::Gradients { .. } => 1 << 40,
    }
}

/// The verdict on step `step` of `workers` workers whose `NON_FINITE` word reads `code`,
/// the same on every rank: the loss (NaN before inf) if any worker's was not finite.
fn not_applied(step: u64, code: i64, workers: usize) -> PsError {
    let count = |field: u32| ((code >> (20 * field)) & 0xF_FFFF) as usize;
    let (nan, inf, grads) = (count(0), count(1), count(2));
    let whose = format!(" on {} of {workers} workers", nan + inf + grads);
    let loss = |value: &str| NonFinite::Loss {
        step,
        value: value.into(),
        whose: whose.clone(),
    };
    PsError::NotApplied(match (nan, inf) {
        (0, 0) => NonFinite::Gradient {
            step,
            tensor: "(the summed gradients)".into(),
            value: "a non-finite value".into(),
            whose: whose.clone(),
        },
        (0, _) => loss("inf"),
        _ => loss("NaN"),
    })
}

/// A ps's own state: its index among the ps tasks, its shards, their optimizer state,
/// the step it starts from.
struct ShardState {
    k: usize,
    shards: Vec<Shard>,
    slots: Vec<Slots>,
    start: u64,
}

struct Rma<'a> {
    roles: &'a Roles,
    cfg: &'a PsConfig,
    pieces: &'a [Piece],
    /// Ranks in the job.
    ranks: usize,
    /// Elements of each ps's parameters (the offset of its gradient sum).
    held: Vec<usize>,
    /// The model's description for checkpoint manifests.
    model_meta: serde_json::Value,
}

impl Rma<'_> {
    /// Where checkpoints go: called only when one is due, which needs a directory.
    fn checkpoint_dir(&self) -> &std::path::Path {
        let dir = self.cfg.train.checkpoint_dir.as_deref();
        dir.expect("a checkpoint is due only with --checkpoint-dir")
    }

    fn ps_task(&self, k: usize) -> String {
        self.roles.task(self.roles.ps[k])
    }

    /// This rank's end when the job stops at `step` for `signal`.
    fn stopped(&self, signal: i32, step: u64) -> PsError {
        let dir = self.cfg.train.checkpoint_dir.as_deref();
        PsError::Stopped(crate::train::Stopped {
            signal: crate::signals::name(signal),
            step,
            checkpoint: dir.map(|d| crate::train::checkpoint::path_of(d, step)),
        })
    }

    /// Adds `t`, this rank's (`rank`'s) window, to its phase-time counters on ps 0
    /// (one accumulate, element-wise atomic).
    fn report_times(&self, ctl: &impl Access<i64>, rank: usize, t: &Times) -> Result<(), PsError> {
        let us = |s: f64| (s * 1e6).round() as i64;
        let v = [
            us(t.compute),
            us(t.comm),
            us(t.wait),
            us(t.other),
            t.steps as i64,
        ];
        let at = PUSHES + self.roles.workers.len() + TIME_FIELDS * rank;
        ctl.accumulates([(self.roles.ps[0], at, &v[..])])?;
        Ok(())
    }

    /// The chief: each rank's phase times since the last read (`seen`, its counters
    /// then), in rank order; ranks that never reported are left out.
    fn read_times(
        &self,
        ctl: &impl Access<i64>,
        seen: &mut [[i64; TIME_FIELDS]],
    ) -> Result<Vec<RankTimes>, PsError> {
        let base = PUSHES + self.roles.workers.len();
        let mut out = Vec::new();
        for (rank, before) in seen.iter_mut().enumerate().take(self.ranks) {
            let mut now = [0i64; TIME_FIELDS];
            for (i, v) in now.iter_mut().enumerate() {
                // An atomic read: accumulates may land meanwhile (asynchronous training).
                *v = ctl.fetch_and_add(self.roles.ps[0], base + TIME_FIELDS * rank + i, 0)?;
            }
            if now == [0; TIME_FIELDS] {
                continue;
            }
            let d = |i: usize| (now[i] - before[i]) as f64 / 1e6;
            out.push(RankTimes {
                rank,
                task: self.roles.task_name(rank),
                times: Times {
                    compute: d(0),
                    comm: d(1),
                    wait: d(2),
                    other: d(3),
                    steps: (now[4] - before[4]).max(0) as u64,
                },
            });
            *before = now;
        }
        Ok(out)
    }

    /// What a pull or a push moves (bytes of every shard) and with whom, for the
    /// timeline.
    fn moved(&self) -> (usize, std::sync::Arc<str>) {
        let bytes = 4 * self.pieces.iter().map(|p| p.len).sum::<usize>();
        let peer = match self.roles.ps.as_slice() {
            [one] => self.roles.task_name(*one),
            all => format!("{} ps tasks", all.len()),
        };
        (bytes, peer.into())
    }

    /// Marks a wait of `op` at `step` on ps `k` (for stall reports).
    fn waiting(&self, op: &'static str, step: u64, k: usize) -> stall::Waiting<'static> {
        stall::wait(|| Wait {
            op,
            step,
            what: None,
            peer: Some(self.roles.task_name(self.roles.ps[k]).into()),
            bytes: 0,
        })
    }

    fn lost(&self, task: String, lost: String) -> PsError {
        PsError::Lost {
            task,
            lost,
            secs: self.cfg.peer_timeout.as_secs(),
        }
    }
}

#[cfg(test)]
mod tests;
