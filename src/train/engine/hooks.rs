//! What runs after each step besides the mode: the user's hooks.

/// What a hook sees after each step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepInfo {
    /// The global step after this step.
    pub global_step: u64,
    /// This step's loss (over every rank's samples in the synchronous modes).
    pub loss: f32,
    /// The loss of the update the parameters came from (NaN if unknown; the ps modes).
    pub applied_loss: f32,
}

/// A user's hook: runs after each step on every rank; `true` asks the session to stop.
/// A request on any rank stops every rank together: at once where one rank trains, after
/// the next step (whose word carries it) where several do.
pub trait Hook {
    fn after_step(&mut self, step: &StepInfo) -> bool;
}

impl<F: FnMut(&StepInfo) -> bool> Hook for F {
    fn after_step(&mut self, step: &StepInfo) -> bool {
        self(step)
    }
}
