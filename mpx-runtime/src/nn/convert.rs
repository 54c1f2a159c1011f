//! [`IntoLayers`]: one conversion for every family of layers (dfdx's, mpx's fused and
//! mixed-ready ones, MX fake-quantized ones), applied through a whole model.

use dfdx::nn::modules::{Repeated, Residual};

/// The family of mpx's layers: dfdx's `Linear` becomes the fused [`Linear`](super::Linear),
/// dfdx's `LayerNorm1D`, `MultiHeadAttention`, `TransformerEncoderBlock` and
/// `TransformerEncoder` become their `mpx::nn` counterparts. A target for
/// [`IntoLayers::into_layers`].
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::{self, IntoLayers, Mpx};
/// let dev = Cpu::default();
/// let ln = dev.build_module::<LayerNorm1D<4>, f32>();
/// let ours: nn::LayerNorm1D<4, f32, Cpu> = ln.into_layers(Mpx);
/// assert_eq!(ours.gamma.array(), [1.0; 4]);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mpx;

/// The family of dfdx's own layers: mpx's layers go back to the dfdx layers they stand for (a
/// fused [`LinearReLU`](super::LinearReLU) to dfdx's `(Linear, ReLU)`). A target for
/// [`IntoLayers::into_layers`].
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::{self, Dfdx, IntoLayers};
/// let dev = Cpu::default();
/// let fused = dev.build_module::<nn::builders::LinearReLU<3, 2>, f32>();
/// let (linear, _relu) = fused.clone().into_layers(Dfdx);
/// assert_eq!(linear.weight.array(), fused.weight.array());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Dfdx;

/// Converts a model's layers into the family `F`, moving the parameters (the tensors themselves,
/// so their ids and buffers are kept). Layers without a counterpart in `F` (activations, `()`)
/// stay as they are; tuples (dfdx's sequential models, up to 6) and `Repeated` stacks convert
/// layer by layer.
///
/// The families:
/// - [`Mpx`]: dfdx's layers to mpx's (`Linear` to the fused [`Linear`](super::Linear); to fuse
///   a `(Linear, ReLU)` pair into one [`LinearReLU`](super::LinearReLU), use
///   `LinearReLU::from((linear, relu))`);
/// - [`Dfdx`]: mpx's layers (and [`MxLinear`](crate::mx::MxLinear)) back to dfdx's;
/// - an [`MxConfig`](crate::mx::MxConfig) such as
///   [`Mxfp8Weights`](crate::mx::Mxfp8Weights): f32 `Linear` and `MxLinear` layers to
///   [`MxLinear`](crate::mx::MxLinear) with that config.
///
/// The single layers also convert with `From` both ways.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::mx::Mxfp8Weights;
/// use mpx_runtime::nn::{Dfdx, IntoLayers, Mpx};
/// let dev = Cpu::default();
/// let model = dev.build_module::<(Linear<4, 8>, ReLU, Linear<8, 2>), f32>();
/// let x = dev.tensor([[1.0f32, 2.0, 3.0, 4.0]]);
/// let want = model.forward(x.clone());
/// let fused = model.clone().into_layers(Mpx); // (mpx Linear<4, 8>, ReLU, mpx Linear<8, 2>)
/// for (a, b) in fused.forward(x.clone()).as_vec().iter().zip(want.as_vec()) {
///     assert!((a - b).abs() < 1e-5);
/// }
/// let back = fused.into_layers(Dfdx);
/// assert_eq!(back.2.weight.array(), model.2.weight.array());
/// let mx = model.into_layers(Mxfp8Weights); // MxLinear layers, weights in MXFP8
/// assert_eq!(mx.0.weight.array(), back.0.weight.array()); // the f32 master weights
/// ```
pub trait IntoLayers<F> {
    /// The model with `F`'s layers.
    type Output;
    /// Converts, moving the parameters.
    fn into_layers(self, family: F) -> Self::Output;
}

impl<F, T: IntoLayers<F>, const N: usize> IntoLayers<F> for Repeated<T, N>
where
    F: Copy,
{
    type Output = Repeated<T::Output, N>;
    fn into_layers(self, family: F) -> Self::Output {
        Repeated {
            modules: self
                .modules
                .into_iter()
                .map(|m| m.into_layers(family))
                .collect(),
        }
    }
}

/// [`IntoLayers`] impls, each `Layer => Family` (the layer is already in the family: it stays as
/// it is) or `Layer => Family: Output` (it converts by `From`), for the generic parameters in
/// brackets; doc comments go on the method.
macro_rules! into_layers {
    ($generics:tt $($(#[$doc:meta])* $from:ty => $fam:ty $(: $to:ty)?),+ $(,)?) => {$(
        $crate::nn::convert::into_layers!(@one $generics $(#[$doc])* $from => $fam $(: $to)?);
    )+};
    (@one [$($g:tt)*] $(#[$doc:meta])* $from:ty => $fam:ty) => {
        impl<$($g)*> $crate::nn::IntoLayers<$fam> for $from {
            type Output = Self;
            $(#[$doc])*
            fn into_layers(self, _: $fam) -> Self {
                self
            }
        }
    };
    (@one [$($g:tt)*] $(#[$doc:meta])* $from:ty => $fam:ty: $to:ty) => {
        impl<$($g)*> $crate::nn::IntoLayers<$fam> for $from {
            type Output = $to;
            $(#[$doc])*
            fn into_layers(self, _: $fam) -> Self::Output {
                self.into()
            }
        }
    };
}
pub(crate) use into_layers;

/// Layers that are the same in every family.
macro_rules! unchanged {
    ($($t:ty),* $(,)?) => {
        into_layers!([F] $($t => F),*);
    };
}

unchanged!(
    (),
    dfdx::nn::modules::ReLU,
    dfdx::nn::modules::Tanh,
    dfdx::nn::modules::Sigmoid,
    dfdx::nn::modules::FastGeLU,
    dfdx::nn::modules::AccurateGeLU,
    dfdx::nn::modules::Softmax,
    dfdx::nn::modules::LogSoftmax,
    dfdx::nn::modules::Abs,
    dfdx::nn::modules::Square,
    dfdx::nn::modules::Sin,
    dfdx::nn::modules::Cos,
    dfdx::nn::modules::Exp,
    dfdx::nn::modules::Ln,
    dfdx::nn::modules::Sqrt,
);

/// Tuples convert element by element.
macro_rules! tuple {
    ($($m:ident . $i:tt),+) => {
        impl<F: Copy, $($m: IntoLayers<F>),+> IntoLayers<F> for ($($m,)+) {
            type Output = ($($m::Output,)+);
            fn into_layers(self, family: F) -> Self::Output {
                ($(self.$i.into_layers(family),)+)
            }
        }
    };
}
crate::for_tuples!(tuple);

/// The one table of mpx's layers that stand for a dfdx layer of the same name, generic
/// parameters and fields (besides `Linear`, whose mpx counterpart is the fused `FusedLinear`
/// family: its own lines are in `linear.rs` and `step/mapped.rs`). Each line reads
/// `Name [const A, ..] { field, .. } by link;`: the fields carried from one family to the other
/// (none where the layer's two `From` impls are written by hand), and the macro that links a
/// mixed step's working copy of the layer to its master's tensors.
///
/// `counterparts!(then)` calls `then! { <the lines> }`. Every map between the families is
/// derived from it: [`IntoLayers`] and `From` both ways (`dfdx_layers!`, below) and the mixed
/// step's working copies ([`HalfLayers`](crate::step::HalfLayers) of both families' layers, in
/// `step/mapped.rs`).
macro_rules! counterparts {
    ($then:ident) => {
        $then! {
            LayerNorm1D [const M] { gamma, beta, epsilon } by link_none;
            MultiHeadAttention [const M, const H, const K, const V] { w_q, w_k, w_v, w_o }
                by link_attention;
            TransformerEncoderBlock [const M, const H, const F] { self_attn, norm1, ff, norm2 }
                by link_encoder_block;
            TransformerDecoderBlock [const M, const H, const F]
                { self_attn, norm1, mh_attn, norm2, ff, norm3 } by link_decoder_block;
            TransformerDecoder [const M, const H, const F, const L] {} by link_decoder;
            Transformer [const M, const H, const A, const B, const F] {} by link_transformer;
        }
    };
}
pub(crate) use counterparts;

/// [`IntoLayers`] for each layer of the [`counterparts`] table, through the layer's two `From`
/// impls: dfdx's into [`Mpx`], mpx's into [`Dfdx`]; each is already in its own family (so models
/// that mix both convert whole). Where the table lists fields, the two `From` impls are written
/// here too, each field carried across ([`Carry`]: a field of the same type in both moves as it
/// is, a layer converts).
macro_rules! dfdx_layers {
    ($($name:ident [$(const $c:ident),*] { $($f:ident),* } by $link:ident;)+) => {$(
        dfdx_layers!(@from $name [$(const $c),*] { $($f),* });
        into_layers!(
            [$(const $c: usize,)* E: dfdx::shapes::Dtype, D: dfdx::tensor::Storage<E>]
            super::$name<$($c,)* E, D> => Mpx,
            dfdx::nn::modules::$name<$($c,)* E, D> => Dfdx,
            dfdx::nn::modules::$name<$($c,)* E, D> => Mpx: super::$name<$($c,)* E, D>,
            super::$name<$($c,)* E, D> => Dfdx: dfdx::nn::modules::$name<$($c,)* E, D>,
        );
    )+};
    (@from $name:ident [$(const $c:ident),*] {}) => {};
    (@from $name:ident [$(const $c:ident),*] { $($f:ident),+ }) => {
        impl<$(const $c: usize,)* E: dfdx::shapes::Dtype, D: dfdx::tensor::Storage<E>>
            From<dfdx::nn::modules::$name<$($c,)* E, D>> for super::$name<$($c,)* E, D>
        {
            fn from(m: dfdx::nn::modules::$name<$($c,)* E, D>) -> Self {
                Self { $($f: Carry::carry(m.$f)),+ }
            }
        }
        impl<$(const $c: usize,)* E: dfdx::shapes::Dtype, D: dfdx::tensor::Storage<E>>
            From<super::$name<$($c,)* E, D>> for dfdx::nn::modules::$name<$($c,)* E, D>
        {
            fn from(m: super::$name<$($c,)* E, D>) -> Self {
                Self { $($f: Carry::carry(m.$f)),+ }
            }
        }
    };
}
counterparts!(dfdx_layers);

/// A field of a layer carried into the other family's layer: a tensor or a setting as it is, a
/// layer converted (dfdx's `Linear` to mpx's and back, a norm, an attention, a feed-forward).
pub(crate) trait Carry<T> {
    /// The field in the other family.
    fn carry(self) -> T;
}

impl<T> Carry<T> for T {
    fn carry(self) -> T {
        self
    }
}

/// A pair of layers that convert into each other with `From`.
macro_rules! carried {
    ($($dfdx:ident <-> $mpx:ident [$(const $c:ident),*]),* $(,)?) => {$(
        impl<$(const $c: usize,)* E: dfdx::shapes::Dtype, D: dfdx::tensor::Storage<E>>
            Carry<super::$mpx<$($c,)* E, D>> for dfdx::nn::modules::$dfdx<$($c,)* E, D>
        {
            fn carry(self) -> super::$mpx<$($c,)* E, D> {
                self.into()
            }
        }
        impl<$(const $c: usize,)* E: dfdx::shapes::Dtype, D: dfdx::tensor::Storage<E>>
            Carry<dfdx::nn::modules::$dfdx<$($c,)* E, D>> for super::$mpx<$($c,)* E, D>
        {
            fn carry(self) -> dfdx::nn::modules::$dfdx<$($c,)* E, D> {
                self.into()
            }
        }
    )*};
}
carried!(
    Linear <-> Linear [const I, const O],
    LayerNorm1D <-> LayerNorm1D [const M],
    MultiHeadAttention <-> MultiHeadAttention [const M, const H, const K, const V],
);

/// dfdx's feed-forward sub-layer and mpx's: `Residual<(Linear, ReLU, Linear)>` of each
/// family's `Linear`.
impl<const M: usize, const F: usize, E: dfdx::shapes::Dtype, D: dfdx::tensor::Storage<E>>
    Carry<super::FeedForward<M, F, E, D>>
    for Residual<(
        dfdx::nn::modules::Linear<M, F, E, D>,
        dfdx::nn::modules::ReLU,
        dfdx::nn::modules::Linear<F, M, E, D>,
    )>
{
    fn carry(self) -> super::FeedForward<M, F, E, D> {
        let (a, relu, b) = self.0;
        Residual((a.into(), relu, b.into()))
    }
}

impl<const M: usize, const F: usize, E: dfdx::shapes::Dtype, D: dfdx::tensor::Storage<E>>
    Carry<
        Residual<(
            dfdx::nn::modules::Linear<M, F, E, D>,
            dfdx::nn::modules::ReLU,
            dfdx::nn::modules::Linear<F, M, E, D>,
        )>,
    > for super::FeedForward<M, F, E, D>
{
    fn carry(
        self,
    ) -> Residual<(
        dfdx::nn::modules::Linear<M, F, E, D>,
        dfdx::nn::modules::ReLU,
        dfdx::nn::modules::Linear<F, M, E, D>,
    )> {
        let (a, relu, b) = self.0;
        Residual((a.into(), relu, b.into()))
    }
}
