//! [`Cast`] and [`FloatLeaves`] for the `mpx::nn` layers: field by field, as for dfdx's own
//! modules (`cast/dfdx_modules.rs`), so a model built from them is a castable tree.
//!
//! The mixed step's working copy goes through `TensorCollection` instead; these make the same
//! models work with [`cast_tree`](crate::cast::cast_tree), `#[derive(Cast)]` structs holding
//! them, and [`all_finite`](crate::finite::all_finite).

use dfdx::tensor::Cpu;

use super::vit::{ClassToken, ClassificationHead, PatchEmbedding, PositionEmbedding, Vit};
use super::{LayerNorm1D, MultiHeadAttention, TransformerEncoderBlock};
use crate::cast::{Cast, FloatLeaves, FloatSliceMut};
use crate::precision::{AMP, FloatBits, Precision, f16};

/// Field-by-field impls of a layer for one element type `$e`.
macro_rules! layer_for {
    ($e:ty; $name:ident [$($c:ident),*] cast { $($f:ident),* } keep { $($k:ident),* }) => {
        impl<$(const $c: usize,)* P: Precision> Cast<P> for $name<$($c,)* $e, Cpu> {
            type Output = $name<$($c,)* P::Elem, Cpu>;
            fn cast(&self) -> Self::Output {
                $name { $($f: Cast::<P>::cast(&self.$f),)* $($k: self.$k,)* }
            }
        }
        impl<$(const $c: usize),*> FloatLeaves for $name<$($c,)* $e, Cpu> {
            fn visit_float_bits(&self, visit: &mut dyn FnMut(FloatBits<'_>) -> bool) -> bool {
                true $(&& self.$f.visit_float_bits(visit))*
            }
            fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
                $(self.$f.visit_floats_mut(visit);)*
            }
        }
    };
}

/// [`layer_for`] for every float element type (f32, f16, `AMP<f16>`).
macro_rules! layer {
    ($($t:tt)*) => {
        layer_for!(f32; $($t)*);
        layer_for!(f16; $($t)*);
        layer_for!(AMP<f16>; $($t)*);
    };
}

layer!(LayerNorm1D [M] cast { gamma, beta } keep { epsilon });
layer!(MultiHeadAttention [M, H, K, V] cast { w_q, w_k, w_v, w_o } keep {});
layer!(TransformerEncoderBlock [M, H, F] cast { self_attn, norm1, ff, norm2 } keep {});
layer!(PatchEmbedding [PIXELS, PATCH_DIM, PATCHES, M] cast { linear } keep {});
layer!(PositionEmbedding [S, M] cast { pos } keep {});
layer!(ClassToken [M] cast { token } keep {});
layer!(ClassificationHead [M, C] cast { norm, linear } keep {});
layer!(Vit [PIXELS, PATCH_DIM, PATCHES, M, H, F, L, C] cast { patch_embed, pos_embed, encoder, head } keep {});
