//! Loss scales: [`NoOpLossScale`], [`StaticLossScale`] and [`DynamicLossScale`], with jmp 0.0.4's
//! semantics.
//!
//! A loss scale multiplies the loss before backward so that small half-precision gradients do not
//! flush to zero, divides the gradients afterwards, and (for the dynamic scale) adapts to overflow.
//! The three scales share one code path: the [`LossScale`] trait's provided methods, built on
//! [`LossScale::loss_scale`].
//!
//! | mpx | jmp | PyTorch | here |
//! |---|---|---|---|
//! | `use_mixed_precision=False` | `NoOpLossScale` | `GradScaler(enabled=False)` | [`NoOpLossScale`] |
//! | – | `StaticLossScale(s)` | – | [`StaticLossScale::new`] |
//! | `DynamicLossScaling` | `DynamicLossScale` | `GradScaler` | [`DynamicLossScale`] |
//! | `scaling.scale(loss)` | `scale(loss)` | `scaler.scale(loss)` | [`LossScale::scale`] (f32 loss tensor) |
//! | `scaling.unscale(grads)` | `unscale(grads)` | `scaler.unscale_(opt)` | [`LossScale::unscale`] (any castable tree, into f32) |
//! | `scaling.adjust(finite)` | `adjust(finite)` | `scaler.update()` | [`LossScale::adjust`] (in place) |
//! | `loss_scaling` | `loss_scale` | `get_scale()` | [`LossScale::loss_scale`] |
//!
//! Scales are f32. `scale` multiplies an f32 loss by the f32 scale (the mixed step scales the loss
//! in f32, never in half precision, unlike mpx which casts the scale to f16). `unscale` casts the
//! tree's float leaves to f32 and multiplies them by `1 / scale` computed in f32, as jmp does
//! (`x * (1 / s)`): exact for power-of-two scales, and within one rounding of a true division
//! otherwise. Only float leaves are unscaled; integer leaves pass through (jmp and mpx multiply
//! every leaf, turning integers into floats; gradients have no integer leaves).
//!
//! Every scale that enters (a static scale, a dynamic scale's initial, min and max, restored
//! state) must be finite and greater than 2^-128, so that `1 / scale` is finite; the unscale
//! checks also look at what they write, so a user [`LossScale`] outside that range yields a
//! non-finite step rather than NaN weights.
//!
//! **Skipped steps never count toward growth:** a step is applied, and `adjust(true)` called, only
//! when both its gradients and its loss are finite ([`step_finite`]); every skipped step calls
//! `adjust(false)`.
//!
//! # Examples
//! ```
//! use dfdx::prelude::*;
//! use mpx_runtime::scaling::{DynamicLossScale, LossScale};
//! let dev: Cpu = Default::default();
//! let mut scale = DynamicLossScale::builder().initial(1024.0).period(2).build()?;
//! let loss = dev.tensor(0.25f32);
//! assert_eq!(scale.scale(loss).array(), 256.0);
//! scale.adjust(true);
//! scale.adjust(true); // second finite step in a row: grows
//! assert_eq!(scale.loss_scale(), 2048.0);
//! scale.adjust(false); // overflow: backs off
//! assert_eq!((scale.loss_scale(), scale.counter()), (1024.0, 0));
//! # Ok::<(), mpx_runtime::scaling::LossScaleError>(())
//! ```

mod dynamic;
mod error;
#[cfg(test)]
mod tests;

pub use dynamic::{DynamicLossScale, DynamicLossScaleBuilder};
pub use error::LossScaleError;

use crate::cast::{Cast, FloatLeaves, FloatSliceMut};
use crate::finite::{all_finite, unscale_in_place_checked, unscale_stored_in_place};
use crate::precision::f16;
use dfdx::shapes::Shape;
use dfdx::tensor::{Cpu, CpuError, Tape, Tensor};
use dfdx::tensor_ops::TryMul;
use serde::{Deserialize, Serialize};

/// A loss scale: multiplies the loss before backward, divides the gradients after, and adapts.
///
/// Implementors provide [`loss_scale`](LossScale::loss_scale) and [`adjust`](LossScale::adjust);
/// every other method is derived from the current scale, so all scales scale and unscale alike.
/// The generic methods need `Self: Sized`; `dyn LossScale` still offers the rest.
///
/// # Examples
/// ```
/// use mpx_runtime::scaling::{LossScale, StaticLossScale};
/// let s = StaticLossScale::new(128.0)?;
/// assert_eq!(s.scale_value(0.5), 64.0);
/// assert_eq!(s.unscale_value(64.0), 0.5);
/// # Ok::<(), mpx_runtime::scaling::LossScaleError>(())
/// ```
pub trait LossScale {
    /// The scale currently applied (jmp's `loss_scale`, mpx's `loss_scaling`, PyTorch's `get_scale()`).
    fn loss_scale(&self) -> f32;

    /// Updates the scale after a step that was applied (`true`) or skipped (`false`). Call it once
    /// per step, after unscaling with the scale that was applied.
    ///
    /// **The rule:** a step is applied only when its gradients **and** its loss are all finite
    /// ([`step_finite`]); pass `false` for every skipped step, so a skipped step never counts
    /// toward growth. An inf loss can come with finite gradients; that step is skipped too.
    fn adjust(&mut self, step_finite: bool);

    /// The factor gradients are multiplied by to unscale them: `1 / loss_scale()`, computed in f32.
    fn inv_loss_scale(&self) -> f32 {
        1.0 / self.loss_scale()
    }

    /// Multiplies one f32 value by the scale.
    fn scale_value(&self, value: f32) -> f32 {
        value * self.loss_scale()
    }

    /// Multiplies one f32 value by [`inv_loss_scale`](LossScale::inv_loss_scale), as `unscale` does.
    fn unscale_value(&self, value: f32) -> f32 {
        value * self.inv_loss_scale()
    }

    /// Multiplies an f32 loss tensor (on any tape) by the scale; the tape records the multiply, so
    /// the gradients come out scaled. A scale of exactly 1 leaves the tensor as it is.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::scaling::{LossScale, StaticLossScale};
    /// let dev: Cpu = Default::default();
    /// let w = dev.tensor([1.0f32, 2.0]);
    /// let loss = w.leaky_trace().sum();
    /// let grads = StaticLossScale::new(8.0)?.scale(loss).backward();
    /// assert_eq!(grads.get(&w).array(), [8.0, 8.0]);
    /// # Ok::<(), mpx_runtime::scaling::LossScaleError>(())
    /// ```
    fn scale<S: Shape, T: Tape<f32, Cpu>>(
        &self,
        loss: Tensor<S, f32, Cpu, T>,
    ) -> Tensor<S, f32, Cpu, T>
    where
        Self: Sized,
    {
        let s = self.loss_scale();
        if s == 1.0 { loss } else { loss * s }
    }

    /// Fallible form of [`scale`](LossScale::scale) (dfdx's `try_*` habit).
    ///
    /// # Errors
    /// The device's [`CpuError`] when it cannot allocate.
    fn try_scale<S: Shape, T: Tape<f32, Cpu>>(
        &self,
        loss: Tensor<S, f32, Cpu, T>,
    ) -> Result<Tensor<S, f32, Cpu, T>, CpuError>
    where
        Self: Sized,
    {
        let s = self.loss_scale();
        if s == 1.0 { Ok(loss) } else { loss.try_mul(s) }
    }

    /// Casts `tree`'s float leaves to f32 (as `cast_to_f32`) and multiplies each by
    /// [`inv_loss_scale`](LossScale::inv_loss_scale): jmp's `x * (1 / s)`. Exact for power-of-two
    /// scales (when nothing overflows or underflows). Integer leaves pass through.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::scaling::{LossScale, StaticLossScale};
    /// let grads = vec![1024.0f32, -2.0];
    /// let unscaled = StaticLossScale::new(1024.0)?.unscale(&grads);
    /// assert_eq!(unscaled, vec![1.0, -2.0 / 1024.0]);
    /// # Ok::<(), mpx_runtime::scaling::LossScaleError>(())
    /// ```
    fn unscale<X>(&self, tree: &X) -> X::Output
    where
        Self: Sized,
        X: Cast<f32> + ?Sized,
        X::Output: FloatLeaves,
    {
        self.unscale_checked(tree).0
    }

    /// [`unscale`](LossScale::unscale) and [`all_finite`] in one pass over the gradients: returns
    /// the unscaled f32 tree and whether every float leaf was finite **before** unscaling (the
    /// check mpx and jmp run on the scaled gradients) **and after** (what would be applied: a
    /// scale whose reciprocal is not finite, or an unscaled value that overflows, gives `false`).
    ///
    /// The flag covers the gradients only; the step's rule for [`adjust`](LossScale::adjust) also
    /// needs the loss to be finite ([`step_finite`]).
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::scaling::{DynamicLossScale, LossScale};
    /// let dev: Cpu = Default::default();
    /// let w = dev.tensor([0.5f32, -1.0]);
    /// let mut scaling = DynamicLossScale::builder().initial(32768.0).build()?;
    /// let loss = (w.leaky_trace() * 3.0).sum();
    /// let grads = scaling.scale(loss).backward();
    /// let (g, finite) = scaling.unscale_checked(&grads.get(&w));
    /// assert!(finite);
    /// assert_eq!(g.array(), [3.0, 3.0]);
    /// scaling.adjust(finite);
    /// assert!(!scaling.unscale_checked(&vec![f32::NAN]).1);
    /// # Ok::<(), mpx_runtime::scaling::LossScaleError>(())
    /// ```
    fn unscale_checked<X>(&self, tree: &X) -> (X::Output, bool)
    where
        Self: Sized,
        X: Cast<f32> + ?Sized,
        X::Output: FloatLeaves,
    {
        let mut out = tree.cast();
        let inv = self.inv_loss_scale();
        if inv == 1.0 {
            let finite = all_finite(&out);
            return (out, finite);
        }
        let finite = unscale_leaves(&mut out, inv);
        (out, finite)
    }
}

/// Multiplies every float leaf of `tree` by `inv` in place; returns whether all were finite before
/// and after.
fn unscale_leaves<T: FloatLeaves + ?Sized>(tree: &mut T, inv: f32) -> bool {
    let mut finite = true;
    tree.visit_floats_mut(&mut |leaf| {
        finite &= match leaf {
            FloatSliceMut::F32(values) => unscale_in_place_checked(values, inv),
            // Not produced by a cast to f32; handled anyway, rounding back to f16.
            FloatSliceMut::F16(values) => unscale_stored_in_place::<f16>(values, inv),
        };
    });
    finite
}

/// No loss scaling: the scale is 1 and `adjust` does nothing (jmp's `NoOpLossScale`; mpx's
/// `use_mixed_precision=False`; PyTorch's `GradScaler(enabled=False)`).
///
/// `scale` returns the loss unchanged; `unscale` only casts to f32.
///
/// # Examples
/// ```
/// use mpx_runtime::scaling::{LossScale, NoOpLossScale};
/// let mut s = NoOpLossScale;
/// s.adjust(false);
/// assert_eq!(s.loss_scale(), 1.0);
/// assert_eq!(s.scale_value(3.5), 3.5);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoOpLossScale;

impl LossScale for NoOpLossScale {
    fn loss_scale(&self) -> f32 {
        1.0
    }
    fn adjust(&mut self, _step_finite: bool) {}
}

/// A fixed loss scale: `adjust` does nothing (jmp's `StaticLossScale`).
///
/// # Examples
/// ```
/// use mpx_runtime::scaling::{LossScale, StaticLossScale};
/// let mut s = StaticLossScale::new(512.0)?;
/// s.adjust(false);
/// assert_eq!(s.loss_scale(), 512.0);
/// assert!(StaticLossScale::new(0.0).is_err());
/// # Ok::<(), mpx_runtime::scaling::LossScaleError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "StaticState", into = "StaticState")]
pub struct StaticLossScale {
    loss_scale: f32,
}

impl StaticLossScale {
    /// A static scale of `loss_scale`.
    ///
    /// # Errors
    /// [`LossScaleError::InvalidScale`] unless `loss_scale` is finite and greater than
    /// 2^-128 (so that its reciprocal, which unscaling multiplies by, is finite).
    pub fn new(loss_scale: f32) -> Result<Self, LossScaleError> {
        let loss_scale = error::check_scale("static scale", loss_scale)?;
        Ok(Self { loss_scale })
    }
}

impl LossScale for StaticLossScale {
    fn loss_scale(&self) -> f32 {
        self.loss_scale
    }
    fn adjust(&mut self, _step_finite: bool) {}
}

/// Serialized form of [`StaticLossScale`], validated when read back; unknown fields are errors.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StaticState {
    loss_scale: f32,
}

impl TryFrom<StaticState> for StaticLossScale {
    type Error = LossScaleError;
    fn try_from(state: StaticState) -> Result<Self, LossScaleError> {
        Self::new(state.loss_scale)
    }
}

impl From<StaticLossScale> for StaticState {
    fn from(s: StaticLossScale) -> Self {
        Self {
            loss_scale: s.loss_scale,
        }
    }
}

/// Whether a step counts as finite for [`LossScale::adjust`]: its gradients were all finite
/// **and** its loss was finite.
///
/// A step with a non-finite loss is skipped even when its gradients came out finite (an inf loss
/// can backpropagate finite gradients), and a skipped step must never count toward growth. Pass
/// this to `adjust`.
///
/// # Examples
/// ```
/// use mpx_runtime::scaling::{step_finite, DynamicLossScale, LossScale};
/// let mut s = DynamicLossScale::builder().initial(1024.0).period(2).build()?;
/// s.adjust(step_finite(true, f32::INFINITY)); // finite gradients, inf loss: skipped
/// s.adjust(step_finite(true, f32::INFINITY));
/// assert_eq!(s.loss_scale(), 256.0); // backed off twice, never grew
/// # Ok::<(), mpx_runtime::scaling::LossScaleError>(())
/// ```
pub fn step_finite(grads_finite: bool, loss: f32) -> bool {
    grads_finite && loss.is_finite()
}
