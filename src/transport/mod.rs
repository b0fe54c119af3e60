//! How processes talk.
//!
//! Layers, bottom up (Horovod's split, without its global state):
//! - [`context`]: the initialised MPI library and agreement on errors; passed by reference,
//!   never global. Dropping it finalises MPI.
//! - [`comm`]: the [`Comm`] trait: non-blocking byte send/receive and optional native
//!   collectives. Implemented by [`mpi::MpiComm`] (real MPI, errors returned, never fatal)
//!   and [`local::LocalComm`] (threads in one process, for `cargo test`).
//! - `links`: each communicator's memory of what each (peer, tag) last carried.
//! - [`p2p`]: tensors between ranks or tasks, one message each, straight from their memory;
//!   windows of them completed together.
//! - `messages`: messages of any length to a peer, from a peer or from any (a server's
//!   requests and replies), through the links' rings on one node, else MPI.
//! - [`channel`]: persistent channels: one tensor again and again, header checked once.
//! - [`inbox`]: a channel's receives posted ahead, each message moved into place uncopied.
//! - `ring`: a channel's small messages through memory its two ranks share, on one node.
//! - `reduce`: element-wise reductions of byte buffers, below every algorithm.
//! - `segments`: memory shared by the ranks of one communicator (from its backend).
//! - [`collectives`]: allreduce (MPI's, ring, recursive doubling, shared memory: one file
//!   each, and the choice among them), broadcast, allgather, barrier, written once over
//!   [`Comm`].
//! - [`fusion`]: negotiation (all ranks submit the same named tensors) and fusion buffers.
//! - [`rma`]: one-sided operations on MPI windows (the RDMA path), MPI only.
//! - `progress`: running MPI's progress engine on a rank that only waits (targets of
//!   emulated one-sided operations).
//! - [`stack`]: which of Open MPI's components carry a job (`--rdma-stack`), decided
//!   before `MPI_Init`.
//! - `tags`: every tag scheme inside the library's `MPI_TAG_UB`.
//! - [`threads`]: which thread level a job may ask for, decided before `MPI_Init`.

pub mod channel;
pub mod collectives;
pub mod comm;
pub mod context;
pub mod fusion;
pub mod inbox;
pub(crate) mod links;
pub mod local;
pub(crate) mod local_window;
pub(crate) mod messages;
pub mod mpi;
pub mod p2p;
pub(crate) mod progress;
pub(crate) mod reduce;
pub(crate) mod ring;
pub mod rma;
pub(crate) mod segments;
pub(crate) mod shm_object;
pub mod stack;
pub mod symmetric;
pub(crate) mod tags;
pub mod threads;
pub mod window;

pub use collectives::{Algorithm, Collectives};
pub use comm::{Comm, ReduceOp, TransportError};
pub use context::{Context, InitError, RankError};
