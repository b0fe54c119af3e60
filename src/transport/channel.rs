//! Persistent channels: the same tensor between two ranks again and again, checked once.
//!
//! [`super::p2p`] sends a tensor's header on the first message of a (peer, tag) link and
//! whenever the tensor changes, and the payload alone otherwise. A channel is the explicit
//! form, MPI's persistent-request idea (`MPI_Send_init`/`MPI_Recv_init`) for tensors:
//! [`Channel::open`] exchanges the two sides' headers before any data moves (the mismatch
//! error names both sides, on both ranks, at open), and then messages carry the payload
//! alone, with no per-message bookkeeping beyond a signature comparison. Each send or
//! receive checks, locally, that the tensor is the one the channel was opened for, and
//! that exactly its bytes arrived.
//!
//! Between two ranks of one node, a channel of a small tensor (at most `ring::MAX_BYTES`)
//! carries its messages through rings in memory the two share (`super::ring`: a copy in
//! and a copy out, no matching and no request), and by MPI when a
//! ring is full, in order either way. [`Channel::carrier`] says which was chosen;
//! [`Channel::open_over`] with [`Carrier::Mpi`] keeps a channel on MPI. A ring has one
//! producer and one consumer, so a channel stays on the thread that opened it (it is
//! neither `Send` nor `Sync`).
//!
//! A channel owns its (peer, tag): no other traffic between the two ranks may use that tag
//! (over MPI, a message of another length on it is an error naming the channel; a channel
//! on rings does not see such messages).

use std::rc::Rc;

use super::comm::{Comm, Completion};
use super::p2p::{
    check_tag, immediate_send_bytes, DeferredReceive, ExactLength, P2pError, Receives, SendRequest,
    Sends,
};
use super::ring::{self, Rings};
use crate::tensor::{Tensor, TensorError};

/// What carries a channel's messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carrier {
    /// Rings in shared memory where both ranks run on one node and the tensor is small
    /// enough (see the module's documentation), else MPI.
    SharedMemory,
    /// MPI alone.
    Mpi,
}

/// A checked, header-free connection for one tensor signature between two ranks.
#[derive(Debug, Clone)]
pub struct Channel {
    peer: usize,
    tag: i32,
    signature: u64,
    nbytes: usize,
    describe: String,
    /// The rings, when the channel is on shared memory (clones share them, and with them
    /// the stream's place; a channel on rings is neither `Send` nor `Sync`).
    rings: Option<Rc<Rings>>,
}

impl Channel {
    /// Opens the channel with `peer` on `tag` for tensors like `t`, on shared memory where
    /// it can be ([`Channel::open_over`] with [`Carrier::SharedMemory`]).
    pub fn open<C: Comm>(c: &C, t: &Tensor, peer: usize, tag: i32) -> Result<Channel, P2pError> {
        Self::open_over(c, t, peer, tag, Carrier::SharedMemory)
    }

    /// Opens the channel with `peer` on `tag` for tensors like `t` (`MPI_Sendrecv` of the
    /// two headers, then two more to agree on rings when `carrier` allows them). Both ranks
    /// call it; a peer that opened it for another tensor is an error on both, naming both
    /// sides. Rings are used only if both ranks allow them.
    pub fn open_over<C: Comm>(
        c: &C,
        t: &Tensor,
        peer: usize,
        tag: i32,
        carrier: Carrier,
    ) -> Result<Channel, P2pError> {
        check_tag(c, tag)?;
        let ours = t.wire_header();
        let mut theirs = [0u8; crate::tensor::HEADER_ROOM];
        let got = super::comm::sendrecv(c, ours, peer, &mut theirs, peer, tag)?;
        let mut ch = Channel {
            peer,
            tag,
            signature: t.signature(),
            nbytes: t.nbytes(),
            describe: t.describe(),
            rings: None,
        };
        if got.truncated() || theirs[..got.count] != *ours {
            let theirs = crate::tensor::describe_header(&theirs[..got.count]);
            return Err(ch.tensor_error(
                c.rank(),
                TensorError::Mismatch {
                    ours: format!("{} (opening a channel)", ch.describe),
                    theirs,
                },
            ));
        }
        let want = carrier == Carrier::SharedMemory;
        ch.rings = ring::connect(c, peer, tag, ch.nbytes, want)?.map(Rc::new);
        Ok(ch)
    }

    /// What carries this channel's messages.
    pub fn carrier(&self) -> Carrier {
        match self.rings {
            Some(_) => Carrier::SharedMemory,
            None => Carrier::Mpi,
        }
    }

    /// The rank at the other end.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// The tag the channel owns between the two ranks.
    pub fn tag(&self) -> i32 {
        self.tag
    }

    /// Receives posted ahead on this channel into tensors like `like` (see
    /// [`super::inbox`]).
    pub fn inbox<'c, C: Comm>(
        &self,
        c: &'c C,
        like: &Tensor,
        depth: usize,
    ) -> Result<super::inbox::Inbox<'c, C>, P2pError> {
        super::inbox::Inbox::open(c, self, like, depth)
    }

    fn tensor_error(&self, rank: usize, source: TensorError) -> P2pError {
        P2pError::Tensor {
            rank,
            peer: self.peer,
            source,
        }
    }

    /// `t` must be the tensor the channel was opened for (name, dtype, shape).
    #[inline(always)]
    pub(super) fn check_tensor<C: Comm>(&self, c: &C, t: &Tensor) -> Result<(), P2pError> {
        if t.signature() == self.signature {
            return Ok(());
        }
        Err(self.other_tensor(c, t))
    }

    #[cold]
    #[inline(never)]
    fn other_tensor<C: Comm>(&self, c: &C, t: &Tensor) -> P2pError {
        P2pError::Channel {
            rank: c.rank(),
            peer: self.peer,
            tag: self.tag,
            opened: self.describe.clone(),
            given: t.describe(),
        }
    }

    /// Puts `bytes` (the channel's tensor's) into the ring: false if the channel is on
    /// MPI or the ring is full (the message then goes by MPI).
    #[inline(always)]
    fn put(&self, bytes: &[u8]) -> bool {
        self.rings.as_ref().is_some_and(|r| r.put(bytes))
    }

    /// Sends `t`'s payload (into the ring, else `MPI_Send`).
    #[inline]
    pub fn send<C: Comm>(&self, c: &C, t: &Tensor) -> Result<(), P2pError> {
        self.check_tensor(c, t)?;
        if !self.put(t.bytes()) {
            c.send_blocking(t.bytes(), self.peer, self.tag)?;
        }
        Ok(())
    }

    /// Receives into `t`'s payload (from the ring, else `MPI_Recv`); anything but exactly
    /// its bytes is an error.
    #[inline]
    pub fn receive_into<C: Comm>(&self, c: &C, t: &mut Tensor) -> Result<(), P2pError> {
        self.check_tensor(c, t)?;
        self.receive_bytes(c, t.bytes_mut())
    }

    /// The next message into `buf` (the channel's tensor's payload), checked.
    #[inline(always)]
    fn receive_bytes<C: Comm>(&self, c: &C, buf: &mut [u8]) -> Result<(), P2pError> {
        match &self.rings {
            Some(rings) => self.ring_receive(c, rings, buf),
            None => {
                let done = c.recv_blocking(buf, self.peer, self.tag)?;
                self.check_length(c.rank(), done)
            }
        }
    }

    /// The next message into `buf`, from the ring or, where the ring's sender said so, by
    /// `MPI_Recv` (see [`ring`]).
    #[inline]
    fn ring_receive<C: Comm>(&self, c: &C, rings: &Rings, buf: &mut [u8]) -> Result<(), P2pError> {
        let done = rings.receive(c, buf, self.peer, self.tag)?;
        self.check_length(c.rank(), done)
    }

    #[cold]
    #[inline(never)]
    fn wrong_length(&self, rank: usize, done: Completion) -> P2pError {
        let got = if done.truncated() {
            format!("more than {} bytes", self.nbytes)
        } else {
            format!("{} bytes", done.count)
        };
        self.tensor_error(
            rank,
            TensorError::Mismatch {
                ours: format!("{} ({} bytes) on the channel", self.describe, self.nbytes),
                theirs: got,
            },
        )
    }

    /// Starts sending `t`'s payload (into the ring, which completes it at once, else
    /// `MPI_Isend`).
    #[inline]
    pub fn immediate_send<'a, C: Comm>(
        &self,
        c: &'a C,
        t: &'a Tensor,
    ) -> Result<SendRequest<'a, C>, P2pError> {
        self.check_tensor(c, t)?;
        if self.put(t.bytes()) {
            return Ok(SendRequest::completed(c));
        }
        immediate_send_bytes(c, t.bytes(), self.peer, self.tag)
    }

    /// Starts receiving into `t`'s payload (`MPI_Irecv`; on rings, the receive happens
    /// when the request is waited on).
    #[inline]
    pub fn immediate_receive_into<'a, C: Comm>(
        &'a self,
        c: &'a C,
        t: &'a mut Tensor,
    ) -> Result<ChannelReceive<'a, C>, P2pError> {
        self.check_tensor(c, t)?;
        let b = t.bytes_mut();
        let pending = match self.rings {
            Some(_) => Pending::Ring(b),
            // SAFETY: the request holds `t` mutably for 'a, so nothing else touches the
            // payload until it is waited on (by `wait` or by the destructor).
            None => Pending::Mpi(unsafe { c.irecv(b.as_mut_ptr(), b.len(), self.peer, self.tag)? }),
        };
        Ok(ChannelReceive {
            comm: c,
            channel: self,
            pending,
        })
    }

    /// Starts sending `t`'s payload as part of the window `sends`. Always inlined: a call
    /// per message saves and restores registers, stores that slow a window of small
    /// messages (see [`Comm::isend_window_into`]).
    #[inline(always)]
    pub fn immediate_send_in<'a, C: Comm>(
        &self,
        sends: &mut Sends<'a, C>,
        t: &'a Tensor,
    ) -> Result<(), P2pError> {
        self.check_tensor(sends.comm(), t)?;
        if self.put(t.bytes()) {
            return Ok(());
        }
        sends.send_bytes(t.bytes(), self.peer, self.tag)
    }

    /// Starts receiving into `t`'s payload as part of the window `receives`, checked
    /// when the window completes.
    #[inline(always)]
    pub fn immediate_receive_in<'a, C: Comm>(
        &'a self,
        receives: &mut Receives<'a, C>,
        t: &'a mut Tensor,
    ) -> Result<(), P2pError> {
        self.check_tensor(receives.comm(), t)?;
        match self.rings {
            Some(_) => {
                receives.receive_later(t.bytes_mut(), self);
                Ok(())
            }
            None => receives.receive_exact(t.bytes_mut(), self.peer, self.tag, self),
        }
    }
}

impl<C: Comm> DeferredReceive<C> for Channel {
    fn receive_now(&self, c: &C, buf: &mut [u8]) -> Result<(), P2pError> {
        self.receive_bytes(c, buf)
    }
}

impl ExactLength for Channel {
    /// Anything but exactly the channel's bytes is an error naming the channel's tensor.
    #[inline]
    fn check_length(&self, rank: usize, done: Completion) -> Result<(), P2pError> {
        if done.truncated() || done.count != self.nbytes {
            return Err(self.wrong_length(rank, done));
        }
        Ok(())
    }
}

/// A channel receive in flight: an MPI request, or the payload a ring receive fills when
/// waited on.
enum Pending<'a, R> {
    Mpi(R),
    Ring(&'a mut [u8]),
    Done,
}

/// A channel receive in flight; the tensor is exclusively borrowed until it completes.
pub struct ChannelReceive<'a, C: Comm> {
    comm: &'a C,
    channel: &'a Channel,
    pending: Pending<'a, C::Request>,
}

impl<C: Comm> ChannelReceive<'_, C> {
    /// Waits and checks that exactly the tensor's bytes arrived.
    #[inline]
    pub fn wait(mut self) -> Result<(), P2pError> {
        self.complete()
    }

    fn complete(&mut self) -> Result<(), P2pError> {
        match std::mem::replace(&mut self.pending, Pending::Done) {
            Pending::Mpi(req) => {
                let done = self.comm.wait(req).map_err(P2pError::from)?;
                self.channel.check_length(self.comm.rank(), done)
            }
            Pending::Ring(buf) => self.channel.receive_now(self.comm, buf),
            Pending::Done => Ok(()),
        }
    }
}

impl<C: Comm> Drop for ChannelReceive<'_, C> {
    /// Completes the receive (the stream stays in step, and MPI never writes into a tensor
    /// that is gone).
    fn drop(&mut self) {
        let _ = self.complete();
    }
}

#[cfg(test)]
mod tests {
    use super::super::local::LocalComm;
    use super::*;
    use crate::tensor::DType;

    #[test]
    fn payloads_cross_without_headers_and_arrive_intact() {
        for carrier in [Carrier::SharedMemory, Carrier::Mpi] {
            payloads_cross_over(carrier);
        }
    }

    fn payloads_cross_over(carrier: Carrier) {
        let out = LocalComm::run(2, |c| {
            let peer = 1 - c.rank();
            let mut t = Tensor::from_slice(&[2], &[c.rank() as f64, 7.5])
                .unwrap()
                .named("loss");
            let ch = Channel::open_over(&c, &t, peer, 3, carrier).unwrap();
            assert_eq!(ch.carrier(), carrier);
            let mut seen = Vec::new();
            for step in 0..3 {
                if c.rank() == 0 {
                    t.as_mut_slice::<f64>().unwrap()[0] = step as f64;
                    ch.send(&c, &t).unwrap();
                    let r = ch.immediate_receive_into(&c, &mut t).unwrap();
                    r.wait().unwrap();
                } else {
                    ch.receive_into(&c, &mut t).unwrap();
                    t.as_mut_slice::<f64>().unwrap()[1] += 1.0;
                    ch.immediate_send(&c, &t).unwrap().wait().unwrap();
                }
                seen.push(t.as_slice::<f64>().unwrap().to_vec());
            }
            seen
        });
        assert_eq!(out[0], vec![vec![0., 8.5], vec![1., 9.5], vec![2., 10.5]]);
    }

    #[test]
    fn opening_for_another_tensor_names_both_sides_on_both_ranks() {
        let out = LocalComm::run(2, |c| {
            let t = if c.rank() == 0 {
                Tensor::zeros(DType::F32, &[4]).unwrap().named("grad/w")
            } else {
                Tensor::zeros(DType::I64, &[2, 2]).unwrap().named("grad/w")
            };
            Channel::open(&c, &t, 1 - c.rank(), 0)
                .unwrap_err()
                .to_string()
        });
        assert_eq!(
            out,
            vec![
                "rank 0: from rank 1: received 'grad/w' i64[2,2] but expected 'grad/w' f32[4] (opening a channel)",
                "rank 1: from rank 0: received 'grad/w' f32[4] but expected 'grad/w' i64[2,2] (opening a channel)",
            ]
        );
    }

    #[test]
    fn another_tensor_or_length_on_an_open_channel_is_an_error() {
        let out = LocalComm::run(2, |c| {
            let t = Tensor::zeros(DType::F32, &[4]).unwrap().named("x");
            let ch = Channel::open_over(&c, &t, 1 - c.rank(), 5, Carrier::Mpi).unwrap();
            if c.rank() == 0 {
                let other = Tensor::zeros(DType::F32, &[3]).unwrap().named("x");
                let e = ch.send(&c, &other).unwrap_err().to_string();
                // A stray 3-byte message on the channel's tag.
                super::super::comm::send(&c, &[1, 2, 3], 1, 5).unwrap();
                e
            } else {
                let mut t = t;
                ch.receive_into(&c, &mut t).unwrap_err().to_string()
            }
        });
        assert_eq!(
            out,
            vec![
                "rank 0: channel with rank 1 (tag 5) was opened for 'x' f32[4], not 'x' f32[3]",
                "rank 1: from rank 0: received 3 bytes but expected 'x' f32[4] (16 bytes) on the channel",
            ]
        );
    }

    fn step(k: usize, rank: usize) -> Tensor {
        Tensor::from_slice(&[2], &[k as i64, rank as i64])
            .unwrap()
            .named("step")
    }

    #[test]
    fn a_ring_keeps_the_order_when_messages_outrun_it_and_go_by_mpi() {
        // 200 messages each way before either side receives one: the ring holds 64, the
        // rest go by MPI; then windows and immediate requests, which complete at once
        // (sends) or when waited on (receives).
        let out = LocalComm::run(2, |c| {
            let (me, peer) = (c.rank(), 1 - c.rank());
            let mut t = step(0, me);
            let ch = Channel::open(&c, &t, peer, 6).unwrap();
            assert_eq!(ch.carrier(), Carrier::SharedMemory);
            for k in 0..200 {
                ch.send(&c, &step(k, me)).unwrap();
            }
            let mut got = Vec::new();
            for _ in 0..200 {
                ch.receive_into(&c, &mut t).unwrap();
                got.push(t.as_slice::<i64>().unwrap().to_vec());
            }
            let sent: Vec<Tensor> = (200..300).map(|k| step(k, me)).collect();
            let mut sends = Sends::new(&c);
            for s in &sent {
                ch.immediate_send_in(&mut sends, s).unwrap();
            }
            let mut window: Vec<Tensor> = (0..100).map(|_| step(0, 9)).collect();
            let mut receives = Receives::new(&c);
            for w in window.iter_mut() {
                ch.immediate_receive_in(&mut receives, w).unwrap();
            }
            receives.wait_all().unwrap();
            sends.wait_all().unwrap();
            got.extend(window.iter().map(|w| w.as_slice::<i64>().unwrap().to_vec()));
            let last = step(300, me);
            let s = ch.immediate_send(&c, &last).unwrap();
            ch.immediate_receive_into(&c, &mut t)
                .unwrap()
                .wait()
                .unwrap();
            s.wait().unwrap();
            got.push(t.as_slice::<i64>().unwrap().to_vec());
            got
        });
        for (me, got) in out.iter().enumerate() {
            let want: Vec<Vec<i64>> = (0..301).map(|k| vec![k, 1 - me as i64]).collect();
            assert_eq!(*got, want, "rank {me}");
        }
    }

    #[test]
    fn rings_only_where_both_ranks_allow_them() {
        let out = LocalComm::run(2, |c| {
            let t = step(0, 0);
            let mpi_only = if c.rank() == 1 {
                Carrier::Mpi
            } else {
                Carrier::SharedMemory
            };
            let one = Channel::open_over(&c, &t, 1 - c.rank(), 1, mpi_only).unwrap();
            let big = Tensor::zeros(DType::U8, &[ring::MAX_BYTES + 1]).unwrap();
            let two = Channel::open(&c, &big, 1 - c.rank(), 2).unwrap();
            let small = Tensor::zeros(DType::U8, &[ring::MAX_BYTES]).unwrap();
            let three = Channel::open(&c, &small, 1 - c.rank(), 3).unwrap();
            [one.carrier(), two.carrier(), three.carrier()]
        });
        let want = [Carrier::Mpi, Carrier::Mpi, Carrier::SharedMemory];
        assert_eq!(out, vec![want, want]);
    }

    #[test]
    fn ranks_of_two_nodes_stay_on_mpi_and_a_ring_receive_waits_no_longer_than_mpi_would() {
        let out = LocalComm::run_on_nodes(&[0, 1], |c| {
            let t = step(0, 0);
            Channel::open(&c, &t, 1 - c.rank(), 1).unwrap().carrier()
        });
        assert_eq!(out, vec![Carrier::Mpi, Carrier::Mpi]);
        // In-process, as long as a receive of the communicator would wait.
        let limit = std::time::Duration::from_millis(200);
        let errors = LocalComm::run_with_timeout(2, limit, |c| {
            let mut t = step(0, 0);
            let ch = Channel::open(&c, &t, 1 - c.rank(), 4).unwrap();
            assert_eq!(ch.carrier(), Carrier::SharedMemory);
            match c.rank() {
                0 => String::new(),
                _ => ch.receive_into(&c, &mut t).unwrap_err().to_string(),
            }
        });
        assert_eq!(
            errors[1],
            "rank 1: no message from rank 0 (tag 4) within 0 s"
        );
    }
}
