//! The four precisions: `f32`, `f16`, `AMP<f16>` and emulated `bf16`.

use dfdx::dtypes::AMP;
use dfdx::tensor::{Cpu, Storage};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::slices::{amp_as_f16, amp_as_f16_mut, f16_as_amp_mut, round_to_bf16, sized};
use super::{FloatBits, FloatSliceMut, HalfPrecision, Precision, sealed};
use crate::finite::{unscale_in_place_checked, unscale_into_checked};
use crate::kernels::Operand;
use crate::policy::DType;

/// The fused widen-check-unscale pass for a precision that stores itself.
fn checked<E: Precision<Elem = E>>(src: &[E], inv_scale: f32, dst: &mut [f32]) -> bool {
    // Lengths match by construction (the workspace checks them before calling); a mismatch would
    // be reported as not finite rather than panic.
    unscale_into_checked(src, inv_scale, dst).unwrap_or(false)
}

impl sealed::Sealed for f32 {}
impl sealed::Sealed for f16 {}
impl sealed::Sealed for AMP<f16> {}
impl sealed::Sealed for bf16 {}

impl Precision for f32 {
    type Elem = f32;
    const DTYPE: DType = DType::Float32;
    const IDENTITY: bool = true;
    fn round(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn bits(src: &[f32]) -> FloatBits<'_> {
        // SAFETY: f32 and u32 have the same size and alignment and every bit pattern is valid.
        FloatBits::F32(unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u32>(), src.len()) })
    }
    fn floats_mut(values: &mut [f32]) -> FloatSliceMut<'_> {
        FloatSliceMut::F32(values)
    }
    fn operand(values: &[f32]) -> Operand<'_> {
        Operand::F32(values)
    }
    fn grad_slice(buf: &mut <Cpu as Storage<f32>>::Vec) -> &mut [f32] {
        buf
    }
    fn transfer(src: &[f32], inv_scale: f32, dst: &mut [f32]) -> bool {
        checked(src, inv_scale, dst)
    }
    fn unscale_in_place(values: &mut [f32], inv_scale: f32) -> bool {
        unscale_in_place_checked(values, inv_scale)
    }
    fn scratch<'a>(tmp32: &'a mut Vec<f32>, _: &'a mut Vec<f16>, n: usize) -> &'a mut [f32] {
        sized(tmp32, n)
    }
}

impl Precision for f16 {
    type Elem = f16;
    const DTYPE: DType = DType::Float16;
    const IDENTITY: bool = false;
    fn round(src: &[f32], dst: &mut [f16]) {
        crate::kernels::round_f16(src, dst);
    }
    fn widen(src: &[f16], dst: &mut [f32]) {
        crate::kernels::widen_f16(src, dst);
    }
    fn bits(src: &[f16]) -> FloatBits<'_> {
        FloatBits::F16(src.reinterpret_cast())
    }
    fn floats_mut(values: &mut [f16]) -> FloatSliceMut<'_> {
        FloatSliceMut::F16(values)
    }
    fn operand(values: &[f16]) -> Operand<'_> {
        Operand::F16(values)
    }
    fn grad_slice(buf: &mut <Cpu as Storage<f16>>::Vec) -> &mut [f16] {
        buf
    }
    fn transfer(src: &[f16], inv_scale: f32, dst: &mut [f32]) -> bool {
        checked(src, inv_scale, dst)
    }
    fn scratch<'a>(_: &'a mut Vec<f32>, tmp16: &'a mut Vec<f16>, n: usize) -> &'a mut [f16] {
        sized(tmp16, n)
    }
}
impl HalfPrecision for f16 {
    const EMULATED: bool = false;
    const MAX: f32 = 65504.0;
}

impl Precision for AMP<f16> {
    type Elem = AMP<f16>;
    const DTYPE: DType = DType::Float16;
    const IDENTITY: bool = false;
    fn round(src: &[f32], dst: &mut [AMP<f16>]) {
        crate::kernels::round_f16(src, amp_as_f16_mut(dst));
    }
    fn widen(src: &[AMP<f16>], dst: &mut [f32]) {
        crate::kernels::widen_f16(amp_as_f16(src), dst);
    }
    fn bits(src: &[AMP<f16>]) -> FloatBits<'_> {
        FloatBits::F16(amp_as_f16(src).reinterpret_cast())
    }
    fn floats_mut(values: &mut [AMP<f16>]) -> FloatSliceMut<'_> {
        FloatSliceMut::F16(amp_as_f16_mut(values))
    }
    fn operand(values: &[AMP<f16>]) -> Operand<'_> {
        Operand::F16(amp_as_f16(values))
    }
    fn grad_slice(buf: &mut <Cpu as Storage<AMP<f16>>>::Vec) -> &mut [AMP<f16>] {
        buf
    }
    fn transfer(src: &[AMP<f16>], inv_scale: f32, dst: &mut [f32]) -> bool {
        checked(src, inv_scale, dst)
    }
    fn scratch<'a>(_: &'a mut Vec<f32>, tmp16: &'a mut Vec<f16>, n: usize) -> &'a mut [AMP<f16>] {
        f16_as_amp_mut(sized(tmp16, n))
    }
}
impl HalfPrecision for AMP<f16> {
    const EMULATED: bool = false;
    const MAX: f32 = 65504.0;
}

impl Precision for bf16 {
    type Elem = f32;
    const DTYPE: DType = DType::BFloat16;
    const IDENTITY: bool = false;
    fn round(src: &[f32], dst: &mut [f32]) {
        round_to_bf16(src, dst);
    }
    fn widen(src: &[f32], dst: &mut [f32]) {
        round_to_bf16(src, dst);
    }
    fn bits(src: &[f32]) -> FloatBits<'_> {
        <f32 as Precision>::bits(src)
    }
    fn floats_mut(values: &mut [f32]) -> FloatSliceMut<'_> {
        FloatSliceMut::F32(values)
    }
    fn operand(values: &[f32]) -> Operand<'_> {
        Operand::Bf16(values)
    }
    fn grad_slice(buf: &mut <Cpu as Storage<f32>>::Vec) -> &mut [f32] {
        buf
    }
    fn transfer(src: &[f32], inv_scale: f32, dst: &mut [f32]) -> bool {
        round_to_bf16(src, dst);
        unscale_in_place_checked(dst, inv_scale)
    }
    fn scratch<'a>(tmp32: &'a mut Vec<f32>, _: &'a mut Vec<f16>, n: usize) -> &'a mut [f32] {
        sized(tmp32, n)
    }
}
impl HalfPrecision for bf16 {
    const EMULATED: bool = true;
    const MAX: f32 = 3.389_531_4e38;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_place_unscale_reports_a_value_that_overflows_when_rounded_back() {
        // 60000 * 2 = 120000 is finite in f32 but not in f16 (max 65504).
        let mut v = [f16::from_f32(60000.0), f16::from_f32(1.0)];
        assert!(!<f16 as Precision>::unscale_in_place(&mut v, 2.0));
        let mut v = [f16::from_f32(1024.0), f16::from_f32(-3.0)];
        assert!(<f16 as Precision>::unscale_in_place(&mut v, 1.0 / 1024.0));
        assert_eq!(v, [f16::ONE, f16::from_f32(-3.0 / 1024.0)]);
        let mut a = [AMP(f16::from_f32(60000.0))];
        assert!(!<AMP<f16> as Precision>::unscale_in_place(&mut a, 2.0));
        // Emulated bf16 rounds to bf16 first (1 + 2^-9 -> 1), then unscales.
        let mut b = [1.0 + 1.0 / 512.0, f32::NAN];
        assert!(!<bf16 as Precision>::unscale_in_place(&mut b, 0.5));
        assert_eq!(b[0], 0.5);
        let mut f = [3.0f32, 5.0];
        assert!(<f32 as Precision>::unscale_in_place(&mut f, 0.5));
        assert_eq!(f, [1.5, 2.5]);
    }

    #[test]
    fn every_view_of_a_precision_agrees_with_its_storage() {
        // bits, floats_mut and operand see the same values round and widen produce.
        let src = [1.5f32, -2.0, 65504.0];
        let mut h = [AMP(f16::ZERO); 3];
        <AMP<f16>>::round(&src, &mut h);
        let FloatBits::F16(b) = <AMP<f16>>::bits(&h) else {
            panic!("AMP<f16> bits are binary16")
        };
        assert_eq!(b, [0x3e00, 0xc000, 0x7bff]);
        assert!(matches!(<AMP<f16>>::operand(&h), Operand::F16(v) if v[2] == f16::MAX));
        let mut e = [1.0f32 + 1.0 / 512.0];
        assert!(matches!(bf16::operand(&e), Operand::Bf16(_)));
        assert!(matches!(bf16::floats_mut(&mut e), FloatSliceMut::F32(_)));
        let mut w = [0.0f32];
        bf16::widen(&e, &mut w);
        assert_eq!(w, [1.0]);
        assert_eq!(
            [f32::DTYPE, f16::DTYPE, <AMP<f16>>::DTYPE, bf16::DTYPE],
            [
                DType::Float32,
                DType::Float16,
                DType::Float16,
                DType::BFloat16
            ]
        );
    }
}
