//! A dfdx `Linear` inside mpx's layers: its parameters as a layer visits them
//! ([`linear_collection!`], with dfdx's initialisation).

use dfdx::nn::BuildModule;
use dfdx::nn::modules::Linear as DfdxLinear;
use dfdx::nn::tensor_collection::TensorOptions;
use dfdx::shapes::{Dtype, Rank1, Rank2};
use dfdx::tensor_ops::Device;

/// Implements dfdx's `TensorCollection` for a layer with dfdx-`Linear`'s parameters, the fields
/// `weight` and `bias` (names, order and initialisation of dfdx's `Linear`): the fused
/// [`Linear`](super::Linear)'s and [`MxLinear`](crate::mx::MxLinear)'s.
///
/// `linear_collection!([X: Bound] Layer<I, O, .., E, D, ..> => Layer<I, O, .., E2, D2, ..>,
/// |weight, bias| layer)`: the layer's parameters beyond `I`, `O`, `E` and `D`, its type, the
/// type it is rebuilt as, and how it is made of its two tensors.
macro_rules! linear_collection {
    ([$($g:tt)*] $layer:ty => $to:ty, |$w:ident, $b:ident| $make:expr $(,)?) => {
        impl<const I: usize, const O: usize, E, D, $($g)*>
            dfdx::nn::tensor_collection::TensorCollection<E, D> for $layer
        where
            E: dfdx::shapes::Dtype,
            D: dfdx::tensor_ops::Device<E>,
            dfdx::nn::modules::Linear<I, O, E, D>: dfdx::nn::BuildModule<D, E>,
        {
            type To<E2: dfdx::shapes::Dtype, D2: dfdx::tensor_ops::Device<E2>> = $to;

            fn iter_tensors<V: dfdx::nn::tensor_collection::ModuleVisitor<Self, E, D>>(
                visitor: &mut V,
            ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
                let weight = $crate::nn::dfdx_linear::linear_weight_options();
                let bias = $crate::nn::dfdx_linear::linear_bias_options();
                visitor.visit_fields(
                    (
                        Self::tensor("weight", |s| &s.weight, |s| &mut s.weight, weight),
                        Self::tensor("bias", |s| &s.bias, |s| &mut s.bias, bias),
                    ),
                    |($w, $b)| $make,
                )
            }
        }
    };
}
pub(crate) use linear_collection;

/// The options of a layer's dfdx-`Linear` weight: trained, and reset as dfdx's `Linear` is
/// (uniform in ±1/sqrt(I)), by building one. Shared by every layer with `Linear`'s parameters.
pub(crate) fn linear_weight_options<const I: usize, const O: usize, E: Dtype, D: Device<E>>()
-> TensorOptions<Rank2<O, I>, E, D>
where
    DfdxLinear<I, O, E, D>: BuildModule<D, E>,
{
    TensorOptions::reset_with(|t| {
        *t = DfdxLinear::<I, O, E, D>::try_build(t.device())?.weight;
        Ok(())
    })
}

/// The options of a layer's dfdx-`Linear` bias (see [`linear_weight_options`]).
pub(crate) fn linear_bias_options<const I: usize, const O: usize, E: Dtype, D: Device<E>>()
-> TensorOptions<Rank1<O>, E, D>
where
    DfdxLinear<I, O, E, D>: BuildModule<D, E>,
{
    TensorOptions::reset_with(|t| {
        *t = DfdxLinear::<I, O, E, D>::try_build(t.device())?.bias;
        Ok(())
    })
}
