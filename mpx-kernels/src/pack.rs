//! Packing of operand blocks into the micro-panels a micro-kernel reads: `mr` rows of A or `nr`
//! columns of B per panel, k-major, zero-padded (where the panels of one product lie and which
//! thread packs which: `packs.rs`). Safe Rust; the layouts with one contiguous
//! direction (every operand of a Linear layer) copy or scatter along it without per-element
//! index arithmetic.

/// A value type the packing loops move. f32 panels of a multiple of 8 lines with k contiguous
/// are transposed with AVX where the CPU has it ([`transpose`](super::transpose)).
pub(crate) trait PackElem: Copy + Default {
    /// Packs a full panel of `width` lines with k contiguous (`ks = 1`) with a faster routine
    /// than the generic loop, if this type has one for this width; returns whether it did.
    fn pack_k_contiguous(panel: &mut [Self], at: &Lines<'_, Self>, width: usize) -> bool {
        let _ = (panel, at, width);
        false
    }
}

impl PackElem for u16 {}

impl PackElem for u32 {}

impl PackElem for f32 {
    fn pack_k_contiguous(panel: &mut [f32], at: &Lines<'_, f32>, width: usize) -> bool {
        super::transpose::lines(panel, at.data, (at.l0, width), (at.pc, at.kc), at.ls)
    }
}

/// A prepared operand: values in the packed type, with strides.
#[derive(Clone, Copy)]
pub(crate) struct Src<'a, T> {
    pub(crate) data: &'a [T],
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

/// Packs rows `ic..ic+mc`, columns `pc..pc+kc` of A into micro-panels of `mr` rows, k-major
/// (`pack[panel][p][i]`), zero-padding the last panel.
pub(crate) fn pack_a<T: PackElem>(
    pack: &mut [T],
    a: Src<'_, T>,
    (ic, mc): (usize, usize),
    (pc, kc): (usize, usize),
    mr: usize,
) {
    for ip in 0..mc.div_ceil(mr) {
        let panel = &mut pack[ip * mr * kc..(ip + 1) * mr * kc];
        let r0 = ic + ip * mr;
        let rows = mr.min(ic + mc - r0);
        panel_of(panel, a, r0, rows, pc, kc, mr);
    }
}

/// Packs rows `pc..pc+kc`, columns `jc..jc+nc` of B into micro-panels of `nr` columns, k-major
/// (`pack[panel][p][j]`), zero-padding the last panel.
pub(crate) fn pack_b<T: PackElem>(
    pack: &mut [T],
    b: Src<'_, T>,
    (pc, kc): (usize, usize),
    (jc, nc): (usize, usize),
    nr: usize,
) {
    // B's columns play the part of A's rows: B packs as Bᵀ (the strides swapped) would as A
    let bt = Src {
        data: b.data,
        rs: b.cs,
        cs: b.rs,
    };
    pack_a(pack, bt, (jc, nc), (pc, kc), nr);
}

/// One panel: `lines` rows of `src` from `l0` (rows of A, or of Bᵀ), each `kc` values from `pc`
/// (`src.rs` apart, `src.cs` between values). `panel[p * width + l]`, lines past `lines`
/// zero. The micro-kernels' widths get code with the width fixed at compile time (no index checks
/// in the inner loops, no library call per small copy).
fn panel_of<T: PackElem>(
    panel: &mut [T],
    src: Src<'_, T>,
    l0: usize,
    lines: usize,
    pc: usize,
    kc: usize,
    width: usize,
) {
    let at = Lines {
        data: src.data,
        l0,
        lines,
        pc,
        kc,
        ls: src.rs,
        ks: src.cs,
    };
    match width {
        4 => panel_w::<T, 4>(panel, at),
        6 => panel_w::<T, 6>(panel, at),
        8 => panel_w::<T, 8>(panel, at),
        16 => panel_w::<T, 16>(panel, at),
        32 => panel_w::<T, 32>(panel, at),
        64 => panel_w::<T, 64>(panel, at),
        _ => panel_any(panel, at, width),
    }
}

/// Where one panel's values are: see [`panel_of`].
#[derive(Clone, Copy)]
#[allow(
    clippy::struct_field_names,
    reason = "`lines` is the panel's line count, named as in `pack_panel`'s docs"
)]
pub(crate) struct Lines<'a, T> {
    data: &'a [T],
    l0: usize,
    lines: usize,
    pc: usize,
    kc: usize,
    ls: usize,
    ks: usize,
}

/// Values along k taken at once when the lines are contiguous along k.
const KSTEP: usize = 8;

/// [`panel_of`] for width `W`.
fn panel_w<T: PackElem, const W: usize>(panel: &mut [T], at: Lines<'_, T>) {
    let Lines {
        data,
        l0,
        lines,
        pc,
        kc,
        ls,
        ks,
    } = at;
    if lines < W || (ls != 1 && ks != 1) {
        return panel_any(panel, at, W);
    }
    let panel = &mut panel[..W * kc];
    if ls == 1 {
        // lines contiguous: one fixed-size copy per k
        for (p, dst) in panel.chunks_exact_mut(W).enumerate() {
            let start = (pc + p) * ks + l0;
            let src: &[T; W] = data[start..start + W].try_into().expect("W values");
            let dst: &mut [T; W] = dst.try_into().expect("chunks of W");
            *dst = *src;
        }
        return;
    }
    // k contiguous: transpose W lines x KSTEP values at a time
    if T::pack_k_contiguous(panel, &at, W) {
        return;
    }
    let line: [&[T]; W] = std::array::from_fn(|l| {
        let start = (l0 + l) * ls + pc;
        &data[start..start + kc]
    });
    let mut chunks = panel.chunks_exact_mut(W * KSTEP);
    for (q, dst) in (&mut chunks).enumerate() {
        let dst = &mut dst[..W * KSTEP]; // a constant length: the index checks below fold away
        for (l, src) in line.iter().enumerate() {
            let v: &[T; KSTEP] = src[q * KSTEP..(q + 1) * KSTEP]
                .try_into()
                .expect("KSTEP values");
            for (p, &x) in v.iter().enumerate() {
                dst[p * W + l] = x;
            }
        }
    }
    let done = kc - kc % KSTEP;
    for (p, dst) in chunks.into_remainder().chunks_exact_mut(W).enumerate() {
        for (d, src) in dst.iter_mut().zip(&line) {
            *d = src[done + p];
        }
    }
}

/// [`panel_of`] for any width, strides and line count.
fn panel_any<T: PackElem>(panel: &mut [T], at: Lines<'_, T>, width: usize) {
    if at.lines < width {
        panel.fill(T::default());
    }
    for l in 0..at.lines {
        let base = (at.l0 + l) * at.ls + at.pc * at.ks;
        for (p, dst) in panel[..width * at.kc].chunks_exact_mut(width).enumerate() {
            dst[l] = at.data[base + p * at.ks];
        }
    }
}
