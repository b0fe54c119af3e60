//! Tensors between two ranks, or two tasks of the cluster.
//!
//! One message per tensor, straight from its memory (`MPI_Isend` of the header and payload
//! that lie contiguous in the tensor, see [`crate::tensor`]), received straight into the
//! destination tensor (`MPI_Irecv`) and checked there: a tensor of another dtype, shape or
//! name is an error naming both sides, and a longer message is cut at the receiver's
//! buffer end, never written past it.
//!
//! Naming follows rsmpi: `send`/`receive_into` block; `immediate_send` and
//! `immediate_receive_into` return requests, so several tensors can be in flight at once.
//! A request that is dropped without `wait` waits in its destructor: the tensor it borrows
//! is never freed or reused while MPI may still touch it.

use std::collections::BTreeMap;

use super::comm::{Comm, TransportError};
use crate::cluster::{Layout, TaskId};
use crate::tensor::{Tensor, TensorError};

/// Tags at or above this are reserved for collectives.
pub const MAX_USER_TAG: i32 = (1 << 24) - 1;

/// Errors from point-to-point tensor transfers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum P2pError {
    #[error("{0}")]
    Transport(#[from] TransportError),
    #[error("rank {rank}: from rank {peer}: {source}")]
    Tensor {
        rank: usize,
        peer: usize,
        source: TensorError,
    },
    #[error("task {0} is not in the cluster")]
    UnknownTask(TaskId),
    #[error("tag {0} is out of range 0..={MAX_USER_TAG}")]
    BadTag(i32),
    #[error(
        "rank {rank}: channel with rank {peer} (tag {tag}) was opened for {opened}, not {given}"
    )]
    Channel {
        rank: usize,
        peer: usize,
        tag: i32,
        opened: String,
        given: String,
    },
}

/// A peer: a rank, or a task of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    Rank(usize),
    Task(TaskId),
}

impl From<usize> for Peer {
    fn from(r: usize) -> Self {
        Peer::Rank(r)
    }
}

impl From<TaskId> for Peer {
    fn from(t: TaskId) -> Self {
        Peer::Task(t)
    }
}

/// Task-to-rank lookup, from the cluster layout.
#[derive(Debug, Clone, Default)]
pub struct Tasks {
    ranks: BTreeMap<TaskId, usize>,
}

impl Tasks {
    pub fn from_layout(layout: &Layout) -> Tasks {
        Tasks {
            ranks: layout
                .ranks
                .iter()
                .filter_map(|r| r.rank.map(|rank| (r.task.clone(), rank)))
                .collect(),
        }
    }

    pub fn rank(&self, peer: &Peer) -> Result<usize, P2pError> {
        match peer {
            Peer::Rank(r) => Ok(*r),
            Peer::Task(t) => self
                .ranks
                .get(t)
                .copied()
                .ok_or_else(|| P2pError::UnknownTask(t.clone())),
        }
    }
}

pub(crate) fn check_tag(tag: i32) -> Result<(), P2pError> {
    if (0..=MAX_USER_TAG).contains(&tag) {
        Ok(())
    } else {
        Err(P2pError::BadTag(tag))
    }
}

/// A send in flight; the tensor stays borrowed until it completes.
pub struct SendRequest<'a, C: Comm> {
    comm: &'a C,
    req: Option<C::Request>,
    _tensor: std::marker::PhantomData<&'a Tensor>,
}

impl<C: Comm> SendRequest<'_, C> {
    pub fn wait(mut self) -> Result<(), P2pError> {
        let req = self.req.take().expect("not yet waited");
        self.comm.wait(req)?;
        Ok(())
    }
}

impl<C: Comm> Drop for SendRequest<'_, C> {
    fn drop(&mut self) {
        if let Some(r) = self.req.take() {
            let _ = self.comm.wait(r);
        }
    }
}

/// A receive in flight; the tensor is exclusively borrowed until it completes.
pub struct RecvRequest<'a, C: Comm> {
    comm: &'a C,
    req: Option<C::Request>,
    tensor: &'a mut Tensor,
    peer: usize,
}

impl<C: Comm> RecvRequest<'_, C> {
    /// Waits and checks what arrived.
    pub fn wait(mut self) -> Result<(), P2pError> {
        let req = self.req.take().expect("not yet waited");
        let done = self.comm.wait(req)?;
        self.tensor
            .check_received(done.count, done.truncated)
            .map_err(|source| P2pError::Tensor {
                rank: self.comm.rank(),
                peer: done.source,
                source,
            })
    }

    /// The rank this receive listens to.
    pub fn peer(&self) -> usize {
        self.peer
    }
}

impl<C: Comm> Drop for RecvRequest<'_, C> {
    fn drop(&mut self) {
        if let Some(r) = self.req.take() {
            let _ = self.comm.wait(r);
        }
    }
}

/// Starts sending `t` to rank `dst` (`MPI_Isend`).
pub fn immediate_send<'a, C: Comm>(
    c: &'a C,
    t: &'a Tensor,
    dst: usize,
    tag: i32,
) -> Result<SendRequest<'a, C>, P2pError> {
    check_tag(tag)?;
    immediate_send_bytes(c, t.wire(), dst, tag)
}

/// Starts sending bytes of a tensor (`MPI_Isend`): its wire message here, its payload alone
/// on a [`super::channel::Channel`].
pub(crate) fn immediate_send_bytes<'a, C: Comm>(
    c: &'a C,
    bytes: &'a [u8],
    dst: usize,
    tag: i32,
) -> Result<SendRequest<'a, C>, P2pError> {
    // SAFETY: the request borrows the bytes for 'a, so they stay valid and unmodified until
    // it is waited on (by `wait` or by the destructor).
    let req = unsafe { c.isend(bytes.as_ptr(), bytes.len(), dst, tag)? };
    Ok(SendRequest {
        comm: c,
        req: Some(req),
        _tensor: std::marker::PhantomData,
    })
}

/// Starts receiving into `t` from rank `src` (`MPI_Irecv`).
pub fn immediate_receive_into<'a, C: Comm>(
    c: &'a C,
    t: &'a mut Tensor,
    src: usize,
    tag: i32,
) -> Result<RecvRequest<'a, C>, P2pError> {
    check_tag(tag)?;
    let region = t.receive_region();
    // SAFETY: the request holds `t` mutably for 'a, so nothing else touches the region
    // until it is waited on (by `wait` or by the destructor).
    let req = unsafe { c.irecv(region.as_mut_ptr(), region.len(), src, tag)? };
    Ok(RecvRequest {
        comm: c,
        req: Some(req),
        tensor: t,
        peer: src,
    })
}

/// Sends `t` to rank `dst` (`MPI_Send`).
pub fn send<C: Comm>(c: &C, t: &Tensor, dst: usize, tag: i32) -> Result<(), P2pError> {
    check_tag(tag)?;
    c.send_blocking(t.wire(), dst, tag)?;
    Ok(())
}

/// Receives into `t` from rank `src` (`MPI_Recv`) and checks it.
pub fn receive_into<C: Comm>(c: &C, t: &mut Tensor, src: usize, tag: i32) -> Result<(), P2pError> {
    check_tag(tag)?;
    let done = c.recv_blocking(t.receive_region(), src, tag)?;
    t.check_received(done.count, done.truncated)
        .map_err(|source| P2pError::Tensor {
            rank: c.rank(),
            peer: done.source,
            source,
        })
}

/// Sends to a task or rank of the cluster.
pub fn send_to<C: Comm>(
    c: &C,
    tasks: &Tasks,
    t: &Tensor,
    to: &Peer,
    tag: i32,
) -> Result<(), P2pError> {
    send(c, t, tasks.rank(to)?, tag)
}

/// Receives from a task or rank of the cluster.
pub fn receive_from<C: Comm>(
    c: &C,
    tasks: &Tasks,
    t: &mut Tensor,
    from: &Peer,
    tag: i32,
) -> Result<(), P2pError> {
    receive_into(c, t, tasks.rank(from)?, tag)
}

#[cfg(test)]
mod tests {
    use super::super::local::LocalComm;
    use super::*;
    use crate::tensor::DType;

    #[test]
    fn tensors_arrive_intact_and_in_flight_together() {
        let out = LocalComm::run(2, |c| {
            if c.rank() == 0 {
                let a = Tensor::from_slice(&[3], &[1f32, 2., 3.])
                    .unwrap()
                    .named("a");
                let b = Tensor::from_slice(&[2, 2], &[5i64, 6, 7, 8])
                    .unwrap()
                    .named("b");
                let ra = immediate_send(&c, &a, 1, 1).unwrap();
                let rb = immediate_send(&c, &b, 1, 2).unwrap();
                rb.wait().unwrap();
                ra.wait().unwrap();
                (vec![], vec![])
            } else {
                let mut a = Tensor::zeros(DType::F32, &[3]).unwrap().named("a");
                let mut b = Tensor::zeros(DType::I64, &[2, 2]).unwrap().named("b");
                // Posted in the opposite order: tags keep them apart.
                let rb = immediate_receive_into(&c, &mut b, 0, 2).unwrap();
                let ra = immediate_receive_into(&c, &mut a, 0, 1).unwrap();
                ra.wait().unwrap();
                rb.wait().unwrap();
                (
                    a.as_slice::<f32>().unwrap().to_vec(),
                    b.as_slice::<i64>().unwrap().to_vec(),
                )
            }
        });
        assert_eq!(out[1], (vec![1., 2., 3.], vec![5, 6, 7, 8]));
    }

    #[test]
    fn mismatches_name_both_sides() {
        let out = LocalComm::run(2, |c| {
            if c.rank() == 0 {
                let a = Tensor::from_slice(&[4], &[1f32; 4])
                    .unwrap()
                    .named("grad/w");
                send(&c, &a, 1, 0).unwrap();
                send(&c, &a, 1, 0).unwrap();
                String::new()
            } else {
                let mut wrong_shape = Tensor::zeros(DType::F32, &[3]).unwrap().named("grad/w");
                let e1 = receive_into(&c, &mut wrong_shape, 0, 0)
                    .unwrap_err()
                    .to_string();
                let mut wrong_name = Tensor::zeros(DType::F32, &[4]).unwrap().named("grad/b");
                let e2 = receive_into(&c, &mut wrong_name, 0, 0)
                    .unwrap_err()
                    .to_string();
                format!("{e1}\n{e2}")
            }
        });
        assert_eq!(
            out[1],
            "rank 1: from rank 0: received 'grad/w' f32[4] but expected 'grad/w' f32[3]\n\
             rank 1: from rank 0: received 'grad/w' f32[4] but expected 'grad/b' f32[4]"
        );
    }

    #[test]
    fn tasks_and_tags() {
        let opts = crate::cluster::MappingOptions {
            ps: 1,
            ..Default::default()
        };
        let layout = Layout::single_host(3, &opts).unwrap();
        let t = Tasks::from_layout(&layout);
        assert_eq!(t.rank(&Peer::Task(TaskId::new("worker", 1))).unwrap(), 2);
        assert_eq!(t.rank(&Peer::Rank(7)).unwrap(), 7);
        assert!(matches!(
            t.rank(&Peer::Task(TaskId::new("ps", 3))),
            Err(P2pError::UnknownTask(_))
        ));
        let c = LocalComm::create(1, std::time::Duration::from_millis(10));
        let x = Tensor::zeros(DType::U8, &[1]).unwrap();
        assert_eq!(
            send(&c[0], &x, 0, 1 << 24).unwrap_err(),
            P2pError::BadTag(1 << 24)
        );
    }
}
