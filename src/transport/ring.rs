//! Rings in memory that the two ranks of a [`super::channel::Channel`] share when they run on
//! one node: the channel's small messages move without MPI.
//!
//! Under Open MPI's `ob1` a small message costs its match, its request and, when it
//! arrives before its receive, a copy through the unexpected-message queue: on this VM
//! about 0.33 us one way at 1-8 B, and a window of 64 messages into one buffer 11-67 MB/s.
//! A single-producer single-consumer ring of slots in shared memory costs a copy in, a
//! copy out and the cache lines that carry them: 0.15 us and 44-316 MB/s at 1-8 B
//! (`benches/compare/shm_ring.c`, the same job alternating both; 0.45-0.65x the latency
//! and 2-5x the bandwidth to 4 KiB). From about 8 KiB MPI's single copy (CMA) wins, so
//! only channels of at most [`MAX_BYTES`] take rings.
//!
//! Each rank creates the ring it receives on (a POSIX shared-memory object, named in the
//! channel's opening handshake and unlinked once the peer mapped it, so nothing outlives
//! the two processes) and maps its peer's as the ring it sends on. A ring is used only if
//! both ranks offered one, name the same host, and mapped each other's: the
//! same verdict on both sides, or neither uses one ([`Comm::node_name`]). `MPIFLOW_SHM_CHANNELS=0` turns rings
//! off for the process.
//!
//! Protocol (`n` slots of one message each; message `k` of the channel, counted from 0):
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
//! Messages of other senders on the channel's tag (which the channel owns) are not seen:
//! a ring receive reads MPI only when the ring's sender said so.

use std::cell::Cell;
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};

use super::comm::{sendrecv, Comm, TransportError};

/// Messages of at most this many bytes travel through rings.
pub const MAX_BYTES: usize = 4096;
/// Bytes of slots a ring aims for (a core's share of cache): 64 slots to 4 KiB messages.
const RING_BYTES: usize = 256 * 1024;
const MAX_SLOTS: usize = 64;
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
/// Bytes of a slot before its message: the sequence word, then the message's length.
const HEAD: usize = 16;

/// Whether this process offers rings (`MPIFLOW_SHM_CHANNELS=0` turns them off).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MPIFLOW_SHM_CHANNELS").map_or(true, |v| v.trim() != "0"))
}

/// The shape of a ring for messages of at most `nbytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
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

/// A ring's shared object mapped into this process; unmapped when dropped. Neither `Send`
/// nor `Sync` (a raw pointer): a ring has one producer and one consumer, so a channel on
/// rings stays on the thread that opened it.
#[derive(Debug)]
struct Mapping {
    base: *mut u8,
    len: usize,
}

impl Mapping {
    /// Maps `len` bytes of the shared object `fd`.
    fn of(fd: &std::os::fd::OwnedFd, len: usize) -> std::io::Result<Mapping> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of an open descriptor; the kernel picks the
        // address, so no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping {
            base: base.cast(),
            len,
        })
    }

    /// The word at `offset` (8-byte aligned, inside the mapping).
    #[inline(always)]
    fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= self.len);
        // SAFETY: the base is page-aligned and every offset the ring uses is a multiple of
        // 8 within the mapping, which lives as long as `self`; both processes access these
        // words only through atomics.
        unsafe { &*self.base.add(offset).cast::<AtomicU64>() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is this mapping, and nothing borrows it any more.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn c_name(name: &str) -> std::io::Result<CString> {
    CString::new(name).map_err(|_| std::io::Error::other("a ring's name holds a NUL"))
}

/// Opens the shared object `name` with `flags`.
fn shm_open(name: &str, flags: libc::c_int) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let c = c_name(name)?;
    // SAFETY: `c` is a NUL-terminated name; the call opens or creates an object by name.
    let fd = unsafe { libc::shm_open(c.as_ptr(), flags, 0o600) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

fn unlink(name: &str) {
    if let Ok(c) = c_name(name) {
        // SAFETY: a NUL-terminated name; removing a name touches no memory of ours.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

/// Creates a ring for `geo` under a fresh name: zero-filled, its geometry written.
fn create(geo: Geometry) -> std::io::Result<(Mapping, String)> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "/mpiflow-ring-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let fd = shm_open(&name, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR)?;
    // The pages are allocated now, not when first touched: a shared-memory file system
    // that is full (a container's 64 MiB /dev/shm) refuses the ring here, and the channel
    // stays on MPI, instead of a store into the ring faulting (SIGBUS) later.
    let sized = {
        use std::os::fd::AsRawFd;
        // SAFETY: sizing an object this process just created (zero-filled by the kernel).
        unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, geo.len() as libc::off_t) }
    };
    let map = if sized == 0 {
        Mapping::of(&fd, geo.len())
    } else {
        Err(std::io::Error::from_raw_os_error(sized))
    };
    let map = map.inspect_err(|_| unlink(&name))?;
    for (i, v) in [
        MAGIC,
        geo.nbytes as u64,
        geo.slots as u64,
        geo.stride as u64,
    ]
    .into_iter()
    .enumerate()
    {
        map.word(GEOMETRY + 8 * i).store(v, Ordering::Relaxed);
    }
    Ok((map, name))
}

/// Maps the peer's ring `name`, which must be one for `geo`.
fn open(name: &str, geo: Geometry) -> std::io::Result<Mapping> {
    let fd = shm_open(name, libc::O_RDWR)?;
    let size = {
        use std::os::fd::AsRawFd;
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstat writes a `stat` into the buffer it is given.
        if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fstat returned 0, so it filled the struct.
        unsafe { st.assume_init() }.st_size
    };
    if size != geo.len() as libc::off_t {
        return Err(std::io::Error::other("the peer's ring has another size"));
    }
    let map = Mapping::of(&fd, geo.len())?;
    let want = [
        MAGIC,
        geo.nbytes as u64,
        geo.slots as u64,
        geo.stride as u64,
    ];
    if (0..4).any(|i| map.word(GEOMETRY + 8 * i).load(Ordering::Relaxed) != want[i]) {
        return Err(std::io::Error::other(
            "the peer's ring has another geometry",
        ));
    }
    Ok(map)
}

/// The ring this rank sends on (the peer's).
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
}

impl Outbound {
    /// The ring to send on; `attached`: known to be mapped by the receiver (a channel's,
    /// agreed at opening), else read from the ring until it says so.
    fn new(map: Mapping, geo: Geometry, attached: bool) -> Outbound {
        Outbound {
            map,
            geo,
            next: Cell::new(0),
            pos: Cell::new(0),
            at: Cell::new(SLOTS),
            seen: Cell::new(0),
            attached: Cell::new(attached),
        }
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

    /// Puts the channel's next message into the ring if a slot is free (`true`); else
    /// records that this message goes by MPI (`false`), which the caller then sends.
    #[inline]
    fn put(&self, bytes: &[u8]) -> bool {
        let k = self.next.get();
        self.next.set(k + 1);
        let pos = self.pos.get();
        let slots = self.geo.slots as u64;
        if bytes.len() > self.geo.nbytes || !self.attached() {
            return self.by_mpi(k);
        }
        if pos - self.seen.get() >= slots {
            let consumed = self.map.word(CONSUMED).load(Ordering::Acquire);
            self.seen.set(consumed);
            if pos - consumed >= slots {
                return self.by_mpi(k);
            }
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
}

/// Where the channel's next message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// In the ring: [`Rings::take`] it.
    Ring,
    /// Sent by MPI: receive it there (after [`Rings::skip`]).
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
}

impl Inbound {
    fn new(map: Mapping, geo: Geometry) -> Inbound {
        Inbound {
            map,
            geo,
            expect: Cell::new(0),
            pos: Cell::new(0),
            at: Cell::new(SLOTS),
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
        let len = (self.map.word(at + 8).load(Ordering::Relaxed) as usize).min(self.geo.nbytes);
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

    /// Tells the sender that this side has mapped the ring (a ring the sender made).
    // Work in progress: the header path's link rings will call it (see the results file).
    #[allow(dead_code)]
    fn attach(&self) {
        self.map.word(ATTACHED).store(1, Ordering::Release);
    }
}

/// A channel's two rings: the one it sends on and the one it receives on.
#[derive(Debug)]
pub(crate) struct Rings {
    out: Outbound,
    inb: Inbound,
}

impl Rings {
    /// See [`Outbound::put`].
    #[inline(always)]
    pub(crate) fn put(&self, bytes: &[u8]) -> bool {
        self.out.put(bytes)
    }

    /// Where the next message to receive is.
    #[inline(always)]
    pub(crate) fn poll(&self) -> Next {
        self.inb.poll()
    }

    /// Copies the next message (which [`Rings::poll`] found in the ring) into `out`: its
    /// length, and whether it was longer than `out`.
    #[inline(always)]
    pub(crate) fn take(&self, out: &mut [u8]) -> (usize, bool) {
        self.inb.take(out)
    }

    /// Counts the next message (which [`Rings::poll`] found sent by MPI) as received:
    /// the caller receives it by MPI.
    #[inline(always)]
    pub(crate) fn skip(&self) {
        self.inb.expect.set(self.inb.expect.get() + 1);
    }
}

/// What a rank offers in a channel's opening: its host and the ring it receives on.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Offer {
    host: String,
    name: String,
}

/// Room for an offer (a host name is at most 255 bytes).
const OFFER_ROOM: usize = 512;

/// Part of a channel's opening, on both ranks (two exchanges with `peer` on `tag`): the
/// rings of a channel of `nbytes` messages, if both ranks want them (`want`) and can share
/// them; `None` on both ranks otherwise.
pub(crate) fn connect<C: Comm>(
    c: &C,
    peer: usize,
    tag: i32,
    nbytes: usize,
    want: bool,
) -> Result<Option<Rings>, TransportError> {
    let geo = Geometry::of(nbytes);
    let want = want && enabled() && nbytes > 0 && nbytes <= MAX_BYTES;
    let host = c.node_name();
    let mine = match (want, host) {
        (true, Some(host)) => create(geo)
            .ok()
            .map(|(map, name)| (map, Offer { host, name })),
        _ => None,
    };
    let result = exchange(c, peer, tag, geo, mine.as_ref().map(|m| &m.1));
    if let Some((_, offer)) = &mine {
        // Mapped by the peer or not by now: the name is no longer needed.
        unlink(&offer.name);
    }
    let out = result?;
    Ok(match (mine, out) {
        (Some((map, _)), Some(out)) => Some(Rings {
            out: Outbound::new(out, geo, true),
            inb: Inbound::new(map, geo),
        }),
        _ => None,
    })
}

/// The two exchanges: offers, then whether each side mapped the other's; the peer's ring
/// when both did.
fn exchange<C: Comm>(
    c: &C,
    peer: usize,
    tag: i32,
    geo: Geometry,
    mine: Option<&Offer>,
) -> Result<Option<Mapping>, TransportError> {
    let ours = serde_json::to_vec(&mine).unwrap_or_default();
    let mut theirs = [0u8; OFFER_ROOM];
    let got = sendrecv(c, &ours, peer, &mut theirs, peer, tag)?;
    let theirs: Option<Offer> = match got.truncated() {
        true => None,
        false => serde_json::from_slice(&theirs[..got.count]).unwrap_or(None),
    };
    let mapped = match (mine, theirs) {
        (Some(m), Some(t)) if m.host == t.host => open(&t.name, geo).ok(),
        _ => None,
    };
    let mut both = [0u8; 1];
    sendrecv(c, &[u8::from(mapped.is_some())], peer, &mut both, peer, tag)?;
    Ok(mapped.filter(|_| both[0] == 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(nbytes: usize) -> (Outbound, Inbound) {
        let geo = Geometry::of(nbytes);
        let (map, name) = create(geo).unwrap();
        let out = open(&name, geo).unwrap();
        unlink(&name);
        (Outbound::new(out, geo, true), Inbound::new(map, geo))
    }

    #[test]
    fn geometry_keeps_slots_within_the_ring_bytes() {
        assert_eq!(Geometry::of(4).stride, 64);
        assert_eq!(Geometry::of(48).stride, 64);
        assert_eq!(Geometry::of(49).stride, 128);
        assert_eq!(Geometry::of(8).slots, 64);
        assert_eq!(Geometry::of(4096).stride, 4160);
        assert_eq!(Geometry::of(4096).slots, 63);
        assert_eq!(Geometry::of(4096).len(), 3 * 64 + 63 * 4160);
    }

    #[test]
    fn a_full_ring_sends_by_mpi_and_the_receiver_knows_which_went_where() {
        let (out, inb) = pair(8);
        let slots = out.geo.slots;
        let mut routes = Vec::new();
        for k in 0..slots + 3 {
            routes.push(out.put(&(k as u64).to_le_bytes()));
        }
        // The ring took the first `slots`; the three after went by MPI.
        assert!(routes[..slots].iter().all(|r| *r));
        assert!(routes[slots..].iter().all(|r| !*r));
        let mut buf = [0u8; 8];
        for k in 0..slots {
            assert_eq!(inb.poll(), Next::Ring);
            inb.take(&mut buf);
            assert_eq!(u64::from_le_bytes(buf), k as u64);
        }
        // A slot is free again, and the next message goes there; the three before it are
        // MPI's, in order.
        assert!(out.put(&99u64.to_le_bytes()));
        for _ in 0..3 {
            assert_eq!(inb.poll(), Next::Mpi);
            inb.expect.set(inb.expect.get() + 1);
        }
        assert_eq!(inb.poll(), Next::Ring);
        inb.take(&mut buf);
        assert_eq!(u64::from_le_bytes(buf), 99);
        assert_eq!(inb.poll(), Next::NotYet);
    }

    #[test]
    fn a_peer_ring_of_another_geometry_is_refused() {
        let (_map, name) = create(Geometry::of(16)).unwrap();
        let err = open(&name, Geometry::of(64)).unwrap_err().to_string();
        unlink(&name);
        assert!(err.contains("another"), "{err}");
        assert!(open(&name, Geometry::of(16)).is_err(), "unlinked");
    }

    #[test]
    fn messages_of_any_length_up_to_the_slot_and_longer_ones_by_mpi() {
        let (out, inb) = pair(100);
        let mut buf = [0u8; 100];
        for (k, len) in [0usize, 1, 57, 100, 101, 3].into_iter().enumerate() {
            let msg: Vec<u8> = (0..len).map(|i| (i + k) as u8).collect();
            let into_ring = out.put(&msg);
            assert_eq!(into_ring, len <= 100, "length {len}");
            if into_ring {
                assert_eq!(inb.poll(), Next::Ring);
                assert_eq!(inb.take(&mut buf), (len, false));
                assert_eq!(&buf[..len], &msg[..]);
            } else {
                assert_eq!(inb.poll(), Next::Mpi);
                inb.expect.set(inb.expect.get() + 1);
            }
        }
        // A message longer than the receiver's buffer: what fits, and the truncation.
        assert!(out.put(&[7u8; 80]));
        assert_eq!(inb.poll(), Next::Ring);
        assert_eq!(inb.take(&mut buf[..50]), (50, true));
    }

    #[test]
    fn a_ring_its_sender_made_carries_nothing_until_the_receiver_attaches() {
        let geo = Geometry::of(8);
        let (map, name) = create(geo).unwrap();
        let out = Outbound::new(map, geo, false);
        let inb = Inbound::new(open(&name, geo).unwrap(), geo);
        unlink(&name);
        // Before the receiver maps it: by MPI, numbered, so the receiver knows.
        assert!(!out.put(&1u64.to_le_bytes()));
        assert_eq!(inb.poll(), Next::Mpi);
        inb.expect.set(inb.expect.get() + 1);
        inb.attach();
        assert!(out.put(&2u64.to_le_bytes()));
        let mut buf = [0u8; 8];
        assert_eq!(inb.poll(), Next::Ring);
        assert_eq!(inb.take(&mut buf), (8, false));
        assert_eq!(u64::from_le_bytes(buf), 2);
    }
}
