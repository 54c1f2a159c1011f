//! Runtime of [mpx](https://docs.rs/mpx-dfdx) (the `mpx-dfdx` package, library `mpx`): everything
//! that runs. Use it through the `mpx` crate.
//!
//! | module | what it holds |
//! |---|---|
//! | [`precision`] | full (`f32`) and half (`f16`, `AMP<f16>`, emulated `bf16`) precision types |
//! | [`policy`] | jmp-style precision policies and their strings |
//! | [`boundary`] | compile-time precision boundaries (trait bounds with clear errors) |
//! | [`cast`] | casting any tree between precisions |
//! | [`scaling`] | loss scales: no-op, static, dynamic |
//! | [`finite`] | bit-level finiteness checks |
//! | [`kernels`] | mpx's own CPU GEMM (f32, f16, bf16) and fused element-wise passes |
//! | [`nn`] | mixed-ready layers (a fused `Linear`) built on those kernels |
//! | [`step`] | the mixed-precision step: mixed gradients, skip-on-overflow updates |
//! | [`region`] | full-precision regions inside a half-precision graph |
//! | [`mx`] | OCP Microscaling (MX) block formats |
//! | [`nn`] | mixed-ready layers: layer norm, attention, transformer encoder, ViT |

pub mod boundary;
pub mod cast;
#[cfg(feature = "mpi")]
pub mod distributed;
pub mod finite;
pub mod kernels;
pub mod mx;
pub mod nn;
pub mod policy;
pub mod precision;
pub mod region;
pub mod scaling;
pub mod step;

/// dfdx, for paths in code the macros generate. Not a public API.
#[doc(hidden)]
pub use dfdx as __dfdx;
