//! Rings for the links of [`crate::transport::p2p`] (a peer and a tag) between ranks of
//! one node: a link's small messages move without MPI, as a channel's do.
//!
//! A link has no opening that both ranks make: it starts with its sender's first message.
//! So its sender makes the ring, at that first message to a rank of its node
//! ([`Comm::same_node`]) when the message is small, and offers it (or says it has none)
//! on a tag of mpiflow's own ([`Reserved::LinkRing`]) before the message. The receiver
//! takes the offer at its first receive on the link, maps the ring, and says so in it;
//! until the sender sees that, it sends by MPI, numbering every message as the ring's
//! protocol does, so the receiver's polls know which way each went ([`super`]). The
//! receiver unlinks the ring's name once it has mapped it, and the sender when it sees the
//! ring in use or its communicator goes, whichever comes first.
//!
//! Receives keep MPI's order. A receive that starts (`immediate_`, or in a window) while
//! its link may use the ring is queued, with where it lands, and done when it is waited
//! on, or earlier, when a receive after it on the link is done (each in turn). An
//! `immediate_` receive of a message longer than a slot (which its sender may send by MPI,
//! as a rendezvous, when the ring is full) is posted at once where it can be, so that two
//! ranks that each start a receive of a large tensor and then send one cannot wait for
//! each other: the receiver asks the sender to leave the ring
//! ([`Inbound::detach`]), and posts its MPI receive if no message from this one on can be
//! in the ring; the sender stays off the ring (asked once for a run of large messages)
//! until the link's next blocking receive of what the ring carries after every receive so
//! posted has completed. Otherwise (messages it expects are on the way through the ring,
//! or small receives are queued before it), it is queued too. A blocking receive waits on
//! the ring for any message the ring carries (it takes it whichever way it comes), and
//! posts at once only for longer ones.

use std::cell::RefCell;
use std::collections::VecDeque;

use super::shm;
use super::{enabled, Geometry, Inbound, Made, Outbound, Waiting, LINK_BYTES, LINK_CHUNKS};
use crate::tensor::TAIL_ROOM;
use crate::transport::comm::{Comm, Completion, TransportError};
use crate::transport::links::{link_key, KeyMap};
use crate::transport::tags::Reserved;

mod messages;
mod offer;

/// Whether a receive into a region of `region` bytes may be of a message longer than a
/// slot of `geo` (which its sender may send by MPI's rendezvous: an `immediate_` receive of
/// it is posted at once). A receive's region holds the message it expects and
/// [`TAIL_ROOM`] bytes more (`Tensor::receive_region`, `Tensor::payload_region`), there
/// to tell a longer message by its count: they do not make the receive large (counting
/// them would send every receive of a 4 KiB tensor through a detach, off the ring).
#[inline(always)]
fn expects_large(region: usize, geo: &Geometry) -> bool {
    region > geo.nbytes + TAIL_ROOM
}

/// Whether a receive into a region of `region` bytes may be of a message longer than the
/// ring carries in its slots ([`LINK_CHUNKS`] of them), which goes by MPI whatever happens.
#[inline(always)]
fn expects_beyond_ring(region: usize, geo: &Geometry) -> bool {
    region > LINK_CHUNKS * geo.nbytes + TAIL_ROOM
}

/// What a link's sender offers its receiver, once: the ring, if it made one.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Offer {
    tag: i32,
    ring: Option<Offered>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Offered {
    name: String,
    nbytes: usize,
}

/// A link's sending side.
#[derive(Debug)]
enum Sending {
    /// By MPI only: the ring could not be made, or the first message was large.
    Mpi,
    Ring {
        out: Outbound,
        /// The ring's name until the receiver has mapped it (then unlinked).
        name: RefCell<Option<String>>,
    },
}

/// A link's receiving side.
#[derive(Debug)]
enum State {
    /// The sender's offer has not been read yet.
    Unknown,
    /// By MPI only.
    Mpi,
    Ring(Inbound),
}

/// A receive queued on its link: where its message lands.
#[derive(Debug)]
struct Queued {
    ticket: u64,
    buf: *mut u8,
    len: usize,
}

#[derive(Debug)]
struct Receiving {
    state: State,
    /// Receives started and not done yet, in the order they started.
    queue: VecDeque<Queued>,
    /// Results of queued receives done before their owners asked, by ticket.
    done: KeyMap<Result<Completion, TransportError>>,
    next_ticket: u64,
    /// MPI receives posted at once under a detach ([`Start::Detached`]) and not yet
    /// completed: the sender is let back onto the ring only when none is left.
    detached: usize,
    /// Messages of any length ([`messages`]): those that came by MPI before the ring's
    /// messages that precede them were taken, in order.
    stash: VecDeque<Vec<u8>>,
}

impl Receiving {
    /// The link's next message into `buf` (its offer read): through the ring where it has
    /// one, else by `MPI_Recv`.
    #[inline]
    fn receive<C: Comm>(
        &self,
        c: &C,
        buf: &mut [u8],
        src: usize,
        tag: i32,
    ) -> Result<Completion, TransportError> {
        match &self.state {
            State::Ring(inb) => self.receive_on_ring(inb, c, buf, src, tag),
            _ => c.recv_blocking(buf, src, tag),
        }
    }

    /// A blocking receive on the link's ring `inb` (see [`Inbound::receive`]). A message
    /// longer than the ring carries goes by MPI, so its receive is posted at once where no
    /// message before it is still to come through the ring (the sender sends by MPI
    /// meanwhile), not after the sender said so: a rendezvous starts when the send does
    /// (8-32 KiB waited 5-7% longer for the word). The sender stays off the ring until the
    /// link's next receive of what the ring carries, which lets it back unless receives
    /// posted under a detach are still in flight (so large messages in a row cost no store
    /// to the ring each). A blocking receive of a message of several slots waits on the
    /// ring: it is there to take it, whichever way it comes.
    #[inline]
    fn receive_on_ring<C: Comm>(
        &self,
        inb: &Inbound,
        c: &C,
        buf: &mut [u8],
        src: usize,
        tag: i32,
    ) -> Result<Completion, TransportError> {
        if !expects_beyond_ring(buf.len(), &inb.geo) {
            if self.detached == 0 {
                inb.back();
            }
            return inb.receive(c, buf, src, tag);
        }
        if !may_post_large(inb) {
            return inb.receive(c, buf, src, tag);
        }
        inb.skip();
        c.recv_blocking(buf, src, tag)
    }

    fn new() -> Receiving {
        Receiving {
            state: State::Unknown,
            queue: VecDeque::new(),
            done: KeyMap::default(),
            next_ticket: 0,
            detached: 0,
            stash: VecDeque::new(),
        }
    }
}

/// How a receive that starts now goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// Post an MPI receive now.
    Mpi,
    /// Post an MPI receive now, and tell [`LinkRings::detached_done`] when it completed.
    Detached,
    /// Queued: done by [`LinkRings::finish`] with this ticket.
    Queued(u64),
}

/// A communicator's link rings (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct LinkRings {
    sending: RefCell<KeyMap<Sending>>,
    receiving: RefCell<KeyMap<Receiving>>,
    /// Offers read before their link's first receive, by link.
    offers: RefCell<KeyMap<Option<Offered>>>,
    /// Messages of any length ([`messages`]): by tag, the senders whose rings a receive
    /// from any source polls, and where the next such receive starts among them.
    message_rings: RefCell<KeyMap<messages::Turn>>,
}

// SAFETY: the rings' mappings and queued receive pointers are plain memory, valid in any
// thread of the process; `LinkRings` is not `Sync` (its cells), so one thread at a time
// uses it, and a queued pointer belongs to a request that borrows the communicator, which
// therefore cannot move to another thread while the request lives.
unsafe impl Send for LinkRings {}

impl LinkRings {
    /// Puts the message `bytes` to `dst` on `tag` into the link's ring: `true` if it went
    /// there (the send is complete), `false` if the caller sends it by MPI.
    #[inline]
    pub(crate) fn put<C: Comm>(
        &self,
        c: &C,
        bytes: &[u8],
        dst: usize,
        tag: i32,
    ) -> Result<bool, TransportError> {
        self.put_first(c, bytes, dst, tag, bytes.len())
    }

    /// [`LinkRings::put`], where a link's first message is taken to be of `first` bytes:
    /// the ring is made if such a message pays for one.
    #[inline]
    fn put_first<C: Comm>(
        &self,
        c: &C,
        bytes: &[u8],
        dst: usize,
        tag: i32,
        first: usize,
    ) -> Result<bool, TransportError> {
        if !c.same_node(dst) {
            return Ok(false);
        }
        let key = link_key(dst, tag);
        if let Some(s) = self.sending.borrow().get(&key) {
            return Ok(s.put(bytes));
        }
        self.first_send(c, first, dst, tag)?;
        Ok(self
            .sending
            .borrow()
            .get(&key)
            .is_some_and(|s| s.put(bytes)))
    }

    /// A link's first message, of `len` bytes: makes its ring where it pays, and offers it.
    #[cold]
    #[inline(never)]
    fn first_send<C: Comm>(
        &self,
        c: &C,
        len: usize,
        dst: usize,
        tag: i32,
    ) -> Result<(), TransportError> {
        let made = match enabled() && len <= LINK_CHUNKS * LINK_BYTES {
            true => {
                // Room for any message a ring carries: a link's tensors change (a benchmark's
                // sizes, a header when they do), and its first says nothing of the rest.
                let geo = Geometry::of(LINK_BYTES);
                shm::create(geo).ok().map(|(map, name)| (map, name, geo))
            }
            false => None,
        };
        let offer = Offer {
            tag,
            ring: made.as_ref().map(|(_, name, geo)| Offered {
                name: name.clone(),
                nbytes: geo.nbytes,
            }),
        };
        let bytes = serde_json::to_vec(&offer).expect("an offer serializes");
        let sent = c.send_blocking(&bytes, dst, c.tags().reserved(Reserved::LinkRing));
        if let Err(e) = sent {
            if let Some((_, name, _)) = &made {
                shm::unlink(name);
            }
            return Err(e);
        }
        let state = match made {
            Some((map, name, geo)) => Sending::Ring {
                out: Outbound::new(map, geo, Made::ForLink),
                name: RefCell::new(Some(name)),
            },
            None => Sending::Mpi,
        };
        self.sending.borrow_mut().insert(link_key(dst, tag), state);
        Ok(())
    }

    /// A blocking receive into `buf` from `src` on `tag`, after the link's receives that
    /// started before it: `MPI_Recv` where the peer runs on another node.
    #[inline]
    pub(crate) fn receive<C: Comm>(
        &self,
        c: &C,
        buf: &mut [u8],
        src: usize,
        tag: i32,
    ) -> Result<Completion, TransportError> {
        if !c.same_node(src) {
            return c.recv_blocking(buf, src, tag);
        }
        if let Some(r) = self.receiving.borrow().get(&link_key(src, tag)) {
            if r.queue.is_empty() && !matches!(r.state, State::Unknown) {
                return r.receive(c, buf, src, tag);
            }
        }
        self.receive_after_queue(c, buf, src, tag)
    }

    /// [`LinkRings::receive`] on a link with queued receives or no offer read yet.
    #[cold]
    #[inline(never)]
    fn receive_after_queue<C: Comm>(
        &self,
        c: &C,
        buf: &mut [u8],
        src: usize,
        tag: i32,
    ) -> Result<Completion, TransportError> {
        let key = link_key(src, tag);
        self.entry(key);
        let last = self.receiving.borrow()[&key].queue.back().map(|q| q.ticket);
        if let Some(ticket) = last {
            // Done in turn; each result waits for its owner.
            let r = self.finish(c, src, tag, ticket);
            self.receiving
                .borrow_mut()
                .get_mut(&key)
                .expect("a link with receives")
                .done
                .insert(ticket, r);
        }
        self.receive_next(c, buf, src, tag)
    }

    /// Receives the link's next message into `buf` (none queued before it).
    fn receive_next<C: Comm>(
        &self,
        c: &C,
        buf: &mut [u8],
        src: usize,
        tag: i32,
    ) -> Result<Completion, TransportError> {
        self.resolve(c, src, tag)?;
        self.receiving.borrow()[&link_key(src, tag)].receive(c, buf, src, tag)
    }

    /// How a receive of at most `len` bytes into `buf` from `src` on `tag` starts:
    /// [`Start::Mpi`], the caller posts an MPI receive now; else it is queued (see the
    /// module documentation).
    ///
    /// # Safety
    /// `buf` is valid for `len` bytes of writes, and nothing else reads or writes them,
    /// until [`LinkRings::finish`] with the returned ticket has returned.
    #[inline]
    pub(crate) unsafe fn start<C: Comm>(
        &self,
        c: &C,
        buf: *mut u8,
        len: usize,
        src: usize,
        tag: i32,
    ) -> Start {
        if !c.same_node(src) {
            return Start::Mpi;
        }
        self.start_on_node(buf, len, link_key(src, tag))
    }

    fn start_on_node(&self, buf: *mut u8, len: usize, key: u64) -> Start {
        let mut map = self.receiving.borrow_mut();
        let r = map.entry(key).or_insert_with(Receiving::new);
        if r.queue.is_empty() {
            match &r.state {
                State::Mpi => return Start::Mpi,
                // The receiver's first: small ones wait for the offer (they may come
                // through the ring); a large one keeps the link on MPI for good.
                State::Unknown if expects_large(len, &Geometry::of(LINK_BYTES)) => {
                    r.state = State::Mpi;
                    return Start::Mpi;
                }
                // Else messages are on their way through the ring: this one waits its turn.
                State::Ring(inb) if expects_large(len, &inb.geo) && may_post_large(inb) => {
                    inb.skip();
                    r.detached += 1;
                    return Start::Detached;
                }
                _ => {}
            }
        }
        let ticket = r.next_ticket;
        r.next_ticket += 1;
        r.queue.push_back(Queued { ticket, buf, len });
        Start::Queued(ticket)
    }

    /// Completes the queued receive `ticket` on the link from `src` on `tag` (and those
    /// queued before it, whose results wait for their owners); returns how it completed.
    pub(crate) fn finish<C: Comm>(
        &self,
        c: &C,
        src: usize,
        tag: i32,
        ticket: u64,
    ) -> Result<Completion, TransportError> {
        let key = link_key(src, tag);
        loop {
            let next = {
                let mut map = self.receiving.borrow_mut();
                let r = map.get_mut(&key).expect("a link with queued receives");
                if let Some(done) = r.done.remove(&ticket) {
                    return done;
                }
                r.queue
                    .pop_front()
                    .expect("a ticket is queued until it is done")
            };
            // SAFETY: `start`'s contract: the region is valid and the queue's alone until
            // its ticket is finished, which is now.
            let buf = unsafe { std::slice::from_raw_parts_mut(next.buf, next.len) };
            let result = self.receive_next(c, buf, src, tag);
            if next.ticket == ticket {
                return result;
            }
            self.receiving
                .borrow_mut()
                .get_mut(&key)
                .expect("a link with queued receives")
                .done
                .insert(next.ticket, result);
        }
    }

    /// An MPI receive posted under a detach ([`Start::Detached`]) on the link from `src`
    /// on `tag` completed: when none is left, the link's next blocking receive of what the
    /// ring carries lets the sender back onto it.
    pub(crate) fn detached_done(&self, src: usize, tag: i32) {
        if let Some(r) = self.receiving.borrow_mut().get_mut(&link_key(src, tag)) {
            r.detached = r.detached.saturating_sub(1);
        }
    }

    /// Whether receives on the link from `src` on `tag` go through a ring (its offer read,
    /// the ring mapped, not detached by a large receive).
    pub(crate) fn receives_by_ring(&self, src: usize, tag: i32) -> bool {
        self.receiving
            .borrow()
            .get(&link_key(src, tag))
            .is_some_and(|r| matches!(r.state, State::Ring(_)))
    }

    /// Slots taken from the ring of the link from `src` on `tag` so far (a message of
    /// several slots counts each).
    #[cfg(test)]
    fn taken_from_ring(&self, src: usize, tag: i32) -> u64 {
        match self
            .receiving
            .borrow()
            .get(&link_key(src, tag))
            .map(|r| &r.state)
        {
            Some(State::Ring(inb)) => inb.pos.get(),
            _ => 0,
        }
    }

    fn entry(&self, key: u64) {
        self.receiving
            .borrow_mut()
            .entry(key)
            .or_insert_with(Receiving::new);
    }
}

/// Whether a message longer than `inb`'s slots, the next one its receiver expects, may be
/// received by an MPI receive posted now: no message from it on can be in the ring. It
/// asks ([`Inbound::detach`], which asks once for a run of large receives: while receives
/// posted under a detach are outstanding, or until a blocking receive of what the ring
/// carries, the detach holds),
/// and where messages are on their way through the ring lets the sender use it again and
/// says no.
fn may_post_large(inb: &Inbound) -> bool {
    if inb.detach() {
        return true;
    }
    inb.reattach();
    false
}

impl Sending {
    #[inline]
    fn put(&self, bytes: &[u8]) -> bool {
        match self {
            Sending::Mpi => false,
            Sending::Ring { out, name } => {
                let into_ring = out.put(bytes);
                if into_ring && name.borrow().is_some() {
                    // The receiver has mapped the ring (it took a message): the name can go.
                    if let Some(n) = name.borrow_mut().take() {
                        shm::unlink(&n);
                    }
                }
                into_ring
            }
        }
    }
}

impl Drop for LinkRings {
    fn drop(&mut self) {
        for s in self.sending.get_mut().values_mut() {
            if let Sending::Ring { name, .. } = s {
                if let Some(n) = name.get_mut().take() {
                    shm::unlink(&n);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
