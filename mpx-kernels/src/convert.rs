//! Slice conversions between f32 and f16 or bf16, one SIMD loop per slice where the CPU has the
//! instructions (F16C for f16, AVX2 for bf16; detected at run time), and the fused `f16 += f32`
//! pass of a gradient written into an f16 buffer.
//!
//! The `half` crate's slice conversions use the same instructions, but through a function call
//! per 8 values; on the small tensors of a mixed step that call dominates. The results are the
//! same bits: widening is exact, and rounding is the instruction's round-to-nearest-even (the
//! values past the last full group of 8 go through the same instruction, padded; a slice of fewer
//! than 8 values goes through the one-value form of it, value by value, without the padded
//! copies: 0.8K fewer instructions per mixed 2-2-1 step, of about 60K, counted by
//! `valgrind --tool=callgrind target/release/examples/bench_step_overhead --profile xor` at
//! `b630144` against the same build without it). Without F16C the `half` crate's own conversions
//! run; without AVX2, [`round_to_bf16`]'s portable loop.
//!
//! # Safety
//! Each function checks that its two slices have one length (and panics otherwise) before it
//! calls a SIMD loop, and calls one only where [`has_f16c`] or `has_avx2` detected its
//! instructions. The loops read and write whole groups of 8 values through unaligned loads and
//! stores of those groups; the values past the last whole group go through the same loop on a
//! padded copy on the stack, and a slice shorter than a group is converted value by value.
//!
//! # Examples
//! ```
//! use half::f16;
//! use mpx_kernels::convert::{add_f32_into_f16, round_f16, widen_f16};
//!
//! let mut h = [f16::ZERO; 3];
//! round_f16(&[1.5, 65520.0, -0.0], &mut h);
//! assert!(h[1].is_infinite()); // past f16's max, 65504
//! add_f32_into_f16(&[0.25, 0.0, 1.0], &mut h);
//! let mut w = [0.0f32; 3];
//! widen_f16(&h, &mut w);
//! assert_eq!(w, [1.75, f32::INFINITY, 1.0]);
//! ```

use half::f16;
use half::slice::HalfFloatSliceExt;

/// An 8-lane SIMD loop over two slices of one length; the CPU must have its instructions.
type Simd<S, D> = unsafe fn(&[S], &mut [D]);

/// Runs `simd` where the CPU has its instructions (`Some`: detected by the caller with
/// [`has_f16c`] or [`has_avx2`]), else `portable`, on two slices of one length: how every
/// conversion here picks its loop.
///
/// # Panics
/// When the lengths differ.
fn dispatch<S, D>(
    name: &str,
    src: &[S],
    dst: &mut [D],
    simd: Option<Simd<S, D>>,
    portable: impl FnOnce(&[S], &mut [D]),
) {
    assert_eq!(src.len(), dst.len(), "{name}: lengths differ");
    match simd {
        // SAFETY: `simd` is `Some` only where its instructions were detected; the lengths match.
        Some(simd) => unsafe { simd(src, dst) },
        None => portable(src, dst),
    }
}

/// Whether the CPU converts with F16C (and AVX, for the 256-bit registers); detected once.
///
/// # Examples
/// ```
/// if mpx_kernels::convert::has_f16c() {
///     println!("f16 conversions run 8 values per instruction");
/// }
/// ```
#[cfg(target_arch = "x86_64")]
pub fn has_f16c() -> bool {
    use std::sync::OnceLock;
    static F16C: OnceLock<bool> = OnceLock::new();
    *F16C.get_or_init(|| is_x86_feature_detected!("avx") && is_x86_feature_detected!("f16c"))
}

/// Whether the CPU has AVX2; detected once.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| is_x86_feature_detected!("avx2"))
}

/// Whether the CPU converts with F16C: never off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub fn has_f16c() -> bool {
    false
}

/// No AVX2 off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn has_avx2() -> bool {
    false
}

/// `dst[i] = src[i]` widened to f32 (exact).
///
/// # Panics
/// When the lengths differ.
///
/// # Examples
/// ```
/// use half::f16;
/// let mut out = [0.0f32; 2];
/// mpx_kernels::convert::widen_f16(&[f16::ONE, f16::MAX], &mut out);
/// assert_eq!(out, [1.0, 65504.0]);
/// ```
pub fn widen_f16(src: &[f16], dst: &mut [f32]) {
    let simd = has_f16c().then_some(x86::widen as Simd<_, _>);
    dispatch("widen_f16", src, dst, simd, <[f16]>::convert_to_f32_slice);
}

/// `dst[i] = src[i]` rounded to f16 (nearest, ties to even; past f16's range to infinity).
///
/// # Panics
/// When the lengths differ.
///
/// # Examples
/// ```
/// use half::f16;
/// let mut out = [f16::ZERO; 2];
/// // 1 + 2^-11 lies halfway between two f16 values: it rounds to the even one, 1.0
/// mpx_kernels::convert::round_f16(&[1.0 + 2f32.powi(-11), 65520.0], &mut out);
/// assert_eq!(out[0], f16::ONE);
/// assert!(out[1].is_infinite());
/// ```
pub fn round_f16(src: &[f32], dst: &mut [f16]) {
    let simd = has_f16c().then_some(x86::round as Simd<_, _>);
    dispatch("round_f16", src, dst, simd, |s, d| {
        d.convert_from_f32_slice(s);
    });
}

/// `dst[i] = round_f16(f32(dst[i]) + src[i])`: the f32 sum rounded once.
///
/// # Panics
/// When the lengths differ.
///
/// # Examples
/// ```
/// use half::f16;
/// let mut acc = [f16::ONE; 2];
/// mpx_kernels::convert::add_f32_into_f16(&[0.5, -1.0], &mut acc);
/// assert_eq!(acc, [f16::from_f32(1.5), f16::ZERO]);
/// ```
pub fn add_f32_into_f16(src: &[f32], dst: &mut [f16]) {
    let simd = has_f16c().then_some(x86::add_into as Simd<_, _>);
    dispatch("add_f32_into_f16", src, dst, simd, |src, dst| {
        let mut buf = [0.0f32; 256];
        for (dc, sc) in dst.chunks_mut(256).zip(src.chunks(256)) {
            let b = &mut buf[..dc.len()];
            dc.convert_to_f32_slice(b);
            b.iter_mut().zip(sc).for_each(|(b, s)| *b += *s);
            dc.convert_from_f32_slice(b);
        }
    });
}

/// `dst[i] = src[i]` rounded to bf16 (nearest, ties to even; NaN quieted), kept in f32: the same
/// bits as [`round_to_bf16`], 8 values per AVX2 instruction where the CPU has it.
///
/// # Panics
/// When the lengths differ.
///
/// # Examples
/// ```
/// let mut out = [0.0f32; 2];
/// // 1 + 2^-9 is not a bf16 value: it rounds to 1.0 (ties to even)
/// mpx_kernels::convert::round_bf16(&[1.0 + 1.0 / 512.0, 3.0], &mut out);
/// assert_eq!(out, [1.0, 3.0]);
/// ```
pub fn round_bf16(src: &[f32], dst: &mut [f32]) {
    let simd = has_avx2().then_some(x86::round_bf16 as Simd<_, _>);
    dispatch("round_bf16", src, dst, simd, round_to_bf16);
}

/// Rounds f32 values to the nearest bf16 value (ties to even), keeping f32 storage. NaN stays NaN
/// and values past bf16's max round to infinity, as `half::bf16::from_f32` does. Portable Rust
/// (the compiler vectorises it); [`round_bf16`] computes the same bits with AVX2 where the CPU
/// has it.
///
/// # Panics
/// When `src` and `dst` differ in length.
///
/// # Examples
/// ```
/// let mut out = [0.0f32; 1];
/// mpx_kernels::convert::round_to_bf16(&[1.0 + 3.0 / 256.0], &mut out);
/// assert_eq!(out[0], 1.0 + 4.0 / 256.0);
/// ```
pub fn round_to_bf16(src: &[f32], dst: &mut [f32]) {
    assert_eq!(
        src.len(),
        dst.len(),
        "round_to_bf16: slices differ in length"
    );
    // Bit-level round-to-nearest-even on the upper 16 bits; branch-free so it vectorises.
    for (d, s) in dst.iter_mut().zip(src) {
        let b = s.to_bits();
        let is_nan = (b & 0x7fff_ffff) > 0x7f80_0000;
        let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
        let quiet_nan = (b | 0x0040_0000) & 0xffff_0000;
        *d = f32::from_bits(if is_nan { quiet_nan } else { rounded });
    }
}

/// Never called: [`has_f16c`] and [`has_avx2`] are `false` off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) mod x86 {
    use half::f16;

    pub(super) unsafe fn widen(_: &[f16], _: &mut [f32]) {
        unreachable!("F16C off x86-64")
    }
    pub(super) unsafe fn round(_: &[f32], _: &mut [f16]) {
        unreachable!("F16C off x86-64")
    }
    pub(super) unsafe fn add_into(_: &[f32], _: &mut [f16]) {
        unreachable!("F16C off x86-64")
    }
    pub(super) unsafe fn round_bf16(_: &[f32], _: &mut [f32]) {
        unreachable!("AVX2 off x86-64")
    }
}

// `_mm_loadu_si128` / `_mm_storeu_si128` take `__m128i` pointers but access them unaligned: the
// casts from 2-byte-aligned f16 pointers are what the intrinsics expect.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::cast_ptr_alignment)]
pub(crate) mod x86 {
    use std::arch::x86_64::{
        __m128i, _MM_FROUND_TO_NEAREST_INT, _mm_loadu_si128, _mm_storeu_si128, _mm256_add_ps,
        _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps,
    };

    use half::f16;

    /// Values per register.
    const LANES: usize = 8;

    /// Runs `op` (one of this module's loops, which handle whole groups of [`LANES`] values) once
    /// more on the values past the last whole group, copied into a zero-padded group with `dst`'s
    /// old values: the last values go through the same instruction as the others.
    ///
    /// # Safety
    /// The CPU must have `op`'s instructions; `src.len() == dst.len()`.
    #[inline]
    unsafe fn padded_tail<S: Copy + Default, D: Copy + Default>(
        src: &[S],
        dst: &mut [D],
        op: unsafe fn(&[S], &mut [D]),
    ) {
        let full = src.len() / LANES * LANES;
        let rest = src.len() - full;
        if rest == 0 {
            return;
        }
        let mut s = [S::default(); LANES];
        let mut d = [D::default(); LANES];
        s[..rest].copy_from_slice(&src[full..]);
        d[..rest].copy_from_slice(&dst[full..]);
        // SAFETY: the caller's instructions; one whole group of LANES values on each side.
        unsafe { op(&s, &mut d) };
        dst[full..].copy_from_slice(&d[..rest]);
    }

    /// `x` widened to f32 (exact), by the instruction [`widen`] uses.
    #[target_feature(enable = "f16c")]
    #[inline]
    pub(crate) fn widen_one(x: f16) -> f32 {
        use std::arch::x86_64::{_mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32};
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(x.to_bits()))))
    }

    /// `x` rounded to f16 (nearest, ties to even), by the instruction [`round`] uses.
    #[target_feature(enable = "f16c")]
    #[inline]
    pub(crate) fn round_one(x: f32) -> f16 {
        use std::arch::x86_64::{_mm_cvtps_ph, _mm_cvtsi128_si32, _mm_set_ss};
        let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x));
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        f16::from_bits(_mm_cvtsi128_si32(h) as u16)
    }

    /// # Safety
    /// The CPU must support AVX and F16C; `src.len() == dst.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn widen(src: &[f16], dst: &mut [f32]) {
        if src.len() < LANES {
            // fewer values than a group: one instruction each, no padded copy
            for (s, d) in src.iter().zip(dst.iter_mut()) {
                *d = widen_one(*s);
            }
            return;
        }
        for (s, d) in src.chunks_exact(LANES).zip(dst.chunks_exact_mut(LANES)) {
            // SAFETY: `s` holds 8 f16 values, the 128 bits read (unaligned).
            let h = unsafe { _mm_loadu_si128(s.as_ptr().cast::<__m128i>()) };
            let w = _mm256_cvtph_ps(h);
            // SAFETY: `d` holds 8 f32 values, the 256 bits written.
            unsafe { _mm256_storeu_ps(d.as_mut_ptr(), w) };
        }
        // SAFETY: the caller's AVX and F16C; the lengths match.
        unsafe { padded_tail(src, dst, widen) };
    }

    /// # Safety
    /// The CPU must support AVX2; `src.len() == dst.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn round_bf16(src: &[f32], dst: &mut [f32]) {
        use std::arch::x86_64::{
            _mm256_add_epi32, _mm256_and_si256, _mm256_blendv_epi8, _mm256_castps_si256,
            _mm256_castsi256_ps, _mm256_cmpgt_epi32, _mm256_or_si256, _mm256_set1_epi32,
            _mm256_srli_epi32,
        };
        let one = _mm256_set1_epi32(1);
        let half = _mm256_set1_epi32(0x7fff);
        let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        let inf = _mm256_set1_epi32(0x7f80_0000);
        let quiet = _mm256_set1_epi32(0x0040_0000);
        for (s, d) in src.chunks_exact(LANES).zip(dst.chunks_exact_mut(LANES)) {
            // SAFETY: `s` holds 8 f32 values, the 256 bits read (unaligned).
            let b = _mm256_castps_si256(unsafe { _mm256_loadu_ps(s.as_ptr()) });
            let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(b), one);
            let rounded = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(half, odd)), high);
            // |b| and 0x7f80_0000 are both below 2^31: the signed compare is the unsigned one
            let nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, abs), inf);
            let quieted = _mm256_and_si256(_mm256_or_si256(b, quiet), high);
            let r = _mm256_castsi256_ps(_mm256_blendv_epi8(rounded, quieted, nan));
            // SAFETY: `d` holds 8 f32 values, the 256 bits written.
            unsafe { _mm256_storeu_ps(d.as_mut_ptr(), r) };
        }
        // SAFETY: the caller's AVX2; the lengths match.
        unsafe { padded_tail(src, dst, round_bf16) };
    }

    /// # Safety
    /// The CPU must support AVX and F16C; `src.len() == dst.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn round(src: &[f32], dst: &mut [f16]) {
        if src.len() < LANES {
            // fewer values than a group: one instruction each, no padded copy
            for (s, d) in src.iter().zip(dst.iter_mut()) {
                *d = round_one(*s);
            }
            return;
        }
        for (s, d) in src.chunks_exact(LANES).zip(dst.chunks_exact_mut(LANES)) {
            // SAFETY: `s` holds 8 f32 values, the 256 bits read (unaligned).
            let v = unsafe { _mm256_loadu_ps(s.as_ptr()) };
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            // SAFETY: `d` holds 8 f16 values, the 128 bits written.
            unsafe { _mm_storeu_si128(d.as_mut_ptr().cast::<__m128i>(), h) };
        }
        // SAFETY: the caller's AVX and F16C; the lengths match.
        unsafe { padded_tail(src, dst, round) };
    }

    /// # Safety
    /// The CPU must support AVX and F16C; `src.len() == dst.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn add_into(src: &[f32], dst: &mut [f16]) {
        for (s, d) in src.chunks_exact(LANES).zip(dst.chunks_exact_mut(LANES)) {
            let dp = d.as_mut_ptr().cast::<__m128i>();
            // SAFETY: `d` holds 8 f16 values, the 128 bits read (unaligned).
            let old = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(dp) });
            // SAFETY: `s` holds 8 f32 values.
            let add = unsafe { _mm256_loadu_ps(s.as_ptr()) };
            let sum = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_add_ps(old, add));
            // SAFETY: the 128 bits of `d` read above.
            unsafe { _mm_storeu_si128(dp, sum) };
        }
        // SAFETY: the caller's AVX and F16C; the lengths match.
        unsafe { padded_tail(src, dst, add_into) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::slice::HalfFloatSliceExt;

    /// Values covering normals, subnormals, ties, overflow, infinities and NaN.
    fn probe(n: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..n)
            .map(|i| {
                let x = (i as f32 * 0.618_034).sin() * 10f32.powi((i % 13) as i32 - 8);
                if i % 2 == 0 { x } else { -x }
            })
            .collect();
        let specials = [
            65504.0,
            65520.0,
            1e6,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            6e-8,
            2.98e-8,
            1.0 + 2f32.powi(-11),
            1.0 + 3.0 * 2f32.powi(-11),
            -0.0,
        ];
        for (slot, s) in v.iter_mut().zip(specials) {
            *slot = s;
        }
        v
    }

    #[test]
    fn round_and_widen_match_the_half_crate_bit_for_bit() {
        // fewer values than a group take the one-value path: every special value alone too
        let alone = probe(11).into_iter().map(|x| vec![x]);
        for src in (0..=9).chain([31, 1000]).map(probe).chain(alone) {
            let n = src.len();
            let mut ours = vec![f16::ZERO; n];
            let mut theirs = vec![f16::ZERO; n];
            round_f16(&src, &mut ours);
            theirs.convert_from_f32_slice(&src);
            let bits = |v: &[f16]| v.iter().map(|h| h.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ours), bits(&theirs), "round, n = {n}");
            let mut w_ours = vec![0.0f32; n];
            let mut w_theirs = vec![0.0f32; n];
            widen_f16(&ours, &mut w_ours);
            theirs.convert_to_f32_slice(&mut w_theirs);
            let bits32 = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits32(&w_ours), bits32(&w_theirs), "widen, n = {n}");
        }
    }

    #[test]
    fn round_bf16_matches_the_portable_rounding_bit_for_bit() {
        for n in [0, 1, 7, 8, 9, 31, 1000] {
            let mut src = probe(n);
            // ties at the bf16 boundary, both parities, and signalling / quiet NaNs
            let extra = [
                f32::from_bits(0x3f80_8000),
                f32::from_bits(0x3f81_8000),
                f32::from_bits(0x7f80_0001),
                f32::from_bits(0xffc0_1234),
                f32::from_bits(0x7f7f_ffff),
                f32::from_bits(0x0000_8000),
            ];
            for (slot, e) in src.iter_mut().rev().zip(extra) {
                *slot = e;
            }
            let mut ours = vec![0.0f32; n];
            let mut theirs = vec![0.0f32; n];
            round_bf16(&src, &mut ours);
            round_to_bf16(&src, &mut theirs);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ours), bits(&theirs), "n = {n}");
        }
    }

    #[test]
    fn add_into_rounds_the_f32_sum_once() {
        for n in [0, 3, 8, 13, 517] {
            let src = probe(n);
            let mut dst: Vec<f16> = probe(n).iter().rev().map(|x| f16::from_f32(*x)).collect();
            let want: Vec<u16> = dst
                .iter()
                .zip(&src)
                .map(|(d, s)| f16::from_f32(d.to_f32() + s).to_bits())
                .collect();
            add_f32_into_f16(&src, &mut dst);
            let got: Vec<u16> = dst.iter().map(|h| h.to_bits()).collect();
            assert_eq!(got, want, "n = {n}");
        }
    }
}
