//! One error for programs on mpiflow: every operation's error converts into it, so `?`
//! works in a `main` returning `Result<(), mpiflow::Error>` (or `Box<dyn Error>`, which
//! each error converts into as well). [`std::error::Error::source`] gives the operation's
//! own error, whose line it prints.

use crate::cluster::ResolveError;
use crate::model::ModelError;
use crate::tensor::TensorError;
use crate::train::checkpoint::CheckpointError;
use crate::train::data::DataError;
use crate::train::engine::TrainError;
use crate::train::ps::PsError;
use crate::train::server::ServerError;
use crate::transport::TransportError;

/// An error of mpiflow, by the part it came from; its line is the part's one-line error.
/// Its `Debug` is that line too, so that a `main` returning it ends with `Error: LINE`
/// (Rust prints a returned error's `Debug`), not a dump of nested variants.
#[derive(thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Server(#[from] ServerError),
    #[error("{0}")]
    Train(#[from] TrainError),
    #[error("{0}")]
    Data(#[from] DataError),
    #[error("{0}")]
    Model(#[from] ModelError),
    #[error("{0}")]
    Ps(#[from] PsError),
    #[error("{0}")]
    Checkpoint(#[from] CheckpointError),
    #[error("{0}")]
    Transport(#[from] TransportError),
    #[error("{0}")]
    Cluster(#[from] ResolveError),
    #[error("{0}")]
    Tensor(#[from] TensorError),
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")
    }
}

impl Error {
    /// The exit status a command should end with: [`crate::train::Stopped::EXIT_STATUS`]
    /// for training stopped by a signal (a rerun resumes), 1 otherwise.
    pub fn exit_status(&self) -> u8 {
        match self {
            Error::Train(TrainError::Stopped(_)) => crate::train::Stopped::EXIT_STATUS,
            _ => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn the_line_is_the_operations_and_source_gives_it() {
        fn load() -> Result<(), Error> {
            crate::train::data::Dataset::load("no-such-data", 1)?;
            Ok(())
        }
        let e = load().unwrap_err();
        let source = e.source().expect("the data error").to_string();
        assert_eq!(e.to_string(), source);
        assert!(source.contains("no-such-data"), "{source}");
        assert_eq!(e.exit_status(), 1);
        assert_eq!(format!("{e:?}"), source);
    }
}
