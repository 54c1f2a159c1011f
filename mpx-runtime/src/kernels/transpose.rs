//! An AVX transpose for packing f32 operands stored with k contiguous (the weight `Wᵀ` of a
//! Linear layer's forward product): 16 lines of 8 values become 8 rows of a 16-wide panel with
//! two 8 x 8 register transposes instead of 128 scalar moves. The values are moved, not
//! computed: the panel is the same as the scalar loop's (the tests compare them).

/// Writes `panel[p * 16 + l] = data[(l0 + l) * ls + pc + p]` for `l < 16`, `p < kc` and returns
/// true, when the CPU has AVX; returns false (writing nothing) otherwise.
pub(crate) fn lines16(
    panel: &mut [f32],
    data: &[f32],
    l0: usize,
    (pc, kc): (usize, usize),
    ls: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx") {
        assert!(panel.len() >= 16 * kc);
        assert!(kc == 0 || (l0 + 15) * ls + pc + kc <= data.len());
        // SAFETY: AVX was detected; every read is `(l0 + l) * ls + pc + p` with `l < 16`,
        // `p < kc` (inside `data`, asserted above) and every write `p * 16 + l` (inside `panel`).
        unsafe { x86::lines16(panel, data, l0, pc, kc, ls) };
        return true;
    }
    let _ = (panel, data, l0, pc, kc, ls);
    false
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m256, _mm256_loadu_ps, _mm256_permute2f128_ps, _mm256_shuffle_ps, _mm256_storeu_ps,
        _mm256_unpackhi_ps, _mm256_unpacklo_ps,
    };

    /// # Safety
    /// The CPU must support AVX; the reads and writes named in [`lines16`](super::lines16) must
    /// lie inside `data` and `panel`.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn lines16(
        panel: &mut [f32],
        data: &[f32],
        l0: usize,
        pc: usize,
        kc: usize,
        ls: usize,
    ) {
        let (src, dst) = (data.as_ptr(), panel.as_mut_ptr());
        let full = kc - kc % 8;
        for q in (0..full).step_by(8) {
            for half in 0..2 {
                let r: [__m256; 8] = std::array::from_fn(|i| {
                    let at = src.wrapping_add((l0 + half * 8 + i) * ls + pc + q);
                    // SAFETY: values `p = q..q + 8 <= full <= kc` of line `half * 8 + i < 16`:
                    // inside `data` by the caller's contract.
                    unsafe { _mm256_loadu_ps(at) }
                });
                let t = transpose8(r);
                for (p, v) in t.iter().enumerate() {
                    let at = dst.wrapping_add((q + p) * 16 + half * 8);
                    // SAFETY: `(q + p) * 16 + half * 8 + 8 <= 16 * kc`: inside `panel`.
                    unsafe { _mm256_storeu_ps(at, *v) };
                }
            }
        }
        for p in full..kc {
            for l in 0..16 {
                let from = src.wrapping_add((l0 + l) * ls + pc + p);
                // SAFETY: value `p < kc` of line `l < 16`: inside `data` by the contract.
                let x = unsafe { *from };
                // SAFETY: `p * 16 + l < 16 * kc`: inside `panel`.
                unsafe { *dst.wrapping_add(p * 16 + l) = x };
            }
        }
    }

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
