//! A small Vision Transformer (ViT) from mixed-ready layers: [`PatchEmbedding`] (a `Linear`
//! over flattened patches), [`PositionEmbedding`] (a learned tensor added to the sequence),
//! optionally a [`ClassToken`],
//! the [`TransformerEncoder`](super::TransformerEncoder), and a [`ClassificationHead`] (mean
//! over tokens or the class token, `LayerNorm1D`, `Linear`), put together as [`Vit`] (mean
//! pooling).
//!
//! Images come in flattened, row-major: `(batch, PIXELS)` with `PIXELS` a square (64 for 8x8
//! images). `examples/vit.rs` trains one on the 8x8 digits.
//!
//! # Examples
//! ```
//! use dfdx::prelude::*;
//! use mpx_runtime::nn::vit::Vit;
//! use mpx_runtime::precision::f16;
//! // 8x8 images in 2x2 patches (16 tokens of 4 pixels), width 32, 4 heads, feed-forward 64,
//! // 2 encoder blocks, 10 classes.
//! type Small = Vit<64, 4, 16, 32, 4, 64, 2, 10>;
//! let dev = Cpu::default();
//! let vit = dev.build_module::<Small, f16>();
//! assert_eq!(vit.encoder.modules.len(), 2);
//! // patches 4*32+32, positions 16*32, two blocks of 4*(32*32+32) + 2*64 + (32*64+64) + (64*32+32),
//! // head 64 + 32*10+10
//! assert_eq!(vit.num_trainable_params(), 160 + 512 + 2 * 8544 + 394);
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
