//! Errors of the mixed-precision step.

use dfdx::optim::OptimizerUpdateError;
use dfdx::tensor::CpuError;

/// What can go wrong in a mixed-precision step ([`filter_value_and_grad`](super::filter_value_and_grad),
/// [`optimizer_update`](super::optimizer_update)).
///
/// A non-finite gradient or loss is **not** an error: it is a skipped step, reported in
/// [`UpdateOutcome::Skipped`](super::UpdateOutcome::Skipped). It becomes an error only when a
/// limit on consecutive skips is set and exceeded ([`StepError::TooManySkips`]).
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The device failed (in practice: out of memory); the device's error is the source.
    #[error("the device failed during the mixed step")]
    Device(#[from] CpuError),

    /// The working copy could not be cast from the master (a module whose `TensorCollection`
    /// does not rebuild it, or runtime dimensions that changed).
    #[error("casting the master into the working copy failed")]
    Cast(#[from] crate::cast::CastError),

    /// The loss scale was zero, negative, infinite or NaN.
    #[error(
        "the loss scale must be finite and greater than 0, got {scale}; \
         use a DynamicLossScale with a positive minimum, a StaticLossScale > 0, or NoOpLossScale"
    )]
    InvalidScale {
        /// The offending scale.
        scale: f32,
    },

    /// The master model does not have the layout the workspace was built for.
    #[error(
        "the workspace was built for a master model with {expected}, but this one has {found}; \
         build the workspace from this master with `MixedWorkspace::new(&master)`"
    )]
    WorkspaceMismatch {
        /// What the workspace expected (tensor count or a tensor's element count).
        expected: String,
        /// What it found.
        found: String,
    },

    /// The optimizer rejected the update; dfdx's `OptimizerUpdateError` is the source.
    #[error(
        "the optimizer update failed; if its source names unused tensors, the gradients were not \
         produced for this master model (was the workspace built from a different master?)"
    )]
    Optimizer(#[source] OptimizerUpdateError<CpuError>),

    /// More consecutive steps were skipped than the limit allows.
    #[error(
        "{consecutive} consecutive steps were skipped (limit {limit}) because gradients or the \
         loss were not finite; the loss scale is now {scale}. Check the batch and the loss for \
         NaN/inf, lower the initial scale or the minimum scale, or raise the limit with \
         `MixedWorkspace::with_max_consecutive_skips`"
    )]
    TooManySkips {
        /// Consecutive skipped steps so far, this one included.
        consecutive: u64,
        /// The limit that was set.
        limit: u64,
        /// The loss scale after the last adjust.
        scale: f32,
    },

    /// The data-parallel all-reduce failed or the ranks disagree (model layout, settings,
    /// accumulation count); the [`DistributedError`](crate::distributed::DistributedError) says
    /// which.
    #[cfg(feature = "mpi")]
    #[error("data-parallel step: {0}")]
    Distributed(#[from] crate::distributed::DistributedError),
}

/// dfdx reports a module's and a backward pass's errors as `CpuError`, so a step that returns
/// dfdx's error type (`Result<_, D::Err>`) can still use `?` on a mixed backward pass: a device
/// error passes through as itself; a workspace that does not match the model, or a cast that
/// could not rebuild it, as `CpuError::WrongNumElements` (the tensors did not line up).
impl From<StepError> for CpuError {
    fn from(e: StepError) -> Self {
        match e {
            StepError::Device(e) => e,
            _ => CpuError::WrongNumElements,
        }
    }
}
