//! What the GEMM driver and its micro-kernels share: a micro-kernel's signature and blocking, the
//! grid that splits a product over threads, the shared view of the output `C`, and the packing
//! buffers each thread keeps. Below both, so neither imports the other for these.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::pack::PackElem;
use super::pool;

/// A micro-kernel: `C[mr x nr] += Apack(kc x mr)ᵀ · Bpack(kc x nr)`, `C` with row stride `ldc`;
/// with `first` (the first k block of a product that overwrites `C`), `C`'s old values are not
/// read: the tile's sums are added to `+0.0`, the same bits as adding them to a cleared tile.
///
/// # Safety (for callers)
/// The path's CPU features must be present (a `Micro` is only built after [`check`] accepted
/// the path), and `c` must be valid for reads and writes of `mr` rows of `nr` values at stride
/// `ldc`, with no other access to those values during the call. The kernels assert the lengths
/// of the packed slices themselves.
pub(crate) type MicroFn<T> = unsafe fn(usize, &[T], &[T], *mut f32, usize, bool);

/// The k block of the FMA micro-kernels (AVX-512's packed ones, AVX2's strided one, the small
/// products' tiles of `tiny.rs` and the scalar chains of `micro.rs`): each output element sums
/// one FMA chain per block of `KC` values and adds it into `C`, so this length decides where
/// the roundings fall, and every FMA path must use the same one to give the same bits.
pub(crate) const KC: usize = 256;

/// A micro-kernel and its blocking.
pub(crate) struct Micro<T> {
    pub(crate) mr: usize,
    pub(crate) nr: usize,
    pub(crate) kc: usize,
    pub(crate) mc: usize,
    pub(crate) nc: usize,
    pub(crate) run: MicroFn<T>,
}

impl<T> Micro<T> {
    /// An `mr x nr` micro-kernel with the blocking the packed paths share: k blocks of 256 (a
    /// packed panel of A and of B stays in L1/L2), 64 rows of A and 512 columns of B per block.
    pub(crate) fn new(mr: usize, nr: usize, run: MicroFn<T>) -> Self {
        Self {
            mr,
            nr,
            kc: KC,
            mc: 64,
            nc: 512,
            run,
        }
    }
}

/// Products smaller than this many multiply-adds run on the calling thread only (starting a
/// scoped thread costs tens of µs).
pub(crate) const PAR_MIN_WORK: usize = 1 << 21;

/// Blocks per thread a split product aims at: more than one, so a thread slowed by other work
/// on the machine hands blocks to the others.
const BLOCKS_PER_THREAD: usize = 6;

/// How a product is cut into blocks of `C`: `mb x nb` (multiples of the micro-tile, the last ones
/// shorter), numbered row block by row block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grid {
    m: usize,
    n: usize,
    mb: usize,
    nb: usize,
    col_blocks: usize,
    blocks: usize,
}

impl Grid {
    /// The grid for `threads` threads: one block for one thread; else about
    /// [`BLOCKS_PER_THREAD`] blocks per thread, cut along columns first (a column block reads
    /// only its own part of the packed B), blocks no narrower than 8 micro-tiles either way (so a product
    /// splits only if it is at least 16 micro-tiles tall or wide).
    pub(crate) fn new(m: usize, n: usize, mr: usize, nr: usize, threads: usize) -> Self {
        let (mb, nb) = if threads <= 1 {
            (m.max(1), n.max(1))
        } else {
            let target = threads * BLOCKS_PER_THREAD;
            let col_pieces = target.min(n / (8 * nr)).max(1);
            let row_pieces = target.div_ceil(col_pieces).min(m / (8 * mr)).max(1);
            (
                m.div_ceil(row_pieces).next_multiple_of(mr),
                n.div_ceil(col_pieces).next_multiple_of(nr),
            )
        };
        let col_blocks = n.div_ceil(nb);
        Grid {
            m,
            n,
            mb,
            nb,
            col_blocks,
            blocks: col_blocks * m.div_ceil(mb),
        }
    }

    /// Number of blocks.
    pub(crate) fn blocks(&self) -> usize {
        self.blocks
    }

    /// Block `t`: its rows and columns of `C`, as half-open ranges.
    pub(crate) fn block(&self, t: usize) -> ((usize, usize), (usize, usize)) {
        let (r0, c0) = (
            (t / self.col_blocks) * self.mb,
            (t % self.col_blocks) * self.nb,
        );
        (
            (r0, (r0 + self.mb).min(self.m)),
            (c0, (c0 + self.nb).min(self.n)),
        )
    }
}

/// The output `C` (row-major, `rows x ld`) shared by the threads of one product. Each thread
/// writes only inside the blocks it claimed, which are disjoint; nothing else touches `C` until
/// the threads are joined.
#[derive(Clone, Copy)]
pub(crate) struct Out {
    ptr: *mut f32,
    rows: usize,
    pub(crate) ld: usize,
}

// SAFETY: `Out` is a pointer into a `&mut [f32]` borrowed until every block is done; threads only
// access disjoint blocks of it (see `Out::segment` and `Out::tile`), so sharing it is as sound
// as handing out disjoint `&mut` sub-slices.
unsafe impl Send for Out {}
// SAFETY: as for `Send`.
unsafe impl Sync for Out {}

impl Out {
    fn new(c: &mut [f32], rows: usize, ld: usize) -> Self {
        assert_eq!(c.len(), rows * ld);
        Out {
            ptr: c.as_mut_ptr(),
            rows,
            ld,
        }
    }

    /// Pointer to element `(r, col)` of a full `mr x nr` tile, checked to lie inside `C`.
    pub(crate) fn tile(&self, r: usize, col: usize, mr: usize, nr: usize) -> *mut f32 {
        assert!(r + mr <= self.rows && col + nr <= self.ld);
        // `r * ld + col < rows * ld`: inside the borrowed slice (asserted above)
        self.ptr.wrapping_add(r * self.ld + col)
    }

    /// Columns `col..col + len` of row `r`.
    ///
    /// # Safety
    /// The caller owns this segment: it lies in a block claimed by the calling thread, and no
    /// other reference to it is alive.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn segment(&self, r: usize, col: usize, len: usize) -> &mut [f32] {
        assert!(r < self.rows && col + len <= self.ld);
        let start = self.ptr.wrapping_add(r * self.ld + col);
        // SAFETY: in bounds (asserted above); exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(start, len) }
    }
}

/// Work that must be done before any block of `C` is computed: `tasks` numbered pieces (the
/// packing of the operands into [`PackView`]s), which the threads of a split product claim
/// before the blocks, so each operand is packed once, shared, whatever the thread count.
#[derive(Clone, Copy)]
pub(crate) struct Prologue<'a> {
    pub(crate) tasks: usize,
    pub(crate) run: &'a (dyn Fn(usize) + Sync),
}

impl Prologue<'_> {
    /// No work before the blocks.
    pub(crate) fn none() -> Self {
        Prologue {
            tasks: 0,
            run: &|_| {},
        }
    }
}

/// The threads a product of `m x n x kd` multiply-adds runs on: one below [`PAR_MIN_WORK`], else
/// `threads`.
pub(crate) fn threads_for((m, n, kd): (usize, usize, usize), threads: usize) -> usize {
    if m.saturating_mul(n).saturating_mul(kd) < PAR_MIN_WORK {
        1
    } else {
        threads.max(1)
    }
}

/// Runs `pre`'s tasks, then cuts `C` (`m x n`) into the [`Grid`] of `threads` threads and runs
/// `task(out, rows, cols)` for each block, on the calling thread and helpers of the pool. Every
/// task of `pre` is done before any block starts (a thread that claims a block while another
/// still packs waits for it).
#[allow(clippy::type_complexity)]
pub(crate) fn split(
    (m, n): (usize, usize),
    (mr, nr): (usize, usize),
    c: &mut [f32],
    threads: usize,
    pre: Prologue<'_>,
    task: &(dyn Fn(Out, (usize, usize), (usize, usize)) + Sync),
) {
    let grid = Grid::new(m, n, mr, nr, threads);
    let out = Out::new(c, m, n);
    let done = AtomicUsize::new(0);
    let each = |t: usize| {
        if t < pre.tasks {
            (pre.run)(t);
            done.fetch_add(1, Ordering::Release);
            return;
        }
        // every task of `pre` was claimed before this block: wait for those still running
        while done.load(Ordering::Acquire) < pre.tasks {
            std::thread::yield_now();
        }
        let (rows, cols) = grid.block(t - pre.tasks);
        task(out, rows, cols);
    };
    pool::for_each_block(pre.tasks + grid.blocks(), threads - 1, &each);
}

/// Packing buffers of one thread.
#[derive(Default)]
pub(crate) struct Buffers<T> {
    pub(crate) a: Vec<T>,
    pub(crate) b: Vec<T>,
    /// One zero-padded tile of A or panel of B past the matrix's edge, for a strided kernel
    /// reading the rest of the operand in place.
    pub(crate) edge_a: Vec<T>,
    pub(crate) edge_b: Vec<T>,
}

/// Packing buffers reused across calls, one set per thread (the pool's helpers are
/// persistent), so no call pays page faults for fresh allocations.
pub(crate) trait Packed: PackElem + 'static {
    /// Runs `f` with this thread's packing buffers of this type.
    fn with_buffers<R>(f: impl FnOnce(&mut Buffers<Self>) -> R) -> R;
}

thread_local! {
    static PACK_F32: RefCell<Buffers<f32>> = RefCell::new(Buffers::default());
    static PACK_U16: RefCell<Buffers<u16>> = RefCell::new(Buffers::default());
    static PACK_U32: RefCell<Buffers<u32>> = RefCell::new(Buffers::default());
}

macro_rules! packed {
    ($t:ty, $cell:ident) => {
        impl Packed for $t {
            fn with_buffers<R>(f: impl FnOnce(&mut Buffers<Self>) -> R) -> R {
                $cell.with(|cell| match cell.try_borrow_mut() {
                    Ok(mut bufs) => f(&mut bufs),
                    // re-entered on this thread (cannot happen today): fresh buffers
                    Err(_) => f(&mut Buffers::default()),
                })
            }
        }
    };
}
packed!(f32, PACK_F32);
packed!(u16, PACK_U16);
packed!(u32, PACK_U32);
