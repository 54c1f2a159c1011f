//! Compile-time precision boundaries: trait bounds whose error messages say what to do when a
//! half-precision value reaches a place that needs full precision.
//!
//! | boundary | trait | where it is required |
//! |---|---|---|
//! | the master model is f32 | [`MasterModel`] | [`GradScaler::forward`](crate::step::GradScaler::forward), [`GradScaler::update`](crate::step::GradScaler::update), `#[mixed_step]` |
//! | a forward pass's input is f32 (or integer) | [`HalfInput`](crate::step::HalfInput) | [`GradScaler::forward`](crate::step::GradScaler::forward), the traced batch of a `#[mixed_step]` |
//!
//! Each trait carries a `#[diagnostic::on_unimplemented]` message, so the compiler error names
//! the boundary and the fix rather than a dfdx trait. Emulated bf16 is stored in f32, so an
//! emulated-bf16 tensor or model passes these checks: the boundary is about storage, and there
//! f32 is what the mixed step expects.

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::tensor::Cpu;
use dfdx::tensor_ops::Device;

/// An f32 master model: what optimizers update and the mixed step casts its working copy from.
///
/// Implemented for every dfdx module (any [`TensorCollection`]) stored in f32, on any dfdx device
/// `D` (the `Cpu` unless named; `Cuda` with the `cuda` feature). A model built in
/// `f16` or `AMP<f16>` is not a master: the error says to keep the master in f32 and let the
/// mixed step cast.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::boundary::MasterModel;
/// fn takes_master<M: MasterModel>(_: &M) {}
/// let dev = Cpu::default();
/// takes_master(&dev.build_module::<Linear<2, 3>, f32>());
/// ```
///
/// A half model does not compile:
/// ```compile_fail
/// use dfdx::prelude::*;
/// use mpx_runtime::boundary::MasterModel;
/// use mpx_runtime::precision::f16;
/// fn takes_master<M: MasterModel>(_: &M) {}
/// let dev = Cpu::default();
/// takes_master(&dev.build_module::<Linear<2, 3>, f16>());
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an f32 master model",
    label = "a half-precision model cannot be the master",
    note = "keep the master in f32 (`dev.build_module::<Model, f32>()`): the mixed step casts its own half working copy, and optimizers must never run on half weights (Adam's eps = 1e-8 is 0 in f16)"
)]
pub trait MasterModel<D: Device<f32> = Cpu>: TensorCollection<f32, D> {}

impl<D: Device<f32>, M: TensorCollection<f32, D>> MasterModel<D> for M {}

/// Checks at compile time that `model` is an f32 [`MasterModel`], and hands it back.
///
/// `#[mixed_step]` calls it on the step's model before anything else, so a half-precision model
/// is reported with [`MasterModel`]'s message, at the model, ahead of the errors that follow from it.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::boundary::require_master;
/// let dev = Cpu::default();
/// let model = dev.build_module::<Linear<2, 3>, f32>();
/// assert_eq!(require_master(&model).weight.array(), model.weight.array());
/// ```
pub fn require_master<D: Device<f32>, M: MasterModel<D>>(model: &M) -> &M {
    model
}
