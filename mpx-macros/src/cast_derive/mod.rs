//! `#[derive(Cast)]`: implements `Cast<P>` and `FloatLeaves` for a struct, so that
//! `cast_to_half_precision` and friends reach its fields.
//!
//! parse ([`parse`]: attributes and fields) -> validate ([`validate`]: which type parameter is the
//! dtype, what a skipped field may hold) -> expand ([`expand`]: the two impls). Every independent
//! mistake is collected and reported together, each with its span.
//!
//! ```text
//! #[derive(Cast)]
//! struct Batch<E: Dtype> {
//!     x: Tensor<Rank2<8, 64>, E, Cpu>,     // cast
//!     y: Tensor<Rank1<8>, usize, Cpu>,     // cast (an integer tensor casts to itself)
//!     #[cast(skip)] name: String,          // cloned as is
//! }
//! // impl<E: Dtype, __P: Precision> Cast<__P> for Batch<E>
//! //     where Tensor<Rank2<8, 64>, E, Cpu>: Cast<__P, Output = Tensor<Rank2<8, 64>, __P::Elem, Cpu>>, ...
//! // { type Output = Batch<<__P as Precision>::Elem>; ... }
//! ```

mod expand;
mod parse;
mod validate;

use proc_macro2::TokenStream;

use crate::ctxt::Ctxt;

/// Entry point of `#[derive(Cast)]`: the generated impls, or the collected errors.
pub(crate) fn expand(input: TokenStream) -> TokenStream {
    let input: syn::DeriveInput = match syn::parse2(input) {
        Ok(input) => input,
        Err(err) => return err.to_compile_error(),
    };
    let mut cx = Ctxt::default();
    let parsed = parse::parse(&input, &mut cx);
    let plan = validate::validate(&parsed, &mut cx);
    match (cx.check(), plan) {
        (Ok(()), Some(plan)) => expand::expand(&plan),
        (Err(err), _) => err.to_compile_error(),
        (Ok(()), None) => TokenStream::new(),
    }
}

#[cfg(test)]
mod tests;
