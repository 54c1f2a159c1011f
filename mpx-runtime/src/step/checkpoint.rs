//! Saving and restoring a [`GradScaler`] (PyTorch's `state_dict` / `load_state_dict`): the loss
//! scale with its growth tracker, the step counters and the skip limit. Working copies are never
//! saved: every forward pass builds its own from the master as it is. A restore changes the
//! scaler's state and nothing of its configuration: a data-parallel scaler keeps its reducer, so
//! the ranks go on averaging (and a rank restored from another checkpoint than the others is an
//! error on every rank at the next backward pass).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::device::MixedDevice;
use super::error::StepError;
use super::scaler::GradScaler;
use crate::precision::Precision;
use crate::scaling::LossScale;

/// The whole saved state of a [`GradScaler`]. Every field is required and checked when it is
/// read back; an unknown field is an error.
///
/// # Examples
/// ```
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::scaling::DynamicLossScale;
/// use mpx_runtime::step::{GradScaler, ScalerState};
/// let scaler = GradScaler::<f16>::new(DynamicLossScale::new(1024.0).unwrap()).with_max_consecutive_skips(5);
/// let state: ScalerState<DynamicLossScale> = scaler.state_dict();
/// let json = serde_json::to_string(&state).unwrap();
/// let mut restored = GradScaler::<f16>::default();
/// restored.load_state_dict(serde_json::from_str(&json).unwrap())?;
/// assert_eq!((restored.loss_scale(), restored.max_consecutive_skips()), (1024.0, Some(5)));
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalerState<L> {
    /// The half precision's name (`"f16"`, `"bf16"`, ...): a checkpoint restores only into a
    /// scaler of the same precision.
    pub precision: String,
    /// The loss scale with its own state (for `DynamicLossScale`: scale, growth counter,
    /// period, factor, bounds).
    pub loss_scale: L,
    /// Updates applied.
    pub applied_steps: u64,
    /// Updates skipped.
    pub skipped_steps: u64,
    /// Updates skipped in a row, up to the checkpoint.
    pub consecutive_skips: u64,
    /// The limit on consecutive skips (`null` for none; the field itself is required).
    #[serde(deserialize_with = "required")]
    pub max_consecutive_skips: Option<u64>,
}

/// An `Option` field that must be present (`null` for `None`).
fn required<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<u64>::deserialize(d)
}

impl<H: Precision, L: LossScale + Clone, D: MixedDevice<H>> GradScaler<H, L, D> {
    /// The scaler's whole state, to save (PyTorch's `scaler.state_dict()`).
    ///
    /// # Examples
    /// See [`ScalerState`].
    pub fn state_dict(&self) -> ScalerState<L> {
        ScalerState {
            precision: H::DTYPE.name().to_string(),
            loss_scale: self.scaling.clone(),
            applied_steps: self.applied,
            skipped_steps: self.skipped,
            consecutive_skips: self.consecutive,
            max_consecutive_skips: self.max_consecutive_skips,
        }
    }

    /// Restores a state saved with [`state_dict`](Self::state_dict) (PyTorch's
    /// `scaler.load_state_dict(..)`): the loss scale, the counters and the skip limit. What the
    /// scaler was built with beside them (a data-parallel reducer) stays. A run restored with its
    /// masters and optimizer continues bit for bit.
    ///
    /// # Errors
    /// [`StepError::Checkpoint`] when the state is of another precision, its counters
    /// contradict each other (more skips in a row than skips, or than the limit allows), or
    /// leave no room to count another step; nothing is changed then.
    ///
    /// # Examples
    /// See [`ScalerState`].
    pub fn load_state_dict(&mut self, state: ScalerState<L>) -> Result<(), StepError> {
        check(&state, H::DTYPE.name())?;
        self.scaling = state.loss_scale;
        self.applied = state.applied_steps;
        self.skipped = state.skipped_steps;
        self.consecutive = state.consecutive_skips;
        self.max_consecutive_skips = state.max_consecutive_skips;
        // each update's skips in a row are the run's, not the checkpoint's: they start over
        self.streaks.clear();
        Ok(())
    }
}

fn check<L>(state: &ScalerState<L>, precision: &str) -> Result<(), StepError> {
    if state.precision != precision {
        return Err(StepError::Checkpoint(format!(
            "it was saved from a `{}` scaler, and this one runs in `{precision}`",
            state.precision
        )));
    }
    if state
        .applied_steps
        .checked_add(state.skipped_steps)
        .is_none_or(|total| total == u64::MAX)
    {
        return Err(StepError::Checkpoint(format!(
            "applied_steps ({}) and skipped_steps ({}) leave no room to count another step",
            state.applied_steps, state.skipped_steps
        )));
    }
    if state.consecutive_skips > state.skipped_steps {
        return Err(StepError::Checkpoint(format!(
            "consecutive_skips ({}) is more than skipped_steps ({})",
            state.consecutive_skips, state.skipped_steps
        )));
    }
    if let Some(limit) = state.max_consecutive_skips
        && state.consecutive_skips > limit.saturating_add(1)
    {
        return Err(StepError::Checkpoint(format!(
            "consecutive_skips ({}) is past max_consecutive_skips ({limit}) by more than the one skip that stops a run",
            state.consecutive_skips
        )));
    }
    Ok(())
}

/// A `GradScaler` serializes as its [`ScalerState`].
impl<H: Precision, L: LossScale + Clone + Serialize, D: MixedDevice<H>> Serialize
    for GradScaler<H, L, D>
{
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.state_dict().serialize(s)
    }
}

/// A `GradScaler` deserializes from its [`ScalerState`], checked as
/// [`load_state_dict`](GradScaler::load_state_dict) checks it.
impl<'de, H: Precision, L: LossScale + Clone + Deserialize<'de>, D: MixedDevice<H>> Deserialize<'de>
    for GradScaler<H, L, D>
{
    fn deserialize<De: Deserializer<'de>>(d: De) -> Result<Self, De::Error> {
        let state = ScalerState::<L>::deserialize(d)?;
        let mut scaler = GradScaler::new(state.loss_scale.clone());
        scaler
            .load_state_dict(state)
            .map_err(serde::de::Error::custom)?;
        Ok(scaler)
    }
}
