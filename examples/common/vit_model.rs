//! The ViT of `examples/vit.rs`, in one place: 8x8 digits cut into 16 patches of 2x2 pixels, a
//! patch embedding (`Linear`), a learned position embedding, a transformer encoder, mean pooling
//! over the patches and a classification head.
//!
//! The encoder is dfdx's own (`TransformerEncoder`: post-norm blocks of multi-head attention and
//! a ReLU feed-forward, each followed by `LayerNorm1D`). It sits behind the [`Encoder`] alias: to
//! run the same model on other encoder layers, change that alias (and, if their builder differs,
//! the one line in [`Vit`]'s `TensorCollection` impl that names it).
#![allow(dead_code)]

use dfdx::nn::modules::{Linear, TransformerEncoder};
use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection, TensorOptions};
use dfdx::prelude::*;
use mpx::precision::{AMP, f16};

use crate::digits::{CLASSES, FEATURES};

/// Side of a square patch, in pixels.
pub const PATCH: usize = 2;
/// Pixels per patch.
pub const PATCH_PIXELS: usize = PATCH * PATCH;
/// Patches per 8x8 image (the sequence length).
pub const PATCHES: usize = FEATURES / PATCH_PIXELS;
/// Width of the token vectors.
pub const DIM: usize = 32;
/// Attention heads.
pub const HEADS: usize = 4;
/// Hidden width of each block's feed-forward network.
pub const FF: usize = 64;
/// Encoder blocks.
pub const LAYERS: usize = 2;

/// The encoder: the one type to change to try other transformer layers.
pub type Encoder<E, D> = TransformerEncoder<DIM, HEADS, FF, LAYERS, E, D>;

/// The ViT, with parameters of dtype `E` on device `D`.
#[derive(Debug, Clone)]
pub struct Vit<E: Dtype, D: Storage<E>> {
    /// Patch embedding: each patch's pixels to a `DIM`-wide token.
    pub patch_embed: Linear<PATCH_PIXELS, DIM, E, D>,
    /// Learned position embedding, one row per patch, added to the tokens.
    pub pos_embed: Tensor<Rank2<PATCHES, DIM>, E, D>,
    /// The transformer encoder.
    pub encoder: Encoder<E, D>,
    /// Classification head on the mean of the encoded tokens.
    pub head: Linear<DIM, CLASSES, E, D>,
}

/// The model as the examples name it.
pub type VitModel<E, D> = Vit<E, D>;

/// Builds the f32 master ViT on `dev` (dfdx's default initialisation; position embedding zero).
pub fn build_vit(dev: &Cpu) -> VitModel<f32, Cpu> {
    VitModel::<f32, Cpu>::build(dev)
}

/// `TensorCollection` for each float dtype mpx trains in (f32, f16, `AMP<f16>`), on the CPU: dfdx's
/// own layers need `num_traits::Float + SampleUniform`, which dfdx does not re-export, so the
/// impl is spelled out per dtype instead of bounded generically.
macro_rules! vit_collection {
    ($($e:ty),*) => {$(
        impl TensorCollection<$e, Cpu> for Vit<$e, Cpu> {
            type To<E2: Dtype, D2: Device<E2>> = Vit<E2, D2>;

            fn iter_tensors<V: ModuleVisitor<Self, $e, Cpu>>(
                visitor: &mut V,
            ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
                visitor.visit_fields(
                    (
                        Self::module("patch_embed", |s| &s.patch_embed, |s| &mut s.patch_embed),
                        Self::tensor(
                            "pos_embed",
                            |s| &s.pos_embed,
                            |s| &mut s.pos_embed,
                            TensorOptions::reset_to_zeros(),
                        ),
                        Self::module("encoder", |s| &s.encoder, |s| &mut s.encoder),
                        Self::module("head", |s| &s.head, |s| &mut s.head),
                    ),
                    |(patch_embed, pos_embed, encoder, head)| Vit {
                        patch_embed,
                        pos_embed,
                        encoder,
                        head,
                    },
                )
            }
        }
    )*};
}
vit_collection!(f32, f16, AMP<f16>);

/// Tokens: a batch of `B` sequences of `PATCHES` vectors of width `N`.
pub type Tokens<B, const N: usize, E, D, T> = Tensor<(B, Const<PATCHES>, Const<N>), E, D, T>;

impl<B, E, D, T> Module<Tokens<B, PATCH_PIXELS, E, D, T>> for Vit<E, D>
where
    B: Dim,
    E: Dtype,
    D: Device<E>,
    T: Tape<E, D>,
    Linear<PATCH_PIXELS, DIM, E, D>:
        Module<Tokens<B, PATCH_PIXELS, E, D, T>, Output = Tokens<B, DIM, E, D, T>, Error = D::Err>,
    Encoder<E, D>:
        Module<Tokens<B, DIM, E, D, T>, Output = Tokens<B, DIM, E, D, T>, Error = D::Err>,
    Linear<DIM, CLASSES, E, D>: Module<
            Tensor<(B, Const<DIM>), E, D, T>,
            Output = Tensor<(B, Const<CLASSES>), E, D, T>,
            Error = D::Err,
        >,
{
    type Output = Tensor<(B, Const<CLASSES>), E, D, T>;
    type Error = D::Err;

    fn try_forward(
        &self,
        patches: Tokens<B, PATCH_PIXELS, E, D, T>,
    ) -> Result<Self::Output, D::Err> {
        let tokens = self.patch_embed.try_forward(patches)?;
        let shape = *tokens.shape();
        let tokens = tokens.try_add(self.pos_embed.retaped::<T>().try_broadcast_like(&shape)?)?;
        let encoded = self.encoder.try_forward(tokens)?;
        let pooled = encoded.try_mean::<(B, Const<DIM>), Axis<1>>()?;
        self.head.try_forward(pooled)
    }
}

/// Cuts row-major 8x8 images (`batch` of them, 64 pixels each) into `PATCH`x`PATCH` patches:
/// returns `batch x PATCHES x PATCH_PIXELS` values, patches in row-major order over the image,
/// pixels row-major inside each patch.
pub fn to_patches(images: &[f32]) -> Vec<f32> {
    const SIDE: usize = 8;
    const PER_ROW: usize = SIDE / PATCH;
    let mut out = Vec::with_capacity(images.len());
    for image in images.chunks_exact(FEATURES) {
        for p in 0..PATCHES {
            let (pr, pc) = (p / PER_ROW, p % PER_ROW);
            for r in 0..PATCH {
                let start = (pr * PATCH + r) * SIDE + pc * PATCH;
                out.extend_from_slice(&image[start..start + PATCH]);
            }
        }
    }
    out
}

/// A batch of `B` images (row-major f32 pixels) as a tensor of patches, ready for [`Vit`].
pub fn patch_tensor<const B: usize>(
    dev: &Cpu,
    images: &[f32],
) -> Tensor<Rank3<B, PATCHES, PATCH_PIXELS>, f32, Cpu> {
    assert_eq!(images.len(), B * FEATURES, "a batch of {B} images");
    dev.tensor_from_vec(to_patches(images), (Const, Const, Const))
}
