//! The AVX2+FMA f32 micro-kernel: 6 x 16 tile, 12 ymm accumulators, reading its operands through
//! strides, so that a tile of A or B can come straight from the caller's matrix instead of a
//! packed panel (see [`strided`](super::strided)).
//!
//! Every instance computes each output element the same way: one FMA chain over `p = 0..kc` in
//! order, then one add into `C` (into `+0.0` for the first k block of a product that overwrites
//! `C`, which is what zeroing `C` and adding gives). Where the values are read from never changes
//! a bit.

use super::caches;
use super::strided::{TileA, TileB, Tiles};

pub(crate) const MR: usize = caches::AVX2_TILE.0;
pub(crate) const NR: usize = caches::AVX2_TILE.1;

/// The kernel with the blocking of [`caches::avx2_blocking`]: `mc` and `nc` sized to this CPU's
/// caches, `kc` fixed (the k blocks decide where the roundings fall: see [`caches`]).
pub(crate) fn tiles() -> Tiles {
    let b = caches::avx2_blocking();
    debug_assert!(b.mc.is_multiple_of(MR) && b.nc.is_multiple_of(NR));
    Tiles {
        mr: MR,
        nr: NR,
        kc: b.kc,
        mc: b.mc,
        nc: b.nc,
        run: kernel,
    }
}

/// `C[6 x 16] (+)= A(6 x kc) · B(kc x 16)` with `A(i, p) = a.ptr[i * a.rs + p * a.cs]` and
/// `B(p, j) = b.ptr[p * b.rs + j]`; with `first`, `C = +0.0 + A·B` (the old values unread).
///
/// # Safety
/// The CPU must support AVX2 and FMA. `a` and `b` must be valid for reads of every element named
/// above for `i < 6`, `p < kc`, `j < 16`; `c` must be valid for reads and writes of 6 rows of 16
/// values at stride `ldc`, untouched by anyone else during the call.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel(kc: usize, a: TileA, b: TileB, c: *mut f32, ldc: usize, first: bool) {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_broadcast_ss, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps,
        _mm256_storeu_ps,
    };
    // The body, expanded once per layout the driver produces, with the strides that are
    // constants there written as literals so that the address arithmetic folds: A packed
    // (`rs = 1, cs = 6`), A with k contiguous (`cs = 1`), A with rows contiguous (`rs = 1`); B
    // packed (`rs = 16`) or rows of the caller's matrix. Addresses are computed with
    // `wrapping_add` (safe); only the reads and writes through them are `unsafe`, each inside the
    // ranges the caller guarantees.
    macro_rules! body {
        ($ars:expr, $acs:expr, $brs:expr) => {{
            let (ars, acs, brs): (usize, usize, usize) = ($ars, $acs, $brs);
            let mut acc = [[_mm256_setzero_ps(); 2]; MR];
            let mut ap = a.ptr;
            let mut bp = b.ptr;
            // one step of k: two loads of B, a broadcast of each row of A, 12 FMAs
            macro_rules! step {
                ($q:expr) => {{
                    let (aq, bq) = (ap.wrapping_add($q * acs), bp.wrapping_add($q * brs));
                    // SAFETY: B(p, 0..8) for this p < kc: readable by the caller's contract.
                    let b0 = unsafe { _mm256_loadu_ps(bq) };
                    // SAFETY: B(p, 8..16), as above.
                    let b1 = unsafe { _mm256_loadu_ps(bq.wrapping_add(8)) };
                    for (i, row) in acc.iter_mut().enumerate() {
                        // SAFETY: A(i, p) for i < MR, this p < kc: readable by the contract.
                        let av = _mm256_broadcast_ss(unsafe { &*aq.wrapping_add(i * ars) });
                        row[0] = _mm256_fmadd_ps(av, b0, row[0]);
                        row[1] = _mm256_fmadd_ps(av, b1, row[1]);
                    }
                }};
            }
            for _ in 0..kc / 4 {
                step!(0);
                step!(1);
                step!(2);
                step!(3);
                ap = ap.wrapping_add(4 * acs);
                bp = bp.wrapping_add(4 * brs);
            }
            for _ in 0..kc % 4 {
                step!(0);
                ap = ap.wrapping_add(acs);
                bp = bp.wrapping_add(brs);
            }
            for (i, row) in acc.iter().enumerate() {
                for (h, v) in row.iter().enumerate() {
                    let dst = c.wrapping_add(i * ldc + h * 8);
                    let old = if first {
                        _mm256_setzero_ps()
                    } else {
                        // SAFETY: C(i, 8h..8h + 8) of the tile the caller lends us.
                        unsafe { _mm256_loadu_ps(dst) }
                    };
                    let sum = _mm256_add_ps(old, *v);
                    // SAFETY: as above; no one else accesses the tile during the call.
                    unsafe { _mm256_storeu_ps(dst, sum) };
                }
            }
        }};
    }
    match (a.rs, a.cs, b.rs) {
        (1, MR, NR) => body!(1, MR, NR),
        (1, MR, brs) => body!(1, MR, brs),
        (rs, 1, NR) => body!(rs, 1, NR),
        (rs, 1, brs) => body!(rs, 1, brs),
        (1, cs, NR) => body!(1, cs, NR),
        (1, cs, brs) => body!(1, cs, brs),
        (rs, cs, brs) => body!(rs, cs, brs),
    }
}

/// Never called: [`KernelPath::Avx2Fma`](super::KernelPath) is unsupported off x86-64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(kc: usize, a: TileA, b: TileB, c: *mut f32, ldc: usize, first: bool) {
    let _ = (kc, a, b, c, ldc, first);
    unreachable!("AVX2 kernel on a non-x86 target")
}
