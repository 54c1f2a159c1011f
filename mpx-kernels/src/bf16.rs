//! The AVX512-BF16 path for bf16 operands: `vdpbf16ps` (`_mm512_dpbf16_ps`) multiplies pairs of
//! bf16 values and adds both products into f32 accumulators, at twice the rate of an f32 FMA on
//! Zen 4.
//!
//! # Layout
//! The operands are rounded to bf16 (nearest, ties to even, NaN quieted: the bits of
//! [`round_to_bf16`](crate::convert::round_to_bf16)) and packed as pairs along k: a panel of A
//! holds, for each pair `q` of a k block, the `MR` values `(A[i][2q], A[i][2q + 1])` as one
//! 32-bit word each; a panel of B the `NR` words `(B[2q][j], B[2q + 1][j])`. An odd k block
//! ends with a pair whose second value is `+0.0` in both operands.
//!
//! # What one instruction computes
//! For each f32 lane, with `(a0, a1)` and `(b0, b1)` the pairs (low half first):
//! `acc = fma(a0, b0, fma(a1, b1, acc))`: the odd element's product first, each step a fused
//! multiply-add rounded to nearest even, with subnormal inputs (the accumulator included) read
//! as zero and a result that is tiny after rounding to 24 bits with an unbounded exponent
//! flushed to zero of the same sign. MXCSR is neither read nor written. A NaN input is returned
//! quieted, the first in the order `a0, b0, a1, b1, acc`; an invalid operation gives the default
//! NaN `0xffc0_0000`. The kernels' unit tests hold a scalar model of exactly this and check the
//! instruction and the whole GEMM against it bit for bit (on random data with subnormals, ties,
//! infinities and NaNs); Intel's pseudocode states the same order and flushing.
//!
//! # Error bound
//! Against the exact sum `c'` of products of the bf16 operands with their subnormal values read
//! as zero, and `S' = Σ|a||b|` over the same: `|ĉ - c'| ≤ γ(K + R, 2^-24)·S' + 2K·2^-126`, with
//! `R = ceil(K / 256)` k blocks (one f32 add of each block's sum into `C`); the last term covers
//! the flush of tiny results (at most `2^-126` per fused step, two steps per pair). Each product
//! of two bf16 values is exact in f32, so this is the bound of the f32 FMA paths on the same
//! operands with one more rounding per k block; only the order inside a pair (odd first) and the
//! flushing differ from them. [`bf16_error_bound`](super::bf16_error_bound) computes it.

use super::pack::Src;
use super::packs::{Part, pack_staged};
use super::tile::Micro;

/// Rows and columns of a micro-tile (two zmm of 16 f32 per row): the AVX-512 f32 kernel's, whose
/// end (adding the sums into `C`) this path shares.
pub(crate) use super::avx512::{MR, NR};
/// Values of k per block (even: blocks start on a pair).
pub(crate) const KC: usize = 256;

/// The micro-kernel on packed bf16 pairs, with the driver's blocking (k blocks of [`KC`]); the
/// driver packs the operands with [`pack`], two values of k to a word, and hands the kernel the
/// number of pairs.
pub(crate) fn micro() -> Micro<u32> {
    Micro {
        kc: KC,
        ..Micro::new(MR, NR, kernel)
    }
}

thread_local! {
    /// One packed part in f32, before it is rounded to pairs (per thread).
    static STAGE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Packs `part` of `a` or `b` (f32 storage) as bf16 pairs into `dst`: packed in f32 first, then
/// rounded ([`to_pairs`]).
pub(crate) fn pack(dst: &mut [u32], a: Src<'_, f32>, b: Src<'_, f32>, part: Part) {
    pack_staged(&STAGE, (a, b), part, (MR, NR), |packed, panels, shape| {
        panels_to_pairs(packed, panels, shape, dst);
    });
}

/// `x` rounded to bf16 (nearest, ties to even; a NaN quieted): the bits of
/// [`round_to_bf16`](crate::convert::round_to_bf16), as the 16-bit pattern.
#[inline(always)]
pub(super) fn bf16_bits(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x7fff_ffff > 0x7f80_0000 {
        (b | 0x0040_0000) >> 16
    } else {
        // no overflow: the largest non-NaN pattern, 0xff80_0000, plus 0x8000 fits
        (b + 0x7fff + ((b >> 16) & 1)) >> 16
    }
}

/// [`to_pairs`] on each of the first `panels` packed panels of `width` lines and `kc` values of k
/// in `packed`, into the same panels of `pairs`.
fn panels_to_pairs(packed: &[f32], panels: usize, (kc, width): (usize, usize), pairs: &mut [u32]) {
    let kq = kc.div_ceil(2);
    for (src, dst) in packed
        .chunks_exact(width * kc)
        .zip(pairs.chunks_exact_mut(width * kq))
        .take(panels)
    {
        to_pairs(src, kc, width, dst);
    }
}

/// A k-major f32 panel of `width` lines (`panel[p * width + l]`, `kc` values of k) rounded to
/// bf16 pairs (`pairs[q * width + l]`, low half `p = 2q`), the last pair zero-padded when `kc` is
/// odd. The rounding happens here, on the packed panel, so the operand itself is read in place
/// (no rounded copy of it). With AVX-512 F (always there on this path), 16 lines at a time
/// ([`to_pairs_avx512`]); the scalar loop below is the definition it computes.
pub(super) fn to_pairs(panel: &[f32], kc: usize, width: usize, pairs: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512 F was detected.
        unsafe { to_pairs_avx512(panel, kc, width, pairs) };
        return;
    }
    let q_count = kc.div_ceil(2);
    let hi = bf16_bits;
    for q in 0..q_count {
        let even = &panel[2 * q * width..(2 * q + 1) * width];
        let dst = &mut pairs[q * width..(q + 1) * width];
        if 2 * q + 1 < kc {
            let odd = &panel[(2 * q + 1) * width..(2 * q + 2) * width];
            for ((d, e), o) in dst.iter_mut().zip(even).zip(odd) {
                *d = hi(*e) | (hi(*o) << 16);
            }
        } else {
            for (d, e) in dst.iter_mut().zip(even) {
                *d = hi(*e);
            }
        }
    }
}

/// [`to_pairs`] on 16 lines at a time: the same bits as [`bf16_bits`] per value (the rounding
/// done in integer lanes, NaNs quieted the same way), two values of k to a word.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn to_pairs_avx512(panel: &[f32], kc: usize, width: usize, pairs: &mut [u32]) {
    use std::arch::x86_64::{
        _mm512_mask_storeu_epi32, _mm512_maskz_loadu_epi32, _mm512_or_si512, _mm512_setzero_si512,
        _mm512_slli_epi32,
    };
    for q in 0..kc.div_ceil(2) {
        for l0 in (0..width).step_by(16) {
            let n = (width - l0).min(16);
            let mask = u16::MAX >> (16 - n);
            let even = &panel[2 * q * width + l0..][..n];
            // SAFETY: the lanes in `mask` are the `n` values of `even`; the others are not read.
            let e = unsafe { _mm512_maskz_loadu_epi32(mask, even.as_ptr().cast()) };
            let o = if 2 * q + 1 < kc {
                let odd = &panel[(2 * q + 1) * width + l0..][..n];
                // SAFETY: as above, for `odd`.
                unsafe { _mm512_maskz_loadu_epi32(mask, odd.as_ptr().cast()) }
            } else {
                // the padding: +0.0, whose bf16 bits are 0
                _mm512_setzero_si512()
            };
            let words = _mm512_or_si512(round_lanes(e), _mm512_slli_epi32::<16>(round_lanes(o)));
            let dst = &mut pairs[q * width + l0..][..n];
            // SAFETY: the lanes in `mask` are the `n` words of `dst`; the others are not written.
            unsafe { _mm512_mask_storeu_epi32(dst.as_mut_ptr().cast(), mask, words) };
        }
    }
}

/// [`bf16_bits`] on 16 lanes of f32 bits.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn round_lanes(v: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::{
        _mm512_add_epi32, _mm512_and_si512, _mm512_cmpgt_epu32_mask, _mm512_mask_blend_epi32,
        _mm512_or_si512, _mm512_set1_epi32, _mm512_srli_epi32,
    };
    let nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(v, _mm512_set1_epi32(0x7fff_ffff)),
        _mm512_set1_epi32(0x7f80_0000),
    );
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(v), _mm512_set1_epi32(1));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
        _mm512_add_epi32(v, _mm512_set1_epi32(0x7fff)),
        lsb,
    ));
    let quiet = _mm512_srli_epi32::<16>(_mm512_or_si512(v, _mm512_set1_epi32(0x0040_0000)));
    _mm512_mask_blend_epi32(nan, rounded, quiet)
}

/// `C[8 x 32] += Σ_q Apairs[q]ᵀ · Bpairs[q]` over `pairs` pairs of k, one `vdpbf16ps` per row
/// and half-tile per pair, the sums started at `+0.0` and added to `C` at the end.
///
/// # Safety
/// The CPU must support AVX-512 F and AVX512-BF16. `c` must be valid for reads and writes of `MR`
/// rows of `NR` values at stride `ldc`, untouched by anyone else during the call. The packed
/// lengths are asserted.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn kernel(
    pairs: usize,
    a: &[u32],
    b: &[u32],
    c: *mut f32,
    ldc: usize,
    first: bool,
) {
    use std::arch::x86_64::{
        _mm512_dpbf16_ps, _mm512_loadu_si512, _mm512_set1_epi32, _mm512_setzero_ps,
    };
    assert!(a.len() >= pairs * MR && b.len() >= pairs * NR);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for (ap, bp) in a.chunks_exact(MR).zip(b.chunks_exact(NR)).take(pairs) {
        let bp: &[u32; NR] = bp.try_into().expect("chunks of NR");
        let (lo, hi) = bp.split_at(16);
        // SAFETY: `lo` holds 16 u32, 64 bytes; the load is unaligned.
        let b0 = bh(unsafe { _mm512_loadu_si512(lo.as_ptr().cast()) });
        // SAFETY: as above, for `hi`.
        let b1 = bh(unsafe { _mm512_loadu_si512(hi.as_ptr().cast()) });
        for (row, &pair) in acc.iter_mut().zip(ap) {
            // the pair broadcast to every 32-bit lane
            let av = bh(_mm512_set1_epi32(pair as i32));
            row[0] = _mm512_dpbf16_ps(row[0], av, b0);
            row[1] = _mm512_dpbf16_ps(row[1], av, b1);
        }
    }
    // SAFETY: AVX-512 F is enabled here; `c` is the tile the caller lends us (same shape).
    unsafe { super::avx512::add_tile(&acc, c, ldc, first) };
}

/// The 512 bits of `v` as 32 bf16 values.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn bh(v: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512bh {
    // SAFETY: both are 512 bits of plain vector data, valid for every bit pattern.
    unsafe { std::mem::transmute::<std::arch::x86_64::__m512i, std::arch::x86_64::__m512bh>(v) }
}

/// Never called: [`KernelPath::Avx512Bf16`](super::KernelPath) is unsupported off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn kernel(
    pairs: usize,
    a: &[u32],
    b: &[u32],
    c: *mut f32,
    ldc: usize,
    first: bool,
) {
    let _ = (pairs, a, b, c, ldc, first);
    unreachable!("AVX512-BF16 kernel on a non-x86 target")
}

/// One `vdpbf16ps` on 16 lanes: `acc[l]` plus the products of the pairs `a[l]` and `b[l]`
/// (tests check the instruction itself against their model, accumulators of every kind included).
///
/// # Safety
/// The CPU must support AVX-512 F and AVX512-BF16.
#[cfg(all(test, target_arch = "x86_64"))]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn dp_lanes(acc: [f32; 16], a: [u32; 16], b: [u32; 16]) -> [f32; 16] {
    use std::arch::x86_64::{__m512, __m512bh, _mm512_dpbf16_ps};
    // SAFETY: 16 f32 values are the 512 bits of an `__m512`.
    let acc = unsafe { std::mem::transmute::<[f32; 16], __m512>(acc) };
    // SAFETY: 16 pairs of bf16 values are the 512 bits of an `__m512bh`.
    let a = unsafe { std::mem::transmute::<[u32; 16], __m512bh>(a) };
    // SAFETY: as above.
    let b = unsafe { std::mem::transmute::<[u32; 16], __m512bh>(b) };
    let r = _mm512_dpbf16_ps(acc, a, b);
    // SAFETY: back: an `__m512` is 16 f32 values.
    unsafe { std::mem::transmute::<__m512, [f32; 16]>(r) }
}
