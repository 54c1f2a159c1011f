//! The portable micro-kernel: plain Rust that compilers vectorise for the baseline target.

use super::tile::Micro;

pub(crate) const MR: usize = 4;
pub(crate) const NR: usize = 16;

pub(crate) fn micro() -> Micro<f32> {
    Micro::new(MR, NR, kernel)
}

/// `C[4 x 16] += Apack(kc x 4)ᵀ · Bpack(kc x 16)`: a separate multiply and add per product (`C`
/// not read when `first`).
///
/// # Safety
/// `c` must be valid for reads and writes of `MR` rows of `NR` values at stride `ldc`, untouched
/// by anyone else during the call.
unsafe fn kernel(kc: usize, a: &[f32], b: &[f32], c: *mut f32, ldc: usize, first: bool) {
    let mut acc = [[0.0f32; NR]; MR];
    for (ap, bp) in a[..kc * MR]
        .chunks_exact(MR)
        .zip(b[..kc * NR].chunks_exact(NR))
    {
        for (row, &av) in acc.iter_mut().zip(ap) {
            for (x, &bv) in row.iter_mut().zip(bp) {
                *x += av * bv;
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        let row_ptr = c.wrapping_add(i * ldc);
        // SAFETY: row `i` of the tile: `NR` values the caller guarantees are ours for the call.
        let dst = unsafe { std::slice::from_raw_parts_mut(row_ptr, NR) };
        for (d, s) in dst.iter_mut().zip(row) {
            *d = if first { 0.0 } else { *d } + *s;
        }
    }
}
