//! The ps wire protocol: typed requests (worker to ps) and replies (ps to worker).
//!
//! One message each: `[u32 n | JSON header of n bytes | f32 payload]`. The header is a
//! [`Request`] or a [`Reply`] (serde), padded with spaces to a multiple of 4 bytes so that
//! the payload is aligned as floats wherever the message lands: a receiver reads it in
//! place ([`decode_view`]). The payload carries the floats the header names (initial
//! values, gradients, parameters), little-endian, sent without gathering them first; a
//! ps answers a pull from its parameters' own memory, the header written in front of
//! them ([`frame_before`]). Requests travel on tag [`Reserved::PsRequest`], replies on
//! [`Reserved::PsReply`], both at the top of the tag range.

use std::borrow::Cow;
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

/// A header's JSON, padded with spaces (which JSON ignores) to a multiple of 4 bytes.
fn header_json<H: Serialize>(header: &H) -> Vec<u8> {
    let mut h = serde_json::to_vec(header).expect("protocol headers serialise");
    h.resize(h.len().next_multiple_of(4), b' ');
    h
}

/// One message from a header and several float slices, copied once.
pub fn encode<H: Serialize>(header: &H, parts: &[&[f32]]) -> Vec<u8> {
    let h = header_json(header);
    let floats: usize = parts.iter().map(|p| p.len()).sum();
    let mut out = Vec::with_capacity(4 + h.len() + 4 * floats);
    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
    out.extend_from_slice(&h);
    for p in parts {
        out.extend_from_slice(f32_bytes(p));
    }
    out
}

/// Writes `[u32 n | header]` into `room` so that it ends where `room` ends (where a
/// payload already in memory begins); returns the offset in `room` where the message
/// starts, or `None` if the header does not fit.
pub fn frame_before<H: Serialize>(header: &H, room: &mut [u8]) -> Option<usize> {
    let h = header_json(header);
    let start = room.len().checked_sub(4 + h.len())?;
    room[start..start + 4].copy_from_slice(&(h.len() as u32).to_le_bytes());
    room[start + 4..].copy_from_slice(&h);
    Some(start)
}

/// The header and payload of a message, or `None` if it is not one of `H`. The payload
/// is read in place when it lies aligned as floats (a message of [`encode`] or
/// [`frame_before`] in a buffer from the allocator), else copied.
pub fn decode_view<H: DeserializeOwned>(bytes: &[u8]) -> Option<(H, Cow<'_, [f32]>)> {
    let n = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let header = serde_json::from_slice(bytes.get(4..4 + n)?).ok()?;
    let rest = &bytes[4 + n..];
    if !rest.len().is_multiple_of(4) {
        return None;
    }
    // SAFETY: every bit pattern is a valid f32; align_to only reinterprets the aligned
    // middle of the byte slice.
    let (head, mid, tail) = unsafe { rest.align_to::<f32>() };
    if head.is_empty() && tail.is_empty() {
        return Some((header, Cow::Borrowed(mid)));
    }
    let mut floats: Vec<f32> = Vec::with_capacity(rest.len() / 4);
    // SAFETY: the allocation holds rest.len() bytes; the regions do not overlap; every bit
    // pattern is a valid f32; the length is set only once all elements are written (one
    // memcpy, no zeroing first).
    unsafe {
        std::ptr::copy_nonoverlapping(rest.as_ptr(), floats.as_mut_ptr().cast::<u8>(), rest.len());
        floats.set_len(rest.len() / 4);
    }
    Some((header, Cow::Owned(floats)))
}

/// [`decode_view`] with the payload copied out.
pub fn decode<H: DeserializeOwned>(bytes: &[u8]) -> Option<(H, Vec<f32>)> {
    decode_view(bytes).map(|(h, p)| (h, p.into_owned()))
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

    #[test]
    fn payloads_are_read_in_place_and_headers_framed_before_them() {
        let r = Reply::Params {
            step: 3,
            loss: Some(0.5),
        };
        // Headers of every length mod 4 leave the payload aligned.
        for pad in 0..4 {
            let long = Reply::Error {
                message: "x".repeat(pad),
            };
            assert_eq!((encode(&long, &[]).len() - 4) % 4, 0);
        }
        let m = encode(&r, &[&[1.0, 2.0]]);
        let (back, payload) = decode_view::<Reply>(&m).unwrap();
        assert_eq!(back, r);
        assert!(matches!(payload, Cow::Borrowed(_)));
        assert_eq!(&payload[..], &[1.0, 2.0]);
        // Misaligned bytes still decode, by a copy.
        let mut shifted = vec![0u8; m.len() + 1];
        shifted[1..].copy_from_slice(&m);
        let (_, payload) = decode_view::<Reply>(&shifted[1..]).unwrap();
        assert_eq!(&payload[..], &[1.0, 2.0]);
        // A header framed in front of floats already in memory reads as one message.
        let mut buf = [0u8; 64 + 8];
        buf[64..68].copy_from_slice(&1.5f32.to_le_bytes());
        buf[68..].copy_from_slice(&(-2.0f32).to_le_bytes());
        let (room, _) = buf.split_at_mut(64);
        let start = frame_before(&r, room).unwrap();
        let (back, payload) = decode::<Reply>(&buf[start..]).unwrap();
        assert_eq!((back, payload), (r.clone(), vec![1.5, -2.0]));
        assert_eq!(frame_before(&r, &mut [0u8; 8]), None);
    }
}
