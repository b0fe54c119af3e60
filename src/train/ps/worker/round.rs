//! A round with the ps tasks: one request to every ps, every reply awaited, each with a
//! deadline; what follows a reply (its floats) taken into place.

use std::time::Instant;

use super::Client;
use crate::train::ps::protocol::{
    encode_into, f32_bytes, f32_bytes_mut, inline, payload_tag, read_inline, reply_tag,
    request_tag, Reply, Request, PIECE_FLOATS,
};
use crate::train::ps::wire::{
    receive_all_within, receive_within_into, reply_of, send_all_then, Incoming, Outgoing, Received,
    Sent,
};
use crate::train::ps::PsError;
use crate::transport::comm::{Comm, TransportError};
use crate::transport::messages;

/// Floats after a ps's reply that did not fit what this worker awaited
/// ([`Client::take_floats`]).
pub(in crate::train::ps) enum Misfit {
    /// The reply's message held `sent` floats.
    Inline { sent: usize },
    /// A piece was not of the `want` bytes due.
    Piece { want: usize },
}

impl<C: Comm> Client<'_, C> {
    pub(in crate::train::ps) fn lost(&self, rank: usize) -> PsError {
        PsError::Lost {
            task: self.me(),
            lost: self.roles.task(rank),
            secs: (self.timeout * 2).as_secs(),
        }
    }

    fn remote(&self, message: String) -> PsError {
        PsError::Remote {
            task: self.me(),
            message,
        }
    }

    /// Sends one request to every ps (its header, then its payload `payload(k)` as pieces
    /// from where the floats are) and waits for every reply; a ps's error reply stops with
    /// its message. Returns the replies, one per ps. After an error, MPI may still read the
    /// payload: the caller gives up its memory.
    pub(in crate::train::ps) fn round<'p>(
        &self,
        request: impl Fn(usize) -> Request,
        payload: impl Fn(usize) -> Vec<&'p [f32]>,
    ) -> Result<Vec<Reply>, PsError> {
        let (replies, _) = self.round_then(request, payload, |_, _, _| Ok(()))?;
        Ok(replies)
    }

    /// [`Client::round`] that takes what follows each ps's reply (`then(k, reply, inline
    /// payload)`) as soon as that reply is in, while this worker's own sends are still in
    /// flight too; returns the replies and when the request's sends completed.
    /// Taking each reply whole as it comes is what keeps a round from a cycle: a ps waits
    /// for its reply's pieces to be taken before it serves anyone else, so a worker that
    /// took no reply before its sends to every ps completed could wait on a second ps that
    /// replies to another worker, itself sending to the first ps, which waits on this one.
    pub(in crate::train::ps) fn round_then<'p>(
        &self,
        request: impl Fn(usize) -> Request,
        payload: impl Fn(usize) -> Vec<&'p [f32]>,
        mut then: impl FnMut(usize, &Reply, &[u8]) -> Result<(), PsError>,
    ) -> Result<(Vec<Reply>, Instant), PsError> {
        self.settle_ahead()?;
        let taken = self.send_round(request, payload, &mut then)?;
        let sent = Instant::now();
        Ok((self.finish_round(taken, &mut then)?, sent))
    }

    /// The first half of [`Client::round_then`]: sends one request to every ps, taking
    /// the replies that come meanwhile; the replies taken (one place per ps).
    pub(in crate::train::ps) fn send_round<'p>(
        &self,
        request: impl Fn(usize) -> Request,
        payload: impl Fn(usize) -> Vec<&'p [f32]>,
        then: &mut impl FnMut(usize, &Reply, &[u8]) -> Result<(), PsError>,
    ) -> Result<Vec<Option<Reply>>, PsError> {
        // Twice the ps's own deadline: a ps that lost another task says so first.
        let deadline = self.timeout * 2;
        let nps = self.roles.ps.len();
        let payloads: Vec<Vec<&[f32]>> = (0..nps).map(payload).collect();
        let small = |k: usize| inline(payloads[k].iter().map(|p| p.len()));
        let (mut headers, mut inbox) = (self.buffers.headers.take(), self.buffers.inbox.take());
        headers.resize_with(nps, Vec::new);
        for (k, h) in headers.iter_mut().enumerate() {
            let parts: &[&[f32]] = if small(k) { &payloads[k] } else { &[] };
            encode_into(h, &request(k), parts);
        }
        let (req, data) = (request_tag(self.comm), payload_tag(self.comm));
        let mut out: Vec<Outgoing<'_>> = Vec::new();
        for (k, r) in self.roles.ps.iter().enumerate() {
            out.push((&headers[k], *r, req));
            if small(k) {
                continue;
            }
            for piece in payloads[k].iter().flat_map(|p| p.chunks(PIECE_FLOATS)) {
                out.push((f32_bytes(piece), *r, data));
            }
        }
        let mut taken: Vec<Option<Reply>> = self.roles.ps.iter().map(|_| None).collect();
        let mut failed = None;
        let rtag = reply_tag(self.comm);
        let sent = send_all_then(self.comm, &out, deadline, || {
            for (k, r) in self.roles.ps.iter().enumerate() {
                if taken[k].is_some() {
                    continue;
                }
                if (messages::try_receive_into(self.comm, *r, rtag, deadline, &mut inbox)?)
                    .is_none()
                {
                    continue;
                }
                match self.take_reply(k, &inbox, then) {
                    Ok(reply) => taken[k] = reply,
                    Err(e) => {
                        failed = Some(e);
                        return Ok(Some(Sent::Interrupted(String::new())));
                    }
                }
            }
            Ok(None)
        });
        if !matches!(sent, Ok(Sent::Done)) {
            std::mem::forget(headers);
            if let Some(e) = failed {
                return Err(e);
            }
            return Err(match sent? {
                Sent::TimedOut { to } => self.lost(to),
                Sent::Interrupted(message) => self.remote(message),
                Sent::Done => unreachable!("matched above"),
            });
        }
        drop(out);
        self.buffers.headers.replace(headers);
        self.buffers.inbox.replace(inbox);
        Ok(taken)
    }

    /// The second half of [`Client::round_then`]: waits for every reply not `taken` yet
    /// (each ps's within the deadline), then the verdict: the replies, one per ps.
    pub(in crate::train::ps) fn finish_round(
        &self,
        mut taken: Vec<Option<Reply>>,
        then: &mut impl FnMut(usize, &Reply, &[u8]) -> Result<(), PsError>,
    ) -> Result<Vec<Reply>, PsError> {
        let deadline = self.timeout * 2;
        let rtag = reply_tag(self.comm);
        let mut inbox = self.buffers.inbox.take();
        for (k, r) in self.roles.ps.iter().enumerate() {
            // Each wait has the whole deadline: a ps still working says so within it.
            while taken[k].is_none() {
                match receive_within_into(self.comm, *r, rtag, deadline, &mut inbox) {
                    Ok(Some(_)) => {}
                    Ok(None) | Err(TransportError::Timeout { .. }) => return Err(self.lost(*r)),
                    Err(e) => return Err(e.into()),
                };
                taken[k] = self.take_reply(k, &inbox, then)?;
            }
        }
        self.buffers.inbox.replace(inbox);
        // A step the ps tasks did not apply: every ps's reply is taken, then the verdict.
        let mut replies = Vec::with_capacity(taken.len());
        let mut not_applied = None;
        for reply in taken.into_iter().flatten() {
            match reply {
                Reply::NotApplied { why } => not_applied = not_applied.or(Some(why)),
                reply => replies.push(reply),
            }
        }
        match not_applied {
            Some(why) => Err(PsError::NotApplied(why)),
            None => Ok(replies),
        }
    }

    /// Ps `k`'s reply in message `m`, what follows it taken by `then` (unless the ps did
    /// not apply the step); an error reply is the ps's error (it names itself); `None`:
    /// the ps is still working on the request ([`Reply::Alive`]).
    fn take_reply(
        &self,
        k: usize,
        m: &[u8],
        then: &mut impl FnMut(usize, &Reply, &[u8]) -> Result<(), PsError>,
    ) -> Result<Option<Reply>, PsError> {
        let (reply, inline) = reply_of(m).map_err(|message| self.remote(message))?;
        match reply {
            Reply::Alive => return Ok(None),
            Reply::NotApplied { .. } => {}
            _ => then(k, &reply, inline)?,
        }
        Ok(Some(reply))
    }

    /// Ps `k`'s floats after its reply into `places`, whose lengths say how many are due:
    /// out of the reply's message (`inline_bytes`) where they ride in it, else the pieces
    /// that follow it. `Some`: what came did not fit (the caller names it).
    pub(in crate::train::ps) fn take_floats(
        &self,
        k: usize,
        places: &mut [&mut [f32]],
        inline_bytes: &[u8],
    ) -> Result<Option<Misfit>, PsError> {
        if inline(places.iter().map(|p| p.len())) {
            let fits = read_inline(inline_bytes, places.iter_mut().map(|p| &mut **p));
            let sent = inline_bytes.len() / 4;
            return Ok((!fits).then_some(Misfit::Inline { sent }));
        }
        let (r, data) = (self.roles.ps[k], payload_tag(self.comm));
        let mut into: Vec<Incoming<'_>> = (places.iter_mut())
            .flat_map(|p| p.chunks_mut(PIECE_FLOATS))
            .map(|piece| (f32_bytes_mut(piece), r, data))
            .collect();
        match receive_all_within(self.comm, &mut into, self.timeout * 2)? {
            Received::Done => Ok(None),
            Received::TimedOut { from } => Err(self.lost(from)),
            Received::Length { want, .. } => Ok(Some(Misfit::Piece { want })),
        }
    }
}
