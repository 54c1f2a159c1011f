//! The AVX512-FP16 micro-kernel: f16 operands, f16 FMA, 8 x 64 tile (16 zmm of 32 halves), the
//! partial sums moved into the f32 output every [`FP16_FLUSH`] products.
//!
//! Operands are f16 bit patterns (`u16`) and every intrinsic used takes integer or `__m512h`
//! vectors, so the unstable `f16` primitive is never needed.

use super::FP16_FLUSH;
use super::tile::Micro;

const MR: usize = 8;
const NR: usize = 64;

pub(crate) fn micro() -> Micro<u16> {
    Micro::new(MR, NR, kernel)
}

/// `C[8 x 64] += Apack(kc x 8)ᵀ · Bpack(kc x 64)`, in runs of at most 32 f16 FMAs per output
/// whose sums are then widened and added to `C` in f32.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and FP16. `c` must be valid for reads and writes of `MR` rows of `NR`
/// values at stride `ldc`, untouched by anyone else during the call. Packed lengths are asserted.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512fp16")]
unsafe fn kernel(kc: usize, a: &[u16], b: &[u16], c: *mut f32, ldc: usize, first: bool) {
    use std::arch::x86_64::{
        _mm512_add_ps, _mm512_castph_si512, _mm512_castsi512_ph, _mm512_castsi512_si256,
        _mm512_cvtph_ps, _mm512_extracti64x4_epi64, _mm512_fmadd_ph, _mm512_loadu_ps,
        _mm512_loadu_si512, _mm512_set1_epi16, _mm512_setzero_ps, _mm512_setzero_si512,
        _mm512_storeu_ps,
    };
    assert!(a.len() >= kc * MR && b.len() >= kc * NR);
    let mut start = 0;
    while start < kc {
        let end = kc.min(start + FP16_FLUSH);
        let zero = _mm512_castsi512_ph(_mm512_setzero_si512());
        let mut acc = [[zero; 2]; MR];
        for p in start..end {
            let ap: &[u16; MR] = a[p * MR..(p + 1) * MR].try_into().expect("MR values");
            let bp: &[u16; NR] = b[p * NR..(p + 1) * NR].try_into().expect("NR values");
            let (lo, hi) = bp.split_at(32);
            // SAFETY: `lo` holds 32 u16, 64 bytes; the load is unaligned.
            let b0 = _mm512_castsi512_ph(unsafe { _mm512_loadu_si512(lo.as_ptr().cast()) });
            // SAFETY: `hi` holds 32 u16.
            let b1 = _mm512_castsi512_ph(unsafe { _mm512_loadu_si512(hi.as_ptr().cast()) });
            for (row, &x) in acc.iter_mut().zip(ap) {
                let av = _mm512_castsi512_ph(_mm512_set1_epi16(x as i16));
                row[0] = _mm512_fmadd_ph(av, b0, row[0]);
                row[1] = _mm512_fmadd_ph(av, b1, row[1]);
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (h, v) in row.iter().enumerate() {
                let bits = _mm512_castph_si512(*v);
                let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(bits));
                let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(bits));
                for (part, sum) in [(0, lo), (16, hi)] {
                    let dst = c.wrapping_add(i * ldc + h * 32 + part);
                    // the first flush of a first k block: `C` is not read
                    let old = if first && start == 0 {
                        _mm512_setzero_ps()
                    } else {
                        // SAFETY: C(i, 32h + part..+16) of the tile the caller lends us
                        // (`i < MR`, `32h + part + 16 <= NR`).
                        unsafe { _mm512_loadu_ps(dst) }
                    };
                    let new = _mm512_add_ps(old, sum);
                    // SAFETY: as above; no one else accesses the tile during the call.
                    unsafe { _mm512_storeu_ps(dst, new) };
                }
            }
        }
        start = end;
    }
}

/// Never called: [`KernelPath::Avx512Fp16`](super::KernelPath) is unsupported off x86-64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(kc: usize, a: &[u16], b: &[u16], c: *mut f32, ldc: usize, first: bool) {
    let _ = (kc, a, b, c, ldc, first);
    unreachable!("AVX512-FP16 kernel on a non-x86 target")
}
