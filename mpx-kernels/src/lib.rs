//! mpx's CPU kernels: a packed GEMM for f32, f16 and (emulated) bf16 operands, the fused
//! element-wise passes of a Linear layer, SIMD slice conversions between f32 and f16 or bf16,
//! and the small thread pool they run on. dfdx 0.13's kernels are private and, on stable Rust,
//! limited to AVX2 with one f16 conversion per element; these pick the CPU's best instructions at
//! run time.
//!
//! This crate is the runtime half of [mpx](https://docs.rs/mpx-dfdx) (the `mpx-dfdx` package,
//! library `mpx`) that needs `unsafe`: **all of mpx's `unsafe` code is here**, behind the safe
//! functions and types below, and `mpx-runtime` and `mpx` forbid `unsafe_code`. Use it through
//! `mpx`; its layers ([`mpx::nn`](https://docs.rs/mpx-dfdx/latest/mpx/nn/)) and precisions are the
//! kernels' users, and `mpx::settings` re-exports the knobs of [`threads`], the kernels' process-wide settings.
//!
//! | item | what it is |
//! |---|---|
//! | [`gemm`], [`gemm_on`], [`MatRef`], [`KernelPath`] | `C = A·B` on strided views of f32, f16 or bf16 values, on the fastest or a chosen instruction set |
//! | [`FloatSlice`], [`FloatSliceMut`] | a slice of values of some precision, to read or to write (mpx re-exports them from `mpx::precision`) |
//! | [`bias_act_into`], [`ReluMask`], [`relu_mask_bias_grad_f16`], [`relu_mask_bias_grad_f32`], [`add_f32_into`] | the fused element-wise passes around a Linear layer's products |
//! | [`convert`] | f16 and bf16 slice conversions (F16C, AVX2) |
//! | [`apply_scalar_f16`], [`zip_f16`], [`add_scaled_f16`], [`Arith`] | f16 tensors' arithmetic with a scalar or with each other, and a constant derivative's gradient pass, each in one pass (F16C) |
//! | `amp` | views between `AMP<f16>` and `f16` slices (feature `amp`) |
//! | [`zip_parts`], [`every_part`] | element-wise passes over long slices, cut over the pool's threads |
//! | [`with_avx2`], [`Avx2Task`] | safe code run in a copy compiled for AVX2 where the CPU has it (mpx's MX block codec) |
//! | [`threads`] | how many threads a product uses: [`set_max_threads`](threads::set_max_threads), [`with_threads`](threads::with_threads), ... |
//! | [`with_path`], [`calibration`], [`peak_fma_flops`], the error bounds | forcing and measuring the kernels (mpx's benchmarks and tests) |
//! | [`Caches`] | the data caches' sizes (read once at run time), which size the AVX2 GEMM's blocking |
//!
//! # Examples
//! ```
//! use mpx_kernels::{MatRef, gemm};
//!
//! // [1 2; 3 4] · [5; 6]
//! let a = MatRef::row_major_f32(&[1.0, 2.0, 3.0, 4.0], 2, 2)?;
//! let b = MatRef::row_major_f32(&[5.0, 6.0], 2, 1)?;
//! let mut c = [0.0f32; 2];
//! gemm(a, b, &mut c, false)?;
//! assert_eq!(c, [17.0, 39.0]);
//! # Ok::<(), mpx_kernels::KernelError>(())
//! ```
//!
//! # Safety policy
//! **What is unsafe, and why.** Four kinds of operation, each because safe Rust has no way to
//! express it at the speed the kernels need:
//!
//! 1. *SIMD instructions the build does not assume*: the AVX2, AVX-512 (F, BW, VL, FP16, BF16) and
//!    F16C intrinsics, in `#[target_feature]` functions, so one binary runs on every x86-64 CPU
//!    and uses the best instructions the CPU has. Calling such a function is `unsafe`: the CPU
//!    must have the features.
//! 2. *Raw-pointer loads and stores* inside those functions: the micro-kernels read panels of A
//!    and B and read-modify-write tiles of C through pointers and strides; the smallest products
//!    (`micro.rs`) read their operands element by element without a bounds check each; the
//!    conversions, the f16 arithmetic (`arith.rs`) and the transpose load and store groups of 8
//!    or 16 values.
//! 3. *Shared mutable views across threads*: a split product's threads write disjoint blocks of
//!    one output (`tile.rs`'s `Out`) and fill disjoint parts of the packed operands that every
//!    block then reads (`packs.rs`'s `PackView`); the borrow checker cannot see that the blocks
//!    are disjoint.
//! 4. *Lifetime and type reinterpretation*: the pool hands a borrowed task to its persistent
//!    helper threads with its lifetime erased (`pool.rs`), and `amp` views `AMP<f16>` slices as
//!    `f16` ones (`#[repr(transparent)]`).
//!
//! **How every entry point is made sound.** Every public function and type is safe and sound for
//! every input; an input it cannot take is an error ([`KernelError`]) or a documented panic
//! (slices of different lengths), never undefined behaviour:
//!
//! - *CPU features* are detected at run time (`is_x86_feature_detected!`, cached) before any
//!   `#[target_feature]` function is called: [`KernelPath::is_supported`] for the GEMM paths
//!   ([`gemm_on`] and [`with_path`] reject a path the CPU lacks, and [`peak_fma_flops`] too),
//!   [`convert::has_f16c`] and an AVX2 check for the conversions, the AVX-512 checks of the
//!   element-wise passes, AVX2 for [`with_avx2`]. Off x86-64 only the portable code runs.
//! - *Shapes* are checked before a pointer is formed: a [`MatRef`] is valid by construction (its
//!   constructors check, with checked arithmetic, that every element its shape and strides reach
//!   lies inside its slice, and its fields are private), [`gemm_on`] checks it again with the
//!   inner dimensions and the output's length, and the block loops check each tile's range
//!   against the slices (`strided.rs`, `Out::tile`; the small products check the last element
//!   each operand reaches, once per product or tile: `micro.rs`, `tiny.rs`). The element-wise
//!   passes check that their slices are whole rows of one length; the conversions and
//!   [`zip_parts`] that their slices have one length.
//! - *Threads*: the output and the packed operands are split into disjoint blocks computed from
//!   one grid; packing (the only writer of the packed operands) finishes before any block reads
//!   them; the pool's caller does not return (or unwind) before every block it handed out is done,
//!   so the borrowed task outlives every use; a panic in a block is caught on the helper and
//!   re-raised on the caller.
//!
//! **How it is checked.** Every `unsafe` block holds one unsafe operation and says why it is
//! sound in a `// SAFETY:` comment (clippy's `undocumented_unsafe_blocks` and
//! `multiple_unsafe_ops_per_block`, errors in CI); an `unsafe fn` states its contract under
//! `# Safety`, and its body still marks each unsafe operation (`#![deny(unsafe_op_in_unsafe_fn)]`).
//! The tests run every path this CPU supports against an f64 reference, the SIMD loops against
//! their portable definitions bit for bit, odd shapes and strides, and more threads than cores.
//!
//! **Unsafe outside this crate.** Two places in `mpx-runtime`, each allowed on its own module
//! only and only with its feature (the crate forbids `unsafe_code` otherwise):
//!
//! - `step/device/cuda.rs` (feature `cuda`): the launches of mpx's own CUDA kernels through
//!   cudarc (`CudaFunction::launch` is unsafe: it cannot check a kernel's parameter types).
//!   They take dfdx's gradient buffers of dfdx's element types on dfdx's `Cuda` device, and
//!   are built only where CUDA is; each launch checks its lengths first and says why it is sound.
//! - `distributed/mod.rs` (feature `mpi`): `unsafe impl Send/Sync for Reducer`, which holds an
//!   MPI communicator; to be removed there.
//!
//! # Process-wide state
//! The kernels keep some state beyond a call; none of it changes a result's bits, only speed:
//!
//! - Knobs, all in [`threads`]: the thread cap of [`set_max_threads`](threads::set_max_threads)
//!   (process-wide, an atomic), the per-thread override of [`with_threads`](threads::with_threads),
//!   and the pool-or-scoped-threads switch of [`use_scoped_threads`](threads::use_scoped_threads)
//!   (process-wide, for a benchmark). mpx re-exports them in `mpx::settings`.
//! - [`with_path`]'s per-thread forced path, and the [`calibration`] (process-wide, measured once
//!   on first use), with the CPU feature detections (cached once).
//! - The pool's helper threads (started on first use, one per extra thread asked for, kept for
//!   the life of the process; see [Threads](#threads)).
//! - Per-thread scratch buffers, grown to the largest product seen and kept, so no product pays
//!   fresh allocations and page faults: the packed operands (f32, f16 bits and bf16 pairs, one set
//!   per thread, the pool's helpers included), the widened or rounded copies of f16 and bf16
//!   operands, and the staging of f16 and bf16 panels before they are widened or rounded.
//!
//! # Paths
//! A [`KernelPath`] names the instruction set the arithmetic runs on. With none forced, bf16
//! operands run on their own instructions (AVX512-BF16: exact products, f32 sums) on the CPUs
//! that run them faster than f32 FMAs ([`bf16_pairs_preferred`]), and everything else, f16 operands included, on the fastest of the paths that
//! compute the same bits, measured on first use ([`calibration`]: once for thin products, once
//! for the others). f16 operands are widened and summed in f32, so a product gives the same bits
//! on every CPU; [`KernelPath::Avx512Fp16`], which sums in f16 (see the error bounds below),
//! runs only where it is forced. [`with_path`] forces a path for the current thread (tests and
//! benchmarks run every path the CPU supports this way).
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
//! ([`available_threads`](threads::available_threads)): the calling thread and the helper threads of a small persistent pool
//! (started on first use) pack its operands once, together, then claim blocks of the output one
//! at a time. Each
//! output element is computed by the same instructions in the same order whatever the thread
//! count, so results are bit-identical. [`set_max_threads`](threads::set_max_threads) caps the
//! count for the process, [`with_threads`](threads::with_threads) forces it for the current
//! thread (tests and benchmarks). (dfdx 0.13's CPU matmul also uses all cores, through rayon.)
//!
//! The pool stays because it measured faster than `std::thread::scope`, which starts threads for
//! each product: on the 9 products of the MLP step (f32, 2 threads, a 2-core Zen 4 EPYC shared
//! with other work) scope took 1.42x, 1.39x and 1.20x the pool's median time in three runs (e.g.
//! 23.2 ms against 19.4 ms per step, quartiles 19.5-27.5 against 15.4-22.1), and 1.06x on a
//! quieter machine at the commit that made the calibration and the kernels' import graph final
//! (8.68 against 8.17 ms; `cargo run --release --example bench_kernels`, its helper-threads
//! table), and 1.088x at `a6fa813` on a 2-core Zen 5 (6.63 against 6.09 ms). Scoped threads also
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
//! # Small and thin products
//! On [`KernelPath::Avx2Fma`] a block of an operand that would be read only a few times (A in a
//! product with few columns, B in one with few rows) or is small enough to stay in L1 is read
//! where it is instead of being packed first, and the first k block writes `C` instead of
//! zeroing it and adding. Neither changes a bit of the result: each output element is the same
//! FMA chain in the same order.

// The AVX-512 intrinsics are stable since Rust 1.89 and the AVX512-FP16 ones since 1.94: the
// workspace's `rust-version` is 1.94 for this crate.
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(feature = "amp")]
pub mod amp;
mod arith;
mod avx2;
mod avx512;
mod bf16;
mod caches;
pub mod convert;
mod dispatch;
mod driver;
mod epilogue;
mod error;
mod fp16;
mod isa;
mod mat;
mod micro;
mod pack;
mod packs;
mod path;
mod peak;
mod pool;
mod portable;
mod relu_grad;
mod relu_mask;
mod strided;
pub mod threads;
mod tile;
mod tiny;
mod transpose;
mod views;
mod wide;

pub use arith::{Arith, add_scaled_f16, apply_scalar_f16, zip_f16};
pub use caches::Caches;
#[doc(hidden)]
pub use caches::{Sizing, with_blocking};
pub use dispatch::{Avx2Task, with_avx2};
pub use driver::gemm_on;
pub use epilogue::{
    Activation, ReluMask, add_f32_into, bias_act_into, relu_mask_bias_grad_f16,
    relu_mask_bias_grad_f32,
};
pub use error::KernelError;
pub use isa::KernelPath;
pub use mat::MatRef;
pub use path::{Calibration, active_path, bf16_pairs_preferred, calibration, gemm, with_path};
pub use peak::peak_fma_flops;
pub use pool::{every_part, zip_parts};
pub use views::{FloatSlice, FloatSliceMut};

/// The f16 FMA path ([`KernelPath::Avx512Fp16`]) moves its partial sums into f32 after at most
/// this many products: the run length of its error bound ([`fp16_error_bound`]).
///
/// # Examples
/// ```
/// // a product with k = 64 sums two runs of 32 f16 FMAs
/// assert_eq!(64usize.div_ceil(mpx_kernels::FP16_FLUSH), 2);
/// ```
pub const FP16_FLUSH: usize = 32;

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
/// (see the [crate docs](crate#error-bounds)).
pub fn f32_error_bound(k: usize) -> f64 {
    gamma(k, 2f64.powi(-24))
}

/// The error bound of [`KernelPath::Avx512Fp16`] on f16 operands for inner dimension `k`:
/// `(relative, absolute)`, meaning `|ĉ - c| ≤ relative·S + absolute` (see the [crate docs](crate#error-bounds)).
pub fn fp16_error_bound(k: usize) -> (f64, f64) {
    let runs = k.div_ceil(FP16_FLUSH);
    (
        gamma(FP16_FLUSH.min(k.max(1)), 2f64.powi(-11)) + gamma(runs + 1, 2f64.powi(-24)),
        k as f64 * 2f64.powi(-25),
    )
}

/// The error bound of [`KernelPath::Avx512Bf16`] on bf16 operands for inner dimension `k`:
/// `(relative, absolute)`, meaning `|ĉ - c'| ≤ relative·S' + absolute`, where `c'` and `S'` are
/// taken over the bf16 operands with subnormal values read as zero (see the [crate docs](crate#error-bounds)).
pub fn bf16_error_bound(k: usize) -> (f64, f64) {
    (
        gamma(k + k.div_ceil(bf16::KC), 2f64.powi(-24)),
        2.0 * k as f64 * 2f64.powi(-126),
    )
}

#[cfg(test)]
mod tests;
