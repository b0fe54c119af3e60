//! How processes talk: the MPI context every operation is given, and (in later layers)
//! point-to-point, collectives and one-sided windows.
//!
//! There is no global MPI state in mpiflow: [`Context`] owns the initialised MPI library
//! and is passed by reference to everything that communicates. Dropping it finalises MPI.

pub mod context;

pub use context::{Context, InitError, RankError};
