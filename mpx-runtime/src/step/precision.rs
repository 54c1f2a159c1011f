//! The precisions a mixed step can run its working copy in, and the per-precision slice work the
//! step does: widening the model output to f32 and moving gradients to the master.

use dfdx::dtypes::AMP;
use dfdx::tensor::{Cpu, Storage};
use half::f16;

use crate::finite::{unscale_in_place_checked, unscale_into_checked};
use crate::precision::{Precision, bf16, round_to_bf16};

/// A precision the working copy of a mixed step can be stored in: [`f16`](struct@crate::precision::f16), [`AMP<f16>`],
/// emulated [`bf16`], or `f32` (the last one is for checking the machinery: with scale 1 it
/// reproduces a plain f32 step bit for bit).
///
/// # Examples
/// ```
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::step::StepPrecision;
/// let mut out = [0.0f32; 2];
/// // widen the half output to f32, then unscale 2^10-scaled gradients into the master's f32
/// <f16 as StepPrecision>::widen(&[f16::from_f32(1.5), f16::from_f32(-2.0)], &mut out);
/// assert_eq!(out, [1.5, -2.0]);
/// let finite = <f16 as StepPrecision>::transfer(&[f16::from_f32(1024.0), f16::INFINITY], 1.0 / 1024.0, &mut out);
/// assert_eq!((finite, out[0]), (false, 1.0));
/// ```
pub trait StepPrecision: Precision {
    /// `true` when casting to this precision changes nothing (only `f32`): the working copy then
    /// shares the master's buffers instead of copying them, and the gradients are checked and
    /// unscaled where they are (mpx's `use_mixed_precision=False` path casts nothing either).
    const IDENTITY: bool;

    /// The working copy's gradient buffer (dfdx's private CPU vector) as a slice.
    fn grad_slice(buf: &mut <Cpu as Storage<Self::Elem>>::Vec) -> &mut [Self::Elem]
    where
        Cpu: Storage<Self::Elem>;

    /// Widens values of this precision into f32 (exact). Emulated bf16 rounds its f32 storage to
    /// bf16 here: this is where a real bf16 tensor would be cast.
    fn widen(src: &[Self::Elem], dst: &mut [f32]);

    /// Moves scaled working-copy gradients into f32 master gradients in one pass: widen (emulated
    /// bf16: round to bf16 first), check finiteness on the scaled values, multiply by `inv_scale`.
    /// Returns `true` when every value was finite. `src` and `dst` have the same length.
    fn transfer(src: &[Self::Elem], inv_scale: f32, dst: &mut [f32]) -> bool;

    /// Checks finiteness and multiplies by `inv_scale` in place (the [`IDENTITY`] path),
    /// chunk by chunk through f32: widen, unscale and check, round back, and check again (a
    /// value can overflow when it is rounded back). Returns `true` when every value was finite.
    ///
    /// [`IDENTITY`]: StepPrecision::IDENTITY
    fn unscale_in_place(values: &mut [Self::Elem], inv_scale: f32) -> bool {
        let mut buf = [0.0f32; 1024];
        let mut finite = true;
        for chunk in values.chunks_mut(buf.len()) {
            let tmp = &mut buf[..chunk.len()];
            Self::widen(chunk, tmp);
            finite &= unscale_in_place_checked(tmp, inv_scale);
            Self::from_f32_slice(tmp, chunk);
            finite &= crate::finite::all_finite_slice(chunk);
        }
        finite
    }
}

fn checked<E: crate::precision::FloatElement>(src: &[E], inv_scale: f32, dst: &mut [f32]) -> bool {
    // Lengths match by construction (the workspace checks them before calling); a mismatch would
    // be reported as not finite rather than panic.
    unscale_into_checked(src, inv_scale, dst).unwrap_or(false)
}

impl StepPrecision for f32 {
    const IDENTITY: bool = true;
    fn unscale_in_place(values: &mut [f32], inv_scale: f32) -> bool {
        unscale_in_place_checked(values, inv_scale)
    }
    fn grad_slice(buf: &mut <Cpu as Storage<f32>>::Vec) -> &mut [f32] {
        buf
    }
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn transfer(src: &[f32], inv_scale: f32, dst: &mut [f32]) -> bool {
        checked(src, inv_scale, dst)
    }
}

impl StepPrecision for f16 {
    const IDENTITY: bool = false;
    fn grad_slice(buf: &mut <Cpu as Storage<f16>>::Vec) -> &mut [f16] {
        buf
    }
    fn widen(src: &[f16], dst: &mut [f32]) {
        <f16 as crate::precision::FloatElement>::to_f32_slice(src, dst);
    }
    fn transfer(src: &[f16], inv_scale: f32, dst: &mut [f32]) -> bool {
        checked(src, inv_scale, dst)
    }
}

impl StepPrecision for AMP<f16> {
    const IDENTITY: bool = false;
    fn grad_slice(buf: &mut <Cpu as Storage<AMP<f16>>>::Vec) -> &mut [AMP<f16>] {
        buf
    }
    fn widen(src: &[AMP<f16>], dst: &mut [f32]) {
        <AMP<f16> as crate::precision::FloatElement>::to_f32_slice(src, dst);
    }
    fn transfer(src: &[AMP<f16>], inv_scale: f32, dst: &mut [f32]) -> bool {
        checked(src, inv_scale, dst)
    }
}

impl StepPrecision for bf16 {
    const IDENTITY: bool = false;
    fn grad_slice(buf: &mut <Cpu as Storage<f32>>::Vec) -> &mut [f32] {
        buf
    }
    fn widen(src: &[f32], dst: &mut [f32]) {
        round_to_bf16(src, dst);
    }
    fn transfer(src: &[f32], inv_scale: f32, dst: &mut [f32]) -> bool {
        round_to_bf16(src, dst);
        unscale_in_place_checked(dst, inv_scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_place_unscale_reports_a_value_that_overflows_when_rounded_back() {
        // 60000 * 2 = 120000 is finite in f32 but not in f16 (max 65504).
        let mut v = [f16::from_f32(60000.0), f16::from_f32(1.0)];
        assert!(!<f16 as StepPrecision>::unscale_in_place(&mut v, 2.0));
        let mut v = [f16::from_f32(1024.0), f16::from_f32(-3.0)];
        assert!(<f16 as StepPrecision>::unscale_in_place(
            &mut v,
            1.0 / 1024.0
        ));
        assert_eq!(v, [f16::ONE, f16::from_f32(-3.0 / 1024.0)]);
        let mut a = [AMP(f16::from_f32(60000.0))];
        assert!(!<AMP<f16> as StepPrecision>::unscale_in_place(&mut a, 2.0));
        // Emulated bf16 rounds to bf16 first (1 + 2^-9 -> 1), then unscales.
        let mut b = [1.0 + 1.0 / 512.0, f32::NAN];
        assert!(!<bf16 as StepPrecision>::unscale_in_place(&mut b, 0.5));
        assert_eq!(b[0], 0.5);
        let mut f = [3.0f32, 5.0];
        assert!(<f32 as StepPrecision>::unscale_in_place(&mut f, 0.5));
        assert_eq!(f, [1.5, 2.5]);
    }
}
