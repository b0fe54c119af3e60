//! Bounded sends and receives: every wait of the ps protocol has a deadline, and yields
//! the CPU while it waits (busy waiting starves oversubscribed ranks).
//!
//! Requests and replies (their headers, with small payloads inline) are messages of
//! [`crate::transport::messages`]: through a ring between ranks of one node, else MPI. A
//! payload's pieces, received where they go, are MPI's messages on their own tag.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::protocol::{decode_with, payload_tag, request_tag, Reply};
use crate::transport::comm::{Backoff, Comm, TransportError, ANY_SOURCE};
use crate::transport::messages;

/// Waits for a request or reply from `src` (or any source) on `tag`, at most `deadline`,
/// into `buf` (its allocation reused); the sender.
pub fn receive_within_into<C: Comm>(
    c: &C,
    src: usize,
    tag: i32,
    deadline: Duration,
    buf: &mut Vec<u8>,
) -> Result<Option<usize>, TransportError> {
    let start = Instant::now();
    let mut backoff = Backoff::polling_mpi(Duration::from_micros(50));
    loop {
        if let Some(from) = messages::try_receive_into(c, src, tag, deadline, buf)? {
            return Ok(Some(from));
        }
        if start.elapsed() > deadline {
            return Ok(None);
        }
        backoff.idle();
    }
}

/// How bounded sends ended.
#[derive(Debug)]
pub enum Sent {
    /// All completed.
    Done,
    /// The send to `to` did not complete within the deadline (the peer is gone or stuck).
    TimedOut { to: usize },
    /// While waiting, a watched peer sent an error (an abort): here it is.
    Interrupted(String),
}

/// The reply a message holds and its inline payload; `Err`: the message of an error
/// reply (or of a message that is no reply at all).
pub fn reply_of(m: &[u8]) -> Result<(Reply, &[u8]), String> {
    match decode_with::<Reply>(m) {
        Some((Reply::Error { message }, _)) => Err(message),
        Some(reply) => Ok(reply),
        None => Err("malformed reply".into()),
    }
}

/// One message to send: its bytes, its destination, its tag.
pub type Outgoing<'b> = (&'b [u8], usize, i32);

/// [`send_all_then`] for a ps's replies: meanwhile every request that arrives (from any
/// worker) is taken into `backlog`, in order, for the ps to serve next; one whose sender
/// stops halfway ends the wait as [`Sent::TimedOut`] naming that sender. A request larger
/// than MPI sends eagerly completes only once taken: a worker whose request waits on this
/// ps while this ps waits on another worker, who waits on a ps that waits on the first,
/// would be a cycle.
pub fn send_all_taking<C: Comm>(
    c: &C,
    out: &[Outgoing<'_>],
    deadline: Duration,
    backlog: &mut VecDeque<(usize, Vec<u8>)>,
) -> Result<Sent, TransportError> {
    send_all_then(c, out, deadline, || loop {
        match messages::try_receive(c, ANY_SOURCE, request_tag(c), deadline) {
            Ok(Some(got)) => backlog.push_back(got),
            Ok(None) => return Ok(None),
            // A request that began to arrive and never ended: its sender is gone.
            Err(TransportError::Timeout { peer, .. }) => {
                return Ok(Some(Sent::TimedOut { to: peer }))
            }
            Err(e) => return Err(e),
        }
    })
}

/// Starts every message of `out` at once and waits at most `deadline` for all, calling
/// `meanwhile` while any is pending (its `Some` ends the wait with that outcome). After
/// anything but [`Sent::Done`] or an error, sends may still be in flight: the caller must
/// keep every buffer of `out` alive for as long as MPI may read it (leak it: the process
/// is about to stop anyway).
pub fn send_all_then<C: Comm>(
    c: &C,
    out: &[Outgoing<'_>],
    deadline: Duration,
    mut meanwhile: impl FnMut() -> Result<Option<Sent>, TransportError>,
) -> Result<Sent, TransportError> {
    let mut reqs = Vec::with_capacity(out.len());
    let in_flight = |reqs: Vec<Option<(C::Request, usize)>>| std::mem::forget(reqs);
    let pieces = payload_tag(c);
    for &(bytes, to, tag) in out {
        // A request's or a reply's header: through the ring where it can.
        match (tag != pieces).then(|| messages::put(c, bytes, to, tag)) {
            Some(Ok(true)) => continue,
            Some(Err(e)) => {
                in_flight(reqs);
                return Err(e);
            }
            Some(Ok(false)) | None => {}
        }
        // SAFETY: `bytes` stay alive until the request completes; if it does not complete
        // here, the caller keeps them alive (see above).
        match unsafe { c.isend(bytes.as_ptr(), bytes.len(), to, tag) } {
            Ok(r) => reqs.push(Some((r, to))),
            Err(e) => {
                in_flight(reqs);
                return Err(e);
            }
        }
    }
    // Sends that complete at once (small ones do) read no clock.
    let mut start = None;
    let mut backoff = Backoff::polling_mpi(Duration::from_micros(50));
    loop {
        let mut pending = None;
        for slot in &mut reqs {
            let Some((r, to)) = slot else { continue };
            match c.test(r) {
                Ok(Some(_)) => *slot = None,
                Ok(None) => pending = pending.or(Some(*to)),
                Err(e) => {
                    in_flight(reqs);
                    return Err(e);
                }
            }
        }
        let Some(to) = pending else {
            return Ok(Sent::Done);
        };
        match meanwhile() {
            Ok(None) => {}
            Ok(Some(outcome)) => {
                in_flight(reqs);
                return Ok(outcome);
            }
            Err(e) => {
                in_flight(reqs);
                return Err(e);
            }
        }
        if start.get_or_insert_with(Instant::now).elapsed() > deadline {
            in_flight(reqs);
            return Ok(Sent::TimedOut { to });
        }
        backoff.idle();
    }
}

/// Sends `bytes` to `to`, waiting at most `deadline` for completion (see
/// [`send_all_then`]: after anything but [`Sent::Done`] the caller keeps `bytes` alive).
pub fn send_within<C: Comm>(
    c: &C,
    bytes: &[u8],
    to: usize,
    tag: i32,
    deadline: Duration,
) -> Result<Sent, TransportError> {
    send_all_then(c, &[(bytes, to, tag)], deadline, || Ok(None))
}

/// [`send_within`] of a message it owns: leaked if the send may still be in flight.
pub fn send_owned_within<C: Comm>(
    c: &C,
    bytes: Vec<u8>,
    to: usize,
    tag: i32,
    deadline: Duration,
) -> Result<Sent, TransportError> {
    let sent = send_within(c, &bytes, to, tag, deadline);
    if !matches!(sent, Ok(Sent::Done)) {
        std::mem::forget(bytes);
    }
    sent
}

/// How bounded receives ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Received {
    /// Every buffer holds its message, of exactly its length.
    Done,
    /// No message from `from` within the deadline.
    TimedOut { from: usize },
    /// `from` sent a message of another length than the `want` bytes due.
    Length { from: usize, want: usize },
}

/// One message to receive: the buffer it fills exactly, its sender, its tag.
pub type Incoming<'b> = (&'b mut [u8], usize, i32);

/// Starts receiving into every buffer of `into` at once and waits at most `deadline` for
/// all of them. After anything but [`Received::Done`] or an error, receives may still be
/// in flight: the caller must keep every buffer alive for as long as MPI may write it
/// (leak it).
pub fn receive_all_within<C: Comm>(
    c: &C,
    into: &mut [Incoming<'_>],
    deadline: Duration,
) -> Result<Received, TransportError> {
    let mut reqs = Vec::with_capacity(into.len());
    let in_flight = |reqs: Vec<Option<(C::Request, usize, usize)>>| std::mem::forget(reqs);
    for (buf, from, tag) in into.iter_mut() {
        // SAFETY: the buffer is neither read nor released until the request completes; if
        // it does not complete here, the caller keeps it alive (see above).
        match unsafe { c.irecv(buf.as_mut_ptr(), buf.len(), *from, *tag) } {
            Ok(r) => reqs.push(Some((r, *from, buf.len()))),
            Err(e) => {
                in_flight(reqs);
                return Err(e);
            }
        }
    }
    let start = Instant::now();
    let mut backoff = Backoff::polling_mpi(Duration::from_micros(50));
    let mut wrong = None;
    loop {
        let mut pending = None;
        // In posting order, up to the first that is not complete: what MPI matches at
        // posting, `LocalComm` matches when tested.
        for slot in &mut reqs {
            let Some((r, from, want)) = slot else {
                continue;
            };
            if pending.is_some() {
                break;
            }
            match c.test(r) {
                Ok(Some(done)) => {
                    if done.truncated() || done.count != *want {
                        wrong = wrong.or(Some(Received::Length {
                            from: *from,
                            want: *want,
                        }));
                    }
                    *slot = None;
                }
                Ok(None) => pending = pending.or(Some(*from)),
                Err(e) => {
                    in_flight(reqs);
                    return Err(e);
                }
            }
        }
        let Some(from) = pending else {
            return Ok(wrong.unwrap_or(Received::Done));
        };
        if start.elapsed() > deadline {
            in_flight(reqs);
            return Ok(Received::TimedOut { from });
        }
        backoff.idle();
    }
}

/// Best effort: sends `message` to each of `ranks` on `tag`, giving each a second (the
/// notice that training stops; a rank that is gone does not hold up the others).
pub fn notify<C: Comm>(c: &C, message: &[u8], ranks: impl IntoIterator<Item = usize>, tag: i32) {
    for r in ranks {
        let _ = send_owned_within(c, message.to_vec(), r, tag, Duration::from_secs(1));
    }
}
