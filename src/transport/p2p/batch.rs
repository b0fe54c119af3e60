//! Windows of transfers that complete together: [`Sends`] and [`Receives`].
//!
//! A window of tensors to or from peers (a step's gradients to a parameter server, a
//! benchmark's window of messages) is started one transfer at a time and completed in one
//! `MPI_Waitall`, as rsmpi's request collections do. A transfer in a window costs its
//! `MPI_Isend`/`MPI_Irecv` and a handle that MPI writes straight into a vector: no
//! request object per message, no wait per message. Receives are checked as
//! [`super::immediate_receive_into`]'s are, in the order they were started, each as its
//! status is read once the window completes.
//!
//! A window borrows every tensor it holds until it completes; dropping one unwaited waits
//! for it (and still checks its receives, so each link learns what arrived).

use std::marker::PhantomData;

use super::{check_link, start_receive_into, Arrival, P2pError};
use crate::tensor::{Landing, Tensor};
use crate::transport::comm::{Comm, Completion};
use crate::transport::ring::Start;

/// Appends to `reqs` the request `start` writes into the slot it is given (the vector's
/// next element, in place: no request is returned and copied per message); `reqs` is
/// unchanged if `start` fails.
///
/// # Safety
/// `start` writes a request into the slot exactly when it returns `Ok`.
#[inline(always)]
unsafe fn push_in_place<R, T, E>(
    reqs: &mut Vec<R>,
    start: impl FnOnce(*mut R) -> Result<T, E>,
) -> Result<T, E> {
    if reqs.len() == reqs.capacity() {
        *reqs = grown(std::mem::take(reqs));
    }
    let n = reqs.len();
    // SAFETY: the capacity (grown if needed) has room for element n, which `start` may
    // write.
    let out = start(unsafe { reqs.as_mut_ptr().add(n) })?;
    // SAFETY: `start` returned Ok, so element n holds a request.
    unsafe { reqs.set_len(n + 1) };
    Ok(out)
}

/// `reqs` with room for more: out of line, and by value, so that the window's vector
/// never has its address taken on the way to each `MPI_Isend` (the compiler then keeps
/// it in registers across the call, rather than storing and reloading it per message).
#[cold]
#[inline(never)]
fn grown<R>(mut reqs: Vec<R>) -> Vec<R> {
    reqs.reserve(reqs.capacity().max(4));
    reqs
}

/// Starts sending `bytes` to `dst` on `tag` as the next send of the window `reqs`.
///
/// # Safety
/// `bytes` stay valid and unmodified until the send completes.
#[inline(always)]
unsafe fn push_send<C: Comm>(
    comm: &C,
    reqs: &mut Vec<C::WindowSend>,
    bytes: &[u8],
    dst: usize,
    tag: i32,
) -> Result<(), P2pError> {
    // SAFETY: the caller's contract; push_in_place gives a writable slot, which
    // isend_window_into fills exactly when it returns Ok.
    unsafe {
        push_in_place(reqs, |slot| {
            comm.isend_window_into(bytes.as_ptr(), bytes.len(), dst, tag, slot)
        })?
    };
    Ok(())
}

/// Ends the process if dropped. Armed around a loop that holds a window's requests in
/// locals ([`Sends::immediate_send_each`], [`Receives::immediate_receive_each`]) and
/// disarmed after it, it runs only if the loop unwinds (a caller's iterator panics): the
/// transfers started so far could then not be waited for, and MPI might read or write
/// their tensors after they are gone. (A guard that waited for them would hold the locals'
/// addresses, and the compiler would then store the window's lengths around every call
/// into MPI again.)
struct AbortOnUnwind;

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        eprintln!("mpiflow: a panic while a window's transfers were starting; aborting, as MPI may still use their tensors");
        std::process::abort();
    }
}

/// A window of sends in flight, completed together by [`Sends::wait_all`].
pub struct Sends<'a, C: Comm> {
    comm: &'a C,
    reqs: Vec<C::WindowSend>,
    _tensors: PhantomData<&'a Tensor>,
}

impl<'a, C: Comm> Sends<'a, C> {
    /// An empty window on `comm`.
    pub fn new(comm: &'a C) -> Self {
        Self::with_capacity(comm, 0)
    }

    /// An empty window with room for `n` sends.
    pub fn with_capacity(comm: &'a C, n: usize) -> Self {
        Sends {
            comm,
            reqs: Vec::with_capacity(n),
            _tensors: PhantomData,
        }
    }

    /// Starts sending `t` to `dst` on `tag` (`MPI_Isend`), as [`super::immediate_send`].
    #[inline(always)]
    pub fn immediate_send(&mut self, t: &'a Tensor, dst: usize, tag: i32) -> Result<(), P2pError> {
        check_link(self.comm, dst, tag)?;
        let links = self.comm.links();
        let bytes = links.outgoing(t, dst, tag);
        if links.rings.put(self.comm, bytes, dst, tag)? {
            return Ok(());
        }
        self.send_bytes(bytes, dst, tag)
    }

    /// Starts sending each of `tensors` to `dst` on `tag`, as [`Sends::immediate_send`]
    /// one by one, with the window's vector held in a local for the loop: a window of small
    /// messages is bound by what the sender stores per message (see
    /// [`Comm::isend_window_into`]), and a caller's loop of `immediate_send` may keep the
    /// window's length in memory, one more store around each `MPI_Isend`
    /// (`benches/results/2026-11-25-osu.md`).
    /// After a failed send, the sends started before it stay in the window.
    #[inline(always)]
    pub fn immediate_send_each(
        &mut self,
        tensors: impl IntoIterator<Item = &'a Tensor>,
        dst: usize,
        tag: i32,
    ) -> Result<(), P2pError> {
        check_link(self.comm, dst, tag)?;
        let (comm, mut reqs) = (self.comm, std::mem::take(&mut self.reqs));
        let armed = AbortOnUnwind;
        let mut done = Ok(());
        for t in tensors {
            let links = comm.links();
            let bytes = links.outgoing(t, dst, tag);
            match links.rings.put(comm, bytes, dst, tag) {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => {
                    done = Err(e.into());
                    break;
                }
            }
            // SAFETY: as in send_bytes: every send is given back to the window below, or
            // the process ends (`armed`) before a tensor could go.
            if let Err(e) = unsafe { push_send(comm, &mut reqs, bytes, dst, tag) } {
                done = Err(e);
                break;
            }
        }
        std::mem::forget(armed);
        self.reqs = reqs;
        done
    }

    /// Starts sending raw bytes of a tensor (a channel's payload).
    #[inline(always)]
    pub(crate) fn send_bytes(
        &mut self,
        bytes: &'a [u8],
        dst: usize,
        tag: i32,
    ) -> Result<(), P2pError> {
        // SAFETY: the window borrows the bytes for 'a and completes every send before it
        // is gone (wait_all or the destructor), so they stay valid and unmodified.
        unsafe { push_send(self.comm, &mut self.reqs, bytes, dst, tag) }
    }

    pub(crate) fn comm(&self) -> &'a C {
        self.comm
    }

    /// Sends in flight.
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Waits for every send (`MPI_Waitall`).
    pub fn wait_all(mut self) -> Result<(), P2pError> {
        Ok(self.comm.wait_window_sends(&mut self.reqs)?)
    }
}

impl<C: Comm> Drop for Sends<'_, C> {
    fn drop(&mut self) {
        if !self.reqs.is_empty() {
            let _ = self.comm.wait_window_sends(&mut self.reqs);
        }
    }
}

/// How a receive of a window is checked once it completed.
enum Check<'a> {
    /// A tensor on a link: as [`super::RecvRequest::wait`].
    Link(&'a mut Tensor, Arrival),
    /// The same, posted under a detach of its link's ring: the link learns it completed.
    Detached(&'a mut Tensor, Arrival),
    /// Not a receive: the link of the [`Check::Payload`]s after it.
    Run { src: usize, tag: i32 },
    /// A tensor of [`Receives::immediate_receive_each`] whose payload alone lands (its
    /// link held it): checked as a `Link` is, on the link of the last `Run` before it. One
    /// word stored per receive while the window is posted.
    Payload(&'a mut Tensor),
    /// A payload of `len` bytes (a channel's); `by` names what it expected otherwise.
    Exact { len: usize, by: &'a dyn ExactLength },
}

/// A receiver of payloads of one length, that names what it expected when another length
/// arrives (a [`crate::transport::channel::Channel`]).
pub(crate) trait ExactLength {
    fn check_length(&self, rank: usize, done: Completion) -> Result<(), P2pError>;
}

/// A receive that happens when its window completes, not when it starts (a
/// [`crate::transport::channel::Channel`] on rings, whose receive is a copy out of memory
/// shared with the sender).
pub(crate) trait DeferredReceive<C: Comm> {
    /// Receives the next message into `buf` (blocking) and checks it.
    fn receive_now(&self, c: &C, buf: &mut [u8]) -> Result<(), P2pError>;
}

/// A window of receives in flight, completed and checked together by
/// [`Receives::wait_all`].
pub struct Receives<'a, C: Comm> {
    comm: &'a C,
    reqs: Vec<C::Request>,
    checks: Vec<Check<'a>>,
    /// Receives done when the window completes, in the order they were started.
    later: Vec<Later<'a, C>>,
}

/// A receive of a window that happens when the window completes.
enum Later<'a, C: Comm> {
    /// A channel's on rings.
    Channel(&'a mut [u8], &'a dyn DeferredReceive<C>),
    /// A link's, queued on it ([`crate::transport::ring::LinkRings::start`]).
    Link {
        t: &'a mut Tensor,
        arrival: Arrival,
        ticket: u64,
    },
}

impl<'a, C: Comm> Receives<'a, C> {
    /// An empty window on `comm`.
    pub fn new(comm: &'a C) -> Self {
        Self::with_capacity(comm, 0)
    }

    /// An empty window with room for `n` receives.
    pub fn with_capacity(comm: &'a C, n: usize) -> Self {
        Receives {
            comm,
            reqs: Vec::with_capacity(n),
            checks: Vec::with_capacity(n),
            later: Vec::new(),
        }
    }

    /// Starts receiving into `t` from `src` on `tag` (`MPI_Irecv`), as
    /// [`super::immediate_receive_into`].
    #[inline]
    pub fn immediate_receive_into(
        &mut self,
        t: &'a mut Tensor,
        src: usize,
        tag: i32,
    ) -> Result<(), P2pError> {
        check_link(self.comm, src, tag)?;
        let (comm, reqs) = (self.comm, &mut self.reqs);
        // SAFETY (both): the window holds `t` mutably for 'a and completes every receive
        // before it is gone (wait_all or the destructor): nothing else touches it
        // meanwhile; irecv_into writes the slot exactly when it returns Ok.
        let (arrival, started) = unsafe {
            start_receive_into(comm, t, src, tag, |buf, len| {
                push_in_place(reqs, |slot| comm.irecv_into(buf, len, src, tag, slot))
            })?
        };
        match started {
            Start::Queued(ticket) => self.queue_link(t, arrival, ticket),
            Start::Mpi => self.checks.push(Check::Link(t, arrival)),
            Start::Detached => self.checks.push(Check::Detached(t, arrival)),
        }
        Ok(())
    }

    /// Starts receiving into each of `tensors` from `src` on `tag`, as
    /// [`Receives::immediate_receive_into`] one by one, with the link checked once, the
    /// window's vectors held in locals for the loop, and one word stored per receive where
    /// its link held the tensor: a window of small messages races its sender, and a
    /// receive posted after its message arrived takes MPI's unexpected-message path. On an
    /// AMD VM, 1-8 B under `bench bw -b multiple`: 0.90-0.91 of plain MPI's window in the
    /// same jobs with `immediate_receive_into` per tensor, 0.93-0.95 with this, 0.96-0.98
    /// with plain MPI receiving into the same tensors (`benches/results/2026-11-25-osu.md`).
    /// After a failed receive, the receives started before it stay in the window.
    #[inline(always)]
    pub fn immediate_receive_each(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut Tensor>,
        src: usize,
        tag: i32,
    ) -> Result<(), P2pError> {
        check_link(self.comm, src, tag)?;
        let comm = self.comm;
        let (mut reqs, mut checks) = (
            std::mem::take(&mut self.reqs),
            std::mem::take(&mut self.checks),
        );
        let armed = AbortOnUnwind;
        let mut done = Ok(());
        checks.push(Check::Run { src, tag });
        for t in tensors {
            // SAFETY: as in immediate_receive_into: every receive is given back to the
            // window below, or the process ends (`armed`) before a tensor could go.
            let started = unsafe {
                start_receive_into(comm, &mut *t, src, tag, |buf, len| {
                    push_in_place(&mut reqs, |slot| comm.irecv_into(buf, len, src, tag, slot))
                })
            };
            match started {
                Ok((arrival, Start::Queued(ticket))) => self.queue_link(t, arrival, ticket),
                Ok((arrival, Start::Detached)) => checks.push(Check::Detached(t, arrival)),
                Ok((arrival, Start::Mpi)) if arrival.landing == Landing::Payload => {
                    checks.push(Check::Payload(t))
                }
                Ok((arrival, Start::Mpi)) => checks.push(Check::Link(t, arrival)),
                Err(e) => {
                    done = Err(e);
                    break;
                }
            }
        }
        std::mem::forget(armed);
        (self.reqs, self.checks) = (reqs, checks);
        done
    }

    /// Starts receiving exactly `region.len()` bytes, checked by `check`.
    #[inline]
    pub(crate) fn receive_exact(
        &mut self,
        region: &'a mut [u8],
        src: usize,
        tag: i32,
        check: &'a dyn ExactLength,
    ) -> Result<(), P2pError> {
        let len = region.len();
        let comm = self.comm;
        // SAFETY: as in immediate_receive_into; the window holds the region for 'a.
        unsafe {
            push_in_place(&mut self.reqs, |slot| {
                comm.irecv_into(region.as_mut_ptr(), len, src, tag, slot)
            })?
        };
        self.checks.push(Check::Exact { len, by: check });
        Ok(())
    }

    /// Receives into `buf` by `by` when the window completes.
    #[inline]
    pub(crate) fn receive_later(&mut self, buf: &'a mut [u8], by: &'a dyn DeferredReceive<C>) {
        self.push_later(Later::Channel(buf, by));
    }

    /// A receive into `t` queued on its link (`ticket`), finished when the window
    /// completes.
    #[inline]
    fn queue_link(&mut self, t: &'a mut Tensor, arrival: Arrival, ticket: u64) {
        self.push_later(Later::Link { t, arrival, ticket });
    }

    #[inline]
    fn push_later(&mut self, later: Later<'a, C>) {
        if self.later.capacity() == 0 {
            // The window's size, once: no growth per window of a benchmark's loop.
            self.later.reserve(self.reqs.capacity().max(4));
        }
        self.later.push(later);
    }

    pub(crate) fn comm(&self) -> &'a C {
        self.comm
    }

    /// Waits for every receive (`MPI_Waitall`) and checks each, in the order they were
    /// started; returns the first error (every receive is checked, so every link holds
    /// what its sender sent).
    pub fn wait_all(mut self) -> Result<(), P2pError> {
        self.complete()
    }

    fn complete(&mut self) -> Result<(), P2pError> {
        let comm = self.comm;
        let (rank, links) = (comm.rank(), comm.links());
        let mut first = Ok(());
        for later in self.later.drain(..) {
            let r = match later {
                Later::Channel(buf, by) => by.receive_now(comm, buf),
                Later::Link { t, arrival, ticket } => {
                    match links.rings.finish(comm, arrival.src, arrival.tag, ticket) {
                        Ok(done) => links.settle(comm, arrival, t, done),
                        Err(e) => Err(e.into()),
                    }
                }
            };
            if r.is_err() && first.is_ok() {
                first = r;
            }
        }
        let mut checks = self.checks.drain(..);
        // Each receive is checked as MPI_Waitall's status for it is read: the hot path
        // reads a length and a discriminant per receive; results (80 bytes) move only on
        // an error. `run` is the link of the `Payload` checks, set by the `Run` before them.
        let mut run = (0, 0);
        comm.wait_all_each(&mut self.reqs, |done| {
            let r = loop {
                break match checks.next() {
                    Some(Check::Run { src, tag }) => {
                        run = (src, tag);
                        continue;
                    }
                    Some(Check::Link(t, arrival)) => links.settle(comm, arrival, t, done),
                    Some(Check::Detached(t, arrival)) => {
                        links.rings.detached_done(arrival.src, arrival.tag);
                        links.settle(comm, arrival, t, done)
                    }
                    Some(Check::Payload(t)) if !done.truncated() && done.count == t.nbytes() => {
                        return
                    }
                    Some(Check::Payload(t)) => {
                        links.settle(comm, Arrival::repeat(run.0, run.1), t, done)
                    }
                    Some(Check::Exact { len, .. }) if !done.truncated() && done.count == len => {
                        return
                    }
                    Some(Check::Exact { by, .. }) => by.check_length(rank, done),
                    None => return,
                };
            };
            if r.is_err() && first.is_ok() {
                first = r;
            }
        })?;
        first
    }
}

impl<C: Comm> Drop for Receives<'_, C> {
    fn drop(&mut self) {
        if !self.reqs.is_empty() || !self.later.is_empty() {
            let _ = self.complete();
        }
    }
}

#[cfg(test)]
mod tests;
