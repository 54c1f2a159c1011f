//! Procedural macros of [mpx](https://docs.rs/mpx-dfdx) (the `mpx-dfdx` package, library `mpx`).
//! Use them through the `mpx` crate, which re-exports them; generated code names the runtime as
//! `::mpx::__private` (override with `crate = "path"`).
//!
//! Each macro lives in its own module as parse -> validate -> expand.

use proc_macro::TokenStream;

mod cast_derive;
mod ctxt;
mod full_precision;
mod mixed_step;
#[allow(dead_code)] // used by #[autocast]
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
