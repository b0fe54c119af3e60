//! Activations and their gradients between consecutive stages of a replica.
//!
//! They travel as tensors over the p2p layer ([`crate::transport::p2p`]), one link per
//! (neighbour, direction): a tensor's header crosses only when its shape changes (the
//! last micro-batch, an evaluation chunk), and between two stages of one node small
//! tensors go through a ring in shared memory.
//!
//! Sends never block a stage: each copies its values into a tensor of the link's pool and
//! starts a send that owns it, so a stage that sends and then waits for its neighbour
//! cannot deadlock with one doing the same the other way (1F1B's steady state). The
//! tensors come back as their sends complete (checked before each receive) and all of
//! them at the end of a step. Receives block, and check that exactly the expected tensor
//! arrived: a neighbour that sent another size (another model, another batch) is an error
//! naming both stages, both shapes and the micro-batch.

use crate::observe::stall::{self, Wait};
use crate::tensor::{DType, Tensor, TensorError};
use crate::transport::p2p::{self, OwnedSend, P2pError};
use crate::transport::Comm;

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
    Transport(#[from] P2pError),
    #[error("stage {stage}: stage {peer} sent {what} {theirs} for micro-batch {mb}, {ours} expected (do the ranks run the same model, batch and --micro-batches?)")]
    Size {
        stage: usize,
        peer: usize,
        what: &'static str,
        mb: usize,
        theirs: String,
        ours: String,
    },
}

impl From<crate::transport::TransportError> for LinkError {
    fn from(e: crate::transport::TransportError) -> Self {
        LinkError::Transport(e.into())
    }
}

/// One replica's stage-to-stage messages, on a communicator whose rank `k` is stage `k`.
pub struct Link<'c, C: Comm> {
    comm: &'c C,
    /// Sends in flight, each holding its tensor.
    pending: Vec<OwnedSend<'c, C>>,
    /// Tensors to send from, back from completed sends.
    spare: Vec<Tensor>,
    /// Tensors to receive into, one per direction and length: the same tensor on a link
    /// step after step is a repeat, its payload alone on the wire.
    inbound: Vec<Tensor>,
    /// The step the messages belong to (stall reports name it).
    pub step: u64,
}

/// Takes from `pool` a tensor of `n` floats named `name`, or makes one.
fn take_from(pool: &mut Vec<Tensor>, n: usize, name: &str) -> Tensor {
    match pool.iter().position(|t| t.numel() == n && t.name() == name) {
        Some(i) => pool.swap_remove(i),
        None => Tensor::zeros(DType::F32, &[n])
            .expect("a tensor of one dimension")
            .named(name),
    }
}

impl<'c, C: Comm> Link<'c, C> {
    pub fn new(comm: &'c C) -> Link<'c, C> {
        Link {
            comm,
            pending: Vec::new(),
            spare: Vec::new(),
            inbound: Vec::new(),
            step: 0,
        }
    }

    /// Starts sending `values` to stage `to`.
    pub fn send(&mut self, values: &[f32], to: usize, dir: Direction) -> Result<(), LinkError> {
        let mut t = take_from(&mut self.spare, values.len(), dir.name());
        t.as_mut_slice::<f32>()
            .expect("f32")
            .copy_from_slice(values);
        let send = p2p::immediate_send_owned(self.comm, t, to, dir.tag())?;
        self.pending.push(send);
        Ok(())
    }

    /// Takes back the tensors of completed sends.
    fn reap(&mut self) -> Result<(), LinkError> {
        let mut i = 0;
        while i < self.pending.len() {
            match self.pending[i].test()? {
                Some(t) => {
                    self.pending.swap_remove(i);
                    self.spare.push(t);
                }
                None => i += 1,
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
        let mut t = take_from(&mut self.inbound, into.len(), dir.name());
        let step = self.step;
        let received = {
            let _wait = stall::wait(|| Wait {
                op: "pipeline receive",
                step,
                what: Some(dir.name().into()),
                peer: Some(format!("stage {from}").into()),
                bytes: 4 * into.len() as u64,
            });
            p2p::receive_into(self.comm, &mut t, from, dir.tag())
        };
        if received.is_ok() {
            into.copy_from_slice(t.as_slice::<f32>().expect("f32"));
        }
        self.inbound.push(t);
        received.map_err(|e| self.named(e, from, dir, mb))
    }

    /// A receive's error, a neighbour's tensor of another shape named as the stages see it.
    fn named(&self, e: P2pError, from: usize, dir: Direction, mb: usize) -> LinkError {
        let size = |theirs: String, ours: String| LinkError::Size {
            stage: self.comm.rank(),
            peer: from,
            what: dir.name(),
            mb,
            theirs,
            ours,
        };
        match e {
            P2pError::Tensor {
                source: TensorError::Mismatch { ours, theirs },
                ..
            } => size(theirs, ours),
            P2pError::Tensor {
                source: TensorError::NotATensor { got },
                ..
            } => size(format!("{got} bytes that are no tensor"), dir.name().into()),
            e => LinkError::Transport(e),
        }
    }

    /// Waits for every send in flight (the end of a step).
    pub fn flush(&mut self) -> Result<(), LinkError> {
        let mut first = Ok(());
        for send in std::mem::take(&mut self.pending) {
            match send.wait() {
                Ok(t) => self.spare.push(t),
                Err(e) => first = first.and(Err(e)),
            }
        }
        Ok(first?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::local::LocalComm;

    #[test]
    fn values_arrive_and_a_neighbour_of_another_shape_is_named() {
        let out = LocalComm::run(2, |c| -> Result<Vec<f32>, LinkError> {
            let mut link = Link::new(&c);
            if c.rank() == 0 {
                for mb in 0..3 {
                    let values: Vec<f32> = (0..4).map(|i| (10 * mb + i) as f32).collect();
                    link.send(&values, 1, Direction::Activations)?;
                }
                link.send(&[1.0; 6], 1, Direction::Activations)?;
                link.flush()?;
                return Ok(Vec::new());
            }
            let mut got = Vec::new();
            for mb in 0..4 {
                let mut into = [0.0f32; 4];
                link.receive(&mut into, 0, Direction::Activations, mb)?;
                got.extend(into);
            }
            Ok(got)
        });
        let Err(e) = &out[1] else {
            panic!("a tensor of 6 floats was received as 4: {out:?}")
        };
        assert_eq!(
            e.to_string(),
            "stage 1: stage 0 sent activations 'activations' f32[6] for micro-batch 3, \
             'activations' f32[4] expected (do the ranks run the same model, batch and \
             --micro-batches?)"
        );
        assert!(out[0].is_ok());
    }

    #[test]
    fn tensors_are_reused_once_their_sends_complete() {
        LocalComm::run(2, |c| {
            let mut link = Link::new(&c);
            for step in 0..3 {
                if c.rank() == 0 {
                    link.send(&[step as f32; 5], 1, Direction::Gradients)
                        .unwrap();
                    link.flush().unwrap();
                } else {
                    let mut into = [0.0f32; 5];
                    link.receive(&mut into, 0, Direction::Gradients, 0).unwrap();
                    assert_eq!(into, [step as f32; 5]);
                }
            }
            assert!(link.spare.len() <= 1 && link.inbound.len() <= 1);
        });
    }
}
