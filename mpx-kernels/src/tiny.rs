//! Products too small for the blocked driver to pay for itself (a 2-2-1 net's, an RL policy's
//! first layer): computed directly, element by element, with the same arithmetic as the FMA
//! micro-kernels, so that the result has the same bits as the blocked run.
//!
//! The blocked driver's fixed cost (choosing a split, reaching the thread pool, packing tiles)
//! is a few hundred nanoseconds; a product of a few thousand multiply-adds takes about that
//! long. Below [`TINY_WORK`] multiply-adds, and only where the path would run an FMA chain
//! (f32 or f16 operands on [`KernelPath::Avx2Fma`], [`KernelPath::Avx512`] or
//! [`KernelPath::Avx512Bf16`], f32 operands on [`KernelPath::Avx512Fp16`]), the product runs
//! here: for every output element one FMA chain over each k block of [`KC`] values in order,
//! added into `C` (into `+0.0` when `C` is overwritten). That is what the AVX2 and AVX-512
//! kernels do; `tests.rs` compares the two bit for bit.

use half::f16;

use super::tile::KC;
use super::{KernelPath, MatRef};
use crate::FloatSlice;

/// Products of at most this many multiply-adds run here.
pub(crate) const TINY_WORK: usize = 512;

/// Runs `C (+)= A·B` here when the product is tiny and `path` computes it with an FMA chain;
/// `false` (nothing written) otherwise. The caller has checked the shapes and that `path` runs
/// on this CPU.
pub(crate) fn gemm(
    path: KernelPath,
    a: &MatRef<'_>,
    b: &MatRef<'_>,
    c: &mut [f32],
    accumulate: bool,
) -> bool {
    let (m, n, k) = (a.rows(), b.cols(), a.cols());
    if m.saturating_mul(n).saturating_mul(k) > TINY_WORK {
        return false;
    }
    let wide = |v: &FloatSlice<'_>| matches!(v, FloatSlice::F32(_) | FloatSlice::F16(_));
    let both_f32 = matches!(
        (a.values(), b.values()),
        (FloatSlice::F32(_), FloatSlice::F32(_))
    );
    let fma_chain = match path {
        KernelPath::Avx2Fma | KernelPath::Avx512 | KernelPath::Avx512Bf16 => {
            wide(&a.values()) && wide(&b.values())
        }
        KernelPath::Avx512Fp16 => both_f32,
        KernelPath::Portable => false,
    };
    if !fma_chain {
        return false;
    }
    // SAFETY: every path above needs FMA (`Avx2Fma` by name; every CPU with AVX-512 has it),
    // and the caller checked that `path` runs on this CPU.
    unsafe { products(a, b, c, accumulate) };
    true
}

/// Element `(i, j)` of an operand, as f32 (f16 widened exactly).
#[derive(Clone, Copy)]
struct Operand<'a> {
    values: FloatSlice<'a>,
    rs: usize,
    cs: usize,
}

impl<'a> Operand<'a> {
    fn of(m: &MatRef<'a>) -> Self {
        Self {
            values: m.values(),
            rs: m.row_stride(),
            cs: m.col_stride(),
        }
    }

    #[inline]
    fn at(self, i: usize, j: usize) -> f32 {
        let idx = i * self.rs + j * self.cs;
        match self.values {
            FloatSlice::F32(v) | FloatSlice::Bf16(v) => v[idx],
            FloatSlice::F16(v) => f16::to_f32_const(v[idx]),
        }
    }
}

/// The products of [`gemm`], element by element, compiled with FMA so that `mul_add` is one
/// instruction.
///
/// # Safety
/// The CPU must have FMA.
#[target_feature(enable = "fma")]
unsafe fn products(a: &MatRef<'_>, b: &MatRef<'_>, c: &mut [f32], accumulate: bool) {
    let (n, k) = (b.cols(), a.cols());
    let (a_, b_) = (Operand::of(a), Operand::of(b));
    for (i, row) in c.chunks_exact_mut(n).enumerate() {
        for (j, out) in row.iter_mut().enumerate() {
            let mut sum = if accumulate { *out } else { 0.0 };
            for k0 in (0..k).step_by(KC) {
                let mut chain = 0.0f32;
                for p in k0..(k0 + KC).min(k) {
                    chain = a_.at(i, p).mul_add(b_.at(p, j), chain);
                }
                sum += chain;
            }
            *out = sum;
        }
    }
}
