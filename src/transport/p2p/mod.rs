//! Tensors between two ranks (by task: [`crate::cluster::peers`]).
//!
//! One message per tensor, straight from its memory (`MPI_Isend` of the header and payload
//! that lie contiguous in the tensor, see [`crate::tensor`]), received straight into the
//! destination tensor (`MPI_Irecv`) and checked there: a tensor of another dtype, shape or
//! name is an error naming both sides, and a longer message is cut at the receiver's
//! buffer end, never written past it.
//!
//! Headers are sent when they say something new. Each communicator remembers, per (peer,
//! tag), the tensor last sent and the tensor last received (`Links`); both sides update
//! it in the same order, so they agree on it. Sending the link's last tensor again puts
//! its payload alone on the wire, and a receiver that expects the link's last tensor
//! receives the payload alone into place: the check is then that both sides' tensors
//! equal the one whose header crossed before (a signature comparison on each side), and
//! that exactly its bytes arrived. The same tensor sent at every step costs what plain
//! MPI costs, where a small header would push small messages into OpenMPI's next size
//! class. When a receiver expects something else
//! than the sender sends, the message tells by its length which kind it is: a sender
//! pads a whole message ([`crate::tensor::WIRE_PAD`]) whose length would equal the link's
//! last payload; so the error still names both sides, and no message is misread.
//! Receives therefore name their source (no `ANY_SOURCE`).
//!
//! Between two ranks of one node a link's tensors of at most 32 KiB go through a ring in
//! shared memory (`super::ring`; the sender offers it with the link's first message,
//! the receiver maps it at its first receive; a tensor over 4 KiB takes several slots),
//! in order with the link's larger messages, which go by MPI (the comparison with plain
//! MPI: `docs/data-plane.md`). So a
//! link owns its (peer, tag): plain MPI messages on the same tag between the same ranks
//! are not seen by its receives, nor its messages by plain MPI receives. On a ring, an
//! `immediate_` receive of a tensor of at most 4 KiB (or one started after it on its
//! link) happens when it is waited on, or when a later receive on the link needs it done
//! first; one of a larger tensor is posted at once (the link's messages go by MPI until
//! its next blocking receive of what the ring carries, after it completed).
//!
//! Naming follows rsmpi: `send`/`receive_into` block; `immediate_send` and
//! `immediate_receive_into` return requests, so several tensors can be in flight at once.
//! A request that is dropped without `wait` waits in its destructor: the tensor it borrows
//! is never freed or reused while MPI may still touch it.

mod batch;
mod owned;

pub(crate) use batch::{DeferredReceive, ExactLength};
pub use batch::{Receives, Sends};
pub use owned::{immediate_send_owned, OwnedSend};

use super::comm::{check_peer, Comm, Completion, TransportError, ANY_SOURCE};
use super::links::{link_key, Last, Links};
use super::ring::Start;
use crate::tensor::{describe_header, Landing, Tensor, TensorError};

/// Errors from point-to-point tensor transfers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum P2pError {
    #[error("{0}")]
    Transport(#[from] TransportError),
    #[error("rank {rank}: from rank {peer}: {source}")]
    Tensor {
        rank: usize,
        peer: usize,
        source: TensorError,
    },
    #[error("rank {rank}: {source}")]
    Tag {
        rank: usize,
        source: super::tags::TagError,
    },
    #[error("rank {0}: tensor transfers name their peer rank (no ANY_SOURCE): headers are remembered per peer")]
    AnySource(usize),
    #[error("rank {rank}: closed the inbox of the channel with rank {peer} (tag {tag}) with {count} messages that arrived and were never received")]
    Untaken {
        rank: usize,
        peer: usize,
        tag: i32,
        count: usize,
    },
    #[error("rank {rank}: the inbox of the channel with rank {peer} (tag {tag}) failed to post one of its receives: close it")]
    InboxBroken { rank: usize, peer: usize, tag: i32 },
    #[error(
        "rank {rank}: channel with rank {peer} (tag {tag}) was opened for {opened}, not {given}"
    )]
    Channel {
        rank: usize,
        peer: usize,
        tag: i32,
        opened: String,
        given: String,
    },
}

#[inline]
pub(crate) fn check_tag<C: Comm>(c: &C, tag: i32) -> Result<(), P2pError> {
    c.tags().check_user(tag).map_err(|source| P2pError::Tag {
        rank: c.rank(),
        source,
    })
}

impl Links {
    /// The bytes that carry `t` to `dst` on `tag`: its payload alone when the link's last
    /// tensor was this one, else the whole message, padded if its length would be that of
    /// the link's last payload. The link holds `t` afterwards.
    #[inline]
    fn outgoing<'t>(&self, t: &'t Tensor, dst: usize, tag: i32) -> &'t [u8] {
        let key = link_key(dst, tag);
        if self.sent.memo_holds(key, t.signature()) {
            return t.bytes();
        }
        self.outgoing_slow(t, key)
    }

    /// [`Links::outgoing`] past the memo: out of line, so that a repeat's send is a few
    /// instructions before `MPI_Send`.
    #[cold]
    #[inline(never)]
    fn outgoing_slow<'t>(&self, t: &'t Tensor, key: u64) -> &'t [u8] {
        if self.sent.map_holds(key, t.signature()) {
            return t.bytes();
        }
        let pad = self.sent.nbytes(key) == Some(t.wire_len());
        self.sent.set(key, Last::of(t));
        if pad {
            t.wire_padded()
        } else {
            t.wire()
        }
    }

    /// How a receive of `t` from `src` on `tag` lands: its payload alone when the link's
    /// last tensor was this one, else the whole message, with what the link held before
    /// (to recognise, and name, a payload-only message of that tensor). The link holds `t`
    /// afterwards, as the sender's will once it sends `t`.
    #[inline]
    fn incoming(&self, t: &Tensor, src: usize, tag: i32) -> Arrival {
        let key = link_key(src, tag);
        let (landing, before) = if self.received.memo_holds(key, t.signature()) {
            (Landing::Payload, None)
        } else {
            self.incoming_slow(t, key)
        };
        Arrival {
            src,
            tag,
            landing,
            before,
        }
    }

    /// [`Links::incoming`] past the memo, out of line.
    #[cold]
    #[inline(never)]
    fn incoming_slow(&self, t: &Tensor, key: u64) -> (Landing, Option<Box<Last>>) {
        if self.received.map_holds(key, t.signature()) {
            return (Landing::Payload, None);
        }
        (
            Landing::Whole,
            self.received.set(key, Last::of(t)).map(Box::new),
        )
    }

    /// Checks what a receive brought; on a mismatch the link holds what the sender sent
    /// (as the sender's link does), so the next message is still understood.
    #[inline]
    fn settle<C: Comm>(
        &self,
        c: &C,
        arrival: Arrival,
        t: &mut Tensor,
        done: Completion,
    ) -> Result<(), P2pError> {
        if arrival.landing == Landing::Payload && !done.truncated() && done.count == t.nbytes() {
            return Ok(());
        }
        self.settle_whole(c.rank(), arrival, t, done)
    }

    /// [`Links::settle`] for all but an exact repeat, on rank `rank`: out of line (and
    /// one copy for every transport), so the repeat's path stays a few instructions (its
    /// stack frame and spills cost more than its checks).
    #[cold]
    #[inline(never)]
    fn settle_whole(
        &self,
        rank: usize,
        arrival: Arrival,
        t: &mut Tensor,
        done: Completion,
    ) -> Result<(), P2pError> {
        let Arrival {
            src,
            tag,
            landing,
            before,
        } = arrival;
        let key = link_key(src, tag);
        let error = |source| P2pError::Tensor {
            rank,
            peer: src,
            source,
        };
        if let Some(last) = before.filter(|l| !done.truncated() && done.count == l.nbytes) {
            // The payload alone of the link's previous tensor: the sender still sends that.
            t.restore_header();
            let theirs = describe_header(&last.header);
            self.received.set(key, *last);
            return Err(error(TensorError::Mismatch {
                ours: t.describe(),
                theirs,
            }));
        }
        t.check_arrival(landing, done.count, done.truncated())
            .map_err(|u| {
                match u.header.and_then(Last::from_header) {
                    Some(theirs) => drop(self.received.set(key, theirs)),
                    None => self.received.forget(key),
                }
                error(u.error)
            })
    }
}

/// How a receive was posted: what [`Links::settle`] needs to check it. Small (what the
/// link held before is boxed, and only there past a repeat): a request carries it.
struct Arrival {
    src: usize,
    tag: i32,
    landing: Landing,
    before: Option<Box<Last>>,
}

impl Arrival {
    /// A receive of the link's last tensor, its payload alone.
    #[inline]
    fn repeat(src: usize, tag: i32) -> Arrival {
        Arrival {
            src,
            tag,
            landing: Landing::Payload,
            before: None,
        }
    }

    /// Moves this arrival out of a request (that is then done with it).
    #[inline]
    fn take(&mut self) -> Arrival {
        Arrival {
            before: self.before.take(),
            ..*self
        }
    }
}

/// A send in flight; the tensor stays borrowed until it completes.
pub struct SendRequest<'a, C: Comm> {
    comm: &'a C,
    req: Option<C::Request>,
    _tensor: std::marker::PhantomData<&'a Tensor>,
}

impl<'a, C: Comm> SendRequest<'a, C> {
    /// A send that completed as it started (into a channel's ring).
    pub(crate) fn completed(comm: &'a C) -> Self {
        SendRequest {
            comm,
            req: None,
            _tensor: std::marker::PhantomData,
        }
    }

    #[inline]
    pub fn wait(mut self) -> Result<(), P2pError> {
        if let Some(req) = self.req.take() {
            self.comm.wait(req)?;
        }
        Ok(())
    }
}

impl<C: Comm> Drop for SendRequest<'_, C> {
    fn drop(&mut self) {
        if let Some(r) = self.req.take() {
            let _ = self.comm.wait(r);
        }
    }
}

/// A receive in flight; the tensor is exclusively borrowed until it completes.
pub struct RecvRequest<'a, C: Comm> {
    comm: &'a C,
    pending: Option<Pending<C::Request>>,
    tensor: &'a mut Tensor,
    arrival: Arrival,
}

/// A receive started and not yet waited on.
enum Pending<R> {
    /// An MPI request.
    Mpi(R),
    /// An MPI request posted under a detach of its link's ring ([`Start::Detached`]).
    Detached(R),
    /// Queued on its link, which may use a ring ([`super::ring::LinkRings::start`]).
    Queued(u64),
}

impl<R> Pending<R> {
    /// Waits for it.
    #[inline]
    fn complete<C: Comm<Request = R>>(
        self,
        c: &C,
        src: usize,
        tag: i32,
    ) -> Result<Completion, P2pError> {
        Ok(match self {
            Pending::Mpi(r) => c.wait(r)?,
            Pending::Detached(r) => {
                let done = c.wait(r);
                c.links().rings.detached_done(src, tag);
                done?
            }
            Pending::Queued(ticket) => c.links().rings.finish(c, src, tag, ticket)?,
        })
    }
}

impl<C: Comm> RecvRequest<'_, C> {
    /// Waits and checks what arrived.
    #[inline]
    pub fn wait(mut self) -> Result<(), P2pError> {
        let pending = self.pending.take().expect("not yet waited");
        let done = pending.complete(self.comm, self.arrival.src, self.arrival.tag)?;
        self.comm
            .links()
            .settle(self.comm, self.arrival.take(), self.tensor, done)
    }

    /// The rank this receive listens to.
    pub fn peer(&self) -> usize {
        self.arrival.src
    }
}

impl<C: Comm> Drop for RecvRequest<'_, C> {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            // Unchecked for the caller, but the link must still learn what arrived.
            if let Ok(done) = p.complete(self.comm, self.arrival.src, self.arrival.tag) {
                let arrival = self.arrival.take();
                let _ = self
                    .comm
                    .links()
                    .settle(self.comm, arrival, self.tensor, done);
            }
        }
    }
}

#[inline]
fn check_link<C: Comm>(c: &C, peer: usize, tag: i32) -> Result<(), P2pError> {
    check_tag(c, tag)?;
    if peer == ANY_SOURCE {
        return Err(P2pError::AnySource(c.rank()));
    }
    Ok(check_peer(c, peer)?)
}

/// Starts sending `t` to rank `dst` (`MPI_Isend`).
#[inline]
pub fn immediate_send<'a, C: Comm>(
    c: &'a C,
    t: &'a Tensor,
    dst: usize,
    tag: i32,
) -> Result<SendRequest<'a, C>, P2pError> {
    check_link(c, dst, tag)?;
    let links = c.links();
    let bytes = links.outgoing(t, dst, tag);
    if links.rings.put(c, bytes, dst, tag)? {
        return Ok(SendRequest::completed(c));
    }
    immediate_send_bytes(c, bytes, dst, tag)
}

/// Starts sending bytes of a tensor (`MPI_Isend`): its wire message here, its payload alone
/// on a [`super::channel::Channel`].
#[inline]
pub(crate) fn immediate_send_bytes<'a, C: Comm>(
    c: &'a C,
    bytes: &'a [u8],
    dst: usize,
    tag: i32,
) -> Result<SendRequest<'a, C>, P2pError> {
    // SAFETY: the request borrows the bytes for 'a, so they stay valid and unmodified until
    // it is waited on (by `wait` or by the destructor).
    let req = unsafe { c.isend(bytes.as_ptr(), bytes.len(), dst, tag)? };
    Ok(SendRequest {
        comm: c,
        req: Some(req),
        _tensor: std::marker::PhantomData,
    })
}

#[inline]
fn landing_region(t: &mut Tensor, landing: Landing) -> &mut [u8] {
    match landing {
        Landing::Whole => t.receive_region(),
        Landing::Payload => t.payload_region(),
    }
}

/// Starts a checked receive into `t` from `src` on a link its caller has checked
/// ([`check_link`]), into the region where the link says the message lands: queued on the
/// link where it may use a ring (the ticket returned; see [`super::ring::LinkRings::start`]), else
/// posted by `post` (an `MPI_Irecv` of the region). Returns what [`Links::settle`] needs
/// once it completes.
///
/// # Safety
/// The caller keeps `t` exclusively borrowed, and neither reads nor moves it, until the
/// receive completes (its request, or [`super::ring::LinkRings::finish`] with its ticket).
#[inline(always)]
unsafe fn start_receive_into<C: Comm>(
    c: &C,
    t: &mut Tensor,
    src: usize,
    tag: i32,
    post: impl FnOnce(*mut u8, usize) -> Result<(), TransportError>,
) -> Result<(Arrival, Start), P2pError> {
    let links = c.links();
    let arrival = links.incoming(t, src, tag);
    let region = landing_region(t, arrival.landing);
    let (buf, len) = (region.as_mut_ptr(), region.len());
    // SAFETY: the caller holds `t` until the receive completes (this function's contract).
    let start = unsafe { links.rings.start(c, buf, len, src, tag) };
    match start {
        Start::Queued(_) => {}
        Start::Mpi => post(buf, len)?,
        Start::Detached => {
            if let Err(e) = post(buf, len) {
                links.rings.detached_done(src, tag);
                return Err(e.into());
            }
        }
    }
    Ok((arrival, start))
}

/// Starts receiving into `t` from rank `src` (`MPI_Irecv`).
#[inline]
pub fn immediate_receive_into<'a, C: Comm>(
    c: &'a C,
    t: &'a mut Tensor,
    src: usize,
    tag: i32,
) -> Result<RecvRequest<'a, C>, P2pError> {
    check_link(c, src, tag)?;
    let mut req = None;
    // SAFETY (both): the request holds `t` mutably for 'a, so nothing else touches it
    // until it is waited on (by `wait` or by the destructor), which completes the receive.
    let (arrival, started) = unsafe {
        start_receive_into(c, t, src, tag, |buf, len| {
            req = Some(c.irecv(buf, len, src, tag)?);
            Ok(())
        })?
    };
    let pending = match (started, req) {
        (Start::Queued(ticket), _) => Pending::Queued(ticket),
        (Start::Mpi, Some(req)) => Pending::Mpi(req),
        (Start::Detached, Some(req)) => Pending::Detached(req),
        (_, None) => unreachable!("a receive not queued is posted"),
    };
    Ok(RecvRequest {
        comm: c,
        pending: Some(pending),
        tensor: t,
        arrival,
    })
}

/// Sends `t` to rank `dst` (`MPI_Send`).
#[inline]
pub fn send<C: Comm>(c: &C, t: &Tensor, dst: usize, tag: i32) -> Result<(), P2pError> {
    check_link(c, dst, tag)?;
    let links = c.links();
    let bytes = links.outgoing(t, dst, tag);
    if !links.rings.put(c, bytes, dst, tag)? {
        c.send_blocking(bytes, dst, tag)?;
    }
    Ok(())
}

/// Receives into `t` from rank `src` (`MPI_Recv`) and checks it.
///
/// A repeat (the memo says the link's last tensor is `t`'s) takes a channel's path: the
/// payload alone into place and a length comparison, with no `Arrival` to build and
/// drop (24 instructions fewer a receive, `benches/results/2026-11-27-receive.md`);
/// everything else goes out of line.
#[inline]
pub fn receive_into<C: Comm>(c: &C, t: &mut Tensor, src: usize, tag: i32) -> Result<(), P2pError> {
    check_link(c, src, tag)?;
    let links = c.links();
    if links.received.memo_holds(link_key(src, tag), t.signature()) {
        let done = links.rings.receive(c, t.payload_region(), src, tag)?;
        if !done.truncated() && done.count == t.nbytes() {
            return Ok(());
        }
        return links.settle_whole(c.rank(), Arrival::repeat(src, tag), t, done);
    }
    receive_other_into(c, t, src, tag)
}

/// [`receive_into`] past the memo (a new tensor on the link, or the memo slot taken by
/// another link), out of line: the link's map decides, as in [`Links::incoming`].
#[inline(never)]
fn receive_other_into<C: Comm>(
    c: &C,
    t: &mut Tensor,
    src: usize,
    tag: i32,
) -> Result<(), P2pError> {
    let links = c.links();
    let (landing, before) = links.incoming_slow(t, link_key(src, tag));
    let arrival = Arrival {
        src,
        tag,
        landing,
        before,
    };
    let done = links
        .rings
        .receive(c, landing_region(t, arrival.landing), src, tag)?;
    links.settle(c, arrival, t, done)
}

/// Whether receives from rank `src` on `tag` go through a ring in shared memory (see
/// `super::ring`): the link has received, its sender runs on this node, and
/// no receive of a tensor larger than the ring's slots has moved it back to MPI.
pub fn receives_by_ring<C: Comm>(c: &C, src: usize, tag: i32) -> bool {
    c.links().rings.receives_by_ring(src, tag)
}

#[cfg(test)]
mod tests;
