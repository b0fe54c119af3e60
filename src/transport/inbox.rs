//! Receives posted ahead on a channel: a stream of one tensor lands as it arrives and moves
//! into the caller's tensor without a copy.
//!
//! A receive posted after its message arrived takes MPI's unexpected-message path: the
//! library keeps the message in a buffer of its own and copies it again once the receive
//! is posted. A receiver that takes a stream from one peer one message at a time (a window
//! of small messages, activations every micro-batch while it computes) pays that on nearly
//! every message. An [`Inbox`] keeps `depth` receives of its [`Channel`] posted into
//! tensors of its own; [`Inbox::receive_into`] waits for the oldest and exchanges its
//! storage with the caller's tensor ([`Tensor::swap_storage`]: no byte copied). The
//! caller's old buffer takes the next receive at the start of the following call, while
//! the caller's reply is on its way, not between a message's arrival and that reply, so
//! `depth - 1` receives stay posted between calls. MPI matches receives of one (peer, tag)
//! in the order they were posted, so messages come out in the order they were sent.
//!
//! Choosing `depth`: enough for the messages that arrive while the receiver is busy (a
//! sender's window), within a core's cache in bytes. Each message lands in the next of the
//! `depth` buffers (and the caller's), so `depth x size` is memory the stream cycles
//! through; beyond the cache every message lands in cold memory, and large messages go by
//! rendezvous, where a receive posted late costs little (`mpiflow bench --path inbox`
//! measures it: `benches/results/2026-11-26-inbox.md`). Whether it pays depends on the MPI
//! library: Open MPI's unexpected-message path costs a copy and a match per message, which
//! receives posted ahead save; under MPICH (`ch4:ucx`) that path is cheap and the request
//! an inbox adds per message is not (`benches/results/2026-11-26-mpich.md`). Measure
//! under the MPI the job runs on.
//!
//! The inbox owns its channel's receiving side while it is open: every message the peer
//! sends on the channel goes through it. [`Inbox::close`] withdraws the receives posted
//! ahead (`MPI_Cancel`); a message that had arrived and was never taken is an error naming
//! the channel and the count, so nothing the peer sent is dropped silently (a message still
//! on its way, matched by no receive yet, stays with MPI for the next receive on the tag).
//! Dropping an inbox withdraws them too, without the check.
//!
//! A channel on rings (`super::ring`) needs no receives posted ahead: its messages wait
//! in the ring, which is what an inbox is for. An inbox of such a channel posts none, each
//! [`Inbox::receive_into`] is the channel's, and nothing can be left untaken at close (what
//! the ring still holds stays there for the channel's next receive).

use super::channel::{Carrier, Channel};
use super::comm::Comm;
use super::p2p::{ExactLength, P2pError};
use crate::tensor::Tensor;

/// One receive posted ahead: the tensor it lands in and its request.
struct Slot<R> {
    tensor: Tensor,
    /// `None` only after a failed post: the inbox is then broken and says so.
    req: Option<R>,
}

/// `depth` receives posted ahead on a channel (see the module's documentation).
pub struct Inbox<'c, C: Comm> {
    comm: &'c C,
    channel: Channel,
    slots: Vec<Slot<C::Request>>,
    /// The slot the next message lands in.
    next: usize,
    /// The slot the last call took its message from, posted again by the next call.
    spent: Option<usize>,
}

impl<'c, C: Comm> Inbox<'c, C> {
    /// Posts `depth` (at least 2) receives of `channel` into tensors like `like`, which
    /// must be the channel's tensor (none on rings).
    pub fn open(
        comm: &'c C,
        channel: &Channel,
        like: &Tensor,
        depth: usize,
    ) -> Result<Inbox<'c, C>, P2pError> {
        channel.check_tensor(comm, like)?;
        let depth = match channel.carrier() {
            Carrier::SharedMemory => 0,
            Carrier::Mpi => depth.max(2),
        };
        let mut inbox = Inbox {
            comm,
            channel: channel.clone(),
            slots: Vec::with_capacity(depth),
            next: 0,
            spent: None,
        };
        for _ in 0..depth {
            inbox.slots.push(Slot {
                tensor: like.clone(),
                req: None,
            });
            let last = inbox.slots.len() - 1;
            inbox.post(last)?;
        }
        Ok(inbox)
    }

    /// Receives posted ahead (0 on rings).
    pub fn depth(&self) -> usize {
        self.slots.len()
    }

    /// The channel this inbox receives on.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Posts slot `i`'s receive into its tensor's payload and the room behind it, so that
    /// a message up to [`crate::tensor::TAIL_ROOM`] bytes longer shows by its length (a
    /// longer one as a truncation).
    #[inline]
    fn post(&mut self, i: usize) -> Result<(), P2pError> {
        let (peer, tag) = (self.channel.peer(), self.channel.tag());
        let slot = &mut self.slots[i];
        let b = slot.tensor.payload_region();
        // SAFETY: the slot's tensor is owned by the inbox and its buffer is neither read,
        // written, moved to another tensor nor freed until this request completes: only
        // `receive_into` (after waiting for it), `close` and the destructor (which cancel
        // and wait for it) touch the slot again. A leaked inbox leaks the buffer too.
        slot.req = Some(unsafe { self.comm.irecv(b.as_mut_ptr(), b.len(), peer, tag)? });
        Ok(())
    }

    /// Waits for the channel's next message and moves it into `t` (the channel's tensor);
    /// anything but exactly its bytes is an error naming the channel, after which the
    /// inbox still receives the messages that follow.
    #[inline]
    pub fn receive_into(&mut self, t: &mut Tensor) -> Result<(), P2pError> {
        if self.slots.is_empty() {
            return self.channel.receive_into(self.comm, t);
        }
        self.channel.check_tensor(self.comm, t)?;
        if let Some(s) = self.spent.take() {
            self.post(s)?;
        }
        let i = self.next;
        self.next = if i + 1 == self.slots.len() { 0 } else { i + 1 };
        let Some(req) = self.slots[i].req.take() else {
            return Err(self.broken());
        };
        self.spent = Some(i);
        let done = self.comm.wait(req)?;
        self.channel.check_length(self.comm.rank(), done)?;
        let swapped = t.swap_storage(&mut self.slots[i].tensor);
        debug_assert!(swapped, "the channel checked both tensors' signature");
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn broken(&self) -> P2pError {
        P2pError::InboxBroken {
            rank: self.comm.rank(),
            peer: self.channel.peer(),
            tag: self.channel.tag(),
        }
    }

    /// Withdraws the receives posted ahead; a message that had arrived and was never
    /// taken is an error (every receive is withdrawn or completed either way).
    pub fn close(mut self) -> Result<(), P2pError> {
        let (untaken, failed) = self.withdraw();
        if let Some(e) = failed {
            return Err(e);
        }
        if untaken > 0 {
            return Err(P2pError::Untaken {
                rank: self.comm.rank(),
                peer: self.channel.peer(),
                tag: self.channel.tag(),
                count: untaken,
            });
        }
        Ok(())
    }

    /// Cancels every receive still posted, oldest first: the messages that had arrived
    /// anyway, and the first error.
    fn withdraw(&mut self) -> (usize, Option<P2pError>) {
        let (mut untaken, mut failed) = (0, None);
        let n = self.slots.len();
        for k in 0..n {
            let i = (self.next + k) % n;
            if let Some(req) = self.slots[i].req.take() {
                match self.comm.cancel_receive(req) {
                    Ok(Some(_)) => untaken += 1,
                    Ok(None) => {}
                    Err(e) => {
                        failed.get_or_insert(P2pError::from(e));
                    }
                }
            }
        }
        (untaken, failed)
    }
}

impl<C: Comm> Drop for Inbox<'_, C> {
    fn drop(&mut self) {
        let _ = self.withdraw();
    }
}

#[cfg(test)]
mod tests {
    use super::super::local::LocalComm;
    use super::super::p2p;
    use super::*;
    use crate::tensor::DType;

    fn tensor(v: f32) -> Tensor {
        Tensor::from_slice(&[3], &[v, v + 1.0, v + 2.0])
            .unwrap()
            .named("act")
    }

    #[test]
    fn a_stream_arrives_in_order_into_the_callers_tensor() {
        let out = LocalComm::run(2, |c| {
            let mut t = tensor(0.0);
            let ch = Channel::open_over(&c, &t, 1 - c.rank(), 7, Carrier::Mpi).unwrap();
            if c.rank() == 0 {
                for step in 0..10 {
                    t = tensor(step as f32 * 10.0);
                    ch.send(&c, &t).unwrap();
                }
                return Vec::new();
            }
            let mut inbox = Inbox::open(&c, &ch, &t, 3).unwrap();
            assert_eq!(inbox.depth(), 3);
            let mut seen = Vec::new();
            for _ in 0..10 {
                inbox.receive_into(&mut t).unwrap();
                seen.push(t.as_slice::<f32>().unwrap().to_vec());
                // The tensor is the caller's to change; the next message replaces it.
                t.as_mut_slice::<f32>().unwrap()[0] = -1.0;
            }
            inbox.close().unwrap();
            // The header travels with the storage: the tensor still sends as itself.
            assert_eq!(t.describe(), "'act' f32[3]");
            seen
        });
        let want: Vec<Vec<f32>> = (0..10)
            .map(|s| {
                let v = s as f32 * 10.0;
                vec![v, v + 1.0, v + 2.0]
            })
            .collect();
        assert_eq!(out[1], want);
    }

    #[test]
    fn another_tensor_or_length_is_an_error_and_the_stream_goes_on() {
        let out = LocalComm::run(2, |c| {
            let mut t = tensor(1.0);
            let ch = Channel::open_over(&c, &t, 1 - c.rank(), 4, Carrier::Mpi).unwrap();
            if c.rank() == 0 {
                // Stray messages (shorter, longer, longer than the room behind the
                // payload), then a good one.
                for n in [5, 40, 500] {
                    super::super::comm::send(&c, &vec![9; n], 1, 4).unwrap();
                }
                ch.send(&c, &tensor(2.0)).unwrap();
                return vec![];
            }
            let mut inbox = Inbox::open(&c, &ch, &t, 2).unwrap();
            let mut other = Tensor::zeros(DType::F32, &[4]).unwrap().named("act");
            let mut errors = vec![inbox.receive_into(&mut other).unwrap_err().to_string()];
            for _ in 0..3 {
                errors.push(inbox.receive_into(&mut t).unwrap_err().to_string());
            }
            inbox.receive_into(&mut t).unwrap();
            assert_eq!(t.as_slice::<f32>().unwrap(), &[2.0, 3.0, 4.0]);
            errors
        });
        let expected = |got: &str| {
            format!("rank 1: from rank 0: received {got} but expected 'act' f32[3] (12 bytes) on the channel")
        };
        assert_eq!(
            out[1],
            vec![
                "rank 1: channel with rank 0 (tag 4) was opened for 'act' f32[3], not 'act' f32[4]"
                    .to_string(),
                expected("5 bytes"),
                expected("40 bytes"),
                expected("more than 12 bytes"),
            ]
        );
    }

    #[test]
    fn closing_with_messages_never_taken_says_how_many() {
        let out = LocalComm::run(2, |c| {
            let mut t = tensor(0.0);
            let ch = Channel::open_over(&c, &t, 1 - c.rank(), 9, Carrier::Mpi).unwrap();
            if c.rank() == 0 {
                for _ in 0..3 {
                    ch.send(&c, &t).unwrap();
                }
                p2p::send(&c, &t, 1, 10).unwrap();
                return String::new();
            }
            // The sender is done once its last message is here.
            p2p::receive_into(&c, &mut t, 0, 10).unwrap();
            let mut inbox = Inbox::open(&c, &ch, &t, 4).unwrap();
            inbox.receive_into(&mut t).unwrap();
            inbox.close().unwrap_err().to_string()
        });
        assert_eq!(
            out[1],
            "rank 1: closed the inbox of the channel with rank 0 (tag 9) with 2 messages that arrived and were never received"
        );
    }

    #[test]
    fn on_rings_an_inbox_posts_nothing_and_loses_nothing_at_close() {
        let out = LocalComm::run(2, |c| {
            let mut t = tensor(0.0);
            let ch = Channel::open(&c, &t, 1 - c.rank(), 7).unwrap();
            assert_eq!(ch.carrier(), Carrier::SharedMemory);
            if c.rank() == 0 {
                for step in 0..5 {
                    ch.send(&c, &tensor(step as f32)).unwrap();
                }
                return Vec::new();
            }
            let mut inbox = Inbox::open(&c, &ch, &t, 4).unwrap();
            assert_eq!(inbox.depth(), 0);
            let mut seen = Vec::new();
            for _ in 0..2 {
                inbox.receive_into(&mut t).unwrap();
                seen.push(t.as_slice::<f32>().unwrap()[0]);
            }
            // Three still in the ring: the close loses none, the channel takes them.
            inbox.close().unwrap();
            for _ in 0..3 {
                ch.receive_into(&c, &mut t).unwrap();
                seen.push(t.as_slice::<f32>().unwrap()[0]);
            }
            seen
        });
        assert_eq!(out[1], vec![0.0, 1.0, 2.0, 3.0, 4.0]);
    }
}
