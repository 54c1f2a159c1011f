//! Shared pieces of the fused half-precision tape ops ([`fused_linear`](super::linear),
//! [`attention_core`](super::attention_core), [`layer_norm_kernel`](super::layer_norm_kernel)):
//! widening a tensor to f32, rounding to the precision in place, rounding an f32 sum into a
//! gradient entry once, strided head views for mpx's GEMM.

use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, Tensor};
use mpx_kernels::{KernelError, MatRef, ReluMask, add_f32_into};

use super::scratch::{self, Buf};
use crate::precision::{FloatSlice, Precision};

/// The values of a tensor (contiguous) in a pooled buffer.
pub(crate) fn read<S: Shape, E: Precision<Elem = E> + dfdx::shapes::Dtype, T>(
    t: &Tensor<S, E, Cpu, T>,
) -> Buf<E> {
    let mut v = scratch::take(t.shape().num_elements());
    t.copy_into(&mut v);
    v
}

/// A tensor's values (in logical order; the caller makes it contiguous first) widened to f32, in
/// a pooled buffer.
pub(crate) fn widen<S: Shape, E: Precision<Elem = E> + dfdx::shapes::Dtype, T>(
    t: &Tensor<S, E, Cpu, T>,
) -> Buf<f32> {
    widen_values(&read(t))
}

/// Values of a precision's storage type widened to f32, in a pooled buffer.
pub(crate) fn widen_values<E: Precision<Elem = E>>(values: &[E]) -> Buf<f32> {
    let mut v = scratch::take::<f32>(values.len());
    E::widen(values, &mut v);
    v
}

/// `ReLU`'s mask of outputs `y`: set where `y > 0` (NaN, zeros and negatives clear).
pub(crate) fn relu_mask_of<E: Precision<Elem = E> + dfdx::shapes::Dtype>(y: &[E]) -> ReluMask {
    match E::floats(y) {
        FloatSlice::F16(v) => ReluMask::from_f16(v),
        FloatSlice::F32(v) | FloatSlice::Bf16(v) => ReluMask::from_f32(v),
    }
}

/// Rounds values of `P`'s storage type to `P` in place: nothing to do for a precision that
/// stores itself (f32, f16, `AMP<f16>`); emulated bf16 (f32 storage) rounds to bf16.
pub(crate) fn round_in_place<P: Precision>(values: &mut [P::Elem]) {
    if P::DTYPE == <P::Elem as Precision>::DTYPE {
        return;
    }
    // widened 256 values at a time into a stack buffer: no allocation
    let mut buf = [0.0f32; 256];
    for chunk in values.chunks_mut(256) {
        let b = &mut buf[..chunk.len()];
        <P::Elem as Precision>::widen(chunk, b);
        P::round(b, chunk);
    }
}

/// f32 values rounded to `P` (the values a half tensor of `P` holds).
pub(crate) fn narrow<P: Precision>(v: &[f32]) -> Vec<P::Elem> {
    let mut out = vec![P::Elem::default(); v.len()];
    P::round(v, &mut out);
    out
}

pub(crate) use crate::cast::grad_slice;

/// `dst = round_P(dst + add)`: the gradient already in `dst` and the new contribution summed in
/// f32 and rounded once (as mpx's regions do).
///
/// # Errors
/// A shape error if the lengths differ.
pub(crate) fn accumulate<P: Precision>(dst: &mut [P::Elem], add: &[f32]) -> Result<(), CpuError> {
    add_f32_into(add, <P::Elem as Precision>::floats_mut(dst)).map_err(shape_err)?;
    round_in_place::<P>(dst);
    Ok(())
}

/// A `rows x cols` f32 view starting at `offset`, rows `row_stride` apart (one head of a
/// `(.., S, heads * cols)` tensor); a shape error if it does not fit in `values`.
pub(crate) fn view(
    values: &[f32],
    offset: usize,
    rows: usize,
    cols: usize,
    row_stride: usize,
) -> Result<MatRef<'_>, CpuError> {
    MatRef::new(
        FloatSlice::F32(&values[offset.min(values.len())..]),
        rows,
        cols,
        row_stride,
        1,
    )
    .map_err(shape_err)
}

/// Kernel errors cannot happen in the fused ops (the shapes are fixed by the layers' types);
/// should one, it is reported as dfdx's shape error.
pub(crate) fn shape_err(_: KernelError) -> CpuError {
    CpuError::WrongNumElements
}
