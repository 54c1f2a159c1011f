//! Tight FMA loops measuring a path's peak arithmetic throughput (for benchmarks).

use super::{KernelError, KernelPath};

/// Independent accumulator chains: enough to hide FMA latency on two FMA ports.
const CHAINS: usize = 12;

/// Runs `iters` rounds of `CHAINS` independent vector FMAs on `path` and returns the floating
/// point operations performed (2 per lane per FMA). Time it to get the peak: FLOP / seconds.
/// For [`KernelPath::Avx512Fp16`] the FMAs are f16 (`vfmadd231ph`), for
/// [`KernelPath::Avx512Bf16`] bf16 pair dot products (`vdpbf16ps`, two multiply-adds per f32
/// lane), for the others f32.
///
/// # Errors
/// [`KernelError::Unsupported`] if this CPU lacks the path.
pub fn peak_fma_flops(path: KernelPath, iters: usize) -> Result<u64, KernelError> {
    if !path.is_supported() {
        return Err(KernelError::Unsupported {
            path,
            supported: KernelPath::supported(),
        });
    }
    let lanes = match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the path's CPU features were checked above.
        KernelPath::Avx512Fp16 => unsafe { x86::fp16(iters) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the path's CPU features were checked above.
        KernelPath::Avx512Bf16 => unsafe { x86::bf16(iters) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the path's CPU features were checked above.
        KernelPath::Avx512 => unsafe { x86::avx512(iters) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the path's CPU features were checked above.
        KernelPath::Avx2Fma => unsafe { x86::avx2(iters) },
        _ => portable(iters),
    };
    // a count, not a size: saturated rather than wrapped for absurd `iters`
    Ok(u64::try_from(iters.saturating_mul(CHAINS * lanes * 2)).unwrap_or(u64::MAX))
}

/// Scalar multiply-adds on 8-lane arrays; returns the lane count.
fn portable(iters: usize) -> usize {
    let mut acc = [[1.0f32; 8]; CHAINS];
    let (m, a) = (
        std::hint::black_box(0.999_f32),
        std::hint::black_box(1e-3_f32),
    );
    for _ in 0..iters {
        for chain in &mut acc {
            for x in chain.iter_mut() {
                *x = *x * m + a;
            }
        }
    }
    std::hint::black_box(acc);
    8
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::{
        _mm256_fmadd_ps, _mm256_set1_ps, _mm512_castsi512_ph, _mm512_fmadd_ph, _mm512_fmadd_ps,
        _mm512_set1_epi16, _mm512_set1_ps,
    };

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2(iters: usize) -> usize {
        let (m, a) = std::hint::black_box((_mm256_set1_ps(0.999), _mm256_set1_ps(1e-3)));
        let mut acc = std::hint::black_box([_mm256_set1_ps(1.0); CHAINS]);
        for _ in 0..iters {
            for x in &mut acc {
                *x = _mm256_fmadd_ps(*x, m, a);
            }
        }
        std::hint::black_box(acc);
        8
    }

    /// # Safety
    /// The CPU must support AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512(iters: usize) -> usize {
        let (m, a) = std::hint::black_box((_mm512_set1_ps(0.999), _mm512_set1_ps(1e-3)));
        let mut acc = std::hint::black_box([_mm512_set1_ps(1.0); CHAINS]);
        for _ in 0..iters {
            for x in &mut acc {
                *x = _mm512_fmadd_ps(*x, m, a);
            }
        }
        std::hint::black_box(acc);
        16
    }

    /// # Safety
    /// The CPU must support AVX-512 F and AVX512-BF16. Returns 32: each of the 16 f32 lanes does
    /// two multiply-adds.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn bf16(iters: usize) -> usize {
        use std::arch::x86_64::{_mm512_dpbf16_ps, _mm512_set1_epi32};
        // (0.999, 1e-3) as bf16 pairs: 0x3f7f, 0x3a83
        let pair = super::super::bf16::bh(std::hint::black_box(_mm512_set1_epi32(0x3a83_3f7f)));
        let mut acc = std::hint::black_box([_mm512_set1_ps(1.0); CHAINS]);
        for _ in 0..iters {
            for x in &mut acc {
                *x = _mm512_dpbf16_ps(*x, pair, pair);
            }
        }
        std::hint::black_box(acc);
        32
    }

    /// # Safety
    /// The CPU must support AVX-512 F, BW and FP16.
    #[target_feature(enable = "avx512f,avx512bw,avx512fp16")]
    pub(super) unsafe fn fp16(iters: usize) -> usize {
        // 0.999 and 1e-3 as f16 bit patterns
        let m = std::hint::black_box(_mm512_castsi512_ph(_mm512_set1_epi16(0x3bfe)));
        let a = std::hint::black_box(_mm512_castsi512_ph(_mm512_set1_epi16(0x1419)));
        let mut acc =
            std::hint::black_box([_mm512_castsi512_ph(_mm512_set1_epi16(0x3c00)); CHAINS]);
        for _ in 0..iters {
            for x in &mut acc {
                *x = _mm512_fmadd_ph(*x, m, a);
            }
        }
        std::hint::black_box(acc);
        32
    }
}
