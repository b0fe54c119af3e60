//! Which allreduce algorithm runs: the names users pick ([`Algorithm`]), and what `auto`
//! picks by size, rank count and placement ([`AutoTuning`]). A new algorithm is a file of
//! this directory, a variant and a name here, and one line in `Collectives::allreduce_one`.

use super::Collectives;
use crate::transport::comm::{Comm, TransportError};

/// An allreduce algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Algorithm {
    #[default]
    Auto,
    Mpi,
    Ring,
    RecursiveDoubling,
    /// Through memory shared by the ranks of one node (see `super::shm`).
    Shm,
    /// Shared memory in each node, one leader per node across (see `super::hierarchical`).
    Hierarchical,
}

impl Algorithm {
    /// Every algorithm, as they are named ([`crate::named::Named`]): what enumerates them
    /// (`mpiflow check`, the flags' help) iterates this, so a new one is listed once.
    pub fn all() -> impl Iterator<Item = Algorithm> {
        <Algorithm as crate::named::Named>::NAMES
            .iter()
            .map(|(a, ..)| *a)
    }
}

impl crate::named::Named for Algorithm {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (
            Algorithm::Auto,
            "auto",
            "By message size and ranks (see AutoTuning)",
        ),
        (Algorithm::Mpi, "mpi", "The MPI library's MPI_Allreduce"),
        (
            Algorithm::Ring,
            "ring",
            "Reduce-scatter and allgather around a ring",
        ),
        (
            Algorithm::RecursiveDoubling,
            "recursive-doubling",
            "Pairwise exchanges, log2 ranks rounds",
        ),
        (
            Algorithm::Shm,
            "shm",
            "Through memory shared by the ranks of one node",
        ),
        (
            Algorithm::Hierarchical,
            "hierarchical",
            "Shared memory in each node, one leader per node across nodes",
        ),
    ];
}

/// When `auto` picks which algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AutoTuning {
    /// Below this many bytes: the library's own (or recursive doubling without one).
    pub small_bytes: usize,
    /// From this many bytes, with at most `ring_max_ranks` ranks: the ring.
    pub ring_min_bytes: usize,
    pub ring_max_ranks: usize,
    /// Ring segment size in bytes.
    pub segment_bytes: usize,
    /// `auto` takes the shared-memory allreduce when every rank is on one node...
    pub shm: bool,
    /// ...from `shm_min_bytes` up to and including `shm_max_bytes` (default: no limit),
    /// or for every size when the node has more ranks than cores. With a core per rank the
    /// library's own wins below (its small-message path has no slot to publish); above,
    /// shm copies each rank's sub-slice once and stores by measured mode
    /// (`super::stores`), where the ring moves every byte through every rank
    /// (`benches/results/2026-11-23b.md` has the comparison).
    pub shm_min_bytes: usize,
    pub shm_max_bytes: usize,
    /// Bytes per shared-memory slot (the pipeline's chunk): large enough that a fused
    /// call waits on few steps, small enough that copying in and reducing still overlap
    /// (`benches/results/2026-11-23b.md` compares 64 KiB to 1 MiB).
    pub shm_slot_bytes: usize,
    /// Across nodes with several ranks on some node: the hierarchical allreduce from this
    /// many bytes (`usize::MAX`: never by `auto`): from where one copy per node crossing
    /// the network outweighs the extra steps inside each node
    /// (`benches/results/2026-11-24-hosts.md`).
    pub hierarchical_min_bytes: usize,
}

impl Default for AutoTuning {
    fn default() -> Self {
        AutoTuning {
            small_bytes: 64 << 10,
            ring_min_bytes: 256 << 10,
            ring_max_ranks: 8,
            segment_bytes: 256 << 10,
            shm: true,
            shm_min_bytes: 512,
            shm_max_bytes: usize::MAX,
            shm_slot_bytes: 256 << 10,
            hierarchical_min_bytes: 4 << 10,
        }
    }
}

impl AutoTuning {
    /// The slot size the shared-memory allreduce uses: `shm_slot_bytes` rounded up to
    /// whole pages (at least one).
    pub fn shm_slot(&self) -> usize {
        self.shm_slot_bytes.next_multiple_of(4096).max(4096)
    }
}

impl<C: Comm> Collectives<C> {
    /// The algorithm `auto` picks for `bytes` bytes on this communicator (collective the
    /// first time: it finds out whether the ranks share a node).
    pub fn choose(&self, bytes: usize) -> Result<Algorithm, TransportError> {
        let native = self.comm.has_native();
        let t = &self.tuning;
        Ok(if self.size() <= 1 {
            Algorithm::RecursiveDoubling
        } else if t.shm
            && self.shm()?.is_some_and(|s| {
                s.oversubscribed()
                    || (bytes >= t.shm_min_bytes || !native)
                        && (bytes <= t.shm_max_bytes || self.size() > t.ring_max_ranks)
            })
        {
            Algorithm::Shm
        } else if bytes >= t.hierarchical_min_bytes && self.hierarchy()?.is_some_and(|h| h.useful())
        {
            Algorithm::Hierarchical
        } else if bytes >= t.ring_min_bytes && self.size() <= t.ring_max_ranks {
            Algorithm::Ring
        } else if native {
            Algorithm::Mpi
        } else {
            self.by_messages(bytes)
        })
    }

    /// What `auto` runs by messages where the library's own allreduce does not serve:
    /// recursive doubling below `small_bytes`, else the ring.
    pub(super) fn by_messages(&self, bytes: usize) -> Algorithm {
        if bytes < self.tuning.small_bytes {
            Algorithm::RecursiveDoubling
        } else {
            Algorithm::Ring
        }
    }

    /// The algorithm that runs when `algo` is asked for: `auto` chosen by size, `shm`
    /// only where the ranks share a node (otherwise as `auto`).
    pub(super) fn resolve(
        &self,
        algo: Algorithm,
        bytes: usize,
    ) -> Result<Algorithm, TransportError> {
        match algo {
            Algorithm::Auto => self.choose(bytes),
            // Not on one node (or one rank): whatever auto picks among the others.
            Algorithm::Shm if self.shm()?.is_none() => self.choose(bytes),
            // On one node: as auto.
            Algorithm::Hierarchical if self.hierarchy()?.is_none() => self.choose(bytes),
            a => Ok(a),
        }
    }
}
