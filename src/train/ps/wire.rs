//! Bounded sends and receives: every wait of the ps protocol has a deadline, and yields
//! the CPU while it waits (busy waiting starves oversubscribed ranks).

use std::time::{Duration, Instant};

use super::protocol::{decode_view, reply_tag, Reply};
use crate::transport::comm::{Backoff, Comm, TransportError};

/// Waits for a message from `src` (or any source) on `tag`, at most `deadline`.
pub fn receive_within<C: Comm>(
    c: &C,
    src: usize,
    tag: i32,
    deadline: Duration,
) -> Result<Option<(usize, Vec<u8>)>, TransportError> {
    let mut buf = Vec::new();
    Ok(receive_within_into(c, src, tag, deadline, &mut buf)?.map(|from| (from, buf)))
}

/// [`receive_within`] into `buf` (its allocation reused); returns the sender.
pub fn receive_within_into<C: Comm>(
    c: &C,
    src: usize,
    tag: i32,
    deadline: Duration,
    buf: &mut Vec<u8>,
) -> Result<Option<usize>, TransportError> {
    let start = Instant::now();
    let mut backoff = Backoff::new(Duration::from_micros(50));
    loop {
        if let Some(from) = c.try_receive_into(src, tag, deadline, buf)? {
            return Ok(Some(from));
        }
        if start.elapsed() > deadline {
            return Ok(None);
        }
        backoff.idle();
    }
}

/// How a bounded send ended.
pub enum Sent {
    /// Completed; with the watched peer's reply if one arrived meanwhile (its reply can
    /// arrive before the send's completion is visible here).
    Done(Option<Vec<u8>>),
    /// Not completed within the deadline (the peer is gone or stuck).
    TimedOut,
    /// While waiting, the watched peer sent an error (an abort): here it is.
    Interrupted(String),
}

/// The message of an error reply (or of a message that is no reply at all).
pub fn error_of(m: &[u8]) -> Option<String> {
    match decode_view::<Reply>(m) {
        Some((Reply::Error { message }, _)) => Some(message),
        Some(_) => None,
        None => Some("malformed reply".into()),
    }
}

/// Sends `bytes` to `to`, waiting at most `deadline` for completion, and meanwhile takes a
/// reply from `watch` if one arrives (a ps that aborts while this worker is still
/// pushing to it). After [`Sent::TimedOut`], [`Sent::Interrupted`] or an error the send
/// may still be in flight: the caller must keep `bytes` alive for as long as MPI may read them
/// (leak them: the process is about to stop anyway); [`send_owned_within`] does that.
pub fn send_within<C: Comm>(
    c: &C,
    bytes: &[u8],
    to: usize,
    tag: i32,
    deadline: Duration,
    watch: Option<usize>,
) -> Result<Sent, TransportError> {
    // SAFETY: `bytes` stays alive until the request completes; if it does not complete
    // here, the caller keeps them alive (see above).
    let mut req = unsafe { c.isend(bytes.as_ptr(), bytes.len(), to, tag)? };
    let start = Instant::now();
    let mut backoff = Backoff::new(Duration::from_micros(50));
    let mut early: Option<Vec<u8>> = None;
    loop {
        if c.test(&mut req)?.is_some() {
            return Ok(Sent::Done(early));
        }
        if let (Some(w), None) = (watch, &early) {
            if let Some((_, m)) = c.try_receive(w, reply_tag(c), deadline)? {
                if let Some(message) = error_of(&m) {
                    std::mem::forget(req);
                    return Ok(Sent::Interrupted(message));
                }
                early = Some(m);
            }
        }
        if start.elapsed() > deadline {
            std::mem::forget(req);
            return Ok(Sent::TimedOut);
        }
        backoff.idle();
    }
}

/// [`send_within`] of a message it owns: leaked if the send may still be in flight.
pub fn send_owned_within<C: Comm>(
    c: &C,
    bytes: Vec<u8>,
    to: usize,
    tag: i32,
    deadline: Duration,
    watch: Option<usize>,
) -> Result<Sent, TransportError> {
    let sent = send_within(c, &bytes, to, tag, deadline, watch);
    if !matches!(sent, Ok(Sent::Done(_))) {
        std::mem::forget(bytes);
    }
    sent
}

/// Best effort: sends `message` to each of `ranks` on `tag`, giving each a second (the
/// notice that training stops; a rank that is gone does not hold up the others).
pub fn notify<C: Comm>(c: &C, message: &[u8], ranks: impl IntoIterator<Item = usize>, tag: i32) {
    for r in ranks {
        let _ = send_owned_within(c, message.to_vec(), r, tag, Duration::from_secs(1), None);
    }
}
