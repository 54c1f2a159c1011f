//! The blocked GEMM driver: operand preparation (widening, bf16 rounding), the loops around a
//! micro-kernel, and the split of large products over threads. Packing lives in
//! [`pack`](super::pack), the block loop of the strided AVX2 kernel (operands read in place or
//! packed) in [`strided`]; the micro-kernels are the only `unsafe` calls, plus the shared view of
//! the output that lets threads write disjoint blocks of it.
//!
//! # Threads
//! A product of at least [`PAR_MIN_WORK`] multiply-adds is cut into a grid of blocks of `C`
//! (whole micro-tiles, see [`Grid`]), which the calling thread and up to [`max_threads`]` - 1`
//! helper threads of a persistent [pool](super::pool) claim one at a time from an atomic
//! counter, so a thread slowed by a busy neighbour simply takes fewer blocks. Each block runs the same k blocks
//! in the same order with the same micro-tile grid as the one-thread run, so every output element
//! sees the same operations: results are bit-identical for any thread count.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::mat::MatRef;
use super::pack::{PackElem, Src, pack_a, pack_b};
use super::strided::{self, Tiles};
use super::threads::max_threads;
use super::tile::{Buffers, Micro, Out, Packed, split};
use super::{KernelError, KernelPath, avx2, avx512, bf16, fp16, portable};
use crate::precision::FloatSlice;

/// [`gemm`](super::path::gemm) on an explicit path.
///
/// # Errors
/// As [`gemm`](super::path::gemm), and [`KernelError::Unsupported`] if this CPU lacks the path.
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
    let _count = CountTime(std::time::Instant::now());
    let (m, n, k) = (a.rows(), b.cols(), a.cols());
    if m == 0 || n == 0 || k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return Ok(());
    }
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
        return Ok(());
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
        // SAFETY: `check` accepted the path: the CPU has AVX-512 F and AVX512-BF16.
        unsafe { bf16::run((m, n, k), a, b, (c, zero), threads) };
        return Ok(());
    }
    with_wide(|[wa, wb]| {
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
        let dims = (m, n, k);
        match path {
            KernelPath::Avx512Fp16 | KernelPath::Avx512Bf16 | KernelPath::Avx512 => {
                run(&avx512::micro(), dims, a, b, (c, zero), threads);
            }
            KernelPath::Avx2Fma => run_strided(&avx2::tiles(), dims, a, b, (c, zero), threads),
            KernelPath::Portable => run(&portable::micro(), dims, a, b, (c, zero), threads),
        }
    });
    Ok(())
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

/// Runs `f` with this thread's two reusable buffers for widened or rounded operands (fresh
/// ones if re-entered).
fn with_wide<R>(f: impl FnOnce(&mut [Vec<f32>; 2]) -> R) -> R {
    thread_local! {
        static WIDE: RefCell<[Vec<f32>; 2]> = const { RefCell::new([Vec::new(), Vec::new()]) };
    }
    WIDE.with(|cell| match cell.try_borrow_mut() {
        Ok(mut bufs) => f(&mut bufs),
        Err(_) => f(&mut Default::default()),
    })
}

/// The first `n` values of `buf`, grown when shorter (never shrunk: operands of different sizes
/// do not zero it again each call). The caller overwrites them.
fn grown(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if buf.len() < n {
        buf.resize(n, 0.0);
    }
    &mut buf[..n]
}

/// An operand's values as f32: f32 operands as they are, f16 operands widened (SIMD slice
/// conversion) and bf16 operands rounded into `buf`.
fn prepared<'s>(m: &MatRef<'s>, buf: &'s mut Vec<f32>) -> &'s [f32] {
    let n = m.needed().expect("checked by `check`");
    match m.values() {
        FloatSlice::F32(v) => &v[..n],
        FloatSlice::F16(v) => {
            let buf = grown(buf, n);
            crate::precision::convert::widen_f16(&v[..n], buf);
            buf
        }
        FloatSlice::Bf16(v) => {
            let buf = grown(buf, n);
            crate::precision::convert::round_bf16(&v[..n], buf);
            buf
        }
    }
}

/// Nanoseconds spent in [`gemm_on`] (all threads, since the process started).
static GEMM_NANOS: AtomicU64 = AtomicU64::new(0);

/// Adds the time since its start to [`GEMM_NANOS`] when dropped (on every return path).
struct CountTime(std::time::Instant);

impl Drop for CountTime {
    fn drop(&mut self) {
        let ns = u64::try_from(self.0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        GEMM_NANOS.fetch_add(ns, Ordering::Relaxed);
    }
}

/// Total wall-clock nanoseconds spent inside [`gemm`](super::path::gemm) / [`gemm_on`] calls so far, summed over
/// calling threads: the difference across a training step is that step's matmul time (for
/// profiling; costs two clock reads per call).
pub fn gemm_nanos() -> u64 {
    GEMM_NANOS.load(Ordering::Relaxed)
}

/// Runs the product on up to `threads` threads: the calling thread and helpers of the
/// [pool](super::pool) claim blocks of the [`Grid`] until none is left.
fn run<T: Packed + Send + Sync>(
    k: &Micro<T>,
    (m, n, kd): (usize, usize, usize),
    a: Src<'_, T>,
    b: Src<'_, T>,
    (c, zero): (&mut [f32], bool),
    threads: usize,
) {
    split((m, n, kd), (k.mr, k.nr), c, threads, &|out, rows, cols| {
        T::with_buffers(|buf| block(k, kd, a, b, (out, zero), rows, cols, buf));
    });
}

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
    split((m, n, kd), (k.mr, k.nr), c, threads, &|out, rows, cols| {
        f32::with_buffers(|buf| strided::block(k, kd, a, b, (out, zero), rows, cols, buf, packing));
    });
}

/// One block of `C` (rows `r0..r1`, columns `c0..c1`, both starting on a micro-tile boundary)
/// over the whole inner dimension, in the BLIS loop order: k blocks, column blocks (pack B),
/// row blocks (pack A), micro-tiles; with `zero`, the block of C is zeroed first. Every packed
/// value is written before it is read.
#[allow(clippy::too_many_arguments)]
fn block<T: PackElem>(
    k: &Micro<T>,
    kd: usize,
    a: Src<'_, T>,
    b: Src<'_, T>,
    (out, zero): (Out, bool),
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
    buf: &mut Buffers<T>,
) {
    let (mr, nr) = (k.mr, k.nr);
    if zero {
        for r in r0..r1 {
            // SAFETY: row `r`, columns `c0..c1` lie in this thread's block; no other reference
            // to them is alive.
            unsafe { out.segment(r, c0, c1 - c0) }.fill(0.0);
        }
    }
    buf.a.resize(k.mc.div_ceil(mr) * mr * k.kc, T::default());
    buf.b.resize(k.nc.div_ceil(nr) * nr * k.kc, T::default());
    // edge tiles: -0.0 is the additive identity, so `C += tmp` adds exactly what a full tile adds
    let mut tmp = [-0.0f32; MAX_TILE];
    let tmp = &mut tmp[..mr * nr];
    for pc in (0..kd).step_by(k.kc) {
        let kc = k.kc.min(kd - pc);
        for jc in (c0..c1).step_by(k.nc) {
            let nc = k.nc.min(c1 - jc);
            pack_b(&mut buf.b, b, (pc, kc), (jc, nc), nr);
            for ic in (r0..r1).step_by(k.mc) {
                let mc = k.mc.min(r1 - ic);
                pack_a(&mut buf.a, a, (ic, mc), (pc, kc), mr);
                for jp in 0..nc.div_ceil(nr) {
                    let (col, cols) = (jc + jp * nr, nr.min(nc - jp * nr));
                    let bp = &buf.b[jp * nr * kc..(jp + 1) * nr * kc];
                    for ip in 0..mc.div_ceil(mr) {
                        let (row, rows) = (ic + ip * mr, mr.min(mc - ip * mr));
                        let ap = &buf.a[ip * mr * kc..(ip + 1) * mr * kc];
                        if rows == mr && cols == nr {
                            let ct = out.tile(row, col, mr, nr);
                            // SAFETY: `k` is built only after `check` accepted its path; the tile
                            // lies inside C (`Out::tile` asserts it) and inside this thread's
                            // block, which no other thread touches.
                            unsafe { (k.run)(kc, ap, bp, ct, out.ld) };
                        } else {
                            tmp.fill(-0.0);
                            // SAFETY: as above; `tmp` holds mr x nr values with row stride nr.
                            unsafe { (k.run)(kc, ap, bp, tmp.as_mut_ptr(), nr) };
                            for (r, t) in tmp.chunks_exact(nr).take(rows).enumerate() {
                                // SAFETY: row `row + r`, columns `col..col + cols` lie in this
                                // thread's block; no other reference to them is alive.
                                let dst = unsafe { out.segment(row + r, col, cols) };
                                dst.iter_mut().zip(t).for_each(|(d, s)| *d += *s);
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
