//! What an update did: applied, or skipped and why.

/// Why a step was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SkipReason {
    /// A gradient was inf or NaN (loss-scale overflow, or NaN in the batch).
    GradsNotFinite,
    /// The gradients were finite but the loss was not.
    LossNotFinite,
}

/// What an update ([`GradScaler::update`](super::GradScaler::update)) did.
///
/// An update is applied or skipped, nothing else: the enum is exhaustive, so a `match` names both.
/// (Why a step was skipped may grow: [`SkipReason`] is `#[non_exhaustive]`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateOutcome {
    /// The optimizer ran; master weights (and non-parameter state such as batch-norm running
    /// statistics) were updated.
    Applied,
    /// The optimizer did not run: master weights and optimizer state are bit-identical to before.
    Skipped {
        /// Why.
        reason: SkipReason,
        /// Skipped steps in a row, this one included: the scaler's, or this model's update's (at
        /// this place in the code) where more, as a GAN's generator skipped while its
        /// discriminator trains.
        consecutive: u64,
        /// Skipped steps since the scaler was built (or restored).
        total: u64,
    },
}

impl UpdateOutcome {
    /// `true` for [`UpdateOutcome::Applied`].
    pub fn is_applied(&self) -> bool {
        matches!(self, UpdateOutcome::Applied)
    }
}
