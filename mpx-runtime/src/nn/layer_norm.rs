//! [`LayerNorm1D`]: dfdx's layer norm with its statistics (and affine transform) in f32.

use dfdx::nn::tensor_collection::{ScalarOptions, TensorOptions};
use dfdx::shapes::{Axis, Const, Dtype, HasShape, Rank1};
use dfdx::tensor::{Cpu, CpuError, OwnedTape, Storage, Tensor};
use dfdx::tensor_ops::BroadcastTo;

use super::layer_impls::{build_on_device, mixed_module, module_collection, native_module};
use super::layer_norm_kernel::add_layer_norm;
use crate::region::FullPrecision;

/// Layer normalization over the last axis, as dfdx's
/// [`LayerNorm1D`](dfdx::nn::modules::LayerNorm1D) (same fields, same operation order), with the
/// whole normalization (mean, variance, scale by `gamma`, shift by `beta`) in an f32 region: a
/// row whose sum passes 65504 overflows dfdx's f16 layer norm, not this one. In a half precision
/// this is one fused op (read the half input, statistics and affine transform in f32, round the
/// output once); in f32, dfdx's operations.
///
/// With `f32` it is bit-identical to dfdx's layer, forward and gradients. Converts from and to
/// dfdx's with `From` (the tensors move, ids and all).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::precision::f16;
/// let dev = Cpu::default();
/// let ln = dev.build_module::<mpx_runtime::nn::LayerNorm1D<4>, f16>();
/// let x = dev.tensor([[40000.0f32, 40000.0, 1.0, 2.0]]).to_dtype::<f16>();
/// // dfdx's f16 layer norm: the row sum overflows, the output is NaN.
/// let plain: dfdx::nn::modules::LayerNorm1D<4, f16, Cpu> = ln.clone().into();
/// assert!(plain.forward(x.clone()).array()[0].iter().any(|v| v.is_nan()));
/// // mpx's: finite.
/// assert!(ln.forward(x).array()[0].iter().all(|v| v.is_finite()));
/// ```
#[derive(Debug, Clone)]
pub struct LayerNorm1D<const M: usize, E: Dtype = f32, D: Storage<E> = Cpu> {
    /// Scale, initialised to ones.
    pub gamma: Tensor<Rank1<M>, E, D>,
    /// Shift, initialised to zeros.
    pub beta: Tensor<Rank1<M>, E, D>,
    /// Added to the variance (default `1e-5`).
    pub epsilon: f64,
}

build_on_device!(LayerNorm1D[const M]);
native_module!(LayerNorm1D[const M]);

module_collection!(LayerNorm1D[const M] {
    tensor gamma: TensorOptions::reset_to_ones(),
    tensor beta: TensorOptions::reset_to_zeros(),
    scalar epsilon: ScalarOptions::from_default(1e-5),
});

mixed_module! {
    LayerNorm1D[const M], dims [],
    fn(self, x: Tensor<Rank1<M>, E, Cpu, T>) -> Tensor<Rank1<M>, E, Cpu, T> {
        let eps = self.epsilon;
        if !P::IDENTITY {
            return add_layer_norm::<P, E, M, _, T>(x, None, &self.gamma, &self.beta, eps);
        }
        // dfdx: x.normalize(eps) * gamma + beta (gamma and beta without a tape).
        FullPrecision::<P>::try_run_with(self, x, |ln, x| {
            x.normalize(eps) * ln.gamma.clone() + ln.beta.clone()
        })
        .map_err(CpuError::from)
    }
}

/// Batched inputs: the statistics run over the last axis `$ax`, as in dfdx.
macro_rules! batched {
    ($ax:literal; $($d:ident),+) => {
        mixed_module! {
            LayerNorm1D[const M], dims [$($d),+],
            fn(self, x: Tensor<($($d,)+ Const<M>), E, Cpu, T>) -> Tensor<($($d,)+ Const<M>), E, Cpu, T> {
                let eps = self.epsilon;
                if !P::IDENTITY {
                    return add_layer_norm::<P, E, M, _, T>(x, None, &self.gamma, &self.beta, eps);
                }
                FullPrecision::<P>::try_run_with(self, x, |ln, x| {
                    let shape = *x.shape();
                    let x = x.normalize::<Axis<$ax>>(eps);
                    let gamma = ln.gamma.retaped::<OwnedTape<f32, Cpu>>().broadcast_like(&shape);
                    let beta = ln.beta.retaped::<OwnedTape<f32, Cpu>>().broadcast_like(&shape);
                    x * gamma + beta
                })
                .map_err(CpuError::from)
            }
        }
    };
}
batched!(1; B);
batched!(2; B, S);
