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

/// `Precision` and `HalfPrecision` for a half precision that casts (`IDENTITY` false, `share`
/// gives `None`): its element type and dtype, its format, and the functions on slices of its
/// elements: `round` (f32 values into them), `widen` (back to f32), `floats` and `floats_mut`
/// (how they read as floats).
macro_rules! half_precision {
    (
        $p:ty: Elem = $e:ty, DTYPE = $dtype:ident, EMULATED = $emulated:literal, MAX = $max:expr;
        $round:path, $widen:path, $floats:path, $floats_mut:path $(,)?
    ) => {
        impl Precision for $p {
            type Elem = $e;
            const DTYPE: DType = DType::$dtype;
            const IDENTITY: bool = false;
            fn round(src: &[f32], dst: &mut [$e]) {
                $round(src, dst);
            }
            fn widen(src: &[$e], dst: &mut [f32]) {
                $widen(src, dst);
            }
            fn floats(values: &[$e]) -> FloatSlice<'_> {
                $floats(values)
            }
            fn floats_mut(values: &mut [$e]) -> FloatSliceMut<'_> {
                $floats_mut(values)
            }
            fn share<
                S: dfdx::shapes::Shape,
                D: dfdx::tensor::Storage<f32> + dfdx::tensor::Storage<$e>,
            >(
                _: &dfdx::tensor::Tensor<S, f32, D>,
            ) -> Option<dfdx::tensor::Tensor<S, $e, D>> {
                None
            }
        }
        impl HalfPrecision for $p {
            const EMULATED: bool = $emulated;
            const MAX: f32 = $max;
        }
    };
}

half_precision!(f16: Elem = f16, DTYPE = Float16, EMULATED = false, MAX = 65504.0;
    convert::round_f16, convert::widen_f16, FloatSlice::F16, FloatSliceMut::F16);
half_precision!(AMP<f16>: Elem = AMP<f16>, DTYPE = Float16, EMULATED = false, MAX = 65504.0;
    amp_views::round, amp_views::widen, amp_views::floats, amp_views::floats_mut);
half_precision!(bf16: Elem = f32, DTYPE = BFloat16, EMULATED = true, MAX = 3.389_531_4e38;
    convert::round_bf16, convert::round_bf16, FloatSlice::Bf16, FloatSliceMut::F32);

/// `AMP<f16>`'s functions: f16's, on f16 views of its slices.
mod amp_views {
    use super::{AMP, FloatSlice, FloatSliceMut, amp, f16};

    pub(super) fn round(src: &[f32], dst: &mut [AMP<f16>]) {
        super::convert::round_f16(src, amp::as_f16_mut(dst));
    }
    pub(super) fn widen(src: &[AMP<f16>], dst: &mut [f32]) {
        super::convert::widen_f16(amp::as_f16(src), dst);
    }
    pub(super) fn floats(values: &[AMP<f16>]) -> FloatSlice<'_> {
        FloatSlice::F16(amp::as_f16(values))
    }
    pub(super) fn floats_mut(values: &mut [AMP<f16>]) -> FloatSliceMut<'_> {
        FloatSliceMut::F16(amp::as_f16_mut(values))
    }
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
