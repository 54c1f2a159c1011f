//! The smallest products (a 2-2-1 net's, at batch 4): at most [`MICRO_WORK`] multiply-adds, whose
//! few FMA chains cost less one after another in scalar registers, reading the operands in place,
//! than the set-up of [`tiny`](super::tiny)'s tiles (the f32 copies of the operands, `B`'s rows,
//! the lane masks): 2.5K fewer instructions per mixed 2-2-1 step, of about 60K, counted by
//! `valgrind --tool=callgrind target/release/examples/bench_step_overhead --profile xor` at
//! `b630144` against the same build with [`MICRO_WORK`] at 0. For each element of `C`, in turn,
//! its FMA chain (one k block of [`KC`]: `k` is at most [`MICRO_WORK`]) added into `C` (into
//! `+0.0` when `C` is overwritten): the same arithmetic, in the same order, as the tiles' lanes
//! and the blocked kernels, so the same bits (`tests.rs` compares them).

use super::MatRef;
use super::tile::KC;
use crate::FloatSlice;

/// Products of at most this many multiply-adds run here.
const MICRO_WORK: usize = 256;

/// Runs `C (+)= A·B` here when the product has at most [`MICRO_WORK`] multiply-adds, both
/// operands are read as they are (f32 or f16) and the CPU has F16C; `false` (nothing written)
/// otherwise. The caller has checked the shapes.
///
/// # Safety
/// The CPU must have FMA.
pub(crate) unsafe fn gemm(a: &MatRef<'_>, b: &MatRef<'_>, c: &mut [f32], accumulate: bool) -> bool {
    let (m, n, k) = (a.rows(), b.cols(), a.cols());
    // the chains are compiled with F16C (one instruction to widen an f16 value), so they run
    // only where the CPU has it, whatever the operands
    if m.saturating_mul(n).saturating_mul(k) > MICRO_WORK || !crate::convert::has_f16c() {
        return false;
    }
    let (Some(av), Some(bv)) = (Scalar::of(a.values()), Scalar::of(b.values())) else {
        return false;
    };
    let a = (av, a.row_stride(), a.col_stride());
    let b = (bv, b.row_stride(), b.col_stride());
    // SAFETY: the caller's FMA; F16C checked above.
    unsafe { micro(a, b, c, (m, n, k), accumulate) };
    true
}

/// An operand read as it is, value by value (f16 widened exactly).
#[derive(Clone, Copy)]
enum Scalar<'a> {
    F32(&'a [f32]),
    F16(&'a [half::f16]),
}

impl<'a> Scalar<'a> {
    /// The operands an FMA chain reads as they are (emulated bf16 is rounded while packing).
    fn of(v: FloatSlice<'a>) -> Option<Self> {
        match v {
            FloatSlice::F32(x) => Some(Self::F32(x)),
            FloatSlice::F16(x) => Some(Self::F16(x)),
            FloatSlice::Bf16(_) => None,
        }
    }
}

/// An operand of [`micro`], read element by element as f32.
trait Read: Copy {
    fn len(self) -> usize;
    /// # Safety
    /// `i < self.len()`, and the CPU must have F16C.
    unsafe fn at(self, i: usize) -> f32;
}

impl Read for &[f32] {
    fn len(self) -> usize {
        <[f32]>::len(self)
    }
    #[inline(always)]
    unsafe fn at(self, i: usize) -> f32 {
        // SAFETY: the caller's bound.
        unsafe { *self.get_unchecked(i) }
    }
}

impl Read for &[half::f16] {
    fn len(self) -> usize {
        <[half::f16]>::len(self)
    }
    #[inline(always)]
    unsafe fn at(self, i: usize) -> f32 {
        // SAFETY: the caller's bound.
        let x = unsafe { *self.get_unchecked(i) };
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's F16C.
        unsafe {
            crate::convert::x86::widen_one(x)
        }
        #[cfg(not(target_arch = "x86_64"))]
        x.to_f32()
    }
}

/// The product, one element's chain after another (see the module's doc). Operands as
/// `(values, row stride, column stride)`.
///
/// # Safety
/// The CPU must have FMA and F16C.
unsafe fn micro(
    (a, ars, acs): (Scalar<'_>, usize, usize),
    (b, brs, bcs): (Scalar<'_>, usize, usize),
    c: &mut [f32],
    dims: (usize, usize, usize),
    accumulate: bool,
) {
    use Scalar::{F16, F32};
    let (sa, sb) = ((ars, acs), (brs, bcs));
    // Each arm: the caller's FMA and F16C.
    match (a, b) {
        // SAFETY: as above.
        (F32(a), F32(b)) => unsafe { chains((a, sa), (b, sb), c, dims, accumulate) },
        // SAFETY: as above.
        (F32(a), F16(b)) => unsafe { chains((a, sa), (b, sb), c, dims, accumulate) },
        // SAFETY: as above.
        (F16(a), F32(b)) => unsafe { chains((a, sa), (b, sb), c, dims, accumulate) },
        // SAFETY: as above.
        (F16(a), F16(b)) => unsafe { chains((a, sa), (b, sb), c, dims, accumulate) },
    }
}

/// [`micro`] for one pair of operand types.
///
/// # Safety
/// The CPU must have FMA and F16C.
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "fma,f16c"))]
unsafe fn chains<A: Read, B: Read>(
    (a, (ars, acs)): (A, (usize, usize)),
    (b, (brs, bcs)): (B, (usize, usize)),
    c: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    const { assert!(MICRO_WORK <= KC) };
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    // the last element of A and of B read, checked once: every index below is at or before it
    assert!((m - 1) * ars + (k - 1) * acs < a.len() && (k - 1) * brs + (n - 1) * bcs < b.len());
    for (i, row) in c.chunks_exact_mut(n).take(m).enumerate() {
        for (j, out) in row.iter_mut().enumerate() {
            let mut chain = 0.0f32;
            for p in 0..k {
                // SAFETY: `i < m`, `p < k`: within the bound checked above; this function's F16C.
                let x = unsafe { a.at(i * ars + p * acs) };
                // SAFETY: `p < k`, `j < n`: as above.
                let y = unsafe { b.at(p * brs + j * bcs) };
                chain = x.mul_add(y, chain);
            }
            *out = if accumulate { *out } else { 0.0 } + chain;
        }
    }
}
