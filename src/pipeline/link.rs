//! Activations and their gradients between consecutive stages of a replica.
//!
//! Sends never block a stage: each copies its values into a buffer of the link's and
//! starts a non-blocking send, so a stage that sends and then waits for its neighbour
//! cannot deadlock with one doing the same the other way (1F1B's steady state). The
//! buffers come back as their sends complete (checked before each receive) and all of
//! them at the end of a step. Receives block, and check that exactly the expected values
//! arrived: a neighbour that sent another size (another model, another batch) is an error
//! naming both stages and the micro-batch.

use crate::observe::stall::{self, Wait};
use crate::train::ps::protocol::{f32_bytes, f32_bytes_mut};
use crate::transport::{Comm, TransportError};

/// Which way a message goes, and its tag on the replica's communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// A stage's output to the next stage.
    Activations,
    /// The gradient of a stage's input to the previous stage.
    Gradients,
    /// Evaluation: outputs forward with no backward pass.
    Inference,
    /// The final parameters, to the stage that writes them.
    Parameters,
}

impl Direction {
    fn tag(self) -> i32 {
        match self {
            Direction::Activations => 1,
            Direction::Gradients => 2,
            Direction::Inference => 3,
            Direction::Parameters => 4,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Direction::Activations => "activations",
            Direction::Gradients => "gradients",
            Direction::Inference => "evaluation activations",
            Direction::Parameters => "parameters",
        }
    }
}

/// Errors of moving values between stages.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    #[error("{0}")]
    Transport(#[from] TransportError),
    #[error("stage {stage}: stage {peer} sent {got} bytes of {what} for micro-batch {mb}, {want} expected (do the ranks run the same model, batch and --micro-batches?)")]
    Size {
        stage: usize,
        peer: usize,
        what: &'static str,
        mb: usize,
        got: String,
        want: usize,
    },
}

/// One replica's stage-to-stage messages, on a communicator whose rank `k` is stage `k`.
pub struct Link<'c, C: Comm> {
    comm: &'c C,
    /// Sends in flight, with the buffers they send from.
    pending: Vec<(C::Request, Vec<f32>)>,
    spare: Vec<Vec<f32>>,
    /// The step the messages belong to (stall reports name it).
    pub step: u64,
}

impl<'c, C: Comm> Link<'c, C> {
    pub fn new(comm: &'c C) -> Link<'c, C> {
        Link {
            comm,
            pending: Vec::new(),
            spare: Vec::new(),
            step: 0,
        }
    }

    /// This stage (its rank on the replica's communicator).
    pub fn stage(&self) -> usize {
        self.comm.rank()
    }

    /// Starts sending `values` to stage `to`.
    pub fn send(&mut self, values: &[f32], to: usize, dir: Direction) -> Result<(), LinkError> {
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(values);
        let bytes = f32_bytes(&buf);
        // SAFETY: the buffer moves into `pending` with the request (a Vec's heap block
        // does not move with it) and is neither touched nor dropped before the request is
        // waited on, in `reap` or `flush`.
        let req = unsafe {
            self.comm
                .isend(bytes.as_ptr(), bytes.len(), to, dir.tag())?
        };
        self.pending.push((req, buf));
        Ok(())
    }

    /// Takes back the buffers of completed sends.
    fn reap(&mut self) -> Result<(), LinkError> {
        let mut i = 0;
        while i < self.pending.len() {
            if self.comm.test(&mut self.pending[i].0)?.is_some() {
                let (_, buf) = self.pending.swap_remove(i);
                self.spare.push(buf);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Receives micro-batch `mb`'s `dir` values from stage `from` into `into`, which
    /// must fill exactly.
    pub fn receive(
        &mut self,
        into: &mut [f32],
        from: usize,
        dir: Direction,
        mb: usize,
    ) -> Result<(), LinkError> {
        self.reap()?;
        let want = 4 * into.len();
        let step = self.step;
        let _wait = stall::wait(|| Wait {
            op: "pipeline receive",
            step,
            what: Some(dir.name().into()),
            peer: Some(format!("stage {from}").into()),
            bytes: want as u64,
        });
        let done = {
            let bytes = f32_bytes_mut(into);
            self.comm.recv_blocking(bytes, from, dir.tag())?
        };
        if done.count != want || done.truncated() {
            return Err(LinkError::Size {
                stage: self.comm.rank(),
                peer: from,
                what: dir.name(),
                mb,
                got: if done.truncated() {
                    format!("more than {want}")
                } else {
                    done.count.to_string()
                },
                want,
            });
        }
        Ok(())
    }

    /// Waits for every send in flight (the end of a step).
    pub fn flush(&mut self) -> Result<(), LinkError> {
        let mut first = Ok(());
        for (req, buf) in self.pending.drain(..) {
            if let Err(e) = self.comm.wait(req) {
                first = first.and(Err(e));
            }
            self.spare.push(buf);
        }
        Ok(first?)
    }

    /// Bytes held in send buffers.
    pub fn buffer_bytes(&self) -> usize {
        let held = self.pending.iter().map(|(_, b)| b.capacity());
        4 * (held.sum::<usize>() + self.spare.iter().map(Vec::capacity).sum::<usize>())
    }
}

impl<C: Comm> Drop for Link<'_, C> {
    /// No buffer is freed while MPI may still read it, and nothing waits: a link dropped
    /// on an error (its neighbour may be gone) keeps the buffers of unfinished sends for
    /// the rest of the process.
    fn drop(&mut self) {
        for (mut req, buf) in self.pending.drain(..) {
            if !matches!(self.comm.test(&mut req), Ok(Some(_))) {
                std::mem::forget(req);
                std::mem::forget(buf);
            }
        }
    }
}
