//! # mpx: mixed-precision training for dfdx
//!
//! The facade crate: depend on `mpx` alone. It re-exports the runtime ([`mpx_runtime`]) and the
//! attribute macros ([`mpx_macros`]).
#![warn(missing_docs, unreachable_pub, clippy::pedantic)]

pub use mpx_macros::{Cast, autocast, full_precision, mixed_step};
pub use mpx_runtime::*;

/// The benchmark hooks ([`mpx_runtime::__bench`]) under their former path, for the examples and
/// tests that still import `mpx::kernels` (`examples/bench_step.rs`). Not a public API.
#[doc(hidden)]
pub use mpx_runtime::__bench as kernels;

#[doc(hidden)]
/// Paths used by macro-generated code. Not a public API.
pub mod __private {
    pub use mpx_runtime;
}
