//! Procedural macros of [mpx](https://docs.rs/mpx-dfdx) (the `mpx-dfdx` package, library `mpx`).
//! Use them through the `mpx` crate, which re-exports them; generated code names the runtime as
//! `::mpx::__private` (override with `crate = "path"`).
//!
//! Each macro lives in its own module as parse -> validate -> expand.

use proc_macro::TokenStream;

mod autocast;
mod cast_derive;
mod ctxt;
#[cfg(test)]
mod expanded_examples;
mod full_precision;
mod mixed_step;
mod ops;

/// Derives `mpx::Cast` (and `mpx::cast::FloatLeaves`) for a struct, so that
/// `cast_to_half_precision` and friends reach its fields.
#[proc_macro_derive(Cast, attributes(cast))]
pub fn derive_cast(input: TokenStream) -> TokenStream {
    cast_derive::expand(input.into()).into()
}

/// Runs the body of a function in f32 inside a half-precision graph, gradients flowing through.
#[proc_macro_attribute]
pub fn full_precision(args: TokenStream, item: TokenStream) -> TokenStream {
    full_precision::expand(args.into(), item.into()).into()
}

/// Turns an f32 dfdx training step into the mixed-precision recipe.
#[proc_macro_attribute]
pub fn mixed_step(args: TokenStream, item: TokenStream) -> TokenStream {
    mixed_step::expand(args.into(), item.into()).into()
}

/// Runs each precision-critical operation of a function in f32, inside a half-precision graph:
/// compile-time autocast.
///
/// Every call of an operation of PyTorch autocast's f32 list, in dfdx's names (the losses;
/// `softmax`, `log_softmax`, `logsumexp`, `exp`, `ln`, `sum`, `mean`, `var`, `stddev`,
/// `normalize`, `powf`, `powi`, `recip` and their `try_` forms), becomes a full-precision region,
/// `mpx::region::FullPrecision::<H>::run(x, |x| x.op(..))`: its tensors are copied to f32, the
/// operation runs in f32 and its result comes back in the caller's half type `H`, gradients
/// flowing through. The rest of the body (matmuls, adds, activations) is untouched and runs in
/// `H`. A chain of operations (`x.exp().sum()`) is one region; a loss's prediction and target
/// enter together. With `H = f32` the function is bit-identical to the same function without the
/// attribute, forward and gradients.
///
/// Arguments, all optional: `half = H` (the caller's precision; found automatically when one type
/// parameter is bounded by `Precision` or `HalfPrecision`; needed on an `impl Module` method whose
/// `H` belongs to the `impl`), `skip = (sum, ..)` (operations to leave in `H`), `crate = "path"`
/// (the `mpx` facade's path). A method whose receiver cannot be a tensor (a literal, a range,
/// `self` or its fields, an iterator: `v.iter().sum()`) is left alone; write a scalar method as a
/// path call (`f32::exp(v)`) or use `skip` to keep any other call out. CPU only. See
/// `docs/dsl.md`.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx::autocast;
/// use mpx::precision::{Precision, f16};
///
/// // Layer norm's statistics: a row summing past 65504 overflows f16 without the attribute.
/// #[autocast]
/// fn norm_then_scale<H: Precision, T: Tape<H::Elem, Cpu>>(
///     x: Tensor<Rank2<2, 4>, H::Elem, Cpu, T>,
///     w: Tensor<Rank2<2, 4>, H::Elem, Cpu>,
/// ) -> Tensor<Rank2<2, 4>, H::Elem, Cpu, T>
/// where
///     Cpu: Device<H::Elem>,
/// {
///     x.normalize::<Axis<1>>(1e-5) * w // normalize runs in f32, the product in H
/// }
///
/// let dev = Cpu::default();
/// let x = dev.tensor([[30000.0f32, 30000.0, 30000.0, 1.0], [1.0, 2.0, 3.0, 4.0]]);
/// let w: Tensor<Rank2<2, 4>, f32, Cpu> = dev.ones();
/// let y = norm_then_scale::<f16, _>(x.clone().to_dtype::<f16>(), w.to_dtype::<f16>());
/// assert!(y.as_vec().iter().all(|v| v.is_finite()));
/// let plain = x.to_dtype::<f16>().normalize::<Axis<1>>(1e-5);
/// assert!(plain.as_vec().iter().any(|v| !v.is_finite()));
/// ```
#[proc_macro_attribute]
pub fn autocast(args: TokenStream, item: TokenStream) -> TokenStream {
    autocast::expand(args.into(), item.into()).into()
}
