//! dfdx 0.13's built-in modules. Parameter modules are cast field by field (each tensor with one
//! slice conversion), so scalar fields such as batch norm's `epsilon` and `momentum` keep their
//! values; wrappers (`Residual`, `Repeated`, ...) cast what they wrap; activations, pooling and
//! dropout hold no float leaves and are returned unchanged (`Dropout::p` is a hyperparameter,
//! not a leaf).
//!
//! Not covered: `Conv2D`, `ConvTrans2D`, `Flatten2D`, the 2D pools and `Upscale2DBy` (dfdx
//! exports them only with its `nightly` feature), `Reshape` and `Upscale2D` (private fields). Use
//! [`cast_module`](super::cast_module) for those and for any other `TensorCollection`.

#![allow(deprecated)] // GeLU: still a dfdx module users may hold

use dfdx::nn::modules::Transformer;
use dfdx::nn::modules::{
    Abs, AccurateGeLU, AddInto, AvgPoolGlobal, BatchNorm1D, BatchNorm2D, Bias2D, Cos, Dropout,
    DropoutOneIn, Embedding, Exp, FastGeLU, GeLU, GeneralizedResidual, LayerNorm1D, LeakyReLU,
    Linear, Ln, LogSoftmax, MaxPoolGlobal, MinPoolGlobal, MultiHeadAttention, ReLU, Repeated,
    Residual, Sigmoid, Sin, Softmax, SplitInto, Sqrt, Square, Tanh, TransformerDecoder,
    TransformerDecoderBlock, TransformerEncoderBlock, UnbiasedLinear,
};

use super::{Cast, FloatLeaves, FloatSliceMut, cast_by_fields};
use crate::precision::{AMP, FloatSlice, Precision, f16};

cast_by_fields!(Linear [I, O] cast { weight, bias } keep {});
cast_by_fields!(UnbiasedLinear [I, O] cast { weight } keep {});
cast_by_fields!(LayerNorm1D [M] cast { gamma, beta } keep { epsilon });
cast_by_fields!(BatchNorm1D [C] cast { scale, bias, running_mean, running_var } keep { epsilon, momentum });
cast_by_fields!(BatchNorm2D [C] cast { scale, bias, running_mean, running_var } keep { epsilon, momentum });
cast_by_fields!(Bias2D [C] cast { bias } keep {});
cast_by_fields!(Embedding [V, M] cast { weight } keep {});
cast_by_fields!(MultiHeadAttention [M, H, K, V] cast { w_q, w_k, w_v, w_o } keep {});
cast_by_fields!(TransformerEncoderBlock [M, H, F] cast { self_attn, norm1, ff, norm2 } keep {});
cast_by_fields!(TransformerDecoderBlock [M, H, F] cast { self_attn, norm1, mh_attn, norm2, ff, norm3 } keep {});
cast_by_fields!(TransformerDecoder [M, H, F, L] cast { 0 } keep {});
cast_by_fields!(Transformer [M, H, A, B, F] cast { encoder, decoder } keep {});

/// `LeakyReLU`'s slope is a value of the module's dtype.
macro_rules! leaky_for {
    ($($e:ty),*) => {$(
        impl<P: Precision> Cast<P> for LeakyReLU<$e> {
            type Output = LeakyReLU<P::Elem>;
            /// The slope is a float value of the module's dtype: it is cast with it.
            fn cast(&self) -> Self::Output {
                LeakyReLU(Cast::<P>::cast(&self.0))
            }
        }
        impl FloatLeaves for LeakyReLU<$e> {
            fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
                self.0.visit_floats(visit)
            }
            fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
                self.0.visit_floats_mut(visit)
            }
        }
    )*};
}
leaky_for!(f32, f16, AMP<f16>);

/// Wrappers cast the modules they hold.
macro_rules! wrapper {
    ($name:ident [$($g:ident),*] { $($f:tt : $t:ident),* }) => {
        impl<P: Precision, $($g: Cast<P>),*> Cast<P> for $name<$($g),*> {
            type Output = $name<$($g::Output),*>;
            fn cast(&self) -> Self::Output {
                $name { $($f: self.$f.cast()),* }
            }
        }
        impl<$($g: FloatLeaves),*> FloatLeaves for $name<$($g),*> {
            fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
                true $(&& self.$f.visit_floats(visit))*
            }
            fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
                $(self.$f.visit_floats_mut(visit);)*
            }
        }
    };
}
wrapper!(Residual [F] { 0: F });
wrapper!(AddInto [T] { 0: T });
wrapper!(SplitInto [T] { 0: T });
wrapper!(GeneralizedResidual [F, R] { f: F, r: R });

impl<P: Precision, T: Cast<P>, const N: usize> Cast<P> for Repeated<T, N> {
    type Output = Repeated<T::Output, N>;
    fn cast(&self) -> Self::Output {
        Repeated {
            modules: self.modules.cast(),
        }
    }
}
impl<T: FloatLeaves, const N: usize> FloatLeaves for Repeated<T, N> {
    fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
        self.modules.visit_floats(visit)
    }
    fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
        self.modules.visit_floats_mut(visit);
    }
}

/// Modules without float leaves: returned unchanged.
macro_rules! no_leaves {
    ($($name:ident $(<const $c:ident>)?),*) => {$(
        impl<$(const $c: usize,)? P: Precision> Cast<P> for $name$(<$c>)? {
            type Output = Self;
            fn cast(&self) -> Self {
                self.clone()
            }
        }
        impl<$(const $c: usize)?> FloatLeaves for $name$(<$c>)? {
            fn visit_floats(&self, _: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
                true
            }
            fn visit_floats_mut(&mut self, _: &mut dyn FnMut(FloatSliceMut<'_>)) {}
        }
    )*};
}
no_leaves!(
    ReLU, FastGeLU, AccurateGeLU, GeLU, Sin, Cos, Ln, Exp, Sigmoid, Tanh, Square, Sqrt, Abs,
    Softmax, LogSoftmax, Dropout, AvgPoolGlobal, MaxPoolGlobal, MinPoolGlobal,
    DropoutOneIn<const N>
);
