//! [`Cast`](crate::cast::Cast) and [`FloatLeaves`](crate::cast::FloatLeaves) for the `mpx::nn` layers: field by field, as for dfdx's own
//! modules (`cast/dfdx_modules.rs`), so a model built from them is a castable tree.
//!
//! The mixed step's working copy goes through `TensorCollection` instead; these make the same
//! models work with [`cast_tree`](crate::cast::cast_tree), `#[derive(Cast)]` structs holding
//! them, and [`all_finite`](crate::finite::all_finite).

use super::vit::{ClassToken, ClassificationHead, PatchEmbedding, PositionEmbedding, Vit};
use super::{LayerNorm1D, MultiHeadAttention, TransformerEncoderBlock};
use crate::cast::cast_by_fields as layer;

layer!(LayerNorm1D [M] cast { gamma, beta } keep { epsilon });
layer!(MultiHeadAttention [M, H, K, V] cast { w_q, w_k, w_v, w_o } keep {});
layer!(TransformerEncoderBlock [M, H, F] cast { self_attn, norm1, ff, norm2 } keep {});
layer!(PatchEmbedding [PIXELS, PATCH_DIM, PATCHES, M] cast { linear } keep {});
layer!(PositionEmbedding [S, M] cast { pos } keep {});
layer!(ClassToken [M] cast { token } keep {});
layer!(ClassificationHead [M, C] cast { norm, linear } keep {});
layer!(Vit [PIXELS, PATCH_DIM, PATCHES, M, H, F, L, C] cast { patch_embed, pos_embed, encoder, head } keep {});
