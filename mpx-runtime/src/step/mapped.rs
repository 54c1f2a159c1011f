//! [`HalfLayers`]: the working copy of a model of dfdx's layers built from mpx's fused layers,
//! and the cast from the master into it by visit order.
//!
//! A model's plain working copy is `<M as TensorCollection<f32, Cpu>>::To<f16, Cpu>`: dfdx's own
//! layers in f16, which run on dfdx's scalar f16 kernels. For a model made of dfdx's stable
//! layers (`Linear`, the activations, `Embedding`, `LayerNorm1D`, `BatchNorm1D`, dropout,
//! `MultiHeadAttention`, transformer encoder blocks) and its containers (tuples, `Residual`,
//! `GeneralizedResidual`, `Repeated`, `AddInto`, `SplitInto`), the working copy can instead be
//! made of mpx's layers where mpx has one: the fused [`nn::Linear`](crate::nn::Linear) (f16
//! storage, f32 sums on mpx's GEMM, and direct f32 gradients into the master's inside a
//! [`GradScaler`](super::GradScaler)), with a `ReLU` right after it in a tuple run in its op, and
//! the mixed-ready transformer layers of [`mpx::nn`](crate::nn); the other layers stay dfdx's,
//! in the half type. The model's type does not change:
//! [`GradScaler::forward_mapped`](super::GradScaler::forward_mapped) runs on it, and
//! `#[mixed_step]` picks it wherever the model implements [`HalfLayers`].
//!
//! mpx's `Linear` visits `weight (O, I)` then `bias (O,)` as dfdx's does, and each transformer
//! layer visits dfdx's fields in dfdx's order, so the mapped working copy's tensors line up with
//! the master's by position: the cast walks the master into one f32 buffer, rounds it, and walks
//! the working copy filling its tensors in the same order; the non-tensor settings (a norm's
//! `epsilon` and `momentum`, dropout's `p`) are copied by [`HalfLayers::copy_scalars`] on every
//! cast, and the `(Linear, ReLU)` pairs linked. Every count and length is checked
//! ([`StepError::WorkspaceMismatch`](super::StepError) otherwise).

use dfdx::nn::BuildModule;
use dfdx::nn::modules::{
    AddInto, Embedding as DfdxEmbedding, GeneralizedResidual, LayerNorm1D as DfdxLayerNorm1D,
    Linear as DfdxLinear, MultiHeadAttention as DfdxMultiHeadAttention, Repeated, Residual,
    SplitInto, Transformer as DfdxTransformer, TransformerDecoder as DfdxDecoder,
    TransformerDecoderBlock as DfdxDecoderBlock, TransformerEncoderBlock as DfdxEncoderBlock,
};
use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::tensor::Cpu;
use dfdx::tensor_ops::Device;

use super::error::StepError;
use super::layout::first_device;
use crate::boundary::MasterModel;
use crate::cast::{CastScratch, cast_by_position};
use crate::precision::{AMP, Precision, bf16, f16};

/// A master model whose working copy in precision `H` can be built from mpx's fused layers:
/// - dfdx's `Linear<I, O>` becomes mpx's fused [`FusedLinear`](crate::nn::FusedLinear) in
///   `H::Elem`; a `ReLU` right after it in a tuple runs in its op (the `ReLU` becomes a
///   [`LinkedReLU`](crate::nn::LinkedReLU) that passes its input through), any other `ReLU` is a
///   `LinkedReLU` that applies it;
/// - `LayerNorm1D`, `MultiHeadAttention` and `TransformerEncoderBlock` become their mixed-ready
///   [`mpx::nn`](crate::nn) counterparts (layer-norm statistics and softmax in f32, matmuls on
///   mpx's GEMM), so a `TransformerEncoder` (dfdx's `Repeated` of blocks) maps too;
/// - `Embedding<V, M>`, `BatchNorm1D<C>`, `UnbiasedLinear<I, O>` and `LeakyReLU` become dfdx's
///   own in `H::Elem` (a gather; the batch norm's running statistics are written back to the
///   master on an applied update; the leaky slope is rounded to `H`);
/// - `Exp`, `Ln`, `Softmax` and `LogSoftmax` (autocast's float32 list) run in an f32 region
///   ([`InF32`](crate::nn::InF32)); the other parameter-free layers (`Tanh`, `Sigmoid`,
///   `FastGeLU`, `AccurateGeLU`, `Abs`, `Square`, `Sqrt`, `Sin`, `Cos`, `Dropout`,
///   `DropoutOneIn`) stay themselves;
/// - `Residual`, `GeneralizedResidual`, `Repeated`, `AddInto`, `SplitInto` and tuples of up to 6
///   such layers map their layers.
///
/// A model with a layer outside this list (a module of the user's own, dfdx's decoder) does not
/// implement it, and runs whole on its plain working copy. The choice is per model, not per
/// module: a per-module fallback would need a blanket impl for "any other module" beside these,
/// which stable Rust's coherence rules (no specialisation) do not allow.
///
/// Each counterpart visits dfdx's tensors in dfdx's order, with the same shapes and trainable
/// flags (the cast goes by position), and takes the same inputs (`(S, M)` and `(B, S, M)`
/// sequences, attention's `(q, k, v)` tuples).
///
/// Implemented for `H` = [`f16`](struct@f16), [`AMP<f16>`] and emulated [`bf16`](struct@bf16).
/// In emulated bf16 the working copy is mpx's layers of f32 elements, which the step's forward
/// pass runs in bf16 (products of bf16 operands, on `vdpbf16ps` where the CPU has AVX512-BF16;
/// outputs and gradients rounded to bf16). A model with any other layer does not implement it
/// and keeps the plain working copy ([`WorkingCopy`](super::WorkingCopy)).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::{nn, precision::f16, step::HalfLayers};
/// type Master = (Linear<4, 8>, ReLU, Linear<8, 2>);
/// type Built = <Master as BuildOnDevice<Cpu, f32>>::Built;
/// type Working = <Built as HalfLayers<f16>>::Working;
/// let dev = Cpu::default();
/// // mpx's fused Linear, the ReLU it applies, mpx's fused Linear; built as any dfdx model
/// let w = Working::build(&dev);
/// assert_eq!(w.2.weight.shape(), &(Const::<2>, Const::<8>));
/// let _: (nn::FusedLinear<4, 8, f16, Cpu, nn::Activation>, nn::LinkedReLU, _) = w;
/// ```
pub trait HalfLayers<H: Precision>: MasterModel
where
    Cpu: Device<H::Elem>,
{
    /// The working copy, made of mpx's layers, with the master's tensors in the same order.
    type Working: TensorCollection<H::Elem, Cpu> + BuildModule<Cpu, H::Elem> + Send + Sync + 'static;

    /// Copies the master's non-tensor parameters (a layer norm's `epsilon`), which the cast by
    /// visit order does not carry, into `working`. Layers without any do nothing.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{nn, precision::f16, step::HalfLayers};
    /// let dev = Cpu::default();
    /// let mut master = dev.build_module::<LayerNorm1D<4>, f32>();
    /// master.epsilon = 1e-3;
    /// let mut w = dev.build_module::<nn::LayerNorm1D<4>, f16>();
    /// HalfLayers::<f16>::copy_scalars(&master, &mut w);
    /// assert_eq!(w.epsilon, 1e-3);
    /// ```
    fn copy_scalars(&self, working: &mut Self::Working) {
        let _ = working;
    }

    /// Whether this layer is dfdx's `ReLU` (a `Linear` right before it in a tuple applies it).
    const RELU: bool = false;

    /// Makes `working` (this layer's working copy) apply the `ReLU` that follows it in a tuple;
    /// returns whether it can (a `Linear` can: its fused op applies it).
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{nn, precision::f16, step::HalfLayers};
    /// let dev = Cpu::default();
    /// let mut w = nn::FusedLinear::<2, 1, f16, Cpu, nn::Activation>::new(
    ///     dev.tensor([[1.0f32, 1.0]]).to_dtype::<f16>(),
    ///     dev.zeros(),
    /// );
    /// assert!(<modules::Linear<2, 1, f32, Cpu> as HalfLayers<f16>>::fuse_relu(&mut w));
    /// assert!(<ReLU as HalfLayers<f16>>::RELU);
    /// let y = w.forward(dev.tensor([[-1.0f32, -2.0]]).to_dtype::<f16>());
    /// assert_eq!(y.array(), [[f16::from_f32(0.0)]]);
    /// ```
    fn fuse_relu(working: &mut Self::Working) -> bool {
        let _ = working;
        false
    }

    /// Makes `working` (a `ReLU`'s working copy) pass its input through, the layer before it
    /// having applied it ([`LinkedReLU`](crate::nn::LinkedReLU)).
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{nn::LinkedReLU, precision::f16, step::HalfLayers};
    /// let mut w = LinkedReLU::default();
    /// <ReLU as HalfLayers<f16>>::applied_before(&mut w);
    /// assert!(w.is_applied_before());
    /// ```
    fn applied_before(working: &mut Self::Working) {
        let _ = working;
    }
}

/// dfdx's `Linear` to mpx's fused one (its activation chosen when the working copy is linked:
/// a `ReLU` after it runs in its op), `ReLU` to [`LinkedReLU`](crate::nn::LinkedReLU), the other
/// parameter-free layers to themselves, for one precision.
macro_rules! layers {
    ($($h:ty),*) => {$(
        impl<const I: usize, const O: usize> HalfLayers<$h> for DfdxLinear<I, O, f32, Cpu> {
            type Working =
                crate::nn::FusedLinear<I, O, <$h as Precision>::Elem, Cpu, crate::nn::Activation>;
            fn fuse_relu(working: &mut Self::Working) -> bool {
                working.set_activation(crate::nn::Activation::ReLU);
                true
            }
        }
        impl HalfLayers<$h> for dfdx::nn::modules::ReLU {
            type Working = crate::nn::LinkedReLU;
            const RELU: bool = true;
            fn applied_before(working: &mut Self::Working) {
                *working = crate::nn::LinkedReLU::applied_before();
            }
        }
        activations!($h: Tanh, Sigmoid, FastGeLU, AccurateGeLU, Abs, Square, Sqrt, Sin, Cos);
        in_f32!($h: Exp, Ln, Softmax, LogSoftmax);
        impl<const N: usize> HalfLayers<$h> for dfdx::nn::modules::DropoutOneIn<N> {
            type Working = Self;
        }
        impl HalfLayers<$h> for dfdx::nn::modules::Dropout {
            type Working = Self;
            fn copy_scalars(&self, working: &mut Self::Working) {
                working.p = self.p;
            }
        }
        impl<const I: usize, const O: usize> HalfLayers<$h>
            for dfdx::nn::modules::UnbiasedLinear<I, O, f32, Cpu>
        {
            type Working = dfdx::nn::modules::UnbiasedLinear<I, O, <$h as Precision>::Elem, Cpu>;
        }
        impl HalfLayers<$h> for dfdx::nn::modules::LeakyReLU<f32> {
            type Working = dfdx::nn::modules::LeakyReLU<<$h as Precision>::Elem>;
            fn copy_scalars(&self, working: &mut Self::Working) {
                let mut slope = [<$h as Precision>::Elem::default()];
                <$h as Precision>::round(&[self.0], &mut slope);
                working.0 = slope[0];
            }
        }
        impl<const C: usize> HalfLayers<$h> for dfdx::nn::modules::BatchNorm1D<C, f32, Cpu> {
            type Working = dfdx::nn::modules::BatchNorm1D<C, <$h as Precision>::Elem, Cpu>;
            fn copy_scalars(&self, working: &mut Self::Working) {
                working.epsilon = self.epsilon;
                working.momentum = self.momentum;
            }
        }
    )*};
}

/// The layers on autocast's float32 list run in an f32 region ([`InF32`](crate::nn::InF32)).
macro_rules! in_f32 {
    ($h:ty: $($a:ident),*) => {$(
        impl HalfLayers<$h> for dfdx::nn::modules::$a {
            type Working = crate::nn::InF32<dfdx::nn::modules::$a>;
        }
    )*};
}

macro_rules! activations {
    ($h:ty: $($a:ident),*) => {$(
        impl HalfLayers<$h> for dfdx::nn::modules::$a {
            type Working = dfdx::nn::modules::$a;
        }
    )*};
}

layers!(f16, AMP<f16>, bf16);

/// dfdx's layers with an `mpx::nn` counterpart that visits the same tensors in the same order
/// (same shapes, same trainable flags, the same scalars): `LayerNorm1D`, `MultiHeadAttention`
/// and `TransformerEncoderBlock` map to mpx's, `Embedding` to dfdx's own in `H` (a gather).
/// The unit tests below check each by visiting both.
macro_rules! transformer_layers {
    ($($h:ty),*) => {$(
        impl<const M: usize> HalfLayers<$h> for DfdxLayerNorm1D<M, f32, Cpu> {
            type Working = crate::nn::LayerNorm1D<M, <$h as Precision>::Elem, Cpu>;
            fn copy_scalars(&self, working: &mut Self::Working) {
                working.epsilon = self.epsilon;
            }
        }
        impl<const M: usize, const NH: usize, const K: usize, const V: usize> HalfLayers<$h>
            for DfdxMultiHeadAttention<M, NH, K, V, f32, Cpu>
        {
            type Working = crate::nn::MultiHeadAttention<M, NH, K, V, <$h as Precision>::Elem, Cpu>;
        }
        impl<const M: usize, const NH: usize, const F: usize> HalfLayers<$h>
            for DfdxEncoderBlock<M, NH, F, f32, Cpu>
        {
            type Working = crate::nn::TransformerEncoderBlock<M, NH, F, <$h as Precision>::Elem, Cpu>;
            fn copy_scalars(&self, working: &mut Self::Working) {
                working.norm1.epsilon = self.norm1.epsilon;
                working.norm2.epsilon = self.norm2.epsilon;
            }
        }
        impl<const M: usize, const NH: usize, const F: usize> HalfLayers<$h>
            for DfdxDecoderBlock<M, NH, F, f32, Cpu>
        {
            type Working = crate::nn::TransformerDecoderBlock<M, NH, F, <$h as Precision>::Elem, Cpu>;
            fn copy_scalars(&self, working: &mut Self::Working) {
                working.norm1.epsilon = self.norm1.epsilon;
                working.norm2.epsilon = self.norm2.epsilon;
                working.norm3.epsilon = self.norm3.epsilon;
            }
        }
        impl<const M: usize, const NH: usize, const F: usize, const L: usize> HalfLayers<$h>
            for DfdxDecoder<M, NH, F, L, f32, Cpu>
        {
            type Working = crate::nn::TransformerDecoder<M, NH, F, L, <$h as Precision>::Elem, Cpu>;
            fn copy_scalars(&self, working: &mut Self::Working) {
                HalfLayers::<$h>::copy_scalars(&self.0, &mut working.0);
            }
        }
        impl<const M: usize, const NH: usize, const A: usize, const B: usize, const F: usize>
            HalfLayers<$h> for DfdxTransformer<M, NH, A, B, F, f32, Cpu>
        {
            type Working = crate::nn::Transformer<M, NH, A, B, F, <$h as Precision>::Elem, Cpu>;
            fn copy_scalars(&self, working: &mut Self::Working) {
                HalfLayers::<$h>::copy_scalars(&self.encoder, &mut working.encoder);
                HalfLayers::<$h>::copy_scalars(&self.decoder, &mut working.decoder);
            }
        }
        impl<const V: usize, const M: usize> HalfLayers<$h> for DfdxEmbedding<V, M, f32, Cpu> {
            type Working = DfdxEmbedding<V, M, <$h as Precision>::Elem, Cpu>;
        }
    )*};
}

transformer_layers!(f16, AMP<f16>, bf16);

/// A stack maps layer by layer (dfdx's `TransformerEncoder` is a `Repeated` of blocks).
impl<H: Precision, T: HalfLayers<H>, const N: usize> HalfLayers<H> for Repeated<T, N>
where
    Cpu: Device<H::Elem>,
    Repeated<T, N>: MasterModel,
    Repeated<T::Working, N>: TensorCollection<H::Elem, Cpu> + BuildModule<Cpu, H::Elem>,
{
    type Working = Repeated<T::Working, N>;
    fn copy_scalars(&self, working: &mut Self::Working) {
        for (m, w) in self.modules.iter().zip(&mut working.modules) {
            m.copy_scalars(w);
        }
    }
}

/// A residual maps its inner model (the add stays dfdx's, in `H`).
impl<H: Precision, F: HalfLayers<H>> HalfLayers<H> for Residual<F>
where
    Cpu: Device<H::Elem>,
    Residual<F>: MasterModel,
    Residual<F::Working>: TensorCollection<H::Elem, Cpu> + BuildModule<Cpu, H::Elem>,
{
    type Working = Residual<F::Working>;
    fn copy_scalars(&self, working: &mut Self::Working) {
        self.0.copy_scalars(&mut working.0);
    }
}

/// A generalized residual maps both of its branches.
impl<H: Precision, F: HalfLayers<H>, R: HalfLayers<H>> HalfLayers<H> for GeneralizedResidual<F, R>
where
    Cpu: Device<H::Elem>,
    GeneralizedResidual<F, R>: MasterModel,
    GeneralizedResidual<F::Working, R::Working>:
        TensorCollection<H::Elem, Cpu> + BuildModule<Cpu, H::Elem>,
{
    type Working = GeneralizedResidual<F::Working, R::Working>;
    fn copy_scalars(&self, working: &mut Self::Working) {
        self.f.copy_scalars(&mut working.f);
        self.r.copy_scalars(&mut working.r);
    }
}

/// `AddInto` and `SplitInto` map their tuple of branches.
macro_rules! branches {
    ($($c:ident),*) => {$(
        impl<H: Precision, T: HalfLayers<H>> HalfLayers<H> for $c<T>
        where
            Cpu: Device<H::Elem>,
            $c<T>: MasterModel,
            $c<T::Working>: TensorCollection<H::Elem, Cpu> + BuildModule<Cpu, H::Elem>,
        {
            type Working = $c<T::Working>;
            fn copy_scalars(&self, working: &mut Self::Working) {
                self.0.copy_scalars(&mut working.0);
            }
        }
    )*};
}
branches!(AddInto, SplitInto);

/// Tuples map element by element; a `ReLU` right after a `Linear` runs in the `Linear`'s fused
/// op (`$a . $i -> $b . $j` lists the neighbours).
macro_rules! tuple {
    ($($m:ident . $i:tt),+ ; $($a:ident . $x:tt -> $b:ident . $y:tt),*) => {
        impl<H: Precision, $($m: HalfLayers<H>),+> HalfLayers<H> for ($($m,)+)
        where
            Cpu: Device<H::Elem>,
            ($($m,)+): MasterModel,
            ($($m::Working,)+): TensorCollection<H::Elem, Cpu> + BuildModule<Cpu, H::Elem>,
        {
            type Working = ($($m::Working,)+);
            fn copy_scalars(&self, working: &mut Self::Working) {
                $(self.$i.copy_scalars(&mut working.$i);)+
                $(if $b::RELU && $a::fuse_relu(&mut working.$x) {
                    $b::applied_before(&mut working.$y);
                })*
            }
        }
    };
}
tuple!(A.0;);
tuple!(A.0, B.1; A.0 -> B.1);
tuple!(A.0, B.1, C.2; A.0 -> B.1, B.1 -> C.2);
tuple!(A.0, B.1, C.2, D.3; A.0 -> B.1, B.1 -> C.2, C.2 -> D.3);
tuple!(A.0, B.1, C.2, D.3, G.4; A.0 -> B.1, B.1 -> C.2, C.2 -> D.3, D.3 -> G.4);
tuple!(A.0, B.1, C.2, D.3, G.4, J.5; A.0 -> B.1, B.1 -> C.2, C.2 -> D.3, D.3 -> G.4, G.4 -> J.5);

/// The mapped working copy of `master`, built the first time (`half` is `None`), then cast from
/// the master in place by position ([`cast_by_position`]: every count, length and trainable flag
/// checked), with the settings that are not tensors copied and the `(Linear, ReLU)` pairs linked.
pub(crate) fn refresh<H, M>(
    master: &M,
    half: Option<M::Working>,
    scratch: &mut CastScratch,
) -> Result<M::Working, StepError>
where
    H: Precision,
    M: HalfLayers<H>,
    Cpu: Device<H::Elem>,
{
    let mut half = match half {
        Some(half) => half,
        // on the master's device (its random state: dropout), as the plain working copy is
        None => M::Working::try_build(&first_device::<f32, Cpu, M>(master)?.unwrap_or_default())?,
    };
    cast_by_position::<H, f32, M, M::Working>(master, &mut half, scratch)?;
    master.copy_scalars(&mut half);
    Ok(half)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dfdx::nn::builders;
    use dfdx::nn::modules::{
        BatchNorm1D, Dropout, DropoutOneIn, Embedding, LayerNorm1D, Linear, MultiHeadAttention,
        ReLU, Sigmoid, Tanh, TransformerEncoder, TransformerEncoderBlock,
    };
    use dfdx::prelude::{DeviceBuildExt, Dtype, TensorFrom};
    use dfdx::shapes::{HasShape, Shape};
    use dfdx::tensor::{CpuError, Tensor};

    use crate::step::layout::{EachTensor, each_tensor};

    #[test]
    fn the_mapped_copy_holds_the_masters_values_rounded() {
        type Mlp = (builders::Linear<3, 4>, ReLU, builders::Linear<4, 2>, Tanh);
        let dev = Cpu::default();
        let master = dev.build_module::<Mlp, f32>();
        let mut scratch = CastScratch::default();
        let w = refresh::<f16, _>(&master, None, &mut scratch).unwrap();
        let round = |v: Vec<f32>| v.into_iter().map(f16::from_f32).collect::<Vec<_>>();
        assert_eq!(w.0.weight.as_vec(), round(master.0.weight.as_vec()));
        assert_eq!(w.0.bias.as_vec(), round(master.0.bias.as_vec()));
        assert_eq!(w.2.weight.as_vec(), round(master.2.weight.as_vec()));
        assert_eq!(w.2.bias.as_vec(), round(master.2.bias.as_vec()));
        // in place, after a change of the master
        let mut master2 = master.clone();
        master2.2.bias = dev.tensor([0.5, -0.25]);
        let w = refresh::<f16, _>(&master2, Some(w), &mut scratch).unwrap();
        assert_eq!(w.2.bias.as_vec(), round(vec![0.5, -0.25]));
    }

    /// Every tensor of a model as `(element count, trainable)`, and its values widened to f32,
    /// in visit order.
    fn walk<E: Dtype, M: TensorCollection<E, Cpu>>(m: &M) -> (Vec<(usize, bool)>, Vec<f32>)
    where
        Cpu: Device<E>,
    {
        struct Walk(Vec<(usize, bool)>, Vec<f32>);
        impl<E: Dtype> EachTensor<E, Cpu> for Walk
        where
            Cpu: Device<E>,
        {
            type Error = CpuError;
            fn tensor<S: Shape>(
                &mut self,
                trainable: bool,
                t: &Tensor<S, E, Cpu>,
            ) -> Result<(), CpuError> {
                self.0.push((t.shape().num_elements(), trainable));
                self.1
                    .extend(t.as_vec().iter().map(|x| x.to_f32().unwrap_or(f32::NAN)));
                Ok(())
            }
        }
        let mut w = Walk(Vec::new(), Vec::new());
        each_tensor(m, &mut w, std::convert::identity).unwrap();
        (w.0, w.1)
    }

    /// Fills every tensor of `m` with distinct values (so that a layer norm's ones and zeros
    /// cannot hide a swap).
    fn scramble<M: TensorCollection<f32, Cpu>>(m: &mut M) {
        let mut at = 1usize;
        crate::cast::module_visit_floats_mut::<f32, M>(m, &mut |s| {
            if let crate::precision::FloatSliceMut::F32(v) = s {
                for x in v.iter_mut() {
                    #[allow(clippy::cast_precision_loss)]
                    let i = at as f32;
                    *x = (i * 0.618_034).sin() * 1.7;
                    at += 1;
                }
            }
        });
    }

    /// `M`'s mapped working copy in `H` visits the master's tensors in order, with the same
    /// counts and trainable flags, holding the master's values rounded to `H`.
    fn check_mapped<H, M>(what: &str) -> (M, M::Working)
    where
        H: Precision,
        M: HalfLayers<H> + BuildModule<Cpu, f32>,
        Cpu: Device<H::Elem>,
    {
        let dev = Cpu::seed_from_u64(7);
        let mut master = M::build(&dev);
        scramble(&mut master);
        let w = refresh::<H, M>(&master, None, &mut CastScratch::default()).unwrap();
        let (layout, values) = walk::<f32, M>(&master);
        let (w_layout, w_values) = walk::<H::Elem, M::Working>(&w);
        assert!(!layout.is_empty(), "{what}: no tensors");
        assert_eq!(
            w_layout, layout,
            "{what}: (count, trainable) in visit order"
        );
        let mut rounded = vec![H::Elem::default(); values.len()];
        H::round(&values, &mut rounded);
        let mut want = vec![0.0f32; values.len()];
        H::widen(&rounded, &mut want);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&w_values), bits(&want), "{what}: values");
        (master, w)
    }

    fn check_all<H: Precision>()
    where
        Cpu: Device<H::Elem>,
        LayerNorm1D<6, f32, Cpu>: HalfLayers<H>,
        MultiHeadAttention<8, 2, 8, 8, f32, Cpu>: HalfLayers<H>,
        MultiHeadAttention<8, 2, 4, 6, f32, Cpu>: HalfLayers<H>,
        TransformerEncoderBlock<8, 2, 16, f32, Cpu>: HalfLayers<H>,
        TransformerEncoder<8, 2, 16, 2, f32, Cpu>: HalfLayers<H>,
        Embedding<10, 8, f32, Cpu>: HalfLayers<H>,
        Residual<(Linear<8, 16, f32, Cpu>, ReLU, Linear<16, 8, f32, Cpu>)>: HalfLayers<H>,
        Repeated<(Linear<8, 8, f32, Cpu>, Tanh), 3>: HalfLayers<H>,
        Classifier: HalfLayers<H>,
        Branches: HalfLayers<H>,
        dfdx::nn::modules::Transformer<8, 2, 2, 2, 16, f32, Cpu>: HalfLayers<H>,
    {
        check_mapped::<H, LayerNorm1D<6, f32, Cpu>>("LayerNorm1D");
        check_mapped::<H, MultiHeadAttention<8, 2, 8, 8, f32, Cpu>>("MultiHeadAttention");
        check_mapped::<H, MultiHeadAttention<8, 2, 4, 6, f32, Cpu>>("MultiHeadAttention K, V");
        check_mapped::<H, TransformerEncoderBlock<8, 2, 16, f32, Cpu>>("TransformerEncoderBlock");
        check_mapped::<H, TransformerEncoder<8, 2, 16, 2, f32, Cpu>>("TransformerEncoder");
        check_mapped::<H, Embedding<10, 8, f32, Cpu>>("Embedding");
        check_mapped::<H, Residual<(Linear<8, 16, f32, Cpu>, ReLU, Linear<16, 8, f32, Cpu>)>>(
            "Residual",
        );
        check_mapped::<H, Repeated<(Linear<8, 8, f32, Cpu>, Tanh), 3>>("Repeated");
        check_mapped::<H, Classifier>("classifier");
        check_mapped::<H, Branches>("branches");
        check_mapped::<H, dfdx::nn::modules::Transformer<8, 2, 2, 2, 16, f32, Cpu>>("Transformer");
    }

    /// The containers and layers without an mpx counterpart: batch norm (its running statistics
    /// untrained), dropout, `GeneralizedResidual`, `AddInto`, `SplitInto`.
    type Branches = (
        Linear<8, 8, f32, Cpu>,
        BatchNorm1D<8, f32, Cpu>,
        Dropout,
        GeneralizedResidual<Linear<8, 4, f32, Cpu>, (Linear<8, 4, f32, Cpu>, Sigmoid)>,
        SplitInto<(
            Linear<4, 4, f32, Cpu>,
            (DropoutOneIn<3>, Linear<4, 4, f32, Cpu>),
        )>,
        AddInto<(Linear<4, 2, f32, Cpu>, Linear<4, 2, f32, Cpu>)>,
    );

    type Classifier = (
        Embedding<10, 8, f32, Cpu>,
        TransformerEncoder<8, 2, 16, 2, f32, Cpu>,
        LayerNorm1D<8, f32, Cpu>,
        Linear<8, 3, f32, Cpu>,
    );

    #[test]
    fn each_mapped_layer_visits_dfdxs_tensors_in_order() {
        check_all::<f16>();
        check_all::<AMP<f16>>();
        check_all::<bf16>();
    }

    #[test]
    fn the_layer_norms_epsilon_is_carried() {
        let dev = Cpu::default();
        let mut master = dev.build_module::<builders::TransformerEncoder<8, 2, 16, 2>, f32>();
        master.modules[1].norm2.epsilon = 1e-3;
        let mut scratch = CastScratch::default();
        let w = refresh::<f16, _>(&master, None, &mut scratch).unwrap();
        assert_eq!(w.modules[1].norm2.epsilon, 1e-3);
        assert_eq!(w.modules[0].norm2.epsilon, 1e-5);
        // and again in place
        master.modules[0].norm1.epsilon = 1e-4;
        let w = refresh::<f16, _>(&master, Some(w), &mut scratch).unwrap();
        assert_eq!(w.modules[0].norm1.epsilon, 1e-4);
    }

    #[test]
    fn a_relu_after_a_linear_runs_in_its_op() {
        use crate::nn::{Activation, LinkedReLU};
        use dfdx::prelude::{Module, Rank2, SampleTensor};
        type Mlp = (
            builders::Linear<4, 8>,
            ReLU,
            builders::Linear<8, 8>,
            Tanh,
            ReLU,
            builders::Linear<8, 2>,
        );
        let dev = Cpu::seed_from_u64(3);
        let mut master = dev.build_module::<Mlp, f32>();
        master.5.bias = dev.tensor([-0.5, 0.25]);
        let w = refresh::<f16, _>(&master, None, &mut CastScratch::default()).unwrap();
        // linked: the first pair only (the second ReLU follows a Tanh)
        assert_eq!(w.0.activation(), Activation::ReLU);
        assert_eq!(w.2.activation(), Activation::Identity);
        assert_eq!(w.5.activation(), Activation::Identity);
        assert_eq!(w.1, LinkedReLU::applied_before());
        assert_eq!(w.4, LinkedReLU::default());
        // the linked working copy computes what dfdx's layers compute, up to f16 rounding
        let x: dfdx::tensor::Tensor<Rank2<16, 4>, f32, Cpu> = dev.sample_normal();
        let want = master.forward(x.clone()).as_vec();
        let got = w.forward(x.to_dtype::<f16>()).as_vec();
        for (g, v) in got.iter().zip(&want) {
            assert!(
                (g.to_f32() - v).abs() <= 4e-3 * (1.0 + v.abs()),
                "{g} vs {v}"
            );
        }
    }

    #[test]
    fn dropouts_p_and_the_batch_norms_settings_are_carried() {
        type Net = (builders::Linear<3, 4>, Dropout, builders::BatchNorm1D<4>);
        let dev = Cpu::default();
        let mut master = dev.build_module::<Net, f32>();
        master.1.p = 0.25;
        master.2.momentum = 0.5;
        let mut scratch = CastScratch::default();
        let w = refresh::<f16, _>(&master, None, &mut scratch).unwrap();
        assert_eq!((w.1.p, w.2.momentum, w.2.epsilon), (0.25, 0.5, 1e-5));
        // a schedule that changes them between steps reaches the working copy
        master.1.p = 0.0;
        master.2.epsilon = 1e-3;
        let w = refresh::<f16, _>(&master, Some(w), &mut scratch).unwrap();
        assert_eq!((w.1.p, w.2.epsilon), (0.0, 1e-3));
    }
}
