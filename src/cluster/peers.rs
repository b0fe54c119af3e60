//! Tensors to and from tasks of the cluster (`worker:1`) instead of ranks: the layout's
//! task-to-rank map over [`crate::transport::p2p`].

use std::collections::BTreeMap;

use super::{Layout, TaskId};
use crate::tensor::Tensor;
use crate::transport::p2p::{self, P2pError};
use crate::transport::Comm;

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

/// Errors of sending to or receiving from a task.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PeerError {
    #[error("task {0} is not in the cluster")]
    UnknownTask(TaskId),
    #[error("{0}")]
    P2p(#[from] P2pError),
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

    /// The rank of `peer`.
    pub fn rank(&self, peer: &Peer) -> Result<usize, PeerError> {
        match peer {
            Peer::Rank(r) => Ok(*r),
            Peer::Task(t) => self
                .ranks
                .get(t)
                .copied()
                .ok_or_else(|| PeerError::UnknownTask(t.clone())),
        }
    }
}

/// Sends `t` to a task or rank of the cluster.
pub fn send_to<C: Comm>(
    c: &C,
    tasks: &Tasks,
    t: &Tensor,
    to: &Peer,
    tag: i32,
) -> Result<(), PeerError> {
    Ok(p2p::send(c, t, tasks.rank(to)?, tag)?)
}

/// Receives into `t` from a task or rank of the cluster.
pub fn receive_from<C: Comm>(
    c: &C,
    tasks: &Tasks,
    t: &mut Tensor,
    from: &Peer,
    tag: i32,
) -> Result<(), PeerError> {
    Ok(p2p::receive_into(c, t, tasks.rank(from)?, tag)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_map_to_ranks() {
        let opts = crate::cluster::MappingOptions {
            ps: 1,
            ..Default::default()
        };
        let layout = Layout::single_host(3, &opts).unwrap();
        let t = Tasks::from_layout(&layout);
        assert_eq!(t.rank(&Peer::Task(TaskId::new("worker", 1))).unwrap(), 2);
        assert_eq!(t.rank(&Peer::Rank(7)).unwrap(), 7);
        assert_eq!(
            t.rank(&Peer::Task(TaskId::new("ps", 3))),
            Err(PeerError::UnknownTask(TaskId::new("ps", 3)))
        );
    }
}
