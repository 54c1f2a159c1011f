//! [`StepReport`]: what one mixed-precision step did.

use super::UpdateOutcome;
use crate::precision::DType;

/// What one mixed-precision step did: its loss, whether it was finite, the loss scale it used
/// and the next one, and what the optimizer update did ([`GradScaler::last_step`](super::GradScaler::last_step)).
///
/// Mapping: JAX mpx's `filter_value_and_grad` returns `(loss, scaling_new, grads_finite, grads)`
/// and its `optimizer_update` the new model; PyTorch reads `scaler.get_scale()` and skips inside
/// `scaler.step(opt)`.
///
/// # Examples
/// ```
/// use mpx_runtime::precision::DType;
/// use mpx_runtime::step::StepReport;
/// use mpx_runtime::step::UpdateOutcome;
/// let r = StepReport {
///     loss: 0.5,
///     grads_finite: true,
///     scale: 1024.0,
///     new_scale: 1024.0,
///     precision: DType::Float16,
///     mpx_layers: false,
///     outcome: UpdateOutcome::Applied,
/// };
/// assert!(r.is_applied());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// The loss in f32, unscaled (computed on the f32 copy of the model output).
    pub loss: f32,
    /// Whether every gradient was finite (mpx's `grads_finite`).
    pub grads_finite: bool,
    /// The loss scale this step applied (and divided the gradients by).
    pub scale: f32,
    /// The loss scale after adjusting: the one the next step applies (mpx's `scaling_new`).
    pub new_scale: f32,
    /// The precision the master's forward passes ran in. [`DType::Float32`] for a master run
    /// in f32 on itself: `#[mixed_step]` does that (and the compiler warns at the step) when the
    /// half working copy's forward pass cannot be type-checked (a model whose type is a generic
    /// parameter of the `impl`; see `docs/dsl.md`).
    pub precision: DType,
    /// Whether the master's forward passes ran on a working copy made of mpx's layers (each
    /// dfdx `Linear` as mpx's fused one, transformer layers as `mpx::nn`'s:
    /// [`Mixed::mapped`](super::Mixed::mapped), which `#[mixed_step]` picks for a model that
    /// implements [`HalfLayers`](super::HalfLayers)); `false` for the master's own layers in
    /// half precision or in f32.
    pub mpx_layers: bool,
    /// Whether the optimizer ran or the step was skipped, and why.
    pub outcome: UpdateOutcome,
}

impl StepReport {
    /// `true` when the optimizer updated the master.
    pub fn is_applied(&self) -> bool {
        self.outcome.is_applied()
    }
}
