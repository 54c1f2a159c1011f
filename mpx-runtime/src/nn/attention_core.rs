//! [`attention_core`]: the scaled-softmax attention of all heads, `softmax(q·kᵀ/√d)·v`, as one
//! fused op on the tape, for [`MultiHeadAttention`](super::MultiHeadAttention) in half precision.
//!
//! It reads the projections as they come out of their `Linear`s, `(B, S, heads·d)`, and views
//! each head in place (strided GEMM operands: no permute, no copy), so the tokens it writes are
//! already in the `(B, S1, heads·dv)` layout the output projection reads.
//!
//! Precision, per head:
//! - `scores = q·kᵀ`: mpx's GEMM, products of half values summed in f32, **not rounded**;
//! - `p = softmax(scores / √d)` in f32 (max-subtracted), then rounded to `P` (the weights are the
//!   half operand of the next product, as in dfdx's graph);
//! - `tokens = round_P(p·v)`, summed in f32.
//!
//! Backward, with `dY` the tokens' gradient (widened to f32): `dP = dY·vᵀ`, `dv += pᵀ·dY` (the
//! rounded `p`), `dS = p ⊙ (dP - rowsum(dP ⊙ p)) / √d` in f32 (the f32 `p`), `dq += dS·k`,
//! `dk += dSᵀ·q`; each gradient entry summed in f32 and rounded once to `P`.

use dfdx::shapes::{Const, Dim, HasShape};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Tape, Tensor, TensorFromVec};
use dfdx::tensor_ops::Device;
use mpx_kernels::gemm;

use super::contiguous::contiguous;
use super::half_ops::{accumulate, grad_slice, narrow, shape_err, view, widen};
use super::scratch;
use crate::precision::Precision;

/// A `(B, S, N)` tensor.
type Seq<B, S, const N: usize, E, T> = Tensor<(B, S, Const<N>), E, Cpu, T>;

/// The attention of `q` over `k` and `v` with `heads` heads (which divide `K` and `V`); the
/// tapes of the three are merged into the output's.
pub(crate) fn attention_core<P, E, B, S1, S2, const K: usize, const V: usize, T>(
    q: Seq<B, S1, K, E, T>,
    k: Seq<B, S2, K, E, T>,
    v: Seq<B, S2, V, E, T>,
    heads: usize,
) -> Result<Seq<B, S1, V, E, T>, CpuError>
where
    P: Precision<Elem = E>,
    E: Precision<Elem = E> + dfdx::shapes::Dtype,
    Cpu: Device<E>,
    B: Dim,
    S1: Dim,
    S2: Dim,
    T: Tape<E, Cpu>,
{
    let (q, tq) = contiguous(q)?.split_tape();
    let (k, tk) = contiguous(k)?.split_tape();
    let (v, tv) = contiguous(v)?.split_tape();
    let mut tape = tq.merge(tk).merge(tv);
    let (b, s1, _) = *q.shape();
    let (nb, n1, n2) = (b.size(), s1.size(), k.shape().1.size());
    let (dk, dv) = (K / heads, V / heads);
    let scale = (1.0 / (dk as f64).sqrt()) as f32;
    let (q32, k32, v32) = (widen(&q), widen(&k), widen(&v));

    // p: f32 softmax weights of every (batch, head), n1 x n2 each
    let block = n1 * n2;
    let mut p = scratch::take::<f32>(nb * heads * block);
    for (bh, pb) in p.chunks_exact_mut(block).enumerate() {
        let (bi, h) = (bh / heads, bh % heads);
        gemm(
            view(&q32, bi * n1 * K + h * dk, n1, dk, K)?,
            view(&k32, bi * n2 * K + h * dk, n2, dk, K)?.t(),
            pb,
            false,
        )
        .map_err(shape_err)?;
        for row in pb.chunks_exact_mut(n2) {
            softmax_row(row, scale);
        }
    }
    drop((q32, k32));
    // the weights as the half type holds them, then widened again for the GEMM
    let mut p_half = scratch::take::<E>(p.len());
    P::round(&p, &mut p_half);
    let mut pr = scratch::take::<f32>(p.len());
    E::widen(&p_half, &mut pr);
    drop(p_half);

    // every (batch, head) writes its own columns of every row: `out` is overwritten whole
    let mut out = scratch::take::<f32>(nb * n1 * V);
    let mut tmp = scratch::take::<f32>(n1 * dv);
    for bh in 0..nb * heads {
        let (bi, h) = (bh / heads, bh % heads);
        gemm(
            view(&pr, bh * block, n1, n2, n2)?,
            view(&v32, bi * n2 * V + h * dv, n2, dv, V)?,
            &mut tmp,
            false,
        )
        .map_err(shape_err)?;
        scatter(&tmp, &mut out, bi * n1 * V + h * dv, dv, V, false);
    }
    drop(v32);
    let y = q
        .device()
        .try_tensor_from_vec(narrow::<P>(&out), (b, s1, Const::<V>))?;
    drop((out, tmp));

    if T::OWNS_TAPE {
        // Kept: q, k, v (the tensors themselves, shared), the f32 and rounded weights.
        let (q_id, k_id, v_id, y_id) = (q.ghost(), k.ghost(), v.ghost(), y.ghost());
        tape.add_backward_op(move |grads| {
            let mut dy = scratch::take::<f32>(nb * n1 * V);
            E::widen(grad_slice::<E>(grads.get_or_alloc_mut(&y_id)?), &mut dy);
            let (q32, k32, v32) = (widen(&q), widen(&k), widen(&v));
            let mut dq = scratch::take_zeroed::<f32>(q32.len());
            let mut dk_all = scratch::take_zeroed::<f32>(k32.len());
            let mut dv_all = scratch::take_zeroed::<f32>(v32.len());
            // overwritten by each GEMM
            let mut ds = scratch::take::<f32>(block);
            let mut tq = scratch::take::<f32>(n1 * dk);
            let mut tk = scratch::take::<f32>(n2 * dk);
            let mut tv = scratch::take::<f32>(n2 * dv);
            for bh in 0..nb * heads {
                let (bi, h) = (bh / heads, bh % heads);
                let (qo, ko, vo, yo) = (
                    bi * n1 * K + h * dk,
                    bi * n2 * K + h * dk,
                    bi * n2 * V + h * dv,
                    bi * n1 * V + h * dv,
                );
                // dP = dY·vᵀ
                gemm(
                    view(&dy, yo, n1, dv, V)?,
                    view(&v32, vo, n2, dv, V)?.t(),
                    &mut ds,
                    false,
                )
                .map_err(shape_err)?;
                // dv += pᵀ·dY (the rounded weights the forward multiplied by)
                gemm(
                    view(&pr, bh * block, n1, n2, n2)?.t(),
                    view(&dy, yo, n1, dv, V)?,
                    &mut tv,
                    false,
                )
                .map_err(shape_err)?;
                scatter(&tv, &mut dv_all, vo, dv, V, true);
                // dS = p ⊙ (dP - rowsum(dP ⊙ p)) · scale
                let pb = &p[bh * block..(bh + 1) * block];
                for (drow, prow) in ds.chunks_exact_mut(n2).zip(pb.chunks_exact(n2)) {
                    softmax_row_grad(drow, prow, scale);
                }
                // dq += dS·k, dk += dSᵀ·q
                gemm(
                    view(&ds, 0, n1, n2, n2)?,
                    view(&k32, ko, n2, dk, K)?,
                    &mut tq,
                    false,
                )
                .map_err(shape_err)?;
                scatter(&tq, &mut dq, qo, dk, K, true);
                gemm(
                    view(&ds, 0, n1, n2, n2)?.t(),
                    view(&q32, qo, n1, dk, K)?,
                    &mut tk,
                    false,
                )
                .map_err(shape_err)?;
                scatter(&tk, &mut dk_all, ko, dk, K, true);
            }
            accumulate::<P>(grad_slice::<E>(grads.get_or_alloc_mut(&q_id)?), &dq)?;
            accumulate::<P>(grad_slice::<E>(grads.get_or_alloc_mut(&k_id)?), &dk_all)?;
            accumulate::<P>(grad_slice::<E>(grads.get_or_alloc_mut(&v_id)?), &dv_all)?;
            Ok(())
        });
    }
    Ok(y.put_tape(tape))
}

/// `row = softmax(row · scale)` in f32, the maximum subtracted first.
fn softmax_row(row: &mut [f32], scale: f32) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(v * scale));
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v * scale - max).exp();
        sum += *v;
    }
    for v in row.iter_mut() {
        *v /= sum;
    }
}

/// The gradient of `softmax(s · scale)` at softmax output `p`, given `dp` (overwritten with `ds`).
fn softmax_row_grad(dp: &mut [f32], p: &[f32], scale: f32) {
    let dot: f32 = dp.iter().zip(p).map(|(d, p)| d * p).sum();
    for (d, p) in dp.iter_mut().zip(p) {
        *d = p * (*d - dot) * scale;
    }
}

/// Writes (or adds) a row-major `rows x cols` block into `dst` at `offset`, rows `stride` apart.
fn scatter(src: &[f32], dst: &mut [f32], offset: usize, cols: usize, stride: usize, add: bool) {
    for (r, row) in src.chunks_exact(cols).enumerate() {
        let d = &mut dst[offset + r * stride..offset + r * stride + cols];
        if add {
            for (a, b) in d.iter_mut().zip(row) {
                *a += b;
            }
        } else {
            d.copy_from_slice(row);
        }
    }
}
