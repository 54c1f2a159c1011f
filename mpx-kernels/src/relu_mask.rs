//! `ReLU`'s mask bits from its outputs, 64 values per word, with SIMD compares: one `vpcmpuw` /
//! `vcmpps` mask (AVX-512) or one `vpmovmskb` / `vmovmskps` (AVX2) per vector, where the portable
//! loop shifts one bit in per value. That loop ([`word`], on [`MaskValue::passes`]) is the
//! definition; the SIMD words are the same bits.
//!
//! Each loop fills `out` with the words of the whole 64-value chunks of `y` and leaves the
//! remainder (fewer than 64 values) to the caller.

/// The SIMD loops of the mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Simd {
    /// AVX-512 F and BW.
    Avx512,
    /// AVX2.
    Avx2,
}

impl Simd {
    /// The loops, widest first.
    pub(super) const ALL: [Simd; 2] = [Simd::Avx512, Simd::Avx2];

    /// Whether this CPU has the loop's instructions.
    pub(super) fn present(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Simd::Avx512 => {
                    std::is_x86_feature_detected!("avx512f")
                        && std::is_x86_feature_detected!("avx512bw")
                }
                Simd::Avx2 => std::is_x86_feature_detected!("avx2"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = self;
            false
        }
    }
}

/// The SIMD loop of one element type on one [`Simd`]: fills `out` with the words of `y`'s whole
/// 64-value chunks. Unsafe: the CPU must have the loop's instructions.
#[cfg(target_arch = "x86_64")]
type WordsFn<T> = unsafe fn(&[T], &mut Vec<u64>);

/// A value a mask is made from: its test (the definition) and its SIMD loops.
pub(super) trait MaskValue: Copy {
    /// Whether a `ReLU` output passes (`y > 0`).
    fn passes(self) -> bool;

    /// The AVX-512 loop.
    #[cfg(target_arch = "x86_64")]
    const AVX512: WordsFn<Self>;
    /// The AVX2 loop.
    #[cfg(target_arch = "x86_64")]
    const AVX2: WordsFn<Self>;

    /// Fills `out` with the words of `y`'s whole 64-value chunks on `simd`.
    ///
    /// # Safety
    /// The CPU must have `simd`'s instructions ([`Simd::present`]).
    unsafe fn words(simd: Simd, y: &[Self], out: &mut Vec<u64>) {
        #[cfg(target_arch = "x86_64")]
        {
            let run = match simd {
                Simd::Avx512 => Self::AVX512,
                Simd::Avx2 => Self::AVX2,
            };
            // SAFETY: the caller's contract: the CPU has the loop's instructions.
            unsafe { run(y, out) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (simd, y, out);
            unreachable!("no SIMD loop is present off x86-64")
        }
    }
}

/// f16 outputs, as bits: `1 <= b <= 0x7c00` passes (positive, not zero, up to +inf; NaN fails).
impl MaskValue for u16 {
    fn passes(self) -> bool {
        self.wrapping_sub(1) < 0x7c00
    }
    #[cfg(target_arch = "x86_64")]
    const AVX512: WordsFn<u16> = f16_words_avx512;
    #[cfg(target_arch = "x86_64")]
    const AVX2: WordsFn<u16> = f16_words_avx2;
}

/// f32 outputs: `y > 0` passes (NaN fails).
impl MaskValue for f32 {
    fn passes(self) -> bool {
        self > 0.0
    }
    #[cfg(target_arch = "x86_64")]
    const AVX512: WordsFn<f32> = f32_words_avx512;
    #[cfg(target_arch = "x86_64")]
    const AVX2: WordsFn<f32> = f32_words_avx2;
}

/// One word of a mask, the definition: bit `b` set when value `b` of `c` (at most 64) passes.
pub(super) fn word<T: MaskValue>(c: &[T]) -> u64 {
    c.iter()
        .enumerate()
        .fold(0u64, |w, (b, &v)| w | (u64::from(v.passes()) << b))
}

/// f16 outputs (as bits) that pass: `1 <= b <= 0x7c00` (positive, not zero, up to +inf; NaN fails).
///
/// # Safety
/// The CPU must have AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn f16_words_avx512(y: &[u16], out: &mut Vec<u64>) {
    use std::arch::x86_64::{
        _mm512_cmplt_epu16_mask, _mm512_loadu_si512, _mm512_set1_epi16, _mm512_sub_epi16,
    };
    let (one, inf) = (_mm512_set1_epi16(1), _mm512_set1_epi16(0x7c00));
    for c in y.chunks_exact(64) {
        let (lo, hi) = c.split_at(32);
        // SAFETY: `lo` holds 32 u16 (64 bytes); the load is unaligned.
        let a = unsafe { _mm512_loadu_si512(lo.as_ptr().cast()) };
        // SAFETY: as for `lo`.
        let b = unsafe { _mm512_loadu_si512(hi.as_ptr().cast()) };
        // b - 1 < 0x7c00 unsigned: 1..=0x7c00 pass, 0 wraps to 0xffff and fails
        let ma = _mm512_cmplt_epu16_mask(_mm512_sub_epi16(a, one), inf);
        let mb = _mm512_cmplt_epu16_mask(_mm512_sub_epi16(b, one), inf);
        out.push(u64::from(ma) | (u64::from(mb) << 32));
    }
}

/// f32 outputs that pass: `y > 0` (NaN fails).
///
/// # Safety
/// The CPU must have AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn f32_words_avx512(y: &[f32], out: &mut Vec<u64>) {
    use std::arch::x86_64::{_CMP_GT_OQ, _mm512_cmp_ps_mask, _mm512_loadu_ps, _mm512_setzero_ps};
    let zero = _mm512_setzero_ps();
    for c in y.chunks_exact(64) {
        let mut word = 0u64;
        for (q, v) in c.chunks_exact(16).enumerate() {
            // SAFETY: `v` holds 16 f32; the load is unaligned.
            let x = unsafe { _mm512_loadu_ps(v.as_ptr()) };
            word |= u64::from(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, zero)) << (16 * q);
        }
        out.push(word);
    }
}

/// [`f16_words_avx512`] on AVX2: the same test on signed 16-bit lanes (`-1 < b - 1 < 0x7c00`),
/// narrowed to bytes for `vpmovmskb`.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn f16_words_avx2(y: &[u16], out: &mut Vec<u64>) {
    use std::arch::x86_64::{
        __m256i, _mm256_and_si256, _mm256_cmpgt_epi16, _mm256_loadu_si256, _mm256_movemask_epi8,
        _mm256_packs_epi16, _mm256_permute4x64_epi64, _mm256_set1_epi16, _mm256_sub_epi16,
    };
    let (one, inf, neg) = (
        _mm256_set1_epi16(1),
        _mm256_set1_epi16(0x7c00),
        _mm256_set1_epi16(-1),
    );
    // all ones in the lanes that pass
    let pass = |v: __m256i| {
        let d = _mm256_sub_epi16(v, one);
        _mm256_and_si256(_mm256_cmpgt_epi16(inf, d), _mm256_cmpgt_epi16(d, neg))
    };
    for c in y.chunks_exact(64) {
        let mut word = 0u64;
        for (h, v) in c.chunks_exact(32).enumerate() {
            let (lo, hi) = v.split_at(16);
            // SAFETY: `lo` holds 16 u16 (32 bytes); the load is unaligned.
            let a = unsafe { _mm256_loadu_si256(lo.as_ptr().cast()) };
            // SAFETY: as for `lo`.
            let b = unsafe { _mm256_loadu_si256(hi.as_ptr().cast()) };
            // bytes in 128-bit lanes [a0 b0 a1 b1], put back in order [a0 a1 b0 b1]
            let bytes =
                _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi16(pass(a), pass(b)));
            // the 32 sign bits, one per value
            #[allow(clippy::cast_sign_loss)]
            let bits = _mm256_movemask_epi8(bytes) as u32;
            word |= u64::from(bits) << (32 * h);
        }
        out.push(word);
    }
}

/// [`f32_words_avx512`] on AVX2.
///
/// # Safety
/// The CPU must have AVX (part of AVX2).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn f32_words_avx2(y: &[f32], out: &mut Vec<u64>) {
    use std::arch::x86_64::{
        _CMP_GT_OQ, _mm256_cmp_ps, _mm256_loadu_ps, _mm256_movemask_ps, _mm256_setzero_ps,
    };
    let zero = _mm256_setzero_ps();
    for c in y.chunks_exact(64) {
        let mut word = 0u64;
        for (q, v) in c.chunks_exact(8).enumerate() {
            // SAFETY: `v` holds 8 f32; the load is unaligned.
            let x = unsafe { _mm256_loadu_ps(v.as_ptr()) };
            // the 8 sign bits of the compare, one per value
            #[allow(clippy::cast_sign_loss)]
            let bits = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(x, zero)) as u32;
            word |= u64::from(bits) << (8 * q);
        }
        out.push(word);
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::super::epilogue::ReluMask;

    /// Values around every edge of the test: zeros of both signs, subnormals, the largest finite,
    /// the infinities and NaNs, and ordinary values of both signs.
    fn values(n: usize) -> Vec<f32> {
        let edges = [
            0.0,
            -0.0,
            1e-7,
            -1e-7,
            65504.0,
            -65504.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MIN_POSITIVE,
            1.5,
            -2.25,
        ];
        #[allow(clippy::cast_precision_loss)]
        (0..n)
            .map(|i| edges[(i * 7 + i / 13) % edges.len()] * (1.0 + (i % 3) as f32))
            .collect()
    }

    #[test]
    fn the_simd_words_are_the_definitions_bits() {
        for n in [0usize, 1, 63, 64, 65, 127, 128, 200, 1000, 4099] {
            let y = values(n);
            let yh: Vec<f16> = y.iter().map(|&v| f16::from_f32(v)).collect();
            // the definition, bit by bit
            let want32: Vec<bool> = y.iter().map(|&v| v > 0.0).collect();
            let want16: Vec<bool> = yh.iter().map(|&v| v > f16::ZERO).collect();
            let bits = |m: &ReluMask| (0..n).map(|i| m.get(i)).collect::<Vec<_>>();
            for (path, m32, m16) in ReluMask::each_path(&y, &yh) {
                assert_eq!(bits(&m32), want32, "f32, {path}, n = {n}");
                assert_eq!(bits(&m16), want16, "f16, {path}, n = {n}");
                assert_eq!(m32.len(), n);
            }
        }
    }
}
