//! Compile-time precision boundaries: trait bounds whose error messages say what to do when a
//! half-precision value reaches a place that needs full precision.
//!
//! | boundary | trait | where it is required |
//! |---|---|---|
//! | the master model is f32 | [`MasterModel`] | [`step::filter_value_and_grad`](crate::step::filter_value_and_grad), [`step::optimizer_update`](crate::step::optimizer_update), `#[mixed_step]` |
//! | an input tensor is f32 | [`FullPrecisionTensor`] | [`cast_input`], the input of a `#[mixed_step]` forward pass |
//!
//! Each trait carries a `#[diagnostic::on_unimplemented]` message, so the compiler error names
//! the boundary and the fix rather than a dfdx trait. Emulated bf16 is stored in f32, so an
//! emulated-bf16 tensor or model passes these checks: the boundary is about storage, and there
//! f32 is what the mixed step expects.

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::shapes::Shape;
use dfdx::tensor::{Cpu, OwnedTape, PutTape, Tensor};

use crate::cast::Cast;
use crate::precision::Precision;

/// An f32 master model: what optimizers update and the mixed step casts its working copy from.
///
/// Implemented for every dfdx module (any [`TensorCollection`]) stored in f32. A model built in
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
pub trait MasterModel: TensorCollection<f32, Cpu> {}

impl<M: TensorCollection<f32, Cpu>> MasterModel for M {}

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
pub fn require_master<M: MasterModel>(model: &M) -> &M {
    model
}

/// An f32 tensor (no tape): what the mixed step's forward pass takes as input before casting it
/// to the half type itself.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::boundary::FullPrecisionTensor;
/// fn needs_f32<X: FullPrecisionTensor>(_: &X) {}
/// let dev = Cpu::default();
/// needs_f32(&dev.tensor([1.0f32, 2.0]));
/// ```
///
/// A half tensor does not compile:
/// ```compile_fail
/// use dfdx::prelude::*;
/// use mpx_runtime::boundary::FullPrecisionTensor;
/// use mpx_runtime::precision::f16;
/// fn needs_f32<X: FullPrecisionTensor>(_: &X) {}
/// let dev = Cpu::default();
/// needs_f32(&dev.tensor([1.0f32, 2.0]).to_dtype::<f16>());
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an f32 tensor, and this API requires full precision",
    label = "expected an f32 tensor without a tape",
    note = "pass the f32 tensor (the mixed step casts its input to the half type itself); cast a half tensor up with `mpx::cast::cast_to_f32(&t)`, or run half-precision code in f32 with `#[full_precision]`"
)]
pub trait FullPrecisionTensor {
    /// The tensor's shape.
    type Shape: Shape;
    /// The tensor itself, as an f32 tensor.
    fn as_f32(&self) -> &Tensor<Self::Shape, f32, Cpu>;
}

impl<S: Shape> FullPrecisionTensor for Tensor<S, f32, Cpu> {
    type Shape = S;
    fn as_f32(&self) -> &Tensor<S, f32, Cpu> {
        self
    }
}

/// Casts an f32 input to half precision `H` and puts `tape` on it: the entry of the half forward
/// pass in a mixed step (what `#[mixed_step]` generates for `x.traced(grads)`).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::boundary::cast_input;
/// use mpx_runtime::precision::f16;
/// let dev = Cpu::default();
/// let x = dev.tensor([1.0f32, 65520.0]);
/// let h = cast_input::<f16, _>(&x, OwnedTape::default());
/// assert_eq!(h.retaped::<NoneTape>().array(), [f16::ONE, f16::INFINITY]);
/// ```
pub fn cast_input<H: Precision, X: FullPrecisionTensor>(
    x: &X,
    tape: OwnedTape<H::Elem, Cpu>,
) -> Tensor<X::Shape, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>
where
    Tensor<X::Shape, f32, Cpu>: Cast<H, Output = Tensor<X::Shape, H::Elem, Cpu>>,
{
    Cast::<H>::cast(x.as_f32()).put_tape(tape)
}
