//! Parameter-server training (`mpiflow train --mode ps`).
//!
//! ps tasks hold the variables (placed by [`super::placement`]) and apply the optimizer;
//! workers pull parameters, compute gradients on their shard of each global batch, and
//! push them. The chief (`chief:0`, else `worker:0`) initialises or restores the variables,
//! writes checkpoints and logs.
//!
//! Protocol: one message per request (`[u32 n | JSON header of n bytes | f32 payload]`,
//! tag [`Reserved::PsRequest`], worker to ps) and one per reply (same framing, tag
//! [`Reserved::PsReply`]). A ps serves any
//! worker's request as it arrives (`MPI_Improbe` + `MPI_Mrecv` on any source): pulls that
//! must wait for a step are parked, never block the loop.
//!
//! Semantics (TensorFlow's `SyncReplicasOptimizer`, plus):
//! - `--sync`: a step's update is applied when `replicas_to_aggregate` fresh gradients have
//!   arrived, averaged weighted by each worker's sample count (so the update equals the
//!   gradient of the combined batch) and summed in worker order (so it is reproducible);
//!   late gradients of a finished step are dropped as stale; `global_step` counts updates;
//!   pulls for step `s` wait until `global_step >= s`.
//! - `--async`: each push is applied as it arrives; pulls return the latest values.
//! - Failure: every wait has a deadline. A ps that stops hearing from a worker it needs
//!   tells every worker and stops, naming the lost task; a worker whose ps does not answer
//!   stops naming that ps. (Run OpenMPI with `--mca orte_enable_recovery 1` to let mpiflow
//!   report it; by default mpirun ends the whole job at once itself.)
//! - Bad requests (unknown variable, wrong length) are answered with an error to that
//!   worker; the ps keeps serving the others.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::checkpoint::{self, Arrays};
use super::data::{shard, Batches, Dataset};
use super::optim::{Optimizer, Slots};
use super::placement::{self, Shard, Strategy};
use super::{StepLog, TrainConfig};
use crate::cluster::{Layout, TaskId};
use crate::model::{Model, Replica};
use crate::transport::comm::{Backoff, Comm, TransportError};
use crate::transport::tags::Reserved;

/// The tag of requests (worker to ps), reserved at the top of the tag range.
fn req<C: Comm>(c: &C) -> i32 {
    c.tags().reserved(Reserved::PsRequest)
}

/// The tag of replies (ps to worker).
fn rep<C: Comm>(c: &C) -> i32 {
    c.tags().reserved(Reserved::PsReply)
}

/// How workers reach the ps tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PsTransport {
    /// Two-sided messages: the ps serves each request (this module).
    #[default]
    P2p,
    /// One-sided MPI windows: workers get and accumulate; the ps works once per step
    /// ([`super::rma_ps`]).
    Rma,
}

/// Settings of ps training.
#[derive(Debug, Clone)]
pub struct PsConfig {
    pub train: TrainConfig,
    pub sync: bool,
    /// Default: the number of workers.
    pub replicas_to_aggregate: Option<usize>,
    pub strategy: Strategy,
    pub partition_bytes: usize,
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N global steps (0: only at the end).
    pub checkpoint_every: u64,
    pub peer_timeout: Duration,
    /// The chief writes the final parameters here.
    pub save_params: Option<PathBuf>,
}

/// Errors of ps training.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PsError {
    #[error("{0}")]
    Transport(#[from] TransportError),
    #[error("{0}")]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error("{task}: lost {lost}: no message for {secs} s (it died or hangs); stopping")]
    Lost {
        task: String,
        lost: String,
        secs: u64,
    },
    #[error("{task}: stopped by a ps: {message}")]
    Remote { task: String, message: String },
    #[error("{0}")]
    Setup(String),
}

/// Who is who in ps mode.
pub(crate) struct Roles {
    pub(crate) ps: Vec<usize>,
    pub(crate) workers: Vec<usize>,
    tasks: BTreeMap<usize, TaskId>,
}

impl Roles {
    pub(crate) fn new(layout: &Layout) -> Result<Roles, PsError> {
        let mut ps: Vec<(usize, usize)> = Vec::new();
        let mut workers: Vec<(usize, usize)> = Vec::new();
        let mut tasks = BTreeMap::new();
        for r in &layout.ranks {
            let rank = r
                .rank
                .ok_or_else(|| PsError::Setup("ps mode needs ranks (run under mpirun)".into()))?;
            tasks.insert(rank, r.task.clone());
            match r.task.job.as_str() {
                "ps" => ps.push((r.task.index, rank)),
                "chief" | "worker" => {
                    workers.push((layout.spec.worker_id(&r.task).expect("a worker"), rank))
                }
                _ => {}
            }
        }
        if ps.is_empty() {
            return Err(PsError::Setup(
                "ps mode needs at least one ps task (--ps N)".into(),
            ));
        }
        ps.sort_unstable();
        workers.sort_unstable();
        Ok(Roles {
            ps: ps.into_iter().map(|x| x.1).collect(),
            workers: workers.into_iter().map(|x| x.1).collect(),
            tasks,
        })
    }

    pub(crate) fn task(&self, rank: usize) -> String {
        self.tasks
            .get(&rank)
            .map_or(format!("rank {rank}"), |t| format!("{t} (rank {rank})"))
    }
}

fn encode(header: &Value, payload: &[f32]) -> Vec<u8> {
    encode_parts(header, &[payload])
}

/// The bytes of floats as they travel (little-endian).
fn f32_bytes(x: &[f32]) -> &[u8] {
    #[cfg(not(target_endian = "little"))]
    compile_error!("the ps wire format assumes a little-endian machine");
    // SAFETY: any f32 slice is a valid byte slice of 4x its length (u8 has alignment 1).
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

/// One message from a header and several float slices, copied once.
fn encode_parts(header: &Value, parts: &[&[f32]]) -> Vec<u8> {
    let h = header.to_string();
    let floats: usize = parts.iter().map(|p| p.len()).sum();
    let mut out = Vec::with_capacity(4 + h.len() + 4 * floats);
    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
    out.extend_from_slice(h.as_bytes());
    for p in parts {
        out.extend_from_slice(f32_bytes(p));
    }
    out
}

fn decode(bytes: &[u8]) -> Option<(Value, Vec<f32>)> {
    let n = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let header = serde_json::from_slice(bytes.get(4..4 + n)?).ok()?;
    let rest = &bytes[4 + n..];
    if !rest.len().is_multiple_of(4) {
        return None;
    }
    let mut floats: Vec<f32> = Vec::with_capacity(rest.len() / 4);
    // SAFETY: the allocation holds rest.len() bytes; the regions do not overlap; every bit
    // pattern is a valid f32; the length is set only once all elements are written (one
    // memcpy, no zeroing first).
    unsafe {
        std::ptr::copy_nonoverlapping(rest.as_ptr(), floats.as_mut_ptr().cast::<u8>(), rest.len());
        floats.set_len(rest.len() / 4);
    }
    Some((header, floats))
}

/// Waits for a message from `src` with a deadline, yielding the CPU while it waits (busy
/// waiting starves oversubscribed ranks).
fn receive_within<C: Comm>(
    c: &C,
    src: usize,
    tag: i32,
    deadline: Duration,
) -> Result<Option<(usize, Vec<u8>)>, TransportError> {
    let start = Instant::now();
    let mut backoff = Backoff::new(Duration::from_micros(50));
    loop {
        if let Some(m) = c.try_receive(src, tag, deadline)? {
            return Ok(Some(m));
        }
        if start.elapsed() > deadline {
            return Ok(None);
        }
        backoff.idle();
    }
}

/// How a bounded send ended.
enum Sent {
    /// Completed; with the watched peer's message if one arrived meanwhile (its reply can
    /// arrive before the send's completion is visible here).
    Done(Option<Vec<u8>>),
    /// Not completed within the deadline (the peer is gone or stuck).
    TimedOut,
    /// While waiting, the watched peer sent an error (an abort): here it is.
    Interrupted(Vec<u8>),
}

/// True for a reply that is not `ok` (an error or an abort).
fn is_error_reply(m: &[u8]) -> bool {
    decode(m).is_none_or(|(h, _)| h["ok"] != json!(true))
}

/// Sends `bytes` to `to`, waiting at most `deadline` for completion, and meanwhile takes a
/// reply from `watch` if one arrives (a ps that aborts while this worker is still
/// pushing to it). A send that never completes keeps its buffer alive (leaked) for as
/// long as MPI may read it: the process is about to stop anyway.
fn send_within<C: Comm>(
    c: &C,
    bytes: Vec<u8>,
    to: usize,
    tag: i32,
    deadline: Duration,
    watch: Option<usize>,
) -> Result<Sent, TransportError> {
    // SAFETY: `bytes` stays alive until the request completes, or forever if it does not.
    let mut req = unsafe { c.isend(bytes.as_ptr(), bytes.len(), to, tag)? };
    let start = Instant::now();
    let mut backoff = Backoff::new(Duration::from_micros(50));
    let mut early: Option<Vec<u8>> = None;
    loop {
        if c.test(&mut req)?.is_some() {
            return Ok(Sent::Done(early));
        }
        if let (Some(w), None) = (watch, &early) {
            if let Some((_, m)) = c.try_receive(w, rep(c), deadline)? {
                if is_error_reply(&m) {
                    std::mem::forget(bytes);
                    std::mem::forget(req);
                    return Ok(Sent::Interrupted(m));
                }
                early = Some(m);
            }
        }
        if start.elapsed() > deadline {
            std::mem::forget(bytes);
            std::mem::forget(req);
            return Ok(Sent::TimedOut);
        }
        backoff.idle();
    }
}

/// The variables of the model: name and element count, in creation order.
pub(crate) fn variables(model: &Replica<'_>) -> Vec<(String, usize)> {
    model
        .params
        .iter()
        .map(|p| (p.name().to_string(), p.numel()))
        .collect()
}

/// Runs this rank's part (ps, worker or chief) of ps training.
pub fn run<C: Comm>(
    comm: &C,
    layout: &Layout,
    model: &dyn Model,
    cfg: &PsConfig,
    train: &Dataset,
    test: &Dataset,
    log: &mut dyn FnMut(&str),
) -> Result<(), PsError> {
    let roles = Roles::new(layout)?;
    let me = comm.rank();
    let model = super::initial_replica(model, train, cfg.train.seed)
        .map_err(|e| PsError::Setup(e.to_string()))?;
    let vars = variables(&model);
    let shards = placement::place(&vars, roles.ps.len(), cfg.strategy, cfg.partition_bytes);
    let rta = cfg
        .replicas_to_aggregate
        .unwrap_or(roles.workers.len())
        .clamp(1, roles.workers.len().max(1));
    if let Some(k) = roles.ps.iter().position(|r| *r == me) {
        let mine: Vec<Shard> = shards.iter().filter(|s| s.ps == k).cloned().collect();
        return Server::new(comm, &roles, k, mine, cfg, rta).serve();
    }
    let Some(w) = roles.workers.iter().position(|r| *r == me) else {
        log(&format!(
            "# {}: not part of ps training (evaluator); idle",
            roles.task(me)
        ));
        return Ok(());
    };
    if w == 0 {
        log(&placement::report(&shards, &vars, roles.ps.len()));
    }
    Worker {
        comm,
        roles: &roles,
        w,
        shards: &shards,
        cfg,
        model,
        train,
        test,
    }
    .run(log)
}

/// The newest valid checkpoint of `--checkpoint-dir` (created if missing), refused if
/// another number of ps tasks wrote it, and a warning for each newer one that did not
/// verify. Both ps transports restore from it.
pub(crate) fn newest_checkpoint(
    cfg: &PsConfig,
    num_ps: usize,
) -> Result<(Option<checkpoint::Found>, Vec<String>), PsError> {
    let Some(dir) = &cfg.checkpoint_dir else {
        return Ok((None, Vec::new()));
    };
    std::fs::create_dir_all(dir)
        .map_err(|e| PsError::Setup(format!("checkpoint dir {}: {e}", dir.display())))?;
    let (found, warnings) = checkpoint::latest(dir);
    if let Some(f) = &found {
        let n = f.meta["num_ps"].as_u64().unwrap_or(0) as usize;
        if n != num_ps {
            return Err(PsError::Setup(format!(
                "checkpoint {} was written by {n} ps tasks, this job has {num_ps}",
                f.path.display()
            )));
        }
    }
    Ok((found, warnings))
}

/// The chief's last act of a checkpoint: the manifest over every ps's shard file (name,
/// bytes, checksum), committed atomically, and the log line.
pub(crate) fn commit_checkpoint(
    dir: &std::path::Path,
    step: u64,
    files: &[(String, u64, u64)],
    num_ps: usize,
    log: &mut dyn FnMut(&str),
) -> Result<(), PsError> {
    let path = checkpoint::commit(dir, step, files, json!({"num_ps": num_ps}))?;
    log(&format!("# checkpoint {} written", path.display()));
    Ok(())
}

/// ps `k`'s checkpoint file contents: each shard's parameters and optimizer state, by
/// `var@offset` (the format both ps transports write and read).
pub(crate) fn shard_arrays(
    k: usize,
    shards: &[Shard],
    params: &[&[f32]],
    slots: &[Slots],
    step: u64,
) -> Arrays {
    let mut arrays = Vec::new();
    for ((s, p), sl) in shards.iter().zip(params).zip(slots) {
        let key = format!("{}@{}", s.var, s.offset);
        arrays.push((format!("{key}/param"), p.to_vec()));
        arrays.push((format!("{key}/m"), sl.m.clone()));
        arrays.push((format!("{key}/v"), sl.v.clone()));
    }
    Arrays {
        step,
        meta: json!({"ps": k, "t": slots.first().map_or(0, |s| s.t)}),
        arrays,
    }
}

/// The chief's log line for `steps` global steps that took `took` (both ps transports).
pub(crate) fn step_line(
    cfg: &PsConfig,
    workers: usize,
    step: u64,
    loss: f32,
    steps: u64,
    took: Duration,
) -> String {
    let secs = took.as_secs_f64().max(1e-9);
    // A sync step uses a global batch; an async one a worker's shard of it.
    let per_step = if cfg.sync {
        cfg.train.batch
    } else {
        cfg.train.batch / workers.max(1)
    };
    StepLog {
        step,
        loss,
        steps_per_sec: steps as f64 / secs,
        samples_per_sec: (steps * per_step as u64) as f64 / secs,
    }
    .line()
}

/// The file name of ps `k`'s shard in a checkpoint.
pub(crate) fn shard_file(k: usize) -> String {
    format!("shard-ps{k}.bin")
}

/// One ps's restored state: parameters and optimizer state per shard, and the step.
pub(crate) type ShardContents = (Vec<Vec<f32>>, Vec<Slots>, u64);

/// Reads ps `k`'s shard from checkpoint `dir`; an error (never a partial result) if
/// anything is missing or mis-sized.
pub(crate) fn read_shard(
    dir: &std::path::Path,
    k: usize,
    shards: &[Shard],
) -> Result<ShardContents, String> {
    let a = checkpoint::read_file(&dir.join(shard_file(k)), None).map_err(|e| e.to_string())?;
    let t = a.meta["t"].as_u64().unwrap_or(a.step);
    let mut params = Vec::new();
    let mut slots = Vec::new();
    for s in shards {
        let key = format!("{}@{}", s.var, s.offset);
        let get = |suffix: &str| {
            a.get(&format!("{key}/{suffix}"))
                .map(<[f32]>::to_vec)
                .ok_or(format!(
                    "checkpoint {} has no {key}/{suffix} (written with another placement?)",
                    dir.display()
                ))
        };
        let p = get("param")?;
        if p.len() != s.len {
            return Err(format!(
                "checkpoint {}: {key} has {} elements, expected {}",
                dir.display(),
                p.len(),
                s.len
            ));
        }
        params.push(p);
        slots.push(Slots {
            m: get("m")?,
            v: get("v")?,
            t,
        });
    }
    Ok((params, slots, a.step))
}

// ---------------------------------------------------------------------------------------
// The server.

struct Server<'a, C: Comm> {
    comm: &'a C,
    roles: &'a Roles,
    k: usize,
    shards: Vec<Shard>,
    params: Vec<Vec<f32>>,
    slots: Vec<Slots>,
    opt: Optimizer,
    sync: bool,
    rta: usize,
    global_step: u64,
    initialized: bool,
    /// Parked pulls: (worker rank, step wanted).
    pending: Vec<(usize, u64)>,
    /// Gradients of the current step by worker index: (samples, loss, per-shard gradients).
    accum: BTreeMap<usize, (f32, f32, Vec<Vec<f32>>)>,
    last_loss: f32,
    done: Vec<bool>,
    heard: Vec<Instant>,
    timeout: Duration,
}

impl<'a, C: Comm> Server<'a, C> {
    fn new(
        comm: &'a C,
        roles: &'a Roles,
        k: usize,
        shards: Vec<Shard>,
        cfg: &PsConfig,
        rta: usize,
    ) -> Self {
        let opt = Optimizer::new(cfg.train.optimizer, cfg.train.lr);
        let nw = roles.workers.len();
        Server {
            comm,
            roles,
            k,
            params: shards.iter().map(|s| vec![0.0; s.len]).collect(),
            slots: shards.iter().map(|s| opt.state(s.len)).collect(),
            shards,
            opt,
            sync: cfg.sync,
            rta,
            global_step: 0,
            initialized: false,
            pending: Vec::new(),
            accum: BTreeMap::new(),
            last_loss: f32::NAN,
            done: vec![false; nw],
            heard: vec![Instant::now(); nw],
            timeout: cfg.peer_timeout,
        }
    }

    fn me(&self) -> String {
        self.roles.task(self.comm.rank())
    }

    fn reply(&self, to: usize, header: Value, payload: &[f32]) -> Result<(), PsError> {
        self.send_reply(to, encode(&header, payload))
    }

    fn send_reply(&self, to: usize, message: Vec<u8>) -> Result<(), PsError> {
        if let Sent::Done(_) =
            send_within(self.comm, message, to, rep(self.comm), self.timeout, None)?
        {
            return Ok(());
        }
        let err = PsError::Lost {
            task: self.me(),
            lost: self.roles.task(to),
            secs: self.timeout.as_secs(),
        };
        self.abort_all(to, &err);
        Err(err)
    }

    /// Tells every worker but `lost` (and those done) that training stops, and why.
    fn abort_all(&self, lost: usize, err: &PsError) {
        let message = encode(&json!({"ok": false, "error": err.to_string()}), &[]);
        for (i, r) in self.roles.workers.iter().enumerate() {
            if *r != lost && !self.done[i] {
                let _ = send_within(
                    self.comm,
                    message.clone(),
                    *r,
                    rep(self.comm),
                    Duration::from_secs(1),
                    None,
                );
            }
        }
    }

    fn error(&self, to: usize, message: String) -> Result<(), PsError> {
        self.reply(to, json!({"ok": false, "error": message}), &[])
    }

    fn labels(&self) -> Vec<(String, usize)> {
        self.shards
            .iter()
            .map(|s| (format!("{}@{}", s.var, s.offset), s.len))
            .collect()
    }

    /// Checks a request's variable list against this ps's shards.
    fn check_vars(&self, header: &Value, payload: &[f32]) -> Result<(), String> {
        let want = self.labels();
        let got: Vec<(String, usize)> = header["vars"]
            .as_array()
            .map(|v| {
                v.iter()
                    .map(|e| {
                        (
                            e[0].as_str().unwrap_or("?").to_string(),
                            e[1].as_u64().unwrap_or(0) as usize,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        for (name, len) in &got {
            match want.iter().find(|(n, _)| n == name) {
                None => {
                    return Err(format!(
                        "unknown variable '{name}' (ps:{} holds {})",
                        self.k,
                        want.iter()
                            .map(|w| w.0.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                }
                Some((_, l)) if l != len => {
                    return Err(format!(
                        "variable '{name}' has {l} elements on ps:{}, the push has {len}",
                        self.k
                    ))
                }
                _ => {}
            }
        }
        if got.len() != want.len() || got.iter().zip(&want).any(|(a, b)| a.0 != b.0) {
            return Err(format!(
                "push must list ps:{}'s variables in order: {:?}",
                self.k,
                want.iter().map(|w| &w.0).collect::<Vec<_>>()
            ));
        }
        let total: usize = want.iter().map(|w| w.1).sum();
        if payload.len() != total {
            return Err(format!(
                "push carries {} floats, the variables need {total}",
                payload.len()
            ));
        }
        Ok(())
    }

    fn answer_pending(&mut self) -> Result<(), PsError> {
        let ready: Vec<(usize, u64)> = self
            .pending
            .iter()
            .copied()
            .filter(|(_, s)| self.initialized && (!self.sync || self.global_step >= *s))
            .collect();
        self.pending
            .retain(|(_, s)| !(self.initialized && (!self.sync || self.global_step >= *s)));
        if ready.is_empty() {
            return Ok(());
        }
        let parts: Vec<&[f32]> = self.params.iter().map(Vec::as_slice).collect();
        let header = json!({"ok": true, "step": self.global_step, "loss": self.last_loss});
        let message = encode_parts(&header, &parts);
        for (to, _) in ready {
            self.send_reply(to, message.clone())?;
        }
        Ok(())
    }

    /// Applies one averaged update from the gradients in `accum` (sync) or `grads` (async).
    fn apply(&mut self, grads: &[Vec<f32>]) {
        for ((p, g), s) in self.params.iter_mut().zip(grads).zip(&mut self.slots) {
            self.opt.apply(p, g, s);
        }
        self.global_step += 1;
    }

    fn split(&self, flat: &[f32]) -> Vec<Vec<f32>> {
        let mut out = Vec::with_capacity(self.shards.len());
        let mut off = 0;
        for s in &self.shards {
            out.push(flat[off..off + s.len].to_vec());
            off += s.len;
        }
        out
    }

    fn handle(&mut self, from: usize, bytes: &[u8]) -> Result<(), PsError> {
        let Some(w) = self.roles.workers.iter().position(|r| *r == from) else {
            return Ok(()); // not a worker: ignore
        };
        self.heard[w] = Instant::now();
        let Some((h, payload)) = decode(bytes) else {
            return self.error(from, "malformed request".into());
        };
        let step = h["step"].as_u64().unwrap_or(0);
        match h["op"].as_str().unwrap_or("") {
            "init" => {
                if let Err(e) = self.check_vars(&h, &payload) {
                    return self.error(from, e);
                }
                self.params = self.split(&payload);
                self.slots = self.shards.iter().map(|s| self.opt.state(s.len)).collect();
                self.global_step = 0;
                self.initialized = true;
                self.reply(from, json!({"ok": true}), &[])?;
                self.answer_pending()
            }
            "restore" => {
                let path = PathBuf::from(h["path"].as_str().unwrap_or_default());
                match self.restore(&path) {
                    Ok(()) => {
                        self.reply(from, json!({"ok": true, "step": self.global_step}), &[])?;
                        self.answer_pending()
                    }
                    Err(e) => self.error(from, e),
                }
            }
            "pull" => {
                self.pending.push((from, step));
                self.answer_pending()
            }
            "push" => {
                if let Err(e) = self.check_vars(&h, &payload) {
                    return self.error(from, e);
                }
                if !self.initialized {
                    return self.error(from, "push before the variables were initialised".into());
                }
                let samples = h["samples"].as_f64().unwrap_or(1.0) as f32;
                let loss = h["loss"].as_f64().unwrap_or(f64::NAN) as f32;
                if !self.sync {
                    let mut off = 0;
                    for ((p, s), sh) in self
                        .params
                        .iter_mut()
                        .zip(&mut self.slots)
                        .zip(&self.shards)
                    {
                        self.opt.apply(p, &payload[off..off + sh.len], s);
                        off += sh.len;
                    }
                    self.global_step += 1;
                    self.last_loss = loss;
                    self.reply(from, json!({"ok": true, "step": self.global_step}), &[])?;
                    return self.answer_pending();
                }
                if step < self.global_step
                    || self.accum.contains_key(&w) && step == self.global_step
                {
                    return self.reply(
                        from,
                        json!({"ok": true, "stale": true, "step": self.global_step}),
                        &[],
                    );
                }
                if step > self.global_step {
                    return self.error(
                        from,
                        format!(
                            "push for step {step} ahead of global step {}",
                            self.global_step
                        ),
                    );
                }
                self.accum.insert(w, (samples, loss, self.split(&payload)));
                self.reply(from, json!({"ok": true, "step": self.global_step}), &[])?;
                if self.accum.len() >= self.rta {
                    let total: f32 = self.accum.values().map(|a| a.0).sum();
                    let mut avg: Vec<Vec<f32>> =
                        self.shards.iter().map(|s| vec![0.0; s.len]).collect();
                    let mut loss = 0.0;
                    // Worker order: the same sum whatever order pushes arrived in.
                    for (n, l, g) in self.accum.values() {
                        loss += l * n / total;
                        for (a, gi) in avg.iter_mut().zip(g) {
                            a.iter_mut()
                                .zip(gi)
                                .for_each(|(x, y)| *x += y * (n / total));
                        }
                    }
                    self.accum.clear();
                    self.apply(&avg);
                    self.last_loss = loss;
                    self.answer_pending()?;
                }
                Ok(())
            }
            "save" => {
                let dir = PathBuf::from(h["dir"].as_str().unwrap_or_default());
                let file = shard_file(self.k);
                match checkpoint::write_file(&dir.join(&file), &self.snapshot()) {
                    Ok((bytes, sum)) => self.reply(from, json!({"ok": true, "file": file, "bytes": bytes, "checksum": sum.to_string()}), &[]),
                    Err(e) => self.error(from, e.to_string()),
                }
            }
            "done" => {
                self.done[w] = true;
                Ok(())
            }
            other => self.error(from, format!("unknown request {other:?}")),
        }
    }

    fn snapshot(&self) -> Arrays {
        let params: Vec<&[f32]> = self.params.iter().map(Vec::as_slice).collect();
        shard_arrays(self.k, &self.shards, &params, &self.slots, self.global_step)
    }

    fn restore(&mut self, dir: &std::path::Path) -> Result<(), String> {
        let (params, slots, step) = read_shard(dir, self.k, &self.shards)?;
        // All or nothing: only now replace the live state.
        self.params = params;
        self.slots = slots;
        self.global_step = step;
        self.initialized = true;
        Ok(())
    }

    /// The workers this ps waits on and has not heard from within the timeout.
    fn lost(&self) -> Option<usize> {
        let waiting_on = |w: usize| -> bool {
            if self.done[w] {
                return false;
            }
            if !self.initialized {
                return w == 0 && !self.pending.is_empty();
            }
            if self.sync {
                // Only a step in progress needs gradients.
                (!self.accum.is_empty() || !self.pending.is_empty()) && !self.accum.contains_key(&w)
            } else {
                true
            }
        };
        (0..self.done.len()).find(|w| waiting_on(*w) && self.heard[*w].elapsed() > self.timeout)
    }

    fn serve(mut self) -> Result<(), PsError> {
        let mut backoff = Backoff::new(Duration::from_micros(200));
        while !self.done.iter().all(|d| *d) {
            let got = match self.comm.try_receive(
                crate::transport::comm::ANY_SOURCE,
                req(self.comm),
                self.timeout,
            ) {
                Err(TransportError::Timeout { peer, .. }) => {
                    let err = PsError::Lost {
                        task: self.me(),
                        lost: self.roles.task(peer),
                        secs: self.timeout.as_secs(),
                    };
                    self.abort_all(peer, &err);
                    return Err(err);
                }
                other => other?,
            };
            match got {
                Some((from, bytes)) => {
                    backoff.reset();
                    self.handle(from, &bytes)?;
                }
                None => {
                    if let Some(w) = self.lost() {
                        let rank = self.roles.workers[w];
                        let err = PsError::Lost {
                            task: self.me(),
                            lost: self.roles.task(rank),
                            secs: self.timeout.as_secs(),
                        };
                        self.abort_all(rank, &err);
                        return Err(err);
                    }
                    backoff.idle();
                }
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Workers and the chief.

struct Worker<'a, C: Comm> {
    comm: &'a C,
    roles: &'a Roles,
    w: usize,
    shards: &'a [Shard],
    cfg: &'a PsConfig,
    model: Replica<'a>,
    train: &'a Dataset,
    test: &'a Dataset,
}

impl<C: Comm> Worker<'_, C> {
    fn me(&self) -> String {
        self.roles.task(self.comm.rank())
    }

    fn vars_of(&self, k: usize) -> Value {
        Value::Array(
            self.shards
                .iter()
                .filter(|s| s.ps == k)
                .map(|s| json!([format!("{}@{}", s.var, s.offset), s.len]))
                .collect(),
        )
    }

    /// The values of ps `k`'s shards, taken from per-variable tensors `src`.
    /// The slices of per-variable tensors `src` that ps `k` holds, in its order (sent as
    /// they are, without gathering them first).
    fn gather<'t>(&self, k: usize, src: &'t [crate::tensor::Tensor]) -> Vec<&'t [f32]> {
        self.shards
            .iter()
            .filter(|s| s.ps == k)
            .map(|s| &src[s.var_index].as_slice::<f32>().expect("f32")[s.offset..s.offset + s.len])
            .collect()
    }

    fn scatter(&mut self, k: usize, flat: &[f32]) {
        let mut off = 0;
        for s in self.shards.iter().filter(|s| s.ps == k) {
            self.model.params[s.var_index]
                .as_mut_slice::<f32>()
                .expect("f32")[s.offset..s.offset + s.len]
                .copy_from_slice(&flat[off..off + s.len]);
            off += s.len;
        }
    }

    /// Sends one request to every ps and waits for every reply.
    fn round<'p>(
        &self,
        header: impl Fn(usize) -> Value,
        payload: impl Fn(usize) -> Vec<&'p [f32]>,
    ) -> Result<Vec<(Value, Vec<f32>)>, PsError> {
        let deadline = self.cfg.peer_timeout * 2;
        let mut early: Vec<Option<Vec<u8>>> = vec![None; self.roles.ps.len()];
        for (k, r) in self.roles.ps.iter().enumerate() {
            match send_within(
                self.comm,
                encode_parts(&header(k), &payload(k)),
                *r,
                req(self.comm),
                deadline,
                Some(*r),
            )? {
                Sent::Done(reply) => early[k] = reply,
                Sent::TimedOut => {
                    return Err(PsError::Lost {
                        task: self.me(),
                        lost: self.roles.task(*r),
                        secs: deadline.as_secs(),
                    });
                }
                Sent::Interrupted(m) => {
                    let message = decode(&m)
                        .and_then(|(h, _)| h["error"].as_str().map(str::to_string))
                        .unwrap_or_else(|| "aborted".into());
                    return Err(PsError::Remote {
                        task: self.me(),
                        message,
                    });
                }
            }
        }
        let mut out = Vec::new();
        for (r, early) in self.roles.ps.iter().zip(early) {
            // Twice the ps's own deadline: a ps that lost another task says so first.
            let lost = || PsError::Lost {
                task: self.me(),
                lost: self.roles.task(*r),
                secs: deadline.as_secs(),
            };
            let got = match early
                .map(|m| Ok(Some((*r, m))))
                .unwrap_or_else(|| receive_within(self.comm, *r, rep(self.comm), deadline))
            {
                Ok(Some(m)) => m,
                Ok(None) | Err(TransportError::Timeout { .. }) => return Err(lost()),
                Err(e) => return Err(e.into()),
            };
            let (h, p) = decode(&got.1).ok_or_else(|| PsError::Remote {
                task: self.roles.task(*r),
                message: "malformed reply".into(),
            })?;
            if h["ok"] != json!(true) {
                let message = h["error"].as_str().unwrap_or("error").to_string();
                // The ps already names itself and the lost task.
                return Err(PsError::Remote {
                    task: self.me(),
                    message,
                });
            }
            out.push((h, p));
        }
        Ok(out)
    }

    fn pull(&mut self, step: u64) -> Result<(u64, f32), PsError> {
        let replies = self.round(|_| json!({"op": "pull", "step": step}), |_| Vec::new())?;
        let step = replies
            .iter()
            .map(|r| r.0["step"].as_u64().unwrap_or(0))
            .min()
            .unwrap_or(0);
        let loss = replies[0].0["loss"].as_f64().unwrap_or(f64::NAN) as f32;
        for (k, (_, p)) in replies.into_iter().enumerate() {
            self.scatter(k, &p);
        }
        Ok((step, loss))
    }

    /// Chief: restore the newest valid checkpoint, or initialise.
    fn init_or_restore(&self, log: &mut dyn FnMut(&str)) -> Result<(), PsError> {
        let (found, warnings) = newest_checkpoint(self.cfg, self.roles.ps.len())?;
        for w in warnings {
            log(&format!("# warning: {w}"));
        }
        if let Some(f) = found {
            let path = f.path.display().to_string();
            self.round(|_| json!({"op": "restore", "path": path}), |_| Vec::new())?;
            log(&format!(
                "# restored {} (global step {})",
                f.path.display(),
                f.step
            ));
            return Ok(());
        }
        let init = &self.model.params;
        self.round(
            |k| json!({"op": "init", "vars": self.vars_of(k)}),
            |k| self.gather(k, init),
        )?;
        Ok(())
    }

    fn checkpoint(&self, step: u64, log: &mut dyn FnMut(&str)) -> Result<(), PsError> {
        let Some(dir) = &self.cfg.checkpoint_dir else {
            return Ok(());
        };
        let tmp = checkpoint::begin(dir, step)?;
        let t = tmp.display().to_string();
        let replies = self.round(|_| json!({"op": "save", "dir": t}), |_| Vec::new())?;
        let files: Vec<(String, u64, u64)> = replies
            .iter()
            .map(|(h, _)| {
                (
                    h["file"].as_str().unwrap_or_default().to_string(),
                    h["bytes"].as_u64().unwrap_or(0),
                    h["checksum"]
                        .as_str()
                        .and_then(|c| c.parse().ok())
                        .unwrap_or(0),
                )
            })
            .collect();
        commit_checkpoint(dir, step, &files, self.roles.ps.len(), log)
    }

    fn run(mut self, log: &mut dyn FnMut(&str)) -> Result<(), PsError> {
        let chief = self.w == 0;
        let nw = self.roles.workers.len();
        let batches = Batches::new(self.train.len(), self.cfg.train.batch, self.cfg.train.seed);
        let mut grads = self.model.zeros_like();
        if chief {
            self.init_or_restore(log)?;
        }
        let (mut step, _) = self.pull(0)?;
        let (mut last_ckpt, mut window, mut window_steps) = (step, Instant::now(), 0u64);
        while step < self.cfg.train.steps {
            let global = batches.global(step);
            let mine = shard(&global, self.w, nw);
            let (x, y) = self.train.rows(mine);
            let loss = self
                .model
                .gradients_into(&x, &y, &mut grads)
                .map_err(|e| PsError::Setup(e.to_string()))?;
            let n = mine.len();
            self.round(
                |k| json!({"op": "push", "step": step, "samples": n, "loss": loss, "vars": self.vars_of(k)}),
                |k| self.gather(k, &grads),
            )?;
            let want = if self.cfg.sync { step + 1 } else { 0 };
            let (next, applied_loss) = self.pull(want)?;
            let prev = step;
            window_steps += next.saturating_sub(prev);
            step = next;
            if chief {
                let every = self.cfg.train.log_every;
                if every > 0 && step / every > prev / every {
                    log(&step_line(
                        self.cfg,
                        nw,
                        step,
                        applied_loss,
                        window_steps,
                        window.elapsed(),
                    ));
                    (window, window_steps) = (Instant::now(), 0);
                }
                if self.cfg.checkpoint_every > 0
                    && step / self.cfg.checkpoint_every > last_ckpt / self.cfg.checkpoint_every
                    && step < self.cfg.train.steps
                {
                    self.checkpoint(step, log)?;
                    last_ckpt = step;
                }
            }
        }
        if chief {
            if last_ckpt != step {
                self.checkpoint(step, log)?;
            }
            super::finish(
                &self.model,
                self.test,
                step,
                self.cfg.save_params.as_deref(),
                log,
            )
            .map_err(|e| PsError::Setup(e.to_string()))?;
        }
        for r in &self.roles.ps {
            crate::transport::comm::send(
                self.comm,
                &encode(&json!({"op": "done"}), &[]),
                *r,
                req(self.comm),
            )?;
        }
        Ok(())
    }
}

/// The benchmark's model: one flat parameter tensor and no computation (its gradients
/// are never asked for: the benchmark pushes zeros).
struct Flat(usize);

impl Model for Flat {
    fn describe(&self) -> String {
        format!("flat {}", self.0)
    }

    fn input_shape(&self) -> Vec<usize> {
        vec![1]
    }

    fn classes(&self) -> usize {
        1
    }

    fn parameters(&self) -> Vec<crate::model::ParamSpec> {
        vec![crate::model::ParamSpec::new(
            "model",
            &[self.0],
            crate::model::Init::Zeros,
        )]
    }

    fn logits(
        &self,
        _params: &[crate::tensor::Tensor],
        _x: &[f32],
        rows: usize,
    ) -> Result<Vec<f32>, crate::model::ModelError> {
        Ok(vec![0.0; rows])
    }

    fn loss_and_gradients(
        &self,
        _params: &[crate::tensor::Tensor],
        _x: &[f32],
        _y: &[u8],
        grads: &mut [crate::tensor::Tensor],
        ready: &mut dyn FnMut(std::ops::Range<usize>, &[crate::tensor::Tensor]),
    ) -> Result<f32, crate::model::ModelError> {
        ready(0..grads.len(), grads);
        Ok(0.0)
    }
}

/// Benchmark support (`mpiflow bench pushpull`): ps ranks serve, workers run `warmup +
/// rounds` rounds of one push and one pull of a model of `floats` floats, sliced evenly
/// over the ps tasks, through the real protocol (async, SGD). Workers return the mean
/// seconds of a timed round; ps ranks return `None`.
pub fn bench_pushpull<C: Comm>(
    comm: &C,
    layout: &Layout,
    floats: usize,
    rounds: usize,
    warmup: usize,
) -> Result<Option<f64>, PsError> {
    let roles = Roles::new(layout)?;
    let vars = vec![("model".to_string(), floats)];
    let slice = floats.div_ceil(roles.ps.len()).max(1) * 4;
    let shards = placement::place(&vars, roles.ps.len(), Strategy::Partition, slice);
    let cfg = PsConfig {
        train: TrainConfig {
            optimizer: super::optim::OptimizerKind::Sgd,
            lr: 1e-12,
            ..TrainConfig::default()
        },
        sync: false,
        replicas_to_aggregate: None,
        strategy: Strategy::Partition,
        partition_bytes: slice,
        checkpoint_dir: None,
        checkpoint_every: 0,
        peer_timeout: Duration::from_secs(60),
        save_params: None,
    };
    let me = comm.rank();
    if let Some(k) = roles.ps.iter().position(|r| *r == me) {
        let mine: Vec<Shard> = shards.iter().filter(|s| s.ps == k).cloned().collect();
        return Server::new(comm, &roles, k, mine, &cfg, 1)
            .serve()
            .map(|_| None);
    }
    let Some(w) = roles.workers.iter().position(|r| *r == me) else {
        return Ok(None);
    };
    let flat = Flat(floats);
    let model = Replica::new(&flat, 0);
    let empty = Dataset {
        x: vec![],
        y: vec![],
        features: 0,
        classes: 0,
        shape: vec![0],
    };
    let mut worker = Worker {
        comm,
        roles: &roles,
        w,
        shards: &shards,
        cfg: &cfg,
        model,
        train: &empty,
        test: &empty,
    };
    let grads = worker.model.zeros_like();
    if w == 0 {
        let init = &worker.model.params;
        worker.round(
            |k| json!({"op": "init", "vars": worker.vars_of(k)}),
            |k| worker.gather(k, init),
        )?;
    }
    // Like training: every worker's first pull waits for the chief's initialisation.
    worker.pull(0)?;
    let mut start = Instant::now();
    for i in 0..warmup + rounds {
        if i == warmup {
            start = Instant::now();
        }
        worker.round(|k| json!({"op": "push", "step": 0, "samples": 1, "loss": 0.0, "vars": worker.vars_of(k)}), |k| worker.gather(k, &grads))?;
        worker.pull(0)?;
    }
    let secs = start.elapsed().as_secs_f64() / rounds.max(1) as f64;
    for r in &roles.ps {
        crate::transport::comm::send(comm, &encode(&json!({"op": "done"}), &[]), *r, req(comm))?;
    }
    Ok(Some(secs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::MappingOptions;
    use crate::transport::local::LocalComm;

    fn layout(n: usize, ps: usize) -> Layout {
        Layout::single_host(
            n,
            &MappingOptions {
                ps,
                ..Default::default()
            },
        )
        .unwrap()
    }

    fn cfg(steps: u64, sync: bool) -> PsConfig {
        PsConfig {
            train: TrainConfig {
                steps,
                log_every: 0,
                ..TrainConfig::default()
            },
            sync,
            replicas_to_aggregate: None,
            strategy: Strategy::Greedy,
            partition_bytes: 4 << 20,
            checkpoint_dir: None,
            checkpoint_every: 0,
            peer_timeout: Duration::from_secs(10),
            save_params: None,
        }
    }

    #[test]
    fn sync_ps_training_equals_local_training_of_the_combined_batch() {
        let data = Dataset::load("digits", 0).unwrap();
        let (train, test) = data.split_holdout(1);
        let steps = 40;
        let mlp = crate::model::mlp(64, &[128], 10).unwrap();
        let local = super::super::train_local(&mlp, &cfg(steps, true).train, &train, &test, |_| {})
            .unwrap();
        let dir = std::env::temp_dir().join(format!("mpiflow-ps-eq-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("params.bin");
        let l = layout(5, 2);
        let mut c = cfg(steps, true);
        c.save_params = Some(out.clone());
        c.strategy = Strategy::Partition;
        c.partition_bytes = 4096; // slices, so partitioned variables are exercised too
        LocalComm::run(5, |comm| {
            run(&comm, &l, &mlp, &c, &train, &test, &mut |_| {}).unwrap()
        });
        let ps = checkpoint::read_file(&out, None).unwrap();
        let mut worst = 0.0f32;
        for p in &local.model.params {
            for (a, b) in p
                .as_slice::<f32>()
                .unwrap()
                .iter()
                .zip(ps.get(p.name()).unwrap())
            {
                worst = worst.max((a - b).abs() / (1.0 + a.abs()));
            }
        }
        assert!(worst < 1e-4, "largest relative difference {worst}");
    }

    #[test]
    fn bad_pushes_are_rejected_and_the_ps_keeps_serving() {
        let data = Dataset::synthetic(200, 8, 3, 1);
        let (train, test) = data.split_holdout(1);
        let l = layout(3, 1);
        let c = cfg(5, true);
        let mlp = crate::model::mlp(8, &[4], 3).unwrap();
        let out = LocalComm::run(3, |comm| {
            if comm.rank() == 2 {
                // worker:1 misbehaves before taking part: an unknown variable, a wrong length.
                let bad = |vars: Value, n: usize| {
                    crate::transport::comm::send(
                        &comm,
                        &encode(
                            &json!({"op": "push", "step": 0, "vars": vars}),
                            &vec![0.0; n],
                        ),
                        0,
                        req(&comm),
                    )
                    .unwrap();
                    let (_, r) = receive_within(&comm, 0, rep(&comm), Duration::from_secs(10))
                        .unwrap()
                        .unwrap();
                    decode(&r).unwrap().0["error"].as_str().unwrap().to_string()
                };
                let e1 = bad(json!([["nope@0", 3]]), 3);
                let e2 = bad(json!([["layer0/w@0", 5]]), 5);
                run(&comm, &l, &mlp, &c, &train, &test, &mut |_| {}).unwrap();
                format!("{e1}\n{e2}")
            } else {
                run(&comm, &l, &mlp, &c, &train, &test, &mut |_| {}).unwrap();
                String::new()
            }
        });
        assert!(out[2].contains("unknown variable 'nope@0'"), "{}", out[2]);
        assert!(
            out[2].contains("'layer0/w@0' has 32 elements on ps:0, the push has 5"),
            "{}",
            out[2]
        );
    }
}
