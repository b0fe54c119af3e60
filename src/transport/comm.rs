//! The communicator abstraction every algorithm is written against.
//!
//! [`Comm`] is the small set of operations the collective algorithms need: non-blocking
//! byte send and receive between ranks, and optionally the MPI library's own collectives.
//! Two implementations run the same algorithm code: [`super::mpi::MpiComm`] (real MPI) and
//! [`super::local::LocalComm`] (threads in one process, for plain `cargo test`).
//!
//! Maintainer note: `isend`/`irecv` take raw pointers because a request outlives the call
//! that starts it; the safe wrappers in [`super::p2p`] and the algorithms in
//! [`super::collectives`] tie buffer lifetimes to the requests and always wait before a
//! buffer is released.

use crate::tensor::DType;

/// Errors from moving bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("{call} failed on rank {rank}: {message}")]
    Mpi {
        call: &'static str,
        rank: usize,
        message: String,
    },
    #[error("rank {rank}: no message from rank {peer} (tag {tag}) within {secs} s")]
    Timeout {
        rank: usize,
        peer: usize,
        tag: i32,
        secs: u64,
    },
    #[error("rank {rank}: peer rank {peer} is out of range (communicator of {size})")]
    BadPeer {
        rank: usize,
        peer: usize,
        size: usize,
    },
    #[error("rank {rank}: could not read the ring offer rank {peer} sent (is every rank running the same mpiflow?)")]
    BadOffer { rank: usize, peer: usize },
    #[error("rank {rank}: message of {len} bytes is larger than MPI can count (2^31-1)")]
    TooLarge { rank: usize, len: usize },
    #[error("rank {rank}: rank {peer} did not reach {what} within {} s", *millis as f64 / 1000.0)]
    Stalled {
        rank: usize,
        peer: usize,
        what: &'static str,
        millis: u64,
    },
    #[error("rank {rank}: symmetric memory: {message}")]
    Symmetric { rank: usize, message: String },
    #[error(
        "rank {rank}: allreduce mismatch: rank {peer} passed {theirs} where rank 0 passed {ours}"
    )]
    CallMismatch {
        rank: usize,
        peer: usize,
        theirs: String,
        ours: String,
    },
}

/// How a receive completed.
///
/// Three whole words: a receive's result is copied word by word, and a word read over a
/// narrower store (a `bool` beside its padding) stalls on store forwarding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Bytes that arrived (at most the buffer length).
    pub count: usize,
    /// The sender's rank (useful with [`ANY_SOURCE`]).
    pub source: usize,
    /// 1 if the message was longer than the buffer (see [`Completion::truncated`]).
    truncated: usize,
}

impl Completion {
    #[inline(always)]
    pub fn new(count: usize, truncated: bool, source: usize) -> Completion {
        Completion {
            count,
            source,
            truncated: usize::from(truncated),
        }
    }

    /// The message was longer than the buffer; the rest was dropped.
    #[inline(always)]
    pub fn truncated(&self) -> bool {
        self.truncated != 0
    }
}

/// Receive from any rank.
pub const ANY_SOURCE: usize = usize::MAX;

/// A reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the number of ranks (integers truncate).
    Average,
    Min,
    Max,
}

impl ReduceOp {
    /// Every operation, in declaration order.
    pub const ALL: [ReduceOp; 4] = [
        ReduceOp::Sum,
        ReduceOp::Average,
        ReduceOp::Min,
        ReduceOp::Max,
    ];
}

/// The operations algorithms are built from.
pub trait Comm {
    /// An in-flight operation.
    type Request;

    fn rank(&self) -> usize;
    fn size(&self) -> usize;

    /// The tag scheme under this communicator's `MPI_TAG_UB`: the library's own tags and
    /// the range left to callers.
    fn tags(&self) -> super::tags::Tags;

    /// The tensors last sent to and received from each (peer, tag), for
    /// [`super::p2p`]'s header-free repeats.
    fn links(&self) -> &super::links::Links;

    /// Starts sending `len` bytes at `buf` to `dst`.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and unmodified until the request is waited on.
    unsafe fn isend(
        &self,
        buf: *const u8,
        len: usize,
        dst: usize,
        tag: i32,
    ) -> Result<Self::Request, TransportError>;

    /// Starts receiving at most `len` bytes into `buf` from `src` (or [`ANY_SOURCE`]).
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and not be accessed until the request is waited on.
    unsafe fn irecv(
        &self,
        buf: *mut u8,
        len: usize,
        src: usize,
        tag: i32,
    ) -> Result<Self::Request, TransportError>;

    /// A send of a window ([`super::p2p::Sends`]): completed only together with the
    /// window's others, by [`Comm::wait_window_sends`], so it keeps nothing for a
    /// completion (for MPI the bare handle, where a [`Comm::Request`] also keeps its
    /// buffer's length: one store less per message, which at 16 bytes decides Open MPI's
    /// shared-memory regime, see [`Comm::isend_window_into`]).
    type WindowSend;

    /// Starts sending `len` bytes at `buf` to `dst` as part of a window, the send written
    /// into `slot` (the window's next element, in place: nothing is returned and copied
    /// per message). `slot` holds a send exactly when this returns `Ok`.
    ///
    /// A window of small messages is bound by what the sender stores per message, so
    /// nothing is stored per message beyond the request itself
    /// (`benches/results/2026-11-25-osu.md`). Open MPI's shared-memory fast box takes each
    /// message in a cache line the receiver is polling: the message's stores wait for that
    /// line, and every later store queues behind them.
    ///
    /// # Safety
    /// As [`Comm::isend`]; `slot` is valid for writes of a send.
    unsafe fn isend_window_into(
        &self,
        buf: *const u8,
        len: usize,
        dst: usize,
        tag: i32,
        slot: *mut Self::WindowSend,
    ) -> Result<(), TransportError>;

    /// Waits for every send of `sends` and empties it (`MPI_Waitall`); an error still
    /// completes or waits for every send before it returns, so no buffer is left in MPI's
    /// hands.
    fn wait_window_sends(&self, sends: &mut Vec<Self::WindowSend>) -> Result<(), TransportError>;

    /// [`Comm::irecv`] that writes the request into `slot` instead of returning it: a
    /// window's next receive, in place (see [`super::p2p::Receives`]). `slot` holds a
    /// request exactly when this returns `Ok`.
    ///
    /// # Safety
    /// As [`Comm::irecv`]; `slot` is valid for writes of a request.
    #[inline]
    unsafe fn irecv_into(
        &self,
        buf: *mut u8,
        len: usize,
        src: usize,
        tag: i32,
        slot: *mut Self::Request,
    ) -> Result<(), TransportError> {
        // SAFETY: the caller's contract, passed on; slot is valid for writes.
        unsafe { slot.write(self.irecv(buf, len, src, tag)?) };
        Ok(())
    }

    /// Waits for one request.
    fn wait(&self, req: Self::Request) -> Result<Completion, TransportError>;

    /// Waits for every request of `reqs` and empties it, in one call where the transport
    /// has one (`MPI_Waitall`): a window of sends costs one wait, not one per message.
    /// Completions are not reported (what sends need); an error still completes or waits
    /// for every request before it returns, so no buffer is left in MPI's hands.
    fn wait_all(&self, reqs: &mut Vec<Self::Request>) -> Result<(), TransportError> {
        let mut first = Ok(());
        for r in reqs.drain(..) {
            if let Err(e) = self.wait(r) {
                first = first.and(Err(e));
            }
        }
        first
    }

    /// [`Comm::wait_all`] that also hands how each request completed to `each`, in order
    /// (what a window of receives needs to check each), as they are read: no vector of
    /// completions is written and read back. After a request fails, `each` sees no more;
    /// every request is still completed or waited for.
    fn wait_all_each(
        &self,
        reqs: &mut Vec<Self::Request>,
        mut each: impl FnMut(Completion),
    ) -> Result<(), TransportError> {
        let mut first = Ok(());
        for r in reqs.drain(..) {
            match self.wait(r) {
                Ok(c) if first.is_ok() => each(c),
                Ok(_) => {}
                Err(e) => first = first.and(Err(e)),
            }
        }
        first
    }

    /// Completes `req` if it is done (`MPI_Test`); `None` leaves it in flight.
    fn test(&self, req: &mut Self::Request) -> Result<Option<Completion>, TransportError>;

    /// Withdraws a receive posted ahead (`MPI_Cancel`, then its wait): `None` if no
    /// message had matched it, else what arrived (a message that matched is received,
    /// never lost in the library).
    fn cancel_receive(&self, req: Self::Request) -> Result<Option<Completion>, TransportError>;

    /// Lets the library move transfers in flight while this rank waits on something else
    /// (a ring in shared memory): `MPI_Iprobe`, which runs MPI's progress engine. Nothing
    /// where transfers progress by themselves.
    fn progress(&self) {}

    /// Whether rank `peer` runs on this rank's node (shares its memory), as the MPI
    /// library sees it (`MPI_COMM_TYPE_SHARED`); false where unknown.
    fn same_node(&self, _peer: usize) -> bool {
        false
    }

    /// This rank's node, as two ranks compare it to know whether they can share memory
    /// (`super::ring`): the host name ([`host_name`], which MPI reports too); in-process,
    /// the simulated node.
    fn node_name(&self) -> Option<String> {
        host_name()
    }

    /// Blocking send (`MPI_Send`); the default starts a request and waits.
    fn send_blocking(&self, buf: &[u8], dst: usize, tag: i32) -> Result<(), TransportError> {
        // SAFETY: the request is waited on before `buf`'s borrow ends.
        let r = unsafe { self.isend(buf.as_ptr(), buf.len(), dst, tag)? };
        self.wait(r).map(|_| ())
    }

    /// Blocking receive (`MPI_Recv`); the default starts a request and waits.
    fn recv_blocking(
        &self,
        buf: &mut [u8],
        src: usize,
        tag: i32,
    ) -> Result<Completion, TransportError> {
        // SAFETY: the request is waited on before `buf`'s borrow ends.
        let r = unsafe { self.irecv(buf.as_mut_ptr(), buf.len(), src, tag)? };
        self.wait(r)
    }

    /// Takes one message with `tag` from `src` (or [`ANY_SOURCE`]) if one has started to
    /// arrive, whatever its length (`MPI_Improbe` + `MPI_Imrecv`). A message whose transfer
    /// does not complete within `complete_within` (its sender died mid-message) is a
    /// [`TransportError::Timeout`] naming the sender, never a hang.
    fn try_receive(
        &self,
        src: usize,
        tag: i32,
        complete_within: std::time::Duration,
    ) -> Result<Option<(usize, Vec<u8>)>, TransportError> {
        let mut buf = Vec::new();
        Ok(self
            .try_receive_into(src, tag, complete_within, &mut buf)?
            .map(|source| (source, buf)))
    }

    /// [`Comm::try_receive`] into `buf`, replaced by the message (its allocation reused
    /// when large enough: a server that receives large messages in a loop allocates, and
    /// faults pages in, once); returns the sender. After a timeout `buf` is empty (the
    /// memory MPI may still write is kept alive for the rest of the process).
    fn try_receive_into(
        &self,
        src: usize,
        tag: i32,
        complete_within: std::time::Duration,
        buf: &mut Vec<u8>,
    ) -> Result<Option<usize>, TransportError>;

    /// One zero-filled segment of `len` bytes per rank that every rank can load and store,
    /// when all ranks share one node (`MPI_Win_allocate_shared`); `None` otherwise.
    /// Collective: every rank calls it, with the same `len`.
    fn shared_segments(
        &self,
        _len: usize,
    ) -> Result<Option<super::segments::SharedSegments>, TransportError> {
        Ok(None)
    }

    /// One-sided windows of `T` ([`super::window`]).
    type Window<T: super::rma::RmaType>: super::window::RmaWindow<T>;

    /// A window of `len` zeroed elements of `T` on this rank (lengths may differ by rank,
    /// 0 included), exposed to every rank's one-sided operations. Collective: every rank
    /// calls it, windows in the same order.
    fn window<T: super::rma::RmaType>(
        &self,
        len: usize,
    ) -> Result<Self::Window<T>, super::rma::AllocateError>;

    /// How long a collective waits for a peer before failing; `None`: the caller's default.
    fn wait_limit(&self) -> Option<std::time::Duration> {
        None
    }

    /// True if the native_* collectives are implemented (by an MPI library).
    fn has_native(&self) -> bool {
        false
    }

    /// The library's own allreduce, in place, if this communicator has one.
    fn native_allreduce(
        &self,
        _buf: &mut [u8],
        _dtype: DType,
        _op: ReduceOp,
    ) -> Option<Result<(), TransportError>> {
        None
    }

    /// The library's own broadcast, if any.
    fn native_bcast(&self, _buf: &mut [u8], _root: usize) -> Option<Result<(), TransportError>> {
        None
    }

    /// The library's own barrier, if any.
    fn native_barrier(&self) -> Option<Result<(), TransportError>> {
        None
    }

    /// A new communicator of the ranks that pass the same `color`, ordered by `key` then
    /// rank (collective, like `MPI_Comm_split`).
    fn split(&self, color: u32, key: usize) -> Result<Self, TransportError>
    where
        Self: Sized;

    /// The communicator of the ranks on this rank's node (that can share memory), in rank
    /// order (collective, like `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`).
    fn split_node(&self) -> Result<Self, TransportError>
    where
        Self: Sized;
}

/// Blocking send of a byte slice.
pub fn send<C: Comm>(c: &C, buf: &[u8], dst: usize, tag: i32) -> Result<(), TransportError> {
    c.send_blocking(buf, dst, tag)
}

/// Blocking receive into a byte slice.
pub fn recv<C: Comm>(
    c: &C,
    buf: &mut [u8],
    src: usize,
    tag: i32,
) -> Result<Completion, TransportError> {
    // SAFETY: the request is waited on before `buf`'s borrow ends.
    let r = unsafe { c.irecv(buf.as_mut_ptr(), buf.len(), src, tag)? };
    c.wait(r)
}

/// Simultaneous send and receive (`MPI_Sendrecv`), deadlock-free in rings and pairs.
pub fn sendrecv<C: Comm>(
    c: &C,
    out: &[u8],
    dst: usize,
    inb: &mut [u8],
    src: usize,
    tag: i32,
) -> Result<Completion, TransportError> {
    check_peer(c, dst)?;
    check_peer(c, src)?;
    // SAFETY: both requests are waited on before the borrows end (peers were checked, so
    // the send cannot fail to start for a reason known in advance).
    let r = unsafe { c.irecv(inb.as_mut_ptr(), inb.len(), src, tag)? };
    let s = unsafe { c.isend(out.as_ptr(), out.len(), dst, tag) };
    let got = c.wait(r);
    c.wait(s?)?;
    got
}

/// This machine's host name (`gethostname`; `uname`'s node name on Linux).
pub fn host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for `buf.len()` bytes and gethostname writes at most that.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// A peer rank that exists (or [`ANY_SOURCE`]).
pub fn check_peer<C: Comm>(c: &C, peer: usize) -> Result<(), TransportError> {
    if peer < c.size() || peer == ANY_SOURCE {
        Ok(())
    } else {
        Err(TransportError::BadPeer {
            rank: c.rank(),
            peer,
            size: c.size(),
        })
    }
}

/// The request `start` writes into a slot of its own, returned with what `start` returns:
/// `isend` and `irecv` of a transport whose own forms write in place (as
/// [`Comm::irecv_into`]), and a single checked receive ([`super::p2p`]).
///
/// # Safety
/// `start` writes a request into the slot exactly when it returns `Ok`.
#[inline(always)]
pub(crate) unsafe fn returned<R, T, E>(
    start: impl FnOnce(*mut R) -> Result<T, E>,
) -> Result<(R, T), E> {
    let mut r = std::mem::MaybeUninit::uninit();
    let out = start(r.as_mut_ptr())?;
    // SAFETY: start returned Ok, so it wrote the request (this function's contract).
    Ok((unsafe { r.assume_init() }, out))
}

/// Waits may spin before they yield: set at start when every rank of this machine has a CPU
/// of its own and MPI itself spins ([`spin_while_waiting`]). Off until then: threads of one
/// process (`LocalComm`) and oversubscribed jobs yield from the first poll.
static SPIN_FIRST: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Lets every [`Backoff`] of this process spin for its first [`Backoff::BUSY`] (`true`: no
/// rank of this machine waits for a CPU that a spinning rank holds), or not.
pub fn spin_while_waiting(on: bool) {
    SPIN_FIRST.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Every rank of this machine has a CPU of its own: set at start ([`cpu_each`]).
static CPU_EACH: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Says whether every rank of this machine has a CPU of its own (set at start by the
/// context; off until then, and for threads of one process).
pub fn set_cpu_each(on: bool) {
    CPU_EACH.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// True where every rank of this machine has a CPU of its own: work another rank does for
/// this one while it computes (a ps serving rows asked for ahead) takes no CPU from it.
pub fn cpu_each() -> bool {
    CPU_EACH.load(std::sync::atomic::Ordering::Relaxed)
}

/// MPI's own progress yields the CPU when a poll finds nothing (Open MPI's
/// `mpi_yield_when_idle`, which its launcher sets on an oversubscribed host): a wait whose
/// poll is an MPI call (a probe, a test) has yielded in it already.
static MPI_YIELDS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Says whether MPI's progress yields when idle (see [`Backoff::polling_mpi`]).
pub fn mpi_yields_while_polling(on: bool) {
    MPI_YIELDS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether waits spin first (see [`spin_while_waiting`]).
pub fn spins_while_waiting() -> bool {
    SPIN_FIRST.load(std::sync::atomic::Ordering::Relaxed)
}

/// Waiting without burning a core for long: where every rank has a CPU of its own
/// ([`spin_while_waiting`]), polls spin for the first [`Backoff::BUSY`] of a wait, as MPI's
/// own waits do; then they yield the CPU until [`Backoff::SPIN`] (and for at least 64
/// polls); later ones sleep a little longer each time, up to `max_sleep`. A yield is a
/// system call (about a microsecond) in which the awaited message can arrive: a
/// parameter server's round trip of a small model paid it on each of its four waits. Busy
/// waiting starves oversubscribed ranks (more ranks than cores is normal on small
/// machines), so they never spin; sleeping at once costs a wait that ends soon a wake-up
/// (tens of microseconds with the kernel's timer slack), which a parameter server's round
/// trip of a few megabytes pays twice.
#[derive(Debug, Clone)]
pub struct Backoff {
    /// Polls since the wait stopped spinning.
    polls: u32,
    max_sleep: std::time::Duration,
    since: Option<std::time::Instant>,
    spin: bool,
    /// Idle calls since the clock was last read, and how long the wait had lasted then:
    /// the clock is read every [`Backoff::CLOCK_EVERY`] calls only (a poll of a message
    /// takes less than reading it twice).
    unread: u32,
    waited: std::time::Duration,
    /// Each poll is an MPI call that yielded the CPU itself when it found nothing: this
    /// backoff does not yield a second time.
    yielded: bool,
}

impl Backoff {
    /// How long a wait spins before it yields, where it may spin.
    pub const BUSY: std::time::Duration = std::time::Duration::from_micros(100);
    /// How long a wait yields before it sleeps.
    pub const SPIN: std::time::Duration = std::time::Duration::from_millis(1);

    /// Idle calls between two readings of the clock.
    const CLOCK_EVERY: u32 = 8;

    pub fn new(max_sleep: std::time::Duration) -> Backoff {
        Backoff {
            polls: 0,
            max_sleep,
            since: None,
            spin: spins_while_waiting(),
            unread: 0,
            waited: std::time::Duration::ZERO,
            yielded: false,
        }
    }

    /// A backoff for polls that are MPI calls (a probe, a test). Where MPI's progress
    /// yields the CPU when it finds nothing ([`mpi_yields_while_polling`]), such a poll
    /// yielded already: yielding again would switch away twice per poll (both ranks of a
    /// round trip twice as often as MPI's own waits), so the backoff only counts the
    /// poll until it is time to sleep.
    pub fn polling_mpi(max_sleep: std::time::Duration) -> Backoff {
        Backoff {
            yielded: MPI_YIELDS.load(std::sync::atomic::Ordering::Relaxed),
            ..Backoff::new(max_sleep)
        }
    }

    /// After a poll that found nothing.
    pub fn idle(&mut self) {
        let since = *self.since.get_or_insert_with(std::time::Instant::now);
        self.unread += 1;
        if self.unread >= Self::CLOCK_EVERY {
            self.unread = 0;
            self.waited = since.elapsed();
        }
        let waited = self.waited;
        if self.spin && waited < Self::BUSY {
            std::hint::spin_loop();
            return;
        }
        self.polls = self.polls.saturating_add(1);
        if self.polls < 64 || waited < Self::SPIN {
            match self.yielded {
                true => std::hint::spin_loop(),
                false => std::thread::yield_now(),
            }
        } else {
            let us = std::time::Duration::from_micros(u64::from(self.polls));
            std::thread::sleep(us.min(self.max_sleep));
        }
    }

    /// After a poll that found work.
    pub fn reset(&mut self) {
        self.polls = 0;
        self.since = None;
        self.unread = 0;
        self.waited = std::time::Duration::ZERO;
    }
}
