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
//! | [`step`] | the mixed-precision step: mixed gradients, skip-on-overflow updates |
//! | [`region`] | full-precision regions inside a half-precision graph |
//! | [`mx`] | OCP Microscaling (MX) block formats |
//! | [`nn`] | mixed-ready layers (a fused `Linear`, layer norm, attention, transformer encoder, ViT) built on mpx's own CPU kernels (a GEMM for f32, f16 and bf16 operands and fused element-wise passes; internal, not a public API) |

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
pub mod boundary;
pub mod cast;
#[cfg(feature = "mpi")]
pub mod distributed;
pub mod finite;
pub(crate) mod kernels;
pub mod mx;
pub mod nn;
pub mod policy;
pub mod precision;
pub mod region;
pub mod scaling;
pub mod step;

/// Hooks into mpx's GEMM for its own benchmarks and tests (force a path or a thread count, time a
/// product). Not a public API: it may change in any release.
#[doc(hidden)]
pub use kernels::bench as __bench;

/// dfdx, for paths in code the macros generate. Not a public API.
#[doc(hidden)]
pub use dfdx as __dfdx;
