//! Hierarchical allreduce, for jobs across nodes with several ranks on a node: the ranks
//! of each node reduce through shared memory, one leader per node (the node's first rank)
//! allreduces among the leaders over the network (recursive doubling for small calls, the
//! ring from `ring_min_bytes`), and each leader broadcasts the result inside its node.
//! Only the leaders' traffic crosses the network: one copy of the buffer per node instead
//! of one per rank, which is what counts when a link, not a memory bus, is the bottleneck.
//!
//! Every rank ends with the same bits: the leaders compute identical results (as the ring
//! and recursive doubling always do) and broadcast them. `Average` sums at both levels and
//! divides once by the number of ranks, so nodes of unequal size weigh each rank alike.

use super::{Algorithm, Collectives};
use crate::tensor::DType;
use crate::transport::comm::{Comm, ReduceOp, TransportError};
use crate::transport::reduce::divide_bytes;

/// The two levels of one communicator.
pub(super) struct Hierarchy<C: Comm> {
    /// The ranks of this rank's node.
    node: Collectives<C>,
    /// The node leaders (on a leader only).
    leaders: Option<Collectives<C>>,
    /// The most ranks any node has: with 1 the hierarchy is the flat allreduce again.
    widest: usize,
    /// Ranks of the whole communicator.
    size: usize,
}

impl<C: Comm> Hierarchy<C> {
    /// Collective over `c`: the node and leader communicators, or `None` when every rank
    /// is on one node (every rank sees the same).
    pub(super) fn build(c: &Collectives<C>) -> Result<Option<Box<Hierarchy<C>>>, TransportError> {
        let node = c.comm.split_node()?;
        if node.size() == c.size() {
            return Ok(None);
        }
        let leader = node.rank() == 0;
        let leaders = c.comm.split(u32::from(!leader), c.rank())?;
        // Every rank learns the widest node (an allgather of each rank's node size).
        let mut sizes = vec![0u8; 8 * c.size()];
        c.allgather(&(node.size() as u64).to_le_bytes(), &mut sizes)?;
        let widest = sizes
            .chunks(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .max()
            .unwrap_or(1);
        let with_tuning = |comm: C| {
            let mut coll = Collectives::new(comm);
            coll.tuning = c.tuning;
            coll
        };
        Ok(Some(Box::new(Hierarchy {
            node: with_tuning(node),
            leaders: leader.then(|| with_tuning(leaders)),
            widest,
            size: c.size(),
        })))
    }

    /// Whether some node has more than one rank (otherwise the hierarchy adds nothing).
    pub(super) fn useful(&self) -> bool {
        self.widest > 1
    }

    /// In-place allreduce of `buf` through the two levels.
    pub(super) fn allreduce(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), TransportError> {
        let level_op = if op == ReduceOp::Average {
            ReduceOp::Sum
        } else {
            op
        };
        self.node.allreduce(buf, dtype, level_op, Algorithm::Auto)?;
        if let Some(leaders) = &self.leaders {
            let algo = if buf.len() >= leaders.tuning.ring_min_bytes {
                Algorithm::Ring
            } else {
                Algorithm::RecursiveDoubling
            };
            leaders.allreduce(buf, dtype, level_op, algo)?;
        }
        self.node.bcast(buf, 0)?;
        if op == ReduceOp::Average {
            divide_bytes(dtype, buf, self.size);
        }
        Ok(())
    }
}
