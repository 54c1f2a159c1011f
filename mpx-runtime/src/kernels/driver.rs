//! The blocked GEMM driver: operand preparation (widening, bf16 rounding), packing into
//! micro-panels, and the loops around a micro-kernel. All safe Rust; the micro-kernels are the
//! only `unsafe` calls, each checked by the kernel's own length assertions.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::mat::{MatRef, Operand};
use super::{KernelError, KernelPath, active_path, avx2, avx512, fp16, portable};
use crate::precision::round_to_bf16;

/// A micro-kernel: `C[mr x nr] += Apack(kc x mr)ᵀ · Bpack(kc x nr)`, `C` with row stride `ldc`.
///
/// The function may require CPU features: a `Micro` is only built by [`micro_for`] after the path
/// was checked to be supported.
pub(crate) type MicroFn<T> = unsafe fn(usize, &[T], &[T], &mut [f32], usize);

/// A micro-kernel and its blocking.
pub(crate) struct Micro<T> {
    pub(crate) mr: usize,
    pub(crate) nr: usize,
    pub(crate) kc: usize,
    pub(crate) mc: usize,
    pub(crate) nc: usize,
    pub(crate) run: MicroFn<T>,
}

/// A prepared operand: values in the packed type, with strides.
#[derive(Clone, Copy)]
struct Src<'a, T> {
    data: &'a [T],
    rs: usize,
    cs: usize,
}

/// `C = A·B` (or `C += A·B` with `accumulate`) on the [active path](super::active_path). `C` is
/// row-major `A.rows x B.cols` f32.
///
/// # Errors
/// [`KernelError::InnerMismatch`], [`KernelError::OperandTooShort`] or
/// [`KernelError::OutputLength`] when the shapes do not fit.
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{gemm, MatRef};
/// use mpx_runtime::precision::f16;
/// let w = [f16::from_f32(1.0), f16::from_f32(2.0)]; // W: 1x2
/// let x = [f16::from_f32(3.0), f16::from_f32(4.0)]; // X: 1x2
/// let mut c = [0.0f32];
/// // X · Wᵀ
/// gemm(MatRef::row_major_f16(&x, 1, 2), MatRef::row_major_f16(&w, 1, 2).t(), &mut c, false).unwrap();
/// assert_eq!(c, [11.0]);
/// ```
pub fn gemm(
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: &mut [f32],
    accumulate: bool,
) -> Result<(), KernelError> {
    gemm_on(active_path(), a, b, c, accumulate)
}

/// [`gemm`] on an explicit path.
///
/// # Errors
/// As [`gemm`], and [`KernelError::Unsupported`] if this CPU lacks the path.
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{gemm_on, KernelPath, MatRef};
/// let mut c = [1.0f32];
/// let a = MatRef::row_major_f32(&[2.0], 1, 1);
/// gemm_on(KernelPath::Portable, a, a, &mut c, true).unwrap();
/// assert_eq!(c, [5.0]);
/// ```
pub fn gemm_on<'a>(
    path: KernelPath,
    a: MatRef<'a>,
    b: MatRef<'a>,
    c: &mut [f32],
    accumulate: bool,
) -> Result<(), KernelError> {
    check(path, &a, &b, c)?;
    let _count = CountTime(std::time::Instant::now());
    if !accumulate {
        c.fill(0.0);
    }
    let (m, n, k) = (a.rows, b.cols, a.cols);
    if m == 0 || n == 0 || k == 0 {
        return Ok(());
    }
    if let (KernelPath::Avx512Fp16, Operand::F16(av), Operand::F16(bv)) = (path, a.values, b.values)
    {
        let bits = |v: &'a [f16]| -> &'a [u16] { v.reinterpret_cast() };
        let a = Src {
            data: bits(av),
            rs: a.row_stride,
            cs: a.col_stride,
        };
        let b = Src {
            data: bits(bv),
            rs: b.row_stride,
            cs: b.col_stride,
        };
        split(&fp16::micro(), m, n, k, a, b, c);
        return Ok(());
    }
    let (ad, bd) = (widen(&a), widen(&b));
    let a = Src {
        data: ad.as_deref().unwrap_or_else(|| f32_values(&a)),
        rs: a.row_stride,
        cs: a.col_stride,
    };
    let b = Src {
        data: bd.as_deref().unwrap_or_else(|| f32_values(&b)),
        rs: b.row_stride,
        cs: b.col_stride,
    };
    match path {
        KernelPath::Avx512Fp16 | KernelPath::Avx512 => split(&avx512::micro(), m, n, k, a, b, c),
        KernelPath::Avx2Fma => split(&avx2::micro(), m, n, k, a, b, c),
        KernelPath::Portable => split(&portable::micro(), m, n, k, a, b, c),
    }
    Ok(())
}

fn check(path: KernelPath, a: &MatRef<'_>, b: &MatRef<'_>, c: &[f32]) -> Result<(), KernelError> {
    if !path.is_supported() {
        return Err(KernelError::Unsupported {
            path,
            supported: KernelPath::supported(),
        });
    }
    if a.cols != b.rows {
        return Err(KernelError::InnerMismatch {
            a_rows: a.rows,
            a_cols: a.cols,
            b_rows: b.rows,
            b_cols: b.cols,
        });
    }
    for (name, mat) in [("A", a), ("B", b)] {
        if mat.needed() > mat.values.len() {
            return Err(KernelError::OperandTooShort {
                name,
                needed: mat.needed(),
                len: mat.values.len(),
            });
        }
    }
    if c.len() != a.rows * b.cols {
        return Err(KernelError::OutputLength {
            m: a.rows,
            n: b.cols,
            len: c.len(),
        });
    }
    Ok(())
}

/// The f32 values of an f32 operand (the others were widened by [`widen`]).
fn f32_values<'a>(m: &MatRef<'a>) -> &'a [f32] {
    match m.values {
        Operand::F32(v) => &v[..m.needed()],
        // widen() returned Some for these; never reached
        Operand::F16(_) | Operand::Bf16(_) => &[],
    }
}

/// f16 operands widened to f32 (SIMD slice conversion), bf16 operands rounded; `None` for f32.
fn widen(m: &MatRef<'_>) -> Option<Vec<f32>> {
    let n = m.needed();
    match m.values {
        Operand::F32(_) => None,
        Operand::F16(v) => {
            let mut out = vec![0.0f32; n];
            v[..n].convert_to_f32_slice(&mut out);
            Some(out)
        }
        Operand::Bf16(v) => {
            let mut out = vec![0.0f32; n];
            round_to_bf16(&v[..n], &mut out);
            Some(out)
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

/// Total wall-clock nanoseconds spent inside [`gemm`] / [`gemm_on`] calls so far, summed over
/// calling threads: the difference across a training step is that step's matmul time (for
/// profiling; costs two clock reads per call).
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{gemm, gemm_nanos, MatRef};
/// let before = gemm_nanos();
/// let mut c = [0.0f32];
/// gemm(MatRef::row_major_f32(&[1.0], 1, 1), MatRef::row_major_f32(&[1.0], 1, 1), &mut c, false).unwrap();
/// assert!(gemm_nanos() > before);
/// ```
pub fn gemm_nanos() -> u64 {
    GEMM_NANOS.load(Ordering::Relaxed)
}

/// Products smaller than this many multiply-adds run on one thread (a thread costs tens of µs).
const PAR_MIN_WORK: usize = 1 << 21;

/// 0: not set (one thread).
static MAX_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Sets how many threads one GEMM may use: 1 (the default) keeps every product on the calling
/// thread; 2 splits large products into two halves of rows where the CPU has two hardware
/// threads. Values above 2 count as 2; 0 restores the default. (dfdx 0.13's CPU matmul uses all
/// cores through rayon.)
///
/// One thread is the default because on the shared 2-core machine this was measured on, the
/// static two-way split was slower than one thread in most runs (`examples/bench_kernels.rs`,
/// `examples/bench_step.rs` row f2); on an idle machine it matched dfdx's two-thread matmul.
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{max_threads, set_max_threads};
/// assert_eq!(max_threads(), 1);
/// set_max_threads(2);
/// assert!(max_threads() >= 1 && max_threads() <= 2); // 1 on a single-threaded CPU
/// set_max_threads(0); // back to the default
/// assert_eq!(max_threads(), 1);
/// ```
pub fn set_max_threads(n: usize) {
    MAX_THREADS.store(n.min(2), Ordering::Relaxed);
}

/// The threads one GEMM may use (see [`set_max_threads`]).
///
/// # Examples
/// ```
/// assert!(mpx_runtime::kernels::max_threads() <= 2);
/// ```
pub fn max_threads() -> usize {
    match MAX_THREADS.load(Ordering::Relaxed) {
        0 | 1 => 1,
        _ => std::thread::available_parallelism().map_or(1, |n| n.get().min(2)),
    }
}

/// Runs [`blocked`] on one thread, or on two halves of C's rows (each thread packs its own panels
/// into its own reused buffers; the halves are disjoint slices of C).
fn split<T: Packed + Send + Sync>(
    k: &Micro<T>,
    m: usize,
    n: usize,
    kd: usize,
    a: Src<'_, T>,
    b: Src<'_, T>,
    c: &mut [f32],
) {
    if max_threads() < 2 || m * n * kd < PAR_MIN_WORK || m < 2 * k.mr {
        return blocked(k, m, n, kd, a, b, c);
    }
    let mid = (m / 2).div_ceil(k.mr) * k.mr;
    let (c0, c1) = c.split_at_mut(mid * n);
    // rows mid.. of A start mid * row_stride values further on
    let a1 = Src {
        data: &a.data[mid * a.rs..],
        rs: a.rs,
        cs: a.cs,
    };
    T::with_buffers(|[a0p, b0p, a1p, b1p]| {
        std::thread::scope(|s| {
            s.spawn(|| blocked_in(k, m - mid, n, kd, a1, b, c1, a1p, b1p));
            blocked_in(k, mid, n, kd, a, b, c0, a0p, b0p);
        });
    });
}

/// The blocked loops (BLIS order: k blocks, column blocks, row blocks, then micro-tiles).
fn blocked<T: Packed>(
    k: &Micro<T>,
    m: usize,
    n: usize,
    kd: usize,
    a: Src<'_, T>,
    b: Src<'_, T>,
    c: &mut [f32],
) {
    T::with_buffers(|[apack, bpack, ..]| blocked_in(k, m, n, kd, a, b, c, apack, bpack));
}

/// Packing buffers reused across calls: two sets per calling thread (the second for the helper
/// thread of a split product), so no call pays page faults for fresh allocations.
pub(crate) trait Packed: Copy + Default + 'static {
    /// Runs `f` with this thread's two sets of packing buffers of this type.
    fn with_buffers<R>(f: impl FnOnce(&mut [Vec<Self>; 4]) -> R) -> R;
}

thread_local! {
    static PACK_F32: RefCell<[Vec<f32>; 4]> = const { RefCell::new([Vec::new(), Vec::new(), Vec::new(), Vec::new()]) };
    static PACK_U16: RefCell<[Vec<u16>; 4]> = const { RefCell::new([Vec::new(), Vec::new(), Vec::new(), Vec::new()]) };
}

macro_rules! packed {
    ($t:ty, $cell:ident) => {
        impl Packed for $t {
            fn with_buffers<R>(f: impl FnOnce(&mut [Vec<Self>; 4]) -> R) -> R {
                $cell.with(|cell| match cell.try_borrow_mut() {
                    Ok(mut bufs) => f(&mut bufs),
                    // re-entered on this thread (cannot happen today): fresh buffers
                    Err(_) => f(&mut Default::default()),
                })
            }
        }
    };
}
packed!(f32, PACK_F32);
packed!(u16, PACK_U16);

/// [`blocked`] with the packing buffers given (resized as needed; every packed value is written
/// before it is read, padding included).
#[allow(clippy::too_many_arguments)]
fn blocked_in<T: Copy + Default>(
    k: &Micro<T>,
    m: usize,
    n: usize,
    kd: usize,
    a: Src<'_, T>,
    b: Src<'_, T>,
    c: &mut [f32],
    apack: &mut Vec<T>,
    bpack: &mut Vec<T>,
) {
    let (mr, nr) = (k.mr, k.nr);
    apack.resize(k.mc.div_ceil(mr) * mr * k.kc, T::default());
    bpack.resize(k.nc.div_ceil(nr) * nr * k.kc, T::default());
    let mut tmp = vec![0.0f32; mr * nr];
    for pc in (0..kd).step_by(k.kc) {
        let kc = k.kc.min(kd - pc);
        for jc in (0..n).step_by(k.nc) {
            let nc = k.nc.min(n - jc);
            let npanels = nc.div_ceil(nr);
            pack_b(bpack, b, pc, kc, jc, nc, nr);
            for ic in (0..m).step_by(k.mc) {
                let mc = k.mc.min(m - ic);
                let mpanels = mc.div_ceil(mr);
                pack_a(apack, a, ic, mc, pc, kc, mr);
                for jp in 0..npanels {
                    let cols = nr.min(nc - jp * nr);
                    let bp = &bpack[jp * nr * kc..(jp + 1) * nr * kc];
                    for ip in 0..mpanels {
                        let rows = mr.min(mc - ip * mr);
                        let ap = &apack[ip * mr * kc..(ip + 1) * mr * kc];
                        let ci = (ic + ip * mr) * n + jc + jp * nr;
                        if rows == mr && cols == nr {
                            // SAFETY: `k` comes from `micro_for`-style constructors used only after
                            // the path's CPU features were checked (`gemm_on` -> `check`); the
                            // micro-kernel asserts its slice lengths itself.
                            unsafe { (k.run)(kc, ap, bp, &mut c[ci..], n) };
                        } else {
                            tmp.fill(0.0);
                            // SAFETY: as above; `tmp` holds mr x nr values with row stride nr.
                            unsafe { (k.run)(kc, ap, bp, &mut tmp, nr) };
                            for r in 0..rows {
                                let row = &mut c[ci + r * n..ci + r * n + cols];
                                for (d, s) in row.iter_mut().zip(&tmp[r * nr..r * nr + cols]) {
                                    *d += *s;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Packs rows `ic..ic+mc`, columns `pc..pc+kc` of A into micro-panels of `mr` rows, k-major
/// (`pack[panel][p][i]`), zero-padding the last panel.
fn pack_a<T: Copy + Default>(
    pack: &mut [T],
    a: Src<'_, T>,
    ic: usize,
    mc: usize,
    pc: usize,
    kc: usize,
    mr: usize,
) {
    for ip in 0..mc.div_ceil(mr) {
        let panel = &mut pack[ip * mr * kc..(ip + 1) * mr * kc];
        for i in 0..mr {
            let r = ic + ip * mr + i;
            if r >= ic + mc {
                for p in 0..kc {
                    panel[p * mr + i] = T::default();
                }
                continue;
            }
            let base = r * a.rs + pc * a.cs;
            for p in 0..kc {
                panel[p * mr + i] = a.data[base + p * a.cs];
            }
        }
    }
}

/// Packs rows `pc..pc+kc`, columns `jc..jc+nc` of B into micro-panels of `nr` columns, k-major
/// (`pack[panel][p][j]`), zero-padding the last panel. Reads along B's contiguous direction.
fn pack_b<T: Copy + Default>(
    pack: &mut [T],
    b: Src<'_, T>,
    pc: usize,
    kc: usize,
    jc: usize,
    nc: usize,
    nr: usize,
) {
    for jp in 0..nc.div_ceil(nr) {
        let panel = &mut pack[jp * nr * kc..(jp + 1) * nr * kc];
        let cols = nr.min(nc - jp * nr);
        let c0 = jc + jp * nr;
        if b.cs == 1 {
            for p in 0..kc {
                let src = &b.data[(pc + p) * b.rs + c0..(pc + p) * b.rs + c0 + cols];
                let dst = &mut panel[p * nr..(p + 1) * nr];
                dst[..cols].copy_from_slice(src);
                dst[cols..].fill(T::default());
            }
        } else {
            for j in 0..nr {
                if j >= cols {
                    for p in 0..kc {
                        panel[p * nr + j] = T::default();
                    }
                    continue;
                }
                let base = pc * b.rs + (c0 + j) * b.cs;
                for p in 0..kc {
                    panel[p * nr + j] = b.data[base + p * b.rs];
                }
            }
        }
    }
}
