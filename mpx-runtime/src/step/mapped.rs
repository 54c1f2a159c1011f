//! [`HalfLayers`]: the layer map of a mixed step's working copy made of mpx's layers.
//!
//! A model's plain working copy is `<M as TensorCollection<f32, Cpu>>::To<f16, Cpu>`: dfdx's own
//! layers in f16, which run on dfdx's scalar f16 kernels. For a model made of dfdx's stable
//! layers and containers, the working copy can instead be made of mpx's layers where mpx has
//! one: the fused [`nn::Linear`](crate::nn::Linear) (f16 storage, f32 sums on mpx's GEMM, its
//! weight and bias gradients written in f32 straight into the master's), and the mixed-ready
//! transformer layers of [`mpx::nn`](crate::nn); the other layers stay dfdx's, in the half type,
//! those with sums or on dfdx's scalar f16 kernels run in f32 ([`InF32`](crate::nn::InF32),
//! [`InF32Copy`]).
//! The model's type does not change: [`Mixed::mapped`](super::Mixed::mapped) runs it that way,
//! and `#[mixed_step]` picks it wherever the model implements [`HalfLayers`].
//!
//! This file is the one map from dfdx's layers to their working copies. Each working copy
//! visits the master's tensors and scalar settings in the master's order, with the same shapes
//! and trainable flags, so the step builds it by walking its type and filling it from the master
//! by position ([`super::working`]): every count and length is checked, and every setting (a
//! norm's `epsilon` and `momentum`, dropout's `p`) is the master's. What a working copy holds
//! that is not a tensor or a scalar of dfdx's (a fused layer's link to its master tensors,
//! `LeakyReLU`'s slope) is set by [`HalfLayers::finish`] once the layer is filled. A linear
//! layer, dfdx's or mpx's, is the one exception: its type fixes its two trained tensors and
//! their shapes, so its fused working copy is made straight from them and linked as it is made,
//! without a walk of either layer (the commonest layer, built once per forward pass). A working
//! copy computes exactly what the master's layers compute, layer by layer: nothing is fused
//! across layers, so a step that calls the layers one by one, with its own ops between them,
//! sees what dfdx's layers give.

use dfdx::nn::modules::{
    AddInto, Embedding as DfdxEmbedding, GeneralizedResidual, Linear as DfdxLinear, Repeated,
    Residual, SplitInto, UnbiasedLinear as DfdxUnbiasedLinear,
};
use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::tensor::Cpu;
use dfdx::tensor_ops::Device;

use super::error::StepError;
use super::half_layers::{BuildCx, HalfLayers};
use crate::boundary::MasterModel;
use crate::master::link::Linker;
use crate::nn::{Embedding, InBf16, InF32Copy, UnbiasedLinear};
use crate::precision::{AMP, Precision, bf16, f16};

/// A layer as it is, in its own storage type: mpx's layers in `f16` and `AMP<f16>`, and dfdx's
/// layers with tensors in emulated bf16's f32 storage.
type Native<L> = L;

/// The mpx layer in a [`Native`] working copy.
fn native<L>(w: &mut L) -> &mut L {
    w
}

/// The mpx layer in an [`InBf16`] working copy.
fn in_bf16<L>(w: &mut InBf16<L>) -> &mut L {
    &mut w.0
}

/// A working copy's fused linear layer (`$w`, an `nn::Linear`) linked to the master's (`$m`,
/// dfdx's or mpx's: either holds `weight` and `bias`).
macro_rules! link_linear {
    ($m:expr, $w:expr, $l:expr) => {
        $w.set_link($l.link(&$m.weight, &$m.bias))
    };
}

/// A layer without fused linear layers: nothing to link.
macro_rules! link_none {
    ($m:expr, $w:expr, $l:expr) => {{
        let _ = ($m, $w, $l);
    }};
}

/// An attention's four projections.
macro_rules! link_attention {
    ($m:expr, $w:expr, $l:expr) => {{
        link_linear!($m.w_q, $w.w_q, $l);
        link_linear!($m.w_k, $w.w_k, $l);
        link_linear!($m.w_v, $w.w_v, $l);
        link_linear!($m.w_o, $w.w_o, $l);
    }};
}

/// An encoder block's attention and feed-forward layers.
macro_rules! link_encoder_block {
    ($m:expr, $w:expr, $l:expr) => {{
        link_attention!($m.self_attn, $w.self_attn, $l);
        link_linear!($m.ff.0.0, $w.ff.0.0, $l);
        link_linear!($m.ff.0.2, $w.ff.0.2, $l);
    }};
}

/// A decoder block's two attentions and feed-forward layers.
macro_rules! link_decoder_block {
    ($m:expr, $w:expr, $l:expr) => {{
        link_attention!($m.self_attn, $w.self_attn, $l);
        link_attention!($m.mh_attn, $w.mh_attn, $l);
        link_linear!($m.ff.0.0, $w.ff.0.0, $l);
        link_linear!($m.ff.0.2, $w.ff.0.2, $l);
    }};
}

/// A decoder stack's blocks.
macro_rules! link_decoder {
    ($m:expr, $w:expr, $l:expr) => {{
        for (m, w) in $m.0.modules.iter().zip(&mut $w.0.modules) {
            link_decoder_block!(m, w, $l);
        }
    }};
}

/// An encoder-decoder transformer's blocks.
macro_rules! link_transformer {
    ($m:expr, $w:expr, $l:expr) => {{
        for (m, w) in $m.encoder.modules.iter().zip(&mut $w.encoder.modules) {
            link_encoder_block!(m, w, $l);
        }
        link_decoder!($m.decoder, $w.decoder, $l);
    }};
}

/// `HalfLayers` of both families' layers in the table of
/// `nn::convert::counterparts`: dfdx's layer and mpx's
/// counterpart (in an f32 master) both get mpx's layer in `H` as their working copy, each
/// precision wrapping it its own way (`$in`, reached by `$get`: [`Native`] or [`InBf16`]), linked
/// to the master's tensors by the table's link macro.
macro_rules! counterpart_layers {
    ($($name:ident [$(const $c:ident),*] { $($f:ident),* } by $link:ident;)+) => {
        counterpart_layers!(@in f16, Native, native: $($name [$(const $c),*] by $link;)+);
        counterpart_layers!(@in AMP<f16>, Native, native: $($name [$(const $c),*] by $link;)+);
        counterpart_layers!(@in bf16, InBf16, in_bf16: $($name [$(const $c),*] by $link;)+);
    };
    (@in $h:ty, $in:ident, $get:ident: $($name:ident [$(const $c:ident),*] by $link:ident;)+) => {$(
        counterpart_layers!(@one $h, $in, $get, dfdx::nn::modules::$name [$(const $c),*] $name by $link);
        counterpart_layers!(@one $h, $in, $get, crate::nn::$name [$(const $c),*] $name by $link);
    )+};
    (@one $h:ty, $in:ident, $get:ident, $($master:ident)::+ [$(const $c:ident),*] $name:ident by $link:ident) => {
        impl<$(const $c: usize),*> HalfLayers<$h> for $($master)::+<$($c,)* f32, Cpu> {
            type Working = $in<crate::nn::$name<$($c,)* <$h as Precision>::Elem, Cpu>>;
            fn finish(&self, working: &mut Self::Working, linker: &Linker) {
                let working = $get(working);
                $link!(self, working, linker);
            }
        }
    };
}
crate::nn::counterparts!(counterpart_layers);

/// dfdx's `Linear` to mpx's fused one, the layers without parameters to themselves, and dfdx's
/// layers mpx has no counterpart of to themselves in `H`, for one precision (`$in` wraps mpx's
/// layers: [`Native`] or [`InBf16`]).
macro_rules! layers {
    ($h:ty, $in:ident, $get:ident, $wrap:path) => {
        impl<const I: usize, const O: usize> HalfLayers<$h> for DfdxLinear<I, O, f32, Cpu> {
            type Working = $in<crate::nn::Linear<I, O, <$h as Precision>::Elem, Cpu>>;
            fn build_working(&self, cx: &mut BuildCx<'_, $h>) -> Result<Self::Working, StepError> {
                Ok($wrap(cx.linear(&self.weight, &self.bias)?))
            }
        }
        // dropout masks and scales; a global max or min picks one of its inputs (exact in any
        // precision)
        same!($h: Dropout, MaxPoolGlobal, MinPoolGlobal);
        impl<const OH: usize, const OW: usize, M> HalfLayers<$h> for dfdx::nn::modules::Upscale2D<OH, OW, M>
        where
            M: dfdx::tensor_ops::UpscaleMethod + Send + Sync + 'static,
        {
            type Working = Self;
        }
        // (dfdx exports its `Reshape` among the builders only: a layer without parameters is
        // its own builder)
        impl<S: dfdx::shapes::ConstShape + Send + Sync + 'static> HalfLayers<$h>
            for dfdx::nn::builders::Reshape<S>
        {
            type Working = Self;
        }
        // dfdx's `Tanh` and `Sigmoid` as mpx's: computed in f32, rounded once
        impl HalfLayers<$h> for dfdx::nn::modules::Tanh {
            type Working = $in<crate::nn::Tanh>;
        }
        impl HalfLayers<$h> for crate::nn::Tanh {
            type Working = $in<crate::nn::Tanh>;
        }
        impl HalfLayers<$h> for dfdx::nn::modules::Sigmoid {
            type Working = $in<crate::nn::Sigmoid>;
        }
        impl HalfLayers<$h> for crate::nn::Sigmoid {
            type Working = $in<crate::nn::Sigmoid>;
        }
        // dfdx's `ReLU` as mpx's: the same values and gradients, in vector passes
        impl HalfLayers<$h> for dfdx::nn::modules::ReLU {
            type Working = crate::nn::ReLU;
        }
        impl HalfLayers<$h> for crate::nn::ReLU {
            type Working = crate::nn::ReLU;
        }
        // a global average pool is a sum: in f32, as autocast runs sums; the element-wise
        // functions in f32 too, rounded once (dfdx's f16 kernels convert each value on its own,
        // several times slower than its f32 ones, and round between the steps of a `GeLU`)
        in_f32!($h: Exp, Ln, Softmax, LogSoftmax, AvgPoolGlobal);
        in_f32!($h: FastGeLU, AccurateGeLU, GeLU, Abs, Square, Sqrt, Sin, Cos);
        impl<const N: usize> HalfLayers<$h> for dfdx::nn::modules::DropoutOneIn<N> {
            type Working = Self;
        }
        // dfdx's `LeakyReLU` as mpx's: the master's f32 slope, the product in f32, rounded once
        leaky_relu!($h, $in, $get: dfdx::nn::modules::LeakyReLU<f32>, crate::nn::LeakyReLU);
    };
}

/// dfdx's `LeakyReLU` and mpx's (`$m`) as mpx's, its slope the master's.
macro_rules! leaky_relu {
    ($h:ty, $in:ident, $get:ident: $($m:ty),+) => {$(
        impl HalfLayers<$h> for $m {
            type Working = $in<crate::nn::LeakyReLU>;
            fn finish(&self, working: &mut Self::Working, _: &Linker) {
                $get(working).0 = self.0;
            }
        }
    )+};
}

/// Layers run in an f32 region ([`InF32`](crate::nn::InF32)): those on autocast's float32 list,
/// and the element-wise functions.
macro_rules! in_f32 {
    ($h:ty: $($a:ident),*) => {$(
        #[allow(deprecated, reason = "dfdx's `GeLU`: a model written for dfdx 0.11 still uses it")]
        impl HalfLayers<$h> for dfdx::nn::modules::$a {
            type Working = crate::nn::InF32<dfdx::nn::modules::$a>;
        }
    )*};
}

/// Layers that are their own working copy.
macro_rules! same {
    ($h:ty: $($a:ident),*) => {$(
        impl HalfLayers<$h> for dfdx::nn::modules::$a {
            type Working = dfdx::nn::modules::$a;
        }
    )*};
}

layers!(f16, Native, native, std::convert::identity);
layers!(AMP<f16>, Native, native, std::convert::identity);
layers!(bf16, InBf16, in_bf16, InBf16);

/// dfdx's layers with tensors that mpx has no fused layer of its own for, for one precision:
/// `UnbiasedLinear` as `$unbiased`, `Embedding` as `$embedding`, and the others dfdx's own in
/// `H`'s storage type run as `$in`. In f16 and `AMP<f16>`: mpx's
/// [`nn::UnbiasedLinear`](crate::nn::UnbiasedLinear) (the fused op with a zero bias, not linked:
/// its weight's gradient goes through the half gradients), mpx's
/// [`nn::Embedding`](crate::nn::Embedding) (dfdx's gather; the table's gradient summed in f32)
/// and [`InF32Copy`] (computed in f32 on an f32 copy: dfdx's f16 kernels are scalar, and its f16
/// batch norm sums its statistics in f16). In emulated bf16, dfdx's own as they are (their
/// storage is f32).
macro_rules! with_tensors {
    ($h:ty, $in:ident, $unbiased:ident, $embedding:ident) => {
        impl<const V: usize, const M: usize> HalfLayers<$h> for DfdxEmbedding<V, M, f32, Cpu> {
            type Working = $embedding<V, M, <$h as Precision>::Elem, Cpu>;
        }
        impl<const I: usize, const O: usize> HalfLayers<$h>
            for dfdx::nn::modules::UnbiasedLinear<I, O, f32, Cpu>
        {
            type Working = $unbiased<I, O, <$h as Precision>::Elem, Cpu>;
        }
        impl<const C: usize> HalfLayers<$h> for dfdx::nn::modules::BatchNorm1D<C, f32, Cpu> {
            type Working = $in<dfdx::nn::modules::BatchNorm1D<C, <$h as Precision>::Elem, Cpu>>;
        }
        impl<const C: usize> HalfLayers<$h> for dfdx::nn::modules::BatchNorm2D<C, f32, Cpu> {
            type Working = $in<dfdx::nn::modules::BatchNorm2D<C, <$h as Precision>::Elem, Cpu>>;
        }
        impl<const C: usize> HalfLayers<$h> for dfdx::nn::modules::Bias2D<C, f32, Cpu> {
            type Working = $in<dfdx::nn::modules::Bias2D<C, <$h as Precision>::Elem, Cpu>>;
        }
        impl HalfLayers<$h> for dfdx::nn::prelu::PReLU<f32, Cpu> {
            type Working = $in<dfdx::nn::prelu::PReLU<<$h as Precision>::Elem, Cpu>>;
        }
        impl<C: dfdx::shapes::ConstDim> HalfLayers<$h> for dfdx::nn::prelu::PReLU1D<C, f32, Cpu> {
            type Working = $in<dfdx::nn::prelu::PReLU1D<C, <$h as Precision>::Elem, Cpu>>;
        }
    };
}
with_tensors!(f16, InF32Copy, UnbiasedLinear, Embedding);
with_tensors!(AMP<f16>, InF32Copy, UnbiasedLinear, Embedding);
with_tensors!(bf16, Native, DfdxUnbiasedLinear, DfdxEmbedding);

/// mpx's own layers in a master of f32 elements: themselves in `H` (a fused linear layer linked
/// to its master tensors).
macro_rules! own {
    ($h:ty, $in:ident, $get:ident, $wrap:path) => {
        impl<const I: usize, const O: usize, A: crate::nn::FusedActivation> HalfLayers<$h>
            for crate::nn::FusedLinear<I, O, f32, Cpu, A>
        {
            type Working = $in<crate::nn::FusedLinear<I, O, <$h as Precision>::Elem, Cpu, A>>;
            fn build_working(&self, cx: &mut BuildCx<'_, $h>) -> Result<Self::Working, StepError> {
                Ok($wrap(cx.linear(&self.weight, &self.bias)?))
            }
        }
        own!(@same $h, $in, $get: vit::PositionEmbedding[const N, const M]);
        own!(@same $h, $in, $get: vit::ClassToken[const M]);
        own!(@same $h, $in, $get: vit::PatchEmbedding[const P, const PD, const N, const M]
            |m, w, l| link_linear!(m.linear, w.linear, l));
        own!(@same $h, $in, $get: vit::ClassificationHead[const M, const C]
            |m, w, l| link_linear!(m.linear, w.linear, l));
        own!(@same $h, $in, $get: vit::Vit[
            const P, const PD, const N, const M, const NH, const F, const L, const C
        ] |m, w, l| {
            link_linear!(m.patch_embed.linear, w.patch_embed.linear, l);
            for (m, w) in m.encoder.modules.iter().zip(&mut w.encoder.modules) {
                link_encoder_block!(m, w, l);
            }
            link_linear!(m.head.linear, w.head.linear, l);
        });
    };
    (@same $h:ty, $in:ident, $get:ident: $($p:ident)::+ [$(const $c:ident),*]) => {
        impl<$(const $c: usize),*> HalfLayers<$h> for crate::nn::$($p)::+<$($c,)* f32, Cpu> {
            type Working = $in<crate::nn::$($p)::+<$($c,)* <$h as Precision>::Elem, Cpu>>;
        }
    };
    (@same $h:ty, $in:ident, $get:ident: $($p:ident)::+ [$(const $c:ident),*] |$m:ident, $w:ident, $l:ident| $link:expr) => {
        impl<$(const $c: usize),*> HalfLayers<$h> for crate::nn::$($p)::+<$($c,)* f32, Cpu> {
            type Working = $in<crate::nn::$($p)::+<$($c,)* <$h as Precision>::Elem, Cpu>>;
            fn finish(&self, working: &mut Self::Working, linker: &Linker) {
                let ($m, $w, $l) = (self, $get(working), linker);
                $link;
            }
        }
    };
}

own!(f16, Native, native, std::convert::identity);
own!(AMP<f16>, Native, native, std::convert::identity);
own!(bf16, InBf16, in_bf16, InBf16);

/// A stack maps layer by layer (dfdx's `TransformerEncoder` is a `Repeated` of blocks).
impl<H: Precision, T: HalfLayers<H>, const N: usize> HalfLayers<H> for Repeated<T, N>
where
    Cpu: Device<H::Elem>,
    Repeated<T, N>: MasterModel,
    Repeated<T::Working, N>:
        TensorCollection<H::Elem, Cpu, To<H::Elem, Cpu> = Repeated<T::Working, N>>,
{
    type Working = Repeated<T::Working, N>;
    fn build_working(&self, cx: &mut BuildCx<'_, H>) -> Result<Self::Working, StepError> {
        let modules = self
            .modules
            .iter()
            .map(|m| m.build_working(cx))
            .collect::<Result<_, _>>()?;
        Ok(Repeated { modules })
    }
    fn carry_back(&mut self, working: &mut Self::Working) {
        for (m, w) in self.modules.iter_mut().zip(&mut working.modules) {
            m.carry_back(w);
        }
    }
}

/// A generalized residual maps both of its branches, and is mpx's
/// [`GeneralizedResidual`](crate::nn::GeneralizedResidual) (the add as a residual's).
impl<H: Precision, F: HalfLayers<H>, R: HalfLayers<H>> HalfLayers<H> for GeneralizedResidual<F, R>
where
    Cpu: Device<H::Elem>,
    GeneralizedResidual<F, R>: MasterModel,
    crate::nn::GeneralizedResidual<F::Working, R::Working>: TensorCollection<
            H::Elem,
            Cpu,
            To<H::Elem, Cpu> = crate::nn::GeneralizedResidual<F::Working, R::Working>,
        >,
{
    type Working = crate::nn::GeneralizedResidual<F::Working, R::Working>;
    fn build_working(&self, cx: &mut BuildCx<'_, H>) -> Result<Self::Working, StepError> {
        // dfdx visits `f`, then `r`
        let f = self.f.build_working(cx)?;
        let r = self.r.build_working(cx)?;
        Ok(crate::nn::GeneralizedResidual { f, r })
    }
    fn carry_back(&mut self, working: &mut Self::Working) {
        self.f.carry_back(&mut working.f);
        self.r.carry_back(&mut working.r);
    }
}

/// `Residual`, `AddInto` and `SplitInto` map what they hold; the two that add are mpx's
/// [`Residual`](crate::nn::Residual) and [`AddInto`](crate::nn::AddInto) (the add of two f16
/// tensors in vector passes).
macro_rules! branches {
    ($($c:ident => $($w:ident)::+),*) => {$(
        impl<H: Precision, T: HalfLayers<H>> HalfLayers<H> for $c<T>
        where
            Cpu: Device<H::Elem>,
            $c<T>: MasterModel,
            $($w)::+<T::Working>:
                TensorCollection<H::Elem, Cpu, To<H::Elem, Cpu> = $($w)::+<T::Working>>,
        {
            type Working = $($w)::+<T::Working>;
            fn build_working(&self, cx: &mut BuildCx<'_, H>) -> Result<Self::Working, StepError> {
                Ok($($w)::+(self.0.build_working(cx)?))
            }
            fn carry_back(&mut self, working: &mut Self::Working) {
                self.0.carry_back(&mut working.0);
            }
        }
    )*};
}
branches!(Residual => crate::nn::Residual, AddInto => crate::nn::AddInto, SplitInto => SplitInto);

/// Tuples map element by element.
macro_rules! tuple {
    ($($m:ident . $i:tt),+) => {
        impl<H: Precision, $($m: HalfLayers<H>),+> HalfLayers<H> for ($($m,)+)
        where
            Cpu: Device<H::Elem>,
            ($($m,)+): MasterModel,
            ($($m::Working,)+): TensorCollection<H::Elem, Cpu, To<H::Elem, Cpu> = ($($m::Working,)+)>,
        {
            type Working = ($($m::Working,)+);
            fn build_working(&self, cx: &mut BuildCx<'_, H>) -> Result<Self::Working, StepError> {
                Ok(($(self.$i.build_working(cx)?,)+))
            }
            fn carry_back(&mut self, working: &mut Self::Working) {
                $(self.$i.carry_back(&mut working.$i);)+
            }
        }
    };
}
crate::for_tuples!(tuple);

#[cfg(test)]
mod tests {
    use super::*;
    use dfdx::nn::builders;
    use dfdx::nn::modules::{
        AvgPoolGlobal, BatchNorm1D, BatchNorm2D, Bias2D, Dropout, DropoutOneIn, Embedding,
        LayerNorm1D, Linear, MaxPoolGlobal, MinPoolGlobal, MultiHeadAttention, ReLU, Sigmoid, Tanh,
        TransformerEncoder, TransformerEncoderBlock, Upscale2D,
    };
    use dfdx::nn::prelu::{PReLU, PReLU1D};
    use dfdx::prelude::{DeviceBuildExt, Dtype, TensorFrom};
    use dfdx::shapes::{HasShape, Shape};
    use dfdx::tensor::{CpuError, Tensor};

    use crate::cast::CastError;
    use crate::step::StepError;
    use crate::step::device::private::Primitives;
    use crate::step::working::{Kind, Mapped};
    use crate::walk::{Each, each};
    use dfdx::nn::BuildModule;
    use dfdx::prelude::{Module, Rank2, SampleTensor};

    /// The mapped working copy of `master` for a forward pass, outside a step (`links`: a
    /// forward pass's own).
    fn refresh<H: Precision, M: HalfLayers<H>>(master: &M) -> Result<M::Working, StepError>
    where
        Cpu: crate::step::MixedDevice<H>,
    {
        let links = <Cpu as Primitives<H>>::links(1.0);
        let mut store = Default::default();
        Ok(<Mapped as Kind<H, M, Cpu>>::build(master, &links, &mut store)?.copy)
    }

    #[test]
    fn the_mapped_copy_holds_the_masters_values_rounded() {
        type Mlp = (builders::Linear<3, 4>, ReLU, builders::Linear<4, 2>, Tanh);
        let dev = Cpu::default();
        let master = dev.build_module::<Mlp, f32>();
        let w = refresh::<f16, _>(&master).unwrap();
        let round = |v: Vec<f32>| v.into_iter().map(f16::from_f32).collect::<Vec<_>>();
        assert_eq!(w.0.weight.as_vec(), round(master.0.weight.as_vec()));
        assert_eq!(w.0.bias.as_vec(), round(master.0.bias.as_vec()));
        assert_eq!(w.2.weight.as_vec(), round(master.2.weight.as_vec()));
        assert_eq!(w.2.bias.as_vec(), round(master.2.bias.as_vec()));
        // built anew from the master as it is
        let mut master2 = master.clone();
        master2.2.bias = dev.tensor([0.5, -0.25]);
        let w = refresh::<f16, _>(&master2).unwrap();
        assert_eq!(w.2.bias.as_vec(), round(vec![0.5, -0.25]));
    }

    /// Every tensor of a model as `(element count, trainable)`, and its values widened to f32,
    /// in visit order.
    fn walk<E: Dtype, M: TensorCollection<E, Cpu>>(m: &M) -> (Vec<(usize, bool)>, Vec<f32>)
    where
        Cpu: Device<E>,
    {
        struct Walk(Vec<(usize, bool)>, Vec<f32>);
        impl<E: Dtype> Each<E, Cpu> for Walk
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
        each(m, &mut w, std::convert::identity).unwrap();
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
        let w = refresh::<H, M>(&master).unwrap();
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
        Others: HalfLayers<H>,
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
        check_mapped::<H, Others>(
            "UnbiasedLinear, PReLU, Bias2D, BatchNorm2D and layers without tensors",
        );
    }

    /// The rest of dfdx's layers on stable Rust: `UnbiasedLinear` (mpx's), dfdx's own in `H`
    /// (`PReLU`, `PReLU1D`, `Bias2D`, `BatchNorm2D`) and the layers without tensors (the global
    /// pools, `Upscale2D`, `Reshape`, the deprecated `GeLU`).
    #[allow(deprecated)]
    type Others = (
        (
            Linear<4, 4, f32, Cpu>,
            PReLU<f32, Cpu>,
            dfdx::nn::modules::GeLU,
            dfdx::nn::modules::UnbiasedLinear<4, 3, f32, Cpu>,
        ),
        PReLU1D<dfdx::shapes::Const<4>, f32, Cpu>,
        (Bias2D<3, f32, Cpu>, BatchNorm2D<3, f32, Cpu>),
        (AvgPoolGlobal, MaxPoolGlobal, MinPoolGlobal),
        (Upscale2D<4, 6>, builders::Reshape<Rank2<2, 6>>),
    );

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

    /// dfdx's element-wise functions in a mapped working copy run in f32 on the f16 values and
    /// round once; dfdx's own in f16 rounds between the steps of a `GeLU`.
    #[test]
    fn the_element_wise_functions_run_in_f32_rounded_once() {
        use dfdx::nn::modules::{AccurateGeLU, Cos, FastGeLU, Sin, Sqrt, Square};
        let dev = Cpu::seed_from_u64(9);
        let x: Tensor<Rank2<16, 32>, f32, Cpu> = dev.sample_normal();
        let xh = x.to_dtype::<f16>();
        let x32 = xh.clone().to_dtype::<f32>();
        let once = |t: Tensor<Rank2<16, 32>, f32, Cpu>| t.to_dtype::<f16>().as_vec();
        macro_rules! check {
            ($($layer:ident, $x:expr;)*) => {$(
                let w = refresh::<f16, _>(&$layer).unwrap();
                let want = once($layer.forward($x.clone().to_dtype::<f32>()));
                assert_eq!(w.forward($x.clone()).as_vec(), want, stringify!($layer));
            )*};
        }
        check!(
            FastGeLU, xh;
            AccurateGeLU, xh;
            Sin, xh;
            Cos, xh;
            Square, xh;
            Sqrt, xh.clone().abs();
        );
        // dfdx's f16 GeLU is not these values
        let f16_gelu = FastGeLU.forward(xh).as_vec();
        assert_ne!(f16_gelu, once(FastGeLU.forward(x32)));
    }

    #[test]
    fn the_layer_norms_epsilon_is_carried() {
        let dev = Cpu::default();
        let mut master = dev.build_module::<builders::TransformerEncoder<8, 2, 16, 2>, f32>();
        master.modules[1].norm2.epsilon = 1e-3;
        let w = refresh::<f16, _>(&master).unwrap();
        assert_eq!(w.modules[1].norm2.epsilon, 1e-3);
        assert_eq!(w.modules[0].norm2.epsilon, 1e-5);
        // and on the next pass
        master.modules[0].norm1.epsilon = 1e-4;
        let w = refresh::<f16, _>(&master).unwrap();
        assert_eq!(w.modules[0].norm1.epsilon, 1e-4);
    }

    #[test]
    fn each_layer_computes_what_dfdxs_computes_called_one_by_one() {
        type Mlp = (
            builders::Linear<4, 8>,
            ReLU,
            builders::Linear<8, 8>,
            Tanh,
            ReLU,
            builders::Linear<8, 2>,
        );
        let dev = Cpu::seed_from_u64(3);
        let master = dev.build_module::<Mlp, f32>();
        let w = refresh::<f16, _>(&master).unwrap();
        // no layer applies another's op: the `Linear`'s output, read on its own, is its output
        let x: dfdx::tensor::Tensor<Rank2<16, 4>, f32, Cpu> = dev.sample_normal();
        let z = master.0.forward(x.clone()) + 0.5;
        let want = master.1.forward(z).as_vec();
        let z = w.0.forward(x.to_dtype::<f16>()) + f16::from_f32(0.5);
        let got = w.1.forward(z).as_vec();
        for (g, v) in got.iter().zip(&want) {
            assert!(
                (g.to_f32() - v).abs() <= 4e-3 * (1.0 + v.abs()),
                "{g} vs {v}"
            );
        }
        assert!(want.iter().any(|v| *v > 0.0) && want.contains(&0.0));
    }

    #[test]
    fn a_working_copy_that_does_not_line_up_is_an_error() {
        use dfdx::nn::tensor_collection::ModuleVisitor;
        use dfdx::tensor::Storage;
        // a batch norm's running statistics are not trained; a layer norm's tensors are
        #[derive(Debug, Clone)]
        struct Norm<E: Dtype, D: Storage<E>>(BatchNorm1D<4, E, D>);
        impl<E: Dtype, D: Device<E>> TensorCollection<E, D> for Norm<E, D> {
            type To<E2: Dtype, D2: Device<E2>> = Norm<E2, D2>;
            fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
                v: &mut V,
            ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
                v.visit_fields(Self::module("0", |s| &s.0, |s| &mut s.0), Norm)
            }
        }
        impl HalfLayers<f16> for Norm<f32, Cpu> {
            type Working = (
                crate::nn::LayerNorm1D<4, f16, Cpu>,
                crate::nn::LayerNorm1D<4, f16, Cpu>,
            );
        }
        let dev = Cpu::default();
        let bn = Norm(dev.build_module::<builders::BatchNorm1D<4>, f32>());
        match refresh::<f16, _>(&bn) {
            Err(StepError::Cast(CastError::TrainableMismatch { index: 2 })) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn dropouts_p_and_the_batch_norms_settings_are_carried() {
        type Net = (builders::Linear<3, 4>, Dropout, builders::BatchNorm1D<4>);
        let dev = Cpu::default();
        let mut master = dev.build_module::<Net, f32>();
        master.1.p = 0.25;
        master.2.momentum = 0.5;
        let w = refresh::<f16, _>(&master).unwrap();
        assert_eq!((w.1.p, w.2.momentum, w.2.epsilon), (0.25, 0.5, 1e-5));
        // a schedule that changes them between steps reaches the working copy
        master.1.p = 0.0;
        master.2.epsilon = 1e-3;
        let w = refresh::<f16, _>(&master).unwrap();
        assert_eq!((w.1.p, w.2.epsilon), (0.0, 1e-3));
    }
}
