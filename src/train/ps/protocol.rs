//! The ps wire protocol: typed requests (worker to ps) and replies (ps to worker).
//!
//! A request or a reply is a header message, a [`Request`] or a [`Reply`] in a binary
//! encoding (serde, bincode), on the tag of [`request_tag`] or [`reply_tag`]. The
//! header says what floats it carries (initial values, gradients, parameters:
//! [`Request::payload`]; a `Params` reply carries the ps's shards), so both sides know how
//! they travel. Up to [`INLINE_FLOATS`] they ride in the header's message (small models:
//! one message per request). Above, they follow as messages of their own on tag
//! [`payload_tag`], sent from the memory they live in and received into the memory
//! they go to: no side gathers them into a message or scatters them out of one. Each part
//! (a shard, a pushed variable slice) then travels as [`pieces`] of at most
//! [`PIECE_FLOATS`], so a ps applies each piece of a gradient while it is still in cache.
//! Messages from one rank on one tag arrive in order, so a header's pieces are the next
//! payload messages from its sender.

use std::ops::Range;
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::placement::Shard;
use crate::model::embedding::{SparseOptimizer, TableSpec};
use crate::observe::phases::{RankTimes, Times};
use crate::train::guard::NonFinite;
use crate::train::optim::Optimizer;
use crate::transport::comm::Comm;

/// How a ps applies gradients, told by the chief when it initialises or restores: a ps
/// task needs no model and no flags of its own (it just `join`s).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Setup {
    /// Every shard of every variable, on every ps (each ps keeps its own).
    pub shards: Vec<Shard>,
    pub optimizer: Optimizer,
    /// Synchronous replicas, or `None` for asynchronous updates.
    pub sync: Option<SyncReplicas>,
    /// The pipeline stage whose variables these are (`train --stages` with ps tasks: each
    /// stage's workers are a job of their own on the same ps tasks); `None`: the whole
    /// model's. Names this ps's checkpoint file, and restores read this stage's variables
    /// of a whole model's checkpoint.
    #[serde(default)]
    pub stage: Option<usize>,
    /// Embedding tables whose rows the ps tasks hold (row `id` on ps `id mod ps tasks`:
    /// [`row_owner`]), made on first touch from `seed` and updated by `sparse`.
    #[serde(default)]
    pub tables: Vec<TableSpec>,
    #[serde(default)]
    pub sparse: Option<SparseOptimizer>,
    #[serde(default)]
    pub seed: u64,
}

/// The ps task (of `ps`) that holds row `id` of every table: rows spread evenly over the ps
/// tasks, so each holds about its share of every table's bytes.
#[inline]
pub fn row_owner(id: u64, ps: usize) -> usize {
    // `id mod ps`; a mask where `ps` is a power of 2 (a division costs tens of cycles per
    // id of a request).
    let ps = ps.max(1) as u64;
    match ps.is_power_of_two() {
        true => (id & (ps - 1)) as usize,
        false => (id % ps) as usize,
    }
}

/// TensorFlow's `SyncReplicasOptimizer`: a step's update averages the first
/// `replicas_to_aggregate` fresh gradients; the other workers are backups whose late
/// gradients for that step are dropped as stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncReplicas {
    pub replicas_to_aggregate: usize,
}

/// A worker's request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Request {
    /// The chief: take `setup`; the payload is this ps's shards' initial values in order.
    Init { setup: Setup },
    /// The chief: take `setup` and load this ps's shard of checkpoint `path`.
    Restore { setup: Setup, path: PathBuf },
    /// The parameters, as [`Then`] says.
    Pull(Then),
    /// Gradients of `samples` samples computed at `step`; the payload is this ps's
    /// shards' gradients in the order of `vars` (`var@offset`, length).
    Push {
        step: u64,
        samples: usize,
        /// `None` for a loss that is not finite.
        loss: Option<f32>,
        vars: Vec<(String, usize)>,
        /// A signal that asks this worker's job to stop (SIGTERM, SIGINT, SIGUSR1): the
        /// ps announces the stop to every worker at the next step boundary.
        stop: Option<i32>,
        /// This worker's phase times since it last reported (to ps 0, which passes them
        /// on to the chief).
        times: Option<Times>,
        /// Synchronous training: this worker's loss or gradients are not finite. The ps
        /// tasks do not apply the step and answer every worker with
        /// [`Reply::NotApplied`].
        non_finite: Option<NonFinite>,
        /// The pull that follows this push, in the same request: the ps answers it (a
        /// `Params` reply, parked like a [`Request::Pull`]'s) instead of `Ok` or `Stale`:
        /// one round trip per step. See `super::worker::Client::push_pull` for when a
        /// worker asks.
        pull: Option<Then>,
    },
    /// The chief: write this ps's shard into checkpoint staging directory `dir`.
    Save { dir: PathBuf },
    /// A worker stops training with an error: the ps tells every other worker and stops.
    /// `agreed`: every worker stops with it (they agreed on it, a pipeline's replica
    /// tasks) and prints it: the ps ends with it quietly once each has said so.
    Abort { message: String, agreed: bool },
    /// This worker is done; `stop`: because of this stop signal (its job ends with
    /// [`crate::train::Stopped`]).
    Done { stop: Option<i32> },
    /// The rows `parts` name (each this ps's: [`row_owner`]), made if new: a
    /// [`Reply::Rows`] whose payload is their values, part by part, in this order. One
    /// request for every table a batch names.
    PullRows { parts: Vec<RowsPart> },
    /// Sparse gradients of the rows `parts` name (each this ps's), scaled by `scale` and
    /// applied at once; the payload is `values` floats, a row's gradient per id, part by
    /// part. Then, if `pull` names rows, a [`Request::PullRows`] of them (the next step's
    /// rows in the same round trip), else [`Reply::Ok`].
    PushRows {
        parts: Vec<RowsPart>,
        scale: f32,
        values: usize,
        pull: Vec<RowsPart>,
    },
    /// [`Request::PullRows`] without making rows: one that does not exist is answered
    /// with its initial values (an evaluation's read).
    ReadRows { parts: Vec<RowsPart> },
    /// The chief: a [`Reply::Stats`] of this ps's tables.
    Stats,
}

/// Rows of one table in a request: the table's index and the rows' ids (on the wire as
/// one string of bytes, 8 a row: a request of thousands of ids is written and read as a
/// copy, not id by id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowsPart {
    pub table: usize,
    #[serde(with = "raw_ids")]
    pub ids: Vec<u64>,
}

/// Row ids as one byte string of little-endian `u64`s.
mod raw_ids {
    use serde::de::{Error, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(ids: &[u64], s: S) -> Result<S::Ok, S::Error> {
        #[cfg(not(target_endian = "little"))]
        compile_error!("the ps wire format assumes a little-endian machine");
        // SAFETY: any u64 slice is a valid byte slice of 8x its length (u8 has alignment 1).
        let bytes = unsafe {
            std::slice::from_raw_parts(ids.as_ptr().cast::<u8>(), std::mem::size_of_val(ids))
        };
        s.serialize_bytes(bytes)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
        d.deserialize_bytes(Ids)
    }

    struct Ids;

    impl Visitor<'_> for Ids {
        type Value = Vec<u64>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("row ids, 8 bytes each")
        }

        fn visit_bytes<E: Error>(self, bytes: &[u8]) -> Result<Vec<u64>, E> {
            if !bytes.len().is_multiple_of(8) {
                return Err(E::custom(format!("{} bytes of row ids", bytes.len())));
            }
            let mut ids = vec![0u64; bytes.len() / 8];
            // SAFETY: `ids` holds exactly `bytes.len()` bytes (a multiple of 8, checked),
            // freshly allocated so the two do not overlap; every bit pattern is a `u64`,
            // and the wire's byte order is the machine's (little-endian, above).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    ids.as_mut_ptr().cast::<u8>(),
                    bytes.len(),
                );
            }
            Ok(ids)
        }
    }
}

/// A pull, alone ([`Request::Pull`]) or after a push ([`Request::Push`]'s `pull`): the
/// parameters once the global step is at least `step` (sync; async: at once); `report`:
/// the chief asks for the phase times the ps gathered since it last asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Then {
    pub step: u64,
    pub report: bool,
}

/// A ps's reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    /// Done; the global step.
    Ok { step: u64 },
    /// The parameters (payload) at `step`, and the loss of the update that made them;
    /// `stop`: the job stops at this step, asked by this signal (see
    /// `super::server`'s stop rule: every worker's reply at one step says the same).
    Params {
        step: u64,
        loss: Option<f32>,
        stop: Option<i32>,
        /// Microseconds the pull waited at the ps for its step (the other workers'
        /// gradients, the update): the worker's waiting, not its communication.
        held_us: u64,
        /// Asked by the chief's pull: this ps's own phase times, and those the workers
        /// reported to it, since the chief last asked.
        #[serde(with = "reports")]
        reports: Vec<RankTimes>,
    },
    /// A gradient for a step already applied: dropped.
    Stale { step: u64 },
    /// This ps's checkpoint file: name, bytes, checksum.
    Saved {
        file: String,
        bytes: u64,
        checksum: u64,
    },
    /// The request failed, or training stops (an abort): why.
    Error { message: String },
    /// The step was not applied: some workers' losses or gradients were not finite
    /// (`why` counts them, ` on 2 of 3 workers`). Every worker and ps task ends with it.
    NotApplied { why: NonFinite },
    /// The rows a [`Request::PullRows`] asked for (the payload).
    Rows { values: usize },
    /// This ps's report of each table's rows (see [`Request::Stats`]).
    Stats {
        tables: Vec<crate::train::tables::TableReport>,
    },
    /// Not an answer: the request is still being worked on (a checkpoint being written, a
    /// pull waiting for its step), and this ps is alive. Sent every third of the peer
    /// timeout while a request waits, so a worker's deadline measures a ps that stopped
    /// answering, not a long write; the answer follows.
    Alive,
}

/// [`RankTimes`] on the wire: `(rank, task, times)` (the metrics file's flattened form
/// needs a self-describing format).
mod reports {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::observe::phases::{RankTimes, Times};

    pub fn serialize<S: Serializer>(v: &[RankTimes], s: S) -> Result<S::Ok, S::Error> {
        let wire: Vec<(usize, &str, &Times)> = v
            .iter()
            .map(|r| (r.rank, r.task.as_str(), &r.times))
            .collect();
        wire.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<RankTimes>, D::Error> {
        let wire: Vec<(usize, String, Times)> = Vec::deserialize(d)?;
        let each = |(rank, task, times)| RankTimes { rank, task, times };
        Ok(wire.into_iter().map(each).collect())
    }
}

/// A loss as it travels: `None` if not finite.
pub fn finite(loss: f32) -> Option<f32> {
    loss.is_finite().then_some(loss)
}

/// The tag of requests (worker to ps), kept at the top of the tag range.
pub fn request_tag<C: Comm>(c: &C) -> i32 {
    c.tags().kept(crate::train::tags::PS_REQUEST)
}

/// The tag of replies (ps to worker).
pub fn reply_tag<C: Comm>(c: &C) -> i32 {
    c.tags().kept(crate::train::tags::PS_REPLY)
}

/// The tag of payload pieces (both ways).
pub fn payload_tag<C: Comm>(c: &C) -> i32 {
    c.tags().kept(crate::train::tags::PS_PAYLOAD)
}

/// The longest piece of a payload, in floats (1 MiB: a ps applies each piece while it is
/// in cache; the sizes compared are in `benches/results/2026-11-23g.md`).
pub const PIECE_FLOATS: usize = 256 << 10;

/// One piece of a payload: floats `range` of part `part`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub part: usize,
    pub range: Range<usize>,
}

/// The pieces a payload of parts of these lengths travels as, in order: each part cut
/// into pieces of at most [`PIECE_FLOATS`] (an empty part sends nothing).
pub fn pieces(lens: impl IntoIterator<Item = usize>) -> impl Iterator<Item = Piece> {
    lens.into_iter().enumerate().flat_map(|(part, len)| {
        (0..len).step_by(PIECE_FLOATS).map(move |start| Piece {
            part,
            range: start..(start + PIECE_FLOATS).min(len),
        })
    })
}

impl Request {
    /// The parts of the payload that follows this header to ps `k`, by length: a push's
    /// variable slices, an init's shards of ps `k` (its setup names them), nothing else.
    pub fn payload(&self, k: usize) -> Vec<usize> {
        match self {
            Request::Push { vars, .. } => vars.iter().map(|v| v.1).collect(),
            Request::PushRows { values, .. } => vec![*values],
            Request::Init { setup } => setup
                .shards
                .iter()
                .filter(|s| s.ps == k)
                .map(|s| s.len)
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// The bytes of floats as they travel (little-endian).
pub fn f32_bytes(x: &[f32]) -> &[u8] {
    #[cfg(not(target_endian = "little"))]
    compile_error!("the ps wire format assumes a little-endian machine");
    // SAFETY: any f32 slice is a valid byte slice of 4x its length (u8 has alignment 1).
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

/// The floats `bytes` hold, read where they are, if they lie at a float's alignment
/// (a payload inside a received message: `None` where it does not, to be copied instead).
pub fn as_floats(bytes: &[u8]) -> Option<&[f32]> {
    // SAFETY: every bit pattern of 4 bytes is an f32; `align_to` puts in the middle only
    // what is aligned for f32.
    let (before, floats, after) = unsafe { bytes.align_to::<f32>() };
    (before.is_empty() && after.is_empty()).then_some(floats)
}

/// [`f32_bytes`], writable (what a piece is received into).
pub fn f32_bytes_mut(x: &mut [f32]) -> &mut [u8] {
    let len = std::mem::size_of_val(x);
    // SAFETY: as in `f32_bytes`; every bit pattern written through the bytes is an f32.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<u8>(), len) }
}

/// The largest payload that travels inside its header's message, in floats (64 KiB): for
/// small models a message more costs more than copying the floats.
pub const INLINE_FLOATS: usize = 16 << 10;

/// True if a payload of parts of these lengths travels inside its header's message (gathered
/// into it and read out of it), false if as [`pieces`] of its own.
pub fn inline(lens: impl IntoIterator<Item = usize>) -> bool {
    lens.into_iter().sum::<usize>() <= INLINE_FLOATS
}

/// The headers' binary encoding (bincode: little-endian, variable-length integers),
/// reading at most `limit` bytes (a claimed length beyond the message is refused, never
/// allocated).
fn wire(limit: usize) -> impl bincode::Options {
    use bincode::Options;
    bincode::DefaultOptions::new()
        .with_limit(limit as u64)
        .allow_trailing_bytes()
}

/// A header message: `[u32 n | header of n bytes | f32 payload]`, the header (serde, in a
/// binary encoding) padded with zeros to a multiple of 4 bytes; the payload is the parts
/// of an [`inline`] one, or nothing.
pub fn encode_with<H: Serialize>(header: &H, parts: &[&[f32]]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(&mut out, header, parts);
    out
}

/// [`encode_with`] into `out` (emptied first; its allocation reused: a client that
/// sends a request of the same size every step allocates, and faults pages in, once).
pub fn encode_into<H: Serialize>(out: &mut Vec<u8>, header: &H, parts: &[&[f32]]) {
    let (n, framed) = frame_len(header);
    let floats: usize = parts.iter().map(|p| p.len()).sum();
    out.clear();
    out.reserve(framed + 4 * floats);
    out.resize(framed, 0);
    write_frame(out, header, n);
    for p in parts {
        out.extend_from_slice(f32_bytes(p));
    }
}

/// The length of `header` encoded, and of it framed as a message begins: its length as a
/// `u32`, then the header padded with zeros to a multiple of 4 bytes.
fn frame_len<H: Serialize>(header: &H) -> (usize, usize) {
    use bincode::Options;
    let n = wire(usize::MAX)
        .serialized_size(header)
        .expect("protocol headers serialise") as usize;
    (n, 4 + n.next_multiple_of(4))
}

/// Writes `header` (`n` bytes encoded) framed into `at`, zeroed bytes of its framed
/// length ([`frame_len`]).
fn write_frame<H: Serialize>(at: &mut [u8], header: &H, n: usize) {
    use bincode::Options;
    let padded = at.len() - 4;
    at[..4].copy_from_slice(&(padded as u32).to_le_bytes());
    wire(usize::MAX)
        .serialize_into(&mut at[4..4 + n], header)
        .expect("protocol headers serialise");
}

/// A header message without a payload.
pub fn encode<H: Serialize>(header: &H) -> Vec<u8> {
    encode_with(header, &[])
}

/// [`encode`] into the first words of `out` (emptied first), for a payload of floats to
/// be appended in place after it (a reply gathered straight into its message); the
/// header's words.
pub fn encode_words<H: Serialize>(out: &mut Vec<f32>, header: &H) -> usize {
    let (n, framed) = frame_len(header);
    out.clear();
    out.resize(framed / 4, 0.0);
    write_frame(f32_bytes_mut(out), header, n);
    framed / 4
}

/// The header a message holds and the bytes of its inline payload (a multiple of 4), or
/// `None` if it is not a message of `H`.
pub fn decode_with<H: DeserializeOwned>(bytes: &[u8]) -> Option<(H, &[u8])> {
    use bincode::Options;
    let n = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let h = bytes.get(4..4usize.checked_add(n)?)?;
    let header = wire(h.len()).deserialize(h).ok()?;
    let rest = &bytes[4 + n..];
    rest.len().is_multiple_of(4).then_some((header, rest))
}

/// The header a message holds, or `None` if it is not a message of `H`.
pub fn decode<H: DeserializeOwned>(bytes: &[u8]) -> Option<H> {
    decode_with(bytes).map(|(h, _)| h)
}

/// Copies the floats of an inline payload into `parts` in order; false if their lengths
/// do not add up to the payload's.
pub fn read_inline<'d>(bytes: &[u8], parts: impl IntoIterator<Item = &'d mut [f32]>) -> bool {
    let mut parts: Vec<&mut [f32]> = parts.into_iter().collect();
    let total: usize = parts.iter().map(|p| p.len()).sum();
    // Fewer floats than places would leave the last places as they were, unsaid.
    if total.checked_mul(4) != Some(bytes.len()) {
        return false;
    }
    let mut rest = bytes;
    for part in &mut parts {
        let (these, after) = rest.split_at(4 * part.len());
        f32_bytes_mut(part).copy_from_slice(these);
        rest = after;
    }
    true
}

#[cfg(test)]
mod tests;
