//! mpx's own CPU kernels: a packed GEMM for f32, f16 and (emulated) bf16 operands, and the fused
//! element-wise passes of a Linear layer. dfdx 0.13's kernels are private and, on stable Rust,
//! limited to AVX2 with one f16 conversion per element; these pick the CPU's best instructions at
//! run time.
//!
//! Internal to the crate: the layers of [`nn`](crate::nn) and the precisions of
//! [`precision`](crate::precision) are their users. mpx's own benchmarks and tests reach a few
//! hooks through the hidden `mpx_runtime::__bench` ([`bench`]), which is not a public API.
//!
//! # Paths
//! A [`KernelPath`] names the instruction set the arithmetic runs on. With none forced, f16 and
//! bf16 operands run on their own instructions where the CPU has them (AVX512-FP16,
//! AVX512-BF16), and everything else on the fastest of the paths that compute the same bits,
//! measured on first use ([`calibration`]; separately for thin products, [`detected_path`](path::detected_path) for
//! the others). [`with_path`] forces one for the
//! current thread (tests and benchmarks run every path the CPU supports this way).
//!
//! | path | f32 operands | f16 operands | bf16 operands (f32 storage) |
//! |---|---|---|---|
//! | [`KernelPath::Avx512Fp16`] | f32 FMA, AVX-512 | **f16 FMA** (`vfmadd231ph`), sums moved to f32 every [`FP16_FLUSH`] products | rounded to bf16 while packing, f32 FMA, AVX-512 |
//! | [`KernelPath::Avx512Bf16`] | f32 FMA, AVX-512 | widened to f32, f32 FMA | **bf16 pair dot products** (`vdpbf16ps`), f32 sums (see `bf16.rs`) |
//! | [`KernelPath::Avx512`] | f32 FMA, AVX-512 | widened to f32 while packing, f32 FMA | as f32, after rounding |
//! | [`KernelPath::Avx2Fma`] | f32 FMA, AVX2 | widened, f32 FMA | as f32, after rounding |
//! | [`KernelPath::Portable`] | plain Rust | widened, plain Rust | as f32, after rounding |
//!
//! # Threads
//! A large product (at least 2^21 multiply-adds) runs on all the machine's hardware threads
//! ([`available_threads`]): the calling thread and the helper threads of a small persistent pool
//! (started on first use) pack its operands once, together, then claim blocks of the output one
//! at a time. Each
//! output element is computed by the same instructions in the same order whatever the thread
//! count, so results are bit-identical. [`with_threads`] forces the count for the current thread
//! (tests and benchmarks). (dfdx 0.13's CPU matmul also uses all cores, through rayon.)
//!
//! The pool stays because it measured faster than `std::thread::scope`, which starts threads for
//! each product: on the 9 products of the MLP step (f32, 2 threads, a 2-core Zen 4 EPYC shared
//! with other work) scope took 1.42x, 1.39x and 1.20x the pool's median time in three runs (e.g.
//! 23.2 ms against 19.4 ms per step, quartiles 19.5-27.5 against 15.4-22.1), and 1.06x on a
//! quieter machine at the commit that made the calibration and the kernels' import graph final
//! (8.68 against 8.17 ms; `cargo run --release --example bench_kernels`, its helper-threads
//! table). Scoped threads also
//! start with empty packing buffers, so every product pays their allocation and page faults
//! again; the pool's helpers keep theirs.
//!
//! # Error bounds
//! Let `u32 = 2^-24` and `u16 = 2^-11` be the unit roundoffs of f32 and f16, `γ(n, u) =
//! n·u / (1 - n·u)`, and `S = Σ_k |a_ik|·|b_kj|` over the operands as the kernel sees them (after
//! any bf16 rounding). Every path computes each `c_ij` as partial sums of products that are added
//! into an f32 accumulator; the error against the exact sum of those products is:
//!
//! - f32 FMA paths (f32, widened f16, bf16): `|ĉ - c| ≤ γ(K, u32)·S`. Each product of two f16 or
//!   bf16 values is exact in f32, so for f16 inputs this is also "f32-accumulated f16".
//! - [`KernelPath::Avx512Fp16`] on f16 operands: each run of at most [`FP16_FLUSH`] = 32 products is
//!   summed with f16 FMAs, then added into f32. With `R = ceil(K / 32)` runs,
//!   `|ĉ - c| ≤ (γ(32, u16) + γ(R + 1, u32))·S + K·2^-25`; the last term covers f16 underflow
//!   (half the smallest subnormal per FMA). `γ(32, u16) ≈ 0.0159` of `S`, against
//!   `γ(1024, u32) ≈ 6.1e-5` for f32-accumulated f16 at `K = 1024`: a worst case about 260 times
//!   larger. Typical errors are far below both (random-sign terms cancel their roundings). A partial sum past 65504 overflows to infinity, as any f16
//!   sum would; the mixed step's loss scaling treats it as any other overflow.
//!
//! - [`KernelPath::Avx512Bf16`] on bf16 operands: the products are exact as above, but subnormal
//!   bf16 inputs are read as zero and tiny results flushed to zero, and each k block of 256 is
//!   summed from zero and then added to `C`. Against the exact sum `c'` over the operands with
//!   subnormals read as zero (and `S'` likewise), with `R = ceil(K / 256)`:
//!   `|ĉ - c'| ≤ γ(K + R, u32)·S' + 2K·2^-126`. It differs from the f32 FMA paths on the same
//!   operands only in the order inside each pair of k (the odd one is added first) and in the
//!   flushing.
//!
//! [`fp16_error_bound`], [`bf16_error_bound`] and [`f32_error_bound`] compute these bounds; the
//! tests check every path against an f64 reference with them.
//!
//! # Safety
//! Most of mpx's `unsafe` is in this module, though not all of it: `precision/` reinterprets
//! `AMP<f16>` slices as f16 ones (`slices.rs`) and converts f16 and bf16 slices with F16C and
//! AVX2 after detecting them (`convert.rs`), and
//! `mx/block.rs` calls its row loops compiled for AVX2 after detecting it. Here: the SIMD micro-kernels (each runs only after its features
//! were detected; the AVX2 one reads tiles of A and B through pointers and strides, in place or
//! packed, whose ranges `strided.rs` checks against the operand slices), the AVX transpose that packs f32 and f16 panels with k
//! contiguous (`transpose.rs`), the peak-throughput loops, the driver's shared view of the output
//! through which threads write disjoint blocks of it, the shared view of the packed operands
//! whose parts the threads fill before any block reads them (`packs.rs`), and the pool's hand-off of a borrowed task
//! to its helper threads (`pool.rs`). Every `unsafe` block holds one unsafe operation and says
//! why it is sound (`// SAFETY:`; clippy's `undocumented_unsafe_blocks` and
//! `multiple_unsafe_ops_per_block` check it). The rest of packing and the element-wise passes are
//! safe Rust over slices. Sizes and offsets computed from callers' shapes use checked arithmetic
//! ([`MatRef`]'s constructors), so no shape wraps around into one that seems to fit.
//!
//! # Small and thin products
//! On [`KernelPath::Avx2Fma`] a block of an operand that would be read only a few times (A in a
//! product with few columns, B in one with few rows) or is small enough to stay in L1 is read
//! where it is instead of being packed first, and the first k block writes `C` instead of
//! zeroing it and adding. Neither changes a bit of the result: each output element is the same
//! FMA chain in the same order.

// The AVX-512 intrinsics are stable since Rust 1.89 and the AVX512-FP16 ones since 1.94: the
// workspace's `rust-version` is 1.94 for this module.

mod avx2;
mod avx512;
mod bf16;
mod driver;
mod epilogue;
mod error;
mod fp16;
mod isa;
mod mat;
mod pack;
mod packs;
mod path;
mod peak;
mod pool;
mod portable;
mod relu_grad;
mod relu_mask;
mod strided;
mod threads;
mod tile;
mod transpose;

pub use driver::{gemm_nanos, gemm_on};
pub use epilogue::Activation;
pub(crate) use epilogue::{
    ReluMask, add_f32_into, bias_act_into, relu_mask_bias_grad_f16, relu_mask_bias_grad_f32,
};
pub use error::KernelError;
pub use isa::KernelPath;
pub use mat::MatRef;
pub(crate) use path::gemm;
pub use path::{Calibration, active_path, calibration, with_path};
pub use peak::peak_fma_flops;
pub(crate) use pool::{every_part, zip_parts};
pub use threads::{available_threads, max_threads, set_max_threads, with_threads};

/// Hooks for mpx's own benchmarks and tests, re-exported as `mpx_runtime::__bench`: force a path
/// or a thread count, time a product, read the error bounds. Not a public API.
pub mod bench {
    pub use super::path::gemm;
    pub use super::{
        Calibration, KernelError, KernelPath, MatRef, active_path, available_threads,
        bf16_error_bound, calibration, f32_error_bound, fp16_error_bound, gemm_nanos, gemm_on,
        max_threads, peak_fma_flops, set_max_threads, use_scoped_threads, with_path, with_threads,
    };
    pub use crate::precision::FloatSlice;
}

/// Makes split products use `std::thread::scope` (`true`) or the persistent pool (`false`): for
/// the benchmark comparing the two (see `pool.rs`).
pub fn use_scoped_threads(on: bool) {
    pool::use_scoped_threads(on);
}

/// The f16 FMA path moves its partial sums into f32 after at most this many products.
pub(crate) const FP16_FLUSH: usize = 32;

/// `γ(n, u) = n·u / (1 - n·u)`, the classic bound on the relative error of an n-term sum.
fn gamma(n: usize, u: f64) -> f64 {
    let nu = n as f64 * u;
    if nu >= 1.0 {
        f64::INFINITY
    } else {
        nu / (1.0 - nu)
    }
}

/// The error bound of the f32 FMA paths for inner dimension `k`, as a multiple of `S = Σ|a||b|`
/// (see the kernels' module docs).
pub fn f32_error_bound(k: usize) -> f64 {
    gamma(k, 2f64.powi(-24))
}

/// The error bound of [`KernelPath::Avx512Fp16`] on f16 operands for inner dimension `k`:
/// `(relative, absolute)`, meaning `|ĉ - c| ≤ relative·S + absolute` (see the kernels' module docs).
pub fn fp16_error_bound(k: usize) -> (f64, f64) {
    let runs = k.div_ceil(FP16_FLUSH);
    (
        gamma(FP16_FLUSH.min(k.max(1)), 2f64.powi(-11)) + gamma(runs + 1, 2f64.powi(-24)),
        k as f64 * 2f64.powi(-25),
    )
}

/// The error bound of [`KernelPath::Avx512Bf16`] on bf16 operands for inner dimension `k`:
/// `(relative, absolute)`, meaning `|ĉ - c'| ≤ relative·S' + absolute`, where `c'` and `S'` are
/// taken over the bf16 operands with subnormal values read as zero (see the kernels' module docs).
pub fn bf16_error_bound(k: usize) -> (f64, f64) {
    (
        gamma(k + k.div_ceil(bf16::KC), 2f64.powi(-24)),
        2.0 * k as f64 * 2f64.powi(-126),
    )
}

#[cfg(test)]
mod tests;
