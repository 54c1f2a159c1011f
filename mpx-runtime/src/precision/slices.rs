//! Slice views between `AMP<f16>` and `f16`, the bf16 rounding of emulated bf16, and scratch
//! sizing.

use dfdx::dtypes::AMP;
use half::f16;

/// The first `n` values of a scratch buffer, grown when shorter (never shrunk, so a buffer reused
/// for tensors of different sizes is not zeroed again each time). The values are whatever the
/// last use left: callers overwrite them.
pub(crate) fn sized<T: Copy + Default>(buf: &mut Vec<T>, n: usize) -> &mut [T] {
    if buf.len() < n {
        buf.resize(n, T::default());
    }
    &mut buf[..n]
}

/// Views `AMP<f16>` values as plain `f16` (`AMP` is `#[repr(transparent)]`).
pub(crate) fn amp_as_f16(src: &[AMP<f16>]) -> &[f16] {
    // SAFETY: AMP<F> is #[repr(transparent)] over F.
    unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<f16>(), src.len()) }
}

/// Mutable form of [`amp_as_f16`].
pub(crate) fn amp_as_f16_mut(src: &mut [AMP<f16>]) -> &mut [f16] {
    // SAFETY: AMP<F> is #[repr(transparent)] over F.
    unsafe { std::slice::from_raw_parts_mut(src.as_mut_ptr().cast::<f16>(), src.len()) }
}

/// Views plain `f16` values as `AMP<f16>` (the inverse of [`amp_as_f16_mut`]).
pub(crate) fn f16_as_amp_mut(src: &mut [f16]) -> &mut [AMP<f16>] {
    // SAFETY: AMP<F> is #[repr(transparent)] over F.
    unsafe { std::slice::from_raw_parts_mut(src.as_mut_ptr().cast::<AMP<f16>>(), src.len()) }
}

/// Rounds f32 values to the nearest bf16 value (ties to even), keeping f32 storage. NaN stays NaN
/// and values past bf16's max round to infinity, as `half::bf16::from_f32` does.
///
/// # Panics
/// When `src` and `dst` differ in length.
///
/// # Examples
/// ```
/// let mut out = [0.0f32; 1];
/// mpx_runtime::precision::round_to_bf16(&[1.0 + 3.0 / 256.0], &mut out);
/// assert_eq!(out[0], 1.0 + 4.0 / 256.0);
/// ```
pub fn round_to_bf16(src: &[f32], dst: &mut [f32]) {
    assert_eq!(
        src.len(),
        dst.len(),
        "round_to_bf16: slices differ in length"
    );
    // Bit-level round-to-nearest-even on the upper 16 bits; branch-free so it vectorises.
    for (d, s) in dst.iter_mut().zip(src) {
        let b = s.to_bits();
        let is_nan = (b & 0x7fff_ffff) > 0x7f80_0000;
        let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
        let quiet_nan = (b | 0x0040_0000) & 0xffff_0000;
        *d = f32::from_bits(if is_nan { quiet_nan } else { rounded });
    }
}
