//! Products too small for the blocked driver to pay for itself (a 2-2-1 net's, a 16-32-4 MLP's,
//! an RL policy's first layer): computed directly on the operands as they are (no packing, no
//! split, one thread), with the same arithmetic as the FMA micro-kernels, so that the result has
//! the same bits as the blocked run.
//!
//! The blocked driver's fixed cost (choosing a split, reaching the thread pool, packing tiles,
//! edge tiles) weighs on such products: with them here, the 16-32-4 step of `cargo run
//! --release --example bench_step_overhead` went from 1.46-1.47 to 1.36 of f32 (1.48-1.49 to
//! 1.36-1.38 with `-- --avx2`), 2-core Zen 5, `a6fa813` against `f166a5a`; products above the
//! bound gained nothing (a 64-128-128-8 policy's). Below [`TINY_WORK`] multiply-adds, and only
//! where the path would run an FMA chain (f32 or f16 operands on [`KernelPath::Avx2Fma`],
//! [`KernelPath::Avx512`] or [`KernelPath::Avx512Bf16`], f32 operands on
//! [`KernelPath::Avx512Fp16`]; every such CPU has AVX2 and FMA), the product runs here: for every
//! output element one FMA chain over each k block of [`KC`] values in order, added into `C`
//! (into `+0.0` when `C` is overwritten). That is what the AVX2 and AVX-512 kernels do; here
//! the chains of 4 rows and 16 columns run side by side in AVX2 registers, each lane its own
//! element's chain (the smallest products run their chains one after another instead, in
//! [`micro`](super::micro)). `tests.rs` compares both with the blocked kernels bit for bit.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m256i, _mm256_add_ps, _mm256_fmadd_ps, _mm256_maskload_ps, _mm256_maskstore_ps,
    _mm256_set1_ps, _mm256_setr_epi32, _mm256_setzero_ps,
};

use super::tile::KC;
use super::wide::{grown, prepared, with_wide};
use super::{KernelPath, MatRef};
use crate::FloatSlice;

/// Products of at most this many multiply-adds run here.
pub(crate) const TINY_WORK: usize = 32 * 1024;

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
    // SAFETY: every path above runs on a CPU with FMA (see below).
    if unsafe { super::micro::gemm(a, b, c, accumulate) } {
        return true;
    }
    with_wide(|[wa, wb, wt]| {
        let a = Strided {
            values: prepared(a, wa),
            rs: a.row_stride(),
            cs: a.col_stride(),
        };
        let b = rows_of(b, wb, wt);
        // SAFETY: every path above runs on a CPU with AVX2 and FMA (`Avx2Fma` by name; every
        // CPU with AVX-512 has both), and the caller checked that `path` runs on this CPU.
        unsafe { products(a, b, c, (m, n, k), accumulate) };
    });
    true
}

/// An operand's f32 values and strides.
#[derive(Clone, Copy)]
struct Strided<'a> {
    values: &'a [f32],
    rs: usize,
    cs: usize,
}

/// `B` with each row contiguous (`cs` 1): its values as they are (f16 widened into `wide`)
/// where its rows already are, else copied row by row into `rows` (a layer's `Wᵀ`).
fn rows_of<'s>(b: &MatRef<'s>, wide: &'s mut Vec<f32>, rows: &'s mut Vec<f32>) -> Strided<'s> {
    let values = prepared(b, wide);
    let (rs, cs) = (b.row_stride(), b.col_stride());
    if cs == 1 {
        return Strided { values, rs, cs };
    }
    let (k, n) = (b.rows(), b.cols());
    let out = grown(rows, k * n);
    for (p, line) in out.chunks_exact_mut(n).enumerate() {
        for (j, x) in line.iter_mut().enumerate() {
            *x = values[p * rs + j * cs];
        }
    }
    Strided {
        values: out,
        rs: n,
        cs: 1,
    }
}

/// Rows of `C` whose chains run side by side.
const MR: usize = 4;

/// The products of [`gemm`], in tiles of up to [`MR`] rows and 16 columns (`B`'s rows
/// contiguous).
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn products(
    a: Strided<'_>,
    b: Strided<'_>,
    c: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    let mut i = 0;
    while i < m {
        let rows = (m - i).min(MR);
        let mut j = 0;
        while j < n {
            let cols = (n - j).min(16);
            let at = Tile {
                i,
                j,
                cols,
                n,
                k,
                accumulate,
            };
            let f: unsafe fn(Strided<'_>, Strided<'_>, &mut [f32], Tile) = match (rows, cols > 8) {
                (4, true) => tile::<4, 2>,
                (4, false) => tile::<4, 1>,
                (3, true) => tile::<3, 2>,
                (3, false) => tile::<3, 1>,
                (2, true) => tile::<2, 2>,
                (2, false) => tile::<2, 1>,
                (_, true) => tile::<1, 2>,
                (_, false) => tile::<1, 1>,
            };
            // SAFETY: this function's own contract.
            unsafe { f(a, b, c, at) };
            j += cols;
        }
        i += rows;
    }
}

/// Where one tile of `C` lies: rows `i..i + R`, columns `j..j + cols` of `C`'s `n`.
#[derive(Clone, Copy)]
struct Tile {
    i: usize,
    j: usize,
    cols: usize,
    n: usize,
    k: usize,
    accumulate: bool,
}

/// The lanes of vector `v` (of 8) that lie among the tile's first `cols` columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn lanes(cols: usize, v: usize) -> __m256i {
    let left = cols.saturating_sub(8 * v).min(8);
    let on = |l: usize| if l < left { -1 } else { 0 };
    _mm256_setr_epi32(on(0), on(1), on(2), on(3), on(4), on(5), on(6), on(7))
}

/// One tile of `R` rows and `V` vectors of 8 columns: `C` (or `+0.0`) plus, for each k block,
/// its FMA chains.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const R: usize, const V: usize>(
    a: Strided<'_>,
    b: Strided<'_>,
    c: &mut [f32],
    t: Tile,
) {
    let mut mask = [lanes(t.cols, 0); V];
    for (v, m) in mask.iter_mut().enumerate() {
        *m = lanes(t.cols, v);
    }
    let mut sum = [[_mm256_setzero_ps(); V]; R];
    // Each slice below starts at the tile's first column of its row and holds every column the
    // tile reaches (checked by indexing); the masked loads and stores touch only those columns.
    if t.accumulate {
        for (r, row) in sum.iter_mut().enumerate() {
            let out = &c[(t.i + r) * t.n + t.j..][..t.cols];
            for (v, s) in row.iter_mut().enumerate() {
                // SAFETY: lanes of `mask[v]` are columns `8v..` of the tile, inside `out`.
                *s = unsafe { _mm256_maskload_ps(out.as_ptr().wrapping_add(8 * v), mask[v]) };
            }
        }
    }
    if t.k > 0 {
        // the last element of A and the last row of B the tile reads, checked once: the loop
        // below reads through pointers at or before them
        assert!((t.i + R - 1) * a.rs + (t.k - 1) * a.cs < a.values.len());
        assert!((t.k - 1) * b.rs + t.j + t.cols <= b.values.len());
    }
    for k0 in (0..t.k).step_by(KC) {
        let mut chain = [[_mm256_setzero_ps(); V]; R];
        let mut ap = a.values.as_ptr().wrapping_add(t.i * a.rs + k0 * a.cs);
        let mut bp = b.values.as_ptr().wrapping_add(k0 * b.rs + t.j);
        for _ in k0..(k0 + KC).min(t.k) {
            let mut bv = [_mm256_setzero_ps(); V];
            for (v, x) in bv.iter_mut().enumerate() {
                // SAFETY: row `p` of B from the tile's first column: its masked lanes are
                // columns inside the row checked above (`p < k`).
                *x = unsafe { _mm256_maskload_ps(bp.wrapping_add(8 * v), mask[v]) };
            }
            for (r, row) in chain.iter_mut().enumerate() {
                let at = ap.wrapping_add(r * a.rs);
                // SAFETY: A(i + r, p) with `r < R`, `p < k`: at or before the element checked
                // above.
                let av = _mm256_set1_ps(unsafe { *at });
                for (x, acc) in bv.iter().zip(row.iter_mut()) {
                    *acc = _mm256_fmadd_ps(av, *x, *acc);
                }
            }
            ap = ap.wrapping_add(a.cs);
            bp = bp.wrapping_add(b.rs);
        }
        for (row, ch) in sum.iter_mut().zip(&chain) {
            for (s, x) in row.iter_mut().zip(ch) {
                *s = _mm256_add_ps(*s, *x);
            }
        }
    }
    for (r, row) in sum.iter().enumerate() {
        let out = &mut c[(t.i + r) * t.n + t.j..][..t.cols];
        for (v, s) in row.iter().enumerate() {
            // SAFETY: as above, inside `out`.
            unsafe { _mm256_maskstore_ps(out.as_mut_ptr().wrapping_add(8 * v), mask[v], *s) };
        }
    }
}

/// Never called: no FMA path runs off x86-64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn products(
    a: Strided<'_>,
    b: Strided<'_>,
    c: &mut [f32],
    dims: (usize, usize, usize),
    accumulate: bool,
) {
    let _ = (a, b, c, dims, accumulate);
    unreachable!("FMA products on a non-x86 target")
}
