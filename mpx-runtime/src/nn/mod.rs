//! Mixed-ready neural network layers: dfdx's transformer layers with their precision-critical
//! operations in f32, for mpx's promise of "typical neural network functions, like Attention,
//! that are ready for mixed precision".
//!
//! | layer | dfdx counterpart | in f32 (a [`region`](crate::region)) | in the half type |
//! |---|---|---|---|
//! | [`LayerNorm1D`] | `LayerNorm1D` | mean, variance, `gamma`/`beta` | - |
//! | [`MultiHeadAttention`] | `MultiHeadAttention` | `q k^T / sqrt(d)` scaling and softmax; matmul sums | projections' and matmuls' outputs (one fused op per projection and one for all heads' attention) |
//! | [`TransformerEncoderBlock`] | `TransformerEncoderBlock` | its two layer norms (with the residual adds fused in) and attention softmax; matmul sums | feed-forward outputs |
//! | [`TransformerEncoder`] | `TransformerEncoder` | as the blocks | as the blocks |
//! | [`vit::PatchEmbedding`] | - | - | a `Linear` over flattened patches |
//! | [`vit::PositionEmbedding`] | - | - | the add |
//! | [`vit::ClassToken`] | - | - | the concatenation |
//! | [`vit::ClassificationHead`] | - | its layer norm | mean over tokens, `Linear` |
//! | [`vit::Vit`] | - | as its layers | as its layers |
//! | [`Linear`], [`LinearReLU`] | `Linear` (+ `ReLU`) | - | one fused op each way on mpx's own kernels: GEMM, then bias, activation and cast in one pass |
//!
//! Every layer has dfdx's field names and parameter layout, implements dfdx's
//! `TensorCollection` (so `alloc_grads`, optimizers, `build_module` and mpx's casts and mixed
//! steps work) and converts from and to dfdx's layer ([`IntoLayers`], `From`). With `f32` each is
//! bit-identical to dfdx's, forward and gradients.
//!
//! The precision: dfdx's `Module::forward` runs in the element type as the precision (f32, f16,
//! `AMP<f16>`: `E: Precision<Elem = E> + Dtype`); [`ForwardIn::forward_in`] names it, which emulated bf16
//! (f32 storage) needs.
//!
//! # Examples
//! ```
//! use dfdx::prelude::*;
//! use mpx_runtime::nn::TransformerEncoder;
//! use mpx_runtime::precision::f16;
//! let dev = Cpu::default();
//! let enc = dev.build_module::<TransformerEncoder<8, 2, 16, 2>, f16>();
//! let x: Tensor<Rank3<1, 3, 8>, f32, Cpu> = dev.tensor([[[30000.0; 8], [1.0; 8], [-2.0; 8]]]);
//! let y = enc.forward(x.to_dtype::<f16>());
//! assert!(y.array()[0].iter().flatten().all(|v| v.is_finite()));
//! ```

mod attention_core;
pub(crate) mod binary;
mod cast;
mod contiguous;
mod convert;
mod decoder;
pub(crate) mod dfdx_linear;
mod embedding;
mod encoder;
mod fused_linear;
mod half_ops;
mod in_bf16;
mod in_f32;
mod layer_impls;
mod layer_norm;
mod layer_norm_kernel;
pub(crate) mod linear;
pub(crate) mod matmul;
pub(crate) mod methods;
mod mha;
mod mixed;
mod relu;
mod residual;
pub(crate) mod scratch;
mod sublayer;
mod unary;
mod unbiased;
pub mod vit;

pub(crate) use contiguous::{contiguous, read_into};
pub use convert::*;
pub use decoder::*;
pub use embedding::Embedding;
pub use encoder::*;
pub use in_bf16::InBf16;
pub use in_f32::{InF32, InF32Copy};
pub use layer_norm::*;
pub use linear::*;
pub use mha::*;
pub use mixed::*;
pub use relu::ReLU;
pub use residual::{AddInto, GeneralizedResidual, Residual, ResidualAdd};
pub use sublayer::FeedForward;
pub use unary::{LeakyReLU, Sigmoid, Tanh};
pub use unbiased::UnbiasedLinear;
