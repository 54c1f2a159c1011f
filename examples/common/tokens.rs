//! The token-classification batch the transformer benchmarks train on, the same on every machine
//! and device: token ids from [`uniform`](super::measure::uniform) and one-hot labels.

use dfdx::prelude::*;

/// A `B x S` batch of token ids below `V` and its `B x C` one-hot labels (row `i` is class
/// `i % C`), on `dev`.
pub fn batch<const B: usize, const S: usize, const V: usize, const C: usize, D>(
    dev: &D,
) -> (Tensor<Rank2<B, S>, usize, D>, Tensor<Rank2<B, C>, f32, D>)
where
    D: TensorFromVec<usize> + TensorFromVec<f32>,
{
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let ids = super::measure::uniform(B * S)
        .map(|u| ((u + 0.5) * V as f32) as usize % V)
        .collect();
    let mut onehot = vec![0.0f32; B * C];
    for i in 0..B {
        onehot[i * C + i % C] = 1.0;
    }
    (
        dev.tensor_from_vec(ids, (Const, Const)),
        dev.tensor_from_vec(onehot, (Const, Const)),
    )
}
