//! [`KernelPath`]: which instructions the kernels use, chosen once per process (by measurement
//! where the candidates compute the same bits) and overridable per thread.
//!
//! # How the path is chosen
//! The widest vectors are not always the fastest: on Zen 4 a 512-bit f32 FMA runs as two 256-bit
//! halves, and the 6 x 16 AVX2 kernel, which reads small and thin operands in place, beats the
//! 8 x 32 AVX-512 one (measured from outside: 1.05x on an MLP's products, 2.7x on an `n = 10`
//! product, 1.39x on small ones), and on another Zen 4 machine the AVX-512 kernel won on all but
//! the thin products. So on first use a short [calibration](calibration) times a few small
//! products (one thread, well under a millisecond in all) on each candidate and keeps the
//! fastest, cached for the process: once for thin products (`m` or `n` at most [`THIN`]) and
//! once for the others.
//!
//! Only paths that compute **the same bits** compete: [`KernelPath::Avx512`] and
//! [`KernelPath::Avx2Fma`] run the same FMA chain per output in the same order (the tests check
//! it bit for bit), so the choice changes speed, never results. Paths with other arithmetic are
//! chosen by operand type and CPU, not by timing: bf16 operands take [`KernelPath::Avx512Bf16`]
//! (exact products summed in f32) on the CPUs that run it faster than f32 FMAs (AMD's; see
//! [`bf16_pairs_preferred`]). [`KernelPath::Avx512Fp16`] sums f16 products in
//! f16, far coarser, and a product or partial sum past 65504 is infinite there where the f32 sum
//! is finite: f16 operands are widened and summed in f32 as on every other CPU (the same bits),
//! and that path runs only where [`with_path`] forces it. The portable loop runs only where
//! neither FMA path does.

use std::cell::Cell;
use std::sync::OnceLock;

use super::driver::{gemm_on, gemm_threads};
use super::{KernelError, KernelPath, MatRef};
use crate::FloatSlice;

/// What the first-use calibration measured: the candidates for f32 arithmetic (the paths that
/// compute the same bits), the time each took on the probe products, and the one chosen, for
/// each of two classes of products: thin ones (`m` or `n` at most 16) and the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Calibration {
    /// The fastest candidate on the probes of ordinary products: the path f32 operands (and f16
    /// / bf16 operands without their own instructions) run on.
    pub chosen: KernelPath,
    /// Each candidate with its time on those probes (nanoseconds, the best of a few interleaved
    /// rounds, summed over the probes); 0 when there was a single candidate and nothing was
    /// timed.
    pub nanos: Vec<(KernelPath, u64)>,
    /// The fastest candidate on thin products (`m` or `n` at most 16: a layer with few
    /// outputs, an attention head).
    pub chosen_thin: KernelPath,
    /// Each candidate with its time on the thin probes.
    pub nanos_thin: Vec<(KernelPath, u64)>,
}

/// A product with `m` or `n` at most this is thin: its operands are read few times, and the
/// path that reads them in place may win (see [`Calibration`]).
pub(crate) const THIN: usize = 16;

/// Probe products of the calibration, `(m, n, k, B stored transposed)`: a Linear layer's forward
/// at a small batch, a small weight gradient, a mid-sized square one.
const PROBES: [(usize, usize, usize, bool); 3] = [
    (32, 128, 64, true),
    (128, 64, 32, false),
    (192, 192, 192, false),
];

/// Thin probes: a layer with 10 outputs, its weight gradient, an attention head's two products.
const PROBES_THIN: [(usize, usize, usize, bool); 4] = [
    (64, 10, 256, true),
    (10, 128, 32, false),
    (16, 16, 8, true),
    (16, 8, 16, false),
];

/// Rounds of the calibration; each candidate's best round counts.
const ROUNDS: usize = 5;

/// The calibration of this process, run on the first call and cached (see the
/// crate docs).
///
/// # Examples
/// ```
/// let c = mpx_kernels::calibration();
/// assert!(c.chosen.is_supported() && c.chosen_thin.is_supported());
/// ```
pub fn calibration() -> &'static Calibration {
    static CALIBRATION: OnceLock<Calibration> = OnceLock::new();
    CALIBRATION.get_or_init(|| {
        let (chosen, nanos) = calibrate(&PROBES);
        let (chosen_thin, nanos_thin) = calibrate(&PROBES_THIN);
        Calibration {
            chosen,
            nanos,
            chosen_thin,
            nanos_thin,
        }
    })
}

/// Times each same-bits candidate on `probes` (one thread) and picks the fastest.
fn calibrate(probes: &[(usize, usize, usize, bool)]) -> (KernelPath, Vec<(KernelPath, u64)>) {
    let candidates: Vec<KernelPath> = [KernelPath::Avx2Fma, KernelPath::Avx512]
        .into_iter()
        .filter(|p| p.is_supported())
        .collect();
    if candidates.len() < 2 {
        let chosen = candidates.first().copied().unwrap_or(KernelPath::Portable);
        return (chosen, vec![(chosen, 0)]);
    }
    let size = probes
        .iter()
        .map(|&(m, n, k, _)| m.max(n) * k)
        .max()
        .unwrap_or(0);
    let data: Vec<f32> = (0..size)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 512.0)
        .collect();
    let mut c = vec![0.0f32; probes.iter().map(|&(m, n, ..)| m * n).max().unwrap_or(0)];
    let mut best = vec![u64::MAX; candidates.len()];
    for _ in 0..ROUNDS {
        for (slot, &path) in best.iter_mut().zip(&candidates) {
            let start = std::time::Instant::now();
            // thin probes are short: repeat them so that a round is not timer noise
            for _ in 0..if probes.len() == PROBES_THIN.len() {
                8
            } else {
                1
            } {
                for &(m, n, k, bt) in probes {
                    let (Ok(a), Ok(b)) = (
                        MatRef::row_major_f32(&data[..m * k], m, k),
                        if bt {
                            MatRef::row_major_f32(&data[..n * k], n, k).map(MatRef::t)
                        } else {
                            MatRef::row_major_f32(&data[..k * n], k, n)
                        },
                    ) else {
                        continue;
                    };
                    let _ = gemm_threads(path, a, b, &mut c[..m * n], false, 1);
                }
            }
            let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
            *slot = (*slot).min(ns);
        }
    }
    let nanos: Vec<(KernelPath, u64)> = candidates.into_iter().zip(best).collect();
    let chosen = nanos
        .iter()
        .min_by_key(|&&(_, ns)| ns)
        .map_or(KernelPath::Portable, |&(p, _)| p);
    (chosen, nanos)
}

/// The path f32 operands run on when none is forced: the fastest of the paths that compute the
/// same bits, measured on first use ([`calibration`]).
pub(crate) fn detected_path() -> KernelPath {
    calibration().chosen
}

/// The path an `m x n` product of `a` and `b` runs on when none is forced: bf16 operands on
/// [`KernelPath::Avx512Bf16`] where [`bf16_pairs_preferred`], everything else, f16 operands
/// included, on the calibration's choice for its class (thin or not): f16 operands are widened
/// and summed in f32, the same bits on every CPU. [`KernelPath::Avx512Fp16`] sums in f16 (a
/// product past 65504 is infinite there, where the f32 sum is finite), so it runs only where
/// [`with_path`] forces it.
pub(crate) fn path_for(a: FloatSlice<'_>, b: FloatSlice<'_>, m: usize, n: usize) -> KernelPath {
    static BF16: OnceLock<bool> = OnceLock::new();
    match (a, b) {
        (FloatSlice::Bf16(_), FloatSlice::Bf16(_)) if *BF16.get_or_init(bf16_pairs_preferred) => {
            KernelPath::Avx512Bf16
        }
        _ if m.min(n) <= THIN => calibration().chosen_thin,
        _ => detected_path(),
    }
}

/// Whether bf16 operands run on [`KernelPath::Avx512Bf16`] when no path is forced: where the CPU
/// has it and is an AMD one. AMD's Zen 4 and Zen 5 run `vdpbf16ps` (two products per f32 lane)
/// faster than f32 FMAs (`bench_kernels`' peak table: 524 against 285 GFLOP/s on a Zen 5); Intel's
/// Sapphire and Emerald Rapids at half their f32 FMA rate (87 against 177 GFLOP/s on an Emerald
/// Rapids), where the f32 path on the operands rounded to bf16 ran the step's products faster
/// (102 against 69 GFLOP/s on one thread; `cargo run --release --example bench_kernels`, both
/// runs in `docs/benchmarks.md`). Decided by the CPU's vendor, not by timing: the two
/// paths differ in the order of each pair's sum and in flushing subnormals, so a choice by timing
/// could change a result from one run to the next.
///
/// # Examples
/// ```
/// use mpx_kernels::{KernelPath, bf16_pairs_preferred};
/// // never without the instructions
/// assert!(!bf16_pairs_preferred() || KernelPath::Avx512Bf16.is_supported());
/// ```
pub fn bf16_pairs_preferred() -> bool {
    KernelPath::Avx512Bf16.is_supported() && is_amd()
}

/// Whether the CPU's vendor (CPUID leaf 0) is AMD.
fn is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let id = std::arch::x86_64::__cpuid(0);
        // the vendor string is EBX, EDX, ECX: "Auth" "enti" "cAMD"
        [id.ebx, id.edx, id.ecx] == [0x6874_7541, 0x6974_6e65, 0x444d_4163]
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

thread_local! {
    static FORCED: Cell<Option<KernelPath>> = const { Cell::new(None) };
}

/// The path forced on this thread by [`with_path`], if any.
pub(crate) fn forced_path() -> Option<KernelPath> {
    FORCED.with(Cell::get)
}

/// The path f32 products called on this thread use: the one forced by [`with_path`], else
/// the [calibration](calibration)'s choice for ordinary products (bf16 operands take
/// [`KernelPath::Avx512Bf16`] on the CPUs that run it faster when none is forced, see the crate
/// docs).
///
/// # Examples
/// ```
/// use mpx_kernels::{KernelPath, active_path, with_path};
/// assert_eq!(with_path(KernelPath::Portable, active_path)?, KernelPath::Portable);
/// # Ok::<(), mpx_kernels::KernelError>(())
/// ```
pub fn active_path() -> KernelPath {
    forced_path().unwrap_or_else(detected_path)
}

/// Runs `f` with every kernel on this thread forced to `path` (layers included), then restores
/// the previous choice.
///
/// # Errors
/// [`KernelError::Unsupported`] if this CPU lacks the path's instructions; `f` does not run.
///
/// # Examples
/// ```
/// use mpx_kernels::{KernelPath, MatRef, gemm, with_path};
///
/// let a = MatRef::row_major_f32(&[1.0, 2.0], 1, 2)?;
/// let b = MatRef::row_major_f32(&[3.0, 4.0], 2, 1)?;
/// for path in KernelPath::supported() {
///     let mut c = [0.0f32];
///     with_path(path, || gemm(a, b, &mut c, false))??;
///     assert_eq!(c, [11.0], "{path:?}");
/// }
/// # Ok::<(), mpx_kernels::KernelError>(())
/// ```
pub fn with_path<R>(path: KernelPath, f: impl FnOnce() -> R) -> Result<R, KernelError> {
    struct Restore(Option<KernelPath>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|c| c.set(self.0));
        }
    }
    if !path.is_supported() {
        return Err(KernelError::Unsupported {
            path,
            supported: KernelPath::supported(),
        });
    }
    let _restore = Restore(FORCED.with(|c| c.replace(Some(path))));
    Ok(f())
}

/// `C = A·B` (or `C += A·B` with `accumulate`) on the path forced by
/// [`with_path`], else the one chosen for these operands: bf16 operands on
/// [`KernelPath::Avx512Bf16`] on the CPUs that run it faster than f32 FMAs, everything else on
/// the [calibration](calibration)'s choice. `C` is row-major `A.rows x B.cols` f32. Every path
/// but a forced [`KernelPath::Avx512Fp16`] sums in f32 (the error bounds of the
/// [crate docs](crate#error-bounds)).
///
/// # Errors
/// [`KernelError::InnerMismatch`], [`KernelError::OperandTooShort`] or
/// [`KernelError::OutputLength`] when the shapes do not fit.
///
/// # Examples
/// ```
/// use half::f16;
/// use mpx_kernels::{MatRef, gemm};
///
/// // x·Wᵀ with f16 operands: W is stored as 3 x 2 (out x in), read transposed
/// let x: Vec<f16> = [1.0f32, 2.0].map(f16::from_f32).to_vec();
/// let w: Vec<f16> = [1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0].map(f16::from_f32).to_vec();
/// let mut y = [0.0f32; 3];
/// gemm(MatRef::row_major_f16(&x, 1, 2)?, MatRef::row_major_f16(&w, 3, 2)?.t(), &mut y, false)?;
/// assert_eq!(y, [1.0, 2.0, 3.0]);
/// gemm(MatRef::row_major_f16(&x, 1, 2)?, MatRef::row_major_f16(&w, 3, 2)?.t(), &mut y, true)?;
/// assert_eq!(y, [2.0, 4.0, 6.0]); // accumulated
/// assert!(gemm(MatRef::row_major_f16(&x, 1, 2)?, MatRef::row_major_f16(&w, 3, 2)?, &mut y, false).is_err());
/// # Ok::<(), mpx_kernels::KernelError>(())
/// ```
pub fn gemm(
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: &mut [f32],
    accumulate: bool,
) -> Result<(), KernelError> {
    let path =
        forced_path().unwrap_or_else(|| path_for(a.values(), b.values(), a.rows(), b.cols()));
    gemm_on(path, a, b, c, accumulate)
}
