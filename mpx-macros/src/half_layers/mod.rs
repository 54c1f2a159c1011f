//! `#[derive(HalfLayers)]` and `#[half_forward]`: a user's own module in a mixed step's mapped
//! working copy, its layers as mpx's, its forward code as written.
//!
//! * The derive ([`derive`]: parse the struct -> validate which parameters are the element type
//!   and the device, what each field is -> expand) writes `<Name>Working<consts.., H>`, the
//!   struct with every layer field as its mapped working copy (`<L as HalfLayers<H>>::Working`,
//!   checked to exist), every tensor field of the element type in `H`'s element type and every
//!   other field as it is; its `TensorCollection`; and `HalfLayers<H>` for `Name<.., f32, Cpu>`,
//!   which builds it field by field from the master.
//! * The attribute `#[half_forward]` ([`attribute`]) on each of the module's `Module` (or
//!   `ModuleMut`) impls, and on the inherent impls of the helper methods their code calls,
//!   writes the same impl for `<Name>Working` in f16, `AMP<f16>` and emulated bf16, with the
//!   element type and the device made concrete ([`concrete`]): the user's forward code,
//!   unchanged, runs on mpx's layers.
//!
//! ```text
//! #[derive(HalfLayers)]
//! struct Mlp<const I: usize, E: Dtype, D: Device<E>> { l1: Linear<I, 8, E, D>, act: ReLU, temp: f32 }
//! // struct MlpWorking<const I: usize, H: Precision> {
//! //     l1: <Linear<I, 8, f32, Cpu> as HalfLayers<H>>::Working, act: <ReLU as HalfLayers<H>>::Working, temp: f32 }
//! // impl<const I: usize, H> HalfLayers<H> for Mlp<I, f32, Cpu> { type Working = MlpWorking<I, H>; .. }
//! #[half_forward]
//! impl<const I: usize, E: Dtype, D: Device<E>, T: Tape<E, D>> Module<Tensor<Rank1<I>, E, D, T>> for Mlp<I, E, D> { .. }
//! // + the same impl for MlpWorking<I, f16> (E = f16, D = Cpu), MlpWorking<I, AMP<f16>>, MlpWorking<I, bf16> (E = f32)
//! ```

mod concrete;
mod derive;
mod forward;

pub(crate) use derive::expand as derive;
pub(crate) use forward::expand as attribute;

/// The precisions a working copy is made in, with the element type each stores: (precision,
/// element) as paths under the runtime's `precision` module.
const PRECISIONS: [(&str, &str); 3] = [("f16", "f16"), ("AMP<f16>", "AMP<f16>"), ("bf16", "f32")];

/// The working struct's name for module `name`.
fn working_name(name: &syn::Ident) -> syn::Ident {
    quote::format_ident!("{}Working", name)
}

/// The type parameter bounded by a trait whose last path segment is one of `traits` (`Dtype` for
/// the element type; `Device`, `Storage` for the device), when there is exactly one.
fn param_bounded_by(generics: &syn::Generics, traits: &[&str]) -> Option<syn::Ident> {
    let mut found = crate::syntax::params_bounded_by(generics, traits);
    (found.len() == 1).then(|| found.remove(0))
}
