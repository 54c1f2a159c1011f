//! A small Vision Transformer (ViT) from mixed-ready layers: [`PatchEmbedding`] (a `Linear`
//! over flattened patches), [`PositionEmbedding`] (a learned tensor added to the sequence),
//! optionally a [`ClassToken`],
//! the [`TransformerEncoder`](super::TransformerEncoder), and a [`ClassificationHead`] (mean
//! over tokens or the class token, `LayerNorm1D`, `Linear`), put together as [`Vit`] (mean
//! pooling).
//!
//! Images come in flattened, row-major: `(batch, PIXELS)` with `PIXELS` a square (64 for the
//! 8x8 digits). [`DigitsVit`] is the configuration for them: 2x2 patches, 16 tokens of width 32.
//!
//! # Examples
//! ```
//! use dfdx::prelude::*;
//! use mpx_runtime::nn::vit::DigitsVit;
//! use mpx_runtime::precision::f16;
//! let dev = Cpu::default();
//! let vit = dev.build_module::<DigitsVit, f16>();
//! let images: Tensor<Rank2<3, 64>, f32, Cpu> = dev.sample_uniform();
//! let logits = vit.forward(images.to_dtype::<f16>());
//! assert_eq!(logits.shape(), &(Const::<3>, Const::<10>));
//! ```

mod class_token;
mod head;
mod model;
mod patch;
mod position;

pub use class_token::*;
pub use head::*;
pub use model::*;
pub use patch::*;
pub use position::*;
