//! The AVX2+FMA f32 micro-kernel: 6 x 16 tile, 12 ymm accumulators.

use super::driver::Micro;

const MR: usize = 6;
const NR: usize = 16;

pub(crate) fn micro() -> Micro<f32> {
    Micro {
        mr: MR,
        nr: NR,
        kc: 256,
        mc: 72,
        nc: 512,
        run: kernel,
    }
}

/// `C[6 x 16] += Apack(kc x 6)ᵀ · Bpack(kc x 16)`.
///
/// # Safety
/// The CPU must support AVX2 and FMA. `c` must be valid for reads and writes of `MR` rows of `NR`
/// values at stride `ldc`, untouched by anyone else during the call. Packed lengths are asserted.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel(kc: usize, a: &[f32], b: &[f32], c: *mut f32, ldc: usize) {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_broadcast_ss, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps,
        _mm256_storeu_ps,
    };
    assert!(a.len() >= kc * MR && b.len() >= kc * NR);
    // SAFETY: the caller guarantees AVX2+FMA; packed-operand offsets stay within the lengths
    // asserted above (p < kc, i < MR, column offsets < NR); the caller guarantees the C tile.
    unsafe {
        let (ap, bp) = (a.as_ptr(), b.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        for p in 0..kc {
            let b0 = _mm256_loadu_ps(bp.add(p * NR));
            let b1 = _mm256_loadu_ps(bp.add(p * NR + 8));
            for (i, row) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*ap.add(p * MR + i));
                row[0] = _mm256_fmadd_ps(av, b0, row[0]);
                row[1] = _mm256_fmadd_ps(av, b1, row[1]);
            }
        }
        let cp = c;
        for (i, row) in acc.iter().enumerate() {
            for (h, v) in row.iter().enumerate() {
                let dst = cp.add(i * ldc + h * 8);
                _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), *v));
            }
        }
    }
}

/// Never called: [`KernelPath::Avx2Fma`](super::KernelPath) is unsupported off x86-64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(kc: usize, a: &[f32], b: &[f32], c: *mut f32, ldc: usize) {
    let _ = (kc, a, b, c, ldc);
    unreachable!("AVX2 kernel on a non-x86 target")
}
