// `Precision` is sealed: a user type cannot become an mpx precision, even with every item written.
use mpx::__bench::Operand;
use mpx::precision::DType;
use mpx::precision::f16;
use mpx::precision::{FloatBits, FloatSliceMut, Precision};

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
    fn bits(src: &[f32]) -> FloatBits<'_> {
        <f32 as Precision>::bits(src)
    }
    fn floats_mut(values: &mut [f32]) -> FloatSliceMut<'_> {
        FloatSliceMut::F32(values)
    }
    fn operand(values: &[f32]) -> Operand<'_> {
        Operand::F32(values)
    }
    fn scratch<'a>(tmp32: &'a mut Vec<f32>, _: &'a mut Vec<f16>, n: usize) -> &'a mut [f32] {
        tmp32.resize(n, 0.0);
        &mut tmp32[..n]
    }
}

fn main() {}
