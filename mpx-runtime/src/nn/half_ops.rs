//! Shared pieces of the fused half-precision tape ops ([`dense`](super::dense_op),
//! [`attention_core`](super::attention_core), [`layer_norm_kernel`](super::layer_norm_kernel)):
//! widening a tensor to f32, rounding an f32 sum into a gradient entry once, strided head views
//! for mpx's GEMM.

use std::any::TypeId;

use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, Storage, Tensor};

use crate::kernels::{KernelError, MatRef, Operand};
use crate::precision::Precision;

/// `true` for the f32 precision itself (`P = f32`): the layers then keep dfdx's own operations,
/// bit-identical to dfdx's layers; every other precision (f16, `AMP<f16>`, emulated bf16) runs
/// the fused ops.
pub(crate) fn is_f32<P: Precision>() -> bool {
    TypeId::of::<P>() == TypeId::of::<f32>()
}

/// A tensor's values (in logical order; the caller makes it contiguous first) widened to f32.
pub(crate) fn widen<S: Shape, E: Precision<Elem = E> + dfdx::shapes::Dtype, T>(
    t: &Tensor<S, E, Cpu, T>,
) -> Vec<f32> {
    let n = t.shape().num_elements();
    let mut h = vec![E::default(); n];
    t.copy_into(&mut h);
    let mut v = vec![0.0f32; n];
    E::widen(&h, &mut v);
    v
}

/// f32 values rounded to `P` (the values a half tensor of `P` holds).
pub(crate) fn narrow<P: Precision>(v: &[f32]) -> Vec<P::Elem> {
    let mut out = vec![P::Elem::default(); v.len()];
    P::round(v, &mut out);
    out
}

/// A gradient entry as a slice (outside the `Cpu: Device<E>` bound, under which the storage type
/// does not resolve).
pub(crate) fn grad_slice<E: Precision<Elem = E> + dfdx::shapes::Dtype>(
    v: &mut <Cpu as Storage<E>>::Vec,
) -> &mut [E] {
    &mut v[..]
}

/// `dst = round_P(dst + add)`: the gradient already in `dst` and the new contribution summed in
/// f32 and rounded once (as mpx's regions do).
pub(crate) fn accumulate<P: Precision>(dst: &mut [P::Elem], add: &[f32]) {
    let mut sum = vec![0.0f32; dst.len()];
    <P::Elem as Precision>::widen(dst, &mut sum);
    for (s, a) in sum.iter_mut().zip(add) {
        *s += a;
    }
    P::round(&sum, dst);
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
        Operand::F32(&values[offset.min(values.len())..]),
        rows,
        cols,
        row_stride,
        1,
    )
    .map_err(shape_err)
}

/// Kernel errors cannot happen in these ops (the shapes are fixed by the layers' types); should
/// one, it is reported as dfdx's shape error.
pub(crate) fn shape_err(_: KernelError) -> CpuError {
    CpuError::WrongNumElements
}
