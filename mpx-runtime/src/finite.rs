//! Bit-level finiteness checks over slices and trees: mpx's and jmp's `all_finite`.
//!
//! A value is non-finite (NaN or ±inf) exactly when its exponent bits are all ones. Instead of
//! testing element by element (`iter().all(|x| x.is_finite())`, which branches on every value),
//! the checks here walk a slice in chunks of 4096 elements, fold each chunk with a
//! branch-free OR of `(bits & !SIGN) + (1 << mantissa_bits)` (bit 31 of that sum, or bit 15 for f16,
//! is set exactly when the exponent field is all ones), and look at the folded value once per
//! chunk, leaving early when a chunk holds a non-finite value. The inner loop uses only
//! and/add/or, so the compiler vectorises it even for baseline x86-64 (SSE2).
//! `cargo run --release --example bench_finite` compares it with a memcpy of the same bytes.
//!
//! | function | what it checks |
//! |---|---|
//! | [`all_finite`] | every float leaf of a tree ([`FloatLeaves`]); integer leaves count as finite |
//! | [`all_finite_f32`], [`all_finite_f16`], [`all_finite_slice`] | one slice |
//! | [`floats_finite`] | one leaf, given as a [`FloatSlice`] |
//! | [`unscale_into_checked`] | fused: unscale half/f32 gradients into f32 and check them in one pass |
//! | [`unscale_in_place_checked`] | fused: unscale f32 values in place and check them in one pass |
//!
//! # Examples
//! ```
//! use mpx_runtime::finite::{all_finite_f16, all_finite_f32};
//! use half::f16;
//! assert!(all_finite_f32(&[0.0, -1.5, f32::MAX, f32::MIN_POSITIVE / 4.0]));
//! assert!(!all_finite_f32(&[1.0, f32::NAN]));
//! assert!(!all_finite_f16(&[f16::ONE, f16::INFINITY]));
//! assert!(all_finite_f32(&[])); // empty: finite, as in jmp and mpx
//! ```

use crate::cast::FloatLeaves;
use crate::precision::{FloatSlice, FloatSliceMut, Precision};
use half::f16;

/// Elements per chunk: the checks look for a non-finite value (and may stop) once per chunk.
pub(crate) const CHUNK: usize = 4096;

/// Why a fused unscale could not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FiniteError {
    /// Source and destination slices of different lengths.
    #[error(
        "slice lengths differ: source has {src} elements, destination has {dst}; they must be equal"
    )]
    LengthMismatch {
        /// Length of the source slice.
        src: usize,
        /// Length of the destination slice.
        dst: usize,
    },
}

/// `true` when `bad` finds nothing in any chunk of `values`: it looks once per chunk of [`CHUNK`]
/// values (whole chunks first, so their loop has a fixed length), and stops at the first bad one.
#[inline]
fn no_bad_chunk<T>(values: &[T], bad: impl Fn(&[T]) -> bool) -> bool {
    let mut chunks = values.chunks_exact(CHUNK);
    !chunks.any(&bad) && !bad(chunks.remainder())
}

/// For each float type `$t` (bits `$u`): `fn $finite(values: &[$t]) -> bool`, `true` when no
/// element of `values` is NaN or infinite, and `fn $fold(chunk: &[$t]) -> $u`, which ORs
/// `(b & $abs) + $exp1` over a chunk's bit patterns `b` (`$abs` clears the sign, `$exp1` is the
/// exponent's lowest bit): the top bit `$top` ends up set iff some exponent is all ones (0xff for
/// f32, 0x1f for f16).
macro_rules! finite_by_bits {
    ($($finite:ident, $fold:ident: $t:ty as $u:ty, $abs:literal, $exp1:literal, $top:literal;)+) => {$(
        #[inline]
        fn $finite(values: &[$t]) -> bool {
            no_bad_chunk(values, |c| $fold(c) & $top != 0)
        }

        #[inline]
        fn $fold(chunk: &[$t]) -> $u {
            chunk.iter().fold(0, |acc, x| acc | (x.to_bits() & $abs).wrapping_add($exp1))
        }
    )+};
}

finite_by_bits! {
    finite_f32, fold_f32: f32 as u32, 0x7fff_ffff, 0x0080_0000, 0x8000_0000;
    finite_f16, fold_f16: f16 as u16, 0x7fff, 0x0400, 0x8000;
}

/// `true` when the leaf `values` holds no NaN or infinity (emulated bf16: its f32 storage).
///
/// # Examples
/// ```
/// use mpx_runtime::{finite::floats_finite, precision::Precision};
/// assert!(floats_finite(f32::floats(&[1.0, 2.0])));
/// assert!(!floats_finite(f32::floats(&[1.0, f32::NEG_INFINITY])));
/// ```
pub fn floats_finite(values: FloatSlice<'_>) -> bool {
    match values {
        FloatSlice::F32(v) | FloatSlice::Bf16(v) => finite_f32(v),
        FloatSlice::F16(v) => finite_f16(v),
    }
}

/// `true` when no element of `values` is NaN or infinite (bit-level, chunked; see the module docs).
///
/// # Examples
/// ```
/// use mpx_runtime::finite::all_finite_f32;
/// assert!(all_finite_f32(&[1.0, -0.0, 1e-45]));
/// assert!(!all_finite_f32(&[1.0, f32::INFINITY]));
/// ```
pub fn all_finite_f32(values: &[f32]) -> bool {
    finite_f32(values)
}

/// `true` when no element of `values` is NaN or infinite (bit-level, chunked; see the module docs).
///
/// # Examples
/// ```
/// use half::f16;
/// use mpx_runtime::finite::all_finite_f16;
/// assert!(all_finite_f16(&[f16::MAX, f16::MIN_POSITIVE_SUBNORMAL]));
/// assert!(!all_finite_f16(&[f16::NAN]));
/// ```
pub fn all_finite_f16(values: &[f16]) -> bool {
    finite_f16(values)
}

/// `true` when no element of `values` is NaN or infinite, for any float element (`f32`, `f16`,
/// `AMP<f16>`).
///
/// # Examples
/// ```
/// use half::f16;
/// use mpx_runtime::{finite::all_finite_slice, precision::AMP};
/// assert!(all_finite_slice(&[AMP(f16::ONE)]));
/// assert!(!all_finite_slice(&[0.0f32, f32::NAN]));
/// ```
pub fn all_finite_slice<E: Precision<Elem = E>>(values: &[E]) -> bool {
    floats_finite(E::floats(values))
}

/// `true` when every floating-point leaf of `tree` is free of NaN and infinity: mpx's and jmp's
/// `all_finite`.
///
/// Integer and bool leaves count as finite, and a tree without float leaves is finite (as in jmp
/// and mpx). Stops at the first leaf (and the first chunk) that holds a non-finite value.
///
/// dfdx 0.13 lends no view of a tensor's storage outside its crate, so each tensor leaf is first
/// copied into a reused per-thread buffer and then checked; plain slices are checked in place.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use half::f16;
/// use mpx_runtime::finite::all_finite;
/// let dev: Cpu = Default::default();
/// let labels: Tensor<Rank1<2>, usize, _> = dev.tensor([3, 1]);
/// let grads = (dev.tensor([1.0f32, 2.0]), vec![f16::ONE], labels.clone());
/// assert!(all_finite(&grads));
/// let bad = (dev.tensor([1.0f32, f32::INFINITY]), vec![f16::ONE], labels);
/// assert!(!all_finite(&bad));
/// assert!(all_finite(&())); // no float leaves: finite
/// ```
pub fn all_finite<T: FloatLeaves + ?Sized>(tree: &T) -> bool {
    tree.visit_floats(&mut |values| floats_finite(values))
}

/// Fused unscale and check: writes `src[i] * inv_scale` (computed in f32, after widening `src`
/// exactly to f32) into `dst[i]`, and returns whether every source value **and** every value
/// written was finite.
///
/// This is the one pass a mixed step needs after backward: it reads the scaled half-precision (or
/// f32) gradients once, checks them as mpx does (on the scaled values, before unscaling), and
/// writes the unscaled f32 gradients. It also checks what it writes, the values a step would
/// apply: an `inv_scale` that is not finite (the reciprocal of a scale at or below 2^-128) or a
/// product that overflows f32 (an `inv_scale` above 1) gives `false`, never a "finite" result
/// holding inf or NaN. It works chunk by chunk, so each chunk is widened,
/// checked and multiplied while it sits in cache. `dst` is written in full even when a value is not
/// finite. With `inv_scale == 1.0` values are copied unchanged.
///
/// # Errors
/// [`FiniteError::LengthMismatch`] when `src` and `dst` differ in length (nothing is written).
///
/// # Examples
/// ```
/// use half::f16;
/// use mpx_runtime::finite::unscale_into_checked;
/// let grads = [f16::from_f32(1024.0), f16::from_f32(-2048.0)];
/// let mut out = [0.0f32; 2];
/// assert_eq!(unscale_into_checked(&grads, 1.0 / 1024.0, &mut out), Ok(true));
/// assert_eq!(out, [1.0, -2.0]);
/// let overflowed = [f16::INFINITY, f16::ONE];
/// assert_eq!(unscale_into_checked(&overflowed, 0.5, &mut out), Ok(false));
/// // A finite source with an infinite reciprocal of the scale: what would be applied is not finite.
/// assert_eq!(unscale_into_checked(&grads, f32::INFINITY, &mut out), Ok(false));
/// ```
pub fn unscale_into_checked<E: Precision<Elem = E>>(
    src: &[E],
    inv_scale: f32,
    dst: &mut [f32],
) -> Result<bool, FiniteError> {
    if src.len() != dst.len() {
        return Err(FiniteError::LengthMismatch {
            src: src.len(),
            dst: dst.len(),
        });
    }
    Ok(unscale_stored_into::<E>(src, inv_scale, dst))
}

/// [`unscale_into_checked`] for values stored in precision `P` (emulated bf16: f32 storage,
/// rounded to bf16 as it is widened): the mixed step's move of scaled half gradients into f32
/// master gradients. `true` when every value was finite; slices of different lengths are
/// reported as not finite (the step checks the lengths first).
pub(crate) fn unscale_stored_into<P: Precision>(
    src: &[P::Elem],
    inv_scale: f32,
    dst: &mut [f32],
) -> bool {
    if src.len() != dst.len() {
        return false;
    }
    let mut acc = 0u32;
    for (s, d) in src.chunks(CHUNK).zip(dst.chunks_mut(CHUNK)) {
        P::widen(s, d);
        acc |= unscale_chunk(d, inv_scale);
    }
    acc & 0x8000_0000 == 0
}

/// Checks finiteness and multiplies by `inv_scale` values stored in precision `P`, in place: f32
/// in one pass ([`unscale_in_place_checked`]); other storage chunk by chunk through f32: widen,
/// unscale and check, round back, and check again (a value can overflow when it is rounded
/// back). `true` when every value was finite.
pub(crate) fn unscale_stored_in_place<P: Precision>(
    values: &mut [P::Elem],
    inv_scale: f32,
) -> bool {
    if P::IDENTITY
        && let FloatSliceMut::F32(v) = P::floats_mut(values)
    {
        return unscale_in_place_checked(v, inv_scale);
    }
    let mut buf = [0.0f32; 1024];
    let mut finite = true;
    for chunk in values.chunks_mut(buf.len()) {
        let tmp = &mut buf[..chunk.len()];
        P::widen(chunk, tmp);
        finite &= unscale_in_place_checked(tmp, inv_scale);
        P::round(tmp, chunk);
        finite &= all_finite_slice::<P::Elem>(chunk);
    }
    finite
}

/// Fused unscale and check in place: multiplies every value by `inv_scale` (in f32) and returns
/// whether every value was finite both **before** and **after** the multiply. One pass; see
/// [`unscale_into_checked`].
///
/// # Examples
/// ```
/// use mpx_runtime::finite::unscale_in_place_checked;
/// let mut grads = [4096.0f32, 8.0];
/// assert!(unscale_in_place_checked(&mut grads, 1.0 / 4096.0));
/// assert_eq!(grads, [1.0, 8.0 / 4096.0]);
/// let mut big = [f32::MAX];
/// assert!(!unscale_in_place_checked(&mut big, 2.0)); // overflows to inf when unscaled
/// ```
pub fn unscale_in_place_checked(values: &mut [f32], inv_scale: f32) -> bool {
    let mut acc = 0u32;
    for chunk in values.chunks_mut(CHUNK) {
        acc |= unscale_chunk(chunk, inv_scale);
    }
    acc & 0x8000_0000 == 0
}

/// `dst += src * scale` (f32), returning whether `dst` is finite afterwards: the check is folded
/// into the add, so `dst` is read once. With `scale == 1.0` the values are added unchanged.
/// Pairs beyond the shorter slice are not touched; callers pass equal lengths.
pub(crate) fn add_scaled_checked(dst: &mut [f32], src: &[f32], scale: f32) -> bool {
    let flag = |v: f32| (v.to_bits() & 0x7fff_ffff).wrapping_add(0x0080_0000);
    let mut acc = 0u32;
    if scale == 1.0 {
        for (d, s) in dst.iter_mut().zip(src) {
            *d += *s;
            acc |= flag(*d);
        }
    } else {
        for (d, s) in dst.iter_mut().zip(src) {
            *d += *s * scale;
            acc |= flag(*d);
        }
    }
    acc & 0x8000_0000 == 0
}

/// Multiplies a chunk by `inv` (skipped when `inv == 1`) and returns its finiteness fold: bit 31
/// is set iff a value before or after the multiply is non-finite.
#[inline]
fn unscale_chunk(chunk: &mut [f32], inv: f32) -> u32 {
    if inv == 1.0 {
        return fold_f32(chunk);
    }
    let mut acc = 0u32;
    for x in chunk.iter_mut() {
        let before = x.to_bits();
        *x *= inv;
        acc |= (before & 0x7fff_ffff).wrapping_add(0x0080_0000)
            | (x.to_bits() & 0x7fff_ffff).wrapping_add(0x0080_0000);
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precision::{AMP, bf16};

    #[test]
    fn exponent_boundaries_f32() {
        // Largest finite, smallest inf, NaN with every payload bit, negative forms.
        let f32s = |bits: &[u32]| bits.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>();
        assert!(finite_f32(&f32s(&[
            0x7f7f_ffff,
            0xff7f_ffff,
            0x0000_0001,
            0x8000_0000
        ])));
        for bad in [
            0x7f80_0000u32,
            0xff80_0000,
            0x7fc0_0000,
            0x7f80_0001,
            0xffff_ffff,
        ] {
            let mut v = vec![0.0f32; 3 * CHUNK + 7];
            for i in [0, CHUNK - 1, CHUNK, 3 * CHUNK + 6] {
                v[i] = f32::from_bits(bad);
                assert!(!finite_f32(&v), "{bad:#x} at {i}");
                v[i] = 0.0;
            }
            assert!(finite_f32(&v));
        }
    }

    #[test]
    fn exponent_boundaries_f16() {
        assert!(finite_f16(
            &[0x7bff, 0xfbff, 0x0001, 0x8000].map(f16::from_bits)
        ));
        for bad in [0x7c00u16, 0xfc00, 0x7e00, 0x7c01, 0xffff] {
            let mut v = vec![f16::ZERO; 2 * CHUNK + 3];
            for i in [0, CHUNK, 2 * CHUNK + 2] {
                v[i] = f16::from_bits(bad);
                assert!(!finite_f16(&v), "{bad:#x} at {i}");
                v[i] = f16::ZERO;
            }
        }
    }

    #[test]
    fn fused_checks_before_and_after_unscaling() {
        // 2 * f32::MAX overflows only after an inv_scale > 1: what is applied is not finite.
        let mut v = vec![1.0f32; CHUNK + 1];
        v[CHUNK] = f32::MAX;
        assert!(!unscale_in_place_checked(&mut v, 2.0));
        assert!(v[CHUNK].is_infinite());
        let mut h = [f16::MAX, f16::NAN];
        assert!(!unscale_stored_in_place::<f16>(&mut h, 0.5));
        assert_eq!(h[0], f16::from_f32(32752.0));
        // f16 values finite in f32 after the multiply, but rounding back to f16 overflows.
        let mut h = [f16::ONE, f16::MAX];
        assert!(!unscale_stored_in_place::<f16>(&mut h, 2.0));
        let mut h = [f16::ONE, f16::from_f32(2.0)];
        assert!(unscale_stored_in_place::<f16>(&mut h, 2.0));
        assert_eq!(h, [f16::from_f32(2.0), f16::from_f32(4.0)]);
    }

    #[test]
    fn an_infinite_reciprocal_is_never_finite() {
        // 1 / 1e-40 is inf: finite sources become inf (or NaN for zeros) when unscaled.
        let inv = 1.0 / 1e-40f32;
        assert!(inv.is_infinite());
        let mut v = [1.0f32, 0.0];
        assert!(!unscale_in_place_checked(&mut v, inv));
        let mut v = [0.0f32];
        assert!(!unscale_in_place_checked(&mut v, inv), "0 * inf is NaN");
        let mut h = [f16::ONE];
        assert!(!unscale_stored_in_place::<f16>(&mut h, inv));
        let mut dst = [0.0f32; 2];
        assert_eq!(
            unscale_into_checked(&[f16::ONE, f16::ZERO], inv, &mut dst),
            Ok(false)
        );
        assert_eq!(
            unscale_into_checked(&[1.0f32, 2.0], f32::NAN, &mut dst),
            Ok(false)
        );
    }

    #[test]
    fn in_place_unscale_reports_a_value_that_overflows_when_rounded_back() {
        // 60000 * 2 = 120000 is finite in f32 but not in f16 (max 65504).
        let mut v = [f16::from_f32(60000.0), f16::from_f32(1.0)];
        assert!(!unscale_stored_in_place::<f16>(&mut v, 2.0));
        let mut v = [f16::from_f32(1024.0), f16::from_f32(-3.0)];
        assert!(unscale_stored_in_place::<f16>(&mut v, 1.0 / 1024.0));
        assert_eq!(v, [f16::ONE, f16::from_f32(-3.0 / 1024.0)]);
        let mut a = [AMP(f16::from_f32(60000.0))];
        assert!(!unscale_stored_in_place::<AMP<f16>>(&mut a, 2.0));
        // Emulated bf16 rounds to bf16 first (1 + 2^-9 -> 1), then unscales.
        let mut b = [1.0 + 1.0 / 512.0, f32::NAN];
        assert!(!unscale_stored_in_place::<bf16>(&mut b, 0.5));
        assert_eq!(b[0], 0.5);
        let mut f = [3.0f32, 5.0];
        assert!(unscale_stored_in_place::<f32>(&mut f, 0.5));
        assert_eq!(f, [1.5, 2.5]);
    }
}
