//! The f32 block loop for a micro-kernel that reads its operands through strides
//! ([`KernelPath::Avx2Fma`](super::KernelPath)): each tile of A or B comes from a packed panel or,
//! where packing would not pay, straight from the caller's matrix.
//!
//! Packing copies a block of an operand so that the micro-kernel reads it contiguously, many
//! times. A block read only a few times (A when the product has few columns, B when it has few
//! rows) or small enough to stay in cache is cheaper to read where it is: a thin product
//! (`n = 10`) then skips copying the whole of A, and a small one skips most of its copies.
//! Tiles that reach past the matrix's edge are still packed (zero-padded), one at a time.
//!
//! The micro-kernel computes every output element the same way whatever it reads from, so the
//! choice never changes a bit of the result (the tests compare the choices bit for bit). The first
//! k block of a product that overwrites `C` stores `+0.0 + sum` without reading `C`, which is
//! what zeroing `C` first and adding gives, without the zeroing pass.

use std::cell::Cell;

use super::pack::{Src, pack_a, pack_b};
use super::tile::{Buffers, Out};

/// Where a micro-kernel reads A's `mr x kc` tile: `A(i, p) = ptr[i * rs + p * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct TileA {
    pub(crate) ptr: *const f32,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

/// Where a micro-kernel reads B's `kc x nr` tile: `B(p, j) = ptr[p * rs + j]`.
#[derive(Clone, Copy)]
pub(crate) struct TileB {
    pub(crate) ptr: *const f32,
    pub(crate) rs: usize,
}

/// A strided micro-kernel: `C[mr x nr] += A·B` (`C = +0.0 + A·B` with the last argument), `C` with
/// row stride `ldc`.
///
/// # Safety (for callers)
/// The path's CPU features must be present; every element of the two tiles must be readable, and
/// `c` valid for reads and writes of `mr` rows of `nr` values at stride `ldc`, with no other access
/// to those values during the call.
pub(crate) type TileFn = unsafe fn(usize, TileA, TileB, *mut f32, usize, bool);

/// A strided micro-kernel and its blocking.
pub(crate) struct Tiles {
    pub(crate) mr: usize,
    pub(crate) nr: usize,
    pub(crate) kc: usize,
    pub(crate) mc: usize,
    pub(crate) nc: usize,
    pub(crate) run: TileFn,
}

/// Whether operands are packed: chosen per block ([`Packing::Auto`]), or forced by tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Packing {
    /// Read a block in place when it is used few times or is small (see [`block`]).
    Auto,
    /// Pack every block (the classic loop).
    #[cfg_attr(not(test), allow(dead_code, reason = "forced by the tests"))]
    Always,
    /// Read every block in place whose layout allows it.
    #[cfg_attr(not(test), allow(dead_code, reason = "forced by the tests"))]
    Never,
}

thread_local! {
    static PACKING: Cell<Packing> = const { Cell::new(Packing::Auto) };
}

/// Runs `f` with the packing of strided GEMMs on this thread forced to `p` (helper threads of a
/// split product follow the caller's choice: it is read once per product).
#[cfg(test)]
pub(crate) fn with_packing<R>(p: Packing, f: impl FnOnce() -> R) -> R {
    struct Restore(Packing);
    impl Drop for Restore {
        fn drop(&mut self) {
            PACKING.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(PACKING.with(|c| c.replace(p)));
    f()
}

/// The packing policy of this thread.
pub(crate) fn packing() -> Packing {
    PACKING.with(Cell::get)
}

/// A is read in place when one of its blocks is used by at most this many column panels of B.
const A_IN_PLACE_MAX_USES: usize = 4;
/// B is read in place when one of its panels is used by at most this many row tiles of A.
const B_IN_PLACE_MAX_USES: usize = 8;
/// B is read in place only when its rows are at most this many values apart (1 KiB): reading
/// one row of 16 values per k step at a stride of a page or more misses the cache on every step
/// (the prefetchers stop at page boundaries and the rows share a cache set), so wider B is packed.
const B_IN_PLACE_MAX_STRIDE: usize = 256;
/// A block of at most this many values is read in place whatever its uses (it stays in L1).
const IN_PLACE_SMALL: usize = 4096;

/// Makes `v` at least `n` long (the values are stale: the packing overwrites what it uses).
fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

/// One block of `C` (rows `r0..r1`, columns `c0..c1`, both starting on a micro-tile boundary)
/// over the whole inner dimension, in the BLIS loop order: k blocks, column blocks (B), row
/// blocks (A), micro-tiles. With `zero`, the block of `C` is overwritten.
#[allow(clippy::too_many_arguments)]
pub(crate) fn block(
    t: &Tiles,
    kd: usize,
    a: Src<'_, f32>,
    b: Src<'_, f32>,
    (out, zero): (Out, bool),
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
    buf: &mut Buffers<f32>,
    packing: Packing,
) {
    let (mr, nr) = (t.mr, t.nr);
    // grown, never shrunk: the packed driver shares these buffers, and a shrink here made its
    // next product grow (and zero) megabytes again
    // (only as much as this block uses: a cache-sized nc of B can reach 4 MiB)
    let kc_max = t.kc.min(kd);
    grow(&mut buf.a, t.mc.min(r1 - r0).div_ceil(mr) * mr * kc_max);
    grow(&mut buf.b, t.nc.min(c1 - c0).div_ceil(nr) * nr * kc_max);
    // edge tiles: -0.0 is the additive identity, so `C += tmp` adds exactly what a full tile adds
    let mut tmp = [-0.0f32; MAX_TILE];
    let tmp = &mut tmp[..mr * nr];
    let row_tiles = (r1 - r0).div_ceil(mr);
    for pc in (0..kd).step_by(t.kc) {
        let kc = t.kc.min(kd - pc);
        let first = zero && pc == 0;
        for jc in (c0..c1).step_by(t.nc) {
            let nc = t.nc.min(c1 - jc);
            let b_in_place = b.cs == 1
                && match packing {
                    Packing::Auto if b.rs > B_IN_PLACE_MAX_STRIDE => false,
                    Packing::Auto => row_tiles <= B_IN_PLACE_MAX_USES || kc * nc <= IN_PLACE_SMALL,
                    Packing::Always => false,
                    Packing::Never => true,
                };
            if !b_in_place {
                pack_b(&mut buf.b, b, (pc, kc), (jc, nc), nr);
            } else if !nc.is_multiple_of(nr) {
                // the edge panel alone, zero-padded
                let col = jc + nc - nc % nr;
                grow(&mut buf.edge_b, nr * kc);
                pack_b(&mut buf.edge_b, b, (pc, kc), (col, nc % nr), nr);
            }
            for ic in (r0..r1).step_by(t.mc) {
                let mc = t.mc.min(r1 - ic);
                let a_in_place = (a.cs == 1 || a.rs == 1)
                    && match packing {
                        Packing::Auto => {
                            nc.div_ceil(nr) <= A_IN_PLACE_MAX_USES || mc * kc <= IN_PLACE_SMALL
                        }
                        Packing::Always => false,
                        Packing::Never => true,
                    };
                if !a_in_place {
                    pack_a(&mut buf.a, a, (ic, mc), (pc, kc), mr);
                } else if !mc.is_multiple_of(mr) {
                    // the edge tile alone, zero-padded
                    let row = ic + mc - mc % mr;
                    grow(&mut buf.edge_a, mr * kc);
                    pack_a(&mut buf.edge_a, a, (row, mc % mr), (pc, kc), mr);
                }
                for jp in 0..nc.div_ceil(nr) {
                    let (col, cols) = (jc + jp * nr, nr.min(nc - jp * nr));
                    let bt = if !b_in_place {
                        packed_b(&buf.b[jp * nr * kc..(jp + 1) * nr * kc], nr)
                    } else if cols < nr {
                        packed_b(&buf.edge_b[..nr * kc], nr)
                    } else {
                        in_place_b(b, pc, kc, col, nr)
                    };
                    for ip in 0..mc.div_ceil(mr) {
                        let (row, rows) = (ic + ip * mr, mr.min(mc - ip * mr));
                        let at = if !a_in_place {
                            packed_a(&buf.a[ip * mr * kc..(ip + 1) * mr * kc], mr)
                        } else if rows < mr {
                            packed_a(&buf.edge_a[..mr * kc], mr)
                        } else {
                            in_place_a(a, row, mr, pc, kc)
                        };
                        run_tile(t, kc, (at, bt), (out, first), (row, rows), (col, cols), tmp);
                    }
                }
            }
        }
    }
}

/// Runs the micro-kernel on one tile of `C` (`rows x cols` at `(row, col)`), through `tmp` when
/// the tile reaches past `C`'s edge.
fn run_tile(
    t: &Tiles,
    kc: usize,
    (at, bt): (TileA, TileB),
    (out, first): (Out, bool),
    (row, rows): (usize, usize),
    (col, cols): (usize, usize),
    tmp: &mut [f32],
) {
    let (mr, nr) = (t.mr, t.nr);
    if rows == mr && cols == nr {
        let ct = out.tile(row, col, mr, nr);
        // SAFETY: `t` is built only after `check` accepted its path; the operand tiles are
        // readable (`packed_*` and `in_place_*` check them); the C tile lies inside C
        // (`Out::tile` asserts it) and inside this thread's block, which no other thread touches.
        unsafe { (t.run)(kc, at, bt, ct, out.ld, first) };
    } else {
        tmp.fill(-0.0);
        // SAFETY: as above; `tmp` holds mr x nr values with row stride nr.
        unsafe { (t.run)(kc, at, bt, tmp.as_mut_ptr(), nr, false) };
        for (r, src) in tmp.chunks_exact(nr).take(rows).enumerate() {
            // SAFETY: row `row + r`, columns `col..col + cols` lie in this thread's block; no
            // other reference to them is alive.
            let dst = unsafe { out.segment(row + r, col, cols) };
            if first {
                dst.iter_mut().zip(src).for_each(|(d, s)| *d = 0.0 + *s);
            } else {
                dst.iter_mut().zip(src).for_each(|(d, s)| *d += *s);
            }
        }
    }
}

/// A packed A tile (`mr` rows, k-major): `rs = 1, cs = mr`.
fn packed_a(panel: &[f32], mr: usize) -> TileA {
    assert!(!panel.is_empty() && panel.len().is_multiple_of(mr));
    TileA {
        ptr: panel.as_ptr(),
        rs: 1,
        cs: mr,
    }
}

/// A packed B panel (`nr` columns, k-major): `rs = nr`.
fn packed_b(panel: &[f32], nr: usize) -> TileB {
    assert!(!panel.is_empty() && panel.len().is_multiple_of(nr));
    TileB {
        ptr: panel.as_ptr(),
        rs: nr,
    }
}

/// Rows `row..row + mr`, columns `pc..pc + kc` of A where they are, checked to lie inside it.
fn in_place_a(a: Src<'_, f32>, row: usize, mr: usize, pc: usize, kc: usize) -> TileA {
    let start = row * a.rs + pc * a.cs;
    assert!(start + (mr - 1) * a.rs + (kc - 1) * a.cs < a.data.len());
    TileA {
        ptr: a.data[start..].as_ptr(),
        rs: a.rs,
        cs: a.cs,
    }
}

/// Rows `pc..pc + kc`, columns `col..col + nr` of B (`cs = 1`) where they are, checked to lie
/// inside it.
fn in_place_b(b: Src<'_, f32>, pc: usize, kc: usize, col: usize, nr: usize) -> TileB {
    let start = pc * b.rs + col;
    assert!(b.cs == 1 && start + (kc - 1) * b.rs + nr - 1 < b.data.len());
    TileB {
        ptr: b.data[start..].as_ptr(),
        rs: b.rs,
    }
}

/// The largest micro-tile of a strided kernel (6 x 16, AVX2).
const MAX_TILE: usize = 6 * 16;
