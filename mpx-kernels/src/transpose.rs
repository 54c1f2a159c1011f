//! An AVX transpose for packing operands stored with k contiguous (the weight `Wᵀ` of a Linear
//! layer's forward product, the activations `X` as A): each group of 8 lines of 8 values becomes
//! 8 rows of 8 of the panel with one 8 x 8 register transpose instead of 64 scalar moves, for
//! panels of any width that is a multiple of 8 (the AVX2 kernel's 16, the AVX-512 kernel's 8 and
//! 32). f32 values are moved; f16 values are widened to f32 on the way (F16C), so an f16 operand
//! packs for the f32 kernels in one pass. The panels are the same as the scalar loop's (the
//! tests compare them).

/// The AVX/F16C loop of [`lines`] for values of type `T`: `(panel, data, (l0, w), pc, kc, ls)`.
#[cfg(target_arch = "x86_64")]
type Loop<T> = unsafe fn(&mut [f32], &[T], (usize, usize), usize, usize, usize);

/// A value type [`lines`] reads: f32, moved as it is, or f16 as its bits, widened to f32 (exact).
pub(crate) trait TransposeElem: Sized {
    /// The loop for this type.
    #[cfg(target_arch = "x86_64")]
    const RUN: Loop<Self>;
}

impl TransposeElem for f32 {
    #[cfg(target_arch = "x86_64")]
    const RUN: Loop<f32> = x86::lines_f32;
}

impl TransposeElem for u16 {
    #[cfg(target_arch = "x86_64")]
    const RUN: Loop<u16> = x86::lines_f16;
}

/// Writes `panel[p * w + l] = data[(l0 + l) * ls + pc + p]` (as f32) for `l < w`, `p < kc` and
/// returns true, when `w` is a positive multiple of 8 and the CPU has AVX and F16C; returns false
/// (writing nothing) otherwise.
pub(crate) fn lines<T: TransposeElem>(
    panel: &mut [f32],
    data: &[T],
    (l0, w): (usize, usize),
    (pc, kc): (usize, usize),
    ls: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if fits(panel.len(), data.len(), (l0, w), (pc, kc), ls) {
        // SAFETY: AVX and F16C were detected; every read is `(l0 + l) * ls + pc + p` with
        // `l < w`, `p < kc` (inside `data`, checked by `fits`) and every write `p * w + l`
        // (inside `panel`).
        unsafe { T::RUN(panel, data, (l0, w), pc, kc, ls) };
        return true;
    }
    let _ = (panel, data, l0, w, pc, kc, ls);
    false
}

/// Whether the transpose runs here (AVX and F16C, `w` a positive multiple of 8), after checking
/// that the panel holds `w x kc` values and every line read lies inside the data (a panic
/// otherwise: the packing loops never ask for more).
#[cfg(target_arch = "x86_64")]
fn fits(
    panel: usize,
    data: usize,
    (l0, w): (usize, usize),
    (pc, kc): (usize, usize),
    ls: usize,
) -> bool {
    if w == 0 || !w.is_multiple_of(8) || !crate::convert::has_f16c() {
        return false;
    }
    assert!(panel >= w * kc);
    assert!(kc == 0 || (l0 + w - 1) * ls + pc + kc <= data);
    true
}

// `_mm_loadu_si128` takes an `__m128i` pointer but reads it unaligned: the cast from `u16` is sound.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::cast_ptr_alignment)]
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256, _mm_loadu_si128, _mm256_cvtph_ps, _mm256_loadu_ps, _mm256_permute2f128_ps,
        _mm256_shuffle_ps, _mm256_storeu_ps, _mm256_unpackhi_ps, _mm256_unpacklo_ps,
    };

    /// The loop of [`lines`](super::lines) for one value type: `$load` reads 8 values as f32,
    /// `$one` converts one.
    macro_rules! lines_of {
        ($name:ident, $t:ty, $load:expr, $one:expr) => {
            /// # Safety
            /// The CPU must support AVX and F16C; `w` is a multiple of 8; the reads and writes
            /// named in [`lines`](super::lines) must lie inside `data` and `panel`.
            #[target_feature(enable = "avx,f16c")]
            pub(super) unsafe fn $name(
                panel: &mut [f32],
                data: &[$t],
                (l0, w): (usize, usize),
                pc: usize,
                kc: usize,
                ls: usize,
            ) {
                let (src, dst) = (data.as_ptr(), panel.as_mut_ptr());
                let full = kc - kc % 8;
                for q in (0..full).step_by(8) {
                    for g in 0..w / 8 {
                        let r: [__m256; 8] = std::array::from_fn(|i| {
                            let at = src.wrapping_add((l0 + g * 8 + i) * ls + pc + q);
                            // SAFETY: values `p = q..q + 8 <= full <= kc` of line
                            // `g * 8 + i < w`: inside `data` by the caller's contract.
                            unsafe { $load(at) }
                        });
                        let t = transpose8(r);
                        for (p, v) in t.iter().enumerate() {
                            let at = dst.wrapping_add((q + p) * w + g * 8);
                            // SAFETY: `(q + p) * w + g * 8 + 8 <= w * kc`: inside `panel`.
                            unsafe { _mm256_storeu_ps(at, *v) };
                        }
                    }
                }
                for p in full..kc {
                    for l in 0..w {
                        let from = src.wrapping_add((l0 + l) * ls + pc + p);
                        // SAFETY: value `p < kc` of line `l < w`: inside `data` by the contract.
                        let x = unsafe { *from };
                        // SAFETY: `p * w + l < w * kc`: inside `panel`.
                        unsafe { *dst.wrapping_add(p * w + l) = $one(x) };
                    }
                }
            }
        };
    }

    lines_of!(
        lines_f32,
        f32,
        |at: *const f32| _mm256_loadu_ps(at),
        |x: f32| x
    );
    lines_of!(
        lines_f16,
        u16,
        |at: *const u16| _mm256_cvtph_ps(_mm_loadu_si128(at.cast::<__m128i>())),
        |x: u16| half::f16::from_bits(x).to_f32()
    );

    /// Rows `r[i]` to columns: `out[p][i] = r[i][p]`.
    #[inline]
    #[target_feature(enable = "avx")]
    fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }
}
