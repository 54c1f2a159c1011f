//! [`Vit`]: patch embedding, position embedding, transformer encoder, classification head.

use dfdx::shapes::Const;
use dfdx::tensor::{Cpu, Tensor};

use super::{ClassificationHead, PatchEmbedding, PositionEmbedding};
use crate::nn::layer_impls::{build_on_device, composite_layer, mixed_module, native_module};
use crate::nn::{MixedModule, TransformerEncoder};

composite_layer! {
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
    ///
    /// Parts that do not fit together fail to compile when the model is built, here 3 heads for a
    /// width of 16:
    /// ```compile_fail
    /// use dfdx::prelude::*;
    /// let vit = Cpu::default().build_module::<mpx_runtime::nn::vit::Vit<64, 16, 4, 16, 3, 32, 1, 3>, f32>();
    /// ```
    #[derive(Debug, Clone)]
    pub struct Vit<
        const PIXELS,
        const PATCH_DIM,
        const PATCHES,
        const MODEL,
        const HEADS,
        const FF,
        const LAYERS,
        const CLASSES,
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
}

build_on_device!(
    Vit[const PIXELS, const PATCH_DIM, const PATCHES, const MODEL, const HEADS, const FF, const LAYERS, const CLASSES],
    checks: PatchEmbedding<PIXELS, PATCH_DIM, PATCHES, MODEL>, crate::nn::MultiHeadAttention<MODEL, HEADS>
);
native_module!(
    Vit[const PIXELS, const PATCH_DIM, const PATCHES, const MODEL, const HEADS, const FF, const LAYERS, const CLASSES]
);

mixed_module! {
    Vit[const PIXELS, const PATCH_DIM, const PATCHES, const MODEL, const HEADS, const FF, const LAYERS, const CLASSES],
    dims [B],
    fn(self, images: Tensor<(B, Const<PIXELS>), E, Cpu, T>) -> Tensor<(B, Const<CLASSES>), E, Cpu, T> {
        let x = MixedModule::<P, _>::try_mixed_forward(&self.patch_embed, images)?;
        let x = MixedModule::<P, _>::try_mixed_forward(&self.pos_embed, x)?;
        let x = MixedModule::<P, _>::try_mixed_forward(&self.encoder, x)?;
        MixedModule::<P, _>::try_mixed_forward(&self.head, x)
    }
}
