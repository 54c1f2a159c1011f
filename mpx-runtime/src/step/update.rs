//! Skip-on-overflow updates: mpx's `optimizer_update` for any dfdx optimizer.

use dfdx::nn::tensor_collection::{RecursiveWalker, TensorOptions, TensorVisitor, ViewTensorMut};
use dfdx::optim::Optimizer;
use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, Tensor};
use dfdx::tensor_ops::Device;

use super::error::StepError;
use super::grads::MixedGrads;
use crate::boundary::MasterModel;
use crate::precision::Precision;

/// Why a step was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// A gradient was inf or NaN (loss-scale overflow, or NaN in the batch).
    GradsNotFinite,
    /// The gradients were finite but the loss was not.
    LossNotFinite,
    /// The caller passed `grads_finite = false` for finite gradients.
    Requested,
}

/// What [`optimizer_update`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateOutcome {
    /// The optimizer ran; master weights (and non-parameter state such as batch-norm running
    /// statistics) were updated.
    Applied,
    /// The optimizer did not run: master weights and optimizer state are bit-identical to before.
    Skipped {
        /// Why.
        reason: SkipReason,
        /// Skipped steps in a row, this one included.
        consecutive: u64,
        /// Skipped steps since the workspace was built.
        total: u64,
    },
}

impl UpdateOutcome {
    /// `true` for [`UpdateOutcome::Applied`].
    pub fn is_applied(&self) -> bool {
        matches!(self, UpdateOutcome::Applied)
    }
}

/// Updates the f32 master with any dfdx optimizer (`Sgd`, `Adam`, `RMSprop`, ...) only when the
/// step was finite: mpx's `optimizer_update(model, optimizer, optimizer_state, grads,
/// grads_finite)` (the dfdx optimizer holds its own state, so there is no separate state
/// argument).
///
/// * Finite (`grads_finite` and the gradients and loss in `grads` all finite): runs
///   `optimizer.update(master, grads.grads())`, then copies the non-parameter tensors that the
///   half forward pass changed (batch-norm running statistics) into the master.
/// * Otherwise: **does not call the optimizer at all**, so master weights and optimizer state
///   (Adam's step count and moments, momentum buffers) stay bit-identical; the skip is counted.
///   mpx computes the update and selects the old values, with the same result. Passing `true`
///   for gradients the workspace saw as non-finite still skips.
///
/// # Errors
/// [`StepError::TooManySkips`] when a limit was set with
/// [`MixedWorkspace::with_max_consecutive_skips`](super::MixedWorkspace::with_max_consecutive_skips)
/// and this skip exceeds it (nothing is changed); [`StepError::Optimizer`] if dfdx's optimizer
/// fails (e.g. gradients built for another master); [`StepError::WorkspaceMismatch`] if
/// `master` does not have the workspace's layout.
///
/// # Examples
/// ```
/// use dfdx::{optim::*, prelude::*};
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::scaling::StaticLossScale;
/// use mpx_runtime::step::{MixedWorkspace, UpdateOutcome, SkipReason, filter_value_and_grad, optimizer_update};
///
/// let dev: Cpu = Default::default();
/// let mut master = dev.build_module::<Linear<2, 1>, f32>();
/// let before = master.weight.array();
/// let mut opt = Adam::new(&master, AdamConfig::default());
/// let mut ws = MixedWorkspace::<f16, _>::new(&master)?;
/// let x = dev.tensor([[f32::NAN, 1.0]]).to_dtype::<f16>(); // a bad batch
/// let grads = filter_value_and_grad(
///     &master,
///     &mut StaticLossScale::new(1.0).unwrap(),
///     &mut ws,
///     |m, t| m.forward(x.clone().put_tape(t)),
///     |o| o.square().mean(),
/// )?;
/// let finite = grads.grads_finite;
/// let outcome = optimizer_update(&mut master, &mut opt, &grads, finite)?;
/// assert_eq!(outcome, UpdateOutcome::Skipped { reason: SkipReason::GradsNotFinite, consecutive: 1, total: 1 });
/// assert_eq!(master.weight.array(), before);
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
pub fn optimizer_update<H, M, O>(
    master: &mut M,
    optimizer: &mut O,
    grads: &MixedGrads<'_, H, M>,
    grads_finite: bool,
) -> Result<UpdateOutcome, StepError>
where
    H: Precision,
    M: MasterModel,
    O: Optimizer<M, Cpu, f32>,
    Cpu: Device<H::Elem>,
{
    let ws = grads.ws;
    let reason = if !grads.grads_finite {
        Some(SkipReason::GradsNotFinite)
    } else if !grads.loss_finite() {
        Some(SkipReason::LossNotFinite)
    } else if !grads_finite {
        Some(SkipReason::Requested)
    } else {
        None
    };
    if let Some(reason) = reason {
        let consecutive = ws.consecutive_skips.get() + 1;
        let total = ws.skipped_steps.get() + 1;
        ws.consecutive_skips.set(consecutive);
        ws.skipped_steps.set(total);
        if let Some(limit) = ws.max_consecutive_skips
            && consecutive > limit
        {
            return Err(StepError::TooManySkips {
                consecutive,
                limit,
                scale: grads.new_scale,
            });
        }
        return Ok(UpdateOutcome::Skipped {
            reason,
            consecutive,
            total,
        });
    }
    optimizer
        .update(master, grads.grads())
        .map_err(StepError::Optimizer)?;
    if ws.state_changed.iter().any(|&c| c) {
        let mut write = WriteState {
            after: &ws.state_after,
            changed: &ws.state_changed,
            index: 0,
            mismatch: None,
        };
        M::iter_tensors(&mut RecursiveWalker {
            m: master,
            f: &mut write,
        })?;
        if let Some(e) = write.mismatch {
            return Err(e);
        }
    }
    ws.consecutive_skips.set(0);
    ws.applied_steps.set(ws.applied_steps.get() + 1);
    Ok(UpdateOutcome::Applied)
}

/// Copies changed non-parameter tensors (f32 values of the working copy after the forward pass)
/// into the master; `changed[j]` says whether tensor `j` is written.
pub(super) struct WriteState<'a> {
    pub(super) after: &'a [Vec<f32>],
    pub(super) changed: &'a [bool],
    pub(super) index: usize,
    pub(super) mismatch: Option<StepError>,
}

impl TensorVisitor<f32, Cpu> for WriteState<'_> {
    type Viewer = ViewTensorMut;
    type Err = CpuError;
    type E2 = f32;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, f32, Cpu>,
        t: &mut Tensor<S, f32, Cpu>,
    ) -> Result<Option<Tensor<S, f32, Cpu>>, CpuError> {
        if opts.do_gradient_update || self.mismatch.is_some() {
            return Ok(None);
        }
        let j = self.index;
        self.index += 1;
        match (self.after.get(j), self.changed.get(j)) {
            (Some(values), Some(true)) if values.len() == t.shape().num_elements() => {
                t.copy_from(values);
            }
            (Some(_), Some(false)) => {}
            (Some(values), Some(_)) => {
                self.mismatch = Some(super::workspace::len_mismatch(
                    j,
                    values.len(),
                    t.shape().num_elements(),
                ));
            }
            _ => self.mismatch = Some(super::workspace::count_mismatch(self.after.len(), j + 1)),
        }
        Ok(None)
    }
}
