//! [`WithScaler`]: an optimizer that carries its [`GradScaler`], for a step whose struct cannot
//! take one more field.

use std::ops::{Deref, DerefMut};

use dfdx::optim::{Optimizer, OptimizerUpdateError};
use dfdx::shapes::Dtype;
use dfdx::tensor::{Cpu, Gradients, Storage};

use super::{GradScaler, MixedDevice};
use crate::precision::{Precision, f16};
use crate::scaling::{DynamicLossScale, LossScale};

/// An optimizer with the [`GradScaler`] of its mixed steps beside it: the form for a step whose
/// struct cannot take one more field (its methods destructure `self` exhaustively, `let Self {
/// model, opt, .. } = self` without `..`, or a derive lists every field). Only the optimizer
/// field's type and its initialisation change; the step names the optimizer as its scaler,
/// `#[mixed_step(scaling = self.opt)]` (or `scaling = opt`, the binding a destructuring of
/// `self` gives it), and every line that used the optimizer keeps working: it
/// is the optimizer (`Deref`, and [`Optimizer`] itself, which runs the inner one).
///
/// # Examples
/// ```
/// use dfdx::{optim::*, prelude::*};
/// use mpx_runtime::step::WithScaler;
/// let dev: Cpu = Default::default();
/// let mut model = dev.build_module::<Linear<2, 1>, f32>();
/// let mut opt = WithScaler::new(Sgd::new(&model, SgdConfig { lr: 0.5, ..Default::default() }));
/// opt.cfg.lr = 0.1; // the optimizer's own settings, as before
/// let x = dev.tensor([[1.0f32, 2.0]]);
/// let grads = model.forward(x.trace(model.alloc_grads())).sum().backward();
/// opt.update(&mut model, &grads).unwrap(); // an f32 step runs the optimizer as it is
/// assert_eq!(opt.scaler().applied_steps(), 0); // the scaler counts mixed steps only
/// ```
#[derive(Debug)]
pub struct WithScaler<O, H = f16, L = DynamicLossScale, D = Cpu>
where
    H: Precision,
    L: LossScale,
    D: MixedDevice<H>,
{
    optimizer: O,
    scaler: GradScaler<H, L, D>,
}

impl<O> WithScaler<O> {
    /// `optimizer` with an f16 scaler of the default dynamic loss scale (another precision or
    /// scale: [`with`](Self::with)).
    ///
    /// # Examples
    /// See [`WithScaler`].
    pub fn new(optimizer: O) -> Self {
        Self::with(optimizer, GradScaler::default())
    }
}

impl<O, H, L, D> WithScaler<O, H, L, D>
where
    H: Precision,
    L: LossScale,
    D: MixedDevice<H>,
{
    /// `optimizer` with `scaler`.
    ///
    /// # Examples
    /// ```
    /// use dfdx::{optim::*, prelude::*};
    /// use mpx_runtime::{precision::f16, scaling::StaticLossScale, step::{GradScaler, WithScaler}};
    /// let model = Cpu::default().build_module::<Linear<2, 1>, f32>();
    /// let scaler = GradScaler::<f16, _>::new(StaticLossScale::new(128.0).unwrap());
    /// let opt = WithScaler::with(Sgd::<_, f32, Cpu>::new(&model, SgdConfig::default()), scaler);
    /// assert_eq!(opt.scaler().loss_scale(), 128.0);
    /// ```
    pub fn with(optimizer: O, scaler: GradScaler<H, L, D>) -> Self {
        Self { optimizer, scaler }
    }

    /// The scaler.
    ///
    /// # Examples
    /// See [`WithScaler`].
    pub fn scaler(&self) -> &GradScaler<H, L, D> {
        &self.scaler
    }

    /// The scaler, mutably (what `#[mixed_step(scaling = self.opt)]` reaches).
    ///
    /// # Examples
    /// ```
    /// use dfdx::{optim::*, prelude::*};
    /// use mpx_runtime::step::WithScaler;
    /// let model = Cpu::default().build_module::<Linear<2, 1>, f32>();
    /// let mut opt: WithScaler<Sgd<_, f32, Cpu>> = WithScaler::new(Sgd::new(&model, Default::default()));
    /// let state = opt.scaler_mut().state_dict();
    /// assert_eq!(state.applied_steps, 0);
    /// ```
    pub fn scaler_mut(&mut self) -> &mut GradScaler<H, L, D> {
        &mut self.scaler
    }

    /// The optimizer and the scaler.
    ///
    /// # Examples
    /// ```
    /// use dfdx::{optim::*, prelude::*};
    /// use mpx_runtime::step::WithScaler;
    /// let model = Cpu::default().build_module::<Linear<2, 1>, f32>();
    /// let opt: WithScaler<Sgd<_, f32, Cpu>> = WithScaler::new(Sgd::new(&model, Default::default()));
    /// let (opt, scaler) = opt.into_parts();
    /// assert_eq!(scaler.skipped_steps(), 0);
    /// # let _ = opt;
    /// ```
    pub fn into_parts(self) -> (O, GradScaler<H, L, D>) {
        (self.optimizer, self.scaler)
    }
}

impl<O, H: Precision, L: LossScale, D: MixedDevice<H>> Deref for WithScaler<O, H, L, D> {
    type Target = O;
    fn deref(&self) -> &O {
        &self.optimizer
    }
}

impl<O, H: Precision, L: LossScale, D: MixedDevice<H>> DerefMut for WithScaler<O, H, L, D> {
    fn deref_mut(&mut self) -> &mut O {
        &mut self.optimizer
    }
}

impl<M, Dev, E, O, H, L, D> Optimizer<M, Dev, E> for WithScaler<O, H, L, D>
where
    Dev: Storage<E>,
    E: Dtype,
    O: Optimizer<M, Dev, E>,
    H: Precision,
    L: LossScale,
    D: MixedDevice<H>,
{
    fn update(
        &mut self,
        module: &mut M,
        gradients: &Gradients<E, Dev>,
    ) -> Result<(), OptimizerUpdateError<Dev::Err>> {
        self.optimizer.update(module, gradients)
    }
}
