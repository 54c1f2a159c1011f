//! [`Mixed`]: a master model with its per-master state, the handle the runtime API names.

use std::ops::{Deref, DerefMut};

use super::pending::Cell;
use super::working::{Mapped, Plain};

/// An f32 master model with the state a mixed step keeps for it: what the last backward pass
/// saw of its gradients, for its next update. The runtime API's handle on one model
/// ([`GradScaler::forward`](super::GradScaler::forward) and
/// [`update`](super::GradScaler::update) take it); `#[mixed_step]` keeps the same state for the
/// models of a step itself, so converted code never names it.
///
/// `K` is the working copy the forward passes run on: [`Plain`] (the model's own layers in the
/// half type, [`Mixed::new`]) or [`Mapped`] (mpx's layers, [`Mixed::mapped`], for models that
/// implement [`HalfLayers`](super::HalfLayers)).
///
/// It dereferences to the model, so dfdx's methods (`alloc_grads`, `zero_grads`, a forward pass
/// in evaluation) and an optimizer built with `Adam::new(&*model, ..)` work on it as on the model.
/// A clone is a new master with its own state.
///
/// # Examples
/// ```
/// use dfdx::{optim::*, prelude::*};
/// use mpx_runtime::{precision::f16, step::{GradScaler, Mixed}};
/// let dev: Cpu = Default::default();
/// let mut model = Mixed::new(dev.build_module::<(Linear<4, 8>, Tanh, Linear<8, 2>), f32>());
/// let mut opt = Adam::new(&*model, AdamConfig::default());
/// let mut scaler = GradScaler::<f16>::default();
/// let x: Tensor<Rank2<3, 4>, f32, _> = dev.sample_normal();
/// let y = scaler.forward(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x))?;
/// let grads = scaler.backward(y.square().mean())?;
/// assert!(scaler.update(&mut model, &mut opt, &grads)?.is_applied());
/// let trained: (modules::Linear<4, 8, f32, Cpu>, Tanh, modules::Linear<8, 2, f32, Cpu>) =
///     model.into_inner();
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
#[derive(Debug)]
pub struct Mixed<M, K = Plain> {
    model: M,
    pub(crate) cell: Cell,
    kind: K,
}

impl<M> Mixed<M, Plain> {
    /// `model` as a master whose forward passes run on its own layers in the half type.
    ///
    /// # Examples
    /// See [`Mixed`].
    pub fn new(model: M) -> Self {
        Self::with(model, Plain)
    }
}

impl<M> Mixed<M, Mapped> {
    /// `model` as a master whose forward passes run on a working copy made of mpx's layers
    /// ([`HalfLayers`](super::HalfLayers)): fused linear layers on mpx's GEMM, with their weight
    /// and bias gradients written in f32 straight into the master's.
    ///
    /// # Examples
    /// See [`Batch`](super::Batch).
    pub fn mapped(model: M) -> Self {
        Self::with(model, Mapped)
    }
}

impl<M, K> Mixed<M, K> {
    /// `model` as a master whose forward passes run on working copies of kind `kind`: what
    /// [`new`](Mixed::new) and [`mapped`](Mixed::mapped) are for code generic over the kind.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::step::{Mapped, Mixed};
    /// let model = Cpu::default().build_module::<Linear<2, 1>, f32>();
    /// let _: Mixed<_, Mapped> = Mixed::with(model, Mapped);
    /// ```
    pub fn with(model: M, kind: K) -> Self {
        Self {
            model,
            cell: Cell::default(),
            kind,
        }
    }

    /// Whether the gradients were all finite after the last backward pass that reached this
    /// master (mpx's `grads_finite`); `None` when none did since its last update.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, step::{GradScaler, Mixed}};
    /// let dev: Cpu = Default::default();
    /// let model = Mixed::new(dev.build_module::<Linear<2, 1>, f32>());
    /// let mut scaler = GradScaler::<f16>::default();
    /// assert_eq!(model.grads_finite(), None);
    /// let y = scaler.forward(&model, dev.tensor([[f32::NAN, 1.0]]).trace(model.alloc_grads()), |m, x| m.forward(x))?;
    /// let _grads = scaler.backward(y.sum())?;
    /// assert_eq!(model.grads_finite(), Some(false));
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn grads_finite(&self) -> Option<bool> {
        let p = self.cell.lock();
        (p.backwards > 0).then_some(p.grads_finite)
    }

    /// The model, its mixed-step state dropped.
    ///
    /// # Examples
    /// See [`Mixed`].
    pub fn into_inner(self) -> M {
        self.model
    }
}

impl<M: Clone, K: Clone> Clone for Mixed<M, K> {
    /// A clone of the model, as a new master with no backward pass waiting.
    fn clone(&self) -> Self {
        Self {
            model: self.model.clone(),
            cell: Cell::default(),
            kind: self.kind.clone(),
        }
    }
}

impl<M, K> Deref for Mixed<M, K> {
    type Target = M;
    fn deref(&self) -> &M {
        &self.model
    }
}

impl<M, K> DerefMut for Mixed<M, K> {
    fn deref_mut(&mut self) -> &mut M {
        &mut self.model
    }
}
