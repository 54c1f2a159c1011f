//! [`TransformerDecoderBlock`], [`TransformerDecoder`] and [`Transformer`]: dfdx's decoder and
//! encoder-decoder built from the mixed-ready [`LayerNorm1D`] and [`MultiHeadAttention`].

use dfdx::nn::modules::{self, Repeated};
use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection};
use dfdx::shapes::{Const, Dtype};
use dfdx::tensor::{Cpu, CpuError, NoneTape, PutTape, SplitTape, Storage, Tape, Tensor};
use dfdx::tensor_ops::Device;

use super::encoder::TransformerEncoder;
use super::layer_impls::{build_on_device, composite_layer, mixed_module, native_module};
use super::layer_norm::LayerNorm1D;
use super::mha::MultiHeadAttention;
use super::mixed::MixedModule;
use super::sublayer::{FeedForward, add_norm, feed_forward_norm};
use crate::precision::{AMP, Precision, f16};

composite_layer! {
    /// A transformer decoder block, as dfdx's
    /// [`TransformerDecoderBlock`](dfdx::nn::modules::TransformerDecoderBlock) (post-norm: same
    /// fields, same operation order): `x = norm1(tgt + self_attn(tgt));
    /// x = norm2(x + mh_attn(x, mem, mem)); norm3(ff(x))`, on a `(target, memory)` pair.
    ///
    /// Its layer norms and attention softmax run in f32. In a half precision each residual add is
    /// fused into the layer norm after it (the sum in f32, not rounded), and the attention
    /// projections and feed-forward `Linear`s run as fused ops on mpx's GEMM; in f32 the block runs
    /// dfdx's operations.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::nn::TransformerDecoderBlock;
    /// use mpx_runtime::precision::f16;
    /// let dev = Cpu::default();
    /// let block = dev.build_module::<TransformerDecoderBlock<8, 2, 16>, f16>();
    /// let tgt: Tensor<Rank3<1, 3, 8>, f32, Cpu> = dev.sample_normal();
    /// let mem: Tensor<Rank3<1, 5, 8>, f32, Cpu> = dev.sample_normal();
    /// let (tgt, mem) = (tgt.to_dtype::<f16>(), mem.to_dtype::<f16>());
    /// let y = block.forward((tgt, mem));
    /// assert!(y.array()[0].iter().flatten().all(|v| v.is_finite()));
    /// ```
    #[derive(Debug, Clone)]
    pub struct TransformerDecoderBlock<const MODEL_DIM, const NUM_HEADS, const FF_DIM> {
        /// Self-attention over the target.
        pub self_attn: MultiHeadAttention<MODEL_DIM, NUM_HEADS, MODEL_DIM, MODEL_DIM, E, D>,
        /// Layer norm after the self-attention's residual add.
        pub norm1: LayerNorm1D<MODEL_DIM, E, D>,
        /// Attention of the target over the memory (the encoder's output).
        pub mh_attn: MultiHeadAttention<MODEL_DIM, NUM_HEADS, MODEL_DIM, MODEL_DIM, E, D>,
        /// Layer norm after the memory attention's residual add.
        pub norm2: LayerNorm1D<MODEL_DIM, E, D>,
        /// Feed-forward network with its residual.
        pub ff: FeedForward<MODEL_DIM, FF_DIM, E, D>,
        /// Layer norm after the feed-forward residual.
        pub norm3: LayerNorm1D<MODEL_DIM, E, D>,
    }
}

/// A stack of `NUM_LAYERS` [`TransformerDecoderBlock`]s, as dfdx's `TransformerDecoder` (a
/// newtype of `Repeated`): each block gets the same memory.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::TransformerDecoder;
/// let dev = Cpu::default();
/// let dec = dev.build_module::<TransformerDecoder<8, 2, 16, 2>, f32>();
/// assert_eq!(dec.0.modules.len(), 2);
/// let y = dec.forward((dev.sample_normal::<Rank2<3, 8>>(), dev.sample_normal::<Rank2<4, 8>>()));
/// assert_eq!(y.shape(), &(Const::<3>, Const::<8>));
/// ```
#[derive(Debug, Clone)]
pub struct TransformerDecoder<
    const MODEL_DIM: usize,
    const NUM_HEADS: usize,
    const FF_DIM: usize,
    const NUM_LAYERS: usize,
    E: Dtype = f32,
    D: Storage<E> = Cpu,
>(pub Repeated<TransformerDecoderBlock<MODEL_DIM, NUM_HEADS, FF_DIM, E, D>, NUM_LAYERS>);

composite_layer! {
    /// An encoder-decoder transformer, as dfdx's `Transformer`: the decoder attends to the encoder's
    /// output; `forward((src, tgt))`.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::nn::Transformer;
    /// let dev = Cpu::default();
    /// let t = dev.build_module::<Transformer<8, 2, 1, 1, 16>, f32>();
    /// let y = t.forward((dev.sample_normal::<Rank2<5, 8>>(), dev.sample_normal::<Rank2<3, 8>>()));
    /// assert_eq!(y.shape(), &(Const::<3>, Const::<8>));
    /// ```
    #[derive(Debug, Clone)]
    pub struct Transformer<
        const MODEL_DIM,
        const NUM_HEADS,
        const NUM_ENCODER_LAYERS,
        const NUM_DECODER_LAYERS,
        const FF_DIM,
    > {
        /// The encoder.
        pub encoder: TransformerEncoder<MODEL_DIM, NUM_HEADS, FF_DIM, NUM_ENCODER_LAYERS, E, D>,
        /// The decoder.
        pub decoder: TransformerDecoder<MODEL_DIM, NUM_HEADS, FF_DIM, NUM_DECODER_LAYERS, E, D>,
    }
}

build_on_device!(TransformerDecoderBlock[const M, const H, const F]);
native_module!(TransformerDecoderBlock[const M, const H, const F]);
build_on_device!(TransformerDecoder[const M, const H, const F, const L]);
native_module!(TransformerDecoder[const M, const H, const F, const L]);
build_on_device!(Transformer[const M, const H, const A, const B, const F]);
native_module!(Transformer[const M, const H, const A, const B, const F]);

/// `TensorCollection` of the decoder stack, for each float element: its one field, `0`, as
/// dfdx's visits it.
macro_rules! decoder_collection {
    ($($e:ty),*) => {$(
        impl<const M: usize, const H: usize, const F: usize, const L: usize, D: Device<$e>>
            TensorCollection<$e, D> for TransformerDecoder<M, H, F, L, $e, D>
        {
            type To<E2: Dtype, D2: Device<E2>> = TransformerDecoder<M, H, F, L, E2, D2>;

            fn iter_tensors<V: ModuleVisitor<Self, $e, D>>(
                visitor: &mut V,
            ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
                visitor.visit_fields(Self::module("0", |s| &s.0, |s| &mut s.0), TransformerDecoder)
            }
        }
    )*};
}
decoder_collection!(f32, f16, AMP<f16>);

/// Block by block, both ways.
fn blocks<A: Into<B>, B, const L: usize>(r: Repeated<A, L>) -> Repeated<B, L> {
    Repeated {
        modules: r.modules.into_iter().map(Into::into).collect(),
    }
}

impl<const M: usize, const H: usize, const F: usize, const L: usize, E: Dtype, D: Storage<E>>
    From<modules::TransformerDecoder<M, H, F, L, E, D>> for TransformerDecoder<M, H, F, L, E, D>
{
    fn from(m: modules::TransformerDecoder<M, H, F, L, E, D>) -> Self {
        Self(blocks(m.0))
    }
}

impl<const M: usize, const H: usize, const F: usize, const L: usize, E: Dtype, D: Storage<E>>
    From<TransformerDecoder<M, H, F, L, E, D>> for modules::TransformerDecoder<M, H, F, L, E, D>
{
    fn from(m: TransformerDecoder<M, H, F, L, E, D>) -> Self {
        Self(blocks(m.0))
    }
}

impl<const M: usize, const H: usize, const A: usize, const B: usize, const F: usize, E, D>
    From<modules::Transformer<M, H, A, B, F, E, D>> for Transformer<M, H, A, B, F, E, D>
where
    E: Dtype,
    D: Storage<E>,
{
    fn from(m: modules::Transformer<M, H, A, B, F, E, D>) -> Self {
        Self {
            encoder: blocks(m.encoder),
            decoder: m.decoder.into(),
        }
    }
}

impl<const M: usize, const H: usize, const A: usize, const B: usize, const F: usize, E, D>
    From<Transformer<M, H, A, B, F, E, D>> for modules::Transformer<M, H, A, B, F, E, D>
where
    E: Dtype,
    D: Storage<E>,
{
    fn from(m: Transformer<M, H, A, B, F, E, D>) -> Self {
        Self {
            encoder: blocks(m.encoder),
            decoder: m.decoder.into(),
        }
    }
}

/// The block on `(S, M)` and `(B, S, M)` targets, with `(S2, M)` and `(B, S2, M)` memories.
macro_rules! block_forward {
    ([$($g:ident),+] ($($t:ident),+) ($($m:ident),+)) => {
        mixed_module! {
            TransformerDecoderBlock[const M, const H, const F], dims [$($g),+],
            fn(
                self,
                (tgt, mem): (Tensor<($($t,)+ Const<M>), E, Cpu, T>, Tensor<($($m,)+ Const<M>), E, Cpu>)
            ) -> Tensor<($($t,)+ Const<M>), E, Cpu, T> {
                let (tgt, tape) = tgt.split_tape();
                let x = MixedModule::<P, _>::try_mixed_forward(
                    &self.self_attn,
                    tgt.clone().put_tape(tape),
                )?;
                let x = add_norm::<P, E, M, _, T>(x, tgt, &self.norm1)?;
                let (x, tape) = x.split_tape();
                let a = MixedModule::<P, _>::try_mixed_forward(
                    &self.mh_attn,
                    (x.clone().put_tape(tape), mem.clone(), mem),
                )?;
                let x = add_norm::<P, E, M, _, T>(a, x, &self.norm2)?;
                feed_forward_norm::<P, E, M, F, _, T>(x, &self.ff, &self.norm3)
            }
        }
    };
}
block_forward!([S, S2](S)(S2));
block_forward!([B, S, S2](B, S)(B, S2));

/// A decoder stack runs its blocks in order, each on the same memory.
impl<const M: usize, const H: usize, const F: usize, const L: usize, E, P, Tgt, Mem>
    MixedModule<P, (Tgt, Mem)> for TransformerDecoder<M, H, F, L, E, Cpu>
where
    E: Dtype,
    P: Precision,
    Mem: Clone,
    TransformerDecoderBlock<M, H, F, E, Cpu>: MixedModule<P, (Tgt, Mem), Output = Tgt>,
{
    type Output = Tgt;
    fn try_mixed_forward(&self, (mut tgt, mem): (Tgt, Mem)) -> Result<Tgt, CpuError> {
        for block in &self.0.modules {
            tgt = block.try_mixed_forward((tgt, mem.clone()))?;
        }
        Ok(tgt)
    }
}

/// The encoder's output is the decoder's memory; its tape goes on with the target, as in dfdx.
impl<
    const M: usize,
    const H: usize,
    const A: usize,
    const B: usize,
    const F: usize,
    E,
    P,
    S1,
    S2,
    T,
> MixedModule<P, (Tensor<S1, E, Cpu, T>, Tensor<S2, E, Cpu, NoneTape>)>
    for Transformer<M, H, A, B, F, E, Cpu>
where
    E: Dtype,
    P: Precision,
    Cpu: Device<E>,
    S1: dfdx::shapes::Shape,
    S2: dfdx::shapes::Shape,
    T: Tape<E, Cpu>,
    TransformerEncoder<M, H, F, A, E, Cpu>:
        MixedModule<P, Tensor<S1, E, Cpu, T>, Output = Tensor<S1, E, Cpu, T>>,
    TransformerDecoder<M, H, F, B, E, Cpu>:
        MixedModule<P, (Tensor<S2, E, Cpu, T>, Tensor<S1, E, Cpu>), Output = Tensor<S2, E, Cpu, T>>,
{
    type Output = Tensor<S2, E, Cpu, T>;
    fn try_mixed_forward(
        &self,
        (src, tgt): (Tensor<S1, E, Cpu, T>, Tensor<S2, E, Cpu, NoneTape>),
    ) -> Result<Self::Output, CpuError> {
        let (mem, tape) = self.encoder.try_mixed_forward(src)?.split_tape();
        self.decoder.try_mixed_forward((tgt.put_tape(tape), mem))
    }
}

#[cfg(test)]
mod tests {
    use dfdx::nn::{DeviceBuildExt, Module, builders};
    use dfdx::shapes::Rank3;
    use dfdx::tensor::{AsArray, SampleTensor, Trace};
    use dfdx::tensor_ops::{Backward, SumTo};

    use super::*;
    use crate::nn::{Dfdx, IntoLayers, Mpx};

    /// In f32, mpx's transformer computes dfdx's, and converts back to the same tensors.
    #[test]
    fn the_f32_transformer_is_dfdxs() {
        let dev = Cpu::seed_from_u64(2);
        let theirs = dev.build_module::<builders::Transformer<8, 2, 1, 2, 16>, f32>();
        let ours: Transformer<8, 2, 1, 2, 16, f32, Cpu> = theirs.clone().into_layers(Mpx);
        let src: Tensor<Rank3<2, 5, 8>, f32, Cpu> = dev.sample_normal();
        let tgt: Tensor<Rank3<2, 3, 8>, f32, Cpu> = dev.sample_normal();
        let want = theirs.forward((src.leaky_trace(), tgt.clone()));
        let got = ours.forward((src.leaky_trace(), tgt));
        for (g, w) in got.as_vec().iter().zip(want.as_vec()) {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{g} vs {w}");
        }
        // the gradient reaches the encoder through the memory
        let grads = got.sum::<dfdx::shapes::Rank0, _>().backward();
        let g = grads.get(&ours.encoder.modules[0].norm2.gamma).array();
        assert!(g.iter().any(|v| *v != 0.0), "{g:?}");
        let back = ours.into_layers(Dfdx);
        assert_eq!(
            back.decoder.0.modules[1].norm3.gamma.array(),
            theirs.decoder.0.modules[1].norm3.gamma.array()
        );
    }
}
