// `Precision` is sealed: a user type cannot become an mpx precision, even with every item written.
use mpx::precision::DType;
use mpx::precision::FloatSlice;
use mpx::precision::FloatSliceMut;
use mpx::precision::Precision;

#[derive(Clone, Copy, Debug)]
struct Int8;

impl Precision for Int8 {
    type Elem = f32;
    const DTYPE: DType = DType::Float32;
    const IDENTITY: bool = false;
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
        _: &dfdx::tensor::Tensor<S, f32, D>,
    ) -> Option<dfdx::tensor::Tensor<S, f32, D>> {
        None
    }
}

fn main() {}
