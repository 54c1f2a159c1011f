//! The blocked GEMM driver: operand preparation (f16 widened while packing on the AVX-512
//! kernels, and into a whole f32 copy for the AVX2 and portable ones; bf16 rounding), the loops around a
//! micro-kernel, and the split of large products over threads. Packing lives in
//! [`pack`](super::pack), the block loop of the strided AVX2 kernel (operands read in place or
//! packed) in [`strided`]; the micro-kernels are the only `unsafe` calls, plus the shared view of
//! the output that lets threads write disjoint blocks of it.
//!
//! # Threads
//! A product of at least [`PAR_MIN_WORK`] multiply-adds is cut into a grid of blocks of `C`
//! (whole micro-tiles, see [`Grid`]), which the calling thread and up to [`max_threads`]` - 1`
//! helper threads of a persistent [pool](super::pool) claim one at a time from an atomic
//! counter, so a thread slowed by a busy neighbour simply takes fewer blocks. Before the blocks,
//! the same threads pack A and B once, in small numbered tasks, into the calling thread's
//! buffers, which every block then reads (`packs.rs`): a block no longer packs its own rows of A
//! and columns of B, which packed each operand about twice on two threads. A product whose
//! packed operands would pass [`PACK_VALUES`] is packed and computed in groups of whole k blocks,
//! one after the other. Each block runs the same k blocks in the same order on the same panels
//! with the same micro-tile grid as the one-thread run, so every output element sees the same
//! operations: results are bit-identical for any thread count.
//!
//! Measured on the 9 products of the MLP step (a 2-core Zen 5 EPYC, 2 threads, medians of 8
//! interleaved runs of 15 rounds): 7.68 -> 7.11 ms in f32 on [`KernelPath::Avx512`], 7.44 ->
//! 6.72 ms with f16 operands, 6.39 -> 4.77 ms in bf16 on [`KernelPath::Avx512Bf16`]; with the
//! other core busy compiling, 14.3 -> 12.4 ms in f32 and 12.0 -> 8.7 ms in bf16.

use std::cell::RefCell;

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use super::mat::MatRef;
use super::pack::{Src, pack_a, pack_b};
use super::packs::{PackView, Packs, Part, pack_staged};
use super::strided::{self, Tiles};
use super::threads::max_threads;
use super::tile::{Micro, Out, Packed, Prologue, split, threads_for};
use super::wide::{prepared, with_wide};
use super::{KernelError, KernelPath, avx2, avx512, bf16, fp16, portable, tiny, transpose};
use crate::FloatSlice;

/// [`gemm`](super::path::gemm) on an explicit path.
///
/// # Errors
/// As [`gemm`](super::path::gemm), and [`KernelError::Unsupported`] if this CPU lacks the path.
///
/// # Examples
/// ```
/// use mpx_kernels::{KernelPath, MatRef, gemm_on};
/// let a = MatRef::row_major_f32(&[1.0, 2.0, 3.0, 4.0], 2, 2)?;
/// let mut c = [0.0f32; 4];
/// gemm_on(KernelPath::Portable, a, a.t(), &mut c, false)?; // A·Aᵀ
/// assert_eq!(c, [5.0, 11.0, 11.0, 25.0]);
/// # Ok::<(), mpx_kernels::KernelError>(())
/// ```
pub fn gemm_on<'a>(
    path: KernelPath,
    a: MatRef<'a>,
    b: MatRef<'a>,
    c: &mut [f32],
    accumulate: bool,
) -> Result<(), KernelError> {
    gemm_threads(path, a, b, c, accumulate, max_threads())
}

/// [`gemm_on`] on at most `threads` threads (not capped: tests use more threads than cores to
/// check that the split never changes a bit).
pub(crate) fn gemm_threads<'a>(
    path: KernelPath,
    a: MatRef<'a>,
    b: MatRef<'a>,
    c: &mut [f32],
    accumulate: bool,
    threads: usize,
) -> Result<(), KernelError> {
    check(path, &a, &b, c)?;
    let (m, n, k) = (a.rows(), b.cols(), a.cols());
    if m == 0 || n == 0 || k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return Ok(());
    }
    if tiny::gemm(path, &a, &b, c, accumulate) {
        return Ok(());
    }
    if transposes(path, &a, &b) {
        transposed(path, (a, b), (c, accumulate), threads);
        return Ok(());
    }
    blocked(path, (a, b), (c, accumulate), threads);
    Ok(())
}

/// Whether a product runs as its transpose on `path` ([`transposed`]): its `n` columns would fill
/// the micro-kernel's tile (`mr x nr`) far less than its `m` rows do (a 64 x 4 product fills a
/// quarter of each 6 x 16 tile; its 4 x 64 transpose two thirds). Only the f32 FMA kernels, for
/// f32 and f16 operands, whose elements are each one chain of multiply-adds over `k` whichever
/// operand the kernel reads across.
pub(crate) fn transposes(path: KernelPath, a: &MatRef<'_>, b: &MatRef<'_>) -> bool {
    let (mr, nr) = match path {
        KernelPath::Avx2Fma => (avx2::MR, avx2::NR),
        KernelPath::Avx512 => (avx512::MR, avx512::NR),
        KernelPath::Portable => (portable::MR, portable::NR),
        KernelPath::Avx512Fp16 | KernelPath::Avx512Bf16 => return false,
    };
    if matches!(a.values(), FloatSlice::Bf16(_)) || matches!(b.values(), FloatSlice::Bf16(_)) {
        return false;
    }
    let (m, n) = (a.rows(), b.cols());
    let padded = |x: usize, r: usize| x.div_ceil(r) * r;
    // the tiles' work as written, and as the transpose, which must save a third of it (the
    // transposed A is packed, and the output copied back)
    let written = padded(m, mr) * padded(n, nr);
    let flipped = padded(n, mr) * padded(m, nr);
    2 * written > 3 * flipped
}

/// `C (+)= A·B` computed as `Cᵀ (+)= Bᵀ·Aᵀ` into a buffer, then copied into `C`: each element of
/// `Cᵀ` is the same chain of multiply-adds over `k` as the element of `C` (the tests compare
/// the bits), on the rows of `Cᵀ` (`C`'s few columns) down the tile and its columns across.
fn transposed(
    path: KernelPath,
    (a, b): (MatRef<'_>, MatRef<'_>),
    (c, accumulate): (&mut [f32], bool),
    threads: usize,
) {
    let (m, n) = (a.rows(), b.cols());
    let mut ct = vec![0.0f32; m * n];
    if accumulate {
        for (i, row) in c.chunks_exact(n).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                ct[j * m + i] = v;
            }
        }
    }
    blocked(path, (b.t(), a.t()), (&mut ct, accumulate), threads);
    for (i, row) in c.chunks_exact_mut(n).enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            *v = ct[j * m + i];
        }
    }
}

/// The blocked product of [`gemm_threads`] (checked, not empty), whatever its size.
pub(crate) fn blocked<'a>(
    path: KernelPath,
    (a, b): (MatRef<'a>, MatRef<'a>),
    (c, accumulate): (&mut [f32], bool),
    threads: usize,
) {
    let (m, n, k) = (a.rows(), b.cols(), a.cols());
    // each block zeroes its own part of C first (on its thread, just before using it)
    let zero = !accumulate;
    if let (KernelPath::Avx512Fp16, FloatSlice::F16(av), FloatSlice::F16(bv)) =
        (path, a.values(), b.values())
    {
        let bits = |v: &'a [f16]| -> &'a [u16] { v.reinterpret_cast() };
        let a = Src {
            data: bits(av),
            rs: a.row_stride(),
            cs: a.col_stride(),
        };
        let b = Src {
            data: bits(bv),
            rs: b.row_stride(),
            cs: b.col_stride(),
        };
        run(&fp16::micro(), (m, n, k), a, b, (c, zero), threads);
        return;
    }
    if let (KernelPath::Avx512Bf16, FloatSlice::Bf16(av), FloatSlice::Bf16(bv)) =
        (path, a.values(), b.values())
    {
        // read in place: the values are rounded to bf16 while packing
        let a = Src {
            data: av,
            rs: a.row_stride(),
            cs: a.col_stride(),
        };
        let b = Src {
            data: bv,
            rs: b.row_stride(),
            cs: b.col_stride(),
        };
        let pack = |dst: &mut [u32], part| bf16::pack(dst, a, b, part);
        run_packed(&bf16::micro(), 2, (m, n, k), &pack, (c, zero), threads);
        return;
    }
    let dims = (m, n, k);
    if matches!(
        path,
        KernelPath::Avx512Fp16 | KernelPath::Avx512Bf16 | KernelPath::Avx512
    ) && let (FloatSlice::F16(av), FloatSlice::F16(bv)) = (a.values(), b.values())
    {
        // f16 operands on the f32 kernel: widened while packing, read in place
        let bits = |v: &'a [f16]| -> &'a [u16] { v.reinterpret_cast() };
        let (a, b) = (
            Src {
                data: bits(av),
                rs: a.row_stride(),
                cs: a.col_stride(),
            },
            Src {
                data: bits(bv),
                rs: b.row_stride(),
                cs: b.col_stride(),
            },
        );
        let pack = |dst: &mut [f32], part| pack_widened(dst, a, b, part);
        run_packed(&avx512::micro(), 1, dims, &pack, (c, zero), threads);
        return;
    }
    with_wide(|[wa, wb, _]| {
        let a = Src {
            data: prepared(&a, wa),
            rs: a.row_stride(),
            cs: a.col_stride(),
        };
        let b = Src {
            data: prepared(&b, wb),
            rs: b.row_stride(),
            cs: b.col_stride(),
        };
        match path {
            KernelPath::Avx512Fp16 | KernelPath::Avx512Bf16 | KernelPath::Avx512 => {
                run(&avx512::micro(), dims, a, b, (c, zero), threads);
            }
            KernelPath::Avx2Fma => run_strided(&avx2::tiles(), dims, a, b, (c, zero), threads),
            KernelPath::Portable => run(&portable::micro(), dims, a, b, (c, zero), threads),
        }
    });
}

/// Checks that the path runs here and the shapes fit: `A.cols == B.rows`, both views inside
/// their slices, `C` holding `m x n` values. Every size is computed with checked arithmetic, so
/// no shape wraps around into one that fits.
fn check(path: KernelPath, a: &MatRef<'_>, b: &MatRef<'_>, c: &[f32]) -> Result<(), KernelError> {
    if !path.is_supported() {
        return Err(KernelError::Unsupported {
            path,
            supported: KernelPath::supported(),
        });
    }
    if a.cols() != b.rows() {
        return Err(KernelError::InnerMismatch {
            a_rows: a.rows(),
            a_cols: a.cols(),
            b_rows: b.rows(),
            b_cols: b.cols(),
        });
    }
    // the views are valid by construction; checked again, as cheaply, where the kernels rely on it
    a.validate("A")?;
    b.validate("B")?;
    if a.rows().checked_mul(b.cols()) != Some(c.len()) {
        return Err(KernelError::OutputLength {
            m: a.rows(),
            n: b.cols(),
            len: c.len(),
        });
    }
    Ok(())
}

thread_local! {
    /// One packed part of an f16 operand, before it is widened (per thread).
    static STAGE_F16: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
}

/// Packs `part` of `a` or `b` (f16 bits) for the AVX-512 f32 kernel, without widening the whole
/// operand beforehand. Full panels of an operand stored with k contiguous (`X` as A, `Wᵀ` as B)
/// are transposed and widened in one pass ([`transpose::lines`]). The other panels (lines
/// contiguous, where the f16 copy is as fast; a last, partial panel) are packed as f16 first,
/// then widened in one SIMD pass: the layout is the same either way.
pub(super) fn pack_widened(dst: &mut [f32], a: Src<'_, u16>, b: Src<'_, u16>, part: Part) {
    // B's columns are the lines of its panels, as A's rows are (see `pack_b`)
    let (src, (l0, lines), (pc, kc), width) = match part {
        Part::A(rows, ks) => (a, rows, ks, avx512::MR),
        Part::B(ks, cols) => (
            Src {
                data: b.data,
                rs: b.cs,
                cs: b.rs,
            },
            cols,
            ks,
            avx512::NR,
        ),
    };
    // full panels in one pass where k is contiguous and the CPU has the transpose
    let mut done = 0;
    let full = if src.cs == 1 { lines / width } else { 0 };
    while done < full {
        let panel = &mut dst[done * width * kc..(done + 1) * width * kc];
        let at = (l0 + done * width, width);
        if !transpose::lines(panel, src.data, at, (pc, kc), src.rs) {
            break;
        }
        done += 1;
    }
    if done * width == lines {
        return;
    }
    let rest = (l0 + done * width, lines - done * width);
    let part = match part {
        Part::A(_, ks) => Part::A(rest, ks),
        Part::B(ks, _) => Part::B(ks, rest),
    };
    pack_staged(
        &STAGE_F16,
        (a, b),
        part,
        (avx512::MR, avx512::NR),
        |packed, _, _| {
            let halves: &[f16] = packed.reinterpret_cast();
            let dst = &mut dst[done * width * kc..];
            crate::convert::widen_f16(halves, &mut dst[..halves.len()]);
        },
    );
}

/// Runs the product on up to `threads` threads, packing the operands' values as they are
/// ([`run_packed`]).
fn run<T: Packed + Send + Sync>(
    k: &Micro<T>,
    dims: (usize, usize, usize),
    a: Src<'_, T>,
    b: Src<'_, T>,
    c: (&mut [f32], bool),
    threads: usize,
) {
    let pack = |dst: &mut [T], part| match part {
        Part::A(rows, ks) => pack_a(dst, a, rows, ks, k.mr),
        Part::B(ks, cols) => pack_b(dst, b, ks, cols, k.nr),
    };
    run_packed(k, 1, dims, &pack, c, threads);
}

/// Runs the product on up to `threads` threads: for each [group](k_group) of k blocks, the calling
/// thread and helpers of the [pool](super::pool) first pack that part of A and B once into the
/// caller's buffers with `pack` (tasks of rows of A and columns of B, `per` values of k to an
/// element, see [`Packs`]), then claim blocks of the [`Grid`](super::tile::Grid), which read the
/// shared panels.
fn run_packed<S: Packed + Send + Sync>(
    k: &Micro<S>,
    per: usize,
    (m, n, kd): (usize, usize, usize),
    pack: &(dyn Fn(&mut [S], Part) + Sync),
    (c, zero): (&mut [f32], bool),
    threads: usize,
) {
    let threads = threads_for((m, n, kd), threads);
    let (mp, np) = (m.next_multiple_of(k.mr), n.next_multiple_of(k.nr));
    let group = k_group(k.kc, (mp + np).div_ceil(per), kd);
    S::with_buffers(|buf| {
        // grown, never shrunk: products of other sizes do not zero the buffers again each call
        let (la, lb) = (
            Packs::<S>::len(mp, group, per),
            Packs::<S>::len(np, group, per),
        );
        if buf.a.len() < la {
            buf.a.resize(la, S::default());
        }
        if buf.b.len() < lb {
            buf.b.resize(lb, S::default());
        }
        for k0 in (0..kd).step_by(group) {
            let packs = Packs {
                kc: k.kc,
                ks: (k0, (k0 + group).min(kd)),
                piece: (
                    PACK_LINES.next_multiple_of(k.mr),
                    PACK_LINES.next_multiple_of(k.nr),
                ),
                mr: k.mr,
                nr: k.nr,
                per,
                mn: (m, n),
                view: (
                    PackView::new(&mut buf.a[..la]),
                    PackView::new(&mut buf.b[..lb]),
                ),
            };
            let pre = Prologue {
                tasks: packs.tasks(),
                run: &|t| packs.pack(t, pack),
            };
            let zero = zero && k0 == 0;
            split((m, n), (k.mr, k.nr), c, threads, pre, &|out, rows, cols| {
                block(k, &packs, (out, zero), rows, cols);
            });
        }
    });
}

/// Values of k packed at once (a multiple of `kc`): all of `kd` when the packed panels of A and
/// B (`lines` rows of A plus columns of B, rounded up to whole panels) hold at most
/// [`PACK_VALUES`] values, else as many whole k blocks as fit (at least one). Each group is one
/// hand-off to the threads; fewer groups mean fewer waits, more mean less memory.
pub(super) fn k_group(kc: usize, lines: usize, kd: usize) -> usize {
    let blocks = (PACK_VALUES / (lines * kc).max(1)).max(1);
    (blocks * kc).min(kd.next_multiple_of(kc))
}

/// The most values of A and B packed at once per product (4 MiB of f32, kept between products):
/// the whole of most products of an MLP of 1024 units at batch 256, two k groups for the
/// 1024 x 1024 layer. Twice this packs every such product in one go but keeps 4 MiB more, which
/// put the mixed step's process peak above dfdx's f32 step (`bench_step`, row c').
const PACK_VALUES: usize = 1 << 20;

/// Rows of A or columns of B one packing task packs (rounded up to whole panels): small, equal
/// tasks, so that the threads finish packing together.
const PACK_LINES: usize = 64;

/// [`run`] for a strided micro-kernel (f32 operands, see [`strided`]).
fn run_strided(
    k: &Tiles,
    (m, n, kd): (usize, usize, usize),
    a: Src<'_, f32>,
    b: Src<'_, f32>,
    (c, zero): (&mut [f32], bool),
    threads: usize,
) {
    let packing = strided::packing();
    let threads = threads_for((m, n, kd), threads);
    split(
        (m, n),
        (k.mr, k.nr),
        c,
        threads,
        Prologue::none(),
        &|out, rows, cols| {
            f32::with_buffers(|buf| {
                strided::block(k, kd, a, b, (out, zero), rows, cols, buf, packing);
            });
        },
    );
}

/// One block of `C` (rows `r0..r1`, columns `c0..c1`, both starting on a micro-tile boundary)
/// over the k blocks of `packs`, in the BLIS loop order: k blocks, column blocks, row blocks,
/// micro-tiles, reading the panels the prologue packed. With `zero`, C's old values are not
/// read: a whole tile's first k block overwrites it (the kernel's `first`), an edge tile's is
/// copied in from the kernel's scratch tile.
fn block<T>(
    k: &Micro<T>,
    packs: &Packs<T>,
    (out, zero): (Out, bool),
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
) {
    let (mr, nr) = (k.mr, k.nr);
    // SAFETY: blocks run only after every task of the prologue, the only writer, is done.
    let pa = unsafe { packs.view.0.all() };
    // SAFETY: as above.
    let pb = unsafe { packs.view.1.all() };
    // edge tiles: -0.0 is the additive identity, so `C += tmp` adds exactly what a full tile adds
    let mut tmp = [-0.0f32; MAX_TILE];
    let tmp = &mut tmp[..mr * nr];
    for pc in (packs.ks.0..packs.ks.1).step_by(k.kc) {
        // values of k in this block, and elements of a panel's line (pairs for bf16)
        let kq = k.kc.min(packs.ks.1 - pc).div_ceil(packs.per);
        let (pa, pb) = (packs.a_block(pa, pc), packs.b_block(pb, pc));
        let clear = zero && pc == packs.ks.0;
        for jc in (c0..c1).step_by(k.nc) {
            let nc = k.nc.min(c1 - jc);
            for ic in (r0..r1).step_by(k.mc) {
                let mc = k.mc.min(r1 - ic);
                for jp in 0..nc.div_ceil(nr) {
                    let (col, cols) = (jc + jp * nr, nr.min(nc - jp * nr));
                    let bp = &pb[col * kq..(col + nr) * kq];
                    for ip in 0..mc.div_ceil(mr) {
                        let (row, rows) = (ic + ip * mr, mr.min(mc - ip * mr));
                        let ap = &pa[row * kq..(row + mr) * kq];
                        if rows == mr && cols == nr {
                            let ct = out.tile(row, col, mr, nr);
                            // SAFETY: `k` is built only after `check` accepted its path; the tile
                            // lies inside C (`Out::tile` asserts it) and inside this thread's
                            // block, which no other thread touches.
                            unsafe { (k.run)(kq, ap, bp, ct, out.ld, clear) };
                        } else {
                            tmp.fill(-0.0);
                            // SAFETY: as above; `tmp` holds mr x nr values with row stride nr.
                            unsafe { (k.run)(kq, ap, bp, tmp.as_mut_ptr(), nr, false) };
                            for (r, t) in tmp.chunks_exact(nr).take(rows).enumerate() {
                                // SAFETY: row `row + r`, columns `col..col + cols` lie in this
                                // thread's block; no other reference to them is alive.
                                let dst = unsafe { out.segment(row + r, col, cols) };
                                if clear {
                                    dst.copy_from_slice(&t[..cols]);
                                } else {
                                    dst.iter_mut().zip(t).for_each(|(d, s)| *d += *s);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The largest micro-tile of any kernel (8 x 64, AVX512-FP16).
const MAX_TILE: usize = 8 * 64;
