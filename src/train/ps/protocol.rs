//! The ps wire protocol: typed requests (worker to ps) and replies (ps to worker).
//!
//! One message each: `[u32 n | JSON header of n bytes | f32 payload]`. The header is a
//! [`Request`] or a [`Reply`] (serde); the payload carries the floats the header names
//! (initial values, gradients, parameters), little-endian, sent without gathering them
//! first. Requests travel on tag [`Reserved::PsRequest`], replies on
//! [`Reserved::PsReply`], both at the top of the tag range.

use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::placement::Shard;
use crate::train::optim::Optimizer;
use crate::transport::comm::Comm;
use crate::transport::tags::Reserved;

/// How a ps applies gradients, told by the chief when it initialises or restores: a ps
/// task needs no model and no flags of its own (it just `join`s).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Setup {
    /// Every shard of every variable, on every ps (each ps keeps its own).
    pub shards: Vec<Shard>,
    pub optimizer: Optimizer,
    /// Synchronous replicas, or `None` for asynchronous updates.
    pub sync: Option<SyncReplicas>,
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
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// The chief: take `setup`; the payload is this ps's shards' initial values in order.
    Init { setup: Setup },
    /// The chief: take `setup` and load this ps's shard of checkpoint `path`.
    Restore { setup: Setup, path: PathBuf },
    /// The parameters once the global step is at least `step` (sync; async: at once).
    Pull { step: u64 },
    /// Gradients of `samples` samples computed at `step`; the payload is this ps's
    /// shards' gradients in the order of `vars` (`var@offset`, length).
    Push {
        step: u64,
        samples: usize,
        /// `None` for a loss that is not finite (JSON has no NaN).
        loss: Option<f32>,
        vars: Vec<(String, usize)>,
    },
    /// The chief: write this ps's shard into checkpoint staging directory `dir`.
    Save { dir: PathBuf },
    /// A worker stops training with an error: the ps tells every other worker and stops.
    Abort { message: String },
    /// This worker is done.
    Done,
}

/// A ps's reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// Done; the global step.
    Ok { step: u64 },
    /// The parameters (payload) at `step`, and the loss of the update that made them.
    Params { step: u64, loss: Option<f32> },
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
}

/// A loss as it travels: `None` if not finite.
pub fn finite(loss: f32) -> Option<f32> {
    loss.is_finite().then_some(loss)
}

/// The tag of requests (worker to ps), reserved at the top of the tag range.
pub fn request_tag<C: Comm>(c: &C) -> i32 {
    c.tags().reserved(Reserved::PsRequest)
}

/// The tag of replies (ps to worker).
pub fn reply_tag<C: Comm>(c: &C) -> i32 {
    c.tags().reserved(Reserved::PsReply)
}

/// The bytes of floats as they travel (little-endian).
fn f32_bytes(x: &[f32]) -> &[u8] {
    #[cfg(not(target_endian = "little"))]
    compile_error!("the ps wire format assumes a little-endian machine");
    // SAFETY: any f32 slice is a valid byte slice of 4x its length (u8 has alignment 1).
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

/// One message from a header and several float slices, copied once.
pub fn encode<H: Serialize>(header: &H, parts: &[&[f32]]) -> Vec<u8> {
    let h = serde_json::to_vec(header).expect("protocol headers serialise");
    let floats: usize = parts.iter().map(|p| p.len()).sum();
    let mut out = Vec::with_capacity(4 + h.len() + 4 * floats);
    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
    out.extend_from_slice(&h);
    for p in parts {
        out.extend_from_slice(f32_bytes(p));
    }
    out
}

/// The header and payload of a message, or `None` if it is not one of `H`.
pub fn decode<H: DeserializeOwned>(bytes: &[u8]) -> Option<(H, Vec<f32>)> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_with_their_payload_and_a_non_finite_loss() {
        let r = Request::Push {
            step: 7,
            samples: 21,
            loss: finite(f32::NAN),
            vars: vec![("layer0/w@0".into(), 3)],
        };
        let m = encode(&r, &[&[1.0, 2.0], &[3.0]]);
        let (back, payload): (Request, _) = decode(&m).unwrap();
        assert_eq!(back, r);
        assert_eq!(payload, [1.0, 2.0, 3.0]);
        // A checksum above 2^53 survives (JSON numbers are u64 here, not f64).
        let s = Reply::Saved {
            file: "shard-ps0.bin".into(),
            bytes: 9,
            checksum: u64::MAX - 1,
        };
        assert_eq!(decode::<Reply>(&encode(&s, &[])).unwrap().0, s);
        // A reply is not a request; a truncated message is nothing.
        assert!(decode::<Request>(&encode(&s, &[])).is_none());
        assert!(decode::<Reply>(&m[..m.len() - 1]).is_none());
    }
}
