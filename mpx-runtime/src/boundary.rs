//! Compile-time precision boundaries: trait bounds whose error messages say what to do when a
//! half-precision value reaches a place that needs full precision.
//!
//! (Contract written first; refined with the DSL.)

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::tensor::Cpu;

/// An f32 master model: what optimizers update and the mixed step casts from.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an f32 master model",
    label = "a half-precision model cannot be the master",
    note = "keep the master in f32 (e.g. `dev.build_module::<Model, f32>()`); the mixed step casts a half working copy itself"
)]
pub trait MasterModel: TensorCollection<f32, Cpu> {}

impl<M: TensorCollection<f32, Cpu>> MasterModel for M {}
