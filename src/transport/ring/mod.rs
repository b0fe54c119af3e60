//! Rings in memory that two ranks share when they run on one node: the small messages of
//! a [`super::channel::Channel`], of a [`super::p2p`] link (peer and tag) and of
//! [`super::messages`] (a link's, received from one peer or any) move without MPI.
//!
//! Under Open MPI's `ob1` a small message costs its match, its request and, when it
//! arrives before its receive, a copy through the unexpected-message queue. A
//! single-producer single-consumer ring of slots in shared memory costs a copy in, a
//! copy out and the cache lines that carry them: less at every size to 4 KiB
//! (`benches/compare/shm_ring.c` measures both in one job; `benches/results/
//! 2026-11-27-rings.md` has the numbers). A channel's tensors of at most [`MAX_BYTES`] take
//! rings, one slot a message (a slot carries its message's length); a link's slots hold
//! `LINK_BYTES`, the whole message of such a tensor, and a link's message may take up to
//! `LINK_CHUNKS` slots in turn (tensors of up to 32 KiB), where MPI's single copy (CMA,
//! from 4 KiB under `vader`) costs more than two copies through a ring.
//!
//! A channel's rings are agreed in its opening (`pair`): each rank creates the ring it
//! receives on (a POSIX shared-memory object, named in the opening handshake and unlinked
//! once the peer mapped it, so nothing outlives the two processes) and maps its peer's as
//! the ring it sends on. A ring is used only if both ranks offered one, name the same
//! host, and mapped each other's: the same verdict on both sides, or neither uses one
//! ([`Comm::node_name`]). A link has no opening: its sender makes the ring at its first
//! message and offers it, and sends by MPI until the receiver has mapped it (`link`).
//! `MPIFLOW_SHM_CHANNELS=0` turns rings off for the process.
//!
//! Protocol (`n` slots of one message each; message `k` of the channel or link, counted
//! from 0):
//! - the sender copies message `k` into the next free slot and then stores `k + 1` in the
//!   slot's sequence word (`Release`); the receiver waits until the slot it expects next
//!   holds `k + 1` (`Acquire`), copies the message out, and then publishes how many slots
//!   it has consumed (`Release`), which the sender reads (`Acquire`) only when the ring
//!   looks full;
//! - a sender that finds the ring full does not wait: it stores `k + 1` in the ring's MPI
//!   word (`Release`) and sends message `k` by MPI on the channel's tag. A receiver whose
//!   next slot does not hold `k + 1` reads the MPI word and then the slot again: if the
//!   word says a message numbered `k` or later went by MPI and the slot still lacks `k`,
//!   then `k` itself went by MPI (had it gone into the ring, its store preceded the MPI
//!   word's, which the receiver has acquired), and the receiver takes it with an MPI
//!   receive. So a send never blocks on a ring (it buffers as MPI does: a program that
//!   sends more than the ring holds before receiving behaves as it would without rings),
//!   and messages come out in the order they were sent whichever way each went.
//!
//! A receiver that waits polls the ring (spinning first where ranks have cores of their
//! own, then yielding: [`super::comm::Backoff`]) and every 64 polls lets MPI progress
//! ([`super::comm::Comm::progress`]), so transfers it has in flight elsewhere complete.
//! Messages of other senders on the channel's or link's tag (which it owns) are not seen:
//! a ring receive reads MPI only when the ring's sender said so.

mod link;
mod pair;
mod shm;

pub(crate) use link::{LinkRings, Start};
pub(crate) use pair::{connect, Rings};

use std::cell::Cell;
use std::sync::atomic::Ordering;

use super::comm::{spins_while_waiting, Backoff, Comm, Completion, TransportError};
use crate::tensor::TAIL_ROOM;
use shm::Mapping;

/// Messages of at most this many bytes travel through rings.
pub const MAX_BYTES: usize = 4096;
/// What a slot of a link's ring carries at most: the whole message (its header, and the
/// padding of [`super::p2p`], at most [`TAIL_ROOM`] bytes) of a tensor of [`MAX_BYTES`],
/// so that a link's tensors up to [`MAX_BYTES`] take its ring from their first message, as
/// their payloads do (slots of [`MAX_BYTES`] kept a link whose first tensor had 4 KiB off
/// the ring for good).
const LINK_BYTES: usize = MAX_BYTES + TAIL_ROOM;
/// Slots a message on a link's ring may take, in turn (a channel's takes one): the whole
/// message of a tensor of up to 32 KiB goes through the ring, each slot copied out while
/// the next is copied in. From 4 KiB `vader` moves a message by the kernel's single copy
/// (`process_vm_readv`, a rendezvous), whose fixed cost exceeds two copies through a ring
/// for small messages (`benches/results/2026-11-27-fourk.md` finds the crossing); from 64
/// KiB the bytes outweigh it and a message would take a quarter of the ring: MPI's single
/// copy.
const LINK_CHUNKS: usize = 8;
/// Slots of a ring: OSU's window (and `mpiflow bench`'s), so that a window of small
/// messages fits a ring whose receiver has not taken any yet (one slot fewer and a
/// receiver still warming its caches and pages lets a window's last messages go by MPI,
/// out of the ring's way).
const MAX_SLOTS: usize = 64;
/// Bytes of slots a ring aims for (a core's share of cache): [`MAX_SLOTS`] slots to
/// messages as large as a link's ring carries.
const RING_BYTES: usize = MAX_SLOTS * (HEAD + LINK_BYTES).next_multiple_of(LINE);
const LINE: usize = 64;
/// The receiver's count of consumed slots.
const CONSUMED: usize = 0;
/// The sender's MPI word: `k + 1` for the last message `k` it sent by MPI.
const BY_MPI: usize = LINE;
/// The creator's geometry: magic, message bytes, slots, stride.
const GEOMETRY: usize = 2 * LINE;
/// Where the slots start.
const SLOTS: usize = 3 * LINE;
const MAGIC: u64 = u64::from_le_bytes(*b"mpifring");
/// The creator's geometry line also holds, after the geometry, whether the receiver has
/// mapped a ring its sender made (rings made for a link; a channel's are agreed at opening).
const ATTACHED: usize = GEOMETRY + 32;
/// A link's ring: `k + 1` once its sender is about to put message `k` into a slot (see
/// [`Inbound::detach`]).
const INTENT: usize = GEOMETRY + 40;
/// A link's ring: whether its receiver has asked the sender to send by MPI from now on.
const DETACHED: usize = GEOMETRY + 48;
/// Bytes of a slot before its message: the sequence word, then the message's length.
const HEAD: usize = 16;

/// Whether this process offers rings (`MPIFLOW_SHM_CHANNELS=0` turns them off).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MPIFLOW_SHM_CHANNELS").map_or(true, |v| v.trim() != "0"))
}

/// The shape of a ring for messages of at most `nbytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Geometry {
    nbytes: usize,
    slots: usize,
    stride: usize,
}

impl Geometry {
    fn of(nbytes: usize) -> Geometry {
        let stride = (HEAD + nbytes).div_ceil(LINE) * LINE;
        Geometry {
            nbytes,
            slots: (RING_BYTES / stride).clamp(2, MAX_SLOTS),
            stride,
        }
    }

    fn len(&self) -> usize {
        SLOTS + self.slots * self.stride
    }

    /// Where the slot after the one at `at` starts (the first after the last): no
    /// division per message (the slot count need not be a power of two), nor per poll.
    #[inline(always)]
    fn after(&self, at: usize) -> usize {
        match at + self.stride {
            end if end == self.len() => SLOTS,
            next => next,
        }
    }
}

/// Who made a ring, and so how its sender starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Made {
    /// Both ranks of a channel, which agreed on it at opening: in use at once.
    ForChannel,
    /// The sender of a link ([`link`]): in use once the receiver has mapped it, until the
    /// receiver detaches it.
    ForLink,
}

/// The ring this rank sends on.
#[derive(Debug)]
struct Outbound {
    map: Mapping,
    geo: Geometry,
    /// The next message's number.
    next: Cell<u64>,
    /// The next slot position to fill (slots filled so far).
    pos: Cell<u64>,
    /// Where that slot starts.
    at: Cell<usize>,
    /// The receiver's consumed count, as last read.
    seen: Cell<u64>,
    /// Whether the receiver has mapped the ring, once seen.
    attached: Cell<bool>,
    made: Made,
}

impl Outbound {
    /// The ring to send on: a channel's is mapped by the receiver already (agreed at
    /// opening); a link's, once the ring says so.
    fn new(map: Mapping, geo: Geometry, made: Made) -> Outbound {
        Outbound {
            map,
            geo,
            next: Cell::new(0),
            pos: Cell::new(0),
            at: Cell::new(SLOTS),
            seen: Cell::new(0),
            attached: Cell::new(made == Made::ForChannel),
            made,
        }
    }

    /// A link's sender, about to put message `k` into a slot: announces it ([`INTENT`]),
    /// then reads whether the receiver detached the ring; both sequentially consistent,
    /// so that a receiver's [`Inbound::detach`] and this cannot both miss the other.
    /// `false`: the message goes by MPI.
    #[inline]
    fn claim(&self, k: u64) -> bool {
        self.map.word(INTENT).store(k + 1, Ordering::SeqCst);
        self.map.word(DETACHED).load(Ordering::SeqCst) == 0
    }

    /// Whether the receiver has mapped the ring (read from it until it has).
    #[inline(always)]
    fn attached(&self) -> bool {
        self.attached.get() || {
            let now = self.map.word(ATTACHED).load(Ordering::Acquire) != 0;
            self.attached.set(now);
            now
        }
    }

    /// Records that message `k` goes by MPI (`false`: the caller sends it there).
    #[cold]
    fn by_mpi(&self, k: u64) -> bool {
        self.map.word(BY_MPI).store(k + 1, Ordering::Release);
        false
    }

    /// Puts the channel's next message into the ring if slots are free (`true`); else
    /// records that this message goes by MPI (`false`), which the caller then sends. A
    /// message takes one slot, or on a link's ring up to [`LINK_CHUNKS`] in turn.
    #[inline]
    fn put(&self, bytes: &[u8]) -> bool {
        let k = self.next.get();
        self.next.set(k + 1);
        let pos = self.pos.get();
        let slots = self.geo.slots as u64;
        let n = match bytes.len() <= self.geo.nbytes {
            true => 1,
            false => match self.chunks(bytes.len()) {
                Some(n) => n,
                None => return self.by_mpi(k),
            },
        };
        if !self.attached() {
            return self.by_mpi(k);
        }
        if self.made == Made::ForLink && !self.claim(k) {
            return self.by_mpi(k);
        }
        if pos + n - self.seen.get() > slots {
            let consumed = self.map.word(CONSUMED).load(Ordering::Acquire);
            self.seen.set(consumed);
            if pos + n - consumed > slots {
                return self.by_mpi(k);
            }
        }
        if n > 1 {
            self.put_chunks(bytes, k);
            self.pos.set(pos + n);
            return true;
        }
        let slot = self.at.get();
        // SAFETY: the slot's message bytes lie inside the mapping (`slot + HEAD + len <=
        // slot + stride`, by the geometry both sides checked and the length test above),
        // and they are the sender's now: the receiver published (consumed, acquired above
        // or earlier) that it is done with the slot's previous message, and reads this one
        // only after the release below.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.map.base.add(slot + HEAD),
                bytes.len(),
            )
        };
        self.map
            .word(slot + 8)
            .store(bytes.len() as u64, Ordering::Relaxed);
        self.map.word(slot).store(k + 1, Ordering::Release);
        self.pos.set(pos + 1);
        self.at.set(self.geo.after(slot));
        true
    }

    /// How many slots a message of `len` bytes, longer than one, takes on this ring: on a
    /// link's, up to [`LINK_CHUNKS`]; `None` where it goes by MPI.
    #[inline]
    fn chunks(&self, len: usize) -> Option<u64> {
        let n = len.div_ceil(self.geo.nbytes);
        (self.made == Made::ForLink && n <= LINK_CHUNKS).then_some(n as u64)
    }

    /// Copies message `k` into the slots from the next free one on, a slot's worth each,
    /// each published as it is complete (its sequence word says `k + 1`, its first slot's
    /// length word the message's length), so the receiver copies one out while this copies
    /// the next in. The caller has checked that the slots are free.
    #[inline(never)]
    fn put_chunks(&self, bytes: &[u8], k: u64) {
        let mut slot = self.at.get();
        for (i, chunk) in bytes.chunks(self.geo.nbytes).enumerate() {
            // SAFETY: as in `put`, for each slot: a chunk is at most `nbytes` bytes, so it
            // lies inside its slot; the slot is the sender's (the receiver has consumed
            // what it held, checked by the caller for all of the message's slots), and the
            // receiver reads it only after the release below.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    chunk.as_ptr(),
                    self.map.base.add(slot + HEAD),
                    chunk.len(),
                )
            };
            let len = if i == 0 { bytes.len() } else { chunk.len() };
            self.map.word(slot + 8).store(len as u64, Ordering::Relaxed);
            self.map.word(slot).store(k + 1, Ordering::Release);
            slot = self.geo.after(slot);
        }
        self.at.set(slot);
    }
}

/// Where the next message to receive is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// In the ring: take it.
    Ring,
    /// Sent by MPI: receive it there (after counting it).
    Mpi,
    /// Not sent yet.
    NotYet,
}

/// The ring this rank receives on (its own).
#[derive(Debug)]
struct Inbound {
    map: Mapping,
    geo: Geometry,
    /// The next message's number.
    expect: Cell<u64>,
    /// The next slot position to read (slots read so far).
    pos: Cell<u64>,
    /// Where that slot starts.
    at: Cell<usize>,
    /// Whether a [`Inbound::detach`] of a link's ring holds (nothing can be in the ring
    /// from the message expected on) and the sender has not been let back since.
    away: Cell<bool>,
}

impl Inbound {
    fn new(map: Mapping, geo: Geometry) -> Inbound {
        Inbound {
            map,
            geo,
            expect: Cell::new(0),
            pos: Cell::new(0),
            at: Cell::new(SLOTS),
            away: Cell::new(false),
        }
    }

    #[inline]
    fn poll(&self) -> Next {
        let k = self.expect.get();
        let seq = self.map.word(self.at.get());
        if seq.load(Ordering::Acquire) == k + 1 {
            return Next::Ring;
        }
        // The MPI word first, then the slot again (see the module's protocol).
        let by_mpi = self.map.word(BY_MPI).load(Ordering::Acquire);
        if seq.load(Ordering::Acquire) == k + 1 {
            Next::Ring
        } else if by_mpi > k {
            Next::Mpi
        } else {
            Next::NotYet
        }
    }

    /// Copies the message [`Inbound::poll`] found into `out` (as much as fits): its
    /// length, and whether it was longer than `out`.
    #[inline]
    fn take(&self, out: &mut [u8]) -> (usize, bool) {
        let (pos, at) = (self.pos.get(), self.at.get());
        // The length was stored before the sequence word's release, which poll acquired.
        let len = self.map.word(at + 8).load(Ordering::Relaxed) as usize;
        if len > self.geo.nbytes {
            return self.take_chunks(out, len.min(LINK_CHUNKS * self.geo.nbytes));
        }
        let n = len.min(out.len());
        // SAFETY: `poll` saw this slot's sequence word say the expected message
        // (`Acquire`, after the sender's release following its copy), so its `len <=
        // nbytes` bytes are complete, inside the mapping, and the sender leaves them alone
        // until the consumed count below passes this position; `n` fits `out`.
        unsafe { std::ptr::copy_nonoverlapping(self.map.base.add(at + HEAD), out.as_mut_ptr(), n) };
        self.pos.set(pos + 1);
        self.at.set(self.geo.after(at));
        self.expect.set(self.expect.get() + 1);
        self.map.word(CONSUMED).store(pos + 1, Ordering::Release);
        (n, len > out.len())
    }

    /// [`Inbound::take`] of a message of `len` bytes in several slots ([`Outbound::put_chunks`]):
    /// each slot after the first once its sequence word says the message's number (the
    /// sender is copying it in: it checked the slots were free before the first).
    #[inline(never)]
    fn take_chunks(&self, out: &mut [u8], len: usize) -> (usize, bool) {
        let (k, nbytes) = (self.expect.get(), self.geo.nbytes);
        let n = len.div_ceil(nbytes);
        let mut at = self.at.get();
        for i in 0..n {
            let seq = self.map.word(at);
            if i > 0 && seq.load(Ordering::Acquire) != k + 1 {
                let mut wait = Backoff::new(std::time::Duration::from_micros(50));
                while seq.load(Ordering::Acquire) != k + 1 {
                    wait.idle();
                }
            }
            let from = i * nbytes;
            let fits = nbytes.min(len - from).min(out.len().saturating_sub(from));
            // SAFETY: the slot's sequence word says message `k` (`Acquire`: here, or in
            // `poll` for the first slot), released after the sender copied this chunk of at
            // most `nbytes` bytes inside the slot; the sender leaves it alone until the
            // consumed count below passes it; `fits` bytes from `from` lie inside `out`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.map.base.add(at + HEAD),
                    out.as_mut_ptr().add(from.min(out.len())),
                    fits,
                )
            };
            at = self.geo.after(at);
        }
        let pos = self.pos.get() + n as u64;
        self.pos.set(pos);
        self.at.set(at);
        self.expect.set(k + 1);
        self.map.word(CONSUMED).store(pos, Ordering::Release);
        (len.min(out.len()), len > out.len())
    }

    /// The length of the message [`Inbound::poll`] found in the ring once all of it is
    /// there (a message of several slots is published slot by slot, as its sender copies
    /// it in); `None` until then. A receiver that must not wait for a sender that may have
    /// died halfway polls this before [`Inbound::take`].
    #[inline]
    fn whole(&self) -> Option<usize> {
        let at = self.at.get();
        // Stored before the sequence word's release, which poll acquired.
        let len = self.map.word(at + 8).load(Ordering::Relaxed) as usize;
        if len <= self.geo.nbytes {
            return Some(len);
        }
        let k = self.expect.get();
        let n = len
            .min(LINK_CHUNKS * self.geo.nbytes)
            .div_ceil(self.geo.nbytes);
        let mut slot = at;
        for _ in 1..n {
            slot = self.geo.after(slot);
            if self.map.word(slot).load(Ordering::Acquire) != k + 1 {
                return None;
            }
        }
        Some(len.min(LINK_CHUNKS * self.geo.nbytes))
    }

    /// Counts the next message (which [`Inbound::poll`] found sent by MPI) as received:
    /// the caller receives it by MPI.
    #[inline(always)]
    fn skip(&self) {
        self.expect.set(self.expect.get() + 1);
    }

    /// Tells the sender that this side has mapped the ring (a ring the sender made).
    fn attach(&self) {
        self.map.word(ATTACHED).store(1, Ordering::Release);
    }

    /// Asks a link's sender to send by MPI from now on; `true` if no message from the next
    /// one this side expects on can be in the ring (the sender had not announced one:
    /// [`Outbound::claim`]), so the caller may post an MPI receive for it now. `false`:
    /// some may be; receive through the ring until the sender has seen this. Once it
    /// holds, it holds without asking again until [`Inbound::reattach`] (the sender puts
    /// nothing into the ring meanwhile): a stream of large messages costs no store per
    /// message.
    fn detach(&self) -> bool {
        if self.away.get() {
            return true;
        }
        self.map.word(DETACHED).store(1, Ordering::SeqCst);
        let clear = self.map.word(INTENT).load(Ordering::SeqCst) <= self.expect.get();
        self.away.set(clear);
        clear
    }

    /// [`Inbound::reattach`] where a detach holds: before a blocking receive of a message
    /// the ring carries.
    #[inline(always)]
    fn back(&self) {
        if self.away.get() {
            self.reattach();
        }
    }

    /// Lets a link's sender use the ring again after [`Inbound::detach`]: only while
    /// this side receives through the ring (no MPI receive of its own posted), whose polls
    /// order whatever comes either way.
    fn reattach(&self) {
        self.away.set(false);
        self.map.word(DETACHED).store(0, Ordering::Release);
    }

    /// The next message into `buf`, from the ring or, where its sender said so, by
    /// `MPI_Recv` from `peer` on `tag`: its length and whether it was cut at `buf`'s end,
    /// as MPI's status says. Waits as long as an MPI receive would (or the communicator's
    /// [`Comm::wait_limit`], in-process), as [`Waiting`] does.
    #[inline]
    fn receive<C: Comm>(
        &self,
        c: &C,
        buf: &mut [u8],
        peer: usize,
        tag: i32,
    ) -> Result<Completion, TransportError> {
        let mut waiting = Waiting::new();
        loop {
            match self.poll() {
                Next::Ring => {
                    let (count, truncated) = self.take(buf);
                    return Ok(Completion::new(count, truncated, peer));
                }
                Next::Mpi => {
                    self.skip();
                    return c.recv_blocking(buf, peer, tag);
                }
                Next::NotYet => waiting.idle(c, peer, tag)?,
            }
        }
    }
}

/// Polls for a message before a wait reads the clock (where waits may spin).
const SPIN_POLLS: u32 = 512;

/// A wait for what a peer writes into shared memory or sends (a ring's next message, a
/// link's offer): where ranks have cores of their own, the first polls spin without
/// reading the clock (a message a few hundred nanoseconds away is polled for before the
/// clock is read: a [`Backoff`] reads it on every poll, a sizeable share of a round trip
/// through a ring); later ones back off as MPI's waits do, and every 64 of them MPI
/// progresses ([`Comm::progress`]) and the communicator's [`Comm::wait_limit`] is checked.
struct Waiting {
    spins: u32,
    backoff: Option<(Backoff, std::time::Instant)>,
    polls: u32,
}

impl Waiting {
    fn new() -> Waiting {
        Waiting {
            spins: if spins_while_waiting() { SPIN_POLLS } else { 0 },
            backoff: None,
            polls: 0,
        }
    }

    /// After a poll that found nothing of `peer`'s on `tag`: a timeout past the
    /// communicator's wait limit.
    #[inline]
    fn idle<C: Comm>(&mut self, c: &C, peer: usize, tag: i32) -> Result<(), TransportError> {
        if self.spins > 0 {
            self.spins -= 1;
            std::hint::spin_loop();
            return Ok(());
        }
        let (wait, since) = self.backoff.get_or_insert_with(|| {
            let max_sleep = std::time::Duration::from_micros(50);
            (Backoff::new(max_sleep), std::time::Instant::now())
        });
        self.polls = self.polls.wrapping_add(1);
        if self.polls.is_multiple_of(64) {
            c.progress();
            if let Some(limit) = c.wait_limit().filter(|l| since.elapsed() > *l) {
                return Err(TransportError::Timeout {
                    rank: c.rank(),
                    peer,
                    tag,
                    secs: limit.as_secs(),
                });
            }
        }
        wait.idle();
        Ok(())
    }
}

#[cfg(test)]
mod tests;
