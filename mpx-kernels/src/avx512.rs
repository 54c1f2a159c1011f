//! The AVX-512 f32 micro-kernel: 8 x 32 tile, 16 zmm accumulators.

use super::tile::Micro;

pub(crate) const MR: usize = 8;
pub(crate) const NR: usize = 32;

pub(crate) fn micro() -> Micro<f32> {
    Micro::new(MR, NR, kernel)
}

/// `C[8 x 32] += Apack(kc x 8)ᵀ · Bpack(kc x 32)` (`C` not read when `first`).
///
/// # Safety
/// The CPU must support AVX-512 F. `c` must be valid for reads and writes of `MR` rows of `NR`
/// values at stride `ldc`, untouched by anyone else during the call. Packed lengths are asserted.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn kernel(kc: usize, a: &[f32], b: &[f32], c: *mut f32, ldc: usize, first: bool) {
    use std::arch::x86_64::{_mm512_fmadd_ps, _mm512_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps};
    assert!(a.len() >= kc * MR && b.len() >= kc * NR);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for (ap, bp) in a.chunks_exact(MR).zip(b.chunks_exact(NR)).take(kc) {
        let bp: &[f32; NR] = bp.try_into().expect("chunks of NR");
        let (lo, hi) = bp.split_at(16);
        // SAFETY: `lo` holds 16 f32; the load is unaligned.
        let b0 = unsafe { _mm512_loadu_ps(lo.as_ptr()) };
        // SAFETY: `hi` holds 16 f32.
        let b1 = unsafe { _mm512_loadu_ps(hi.as_ptr()) };
        for (row, &x) in acc.iter_mut().zip(ap) {
            let av = _mm512_set1_ps(x);
            row[0] = _mm512_fmadd_ps(av, b0, row[0]);
            row[1] = _mm512_fmadd_ps(av, b1, row[1]);
        }
    }
    // SAFETY: AVX-512 F is enabled here; `c` is the tile the caller lends us.
    unsafe { add_tile(&acc, c, ldc, first) };
}

/// `C[8 x 32] += acc`: a tile's f32 sums, two zmm per row, added into `C` (into `+0.0`, `C` not
/// read, when `first`). The end of the AVX-512 f32 kernel and of the AVX512-BF16 one
/// (`bf16.rs`), which share the tile shape.
///
/// # Safety
/// The CPU must support AVX-512 F. `c` must be valid for reads and writes of `MR` rows of `NR`
/// values at stride `ldc`, untouched by anyone else during the call.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn add_tile(
    acc: &[[std::arch::x86_64::__m512; 2]; MR],
    c: *mut f32,
    ldc: usize,
    first: bool,
) {
    use std::arch::x86_64::{_mm512_add_ps, _mm512_loadu_ps, _mm512_setzero_ps, _mm512_storeu_ps};
    for (i, row) in acc.iter().enumerate() {
        for (h, v) in row.iter().enumerate() {
            let dst = c.wrapping_add(i * ldc + h * 16);
            let old = if first {
                _mm512_setzero_ps()
            } else {
                // SAFETY: C(i, 16h..16h + 16) of the tile the caller lends us (`i < MR`,
                // `16h + 16 <= NR`).
                unsafe { _mm512_loadu_ps(dst) }
            };
            let sum = _mm512_add_ps(old, *v);
            // SAFETY: as above; no one else accesses the tile during the call.
            unsafe { _mm512_storeu_ps(dst, sum) };
        }
    }
}

/// Never called: [`KernelPath::Avx512`](super::KernelPath) is unsupported off x86-64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(kc: usize, a: &[f32], b: &[f32], c: *mut f32, ldc: usize, first: bool) {
    let _ = (kc, a, b, c, ldc, first);
    unreachable!("AVX-512 kernel on a non-x86 target")
}
