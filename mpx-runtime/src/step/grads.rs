//! Mixed gradients: mpx's `filter_value_and_grad` / `filter_grad` on dfdx, and [`MixedGrads`].

use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorRef,
};
use dfdx::shapes::{HasShape, Rank0, Shape};
use dfdx::tensor::{
    AsArray, Cpu, CpuError, Gradients, OwnedTape, PutTape, SplitTape, Tape, Tensor, TensorFromVec,
    Trace,
};
use dfdx::tensor_ops::{Backward, Device};

use std::time::Instant;

use super::error::StepError;
use super::workspace::StepTimings;
use super::workspace::{MasterSlot, MixedWorkspace, WorkingCopy, count_mismatch, len_mismatch};
use crate::boundary::MasterModel;
use crate::cast::grad_slice;
use crate::finite::{unscale_stored_in_place, unscale_stored_into};
use crate::precision::Precision;
use crate::scaling::LossScale;

/// The result of a mixed gradient computation: the f32 loss, the scales, `grads_finite`, and f32
/// gradients shaped like (keyed to) the master, ready for `optimizer_update` or `opt.update`.
///
/// It borrows the workspace that holds the gradient buffers, so it lives until the next step.
///
/// Mapping to mpx: `filter_value_and_grad` returns `(value, scaling_new, grads_finite, grad)`:
/// here `value` is [`loss`](MixedGrads::loss), `scaling_new` is the scale object you passed
/// (adjusted in place; [`new_scale`](MixedGrads::new_scale) is its value), `grads_finite` is
/// [`grads_finite`](MixedGrads::grads_finite) and `grad` is [`grads`](MixedGrads::grads).
pub struct MixedGrads<'w, H: Precision, M: MasterModel>
where
    Cpu: Device<H::Elem>,
{
    /// The loss in f32, unscaled: computed in f32 on its own tape from the f32 copy of the model
    /// output (mpx returns `unscale(f16(loss) * f16(scale))`, which is inf whenever
    /// `loss * scale > 65504`; this one is the real loss).
    pub loss: f32,
    /// Whether every gradient was finite (checked on the scaled values, as mpx does).
    pub grads_finite: bool,
    /// The scale the loss was multiplied by, and that the gradients were divided by.
    pub applied_scale: f32,
    /// The scale after `adjust(grads_finite)`: the one the next step applies.
    pub new_scale: f32,
    pub(super) ws: &'w MixedWorkspace<H, M>,
}

impl<H: Precision, M: MasterModel> MixedGrads<'_, H, M>
where
    Cpu: Device<H::Elem>,
{
    /// The unscaled f32 gradients, keyed to the master's tensors: pass them to dfdx's
    /// `opt.update(&mut master, grads.grads())` (skipping is then yours to do), or use
    /// [`optimizer_update`](super::optimizer_update).
    pub fn grads(&self) -> &Gradients<f32, Cpu> {
        &self.ws.master_grads
    }

    /// Whether the loss value was finite. A batch containing NaN shows up here (and, through the
    /// gradients, in `grads_finite`).
    pub fn loss_finite(&self) -> bool {
        self.loss.is_finite()
    }

    /// `true` when the update should be applied: gradients and loss finite.
    pub fn is_finite(&self) -> bool {
        self.grads_finite && self.loss_finite()
    }
}

/// Computes the loss and f32 gradients of the master model with the forward pass in half
/// precision `H`: mpx's `filter_value_and_grad` (jmp/PyTorch: scaled backward + unscale + check).
///
/// * `forward` gets the working copy (cast from `master` into the workspace's buffers) and a
///   fresh tape; it casts its own inputs to `H` and returns the traced half output.
/// * `loss` gets that output cast to f32, on its own f32 tape, and returns the scalar f32 loss.
///
/// Inside: the loss is multiplied by the scale **in f32** (2^16 is already inf in f16), its
/// gradient with respect to the f32 output is cast to `H` (an overflow shows up as inf and is
/// caught below) and pushed into the half graph as a vector-Jacobian product; one pass over the
/// working copy's gradients then widens them, checks finiteness, and unscales them with the scale
/// that was **applied** (mpx 0.1.8 uses the adjusted one, which is off by the growth factor on
/// every growth step; not ported). Finally `scaling.adjust(step_finite(grads_finite, loss))`:
/// a step skipped for a non-finite loss never counts toward growth.
///
/// # Errors
/// [`StepError::InvalidScale`] for a scale that is not finite and positive,
/// [`StepError::WorkspaceMismatch`] if `master` is not the model the workspace was built for,
/// [`StepError::Device`] if the device cannot allocate. Non-finite gradients are not errors.
///
/// # Examples
/// ```
/// use dfdx::{optim::*, prelude::*};
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::scaling::StaticLossScale;
/// use mpx_runtime::step::{MixedWorkspace, filter_value_and_grad, optimizer_update};
///
/// let dev: Cpu = Default::default();
/// type Mlp = (Linear<4, 8>, ReLU, Linear<8, 2>);
/// let mut master = dev.build_module::<Mlp, f32>();
/// let mut opt = Sgd::new(&master, SgdConfig { lr: 0.1, momentum: None, weight_decay: None });
/// let mut ws = MixedWorkspace::<f16, _>::new(&master)?;
/// let mut scaling = StaticLossScale::new(1024.0).unwrap();
///
/// let x: Tensor<Rank2<3, 4>, f32, _> = dev.sample_normal();
/// let y: Tensor<Rank2<3, 2>, f32, _> = dev.sample_normal();
/// let x_half = x.to_dtype::<f16>();
/// let grads = filter_value_and_grad(
///     &master,
///     &mut scaling,
///     &mut ws,
///     |model, tape| model.forward(x_half.clone().put_tape(tape)),
///     |out| mse_loss(out, y.clone()),
/// )?;
/// assert!(grads.grads_finite && grads.loss.is_finite());
/// assert_eq!((grads.applied_scale, grads.new_scale), (1024.0, 1024.0));
/// let finite = grads.grads_finite;
/// optimizer_update(&mut master, &mut opt, &grads, finite)?;
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
pub fn filter_value_and_grad<'w, H, M, L, S, Fwd, LossFn>(
    master: &M,
    scaling: &mut L,
    workspace: &'w mut MixedWorkspace<H, M>,
    forward: Fwd,
    loss: LossFn,
) -> Result<MixedGrads<'w, H, M>, StepError>
where
    H: Precision,
    M: MasterModel,
    L: LossScale + ?Sized,
    S: Shape,
    Cpu: Device<H::Elem>,
    WorkingCopy<H, M>: TensorCollection<H::Elem, Cpu>,
    Fwd: FnOnce(
        &mut WorkingCopy<H, M>,
        OwnedTape<H::Elem, Cpu>,
    ) -> Tensor<S, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
    LossFn: FnOnce(
        Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
    ) -> Tensor<Rank0, f32, Cpu, OwnedTape<f32, Cpu>>,
{
    let (grads, ()) =
        filter_value_and_grad_with_aux(master, scaling, workspace, forward, |out| (loss(out), ()))?;
    Ok(grads)
}

/// [`filter_value_and_grad`] whose loss function also returns an auxiliary value (mpx's
/// `has_aux=True`): `loss` returns `(loss, aux)`, and `aux` comes back beside the gradients.
/// Unlike mpx, `aux` is computed on the f32 side, so it is already full precision.
///
/// # Errors
/// As [`filter_value_and_grad`].
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::scaling::StaticLossScale;
/// use mpx_runtime::step::{MixedWorkspace, filter_value_and_grad_with_aux};
///
/// let dev: Cpu = Default::default();
/// let master = dev.build_module::<Linear<3, 2>, f32>();
/// let mut ws = MixedWorkspace::<f16, _>::new(&master)?;
/// let x = dev.tensor([[1.0f32, 2.0, 3.0]]).to_dtype::<f16>();
/// let (grads, logits) = filter_value_and_grad_with_aux(
///     &master,
///     &mut StaticLossScale::new(256.0).unwrap(),
///     &mut ws,
///     |m, tape| m.forward(x.clone().put_tape(tape)),
///     |out| {
///         let logits = out.retaped::<NoneTape>().array();
///         (out.square().mean(), logits)
///     },
/// )?;
/// assert!(grads.grads_finite && logits[0].iter().all(|v| v.is_finite()));
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
pub fn filter_value_and_grad_with_aux<'w, H, M, L, S, A, Fwd, LossFn>(
    master: &M,
    scaling: &mut L,
    workspace: &'w mut MixedWorkspace<H, M>,
    forward: Fwd,
    loss: LossFn,
) -> Result<(MixedGrads<'w, H, M>, A), StepError>
where
    H: Precision,
    M: MasterModel,
    L: LossScale + ?Sized,
    S: Shape,
    Cpu: Device<H::Elem>,
    WorkingCopy<H, M>: TensorCollection<H::Elem, Cpu>,
    Fwd: FnOnce(
        &mut WorkingCopy<H, M>,
        OwnedTape<H::Elem, Cpu>,
    ) -> Tensor<S, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
    LossFn: FnOnce(
        Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
    ) -> (Tensor<Rank0, f32, Cpu, OwnedTape<f32, Cpu>>, A),
{
    let scale = scaling.loss_scale();
    if !(scale.is_finite() && scale > 0.0 && (1.0 / scale).is_finite()) {
        return Err(StepError::InvalidScale { scale });
    }
    let ws = workspace;

    // 1. working copy from the master, in place.
    let t0 = Instant::now();
    ws.refresh(master)?;
    let t_cast = Instant::now();

    // 2. forward in half precision, on a tape that accumulates into the reused gradients.
    let Some(half) = ws.half.as_mut() else {
        return Err(StepError::Cast(crate::cast::CastError::NotRebuilt));
    };
    let half_grads = match ws.half_grads.take() {
        // The identity path swaps buffers with the master gradients: zero them here.
        Some(mut g) if H::IDENTITY => {
            dfdx::nn::ZeroGrads::try_zero_grads(&*half, &mut g)?;
            g
        }
        Some(g) => g,
        None => dfdx::nn::ZeroGrads::try_alloc_grads(&*half)?,
    };
    let (_, tape) = ws.anchor.clone().traced(half_grads).split_tape();
    let out_half = forward(half, tape);
    let t_forward = Instant::now();
    let (out_half, mut half_tape) = out_half.split_tape();

    // 3. loss and its scaling in f32, on its own tape.
    let shape = *out_half.shape();
    let out_values = out_half.as_vec();
    let mut out32 = vec![0.0f32; out_values.len()];
    H::widen(&out_values, &mut out32);
    let out32: Tensor<S, f32, Cpu> = ws.dev.try_tensor_from_vec(out32, shape)?;
    let (loss_t, aux) = loss(out32.clone().traced(Gradients::leaky()));
    let loss_value = loss_t.array();
    let scaled = if scale == 1.0 { loss_t } else { loss_t * scale };
    let mut grads32 = scaled.try_backward()?;
    let g32: &[f32] = grads32.get_or_alloc_mut(&out32)?;

    // 4. the output gradient, cast to the half type, seeds the half graph (a VJP).
    let mut g_half = vec![H::Elem::default(); g32.len()];
    H::round(g32, &mut g_half);
    drop(grads32);
    let out_ghost = out_half.ghost();
    half_tape.add_backward_op(move |grads: &mut Gradients<H::Elem, Cpu>| {
        let buf = grad_slice::<H::Elem>(grads.get_or_alloc_mut(&out_ghost)?);
        for (d, s) in buf.iter_mut().zip(&g_half) {
            *d += *s;
        }
        Ok(())
    });
    let t_loss = Instant::now();
    let mut half_grads = ws.anchor.clone().put_tape(half_tape).try_backward()?;
    let t_backward = Instant::now();

    // 5. one pass: working-copy gradients -> f32 master gradients, unscaled with the APPLIED
    //    scale, finiteness checked; the half buffers are zeroed for the next step on the way.
    let mut transfer = Transfer::<H> {
        half_grads: &mut half_grads,
        master_grads: &mut ws.master_grads,
        slots: &ws.slots,
        inv_scale: 1.0 / scale,
        in_place: H::IDENTITY,
        finite: true,
        slot: 0,
        state_before: &ws.state_before,
        state_after: &mut ws.state_after,
        state_changed: &mut ws.state_changed,
        state_scratch: &mut ws.state_scratch,
        state: 0,
        mismatch: None,
    };
    let walked =
        <WorkingCopy<H, M> as TensorCollection<H::Elem, Cpu>>::iter_tensors(&mut RecursiveWalker {
            m: &*half,
            f: &mut transfer,
        });
    let (finite, mismatch, slots_seen) = (transfer.finite, transfer.mismatch.take(), transfer.slot);
    if H::IDENTITY {
        // The working copy's gradients are keyed to the master's tensors: they become the master
        // gradients, and the previous buffers are reused (after zeroing) next step. The shared
        // working copy is released so the optimizer can update the master's buffers in place.
        ws.half = None;
        let any: &mut dyn std::any::Any = &mut half_grads;
        match any.downcast_mut::<Gradients<f32, Cpu>>() {
            Some(g) => std::mem::swap(&mut ws.master_grads, g),
            None => {
                return Err(StepError::WorkspaceMismatch {
                    expected: "f32 gradients for an identity working copy".into(),
                    found: "another element type (a Precision impl is inconsistent)".into(),
                });
            }
        }
    }
    ws.half_grads = Some(half_grads);
    walked?;
    if let Some(e) = mismatch {
        return Err(e);
    }
    if slots_seen != ws.slots.len() {
        return Err(count_mismatch(ws.slots.len(), slots_seen));
    }

    let t_transfer = Instant::now();
    ws.timings = StepTimings {
        cast: t_cast - t0,
        forward: t_forward - t_cast,
        loss: t_loss - t_forward,
        backward: t_backward - t_loss,
        transfer: t_transfer - t_backward,
    };

    // 6. adjust the scale.
    scaling.adjust(crate::scaling::step_finite(finite, loss_value));
    let new_scale = scaling.loss_scale();
    Ok((
        MixedGrads {
            loss: loss_value,
            grads_finite: finite,
            applied_scale: scale,
            new_scale,
            ws,
        },
        aux,
    ))
}

/// mpx's `filter_grad`: the same computation as [`filter_value_and_grad`] (the loss value is
/// computed anyway, on the f32 side, so it is in the result too).
///
/// mpx returns `(scaling_new, grads_finite, grad)`; here the scale object is adjusted in place
/// and the rest are [`MixedGrads::grads_finite`] and [`MixedGrads::grads`].
///
/// # Errors
/// As [`filter_value_and_grad`].
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::scaling::NoOpLossScale;
/// use mpx_runtime::step::{MixedWorkspace, filter_grad};
/// let dev: Cpu = Default::default();
/// let master = dev.build_module::<Linear<2, 1>, f32>();
/// let mut ws = MixedWorkspace::<f16, _>::new(&master)?;
/// let x = dev.tensor([[0.5f32, -1.0]]).to_dtype::<f16>();
/// let g = filter_grad(&master, &mut NoOpLossScale, &mut ws, |m, t| m.forward(x.clone().put_tape(t)), |o| o.sum())?;
/// // d(sum(W x + b))/db = 1
/// assert_eq!(g.grads().get(&master.bias).array(), [1.0]);
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
pub fn filter_grad<'w, H, M, L, S, Fwd, LossFn>(
    master: &M,
    scaling: &mut L,
    workspace: &'w mut MixedWorkspace<H, M>,
    forward: Fwd,
    loss: LossFn,
) -> Result<MixedGrads<'w, H, M>, StepError>
where
    H: Precision,
    M: MasterModel,
    L: LossScale + ?Sized,
    S: Shape,
    Cpu: Device<H::Elem>,
    WorkingCopy<H, M>: TensorCollection<H::Elem, Cpu>,
    Fwd: FnOnce(
        &mut WorkingCopy<H, M>,
        OwnedTape<H::Elem, Cpu>,
    ) -> Tensor<S, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
    LossFn: FnOnce(
        Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
    ) -> Tensor<Rank0, f32, Cpu, OwnedTape<f32, Cpu>>,
{
    filter_value_and_grad(master, scaling, workspace, forward, loss)
}

/// Walks the working copy once: moves each trainable tensor's gradient to its master slot, and
/// snapshots the non-parameter tensors the forward pass changed.
struct Transfer<'a, H: Precision>
where
    Cpu: Device<H::Elem>,
{
    half_grads: &'a mut Gradients<H::Elem, Cpu>,
    master_grads: &'a mut Gradients<f32, Cpu>,
    slots: &'a [MasterSlot],
    inv_scale: f32,
    /// Check and unscale the working copy's gradients where they are (identity precision).
    in_place: bool,
    finite: bool,
    slot: usize,
    state_before: &'a [Vec<H::Elem>],
    state_after: &'a mut [Vec<f32>],
    state_changed: &'a mut [bool],
    state_scratch: &'a mut [H::Elem],
    state: usize,
    mismatch: Option<StepError>,
}

/// Elements moved per chunk: widened, checked and unscaled while in cache, then zeroed.
const CHUNK: usize = 4096;

impl<H: Precision> TensorVisitor<H::Elem, Cpu> for Transfer<'_, H>
where
    Cpu: Device<H::Elem>,
{
    type Viewer = ViewTensorRef;
    type Err = CpuError;
    type E2 = H::Elem;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, H::Elem, Cpu>,
        t: &Tensor<S, H::Elem, Cpu>,
    ) -> Result<Option<Tensor<S, H::Elem, Cpu>>, CpuError> {
        if self.mismatch.is_some() {
            return Ok(None);
        }
        let n = t.shape().num_elements();
        if !opts.do_gradient_update {
            let j = self.state;
            self.state += 1;
            let (Some(before), Some(after)) =
                (self.state_before.get(j), self.state_after.get_mut(j))
            else {
                self.mismatch = Some(count_mismatch(self.state_before.len(), j + 1));
                return Ok(None);
            };
            let now = &mut self.state_scratch[..n.min(before.len())];
            if now.len() != n {
                self.mismatch = Some(len_mismatch(j, before.len(), n));
                return Ok(None);
            }
            t.copy_into(now);
            let changed = now.iter().zip(before).any(|(a, b)| !same_bits(a, b));
            self.state_changed[j] = changed;
            if changed {
                H::widen(now, after);
            }
            return Ok(None);
        }
        let i = self.slot;
        self.slot += 1;
        let Some(slot) = self.slots.get(i) else {
            self.mismatch = Some(count_mismatch(self.slots.len(), i + 1));
            return Ok(None);
        };
        if slot.len != n {
            self.mismatch = Some(len_mismatch(i, slot.len, n));
            return Ok(None);
        }
        let src = grad_slice::<H::Elem>(self.half_grads.get_or_alloc_mut(t)?);
        if self.in_place {
            if src.len() != n {
                self.mismatch = Some(len_mismatch(i, n, src.len()));
                return Ok(None);
            }
            self.finite &= unscale_stored_in_place::<H>(src, self.inv_scale);
            return Ok(None);
        }
        let dst = (slot.get)(self.master_grads)?;
        if src.len() != dst.len() {
            self.mismatch = Some(len_mismatch(i, dst.len(), src.len()));
            return Ok(None);
        }
        let zero = H::Elem::default();
        let mut finite = true;
        for (s, d) in src.chunks_mut(CHUNK).zip(dst.chunks_mut(CHUNK)) {
            finite &= unscale_stored_into::<H>(s, self.inv_scale, d);
            s.fill(zero);
        }
        self.finite &= finite;
        Ok(None)
    }
}

/// Bit equality of two elements (so NaN == NaN and 0 != -0), through their f32 values' bits.
fn same_bits<E: dfdx::shapes::Dtype>(a: &E, b: &E) -> bool {
    match (a.to_f32(), b.to_f32()) {
        (Some(x), Some(y)) => x.to_bits() == y.to_bits(),
        _ => false,
    }
}
