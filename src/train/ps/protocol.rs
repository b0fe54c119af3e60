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
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_with_a_non_finite_loss() {
        let r = Request::Push {
            step: 7,
            samples: 21,
            loss: finite(f32::NAN),
            vars: vec![("layer0/w@0".into(), 3)],
            stop: None,
            times: None,
            non_finite: None,
            pull: None,
        };
        assert_eq!(decode::<Request>(&encode(&r)), Some(r.clone()));
        // No stop, no times, nothing not finite: the fields are left out, and a header
        // without them reads as none.
        let text = String::from_utf8_lossy(&encode(&r)).to_string();
        assert!(
            ["stop", "times", "pull", "non_finite"]
                .iter()
                .all(|f| !text.contains(f)),
            "{text}"
        );
        // What a worker found, and the ps tasks' verdict, travel whole.
        let grad = crate::tensor::Tensor::from_slice(&[2], &[1f32, f32::INFINITY])
            .unwrap()
            .named("layer0/w");
        let found = crate::train::guard::check_gradients(7, &[grad]).unwrap_err();
        let mut bad = r.clone();
        if let Request::Push { non_finite, .. } = &mut bad {
            *non_finite = Some(found.clone());
        }
        assert_eq!(decode::<Request>(&encode(&bad)), Some(bad));
        let verdict = Reply::NotApplied {
            why: found.seen(" on 2 of 3 workers".into()),
        };
        assert_eq!(decode::<Reply>(&encode(&verdict)), Some(verdict.clone()));
        let Reply::NotApplied { why } = verdict else {
            unreachable!()
        };
        assert!(
            why.to_string()
                .starts_with("gradient 'layer0/w' holds inf at step 7 on 2 of 3 workers: "),
            "{why}"
        );
        let timed = Request::Push {
            step: 7,
            samples: 21,
            loss: None,
            vars: vec![],
            stop: None,
            non_finite: None,
            times: Some(Times {
                compute: 0.5,
                steps: 3,
                ..Times::default()
            }),
            pull: Some(Then {
                step: 8,
                report: true,
            }),
        };
        assert_eq!(decode::<Request>(&encode(&timed)), Some(timed));
        let params = Reply::Params {
            step: 4,
            loss: None,
            stop: None,
            held_us: 0,
            reports: vec![],
        };
        // A step's headers are a few bytes (4 of length, the header padded to 4).
        let m = encode(&params);
        assert!(m.len() <= 12, "{} bytes: {m:?}", m.len());
        assert_eq!(decode::<Reply>(&m), Some(params));
        let pull = Request::Pull(Then {
            step: 1,
            report: false,
        });
        let m = encode(&pull);
        assert!(m.len() <= 8, "{} bytes: {m:?}", m.len());
        assert_eq!(decode::<Request>(&m), Some(pull));
        // Bytes that are no header are refused, a length beyond the message too.
        assert_eq!(decode::<Request>(&[4, 0, 0, 0, 255, 255, 255, 255]), None);
        assert_eq!(decode::<Request>(&[64, 0, 0, 0, 1]), None);
        let done = Request::Done { stop: Some(10) };
        assert_eq!(decode::<Request>(&encode(&done)), Some(done));
        assert_eq!(r.payload(0), [3]);
        // An inline payload rides after the header, whatever the header's length mod 4.
        for pad in 0..4 {
            let long = Reply::Error {
                message: "x".repeat(pad),
            };
            let m = encode_with(&long, &[&[1.0, 2.0], &[3.0]]);
            let (back, bytes) = decode_with::<Reply>(&m).unwrap();
            assert_eq!(back, long);
            let (mut a, mut b) = ([0f32; 2], [0f32; 1]);
            assert!(read_inline(bytes, [&mut a[..], &mut b[..]]));
            assert_eq!((a, b), ([1.0, 2.0], [3.0]));
            assert!(!read_inline(bytes, [&mut a[..]]));
            // Fewer floats than places: refused, nothing written.
            let mut c = [9f32; 1];
            assert!(!read_inline(bytes, [&mut a[..], &mut b[..], &mut c[..]]));
            assert_eq!(c, [9.0]);
        }
        assert!(inline([INLINE_FLOATS]) && !inline([INLINE_FLOATS, 1]));
        // A checksum above 2^53 survives (an integer, not a float).
        let s = Reply::Saved {
            file: "shard-ps0.bin".into(),
            bytes: 9,
            checksum: u64::MAX - 1,
        };
        assert_eq!(decode::<Reply>(&encode(&s)), Some(s.clone()));
        // A reply is not a request; a truncated message is nothing.
        assert!(decode::<Request>(&encode(&s)).is_none());
        let m = encode(&r);
        assert!(decode::<Request>(&m[..m.len() - 1]).is_none());
    }

    #[test]
    fn payloads_travel_as_pieces_covering_each_part_in_order() {
        let lens = [0, 3, PIECE_FLOATS, 2 * PIECE_FLOATS + 1];
        let all: Vec<Piece> = pieces(lens).collect();
        let want = |part, a: usize, b: usize| Piece { part, range: a..b };
        let p = PIECE_FLOATS;
        assert_eq!(
            all,
            [
                want(1, 0, 3),
                want(2, 0, p),
                want(3, 0, p),
                want(3, p, 2 * p),
                want(3, 2 * p, 2 * p + 1)
            ]
        );
        let setup = Setup {
            shards: vec![],
            optimizer: crate::train::optim::Optimizer::new(
                crate::train::optim::OptimizerKind::Sgd,
                0.1,
            ),
            sync: None,
            stage: None,
            tables: Vec::new(),
            sparse: None,
            seed: 0,
        };
        assert!(Request::Init { setup }.payload(0).is_empty());
        let rows = Request::PushRows {
            parts: vec![RowsPart {
                table: 0,
                ids: vec![3, 9],
            }],
            scale: 1.0,
            values: 8,
            pull: Vec::new(),
        };
        assert_eq!(rows.payload(0), vec![8]);
        assert!(Request::Done { stop: None }.payload(0).is_empty());
    }

    /// A header written as words, floats appended after it, is the message
    /// `encode_with` makes of the same header and floats.
    #[test]
    fn a_header_in_words_with_floats_after_it_is_the_same_message() {
        let reply = Reply::Rows { values: 3 };
        let floats = [1.5f32, f32::from_bits(0x7fc0_0001), -0.0];
        let mut words = vec![9.0; 40];
        let head = encode_words(&mut words, &reply);
        words.extend_from_slice(&floats);
        assert_eq!(f32_bytes(&words), &encode_with(&reply, &[&floats])[..]);
        assert_eq!(words.len(), head + 3);
    }

    /// Row ids travel as bytes, 8 an id, every bit kept; a string of bytes that is not a
    /// whole number of ids is no request.
    #[test]
    fn row_ids_round_trip_as_bytes_and_a_broken_id_is_refused() {
        let ids = vec![0, 1, 255, 1 << 40, u64::MAX - 1, u64::MAX];
        let r = Request::PullRows {
            parts: vec![
                RowsPart {
                    table: 2,
                    ids: ids.clone(),
                },
                RowsPart {
                    table: 0,
                    ids: Vec::new(),
                },
            ],
        };
        let m = encode_with(&r, &[&[1.5, -2.0]]);
        let (back, floats) = decode_with::<Request>(&m).expect("a request");
        assert_eq!(back, r);
        assert_eq!(floats.len(), 8);
        // The ids' bytes are the message's: 8 per id, little-endian.
        let raw: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        assert!(m.windows(raw.len()).any(|w| w == raw));
        // One byte fewer in the first part's length: 47 bytes are no ids.
        let at = m.windows(raw.len()).position(|w| w == raw).unwrap();
        let mut broken = m.clone();
        assert_eq!(broken[at - 1], 48, "the length before the ids");
        broken[at - 1] = 47;
        assert!(decode_with::<Request>(&broken).is_none());
    }
}
