//! The mpiflow paths' side of `latency`, `bw` and `bibw`: tensors as the runtime makes
//! them, moved with a header on every message (`p2p`), over an open [`Channel`], or
//! through an [`Inbox`] of receives posted ahead (the `mpi` path's side is [`super::raw`]).
//! Between ranks of one node, a channel (and so an inbox) of at most
//! [`crate::transport::ring::MAX_BYTES`] is on rings in shared memory, not MPI, unless
//! `MPIFLOW_SHM_CHANNELS=0`.

use super::osu::Path;
use super::{turns, BenchError, TAG};
use crate::tensor::{DType, Tensor};
use crate::transport::channel::Channel;
use crate::transport::inbox::Inbox;
use crate::transport::mpi::MpiComm;
use crate::transport::p2p::{self, P2pError, Receives, Sends};

/// How the mpiflow paths move a tensor: a header on every message, an open channel, or a
/// channel whose receiving rank keeps a window of receives posted ahead (an [`Inbox`]).
pub(super) enum Via<'c> {
    Headers,
    Channel(Channel),
    /// The inbox only on a rank that receives on the channel.
    Inbox(Channel, Option<Inbox<'c, MpiComm>>),
}

impl<'c> Via<'c> {
    /// The way `path` goes between ranks 0 and 1 for tensors like `t` (opening a channel
    /// is collective between the two); an inbox holds `depth` receives, if any.
    pub(super) fn open(
        comm: &'c MpiComm,
        path: Path,
        t: &Tensor,
        peer: usize,
        depth: usize,
    ) -> Result<Via<'c>, P2pError> {
        Ok(match path {
            Path::Channel => Via::Channel(Channel::open(comm, t, peer, TAG)?),
            Path::Inbox => {
                let ch = Channel::open(comm, t, peer, TAG)?;
                let inbox = match depth {
                    0 => None,
                    d => Some(ch.inbox(comm, t, d)?),
                };
                Via::Inbox(ch, inbox)
            }
            _ => Via::Headers,
        })
    }

    /// Withdraws an inbox's receives: a message that arrived and was never taken means
    /// the benchmark lost count, an error.
    pub(super) fn close(self) -> Result<(), P2pError> {
        match self {
            Via::Inbox(_, Some(inbox)) => inbox.close(),
            _ => Ok(()),
        }
    }
}

/// A path's calls on tensors, for [`Tensors::window_on`] and [`Tensors::round_trip_on`]:
/// one instance per path, dispatched once per window or round trip, not per message (a
/// match per message shows in small messages' latency). A window of small messages is
/// bound by what the sender stores per message (see `Comm::isend_window_into`): neither a
/// match per message nor a loop that spills a register around each `MPI_Isend`.
trait Way {
    /// Sends `t` (blocking).
    fn send(&self, c: &MpiComm, t: &Tensor) -> Result<(), P2pError>;

    /// Starts sending each of `tensors` in the window `sends`.
    fn send_each<'a>(
        &self,
        sends: &mut Sends<'a, MpiComm>,
        tensors: impl Iterator<Item = &'a Tensor>,
    ) -> Result<(), P2pError>;

    /// Starts receiving into each of `tensors` in the window `receives`.
    fn receive_each<'a>(
        &'a self,
        receives: &mut Receives<'a, MpiComm>,
        tensors: impl Iterator<Item = &'a mut Tensor>,
    ) -> Result<(), P2pError>;

    /// Receives into `t` (blocking).
    fn receive_into(&self, c: &MpiComm, t: &mut Tensor) -> Result<(), P2pError>;
}

/// The header path to `peer`.
struct Headers(usize);

impl Way for Headers {
    #[inline(always)]
    fn send(&self, c: &MpiComm, t: &Tensor) -> Result<(), P2pError> {
        p2p::send(c, t, self.0, TAG)
    }

    #[inline(always)]
    fn send_each<'a>(
        &self,
        sends: &mut Sends<'a, MpiComm>,
        tensors: impl Iterator<Item = &'a Tensor>,
    ) -> Result<(), P2pError> {
        sends.immediate_send_each(tensors, self.0, TAG)
    }

    #[inline(always)]
    fn receive_each<'a>(
        &'a self,
        receives: &mut Receives<'a, MpiComm>,
        tensors: impl Iterator<Item = &'a mut Tensor>,
    ) -> Result<(), P2pError> {
        receives.immediate_receive_each(tensors, self.0, TAG)
    }

    #[inline(always)]
    fn receive_into(&self, c: &MpiComm, t: &mut Tensor) -> Result<(), P2pError> {
        p2p::receive_into(c, t, self.0, TAG)
    }
}

impl Way for Channel {
    #[inline(always)]
    fn send(&self, c: &MpiComm, t: &Tensor) -> Result<(), P2pError> {
        Channel::send(self, c, t)
    }

    #[inline(always)]
    fn send_each<'a>(
        &self,
        sends: &mut Sends<'a, MpiComm>,
        tensors: impl Iterator<Item = &'a Tensor>,
    ) -> Result<(), P2pError> {
        for t in tensors {
            self.immediate_send_in(sends, t)?;
        }
        Ok(())
    }

    #[inline(always)]
    fn receive_each<'a>(
        &'a self,
        receives: &mut Receives<'a, MpiComm>,
        tensors: impl Iterator<Item = &'a mut Tensor>,
    ) -> Result<(), P2pError> {
        for t in tensors {
            self.immediate_receive_in(receives, t)?;
        }
        Ok(())
    }

    #[inline(always)]
    fn receive_into(&self, c: &MpiComm, t: &mut Tensor) -> Result<(), P2pError> {
        Channel::receive_into(self, c, t)
    }
}

/// Bytes of buffers an inbox of the benchmark posts ahead at most: the L2 cache of a core
/// on the machines measured (1 MiB). Each message lands in a buffer of the inbox's in
/// turn, so beyond the cache every message lands in cold memory: a window of 64 receives
/// ahead made `bibw` 0.61-0.67x of plain MPI at 256 KiB-1 MiB and lost the huge-page lead
/// at 2-4 MiB (`benches/results/2026-11-26-inbox.md`), where messages go by rendezvous
/// and a receive posted late costs little anyway.
const INBOX_BYTES: usize = 1 << 20;

/// An inbox's depth on a receiving rank: the window, within [`INBOX_BYTES`] of buffers
/// (at least 2).
pub(super) fn inbox_depth(window: usize, size: usize) -> usize {
    (INBOX_BYTES / size.max(1)).clamp(2, window.max(2))
}

/// Starts the window's `n` sends from the tensors `send` in turn, on `way`.
#[inline(always)]
fn start_sends<'a, W: Way>(
    c: &'a MpiComm,
    way: &W,
    send: &'a [Tensor],
    n: usize,
) -> Result<Sends<'a, MpiComm>, P2pError> {
    let mut sending = Sends::with_capacity(c, n);
    way.send_each(&mut sending, turns(send.len(), n).map(|j| &send[j]))?;
    Ok(sending)
}

/// The mpiflow paths' buffers: tensors as the runtime makes them.
pub(super) struct Tensors {
    pub(super) send: Vec<Tensor>,
    pub(super) recv: Vec<Tensor>,
    /// The 1-byte reply of bw.
    pub(super) ack: Tensor,
    pub(super) ack_in: Tensor,
}

impl Tensors {
    pub(super) fn new(count: usize, size: usize) -> Result<Tensors, BenchError> {
        let filled = |byte: u8| -> Result<Tensor, BenchError> {
            let mut t = Tensor::zeros(DType::U8, &[size])?.named("bench");
            t.bytes_mut().fill(byte);
            Ok(t)
        };
        let ack = Tensor::zeros(DType::U8, &[1])?.named("ack");
        Ok(Tensors {
            send: (0..count).map(|_| filled(b'a')).collect::<Result<_, _>>()?,
            recv: (0..count).map(|_| filled(b'b')).collect::<Result<_, _>>()?,
            ack_in: ack.clone(),
            ack,
        })
    }

    /// One side of a window on an mpiflow path, dispatched once to the path's [`Way`].
    pub(super) fn window(
        &mut self,
        c: &MpiComm,
        via: &mut Via,
        peer: usize,
        receives: usize,
        sends: usize,
    ) -> Result<(), P2pError> {
        match via {
            Via::Headers => self.window_on(c, &Headers(peer), receives, sends),
            Via::Channel(ch) => self.window_on(c, ch, receives, sends),
            Via::Inbox(ch, inbox) => self.window_inbox(c, ch, inbox.as_mut(), receives, sends),
        }
    }

    /// One iteration of latency on an mpiflow path, dispatched once to the path's
    /// [`Way`]: rank 0 (`first`) sends, then receives; its peer the other way round.
    pub(super) fn round_trip(
        &mut self,
        c: &MpiComm,
        via: &mut Via,
        peer: usize,
        first: bool,
    ) -> Result<(), P2pError> {
        match via {
            Via::Headers => self.round_trip_on(c, &Headers(peer), first),
            Via::Channel(ch) => self.round_trip_on(c, ch, first),
            Via::Inbox(ch, Some(inbox)) => {
                let (send, recv) = (&self.send[0], &mut self.recv[0]);
                if first {
                    ch.send(c, send)?;
                    inbox.receive_into(recv)
                } else {
                    inbox.receive_into(recv)?;
                    ch.send(c, send)
                }
            }
            Via::Inbox(_, None) => unreachable!("both ranks of latency receive"),
        }
    }

    #[inline(always)]
    fn round_trip_on<W: Way>(&mut self, c: &MpiComm, way: &W, first: bool) -> Result<(), P2pError> {
        let (send, recv) = (&self.send[0], &mut self.recv[0]);
        if first {
            way.send(c, send)?;
            way.receive_into(c, recv)
        } else {
            way.receive_into(c, recv)?;
            way.send(c, send)
        }
    }

    /// One side of a window: the sends in flight, then the receives (into the one receive
    /// tensor in turn, or into one each, posted before the sends, as OSU); waits for the
    /// sends, then the receives.
    fn window_on<W: Way>(
        &mut self,
        c: &MpiComm,
        way: &W,
        receives: usize,
        sends: usize,
    ) -> Result<(), P2pError> {
        if self.recv.len() == 1 {
            let sending = start_sends(c, way, &self.send, sends)?;
            for _ in 0..receives {
                way.receive_into(c, &mut self.recv[0])?;
            }
            return sending.wait_all();
        }
        let mut incoming = Receives::with_capacity(c, receives);
        way.receive_each(&mut incoming, self.recv[..receives].iter_mut())?;
        start_sends(c, way, &self.send, sends)?.wait_all()?;
        incoming.wait_all()
    }

    /// One side of a window through an inbox: the sends in flight, then each message
    /// taken from the inbox (whose receives were posted ahead) into the receive tensors in
    /// turn; waits for the sends.
    fn window_inbox(
        &mut self,
        c: &MpiComm,
        ch: &Channel,
        inbox: Option<&mut Inbox<'_, MpiComm>>,
        receives: usize,
        sends: usize,
    ) -> Result<(), P2pError> {
        let sending = start_sends(c, ch, &self.send, sends)?;
        if let Some(inbox) = inbox {
            let nr = self.recv.len();
            for j in turns(nr, receives) {
                inbox.receive_into(&mut self.recv[j])?;
            }
        }
        sending.wait_all()
    }
}
