//! mpx's function API (`filter_value_and_grad`, `filter_grad`, `optimizer_update`) as thin
//! functions over [`GradScaler`]: the same state, the same working copy, the same transfer.
//!
//! | mpx | here |
//! |---|---|
//! | `filter_value_and_grad(func, scaling)(model, batch)` | [`filter_value_and_grad`]`(&master, &mut scaler, forward, loss)` |
//! | `filter_grad` | [`filter_grad`] |
//! | `has_aux=True` | [`filter_value_and_grad_with_aux`] |
//! | `optimizer_update(model, optimizer, optimizer_state, grads, grads_finite)` | [`optimizer_update`]`(&mut master, &mut opt, &mut scaler, &grads)` |
//!
//! The model function is split at the model output: `forward` gets the half working copy and a
//! half tape and returns the half output; `loss` gets that output widened to f32 on the f32 tape
//! and returns the loss (with `_with_aux`, the loss and an auxiliary value).

use dfdx::nn::ZeroGrads;
use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::optim::Optimizer;
use dfdx::shapes::{Rank0, Shape};
use dfdx::tensor::{AsArray, Cpu, Gradients, OwnedTape, SplitTape, Tensor, Trace, ZerosTensor};

use super::error::StepError;
use super::layout::WorkingCopy;
use super::outcome::UpdateOutcome;
use super::scaler::GradScaler;
use crate::boundary::MasterModel;
use crate::precision::Precision;
use crate::scaling::LossScale;

/// The result of [`filter_value_and_grad`]: the f32 loss, the scale applied, whether the
/// master's gradients were finite, and the unscaled f32 gradients keyed to the master.
///
/// Mapping to mpx's `(value, scaling_new, grads_finite, grad)`: `value` is
/// [`loss`](MixedGrads::loss), `grads_finite` is [`grads_finite`](MixedGrads::grads_finite),
/// `grad` is [`grads`](MixedGrads::grads); the scale lives in the scaler and is adjusted by the
/// update ([`GradScaler::loss_scale`] reads it).
///
/// # Examples
/// See [`filter_value_and_grad`].
#[derive(Debug)]
pub struct MixedGrads {
    /// The loss in f32, unscaled.
    pub loss: f32,
    /// Whether every gradient of the master was finite.
    pub grads_finite: bool,
    /// The scale the loss was multiplied by, and the gradients divided by.
    pub applied_scale: f32,
    grads: Gradients<f32, Cpu>,
}

impl MixedGrads {
    /// The unscaled f32 gradients, keyed to the master's tensors.
    ///
    /// # Examples
    /// See [`filter_value_and_grad`].
    pub fn grads(&self) -> &Gradients<f32, Cpu> {
        &self.grads
    }

    /// The gradients, to keep (for accumulation, or to pass on).
    ///
    /// # Examples
    /// See [`filter_value_and_grad`].
    pub fn into_grads(self) -> Gradients<f32, Cpu> {
        self.grads
    }

    /// Whether the loss value was finite.
    ///
    /// # Examples
    /// See [`filter_value_and_grad`].
    pub fn loss_finite(&self) -> bool {
        self.loss.is_finite()
    }

    /// `true` when the update will be applied: gradients and loss finite.
    ///
    /// # Examples
    /// See [`filter_value_and_grad`].
    pub fn is_finite(&self) -> bool {
        self.grads_finite && self.loss_finite()
    }
}

/// Computes the loss and the f32 gradients of `master` with its forward pass in half precision:
/// mpx's `filter_value_and_grad`. One [`GradScaler::forward`] and one
/// [`GradScaler::backward`]: the scaled gradient enters the half graph, the working copy's
/// gradients come back unscaled and checked. The gradient buffers are allocated per call; a
/// loop that wants them reused calls the scaler's methods itself.
///
/// # Errors
/// [`StepError::InvalidScale`] for a scale that is not finite and positive,
/// [`StepError::Device`] when the device cannot allocate. Non-finite gradients are not errors.
///
/// # Examples
/// ```
/// use dfdx::{optim::*, prelude::*};
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::scaling::StaticLossScale;
/// use mpx_runtime::step::{GradScaler, filter_value_and_grad, optimizer_update};
///
/// let dev: Cpu = Default::default();
/// type Mlp = (Linear<4, 8>, ReLU, Linear<8, 2>);
/// let mut master = dev.build_module::<Mlp, f32>();
/// let mut opt = Sgd::new(&master, SgdConfig { lr: 0.1, momentum: None, weight_decay: None });
/// let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(1024.0).unwrap());
///
/// let x: Tensor<Rank2<3, 4>, f32, _> = dev.sample_normal();
/// let y: Tensor<Rank2<3, 2>, f32, _> = dev.sample_normal();
/// let x_half = x.to_dtype::<f16>();
/// let grads = filter_value_and_grad(
///     &master,
///     &mut scaler,
///     |model, tape| model.forward(x_half.clone().put_tape(tape)),
///     |out| mse_loss(out, y.clone()),
/// )?;
/// assert!(grads.is_finite() && grads.applied_scale == 1024.0);
/// assert!(optimizer_update(&mut master, &mut opt, &mut scaler, &grads)?.is_applied());
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
pub fn filter_value_and_grad<H, L, M, S, Fwd, LossFn>(
    master: &M,
    scaler: &mut GradScaler<H, L>,
    forward: Fwd,
    loss: LossFn,
) -> Result<MixedGrads, StepError>
where
    H: Precision,
    L: LossScale,
    M: MasterModel + Send + Sync + 'static,
    S: Shape,
    Cpu: super::MixedDevice<H>,
    WorkingCopy<H, M>: TensorCollection<H::Elem, Cpu> + Send + Sync + 'static,
    Fwd: FnOnce(
        &mut WorkingCopy<H, M>,
        OwnedTape<H::Elem, Cpu>,
    ) -> Tensor<S, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
    LossFn: FnOnce(
        Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
    ) -> Tensor<Rank0, f32, Cpu, OwnedTape<f32, Cpu>>,
{
    let (grads, ()) =
        filter_value_and_grad_with_aux(master, scaler, forward, |out| (loss(out), ()))?;
    Ok(grads)
}

/// [`filter_value_and_grad`] whose loss function also returns an auxiliary value (mpx's
/// `has_aux=True`), computed on the f32 side.
///
/// # Errors
/// As [`filter_value_and_grad`].
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::scaling::StaticLossScale;
/// use mpx_runtime::step::{GradScaler, filter_value_and_grad_with_aux};
///
/// let dev: Cpu = Default::default();
/// let master = dev.build_module::<Linear<3, 2>, f32>();
/// let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(256.0).unwrap());
/// let x = dev.tensor([[1.0f32, 2.0, 3.0]]).to_dtype::<f16>();
/// let (grads, logits) = filter_value_and_grad_with_aux(
///     &master,
///     &mut scaler,
///     |m, tape| m.forward(x.clone().put_tape(tape)),
///     |out| {
///         let logits = out.retaped::<NoneTape>().array();
///         (out.square().mean(), logits)
///     },
/// )?;
/// assert!(grads.grads_finite && logits[0].iter().all(|v| v.is_finite()));
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
pub fn filter_value_and_grad_with_aux<H, L, M, S, A, Fwd, LossFn>(
    master: &M,
    scaler: &mut GradScaler<H, L>,
    forward: Fwd,
    loss: LossFn,
) -> Result<(MixedGrads, A), StepError>
where
    H: Precision,
    L: LossScale,
    M: MasterModel + Send + Sync + 'static,
    S: Shape,
    Cpu: super::MixedDevice<H>,
    WorkingCopy<H, M>: TensorCollection<H::Elem, Cpu> + Send + Sync + 'static,
    Fwd: FnOnce(
        &mut WorkingCopy<H, M>,
        OwnedTape<H::Elem, Cpu>,
    ) -> Tensor<S, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
    LossFn: FnOnce(
        Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
    ) -> (Tensor<Rank0, f32, Cpu, OwnedTape<f32, Cpu>>, A),
{
    // The forward pass takes no f32 input of its own: a scalar anchor carries the master's
    // gradients onto the tape, and its half copy hands the forward closure the half tape.
    let anchor: Tensor<Rank0, f32, Cpu> = Cpu::default().try_zeros()?;
    let traced = anchor.traced(master.try_alloc_grads()?);
    let out = scaler.try_forward(master, traced, |working, a| {
        let (_, tape) = a.split_tape();
        forward(working, tape)
    })?;
    let (loss_t, aux) = loss(out);
    let value = loss_t.array();
    let applied_scale = scaler.loss_scale();
    let grads = scaler.try_backward(loss_t)?;
    let grads_finite = scaler.pending_grads_finite(master)?;
    Ok((
        MixedGrads {
            loss: value,
            grads_finite,
            applied_scale,
            grads,
        },
        aux,
    ))
}

/// Updates the f32 master with any dfdx optimizer when its gradients were finite, else leaves
/// master and optimizer state untouched: mpx's `optimizer_update`, here
/// [`GradScaler::update`] (which also adjusts the loss scale).
///
/// # Errors
/// As [`GradScaler::update`].
///
/// # Examples
/// ```
/// use dfdx::{optim::*, prelude::*};
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::step::{GradScaler, SkipReason, UpdateOutcome, filter_value_and_grad, optimizer_update};
///
/// let dev: Cpu = Default::default();
/// let mut master = dev.build_module::<Linear<2, 1>, f32>();
/// let before = master.weight.array();
/// let mut opt = Adam::new(&master, AdamConfig::default());
/// let mut scaler = GradScaler::<f16>::default();
/// let x = dev.tensor([[f32::NAN, 1.0]]).to_dtype::<f16>(); // a bad batch
/// let grads = filter_value_and_grad(&master, &mut scaler, |m, t| m.forward(x.clone().put_tape(t)), |o| o.square().mean())?;
/// let outcome = optimizer_update(&mut master, &mut opt, &mut scaler, &grads)?;
/// assert_eq!(outcome, UpdateOutcome::Skipped { reason: SkipReason::GradsNotFinite, consecutive: 1, total: 1 });
/// assert_eq!(master.weight.array(), before);
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
pub fn optimizer_update<H, L, M, O>(
    master: &mut M,
    optimizer: &mut O,
    scaler: &mut GradScaler<H, L>,
    grads: &MixedGrads,
) -> Result<UpdateOutcome, StepError>
where
    H: Precision,
    L: LossScale,
    M: MasterModel,
    O: Optimizer<M, Cpu, f32>,
    Cpu: super::MixedDevice<H>,
{
    scaler.update(master, optimizer, grads.grads())
}
