//! The one error of training, in every mode.

use crate::model::ModelError;
use crate::train::checkpoint::CheckpointError;
use crate::train::guard::NonFinite;
use crate::train::sidecar::SidecarError;
use crate::train::Stopped;
use crate::transport::fusion::FusionError;
use crate::transport::TransportError;

/// Why training ended early. [`TrainError::is_agreed`] tells an error every rank that
/// trains raises at the same step (nothing is left waiting) from one rank's own.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TrainError {
    #[error("{0}")]
    Transport(#[from] TransportError),
    #[error("{0}")]
    Fusion(#[from] FusionError),
    #[error("{0}")]
    Checkpoint(#[from] CheckpointError),
    #[error("{0}")]
    Model(#[from] ModelError),
    #[error("{0}")]
    Tensor(#[from] crate::tensor::TensorError),
    #[error("{0}")]
    NonFinite(#[from] NonFinite),
    #[error("{0}")]
    Stopped(#[from] Stopped),
    #[error(
        "replicas diverged at step {step}: rank {rank}'s parameters differ from rank {first}'s"
    )]
    Diverged {
        step: u64,
        rank: usize,
        first: usize,
    },
    /// The ranks hold different models (every rank raises it).
    #[error("{0}")]
    Models(String),
    #[error("{0}")]
    Sidecar(#[from] SidecarError),
    /// Parameter-server training's own (a worker lost its ps, a step the ps tasks did not
    /// apply).
    #[error("{0}")]
    Ps(#[from] crate::train::ps::PsError),
    /// An error every rank that trains raises alike (a mode's own, said in full: a
    /// pipeline's stages that diverged).
    #[error("{0}")]
    Agreed(String),
    /// The session used in a way it does not allow (a step after it stopped).
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Setup(String),
}

impl TrainError {
    /// True for an error every rank raises at the same step (a non-finite value among the
    /// reduced ones, diverged parameters, a stop, different models), so no rank is left
    /// waiting on another and one of them may say it for all.
    pub fn is_agreed(&self) -> bool {
        matches!(
            self,
            TrainError::NonFinite(_)
                | TrainError::Diverged { .. }
                | TrainError::Stopped(_)
                | TrainError::Models(_)
                | TrainError::Agreed(_)
                | TrainError::Ps(crate::train::ps::PsError::NotApplied(_))
                | TrainError::Ps(crate::train::ps::PsError::Stopped(_))
        )
    }
}
