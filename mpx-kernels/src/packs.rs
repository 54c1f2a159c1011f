//! The operands of one product packed once and shared by its threads: where each k block's
//! panels of A and B lie in the caller's buffers, the numbered packing tasks of a
//! [`Prologue`](super::tile::Prologue) that fill them, and the shared view through which the
//! tasks write disjoint parts and the blocks of `C` then read them all.
//!
//! Packing each operand once, instead of once per block of `C` that uses it, halves the packing
//! of a product split over two threads (a block of rows re-packed B's columns, a block of columns
//! re-packed A's rows). The panels are the ones the per-block packing wrote, so the micro-kernels
//! see the same values in the same order: not a bit of any result changes.

use std::cell::RefCell;
use std::thread::LocalKey;

use super::pack::{PackElem, Src, pack_a, pack_b};

/// A part of an operand one packing task writes: rows `(ic, mc)` of A over k `(pc, kc)`, or k
/// `(pc, kc)` of B over columns `(jc, nc)` (the argument order of `pack_a` and `pack_b`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    A((usize, usize), (usize, usize)),
    B((usize, usize), (usize, usize)),
}

/// Packs `part` of `a` or `b` as their own type into `stage` (this thread's buffer of that type,
/// grown as needed; a fresh one if re-entered), then hands `finish` the packed panels, their
/// count, their k length and their width: the packing of a path whose kernel reads another type
/// than the operand's (f16 widened to f32, f32 rounded to bf16 pairs). The layout is
/// `pack_a`'s / `pack_b`'s, so `finish` converts panel by panel.
pub(crate) fn pack_staged<S: PackElem>(
    stage: &'static LocalKey<RefCell<Vec<S>>>,
    (a, b): (Src<'_, S>, Src<'_, S>),
    part: Part,
    (mr, nr): (usize, usize),
    finish: impl FnOnce(&[S], usize, (usize, usize)),
) {
    let go = |stage: &mut Vec<S>| {
        let (lines, kc, width) = match part {
            Part::A((_, mc), (_, kc)) => (mc, kc, mr),
            Part::B((_, kc), (_, nc)) => (nc, kc, nr),
        };
        let panels = lines.div_ceil(width);
        let len = panels * width * kc;
        if stage.len() < len {
            stage.resize(len, S::default());
        }
        match part {
            Part::A(rows, ks) => pack_a(&mut stage[..len], a, rows, ks, mr),
            Part::B(ks, cols) => pack_b(&mut stage[..len], b, ks, cols, nr),
        }
        finish(&stage[..len], panels, (kc, width));
    };
    stage.with(|cell| match cell.try_borrow_mut() {
        Ok(mut stage) => go(&mut stage),
        Err(_) => go(&mut Vec::new()),
    });
}

/// The packed panels of one group of k blocks `ks` of an `m x n` product: per k block `pc`, A's
/// `mr`-row panels of all its rows, then B's `nr`-column panels of all its columns, each panel
/// `kc` values of k long, stored `per` values of k to an element (2 for bf16 pairs).
pub(crate) struct Packs<S> {
    pub(crate) kc: usize,
    pub(crate) ks: (usize, usize),
    /// Rows of A and columns of B per packing task (multiples of `mr` and `nr`).
    pub(crate) piece: (usize, usize),
    pub(crate) mr: usize,
    pub(crate) nr: usize,
    pub(crate) per: usize,
    pub(crate) mn: (usize, usize),
    pub(crate) view: (PackView<S>, PackView<S>),
}

impl<S> Packs<S> {
    /// Rows of A and columns of B rounded up to whole panels.
    fn padded(&self) -> (usize, usize) {
        (
            self.mn.0.next_multiple_of(self.mr),
            self.mn.1.next_multiple_of(self.nr),
        )
    }

    /// Elements of A and B one group of `group` values of k takes (`lines`: rows of A plus
    /// columns of B, padded).
    pub(crate) fn len(lines: usize, group: usize, per: usize) -> usize {
        lines * group.div_ceil(per)
    }

    /// Numbered packing tasks: per k block, A's rows in pieces of `piece.0`, then B's columns in
    /// pieces of `piece.1`.
    pub(crate) fn tasks(&self) -> usize {
        let blocks = (self.ks.1 - self.ks.0).div_ceil(self.kc);
        blocks * (self.mn.0.div_ceil(self.piece.0) + self.mn.1.div_ceil(self.piece.1))
    }

    /// Runs packing task `t`: `f(dst, part)` fills `dst`, the panels of `part`.
    pub(crate) fn pack(&self, t: usize, f: impl FnOnce(&mut [S], Part)) {
        let (pa, pb) = (
            self.mn.0.div_ceil(self.piece.0),
            self.mn.1.div_ceil(self.piece.1),
        );
        let (block, piece) = (t / (pa + pb), t % (pa + pb));
        let pc = self.ks.0 + block * self.kc;
        let kc = self.kc.min(self.ks.1 - pc);
        let kq = kc.div_ceil(self.per);
        let (mp, np) = self.padded();
        let off = (pc - self.ks.0) / self.per;
        if piece < pa {
            let ic = piece * self.piece.0;
            let mc = self.piece.0.min(self.mn.0 - ic);
            let len = mc.div_ceil(self.mr) * self.mr * kq;
            // SAFETY: task `t` alone writes these panels (rows `ic..ic + mc` of k block `pc`),
            // and no block reads them before every task is done.
            let dst = unsafe { self.view.0.part_mut(off * mp + ic * kq, len) };
            f(dst, Part::A((ic, mc), (pc, kc)));
        } else {
            let jc = (piece - pa) * self.piece.1;
            let nc = self.piece.1.min(self.mn.1 - jc);
            let len = nc.div_ceil(self.nr) * self.nr * kq;
            // SAFETY: as above, for columns `jc..jc + nc` of B.
            let dst = unsafe { self.view.1.part_mut(off * np + jc * kq, len) };
            f(dst, Part::B((pc, kc), (jc, nc)));
        }
    }

    /// The panels of A for k block `pc` in `all` (the whole of A's view): row `r`'s panel starts
    /// at `r * kq`.
    pub(crate) fn a_block<'s>(&self, all: &'s [S], pc: usize) -> &'s [S] {
        let kq = self.kc.min(self.ks.1 - pc).div_ceil(self.per);
        let mp = self.padded().0;
        let off = (pc - self.ks.0) / self.per * mp;
        &all[off..off + mp * kq]
    }

    /// The panels of B for k block `pc` in `all`: column `c`'s panel starts at `c * kq`.
    pub(crate) fn b_block<'s>(&self, all: &'s [S], pc: usize) -> &'s [S] {
        let kq = self.kc.min(self.ks.1 - pc).div_ceil(self.per);
        let np = self.padded().1;
        let off = (pc - self.ks.0) / self.per * np;
        &all[off..off + np * kq]
    }
}

/// A packing buffer shared by the threads of one product: the [`Prologue`]'s tasks write
/// disjoint parts of it, then the blocks of `C` read it. It borrows the caller's buffer until
/// the product is done.
#[derive(Clone, Copy)]
pub(crate) struct PackView<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: `PackView` is a pointer into a `&mut [T]` borrowed until every task of the product is
// done; threads write only disjoint parts of it, and read it only after every write is done (see
// `part_mut` and `all`), as with disjoint `&mut` sub-slices handed out and then shared.
unsafe impl<T: Send> Send for PackView<T> {}
// SAFETY: as for `Send`.
unsafe impl<T: Send + Sync> Sync for PackView<T> {}

impl<T> PackView<T> {
    pub(crate) fn new(v: &mut [T]) -> Self {
        PackView {
            ptr: v.as_mut_ptr(),
            len: v.len(),
        }
    }

    /// Values `start..start + len`, to write.
    ///
    /// # Safety
    /// The caller owns this part: no other reference to it is alive (the prologue's tasks write
    /// disjoint parts, and no block reads before they are all done).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn part_mut(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start <= self.len && len <= self.len - start);
        // SAFETY: in bounds (asserted above); exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.wrapping_add(start), len) }
    }

    /// All the values, to read.
    ///
    /// # Safety
    /// No thread writes them while the slice lives: every task of the prologue is done.
    pub(crate) unsafe fn all(&self) -> &[T] {
        // SAFETY: the borrowed buffer; no writes by the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}
