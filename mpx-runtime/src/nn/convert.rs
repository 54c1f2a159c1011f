//! [`DfdxLayer`]: conversions between `mpx::nn` layers and the dfdx layers they stand for.

use dfdx::nn::modules::Repeated;

/// An `mpx::nn` layer with a dfdx counterpart of the same parameter layout: weights move across
/// unchanged (the tensors themselves, so ids and buffers are kept).
///
/// The single layers also implement `From` both ways; this trait covers the stacks
/// (`Repeated`, which is dfdx's `TransformerEncoder`) too.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::{DfdxLayer, TransformerEncoder};
/// let dev = Cpu::default();
/// let theirs = dev.build_module::<dfdx::nn::builders::TransformerEncoder<8, 2, 16, 2>, f32>();
/// let ours = TransformerEncoder::<8, 2, 16, 2>::from_dfdx(theirs.clone());
/// assert_eq!(ours.modules[1].norm2.gamma.array(), theirs.modules[1].norm2.gamma.array());
/// let back = ours.into_dfdx();
/// assert_eq!(back.modules[0].ff.0.0.weight.array(), theirs.modules[0].ff.0.0.weight.array());
/// ```
pub trait DfdxLayer: Sized {
    /// The dfdx layer with the same parameters.
    type Dfdx;
    /// Takes over a dfdx layer's parameters.
    fn from_dfdx(layer: Self::Dfdx) -> Self;
    /// Hands the parameters back as the dfdx layer.
    fn into_dfdx(self) -> Self::Dfdx;
}

impl<T: DfdxLayer, const N: usize> DfdxLayer for Repeated<T, N> {
    type Dfdx = Repeated<T::Dfdx, N>;
    fn from_dfdx(layer: Self::Dfdx) -> Self {
        Repeated {
            modules: layer.modules.into_iter().map(T::from_dfdx).collect(),
        }
    }
    fn into_dfdx(self) -> Self::Dfdx {
        Repeated {
            modules: self.modules.into_iter().map(T::into_dfdx).collect(),
        }
    }
}

/// Implements [`DfdxLayer`] through the layer's two `From` impls.
macro_rules! dfdx_layer {
    ($name:ident [$(const $c:ident),*]) => {
        impl<$(const $c: usize,)* E: dfdx::shapes::Dtype, D: dfdx::tensor::Storage<E>>
            $crate::nn::DfdxLayer for $name<$($c,)* E, D>
        {
            type Dfdx = dfdx::nn::modules::$name<$($c,)* E, D>;
            fn from_dfdx(layer: Self::Dfdx) -> Self {
                layer.into()
            }
            fn into_dfdx(self) -> Self::Dfdx {
                self.into()
            }
        }
    };
}
pub(crate) use dfdx_layer;
