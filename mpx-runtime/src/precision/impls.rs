//! The four precisions: `f32`, `f16`, `AMP<f16>` and emulated `bf16`.

use dfdx::dtypes::AMP;
use half::{bf16, f16};

use mpx_kernels::{amp, convert};

use super::slices::sized;
use super::{DType, FloatSlice, FloatSliceMut, HalfPrecision, Precision, sealed};

impl sealed::Sealed for f32 {
    fn scratch<'a>(tmp32: &'a mut Vec<f32>, _: &'a mut Vec<f16>, n: usize) -> &'a mut [f32] {
        sized(tmp32, n)
    }
}
impl sealed::Sealed for f16 {
    fn scratch<'a>(_: &'a mut Vec<f32>, tmp16: &'a mut Vec<f16>, n: usize) -> &'a mut [f16] {
        sized(tmp16, n)
    }
}
impl sealed::Sealed for AMP<f16> {
    fn scratch<'a>(_: &'a mut Vec<f32>, tmp16: &'a mut Vec<f16>, n: usize) -> &'a mut [AMP<f16>] {
        amp::from_f16_mut(sized(tmp16, n))
    }
}
impl sealed::Sealed for bf16 {
    fn scratch<'a>(tmp32: &'a mut Vec<f32>, _: &'a mut Vec<f16>, n: usize) -> &'a mut [f32] {
        sized(tmp32, n)
    }
}

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
    fn floats(values: &[f32]) -> FloatSlice<'_> {
        FloatSlice::F32(values)
    }
    fn floats_mut(values: &mut [f32]) -> FloatSliceMut<'_> {
        FloatSliceMut::F32(values)
    }
    fn share<S: dfdx::shapes::Shape, D: dfdx::tensor::Storage<f32>>(
        t: &dfdx::tensor::Tensor<S, f32, D>,
    ) -> Option<dfdx::tensor::Tensor<S, f32, D>> {
        Some(t.clone())
    }
}

impl Precision for f16 {
    type Elem = f16;
    const DTYPE: DType = DType::Float16;
    const IDENTITY: bool = false;
    fn round(src: &[f32], dst: &mut [f16]) {
        convert::round_f16(src, dst);
    }
    fn widen(src: &[f16], dst: &mut [f32]) {
        convert::widen_f16(src, dst);
    }
    fn floats(values: &[f16]) -> FloatSlice<'_> {
        FloatSlice::F16(values)
    }
    fn floats_mut(values: &mut [f16]) -> FloatSliceMut<'_> {
        FloatSliceMut::F16(values)
    }
    fn share<S: dfdx::shapes::Shape, D: dfdx::tensor::Storage<f32> + dfdx::tensor::Storage<f16>>(
        _: &dfdx::tensor::Tensor<S, f32, D>,
    ) -> Option<dfdx::tensor::Tensor<S, f16, D>> {
        None
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
        convert::round_f16(src, amp::as_f16_mut(dst));
    }
    fn widen(src: &[AMP<f16>], dst: &mut [f32]) {
        convert::widen_f16(amp::as_f16(src), dst);
    }
    fn floats(values: &[AMP<f16>]) -> FloatSlice<'_> {
        FloatSlice::F16(amp::as_f16(values))
    }
    fn floats_mut(values: &mut [AMP<f16>]) -> FloatSliceMut<'_> {
        FloatSliceMut::F16(amp::as_f16_mut(values))
    }
    fn share<
        S: dfdx::shapes::Shape,
        D: dfdx::tensor::Storage<f32> + dfdx::tensor::Storage<AMP<f16>>,
    >(
        _: &dfdx::tensor::Tensor<S, f32, D>,
    ) -> Option<dfdx::tensor::Tensor<S, AMP<f16>, D>> {
        None
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
        convert::round_bf16(src, dst);
    }
    fn widen(src: &[f32], dst: &mut [f32]) {
        convert::round_bf16(src, dst);
    }
    fn floats(values: &[f32]) -> FloatSlice<'_> {
        FloatSlice::Bf16(values)
    }
    fn floats_mut(values: &mut [f32]) -> FloatSliceMut<'_> {
        FloatSliceMut::F32(values)
    }
    fn share<S: dfdx::shapes::Shape, D: dfdx::tensor::Storage<f32> + dfdx::tensor::Storage<f32>>(
        _: &dfdx::tensor::Tensor<S, f32, D>,
    ) -> Option<dfdx::tensor::Tensor<S, f32, D>> {
        None
    }
}
impl HalfPrecision for bf16 {
    const EMULATED: bool = true;
    const MAX: f32 = 3.389_531_4e38;
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::slice::HalfFloatSliceExt;

    #[test]
    fn every_view_of_a_precision_agrees_with_its_storage() {
        // floats and floats_mut see the same values round and widen produce.
        let src = [1.5f32, -2.0, 65504.0];
        let mut h = [AMP(f16::ZERO); 3];
        <AMP<f16>>::round(&src, &mut h);
        let FloatSlice::F16(b) = <AMP<f16>>::floats(&h) else {
            panic!("AMP<f16> values are binary16")
        };
        assert_eq!(b.reinterpret_cast(), [0x3e00, 0xc000, 0x7bff]);
        assert!(matches!(<AMP<f16>>::floats(&h), FloatSlice::F16(v) if v[2] == f16::MAX));
        let mut e = [1.0f32 + 1.0 / 512.0];
        assert!(matches!(bf16::floats(&e), FloatSlice::Bf16(_)));
        assert_eq!(
            <AMP<f16> as sealed::Sealed>::scratch(&mut Vec::new(), &mut Vec::new(), 3).len(),
            3
        );
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
