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
//! | [`nn`] | mixed-ready layers (a fused `Linear`, layer norm, attention, transformer encoder, ViT) built on mpx's own CPU kernels (a GEMM for f32, f16 and bf16 operands and fused element-wise passes, in the `mpx-kernels` crate) |
//! | [`settings`] | mpx's process-wide settings, all opt-in: the kernels' threads, buffers kept between steps |
//!
//! # Safety
//! This crate has no `unsafe` code: every `unsafe` operation mpx needs (SIMD kernels, slice
//! views, the thread pool) is in the `mpx-kernels` crate, behind safe functions, and its crate
//! docs state how each is made sound. Two modules are exceptions, each only with its feature,
//! where `unsafe_code` is allowed on that module alone (and denied everywhere else):
//! `step::device::cuda` (feature `cuda`, kernel launches through cudarc) and `distributed`
//! (feature `mpi`, the `Send` and `Sync` of its reducer). Without those features the crate
//! forbids `unsafe_code`.

// No `unsafe` here: it lives in `mpx-kernels`. The two feature-gated exceptions (see the crate
// docs) allow it on their own modules, which `forbid` would not let them do.
#![cfg_attr(not(any(feature = "cuda", feature = "mpi")), forbid(unsafe_code))]
#![cfg_attr(any(feature = "cuda", feature = "mpi"), deny(unsafe_code))]

/// Invokes the macro `$m` once for each tuple arity mpx implements its traits for (1 to 6
/// elements), as `$m!(A.0, B.1, ..)`: each element's type parameter and index. The names leave
/// out `E`, `F` and `H`, which the impls use for an element type, a family and a precision.
macro_rules! for_tuples {
    ($m:ident) => {
        $m!(A.0);
        $m!(A.0, B.1);
        $m!(A.0, B.1, C.2);
        $m!(A.0, B.1, C.2, D.3);
        $m!(A.0, B.1, C.2, D.3, G.4);
        $m!(A.0, B.1, C.2, D.3, G.4, J.5);
    };
}
pub(crate) use for_tuples;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
pub mod boundary;
pub mod cast;
// `unsafe impl Send/Sync for Reducer` (an MPI communicator's handle), until it is removed there.
#[cfg(feature = "mpi")]
#[allow(unsafe_code)]
pub mod distributed;
pub mod finite;
mod master;
pub mod mx;
pub mod nn;
pub mod policy;
pub mod precision;
pub mod region;
pub mod scaling;
pub mod settings;
pub mod step;
mod walk;

/// Hooks into mpx's GEMM for its own benchmarks and tests (force a path or a thread count, time a
/// product, read the error bounds). Not a public API: it may change in any release. The thread
/// settings here are [`settings`]' own.
#[doc(hidden)]
pub mod __bench {
    pub use crate::precision::FloatSlice;
    pub use mpx_kernels::threads::{
        available_threads, max_threads, set_max_threads, use_scoped_threads, with_threads,
    };
    pub use mpx_kernels::{
        Caches, Calibration, KernelError, KernelPath, MatRef, Sizing, active_path,
        bf16_error_bound, bf16_pairs_preferred, calibration, f32_error_bound, fp16_error_bound,
        gemm, gemm_on, peak_fma_flops, with_blocking, with_path,
    };
}

/// dfdx, for paths in code the macros generate. Not a public API.
#[doc(hidden)]
pub use dfdx as __dfdx;
