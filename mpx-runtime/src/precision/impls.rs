//! The four precisions: `f32`, `f16`, `AMP<f16>` and emulated `bf16`.

use dfdx::dtypes::AMP;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::Operand;
use super::slices::{amp_as_f16, amp_as_f16_mut, f16_as_amp_mut, round_to_bf16, sized};
use super::{DType, FloatBits, FloatSliceMut, HalfPrecision, Precision, sealed};

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
    fn scratch<'a>(tmp32: &'a mut Vec<f32>, _: &'a mut Vec<f16>, n: usize) -> &'a mut [f32] {
        sized(tmp32, n)
    }
}

impl Precision for f16 {
    type Elem = f16;
    const DTYPE: DType = DType::Float16;
    const IDENTITY: bool = false;
    fn round(src: &[f32], dst: &mut [f16]) {
        super::convert::round_f16(src, dst);
    }
    fn widen(src: &[f16], dst: &mut [f32]) {
        super::convert::widen_f16(src, dst);
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
        super::convert::round_f16(src, amp_as_f16_mut(dst));
    }
    fn widen(src: &[AMP<f16>], dst: &mut [f32]) {
        super::convert::widen_f16(amp_as_f16(src), dst);
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
