//! [`Vit`]: patch embedding, position embedding, transformer encoder, classification head.

use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection};
use dfdx::nn::{BuildModule, BuildOnDevice};
use dfdx::shapes::{Const, Dim, Dtype};
use dfdx::tensor::{Cpu, CpuError, Storage, Tape, Tensor};
use dfdx::tensor_ops::Device;

use super::{ClassificationHead, PatchEmbedding, PositionEmbedding};
use crate::nn::mixed::native_module;
use crate::nn::{MixedModule, TransformerEncoder};
use crate::precision::{AMP, Precision, f16};

/// A Vision Transformer for flattened square images `(B, PIXELS)`: `PATCHES` patches of
/// `PATCH_DIM` pixels embedded to width `MODEL`, plus a learned position embedding, through
/// `LAYERS` encoder blocks (`HEADS` heads, feed-forward width `FF`), pooled by the mean over
/// tokens into `CLASSES` logits.
///
/// Every layer is an `mpx::nn` layer: in a mixed step the layer norms, the attention softmax
/// and the head's pooling run in f32, the rest in the half type. `forward` runs in the
/// element's native precision; emulated bf16 calls
/// [`forward_in::<bf16, _>`](crate::nn::ForwardIn::forward_in).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::ForwardIn;
/// use mpx_runtime::nn::vit::Vit;
/// use mpx_runtime::precision::bf16;
/// // 8x8 images, 4x4 patches (4 tokens of 16 pixels), width 16, 2 heads, 1 block, 3 classes.
/// type Small = Vit<64, 16, 4, 16, 2, 32, 1, 3>;
/// let dev = Cpu::default();
/// let vit = dev.build_module::<Small, f32>();
/// let images: Tensor<Rank2<5, 64>, f32, Cpu> = dev.sample_uniform();
/// let logits = vit.forward_in::<bf16, _>(images);
/// assert_eq!(logits.shape(), &(Const::<5>, Const::<3>));
/// ```
#[derive(Debug, Clone)]
pub struct Vit<
    const PIXELS: usize,
    const PATCH_DIM: usize,
    const PATCHES: usize,
    const MODEL: usize,
    const HEADS: usize,
    const FF: usize,
    const LAYERS: usize,
    const CLASSES: usize,
    E: Dtype = f32,
    D: Storage<E> = Cpu,
> {
    /// Patches to tokens.
    pub patch_embed: PatchEmbedding<PIXELS, PATCH_DIM, PATCHES, MODEL, E, D>,
    /// Learned position embedding, one vector per patch.
    pub pos_embed: PositionEmbedding<PATCHES, MODEL, E, D>,
    /// The encoder blocks.
    pub encoder: TransformerEncoder<MODEL, HEADS, FF, LAYERS, E, D>,
    /// Mean over tokens, layer norm, logits.
    pub head: ClassificationHead<MODEL, CLASSES, E, D>,
}

impl<
    const PIXELS: usize,
    const PATCH_DIM: usize,
    const PATCHES: usize,
    const MODEL: usize,
    const HEADS: usize,
    const FF: usize,
    const LAYERS: usize,
    const CLASSES: usize,
    E0: Dtype,
    D0: Storage<E0>,
    E: Dtype,
    D: Device<E>,
> BuildOnDevice<D, E> for Vit<PIXELS, PATCH_DIM, PATCHES, MODEL, HEADS, FF, LAYERS, CLASSES, E0, D0>
where
    Vit<PIXELS, PATCH_DIM, PATCHES, MODEL, HEADS, FF, LAYERS, CLASSES, E, D>: BuildModule<D, E>,
{
    type Built = Vit<PIXELS, PATCH_DIM, PATCHES, MODEL, HEADS, FF, LAYERS, CLASSES, E, D>;
    fn try_build_on_device(device: &D) -> Result<Self::Built, D::Err> {
        // The geometry and head checks of the parts, at compile time.
        #[allow(clippy::let_unit_value)]
        let () = PatchEmbedding::<PIXELS, PATCH_DIM, PATCHES, MODEL, E, D>::TYPE_CHECK;
        #[allow(clippy::let_unit_value)]
        let () = crate::nn::MultiHeadAttention::<MODEL, HEADS, MODEL, MODEL, E, D>::TYPE_CHECK;
        Self::Built::try_build(device)
    }
}

/// `TensorCollection` for each float element (dfdx's `Linear` needs a concrete one).
macro_rules! collection {
    ($($e:ty),*) => {$(
        impl<
            const PIXELS: usize,
            const PATCH_DIM: usize,
            const PATCHES: usize,
            const MODEL: usize,
            const HEADS: usize,
            const FF: usize,
            const LAYERS: usize,
            const CLASSES: usize,
            D: Device<$e>,
        > TensorCollection<$e, D>
            for Vit<PIXELS, PATCH_DIM, PATCHES, MODEL, HEADS, FF, LAYERS, CLASSES, $e, D>
        {
            type To<E2: Dtype, D2: Device<E2>> =
                Vit<PIXELS, PATCH_DIM, PATCHES, MODEL, HEADS, FF, LAYERS, CLASSES, E2, D2>;

            fn iter_tensors<V: ModuleVisitor<Self, $e, D>>(
                visitor: &mut V,
            ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
                visitor.visit_fields(
                    (
                        Self::module("patch_embed", |s| &s.patch_embed, |s| &mut s.patch_embed),
                        Self::module("pos_embed", |s| &s.pos_embed, |s| &mut s.pos_embed),
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
collection!(f32, f16, AMP<f16>);

native_module!(
    Vit[const PIXELS, const PATCH_DIM, const PATCHES, const MODEL, const HEADS, const FF, const LAYERS, const CLASSES]
);

impl<
    const PIXELS: usize,
    const PATCH_DIM: usize,
    const PATCHES: usize,
    const MODEL: usize,
    const HEADS: usize,
    const FF: usize,
    const LAYERS: usize,
    const CLASSES: usize,
    E,
    P,
    B,
    T,
> MixedModule<P, Tensor<(B, Const<PIXELS>), E, Cpu, T>>
    for Vit<PIXELS, PATCH_DIM, PATCHES, MODEL, HEADS, FF, LAYERS, CLASSES, E, Cpu>
where
    E: Precision<Elem = E> + Dtype,
    P: Precision<Elem = E>,
    Cpu: Device<E>,
    B: Dim,
    T: Tape<E, Cpu>,
{
    type Output = Tensor<(B, Const<CLASSES>), E, Cpu, T>;
    fn try_mixed_forward(
        &self,
        images: Tensor<(B, Const<PIXELS>), E, Cpu, T>,
    ) -> Result<Self::Output, CpuError> {
        let x = MixedModule::<P, _>::try_mixed_forward(&self.patch_embed, images)?;
        let x = MixedModule::<P, _>::try_mixed_forward(&self.pos_embed, x)?;
        let x = MixedModule::<P, _>::try_mixed_forward(&self.encoder, x)?;
        MixedModule::<P, _>::try_mixed_forward(&self.head, x)
    }
}
