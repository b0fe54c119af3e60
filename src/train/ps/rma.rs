//! One-sided parameter server (`mpiflow train --mode ps --transport rma`): each ps shard
//! lives in an MPI window; workers pull with `MPI_Get` and push with `MPI_Accumulate`, so
//! ps processes do no work per request (on RDMA hardware, their CPUs take no part in it).
//!
//! Windows, on each ps `k` (workers expose empty ones):
//! - `data` (f32): `[params | gradient sum | loss sum, sample sum]`, the parameters of
//!   ps `k`'s shards back to back, in placement order;
//! - `ctl` (i64): `[STEP, ARRIVALS, DONE, LOSS bits, ABORT, SAVED step, its bytes, its
//!   checksum, pushes of worker 0, 1, ...]`.
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
//! `MPI_Accumulate`, element-wise atomic); ps processes only wait for `DONE`.
//!
//! Checkpoints (`--sync`): every ps restores its shard from the newest valid checkpoint
//! before the windows open, and after applying a checkpoint step writes its shard file
//! (parameters and optimizer state, the two-sided ps's format) into the checkpoint's
//! staging directory before publishing the step, then its size and checksum in `ctl`; the
//! chief commits the manifest when every ps has saved that step.
//!
//! Every wait has a deadline (`--peer-timeout`): a ps that stops receiving pushes names
//! the worker that did not push, and leaves its number in `ABORT` so that the workers
//! waiting on it stop with the same diagnosis; a worker that sees no new step names the ps.

use std::time::{Duration, Instant};

use super::placement::{self, Shard};
use super::{variables, PsConfig, PsError, Roles};
use crate::cluster::Layout;
use crate::model::{Model, Replica};
use crate::tensor::Tensor;
use crate::train::data::{shard, Batches, Dataset};
use crate::train::events::Event;
use crate::train::optim::{OptimizerKind, Slots};
use crate::train::StepLog;
use crate::transport::comm::{Backoff, Comm};
use crate::transport::mpi::MpiComm;
use crate::transport::rma::{Epoch, RmaError, Window};

const STEP: usize = 0;
const ARRIVALS: usize = 1;
const DONE: usize = 2;
const LOSS: usize = 3;
const ABORT: usize = 4;
const SAVED: usize = 5;
const SAVED_BYTES: usize = 6;
const SAVED_SUM: usize = 7;
const PUSHES: usize = 8;

impl From<RmaError> for PsError {
    fn from(e: RmaError) -> PsError {
        PsError::Setup(e.to_string())
    }
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
/// changed for `timeout`.
fn wait_until(
    timeout: Duration,
    mut read: impl FnMut() -> Result<i64, PsError>,
    done: impl Fn(i64) -> bool,
    stalled: impl FnOnce() -> PsError,
) -> Result<i64, PsError> {
    let mut backoff = Backoff::new(Duration::from_micros(200));
    let (mut last, mut since) = (i64::MIN, Instant::now());
    loop {
        let v = read()?;
        if done(v) {
            return Ok(v);
        }
        if v != last {
            (last, since) = (v, Instant::now());
        } else if since.elapsed() > timeout {
            return Err(stalled());
        }
        backoff.idle();
    }
}

/// Refuses settings the one-sided ps does not implement (the same verdict on every rank,
/// so a launcher can agree on it before starting).
pub fn check_config(cfg: &PsConfig, layout: &Layout) -> Result<(), PsError> {
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
    if cfg.train.checkpoint_dir.is_some() && !cfg.sync {
        return Err(PsError::Setup(
            "--transport rma --async does not write checkpoints: use --sync, or --transport p2p"
                .into(),
        ));
    }
    Ok(())
}

/// Runs this rank's part of one-sided ps training (collective over `comm`: every rank
/// allocates the windows).
pub fn run(
    comm: &MpiComm,
    layout: &Layout,
    model: &dyn Model,
    cfg: &PsConfig,
    train: &Dataset,
    test: &Dataset,
    events: &mut dyn FnMut(&Event),
) -> Result<(), PsError> {
    check_config(cfg, layout)?;
    let roles = Roles::new(layout)?;
    let nw = roles.workers.len();
    let me = comm.rank();
    let mut model = crate::train::initial_replica(model, train, cfg.train.seed)
        .map_err(|e| PsError::Setup(e.to_string()))?;
    let vars = variables(&model);
    let shards = placement::place(&vars, roles.ps.len(), cfg.strategy, cfg.partition_bytes);
    let pieces = pieces(&shards);
    let ps_index = roles.ps.iter().position(|r| *r == me);
    // Elements of each ps's parameters (also where its gradient sum starts).
    let mut held = vec![0; roles.ps.len()];
    for p in &pieces {
        held[p.ps] += p.len;
    }
    let (data_len, ctl_len) = match ps_index {
        Some(k) => (2 * held[k] + 2, PUSHES + nw),
        None => (0, 0),
    };
    let mut data =
        Window::<f32>::allocate(comm, data_len).map_err(|e| PsError::Setup(e.to_string()))?;
    let mut ctl =
        Window::<i64>::allocate(comm, ctl_len).map_err(|e| PsError::Setup(e.to_string()))?;
    // Every rank finds the same one: the directory does not change before training.
    let (restored, warnings) = super::shards::newest(cfg.train.checkpoint_dir.as_deref(), &vars)?;
    let mut prepare = || -> Result<Option<ShardState>, PsError> {
        let Some(k) = ps_index else {
            return Ok(None);
        };
        let mine: Vec<Shard> = shards.iter().filter(|s| s.ps == k).cloned().collect();
        let opt = cfg.train.optimizer;
        // SAFETY: no rank opens an epoch before the barrier below.
        let mem = unsafe { data.local_mut() };
        let (slots, start) = match &restored {
            Some(found) => {
                let (params, slots, step) = super::shards::read(&found.path, &mine, &shards, &opt)?;
                let at = pieces.iter().filter(|p| p.ps == k).map(|p| p.at);
                for (a, p) in at.zip(&params) {
                    mem[a..a + p.len()].copy_from_slice(p);
                }
                (slots, step)
            }
            None => {
                // The same seeded initialiser as every other mode.
                for (p, src) in slices(&model.params, &pieces) {
                    if p.ps == k {
                        mem[p.at..p.at + p.len].copy_from_slice(src);
                    }
                }
                (mine.iter().map(|s| opt.state(s.len)).collect(), 0)
            }
        };
        // SAFETY: as above.
        let c = unsafe { ctl.local_mut() };
        c[STEP] = start as i64;
        c[SAVED] = start as i64;
        c[PUSHES..].fill(start as i64);
        Ok(Some(ShardState {
            shards: mine,
            slots,
            start,
        }))
    };
    // A ps that cannot restore must not leave the others in the barrier below: every
    // rank learns whether all are ready (MPI_Allreduce of a flag) before it.
    let prepared = prepare();
    let mut failed = 0i32;
    mpi::traits::CommunicatorCollectives::all_reduce_into(
        comm.raw(),
        &i32::from(prepared.is_err()),
        &mut failed,
        mpi::collective::SystemOperation::max(),
    );
    let mut state = prepared?;
    if failed != 0 {
        return Err(PsError::Setup(
            "another rank could not set up one-sided training (its error says why)".into(),
        ));
    }
    if me == roles.workers.first().copied().unwrap_or(0) {
        for w in &warnings {
            events(&Event::Warning(w.clone()));
        }
        if let Some(f) = &restored {
            events(&Event::Restored {
                path: f.path.clone(),
                step: f.step,
            });
        }
        events(&Event::Placement(placement::report(
            &shards,
            &vars,
            roles.ps.len(),
        )));
        events(&Event::Note(crate::transport::rma::path_note()));
        let hosts: std::collections::BTreeSet<&str> =
            layout.ranks.iter().map(|r| r.host.as_str()).collect();
        if hosts.len() > 1 && crate::transport::rma::rdma_devices().is_empty() {
            // Measured across network-namespace hosts: 31 steps/s against 3100 for p2p.
            events(&Event::Warning(format!(
                "{} hosts and no RDMA device: one-sided operations between hosts are emulated over TCP messages that each target must poll for; --transport p2p is about 100x faster there",
                hosts.len()
            )));
        }
    }
    mpi::traits::CommunicatorCollectives::barrier(comm.raw());
    let ctx = Rma {
        roles: &roles,
        cfg,
        pieces: &pieces,
        held,
        model_meta: crate::train::checkpoint::state::model_meta(&model.model.describe(), &vars),
    };
    let result = {
        let mut d = data.lock_all()?;
        let c = ctl.lock_all()?;
        match (ps_index, roles.workers.iter().position(|r| *r == me)) {
            (Some(k), _) if cfg.sync => {
                ctx.serve_sync(k, &mut d, &c, state.take().expect("ps state"))
            }
            (Some(k), _) => ctx.serve_async(k, &c),
            (None, Some(w)) => ctx.work(w, &mut model, &d, &c, train, test, events),
            (None, None) => Ok(()),
        }
    };
    result?;
    // Everyone is past its last operation: the collective frees cannot wait on a failure.
    data.free()?;
    ctl.free()?;
    Ok(())
}

/// A sync ps's own state: its shards, their optimizer state, the step it starts from.
struct ShardState {
    shards: Vec<Shard>,
    slots: Vec<Slots>,
    start: u64,
}

/// Whether global step `s` (reached in a run that started at `start`) is checkpointed.
fn checkpoint_due(cfg: &PsConfig, start: u64, s: u64) -> bool {
    let every = cfg.train.checkpoint_every;
    cfg.train.checkpoint_dir.is_some()
        && s > start
        && ((every > 0 && s.is_multiple_of(every)) || s == cfg.train.steps)
}

/// The chief's step report for `steps` global steps that took `took` (the one-sided ps).
fn step_event(
    cfg: &PsConfig,
    workers: usize,
    step: u64,
    loss: f32,
    steps: u64,
    took: Duration,
) -> Event {
    let secs = took.as_secs_f64().max(1e-9);
    // A sync step uses a global batch; an async one a worker's shard of it.
    let per_step = if cfg.sync {
        cfg.train.batch
    } else {
        cfg.train.batch / workers.max(1)
    };
    Event::Step(StepLog {
        step,
        loss,
        steps_per_sec: steps as f64 / secs,
        samples_per_sec: (steps * per_step as u64) as f64 / secs,
        comm_fraction: None,
    })
}

struct Rma<'a> {
    roles: &'a Roles,
    cfg: &'a PsConfig,
    pieces: &'a [Piece],
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

    fn lost(&self, task: String, lost: String) -> PsError {
        PsError::Lost {
            task,
            lost,
            secs: self.cfg.peer_timeout.as_secs(),
        }
    }

    /// The sync ps: apply each step's summed gradient once every worker pushed it.
    fn serve_sync(
        &self,
        k: usize,
        data: &mut Epoch<'_, f32>,
        ctl: &Epoch<'_, i64>,
        state: ShardState,
    ) -> Result<(), PsError> {
        let nw = self.roles.workers.len() as i64;
        let me = self.roles.ps[k];
        let opt = self.cfg.train.optimizer;
        let mine: Vec<&Piece> = self.pieces.iter().filter(|p| p.ps == k).collect();
        let ShardState {
            shards,
            mut slots,
            start,
        } = state;
        let n = self.held[k];
        for step in start..self.cfg.train.steps {
            let want = (step - start + 1) as i64 * nw;
            wait_until(
                self.cfg.peer_timeout,
                || Ok(ctl.fetch_and_add(me, ARRIVALS, 0)?),
                |a| a >= want,
                || {
                    // The first worker whose push count is behind this step.
                    let late = (0..self.roles.workers.len())
                        .find(|w| {
                            ctl.fetch_and_add(me, PUSHES + w, 0)
                                .is_ok_and(|c| c <= step as i64)
                        })
                        .unwrap_or(0);
                    // Tell the others why (best effort: this ps stops either way).
                    let _ = ctl.put(me, ABORT, &[late as i64 + 1]);
                    self.lost(
                        self.roles.task(me),
                        self.roles.task(self.roles.workers[late]),
                    )
                },
            )?;
            // SAFETY: every worker pushed this step (accumulates flushed before it counted
            // its arrival) and now only polls `ctl` until STEP moves, which happens after
            // this returns: nothing touches this window meanwhile.
            let loss = unsafe {
                data.with_local(|mem| {
                    let (params, rest) = mem.split_at_mut(n);
                    let (grads, tail) = rest.split_at_mut(n);
                    let samples = tail[1].max(1.0);
                    let loss = tail[0] / samples;
                    grads.iter_mut().for_each(|g| *g /= samples);
                    for (p, s) in mine.iter().zip(slots.iter_mut()) {
                        opt.apply(
                            &mut params[p.at..p.at + p.len],
                            &grads[p.at..p.at + p.len],
                            s,
                        );
                    }
                    grads.fill(0.0);
                    tail.fill(0.0);
                    // Copied while no rank can touch the window (see above).
                    let snapshot = checkpoint_due(self.cfg, start, step + 1).then(|| {
                        let views: Vec<&[f32]> =
                            mine.iter().map(|p| &params[p.at..p.at + p.len]).collect();
                        super::shards::arrays(k, &shards, &views, &slots, step + 1)
                    });
                    (loss, snapshot)
                })
            }?;
            let (loss, snapshot) = loss;
            if let Some(arrays) = snapshot {
                self.save_shard(k, ctl, step + 1, &arrays)?;
            }
            ctl.put(me, LOSS, &[i64::from(loss.to_bits())])?;
            ctl.fetch_and_add(me, STEP, 1)?;
        }
        Ok(())
    }

    /// Writes this ps's shard of checkpoint `step` into its staging directory and
    /// publishes its size and checksum, then the step, in `ctl` for the chief.
    fn save_shard(
        &self,
        k: usize,
        ctl: &Epoch<'_, i64>,
        step: u64,
        arrays: &crate::train::checkpoint::Arrays,
    ) -> Result<(), PsError> {
        let dir = self.checkpoint_dir();
        let stage = crate::train::checkpoint::staging_dir(dir, step);
        std::fs::create_dir_all(&stage)
            .map_err(|e| PsError::Setup(format!("{}: {e}", stage.display())))?;
        let (bytes, sum) =
            crate::train::checkpoint::write_file(&stage.join(super::shards::file(k)), arrays)?;
        let me = self.roles.ps[k];
        ctl.put(me, SAVED_BYTES, &[bytes as i64, sum as i64])?;
        let before = ctl.fetch_and_add(me, SAVED, 0)?;
        ctl.fetch_and_add(me, SAVED, step as i64 - before)?;
        Ok(())
    }

    /// The chief: commits checkpoint `step` once every ps saved its shard.
    fn commit(
        &self,
        ctl: &Epoch<'_, i64>,
        step: u64,
        events: &mut dyn FnMut(&Event),
    ) -> Result<(), PsError> {
        let me = self.roles.task(self.roles.workers[0]);
        let mut files = Vec::new();
        for (k, r) in self.roles.ps.iter().enumerate() {
            wait_until(
                self.cfg.peer_timeout * 2,
                || Ok(ctl.fetch_and_add(*r, SAVED, 0)?),
                |v| v >= step as i64,
                || self.lost(me.clone(), self.ps_task(k)),
            )?;
            let bytes = ctl.fetch_and_add(*r, SAVED_BYTES, 0)? as u64;
            let sum = ctl.fetch_and_add(*r, SAVED_SUM, 0)? as u64;
            files.push((super::shards::file(k), bytes, sum));
        }
        let dir = self.checkpoint_dir();
        events(&super::shards::commit(
            dir,
            step,
            &files,
            self.model_meta.clone(),
        )?);
        Ok(())
    }

    /// The async ps: nothing to do per request; wait until every worker is done.
    fn serve_async(&self, k: usize, ctl: &Epoch<'_, i64>) -> Result<(), PsError> {
        let ps0 = self.roles.ps[0];
        let nw = self.roles.workers.len() as i64;
        // Progress is any claimed step or finished worker; done is every worker finished.
        wait_until(
            self.cfg.peer_timeout,
            || Ok((ctl.fetch_and_add(ps0, DONE, 0)? << 32) + ctl.fetch_and_add(ps0, STEP, 0)?),
            |v| v >> 32 >= nw,
            || {
                self.lost(
                    self.ps_task(k),
                    "a worker (no step claimed, none finished)".into(),
                )
            },
        )?;
        Ok(())
    }

    /// A worker (the chief too): pull, compute, push, until the last step.
    #[allow(clippy::too_many_arguments)]
    fn work(
        &self,
        w: usize,
        model: &mut Replica<'_>,
        data: &Epoch<'_, f32>,
        ctl: &Epoch<'_, i64>,
        train: &Dataset,
        test: &Dataset,
        events: &mut dyn FnMut(&Event),
    ) -> Result<(), PsError> {
        let cfg = self.cfg;
        let roles = self.roles;
        let nw = roles.workers.len();
        let me = roles.task(roles.workers[w]);
        let chief = w == 0;
        let batches = Batches::new(train.len(), cfg.train.batch, cfg.train.seed);
        let mut grads = model.zeros_like();
        // Where training starts: step 0, or the restored checkpoint's step.
        let start = ctl.fetch_and_add(roles.ps[0], STEP, 0)? as u64;
        let (mut window, mut logged, mut last_loss) = (Instant::now(), start, f32::NAN);
        let mut step = if cfg.sync { start } else { 0 };
        loop {
            let s = if cfg.sync {
                for (k, r) in roles.ps.iter().enumerate() {
                    wait_until(
                        cfg.peer_timeout * 2,
                        || match ctl.fetch_and_add(*r, ABORT, 0)? {
                            0 => Ok(ctl.fetch_and_add(*r, STEP, 0)?),
                            late => Err(PsError::Remote {
                                task: me.clone(),
                                message: self
                                    .lost(
                                        self.ps_task(k),
                                        roles.task(roles.workers[(late - 1) as usize]),
                                    )
                                    .to_string(),
                            }),
                        },
                        |v| v >= step as i64,
                        || self.lost(me.clone(), self.ps_task(k)),
                    )?;
                }
                step
            } else {
                ctl.fetch_and_add(roles.ps[0], STEP, 1)? as u64
            };
            let every = cfg.train.log_every;
            if chief && every > 0 && s / every > logged / every {
                // Sync: the combined batch's loss, from ps 0; async: this worker's own.
                let loss = if cfg.sync {
                    f32::from_bits(ctl.fetch_and_add(roles.ps[0], LOSS, 0)? as u32)
                } else {
                    last_loss
                };
                events(&step_event(cfg, nw, s, loss, s - logged, window.elapsed()));
                (window, logged) = (Instant::now(), s);
            }
            if chief && cfg.sync && checkpoint_due(cfg, start, s) {
                self.commit(ctl, s, events)?;
            }
            step = s + u64::from(cfg.sync);
            if s >= cfg.train.steps {
                break;
            }
            self.pull(model, data)?;
            let global = batches.global(s);
            let mine = shard(&global, w, nw);
            let (x, y) = train.rows(mine);
            let loss = model
                .gradients_into(&x, &y, &mut grads)
                .map_err(|e| PsError::Setup(e.to_string()))?;
            crate::train::guard::check_step(s, loss, &grads).map_err(|source| {
                PsError::NonFinite {
                    task: me.clone(),
                    source,
                }
            })?;
            last_loss = loss;
            let n = mine.len() as f32;
            // In place: the sync ps divides the sum by the samples; async applies SGD.
            // (s is the global step this update counts as: the decay's update s + 1.)
            let scale = if cfg.sync {
                n
            } else {
                -cfg.train.optimizer.lr_at(s + 1)
            };
            for g in grads.iter_mut() {
                g.as_mut_slice::<f32>()
                    .expect("f32")
                    .iter_mut()
                    .for_each(|v| *v *= scale);
            }
            let tail = [loss * n, n];
            data.batch(|b| -> Result<(), RmaError> {
                for (p, g) in slices(&grads, self.pieces) {
                    let r = roles.ps[p.ps];
                    let at = if cfg.sync {
                        self.held[p.ps] + p.at
                    } else {
                        p.at
                    };
                    b.accumulate_sum(r, at, g)?;
                }
                if cfg.sync {
                    for (k, r) in roles.ps.iter().enumerate() {
                        b.accumulate_sum(*r, 2 * self.held[k], &tail)?;
                    }
                }
                Ok(())
            })??;
            if cfg.sync {
                for r in &roles.ps {
                    ctl.fetch_and_add(*r, PUSHES + w, 1)?;
                    ctl.fetch_and_add(*r, ARRIVALS, 1)?;
                }
            }
        }
        if !cfg.sync {
            ctl.fetch_and_add(roles.ps[0], DONE, 1)?;
        }
        if chief {
            if !cfg.sync {
                // The final parameters are those after every worker's last push.
                wait_until(
                    cfg.peer_timeout * 2,
                    || Ok(ctl.fetch_and_add(roles.ps[0], DONE, 0)?),
                    |d| d >= nw as i64,
                    || self.lost(me.clone(), "a worker (not done)".into()),
                )?;
            }
            self.pull(model, data)?;
            crate::train::finish(
                model,
                test,
                cfg.train.steps,
                cfg.train.save_params.as_deref(),
                events,
            )
            .map_err(|e| PsError::Setup(e.to_string()))?;
        }
        Ok(())
    }

    /// Gets every shard straight into the model's tensors (one `MPI_Get` each).
    fn pull(&self, model: &mut Replica<'_>, data: &Epoch<'_, f32>) -> Result<(), PsError> {
        let targets = slices_mut(&mut model.params, self.pieces);
        data.batch(|b| -> Result<(), RmaError> {
            for (p, dst) in targets {
                b.get_into(self.roles.ps[p.ps], p.at, dst)?;
            }
            Ok(())
        })??;
        Ok(())
    }
}

/// Benchmark support (`mpiflow bench pushpull --transport rma`): a model of `floats`
/// floats sliced evenly over the ps tasks' windows; each worker runs `warmup + rounds`
/// rounds of one push (`MPI_Accumulate` of its gradient into every slice) and one pull
/// (`MPI_Get` of every slice), as asynchronous SGD does. The ps ranks do nothing but wait
/// in a barrier. Workers return the mean seconds of a timed round; ps ranks `None`.
pub fn bench_pushpull(
    comm: &MpiComm,
    layout: &Layout,
    floats: usize,
    rounds: usize,
    warmup: usize,
) -> Result<Option<f64>, PsError> {
    let roles = Roles::new(layout)?;
    let me = comm.rank();
    let np = roles.ps.len();
    let slice = floats.div_ceil(np).max(1);
    let range = |k: usize| (k * slice).min(floats)..((k + 1) * slice).min(floats);
    let mine = roles
        .ps
        .iter()
        .position(|r| *r == me)
        .map_or(0, |k| range(k).len());
    let mut w = Window::<f32>::allocate(comm, mine).map_err(|e| PsError::Setup(e.to_string()))?;
    let mut secs = None;
    if roles.workers.contains(&me) {
        let grads = vec![0f32; floats];
        let mut params = vec![0f32; floats];
        let ep = w.lock_all()?;
        let mut start = Instant::now();
        for i in 0..warmup + rounds {
            if i == warmup {
                start = Instant::now();
            }
            ep.batch(|b| -> Result<(), RmaError> {
                for (k, r) in roles.ps.iter().enumerate() {
                    b.accumulate_sum(*r, 0, &grads[range(k)])?;
                }
                Ok(())
            })??;
            ep.batch(|b| -> Result<(), RmaError> {
                for ((k, r), dst) in roles.ps.iter().enumerate().zip(params.chunks_mut(slice)) {
                    debug_assert_eq!(dst.len(), range(k).len());
                    b.get_into(*r, 0, dst)?;
                }
                Ok(())
            })??;
        }
        secs = Some(start.elapsed().as_secs_f64() / rounds.max(1) as f64);
    }
    mpi::traits::CommunicatorCollectives::barrier(comm.raw());
    w.free()?;
    Ok(secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    #[test]
    fn pieces_number_each_ps_from_zero_and_slices_cover_the_tensors() {
        let shards = placement::place(
            &[("a".into(), 10), ("b".into(), 6)],
            2,
            placement::Strategy::Partition,
            16,
        );
        let ps = pieces(&shards);
        for k in 0..2 {
            let mut at: Vec<(usize, usize)> = ps
                .iter()
                .filter(|p| p.ps == k)
                .map(|p| (p.at, p.len))
                .collect();
            at.sort_unstable();
            let mut next = 0;
            for (a, l) in at {
                assert_eq!(a, next);
                next += l;
            }
        }
        let mut t = vec![
            Tensor::zeros(DType::F32, &[10]).unwrap(),
            Tensor::zeros(DType::F32, &[6]).unwrap(),
        ];
        for (i, (p, s)) in slices_mut(&mut t, &ps).into_iter().enumerate() {
            assert_eq!(s.len(), p.len);
            s.fill(i as f32 + 1.0);
        }
        // Every element written exactly by its own piece.
        for p in &ps {
            let v = &t[p.var].as_slice::<f32>().unwrap()[p.offset..p.offset + p.len];
            let i = ps.iter().position(|q| std::ptr::eq(q, p)).unwrap();
            assert!(v.iter().all(|x| *x == i as f32 + 1.0));
        }
    }
}
