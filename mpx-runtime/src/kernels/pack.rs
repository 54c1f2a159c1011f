//! Packing of operand blocks into the micro-panels a micro-kernel reads: `mr` rows of A or `nr`
//! columns of B per panel, k-major, zero-padded. Safe Rust; the layouts with one contiguous
//! direction (every operand of a Linear layer) copy or scatter along it without per-element
//! index arithmetic.

/// A prepared operand: values in the packed type, with strides.
#[derive(Clone, Copy)]
pub(crate) struct Src<'a, T> {
    pub(crate) data: &'a [T],
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

/// Packs rows `ic..ic+mc`, columns `pc..pc+kc` of A into micro-panels of `mr` rows, k-major
/// (`pack[panel][p][i]`), zero-padding the last panel.
pub(crate) fn pack_a<T: Copy + Default>(
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
        panel_of(panel, a, r0, rows, pc, kc, mr, a.rs, a.cs);
    }
}

/// Packs rows `pc..pc+kc`, columns `jc..jc+nc` of B into micro-panels of `nr` columns, k-major
/// (`pack[panel][p][j]`), zero-padding the last panel.
pub(crate) fn pack_b<T: Copy + Default>(
    pack: &mut [T],
    b: Src<'_, T>,
    (pc, kc): (usize, usize),
    (jc, nc): (usize, usize),
    nr: usize,
) {
    for jp in 0..nc.div_ceil(nr) {
        let panel = &mut pack[jp * nr * kc..(jp + 1) * nr * kc];
        let c0 = jc + jp * nr;
        let cols = nr.min(jc + nc - c0);
        // B's columns play the part of A's rows: swap the strides
        panel_of(panel, b, c0, cols, pc, kc, nr, b.cs, b.rs);
    }
}

/// One panel: `lines` lines (rows of A or columns of B) from `l0`, each `kc` values from `pc`;
/// `ls` is the stride between lines, `ks` along k. `panel[p * width + l]`, lines past `lines`
/// zero.
#[allow(clippy::too_many_arguments)]
fn panel_of<T: Copy + Default>(
    panel: &mut [T],
    src: Src<'_, T>,
    l0: usize,
    lines: usize,
    pc: usize,
    kc: usize,
    width: usize,
    ls: usize,
    ks: usize,
) {
    let data = src.data;
    if ls == 1 {
        // lines contiguous: one copy of `lines` values per k
        for (p, dst) in panel.chunks_exact_mut(width).enumerate() {
            let start = (pc + p) * ks + l0;
            dst[..lines].copy_from_slice(&data[start..start + lines]);
            dst[lines..].fill(T::default());
        }
        return;
    }
    if lines < width {
        panel.fill(T::default());
    }
    if ks == 1 {
        // k contiguous: each line is one slice, scattered with stride `width`
        for l in 0..lines {
            let start = (l0 + l) * ls + pc;
            let line = &data[start..start + kc];
            for (dst, &v) in panel.chunks_exact_mut(width).zip(line) {
                dst[l] = v;
            }
        }
    } else {
        for l in 0..lines {
            let base = (l0 + l) * ls + pc * ks;
            for (p, dst) in panel.chunks_exact_mut(width).enumerate() {
                dst[l] = data[base + p * ks];
            }
        }
    }
}
