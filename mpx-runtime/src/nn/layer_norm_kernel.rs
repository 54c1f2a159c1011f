//! [`add_layer_norm`]: `LayerNorm(a + b)` over the last axis as one fused op on the tape, for
//! [`LayerNorm1D`](super::LayerNorm1D) and the post-norm residuals of
//! [`TransformerEncoderBlock`](super::TransformerEncoderBlock) in half precision.
//!
//! It reads the half inputs, adds them in f32 (the residual sum is not rounded), computes each
//! row's mean, variance (`mean((z - mean)²)`, as dfdx's `normalize`) and `x̂ = (z - mean) /
//! sqrt(var + eps)` in f32, applies `gamma` and `beta` in f32 and rounds the output once to `P`.
//!
//! Backward, in f32 from the output's gradient `dY`: `dbeta += Σ dY`, `dgamma += Σ dY ⊙ x̂`,
//! `dx̂ = dY ⊙ gamma`, `dz = (dx̂ - mean(dx̂) - x̂ ⊙ mean(dx̂ ⊙ x̂)) / sqrt(var + eps)`; `dz` goes
//! to both `a` and `b`, each gradient entry summed in f32 and rounded once to `P`.

use dfdx::shapes::{HasShape, Rank1, Shape};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Tape, Tensor, TensorFromVec};
use dfdx::tensor_ops::Device;

use super::contiguous::{add_grad, contiguous, operand, values};
use super::half_ops::{accumulate, grad_slice, narrow, widen, widen_values};
use super::scratch;
use crate::precision::Precision;

/// `LayerNorm(a + b)` (or of `a` alone) over the last axis, which must have `M` values; the
/// output carries `a`'s tape.
pub(crate) fn add_layer_norm<P, E, const M: usize, S, T>(
    a: Tensor<S, E, Cpu, T>,
    b: Option<Tensor<S, E, Cpu>>,
    gamma: &Tensor<Rank1<M>, E, Cpu>,
    beta: &Tensor<Rank1<M>, E, Cpu>,
    epsilon: f64,
) -> Result<Tensor<S, E, Cpu, T>, CpuError>
where
    P: Precision<Elem = E>,
    E: Precision<Elem = E> + dfdx::shapes::Dtype,
    Cpu: Device<E>,
    S: Shape,
    T: Tape<E, Cpu>,
{
    let (a, mut tape) = contiguous(a)?.split_tape();
    // the untraced residual read as the binary ops read an operand (a view where it lies, its
    // gradient summed back per buffer element)
    let b = match b {
        Some(b) => {
            let (b, copy_tape) = operand::<T, _, _>(b)?;
            tape = tape.merge(copy_tape);
            Some(b)
        }
        None => None,
    };
    let mut z = widen(&a);
    if let Some((b, vb)) = &b {
        for (z, v) in z
            .iter_mut()
            .zip(widen_values(&values(b, vb.as_ref())?).iter())
        {
            *z += v;
        }
    }
    let (g32, b32) = (widen(gamma), widen(beta));
    let rows = z.len() / M;
    let eps = epsilon as f32;
    // z becomes x̂ in place; rstd per row
    let mut rstd = scratch::take::<f32>(rows);
    let mut y = scratch::take::<f32>(z.len());
    for ((zr, yr), r) in z
        .chunks_exact_mut(M)
        .zip(y.chunks_exact_mut(M))
        .zip(rstd.iter_mut())
    {
        let mean = zr.iter().sum::<f32>() / M as f32;
        let var = zr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / M as f32;
        *r = 1.0 / (var + eps).sqrt();
        for (((x, y), g), bt) in zr.iter_mut().zip(yr).zip(g32.iter()).zip(b32.iter()) {
            *x = (*x - mean) * *r;
            *y = *x * g + bt;
        }
    }
    let out = a
        .device()
        .try_tensor_from_vec(narrow::<P>(&y), *a.shape())?;
    drop(y);
    if T::OWNS_TAPE {
        // Kept: x̂ and 1/std in f32, gamma widened (M values).
        let xhat = z;
        let (a_id, b_id, g_id, bt_id, y_id) = (
            a.ghost(),
            b.as_ref().map(|(b, vb)| (b.ghost(), *vb)),
            gamma.ghost(),
            beta.ghost(),
            out.ghost(),
        );
        drop((a, b));
        tape.add_backward_op(move |grads| {
            let mut dy = scratch::take::<f32>(xhat.len());
            E::widen(grad_slice::<E>(grads.get_or_alloc_mut(&y_id)?), &mut dy);
            let (mut dg, mut db) = (
                scratch::take_zeroed::<f32>(M),
                scratch::take_zeroed::<f32>(M),
            );
            for ((dr, xr), r) in dy
                .chunks_exact_mut(M)
                .zip(xhat.chunks_exact(M))
                .zip(rstd.iter())
            {
                let (mut mean_d, mut mean_dx) = (0.0f32, 0.0f32);
                for (j, (d, x)) in dr.iter_mut().zip(xr).enumerate() {
                    db[j] += *d;
                    dg[j] += *d * x;
                    *d *= g32[j]; // dx̂
                    mean_d += *d;
                    mean_dx += *d * x;
                }
                mean_d /= M as f32;
                mean_dx /= M as f32;
                for (d, x) in dr.iter_mut().zip(xr) {
                    *d = (*d - mean_d - x * mean_dx) * r;
                }
            }
            accumulate::<P>(grad_slice::<E>(grads.get_or_alloc_mut(&g_id)?), &dg)?;
            accumulate::<P>(grad_slice::<E>(grads.get_or_alloc_mut(&bt_id)?), &db)?;
            accumulate::<P>(grad_slice::<E>(grads.get_or_alloc_mut(&a_id)?), &dy)?;
            if let Some((b_id, vb)) = &b_id {
                add_grad::<P, S>(grad_slice(grads.get_or_alloc_mut(b_id)?), vb.as_ref(), &dy)?;
            }
            Ok(())
        });
    }
    Ok(out.put_tape(tape))
}

#[cfg(test)]
mod tests {
    use dfdx::prelude::*;
    use half::f16;

    use super::add_layer_norm;

    /// A residual that is a view (a permuted tensor, untraced) trains: its gradient is the one a
    /// contiguous copy of it gets, laid back out as the view (a permutation's gradient is a copy).
    #[test]
    fn a_residual_view_gets_its_gradient() {
        let dev = Cpu::seed_from_u64(4);
        let a: Tensor<Rank3<2, 3, 4>, f16, Cpu> = dev.sample_normal();
        let r: Tensor<Rank3<2, 4, 3>, f16, Cpu> = dev.sample_normal();
        let w: Tensor<Rank3<2, 3, 4>, f16, Cpu> = dev.sample_normal();
        let (gamma, beta): (Tensor<Rank1<4>, f16, Cpu>, _) =
            (dev.sample_normal(), dev.sample_normal());
        let run = |b: Tensor<Rank3<2, 3, 4>, f16, Cpu>| {
            let y =
                add_layer_norm::<f16, f16, 4, _, _>(a.leaky_trace(), Some(b), &gamma, &beta, 1e-5)
                    .unwrap();
            (y * w.clone()).sum().backward()
        };
        let view = r.clone().permute::<Rank3<2, 3, 4>, Axes3<0, 2, 1>>();
        let g = run(view).get(&r).as_vec();
        let copy = r
            .clone()
            .permute::<Rank3<2, 3, 4>, Axes3<0, 2, 1>>()
            .contiguous();
        let want = run(copy.clone())
            .get(&copy)
            .permute::<Rank3<2, 4, 3>, Axes3<0, 2, 1>>();
        assert!(
            g.iter().any(|v| v.to_f32() != 0.0),
            "the residual got no gradient"
        );
        assert_eq!(g, want.as_vec());
    }
}
