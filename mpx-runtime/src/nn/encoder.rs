//! [`TransformerEncoderBlock`] and [`TransformerEncoder`]: dfdx's encoder built from the
//! mixed-ready [`LayerNorm1D`] and [`MultiHeadAttention`].

use dfdx::nn::modules::Repeated;
use dfdx::shapes::Const;
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Tensor};

use super::layer_impls::{build_on_device, composite_layer, mixed_module, native_module};
use super::layer_norm::LayerNorm1D;
use super::mha::MultiHeadAttention;
use super::mixed::MixedModule;
use super::sublayer::{FeedForward, add_norm, feed_forward_norm};
use crate::precision::Precision;

composite_layer! {
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
    pub struct TransformerEncoderBlock<const MODEL_DIM, const NUM_HEADS, const FF_DIM> {
        /// Self-attention.
        pub self_attn: MultiHeadAttention<MODEL_DIM, NUM_HEADS, MODEL_DIM, MODEL_DIM, E, D>,
        /// Layer norm after the attention's residual add.
        pub norm1: LayerNorm1D<MODEL_DIM, E, D>,
        /// Feed-forward network with its residual.
        pub ff: FeedForward<MODEL_DIM, FF_DIM, E, D>,
        /// Layer norm after the feed-forward residual.
        pub norm2: LayerNorm1D<MODEL_DIM, E, D>,
    }
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

/// The block on `(S, M)` and `(B, S, M)` sequences.
macro_rules! block_forward {
    ($($d:ident),+) => {
        mixed_module! {
            TransformerEncoderBlock[const M, const H, const F], dims [$($d),+],
            fn(self, src: Tensor<($($d,)+ Const<M>), E, Cpu, T>)
                -> Tensor<($($d,)+ Const<M>), E, Cpu, T>
            {
                let (src, tape) = src.split_tape();
                let x = MixedModule::<P, _>::try_mixed_forward(
                    &self.self_attn,
                    src.clone().put_tape(tape),
                )?;
                let x = add_norm::<P, E, M, _, T>(x, src, &self.norm1)?;
                feed_forward_norm::<P, E, M, F, _, T>(x, &self.ff, &self.norm2)
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
