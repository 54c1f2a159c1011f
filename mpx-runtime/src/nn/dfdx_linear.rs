//! A dfdx `Linear` inside mpx's layers: its parameters as a layer visits them
//! ([`linear_params!`], with dfdx's initialisation) and its forward in a precision
//! ([`linear_in`]: dfdx's own op in f32, mpx's fused op in a half precision).

use dfdx::nn::modules::Linear as DfdxLinear;
use dfdx::nn::tensor_collection::TensorOptions;
use dfdx::nn::{BuildModule, Module};
use dfdx::shapes::{Dtype, Rank1, Rank2, Shape};
use dfdx::tensor::{Cpu, CpuError, Tape, Tensor};
use dfdx::tensor_ops::Device;
use mpx_kernels::Activation;

use super::fused_linear::fused_linear;
use crate::precision::Precision;

/// The fields `weight` and `bias` of a layer with dfdx-`Linear`'s parameters, as its
/// `TensorCollection::iter_tensors` visits them (names, order and initialisation of dfdx's
/// `Linear`): the fused [`Linear`](super::Linear)'s and [`MxLinear`](crate::mx::MxLinear)'s.
macro_rules! linear_params {
    () => {
        (
            Self::tensor(
                "weight",
                |s| &s.weight,
                |s| &mut s.weight,
                $crate::nn::dfdx_linear::linear_weight_options(),
            ),
            Self::tensor(
                "bias",
                |s| &s.bias,
                |s| &mut s.bias,
                $crate::nn::dfdx_linear::linear_bias_options(),
            ),
        )
    };
}
pub(crate) use linear_params;

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

/// dfdx's `Linear` `l` on `x` (output shaped `out`) in precision `P`: dfdx's own operations in
/// f32 (bit-identical to dfdx's layer), the fused op ([`fused_linear`], no activation) in a half
/// precision. For the layers that hold a dfdx `Linear` alone (the ViT's patch embedding and head).
pub(crate) fn linear_in<P, E, const I: usize, const O: usize, Sx, Sy, T>(
    l: &super::Linear<I, O, E, Cpu>,
    x: Tensor<Sx, E, Cpu, T>,
    out: Sy,
) -> Result<Tensor<Sy, E, Cpu, T>, CpuError>
where
    P: Precision<Elem = E>,
    E: Precision<Elem = E> + Dtype,
    Cpu: Device<E>,
    Sx: Shape,
    Sy: Shape,
    T: Tape<E, Cpu>,
    DfdxLinear<I, O, E, Cpu>:
        Module<Tensor<Sx, E, Cpu, T>, Output = Tensor<Sy, E, Cpu, T>, Error = CpuError>,
{
    if P::IDENTITY {
        return l.as_dfdx().try_forward(x);
    }
    fused_linear::<P, E, I, O, _, _, _>(&l.weight, &l.bias, Activation::Identity, l.link(), x, out)
}
