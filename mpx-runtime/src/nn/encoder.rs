//! [`TransformerEncoderBlock`] and [`TransformerEncoder`]: dfdx's encoder built from the
//! mixed-ready [`LayerNorm1D`] and [`MultiHeadAttention`].

use dfdx::nn::Module;
use dfdx::nn::modules::{self, Linear, ReLU, Repeated, Residual};
use dfdx::shapes::{Const, Dim, Dtype, HasShape};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Storage, Tape, Tensor};
use dfdx::tensor_ops::{Device, TryAdd};

use super::convert::dfdx_layer;
use super::fused_linear::fused_linear;
use super::layer_impls::{build_on_device, module_collection, native_module};
use super::layer_norm::LayerNorm1D;
use super::layer_norm_kernel::add_layer_norm;
use super::mha::MultiHeadAttention;
use super::mixed::MixedModule;
use crate::kernels::Activation;
use crate::precision::Precision;

/// The feed-forward part of an encoder block: `x + Linear(ReLU(Linear(x)))`, all in the half
/// type (dfdx's own modules), as in dfdx's encoder block.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::{FeedForward, TransformerEncoderBlock};
/// let dev = Cpu::default();
/// let block = dev.build_module::<TransformerEncoderBlock<4, 2, 8>, f32>();
/// let ff: &FeedForward<4, 8, f32, Cpu> = &block.ff;
/// let x: Tensor<Rank1<4>, f32, Cpu> = dev.zeros();
/// // x + W2 relu(W1 x + b1) + b2 at x = 0 is W2 relu(b1) + b2.
/// let want = ff.0.2.forward(ff.0.0.bias.clone().relu());
/// assert_eq!(ff.forward(x).array(), want.array());
/// ```
pub type FeedForward<const M: usize, const F: usize, E, D> =
    Residual<(Linear<M, F, E, D>, ReLU, Linear<F, M, E, D>)>;

/// A transformer encoder block, as dfdx's
/// [`TransformerEncoderBlock`](dfdx::nn::modules::TransformerEncoderBlock) (post-norm: same
/// fields, same operation order): `x = norm1(x + self_attn(x)); norm2(x + ff(x))`.
///
/// Its layer norms and attention softmax run in f32. In a half precision each residual add is
/// fused into the layer norm after it (the sum in f32, not rounded), and the feed-forward
/// `Linear`s run as fused ops on mpx's GEMM (f32 sums, outputs rounded once to the half type);
/// in f32 the block runs dfdx's operations.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::TransformerEncoderBlock;
/// use mpx_runtime::precision::f16;
/// let dev = Cpu::default();
/// let block = dev.build_module::<TransformerEncoderBlock<8, 2, 16>, f16>();
/// let x: Tensor<Rank3<1, 2, 8>, f32, Cpu> = dev.tensor([[[20000.0; 8], [0.5; 8]]]);
/// let y = block.forward(x.to_dtype::<f16>());
/// assert!(y.array()[0].iter().flatten().all(|v| v.is_finite()));
/// ```
#[derive(Debug, Clone)]
pub struct TransformerEncoderBlock<
    const MODEL_DIM: usize,
    const NUM_HEADS: usize,
    const FF_DIM: usize,
    E: Dtype = f32,
    D: Storage<E> = Cpu,
> {
    /// Self-attention.
    pub self_attn: MultiHeadAttention<MODEL_DIM, NUM_HEADS, MODEL_DIM, MODEL_DIM, E, D>,
    /// Layer norm after the attention's residual add.
    pub norm1: LayerNorm1D<MODEL_DIM, E, D>,
    /// Feed-forward network with its residual.
    pub ff: FeedForward<MODEL_DIM, FF_DIM, E, D>,
    /// Layer norm after the feed-forward residual.
    pub norm2: LayerNorm1D<MODEL_DIM, E, D>,
}

/// A stack of `NUM_LAYERS` [`TransformerEncoderBlock`]s, as dfdx's `TransformerEncoder` (a
/// `Repeated`, whose `modules` field holds the blocks).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::TransformerEncoder;
/// let dev = Cpu::default();
/// let enc = dev.build_module::<TransformerEncoder<8, 2, 16, 3>, f32>();
/// assert_eq!(enc.modules.len(), 3);
/// let y = enc.forward(dev.sample_normal::<Rank2<4, 8>>());
/// assert_eq!(y.shape(), &(Const::<4>, Const::<8>));
/// ```
pub type TransformerEncoder<
    const MODEL_DIM: usize,
    const NUM_HEADS: usize,
    const FF_DIM: usize,
    const NUM_LAYERS: usize,
    E = f32,
    D = Cpu,
> = Repeated<TransformerEncoderBlock<MODEL_DIM, NUM_HEADS, FF_DIM, E, D>, NUM_LAYERS>;

build_on_device!(TransformerEncoderBlock[const M, const H, const F]);
native_module!(TransformerEncoderBlock[const M, const H, const F]);

module_collection!(TransformerEncoderBlock[const M, const H, const F] { self_attn, norm1, ff, norm2 });

impl<const M: usize, const H: usize, const F: usize, E: Dtype, D: Storage<E>>
    From<modules::TransformerEncoderBlock<M, H, F, E, D>>
    for TransformerEncoderBlock<M, H, F, E, D>
{
    fn from(m: modules::TransformerEncoderBlock<M, H, F, E, D>) -> Self {
        Self {
            self_attn: m.self_attn.into(),
            norm1: m.norm1.into(),
            ff: m.ff,
            norm2: m.norm2.into(),
        }
    }
}

impl<const M: usize, const H: usize, const F: usize, E: Dtype, D: Storage<E>>
    From<TransformerEncoderBlock<M, H, F, E, D>>
    for modules::TransformerEncoderBlock<M, H, F, E, D>
{
    fn from(m: TransformerEncoderBlock<M, H, F, E, D>) -> Self {
        Self {
            self_attn: m.self_attn.into(),
            norm1: m.norm1.into(),
            ff: m.ff,
            norm2: m.norm2.into(),
        }
    }
}

dfdx_layer!(TransformerEncoderBlock[const M, const H, const F]);

/// The block on `(S, M)` and `(B, S, M)` sequences.
macro_rules! block_forward {
    ($($d:ident),+) => {
        impl<const M: usize, const H: usize, const F: usize, E, P, $($d,)+ T>
            MixedModule<P, Tensor<($($d,)+ Const<M>), E, Cpu, T>>
            for TransformerEncoderBlock<M, H, F, E, Cpu>
        where
            E: Precision<Elem = E> + Dtype,
            P: Precision<Elem = E>,
            Cpu: Device<E>,
            $($d: Dim,)+
            T: Tape<E, Cpu>,
        {
            type Output = Tensor<($($d,)+ Const<M>), E, Cpu, T>;
            fn try_mixed_forward(
                &self,
                src: Tensor<($($d,)+ Const<M>), E, Cpu, T>,
            ) -> Result<Self::Output, CpuError> {
                let (src, tape) = src.split_tape();
                let x = MixedModule::<P, _>::try_mixed_forward(
                    &self.self_attn,
                    src.clone().put_tape(tape),
                )?;
                if !P::IDENTITY {
                    // Half precision: each residual add fused into its layer norm, the
                    // feed-forward layers as fused ops on mpx's GEMM.
                    let (n1, n2) = (&self.norm1, &self.norm2);
                    let x = add_layer_norm::<P, E, M, _, T>(x, Some(src), &n1.gamma, &n1.beta, n1.epsilon)?;
                    let (x, tape) = x.split_tape();
                    let shape = *x.shape();
                    let (l1, _, l2) = &self.ff.0;
                    #[allow(non_snake_case)]
                    let ($($d,)+ _) = shape;
                    let hidden = ($($d,)+ Const::<F>);
                    let h = fused_linear::<P, E, M, F, _, _, _>(&l1.weight, &l1.bias, Activation::ReLU, x.clone().put_tape(tape), hidden)?;
                    let f = fused_linear::<P, E, F, M, _, _, _>(&l2.weight, &l2.bias, Activation::Identity, h, shape)?;
                    return add_layer_norm::<P, E, M, _, T>(f, Some(x), &n2.gamma, &n2.beta, n2.epsilon);
                }
                let x = x.try_add(src)?;
                let x = MixedModule::<P, _>::try_mixed_forward(&self.norm1, x)?;
                let x = self.ff.try_forward(x)?;
                MixedModule::<P, _>::try_mixed_forward(&self.norm2, x)
            }
        }
    };
}
block_forward!(S);
block_forward!(B, S);

/// A stack runs its layers in order, each in precision `P` (dfdx's `Repeated` does the same for
/// `Module`).
impl<P: Precision, X, L: MixedModule<P, X, Output = X>, const N: usize> MixedModule<P, X>
    for Repeated<L, N>
{
    type Output = X;
    fn try_mixed_forward(&self, mut x: X) -> Result<X, CpuError> {
        for layer in &self.modules {
            x = layer.try_mixed_forward(x)?;
        }
        Ok(x)
    }
}
