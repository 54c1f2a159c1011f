//! A model whose parts are updated each by its own optimizer (a trunk on Adam and a head on
//! SGD, or a frozen trunk and a trained head): one forward pass of the whole model, on its
//! working copy, whose gradients are shared out among the parts by tensor, each part's judged
//! for its own update, as PyTorch's `GradScaler` checks each optimizer's own parameters.
//!
//! By hand: a [`MixedPart`] per part, [`GradScaler::forward_parts`] and
//! [`GradScaler::update_part`]; `#[mixed_step]` does the same for a step that updates parts of
//! a model whose forward pass it runs whole.

use std::panic::Location;

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::optim::Optimizer;
use dfdx::tensor::Gradients;
use dfdx::tensor_ops::Device;

use super::device::MixedDevice;
use super::error::StepError;
use super::half_region::{HalfInput, HalfOutput};
use super::iteration::Site;
use super::outcome::UpdateOutcome;
use super::owners::{Owners, Part, check_named};
use super::pending::Cell;
use super::scaler::GradScaler;
use super::working::Kind;
use crate::boundary::MasterModel;
use crate::precision::Precision;
use crate::scaling::LossScale;

/// The state a mixed step keeps for one part of a model that its own optimizer updates: what
/// the last backward pass saw of the part's gradients, for the part's next update. The by-hand
/// counterpart of [`Mixed`](super::Mixed) for a part (a field of a model cannot be wrapped in
/// a handle of its own).
///
/// # Examples
/// See [`GradScaler::forward_parts`].
#[derive(Debug, Default)]
pub struct MixedPart {
    cell: Cell,
}

impl MixedPart {
    /// A part no forward pass has reached yet.
    ///
    /// # Examples
    /// See [`GradScaler::forward_parts`].
    pub fn new() -> Self {
        Self::default()
    }

    /// This part's place in a forward pass of the whole model: `part` is the part of the model
    /// (a field) this state is for.
    ///
    /// # Errors
    /// A device error (reading the part's tensors).
    ///
    /// # Examples
    /// See [`GradScaler::forward_parts`].
    pub fn of<D: Device<f32>, P: TensorCollection<f32, D>>(
        &self,
        part: &P,
    ) -> Result<Part, D::Err> {
        let made = Part::of(self.cell.clone(), part)?;
        made.record();
        Ok(made)
    }
}

impl<H: Precision, L: LossScale, D: MixedDevice<H>> GradScaler<H, L, D> {
    /// A forward pass of `model` on its working copy of kind `kind` ([`Plain`](super::Plain) or
    /// [`Mapped`](super::Mapped)), as [`forward`](Self::forward), for a model whose `parts`
    /// (each made by [`MixedPart::of`]) are updated each by its own optimizer
    /// ([`update_part`](Self::update_part)). The backward pass judges each part's gradients for
    /// its own update; a tensor in no part (a frozen trunk's) is not judged.
    ///
    /// # Errors
    /// As [`forward`](Self::forward); [`StepError::PartsState`] when the pass changed batch-norm
    /// statistics in no part (those of a part reach it at its applied update); [`StepError::NotAPart`] for a part that is
    /// not the model's, [`StepError::PartsOverlap`] for two parts that share a tensor.
    ///
    /// # Examples
    /// ```
    /// use dfdx::{optim::*, prelude::*};
    /// use mpx_runtime::{precision::f16, step::{GradScaler, Mapped, MixedPart}};
    /// let dev: Cpu = Default::default();
    /// let mut model = dev.build_module::<((Linear<4, 8>, Tanh), Linear<8, 2>), f32>();
    /// let (trunk, head) = (MixedPart::new(), MixedPart::new());
    /// let mut trunk_opt = Adam::new(&model.0, Default::default());
    /// let mut head_opt = Sgd::new(&model.1, Default::default());
    /// let mut scaler = GradScaler::<f16>::default();
    /// let x: Tensor<Rank2<3, 4>, f32, _> = dev.sample_normal();
    /// let parts = vec![trunk.of(&model.0)?, head.of(&model.1)?];
    /// let y = scaler.forward_parts(&model, Mapped, parts, x.trace(model.alloc_grads()), |m, x| m.forward(x))?;
    /// let grads = scaler.backward(y.square().mean())?;
    /// assert!(scaler.update_part(&trunk, &mut model.0, &mut trunk_opt, &grads)?.is_applied());
    /// assert!(scaler.update_part(&head, &mut model.1, &mut head_opt, &grads)?.is_applied());
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn forward_parts<M, K, X, Y, F>(
        &mut self,
        model: &M,
        kind: K,
        parts: Vec<Part>,
        input: X,
        f: F,
    ) -> Result<Y::Full, StepError>
    where
        M: MasterModel<D>,
        K: Kind<H, M, D> + Copy,
        X: HalfInput<H, D>,
        Y: HalfOutput<H, D>,
        F: FnOnce(&mut K::Copy, X::Half) -> Y,
    {
        let _ = kind;
        Ok(self
            .run::<M, K, X, Y, F>(model, &Owners::Parts(parts), input, f)?
            .0)
    }

    /// Updates `part` (the part of the model whose state is `state`) with `optimizer`, as
    /// [`update`](Self::update) a whole master: only when the part's gradients of the last
    /// backward pass were all finite and the loss was finite.
    ///
    /// # Errors
    /// As [`update`](Self::update); [`StepError::OtherPart`] when `part` is not the part `state`
    /// was made of.
    ///
    /// # Examples
    /// See [`forward_parts`](Self::forward_parts).
    #[track_caller]
    pub fn update_part<P, O>(
        &mut self,
        state: &MixedPart,
        part: &mut P,
        optimizer: &mut O,
        grads: &Gradients<f32, D>,
    ) -> Result<UpdateOutcome, StepError>
    where
        P: MasterModel<D>,
        O: Optimizer<P, D, f32>,
    {
        check_named::<D, P>(&state.cell, part, D::step_error)?;
        let site = Site::Call(Location::caller());
        self.update_of(&state.cell, part, site, |p| optimizer.update(p, grads))
    }
}
