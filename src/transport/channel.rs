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
//! A channel owns its (peer, tag): no other traffic between the two ranks may use that tag.

use super::comm::Comm;
use super::comm::Completion;
use super::p2p::{
    check_tag, immediate_send_bytes, ExactLength, P2pError, Receives, SendRequest, Sends,
};
use crate::tensor::{Tensor, TensorError};

/// A checked, header-free connection for one tensor signature between two ranks.
#[derive(Debug, Clone)]
pub struct Channel {
    peer: usize,
    tag: i32,
    signature: u64,
    nbytes: usize,
    describe: String,
}

impl Channel {
    /// Opens the channel with `peer` on `tag` for tensors like `t` (`MPI_Sendrecv` of the
    /// two headers). Both ranks call it; a peer that opened it for another tensor is an
    /// error on both, naming both sides.
    pub fn open<C: Comm>(c: &C, t: &Tensor, peer: usize, tag: i32) -> Result<Channel, P2pError> {
        check_tag(c, tag)?;
        let ours = t.wire_header();
        let mut theirs = [0u8; crate::tensor::HEADER_ROOM];
        let got = super::comm::sendrecv(c, ours, peer, &mut theirs, peer, tag)?;
        let ch = Channel {
            peer,
            tag,
            signature: t.signature(),
            nbytes: t.nbytes(),
            describe: t.describe(),
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
        Ok(ch)
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

    /// Sends `t`'s payload (`MPI_Send`).
    #[inline]
    pub fn send<C: Comm>(&self, c: &C, t: &Tensor) -> Result<(), P2pError> {
        self.check_tensor(c, t)?;
        c.send_blocking(t.bytes(), self.peer, self.tag)?;
        Ok(())
    }

    /// Receives into `t`'s payload (`MPI_Recv`); anything but exactly its bytes is an error.
    #[inline]
    pub fn receive_into<C: Comm>(&self, c: &C, t: &mut Tensor) -> Result<(), P2pError> {
        self.check_tensor(c, t)?;
        let done = c.recv_blocking(t.bytes_mut(), self.peer, self.tag)?;
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

    /// Starts sending `t`'s payload (`MPI_Isend`).
    #[inline]
    pub fn immediate_send<'a, C: Comm>(
        &self,
        c: &'a C,
        t: &'a Tensor,
    ) -> Result<SendRequest<'a, C>, P2pError> {
        self.check_tensor(c, t)?;
        immediate_send_bytes(c, t.bytes(), self.peer, self.tag)
    }

    /// Starts receiving into `t`'s payload (`MPI_Irecv`).
    #[inline]
    pub fn immediate_receive_into<'a, C: Comm>(
        &'a self,
        c: &'a C,
        t: &'a mut Tensor,
    ) -> Result<ChannelReceive<'a, C>, P2pError> {
        self.check_tensor(c, t)?;
        let b = t.bytes_mut();
        // SAFETY: the request holds `t` mutably for 'a, so nothing else touches the payload
        // until it is waited on (by `wait` or by the destructor).
        let req = unsafe { c.irecv(b.as_mut_ptr(), b.len(), self.peer, self.tag)? };
        Ok(ChannelReceive {
            comm: c,
            channel: self,
            req: Some(req),
            _tensor: std::marker::PhantomData,
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
        receives.receive_exact(t.bytes_mut(), self.peer, self.tag, self)
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

/// A channel receive in flight; the tensor is exclusively borrowed until it completes.
pub struct ChannelReceive<'a, C: Comm> {
    comm: &'a C,
    channel: &'a Channel,
    req: Option<C::Request>,
    _tensor: std::marker::PhantomData<&'a mut Tensor>,
}

impl<C: Comm> ChannelReceive<'_, C> {
    /// Waits and checks that exactly the tensor's bytes arrived.
    #[inline]
    pub fn wait(mut self) -> Result<(), P2pError> {
        let req = self.req.take().expect("not yet waited");
        let done = self.comm.wait(req).map_err(P2pError::from)?;
        self.channel.check_length(self.comm.rank(), done)
    }
}

impl<C: Comm> Drop for ChannelReceive<'_, C> {
    fn drop(&mut self) {
        if let Some(r) = self.req.take() {
            let _ = self.comm.wait(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::local::LocalComm;
    use super::*;
    use crate::tensor::DType;

    #[test]
    fn payloads_cross_without_headers_and_arrive_intact() {
        let out = LocalComm::run(2, |c| {
            let peer = 1 - c.rank();
            let mut t = Tensor::from_slice(&[2], &[c.rank() as f64, 7.5])
                .unwrap()
                .named("loss");
            let ch = Channel::open(&c, &t, peer, 3).unwrap();
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
            let ch = Channel::open(&c, &t, 1 - c.rank(), 5).unwrap();
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
}
