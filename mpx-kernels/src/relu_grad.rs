//! The backward epilogue's rows with SIMD, for f32 and f16 `dY`: `ReLU`'s mask applied to `dY`
//! from its bits, and the bias gradient's column sums, in one pass. The scalar loops in
//! [`epilogue`](super::epilogue) are the definition: every column is summed row by row in the
//! same order, so the results are the same bits.

/// The 16 mask bits of elements `i..i + 16` (bits past the mask's end read as clear).
#[cfg(target_arch = "x86_64")]
fn bits16(bits: &[u64], i: usize) -> u16 {
    let (word, off) = (i / 64, i % 64);
    let lo = bits.get(word).map_or(0, |w| w >> off);
    let hi = if off > 48 {
        bits.get(word + 1).map_or(0, |w| w << (64 - off))
    } else {
        0
    };
    // the low 16 bits: the mask of these 16 elements
    #[allow(clippy::cast_possible_truncation)]
    let m = (lo | hi) as u16;
    m
}

/// The lanes of a chunk of `len` values (at most 16) starting at element `at`, and those of them
/// the mask keeps (all without a mask).
#[cfg(target_arch = "x86_64")]
fn lanes(len: usize, mask: Option<&[u64]>, at: usize) -> (u16, u16) {
    let lanes: u16 = u16::MAX >> (16 - len);
    (lanes, mask.map_or(lanes, |m| lanes & bits16(m, at)))
}

/// `g += v` on `lanes`: a chunk's values added into its columns' sums.
///
/// # Safety
/// The CPU must have AVX-512 F; `lanes` covers at most `g.len()` lanes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn add_to_sums(g: &mut [f32], lanes: u16, v: std::arch::x86_64::__m512) {
    use std::arch::x86_64::{_mm512_add_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps};
    // SAFETY: the lanes set in `lanes` are `g`'s values (the caller's contract).
    let old = unsafe { _mm512_maskz_loadu_ps(lanes, g.as_ptr()) };
    let sum = _mm512_add_ps(old, v);
    // SAFETY: as above.
    unsafe { _mm512_mask_storeu_ps(g.as_mut_ptr(), lanes, sum) };
}

/// `dy` (whole rows of `bias_grad.len()`, not empty) zeroed where `mask`'s bit is clear, then
/// summed by column into `bias_grad`.
///
/// # Safety
/// The CPU must have AVX-512 F. (Any lengths are sound: rows are `bias_grad.len()` values, a
/// shorter last row is summed as far as it goes, and missing mask bits read as clear.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn mask_bias_grad_f32_avx512(
    dy: &mut [f32],
    mask: Option<&[u64]>,
    bias_grad: &mut [f32],
) {
    use std::arch::x86_64::{_mm512_mask_storeu_ps, _mm512_maskz_loadu_ps};
    let cols = bias_grad.len();
    for (r, row) in dy.chunks_exact_mut(cols).enumerate() {
        for (k, (d, g)) in row.chunks_mut(16).zip(bias_grad.chunks_mut(16)).enumerate() {
            // the lanes of this chunk (16, or fewer at the row's end)
            let (lanes, keep) = lanes(d.len(), mask, r * cols + 16 * k);
            // SAFETY: only the lanes set in `keep` are read, and `keep` is within `lanes`: the
            // `d.len()` values of `d`.
            let v = unsafe { _mm512_maskz_loadu_ps(keep, d.as_ptr()) };
            // SAFETY: the `d.len()` lanes of `lanes` are `d`'s values.
            unsafe { _mm512_mask_storeu_ps(d.as_mut_ptr(), lanes, v) };
            // SAFETY: `g` has the same length as `d` (a row's chunk and its columns' sums).
            unsafe { add_to_sums(g, lanes, v) };
        }
    }
}

/// [`mask_bias_grad_f32_avx512`] for f16 `dy`: masked in place, widened exactly to f32 and
/// summed by column.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL. (Any lengths are sound, as for the f32 function.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn mask_bias_grad_f16_avx512(
    dy: &mut [u16],
    mask: Option<&[u64]>,
    bias_grad: &mut [f32],
) {
    use std::arch::x86_64::{_mm256_mask_storeu_epi16, _mm256_maskz_loadu_epi16, _mm512_cvtph_ps};
    let cols = bias_grad.len();
    for (r, row) in dy.chunks_exact_mut(cols).enumerate() {
        for (k, (d, g)) in row.chunks_mut(16).zip(bias_grad.chunks_mut(16)).enumerate() {
            let (lanes, keep) = lanes(d.len(), mask, r * cols + 16 * k);
            // SAFETY: only the lanes set in `keep` (within `lanes`, the `d.len()` values of
            // `d`) are read; the others read as +0.0.
            let h = unsafe { _mm256_maskz_loadu_epi16(keep, d.as_ptr().cast()) };
            // SAFETY: the `d.len()` lanes of `lanes` are `d`'s values.
            unsafe { _mm256_mask_storeu_epi16(d.as_mut_ptr().cast(), lanes, h) };
            let v = _mm512_cvtph_ps(h);
            // SAFETY: `g` has the same length as `d`.
            unsafe { add_to_sums(g, lanes, v) };
        }
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::super::epilogue::{ReluMask, relu_mask_bias_grad_f16, relu_mask_bias_grad_f32};

    /// A gradient element of the epilogue: f32 or f16, and the entry point that takes it.
    trait Grad: Copy {
        fn of(v: f32) -> Self;
        fn wide(self) -> f32;
        fn bits(self) -> u32;
        fn mask(y: &[Self]) -> ReluMask;
        /// The dispatching entry point (SIMD where the CPU has it).
        fn run(dy: &mut [Self], mask: Option<&ReluMask>, bias_grad: &mut [f32]);
    }

    impl Grad for f32 {
        fn of(v: f32) -> Self {
            v
        }
        fn wide(self) -> f32 {
            self
        }
        fn bits(self) -> u32 {
            self.to_bits()
        }
        fn mask(y: &[Self]) -> ReluMask {
            ReluMask::from_f32(y)
        }
        fn run(dy: &mut [Self], mask: Option<&ReluMask>, bias_grad: &mut [f32]) {
            relu_mask_bias_grad_f32(dy, mask, bias_grad).unwrap();
        }
    }

    impl Grad for f16 {
        fn of(v: f32) -> Self {
            f16::from_f32(v)
        }
        fn wide(self) -> f32 {
            self.to_f32()
        }
        fn bits(self) -> u32 {
            u32::from(self.to_bits())
        }
        fn mask(y: &[Self]) -> ReluMask {
            ReluMask::from_f16(y)
        }
        fn run(dy: &mut [Self], mask: Option<&ReluMask>, bias_grad: &mut [f32]) {
            relu_mask_bias_grad_f16(dy, mask, bias_grad).unwrap();
        }
    }

    /// The entry point against the scalar definition (mask, widen, column sums row by row), bit
    /// for bit, over row widths around the 16-lane chunks, with and without a mask.
    fn rows_are_the_scalar_bits<T: Grad>() {
        for cols in [1usize, 7, 15, 16, 17, 33, 64, 100, 1024] {
            for rows in [1usize, 3, 5] {
                let n = rows * cols;
                #[allow(clippy::cast_precision_loss)]
                let dy0: Vec<T> = (0..n)
                    .map(|i| T::of(((i * 37 % 101) as f32 - 50.0) / 7.0))
                    .collect();
                #[allow(clippy::cast_precision_loss)]
                let y: Vec<T> = (0..n)
                    .map(|i| T::of(((i * 13 % 29) as f32) - 14.0))
                    .collect();
                for masked in [false, true] {
                    let (mut want, mut gw) = (dy0.clone(), vec![0.5f32; cols]);
                    for (i, v) in want.iter_mut().enumerate() {
                        if masked && y[i].wide() <= 0.0 {
                            *v = T::of(0.0);
                        }
                        gw[i % cols] += v.wide();
                    }
                    let mask = masked.then(|| T::mask(&y));
                    let (mut got, mut gg) = (dy0.clone(), vec![0.5f32; cols]);
                    T::run(&mut got, mask.as_ref(), &mut gg);
                    let tb = |v: &[T]| v.iter().map(|x| x.bits()).collect::<Vec<_>>();
                    let fb = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(tb(&got), tb(&want), "dy, {rows}x{cols}, mask {masked}");
                    assert_eq!(fb(&gg), fb(&gw), "bias grad, {rows}x{cols}, mask {masked}");
                }
            }
        }
    }

    #[test]
    fn the_simd_rows_are_the_scalar_bits() {
        #[cfg(target_arch = "x86_64")]
        let simd = std::is_x86_feature_detected!("avx512f");
        #[cfg(not(target_arch = "x86_64"))]
        let simd = false;
        if !simd {
            eprintln!("skipped: this CPU has no AVX-512 F (the portable loop ran instead)");
        }
        rows_are_the_scalar_bits::<f32>();
    }

    #[test]
    fn the_simd_f16_rows_are_the_scalar_bits() {
        #[cfg(target_arch = "x86_64")]
        let simd =
            std::is_x86_feature_detected!("avx512bw") && std::is_x86_feature_detected!("avx512vl");
        #[cfg(not(target_arch = "x86_64"))]
        let simd = false;
        if !simd {
            eprintln!("skipped: this CPU has no AVX-512 BW and VL (the portable loop ran instead)");
        }
        rows_are_the_scalar_bits::<f16>();
    }
}
