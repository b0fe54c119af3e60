//! Tensors between two ranks, or two tasks of the cluster.
//!
//! One message per tensor, straight from its memory (`MPI_Isend` of the header and payload
//! that lie contiguous in the tensor, see [`crate::tensor`]), received straight into the
//! destination tensor (`MPI_Irecv`) and checked there: a tensor of another dtype, shape or
//! name is an error naming both sides, and a longer message is cut at the receiver's
//! buffer end, never written past it.
//!
//! Headers are sent when they say something new. Each communicator remembers, per (peer,
//! tag), the tensor last sent and the tensor last received ([`Links`]); both sides update
//! it in the same order, so they agree on it. Sending the link's last tensor again puts
//! its payload alone on the wire, and a receiver that expects the link's last tensor
//! receives the payload alone into place: the check is then that both sides' tensors
//! equal the one whose header crossed before (a signature comparison on each side), and
//! that exactly its bytes arrived. The same tensor sent at every step costs what plain
//! MPI costs, while a small header pushed small messages into OpenMPI's next size
//! class (1.2-1.5x the latency of plain MPI). When a receiver expects something else
//! than the sender sends, the message tells by its length which kind it is: a sender
//! pads a whole message ([`crate::tensor::WIRE_PAD`]) whose length would equal the link's
//! last payload; so the error still names both sides, and no message is misread.
//! Receives therefore name their source (no `ANY_SOURCE`).
//!
//! Naming follows rsmpi: `send`/`receive_into` block; `immediate_send` and
//! `immediate_receive_into` return requests, so several tensors can be in flight at once.
//! A request that is dropped without `wait` waits in its destructor: the tensor it borrows
//! is never freed or reused while MPI may still touch it.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use super::comm::{check_peer, Comm, Completion, TransportError, ANY_SOURCE};
use crate::cluster::{Layout, TaskId};
use crate::tensor::{describe_header, header_payload_len, Landing, Tensor, TensorError};

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
    #[error("task {0} is not in the cluster")]
    UnknownTask(TaskId),
    #[error("rank {rank}: {source}")]
    Tag {
        rank: usize,
        source: super::tags::TagError,
    },
    #[error("rank {0}: tensor transfers name their peer rank (no ANY_SOURCE): headers are remembered per peer")]
    AnySource(usize),
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

/// A peer: a rank, or a task of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    Rank(usize),
    Task(TaskId),
}

impl From<usize> for Peer {
    fn from(r: usize) -> Self {
        Peer::Rank(r)
    }
}

impl From<TaskId> for Peer {
    fn from(t: TaskId) -> Self {
        Peer::Task(t)
    }
}

/// Task-to-rank lookup, from the cluster layout.
#[derive(Debug, Clone, Default)]
pub struct Tasks {
    ranks: BTreeMap<TaskId, usize>,
}

impl Tasks {
    pub fn from_layout(layout: &Layout) -> Tasks {
        Tasks {
            ranks: layout
                .ranks
                .iter()
                .filter_map(|r| r.rank.map(|rank| (r.task.clone(), rank)))
                .collect(),
        }
    }

    pub fn rank(&self, peer: &Peer) -> Result<usize, P2pError> {
        match peer {
            Peer::Rank(r) => Ok(*r),
            Peer::Task(t) => self
                .ranks
                .get(t)
                .copied()
                .ok_or_else(|| P2pError::UnknownTask(t.clone())),
        }
    }
}

#[inline]
pub(crate) fn check_tag<C: Comm>(c: &C, tag: i32) -> Result<(), P2pError> {
    c.tags().check_user(tag).map_err(|source| P2pError::Tag {
        rank: c.rank(),
        source,
    })
}

/// What one side of a link last sent or received: enough to leave out the next header.
#[derive(Debug, Clone)]
struct Last {
    signature: u64,
    nbytes: usize,
    header: Vec<u8>,
}

impl Last {
    fn of(t: &Tensor) -> Last {
        Last {
            signature: t.signature(),
            nbytes: t.nbytes(),
            header: t.wire_header().to_vec(),
        }
    }

    fn from_header(header: Vec<u8>) -> Option<Last> {
        Some(Last {
            signature: crate::hash::fnv1a(&header),
            nbytes: header_payload_len(&header)?,
            header,
        })
    }
}

/// Hashes a link key (peer and tag in one `u64`) with one multiplication: SipHash would
/// cost more than the header it saves on a small message.
#[derive(Default)]
struct LinkHasher(u64);

impl Hasher for LinkHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b) ^ self.0.rotate_left(8));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = mix(v);
    }
}

#[inline]
fn mix(v: u64) -> u64 {
    let x = (v ^ (v >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

type LinkMap = HashMap<u64, Last, BuildHasherDefault<LinkHasher>>;

/// Slots of the direct-mapped memo in front of each side's map.
const HOT: usize = 64;
/// A memo slot that holds no link (no link has this key: tags are not negative).
const NO_LINK: (u64, u64) = (u64::MAX, 0);

/// One direction of a communicator's links: the tensor of each (peer, tag), and a memo of
/// (key, signature) pairs in front of it, so that a repeat costs two loads, not a hash
/// lookup (which was 10-25 ns on a 200 ns round trip). A memo slot is only ever a
/// pair that the map holds.
#[derive(Debug)]
struct Side {
    map: RefCell<LinkMap>,
    hot: [Cell<(u64, u64)>; HOT],
}

impl Default for Side {
    fn default() -> Side {
        Side {
            map: RefCell::default(),
            hot: std::array::from_fn(|_| Cell::new(NO_LINK)),
        }
    }
}

impl Side {
    #[inline]
    fn slot(&self, key: u64) -> &Cell<(u64, u64)> {
        &self.hot[(mix(key) >> 58) as usize % HOT]
    }

    /// True if the memo says the link `key` holds the tensor of `signature` (false may
    /// still be a hold: ask [`Side::map_holds`]).
    #[inline]
    fn memo_holds(&self, key: u64, signature: u64) -> bool {
        self.slot(key).get() == (key, signature)
    }

    /// True if the map says the link `key` holds the tensor of `signature` (after the
    /// memo said no: its slot went to another link); a hold goes back into the memo.
    fn map_holds(&self, key: u64, signature: u64) -> bool {
        let held = self
            .map
            .borrow()
            .get(&key)
            .is_some_and(|l| l.signature == signature);
        if held {
            self.slot(key).set((key, signature));
        }
        held
    }

    /// Payload length of the link's tensor, if it has one.
    fn nbytes(&self, key: u64) -> Option<usize> {
        self.map.borrow().get(&key).map(|l| l.nbytes)
    }

    /// Makes the link hold `last`; returns what it held.
    fn set(&self, key: u64, last: Last) -> Option<Last> {
        self.slot(key).set((key, last.signature));
        self.map.borrow_mut().insert(key, last)
    }

    fn forget(&self, key: u64) {
        let slot = self.slot(key);
        if slot.get().0 == key {
            slot.set(NO_LINK);
        }
        self.map.borrow_mut().remove(&key);
    }
}

/// A communicator's memory of the tensor last sent to and last received from each (peer,
/// tag); see the module documentation.
#[derive(Debug, Default)]
pub struct Links {
    sent: Side,
    received: Side,
}

#[inline]
fn link_key(peer: usize, tag: i32) -> u64 {
    ((peer as u64) << 32) | u64::from(tag as u32)
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
    fn incoming_slow(&self, t: &Tensor, key: u64) -> (Landing, Option<Last>) {
        if self.received.map_holds(key, t.signature()) {
            return (Landing::Payload, None);
        }
        (Landing::Whole, self.received.set(key, Last::of(t)))
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
        if arrival.landing == Landing::Payload && !done.truncated && done.count == t.nbytes() {
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
        if let Some(last) = before.filter(|l| !done.truncated && done.count == l.nbytes) {
            // The payload alone of the link's previous tensor: the sender still sends that.
            t.restore_header();
            let theirs = describe_header(&last.header);
            self.received.set(key, last);
            return Err(error(TensorError::Mismatch {
                ours: t.describe(),
                theirs,
            }));
        }
        t.check_arrival(landing, done.count, done.truncated)
            .map_err(|u| {
                match u.header.and_then(Last::from_header) {
                    Some(theirs) => drop(self.received.set(key, theirs)),
                    None => self.received.forget(key),
                }
                error(u.error)
            })
    }
}

/// How a receive was posted: what [`Links::settle`] needs to check it.
struct Arrival {
    src: usize,
    tag: i32,
    landing: Landing,
    before: Option<Last>,
}

/// A send in flight; the tensor stays borrowed until it completes.
pub struct SendRequest<'a, C: Comm> {
    comm: &'a C,
    req: Option<C::Request>,
    _tensor: std::marker::PhantomData<&'a Tensor>,
}

impl<C: Comm> SendRequest<'_, C> {
    pub fn wait(mut self) -> Result<(), P2pError> {
        let req = self.req.take().expect("not yet waited");
        self.comm.wait(req)?;
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
    req: Option<C::Request>,
    tensor: &'a mut Tensor,
    peer: usize,
    /// Taken when the receive is checked.
    arrival: Option<Arrival>,
}

impl<C: Comm> RecvRequest<'_, C> {
    /// Waits and checks what arrived.
    pub fn wait(mut self) -> Result<(), P2pError> {
        let req = self.req.take().expect("not yet waited");
        let done = self.comm.wait(req)?;
        let arrival = self.arrival.take().expect("not yet waited");
        self.comm
            .links()
            .settle(self.comm, arrival, self.tensor, done)
    }

    /// The rank this receive listens to.
    pub fn peer(&self) -> usize {
        self.peer
    }
}

impl<C: Comm> Drop for RecvRequest<'_, C> {
    fn drop(&mut self) {
        if let Some(r) = self.req.take() {
            // Unchecked for the caller, but the link must still learn what arrived.
            if let (Ok(done), Some(arrival)) = (self.comm.wait(r), self.arrival.take()) {
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
pub fn immediate_send<'a, C: Comm>(
    c: &'a C,
    t: &'a Tensor,
    dst: usize,
    tag: i32,
) -> Result<SendRequest<'a, C>, P2pError> {
    check_link(c, dst, tag)?;
    immediate_send_bytes(c, c.links().outgoing(t, dst, tag), dst, tag)
}

/// Starts sending bytes of a tensor (`MPI_Isend`): its wire message here, its payload alone
/// on a [`super::channel::Channel`].
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

/// Starts receiving into `t` from rank `src` (`MPI_Irecv`).
pub fn immediate_receive_into<'a, C: Comm>(
    c: &'a C,
    t: &'a mut Tensor,
    src: usize,
    tag: i32,
) -> Result<RecvRequest<'a, C>, P2pError> {
    check_link(c, src, tag)?;
    let arrival = c.links().incoming(t, src, tag);
    let region = landing_region(t, arrival.landing);
    // SAFETY: the request holds `t` mutably for 'a, so nothing else touches the region
    // until it is waited on (by `wait` or by the destructor).
    let req = unsafe { c.irecv(region.as_mut_ptr(), region.len(), src, tag)? };
    Ok(RecvRequest {
        comm: c,
        req: Some(req),
        tensor: t,
        peer: src,
        arrival: Some(arrival),
    })
}

/// Sends `t` to rank `dst` (`MPI_Send`).
pub fn send<C: Comm>(c: &C, t: &Tensor, dst: usize, tag: i32) -> Result<(), P2pError> {
    check_link(c, dst, tag)?;
    c.send_blocking(c.links().outgoing(t, dst, tag), dst, tag)?;
    Ok(())
}

/// Receives into `t` from rank `src` (`MPI_Recv`) and checks it.
pub fn receive_into<C: Comm>(c: &C, t: &mut Tensor, src: usize, tag: i32) -> Result<(), P2pError> {
    check_link(c, src, tag)?;
    let links = c.links();
    let arrival = links.incoming(t, src, tag);
    let done = c.recv_blocking(landing_region(t, arrival.landing), src, tag)?;
    links.settle(c, arrival, t, done)
}

/// Sends to a task or rank of the cluster.
pub fn send_to<C: Comm>(
    c: &C,
    tasks: &Tasks,
    t: &Tensor,
    to: &Peer,
    tag: i32,
) -> Result<(), P2pError> {
    send(c, t, tasks.rank(to)?, tag)
}

/// Receives from a task or rank of the cluster.
pub fn receive_from<C: Comm>(
    c: &C,
    tasks: &Tasks,
    t: &mut Tensor,
    from: &Peer,
    tag: i32,
) -> Result<(), P2pError> {
    receive_into(c, t, tasks.rank(from)?, tag)
}

#[cfg(test)]
mod tests {
    use super::super::local::LocalComm;
    use super::*;
    use crate::tensor::DType;

    #[test]
    fn tensors_arrive_intact_and_in_flight_together() {
        let out = LocalComm::run(2, |c| {
            if c.rank() == 0 {
                let a = Tensor::from_slice(&[3], &[1f32, 2., 3.])
                    .unwrap()
                    .named("a");
                let b = Tensor::from_slice(&[2, 2], &[5i64, 6, 7, 8])
                    .unwrap()
                    .named("b");
                let ra = immediate_send(&c, &a, 1, 1).unwrap();
                let rb = immediate_send(&c, &b, 1, 2).unwrap();
                rb.wait().unwrap();
                ra.wait().unwrap();
                (vec![], vec![])
            } else {
                let mut a = Tensor::zeros(DType::F32, &[3]).unwrap().named("a");
                let mut b = Tensor::zeros(DType::I64, &[2, 2]).unwrap().named("b");
                // Posted in the opposite order: tags keep them apart.
                let rb = immediate_receive_into(&c, &mut b, 0, 2).unwrap();
                let ra = immediate_receive_into(&c, &mut a, 0, 1).unwrap();
                ra.wait().unwrap();
                rb.wait().unwrap();
                (
                    a.as_slice::<f32>().unwrap().to_vec(),
                    b.as_slice::<i64>().unwrap().to_vec(),
                )
            }
        });
        assert_eq!(out[1], (vec![1., 2., 3.], vec![5, 6, 7, 8]));
    }

    #[test]
    fn mismatches_name_both_sides() {
        let out = LocalComm::run(2, |c| {
            if c.rank() == 0 {
                let a = Tensor::from_slice(&[4], &[1f32; 4])
                    .unwrap()
                    .named("grad/w");
                send(&c, &a, 1, 0).unwrap();
                send(&c, &a, 1, 0).unwrap();
                String::new()
            } else {
                let mut wrong_shape = Tensor::zeros(DType::F32, &[3]).unwrap().named("grad/w");
                let e1 = receive_into(&c, &mut wrong_shape, 0, 0)
                    .unwrap_err()
                    .to_string();
                let mut wrong_name = Tensor::zeros(DType::F32, &[4]).unwrap().named("grad/b");
                let e2 = receive_into(&c, &mut wrong_name, 0, 0)
                    .unwrap_err()
                    .to_string();
                format!("{e1}\n{e2}")
            }
        });
        assert_eq!(
            out[1],
            "rank 1: from rank 0: received 'grad/w' f32[4] but expected 'grad/w' f32[3]\n\
             rank 1: from rank 0: received 'grad/w' f32[4] but expected 'grad/b' f32[4]"
        );
    }

    fn u8s(n: usize, v: u8, name: &str) -> Tensor {
        Tensor::from_slice(&[n], &vec![v; n]).unwrap().named(name)
    }

    #[test]
    fn repeats_travel_without_header() {
        let out = LocalComm::run(2, |c| {
            let t = u8s(5, 7, "x");
            if c.rank() == 0 {
                for _ in 0..3 {
                    send(&c, &t, 1, 3).unwrap();
                }
                vec![]
            } else {
                let mut r = u8s(5, 0, "x");
                receive_into(&c, &mut r, 0, 3).unwrap();
                receive_into(&c, &mut r, 0, 3).unwrap();
                // The third message, taken raw: the payload alone.
                let mut raw = [0u8; 64];
                let got = super::super::comm::recv(&c, &mut raw, 0, 3).unwrap();
                let mut seen = r.bytes().to_vec();
                seen.extend_from_slice(&raw[..got.count]);
                seen
            }
        });
        assert_eq!(out[1], vec![7; 10]);
    }

    #[test]
    fn links_stay_in_step_through_changes_and_mismatches() {
        // a: u8[32]; b: u8[8] unnamed, whose whole message (24-byte header) is 32 bytes
        // long, the length of a's payload alone: the sender pads it.
        let out = LocalComm::run(2, |c| {
            let a = u8s(32, 1, "");
            let b = u8s(8, 2, "");
            if c.rank() == 0 {
                for t in [&a, &a, &b, &b, &a, &a, &b] {
                    send(&c, t, 1, 0).unwrap();
                }
                vec![]
            } else {
                let mut ra = u8s(32, 0, "");
                let mut rb = u8s(8, 0, "");
                let mut log = vec![];
                let mut note = |r: Result<(), P2pError>, t: &Tensor| {
                    log.push(match r {
                        Ok(()) => format!("ok {:?}", &t.bytes()[..2]),
                        Err(e) => e.to_string(),
                    })
                };
                let r = receive_into(&c, &mut ra, 0, 0);
                note(r, &ra);
                let r = receive_into(&c, &mut ra, 0, 0);
                note(r, &ra);
                // Sender switched to b (padded), receiver still expects a.
                ra.bytes_mut().fill(0);
                let r = receive_into(&c, &mut ra, 0, 0);
                note(r, &ra);
                // The link now holds b on both sides.
                let r = receive_into(&c, &mut rb, 0, 0);
                note(r, &rb);
                // Sender switched back to a, receiver expects b: a whole message lands in
                // the payload's place.
                let r = receive_into(&c, &mut rb, 0, 0);
                note(r, &rb);
                // Sender repeats a (payload alone) while the receiver still expects b;
                // then b again, in step.
                let r = receive_into(&c, &mut rb, 0, 0);
                note(r, &rb);
                let r = receive_into(&c, &mut rb, 0, 0);
                note(r, &rb);
                log
            }
        });
        assert_eq!(
            out[1],
            [
                "ok [1, 1]",
                "ok [1, 1]",
                "rank 1: from rank 0: received '' u8[8] but expected '' u8[32]",
                "ok [2, 2]",
                "rank 1: from rank 0: received '' u8[32] but expected '' u8[8]",
                "rank 1: from rank 0: received '' u8[32] but expected '' u8[8]",
                "ok [2, 2]",
            ]
        );
    }

    #[test]
    fn many_in_flight_on_one_link() {
        let out = LocalComm::run(2, |c| {
            let ts: Vec<Tensor> = [(4, 1, "p"), (4, 2, "p"), (6, 3, "q"), (4, 4, "p")]
                .iter()
                .map(|&(n, v, name)| u8s(n, v, name))
                .collect();
            if c.rank() == 0 {
                let reqs: Vec<_> = ts
                    .iter()
                    .map(|t| immediate_send(&c, t, 1, 9).unwrap())
                    .collect();
                reqs.into_iter().for_each(|r| r.wait().unwrap());
                vec![]
            } else {
                let mut rs: Vec<Tensor> = ts
                    .iter()
                    .map(|t| Tensor::zeros(DType::U8, t.shape()).unwrap().named(t.name()))
                    .collect();
                let reqs: Vec<_> = rs
                    .iter_mut()
                    .map(|t| immediate_receive_into(&c, t, 0, 9).unwrap())
                    .collect();
                reqs.into_iter().for_each(|r| r.wait().unwrap());
                rs.iter().map(|t| t.bytes().to_vec()).collect()
            }
        });
        assert_eq!(out[1], vec![vec![1; 4], vec![2; 4], vec![3; 6], vec![4; 4]]);
    }

    #[test]
    fn any_source_is_refused() {
        let c = LocalComm::create(2, std::time::Duration::from_millis(10));
        let mut x = Tensor::zeros(DType::U8, &[1]).unwrap();
        assert_eq!(
            receive_into(&c[0], &mut x, ANY_SOURCE, 1).unwrap_err(),
            P2pError::AnySource(0)
        );
    }

    #[test]
    fn tasks_and_tags() {
        let opts = crate::cluster::MappingOptions {
            ps: 1,
            ..Default::default()
        };
        let layout = Layout::single_host(3, &opts).unwrap();
        let t = Tasks::from_layout(&layout);
        assert_eq!(t.rank(&Peer::Task(TaskId::new("worker", 1))).unwrap(), 2);
        assert_eq!(t.rank(&Peer::Rank(7)).unwrap(), 7);
        assert!(matches!(
            t.rank(&Peer::Task(TaskId::new("ps", 3))),
            Err(P2pError::UnknownTask(_))
        ));
        let c = LocalComm::create(1, std::time::Duration::from_millis(10));
        let x = Tensor::zeros(DType::U8, &[1]).unwrap();
        // The in-process transport runs under the standard's minimum bound, 32767, with
        // mpiflow's own tags at its top.
        let max = c[0].tags().max_user();
        assert_eq!(max, 32767 - 7);
        assert_eq!(
            send(&c[0], &x, 0, max + 1).unwrap_err().to_string(),
            "rank 0: tag 32761 is out of range 0..=32760 (MPI_TAG_UB 32767; the 7 tags above are mpiflow's own)"
        );
        send(&c[0], &x, 0, max).unwrap();
    }
}
