//! The mixed-precision step: [`GradScaler`], the one state object, kept across steps like
//! PyTorch's `GradScaler`, and mpx's function API as thin functions over it.
//!
//! | mpx / jmp / PyTorch | here |
//! |---|---|
//! | PyTorch `scaler.scale(loss).backward(); scaler.step(opt); scaler.update()` | [`GradScaler::forward`], [`GradScaler::backward`], [`GradScaler::update`] (or `#[mixed_step]`, which writes them) |
//! | PyTorch `scaler.state_dict()` / `load_state_dict` | [`GradScaler::state_dict`] / [`GradScaler::load_state_dict`], or serde on the scaler itself |
//! | `mpx.filter_value_and_grad(func, scaling)(model, batch)` | [`filter_value_and_grad`]`(&master, &mut scaler, forward, loss)` |
//! | `mpx.filter_grad` | [`filter_grad`] (the same function) |
//! | `has_aux=True` | [`filter_value_and_grad_with_aux`] |
//! | `mpx.optimizer_update(model, optimizer, optimizer_state, grads, grads_finite)` | [`optimizer_update`]`(&mut master, &mut opt, &mut scaler, &grads)` |
//! | `optax.apply_if_finite(.., max_consecutive_errors)` | [`GradScaler::with_max_consecutive_skips`] (an error, never a bad update) |
//!
//! One scaler serves any number of master models (a GAN's generator and discriminator, an
//! actor and a critic, the models of successive folds): each master gets its own working copy,
//! each update is skipped on its own master's gradients, and the one loss scale is adjusted once
//! per iteration.
//!
//! # Examples
//! A complete training step, by hand:
//! ```
//! use dfdx::{optim::*, prelude::*};
//! use mpx_runtime::precision::f16;
//! use mpx_runtime::scaling::DynamicLossScale;
//! use mpx_runtime::step::GradScaler;
//!
//! let dev: Cpu = Default::default();
//! type Mlp = (Linear<8, 16>, ReLU, Linear<16, 3>);
//! let mut master = dev.build_module::<Mlp, f32>();
//! let mut opt = Adam::new(&master, AdamConfig { lr: 1e-2, ..Default::default() });
//! let mut scaler = GradScaler::<f16>::new(DynamicLossScale::builder().initial(65536.0).build().unwrap());
//!
//! let x: Tensor<Rank2<4, 8>, f32, _> = dev.sample_normal();
//! let labels: Tensor<Rank2<4, 3>, f32, _> = dev.tensor([[1.0, 0.0, 0.0]; 4]);
//! let mut grads = master.alloc_grads();
//! for _ in 0..3 {
//!     let logits = scaler.forward(&master, x.trace(grads), |m, x| m.forward(x));
//!     let loss = cross_entropy_with_logits_loss(logits, labels.clone());
//!     grads = scaler.backward(loss);
//!     scaler.update(&mut master, &mut opt, &grads)?;
//!     scaler.zero_grads(&master, &mut grads);
//! }
//! assert_eq!(scaler.applied_steps() + scaler.skipped_steps(), 3);
//! # Ok::<(), mpx_runtime::step::StepError>(())
//! ```

mod checkpoint;
mod clip;
mod device;
pub(crate) mod direct;
mod error;
mod function;
mod half_region;
mod layout;
// Used by devices whose tensors are not `Send` (`Cuda`); built and unit-tested everywhere.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod local;
mod mapped;
mod masters;
mod outcome;
mod report;
mod scaler;
pub(crate) mod unread;
mod working;
mod workspace;

pub use checkpoint::ScalerState;
pub use clip::{clip_grad_norm, grad_norm};
pub use device::MixedDevice;
pub use error::StepError;
/// mpx's `filter_grad`: [`filter_value_and_grad`] under mpx's other name (the loss value comes
/// with the gradients either way).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::{precision::bf16, step::{GradScaler, filter_grad}};
/// let dev: Cpu = Default::default();
/// let master = dev.build_module::<Linear<2, 2>, f32>();
/// let mut scaler = GradScaler::<bf16>::default();
/// let x = dev.tensor([[1.0f32, -1.0]]);
/// let g = filter_grad(&master, &mut scaler, |m, t| m.forward(x.clone().put_tape(t)), |o| o.sum())?;
/// assert!(g.grads_finite);
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
pub use function::filter_value_and_grad as filter_grad;
pub use function::{
    MixedGrads, filter_value_and_grad, filter_value_and_grad_with_aux, optimizer_update,
};
#[doc(hidden)]
pub use half_region::Region;
pub use half_region::{HalfInput, HalfOutput};
#[cfg(feature = "mpi")]
pub(crate) use layout::MasterSlot;
pub use layout::WorkingCopy;
pub use mapped::HalfLayers;
pub use outcome::{SkipReason, UpdateOutcome};
pub use report::StepReport;
pub use scaler::{GradScaler, MixedScaler, Verdict, scaler_of};
pub use working::WorkspaceOn;

/// Support for code `#[mixed_step]` generates. Not a public API.
#[doc(hidden)]
pub mod __macro_support {
    use std::marker::PhantomData;

    use dfdx::nn::tensor_collection::TensorCollection;
    use dfdx::tensor::Cpu;

    use super::{
        GradScaler, HalfInput, HalfLayers, HalfOutput, MixedDevice, WorkingCopy, WorkspaceOn,
    };
    use crate::boundary::MasterModel;
    use crate::precision::Precision;
    use crate::scaling::LossScale;

    /// `(expr).__mpx_by_mut()` borrows a place mutably whether it holds a value or a `&mut`
    /// reference (method-call autoref and reborrow), which a plain `&mut expr` cannot do for an
    /// immutable binding of a `&mut` parameter.
    pub trait ByMut {
        /// The place, mutably.
        fn __mpx_by_mut(&mut self) -> &mut Self {
            self
        }
    }
    impl<T: ?Sized> ByMut for T {}

    /// `(model).__mpx_master()` borrows a model however the step holds it (a value, a `&mut`
    /// binding, a field, a `Box`): method calls auto-deref until a module is found, which a
    /// generic function taking `&M` would not do.
    pub trait Master<E: dfdx::shapes::Dtype, D> {
        /// The model, shared.
        fn __mpx_master(&self) -> &Self {
            self
        }
        /// The model, mutably.
        fn __mpx_master_mut(&mut self) -> &mut Self {
            self
        }
    }
    impl<E: dfdx::shapes::Dtype, D, T> Master<E, D> for T
    where
        T: dfdx::nn::tensor_collection::TensorCollection<E, D>,
        D: dfdx::tensor_ops::Device<E>,
    {
    }

    /// A forward pass of a master, with the scaler it runs through, on the best working copy
    /// whose bounds hold (autoref specialisation): `ViaMapped` runs it on the working copy made
    /// of mpx's layers (a model that implements [`HalfLayers`]); else `ViaHalf` runs it on the
    /// master's own layers in half precision; where that cannot be type-checked either (a model
    /// whose type is a generic parameter of the `impl`), `ViaFull` runs it in f32 on the master
    /// itself. Method probing tries the receiver by value, then borrowed, then dereferenced:
    /// `(&mut &mut fwd).__mpx_forward(..)` finds `ViaMapped` (on `&mut Forward`) first,
    /// `ViaHalf` (on `&mut &mut Forward`) next, `ViaFull` (on `Forward`) last. `D` is the
    /// device the step's types name (the `Cpu` unless the step names `Cuda`).
    pub struct Forward<'a, H: Precision, L: LossScale, R, D = Cpu> {
        scaler: &'a mut GradScaler<H, L>,
        master: Option<R>,
        device: PhantomData<fn() -> D>,
    }

    /// The forward pass of `master` through `scaler`, on the `Cpu`.
    pub fn forward<H: Precision, L: LossScale, R>(
        scaler: &mut GradScaler<H, L>,
        master: R,
    ) -> Forward<'_, H, L, R> {
        forward_on::<Cpu, H, L, R>(scaler, master)
    }

    /// The forward pass of `master` through `scaler`, on device `D`.
    pub fn forward_on<D, H: Precision, L: LossScale, R>(
        scaler: &mut GradScaler<H, L>,
        master: R,
    ) -> Forward<'_, H, L, R, D> {
        Forward {
            scaler,
            master: Some(master),
            device: PhantomData,
        }
    }

    /// `&M` or `&mut M`: the master as the forward method needs it.
    pub trait Borrowed {
        /// The model.
        type Model;
        /// The model, shared.
        fn shared(&self) -> &Self::Model;
    }
    impl<M> Borrowed for &M {
        type Model = M;
        fn shared(&self) -> &M {
            self
        }
    }
    impl<M> Borrowed for &mut M {
        type Model = M;
        fn shared(&self) -> &M {
            self
        }
    }

    /// The forward pass on the half working copy.
    pub trait ViaHalf<H: Precision, D: MixedDevice<H>> {
        /// The master model.
        type Model: MasterModel<D>;
        /// Runs `f` on the working copy and `x` rounded to `H`; the output comes back in f32.
        fn __mpx_forward<X, Y, F>(&mut self, x: X, f: F) -> Y::Full
        where
            X: HalfInput<H, D>,
            Y: HalfOutput<H, D>,
            F: FnOnce(&mut WorkingCopy<H, Self::Model, D>, X::Half) -> Y;
    }

    /// The forward pass on the working copy made of mpx's layers.
    pub trait ViaMapped<H: Precision>
    where
        Cpu: MixedDevice<H>,
    {
        /// The master model.
        type Model: HalfLayers<H>;
        /// Runs `f` on the mapped working copy and `x` rounded to `H`; the output comes back in
        /// f32.
        fn __mpx_forward<X, Y, F>(&mut self, x: X, f: F) -> Y::Full
        where
            X: HalfInput<H>,
            Y: HalfOutput<H>,
            F: FnOnce(&mut <Self::Model as HalfLayers<H>>::Working, X::Half) -> Y;
    }

    impl<H, L, R> ViaMapped<H> for &mut Forward<'_, H, L, R>
    where
        H: Precision,
        L: LossScale,
        R: Borrowed,
        R::Model: HalfLayers<H> + Send + Sync + 'static,
        Cpu: MixedDevice<H>,
    {
        type Model = R::Model;
        fn __mpx_forward<X, Y, F>(&mut self, x: X, f: F) -> Y::Full
        where
            X: HalfInput<H>,
            Y: HalfOutput<H>,
            F: FnOnce(&mut <Self::Model as HalfLayers<H>>::Working, X::Half) -> Y,
        {
            match self.master.as_ref() {
                Some(m) => self.scaler.forward_mapped(m.shared(), x, f),
                None => panic!("a mixed forward pass ran twice"),
            }
        }
    }

    // the second `&mut` is the ladder's middle rung (see `Forward`)
    #[allow(clippy::mut_mut)]
    impl<H, L, R, D> ViaHalf<H, D> for &mut &mut Forward<'_, H, L, R, D>
    where
        H: Precision,
        L: LossScale,
        R: Borrowed,
        D: MixedDevice<H>,
        R::Model: MasterModel<D> + 'static,
        WorkingCopy<H, R::Model, D>: TensorCollection<H::Elem, D> + WorkspaceOn<D>,
    {
        type Model = R::Model;
        fn __mpx_forward<X, Y, F>(&mut self, x: X, f: F) -> Y::Full
        where
            X: HalfInput<H, D>,
            Y: HalfOutput<H, D>,
            F: FnOnce(&mut WorkingCopy<H, Self::Model, D>, X::Half) -> Y,
        {
            match self.master.as_ref() {
                Some(m) => self.scaler.forward(m.shared(), x, f),
                None => panic!("a mixed forward pass ran twice"),
            }
        }
    }

    /// The forward pass in f32, on the master itself.
    pub trait ViaFull<R> {
        /// Runs `f` on the master and `x` as they are.
        fn __mpx_forward<X, Y, F: FnOnce(R, X) -> Y>(&mut self, x: X, f: F) -> Y;
    }

    impl<H, L, R, D> ViaFull<R> for Forward<'_, H, L, R, D>
    where
        H: Precision,
        L: LossScale,
        R: Borrowed,
        D: MixedDevice<H>,
        R::Model: MasterModel<D>,
    {
        fn __mpx_forward<X, Y, F: FnOnce(R, X) -> Y>(&mut self, x: X, f: F) -> Y {
            let Some(master) = self.master.take() else {
                panic!("a mixed forward pass ran twice")
            };
            if let Err(e) = self.scaler.forward_full::<R::Model, D>(master.shared()) {
                panic!("mixed-precision forward pass failed: {e}");
            }
            f(master, x)
        }
    }

    /// A shared borrow of what the user passed as the gradients (`&grads`, or a `&mut`
    /// binding, which coerces), without moving a `&mut` binding.
    pub fn shared<T: ?Sized>(t: &T) -> &T {
        t
    }
}
