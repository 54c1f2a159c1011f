//! [`dense`]: a dfdx `Linear`'s parameters applied as one fused op on the tape (optionally with a
//! `ReLU`), computed by mpx's GEMM in f32 and rounded once to the precision `P`.
//!
//! This is what [`MultiHeadAttention`](super::MultiHeadAttention) and
//! [`TransformerEncoderBlock`](super::TransformerEncoderBlock) run their projections and
//! feed-forward layers on in half precision: their fields stay dfdx's `Linear`, whose `weight`
//! and `bias` tensors (same ids, so the same gradient entries) are passed here.
//!
//! - forward: `y = round_P(act(x·Wᵀ + b))`, the sums in f32 (f16 and bf16 values are exact in f32);
//! - backward: `dZ = dY` (masked where the `ReLU` was off), `db += Σ dZ`, `dW += dZᵀ·X`,
//!   `dX += dZ·W`, each summed in f32 and rounded once into its gradient entry. The `ReLU` mask
//!   (one bit per output) and the masked bias-gradient pass are the fused `Linear`'s kernels.

use dfdx::shapes::{HasShape, Rank1, Rank2, Shape};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Tape, Tensor, TensorFromVec};
use dfdx::tensor_ops::{Device, ReshapeTo};

use super::half_ops::{accumulate, grad_slice, narrow, shape_err, widen};
use crate::kernels::{MatRef, ReluMask, gemm, relu_mask_bias_grad_f32};
use crate::precision::Precision;

/// `act(x·Wᵀ + b)` over the last axis of `x` (which must have `I` values), shaped `out`; `ReLU`
/// when `relu`.
pub(crate) fn dense<P, E, const I: usize, const O: usize, Sx, Sy, T>(
    weight: &Tensor<Rank2<O, I>, E, Cpu>,
    bias: &Tensor<Rank1<O>, E, Cpu>,
    relu: bool,
    x: Tensor<Sx, E, Cpu, T>,
    out: Sy,
) -> Result<Tensor<Sy, E, Cpu, T>, CpuError>
where
    P: Precision<Elem = E>,
    E: Precision<Elem = E> + dfdx::shapes::Dtype,
    Cpu: Device<E>,
    Sx: Shape,
    Sy: Shape,
    T: Tape<E, Cpu>,
{
    let (x, mut tape) = x.try_contiguous()?.split_tape();
    let rows = x.shape().num_elements() / I;
    let (x32, w32, b32) = (widen(&x), widen(weight), widen(bias));
    let mut z = vec![0.0f32; rows * O];
    gemm(
        MatRef::row_major_f32(&x32, rows, I).map_err(shape_err)?,
        MatRef::row_major_f32(&w32, O, I).map_err(shape_err)?.t(),
        &mut z,
        false,
    )
    .map_err(shape_err)?;
    drop(x32);
    for row in z.chunks_exact_mut(O) {
        for (v, b) in row.iter_mut().zip(&b32) {
            *v += b;
            if relu && *v < 0.0 {
                *v = 0.0;
            }
        }
    }
    let mask = (T::OWNS_TAPE && relu).then(|| ReluMask::from_f32(&z));
    let y = x.device().try_tensor_from_vec(narrow::<P>(&z), out)?;
    drop(z);
    if T::OWNS_TAPE {
        // Kept for the backward: the input and weight tensors (shared, not copied), the mask.
        let (x_id, w_id, b_id, y_id, w) = (
            x.ghost(),
            weight.ghost(),
            bias.ghost(),
            y.ghost(),
            weight.clone(),
        );
        tape.add_backward_op(move |grads| {
            let mut dz = vec![0.0f32; rows * O];
            E::widen(grad_slice::<E>(grads.get_or_alloc_mut(&y_id)?), &mut dz);
            let mut db = vec![0.0f32; O];
            relu_mask_bias_grad_f32(&mut dz, mask.as_ref(), &mut db).map_err(shape_err)?;
            accumulate::<P>(grad_slice::<E>(grads.get_or_alloc_mut(&b_id)?), &db);
            let x32 = widen(&x);
            let mut dw = vec![0.0f32; O * I];
            gemm(
                MatRef::row_major_f32(&dz, rows, O).map_err(shape_err)?.t(),
                MatRef::row_major_f32(&x32, rows, I).map_err(shape_err)?,
                &mut dw,
                false,
            )
            .map_err(shape_err)?;
            accumulate::<P>(grad_slice::<E>(grads.get_or_alloc_mut(&w_id)?), &dw);
            let mut dx = x32;
            gemm(
                MatRef::row_major_f32(&dz, rows, O).map_err(shape_err)?,
                MatRef::row_major_f32(&widen(&w), O, I).map_err(shape_err)?,
                &mut dx,
                false,
            )
            .map_err(shape_err)?;
            accumulate::<P>(grad_slice::<E>(grads.get_or_alloc_mut(&x_id)?), &dx);
            Ok(())
        });
    }
    Ok(y.put_tape(tape))
}
