//! [`Embedding`]: dfdx's `Embedding` as a mixed step's working copy runs it. The rows are
//! gathered as dfdx gathers them (a copy, exact in any precision); the table's gradient is summed
//! in f32, one token's rows at a time, and added to the table's half gradient rounded once per
//! element. dfdx's own f16 backward adds each row to the table one element at a time through
//! `half`'s conversions, rounding after every add.

use dfdx::nn::modules::Embedding as DfdxEmbedding;
use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection, TensorOptions};
use dfdx::nn::{BuildModule, Module, NonMutableModule};
use dfdx::shapes::{Const, Dim, Dtype, Rank2};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Storage, Tape, Tensor};
use dfdx::tensor_ops::{Device, GatherTo};

use super::half_ops::grad_slice;
use super::scratch;
use crate::precision::Precision;

/// dfdx's `Embedding<VOCAB, DIM>`: row `id` of `weight` for each token id, of a sequence `(S,)`
/// or a batch of them `(B, S)`, with dfdx's field, initialisation and visit order. The output is
/// the table's rows as they are; on a tape the table's gradient gets, for each token that
/// occurred, the sum of its rows' output gradients computed in f32 and added to the gradient
/// already there, rounded once per element. A mixed step's working copy runs dfdx's
/// `Embedding` as this in f16 and `AMP<f16>`. A token id outside the vocabulary panics, as in
/// dfdx's own.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::{nn, precision::f16};
/// let dev = Cpu::default();
/// let table = dev.tensor([[1.0f32, 2.0], [3.0, 4.0], [5.0, 6.0]]).to_dtype::<f16>();
/// let emb = nn::Embedding { weight: table.clone() };
/// let ids = dev.tensor([2usize, 0, 2]);
/// let y = emb.forward(ids.leaky_traced());
/// assert_eq!(y.as_vec(), [5.0f32, 6.0, 1.0, 2.0, 5.0, 6.0].map(f16::from_f32));
/// // token 2 occurs twice: its row's gradient is the sum of both, token 1's is zero
/// let g = (y * 0.5).sum().backward();
/// assert_eq!(g.get(&emb.weight).as_vec(), [0.5f32, 0.5, 0.0, 0.0, 1.0, 1.0].map(f16::from_f32));
/// ```
#[derive(Debug, Clone)]
pub struct Embedding<const VOCAB: usize, const DIM: usize, E: Dtype, D: Storage<E>> {
    /// One row per token id.
    pub weight: Tensor<Rank2<VOCAB, DIM>, E, D>,
}

impl<const V: usize, const M: usize, E: Dtype, D: Storage<E>> NonMutableModule
    for Embedding<V, M, E, D>
{
}

impl<const V: usize, const M: usize, E: Dtype, D: Device<E>> TensorCollection<E, D>
    for Embedding<V, M, E, D>
where
    DfdxEmbedding<V, M, E, D>: BuildModule<D, E>,
{
    type To<E2: Dtype, D2: Device<E2>> = Embedding<V, M, E2, D2>;

    fn iter_tensors<Vis: ModuleVisitor<Self, E, D>>(
        visitor: &mut Vis,
    ) -> Result<Option<Self::To<Vis::E2, Vis::D2>>, Vis::Err> {
        // dfdx's field and order, reset as dfdx's (uniform in +-1/sqrt(VOCAB)), by building one
        visitor.visit_fields(
            Self::tensor(
                "weight",
                |s| &s.weight,
                |s| &mut s.weight,
                TensorOptions::reset_with(|t| {
                    *t = DfdxEmbedding::<V, M, E, D>::try_build(t.device())?.weight;
                    Ok(())
                }),
            ),
            |weight| Embedding { weight },
        )
    }
}

/// The forward pass for token ids of shape `$ids` (dims `$d`), output `$out`.
macro_rules! forward {
    ($([$($d:ident),+] $ids:ty => $out:ty;)+) => {$(
        impl<const V: usize, const M: usize, $($d: Dim,)+ E, T> Module<Tensor<$ids, usize, Cpu, T>>
            for Embedding<V, M, E, Cpu>
        where
            E: Precision<Elem = E> + Dtype,
            Cpu: Device<E>,
            T: Tape<E, Cpu>,
        {
            type Output = Tensor<$out, E, Cpu, T>;
            type Error = CpuError;

            fn try_forward(&self, ids: Tensor<$ids, usize, Cpu, T>) -> Result<Self::Output, CpuError> {
                let (ids, mut tape) = ids.split_tape();
                // dfdx's own gather, untraced: the rows copied, exact
                let y: Tensor<$out, E, Cpu> = self.weight.clone().try_gather(ids.clone())?;
                if T::OWNS_TAPE {
                    let (w, out) = (self.weight.ghost(), y.ghost());
                    let ids = ids.as_vec();
                    tape.add_backward_op(move |grads| {
                        let dy = grad_slice::<E>(grads.get_or_alloc_mut(&out)?).to_vec();
                        let dw = grad_slice::<E>(grads.get_or_alloc_mut(&w)?);
                        add_rows::<E>(&ids, &dy, M, dw)
                    });
                }
                Ok(y.put_tape(tape))
            }
        }
    )+};
}
forward! {
    [S] (S,) => (S, Const<M>);
    [B, S] (B, S) => (B, S, Const<M>);
}

/// `dw[id] += sum of dy's rows of token id`, each token's sum in f32, added to its row of `dw`
/// and rounded once per element.
fn add_rows<E: Precision<Elem = E>>(
    ids: &[usize],
    dy: &[E],
    m: usize,
    dw: &mut [E],
) -> Result<(), CpuError> {
    if dy.len() != ids.len() * m {
        return Err(CpuError::WrongNumElements);
    }
    // the occurrences of each token next to each other
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&i| ids[i]);
    let (mut sum, mut row) = (scratch::take::<f32>(m), scratch::take::<f32>(m));
    for run in order.chunk_by(|&a, &b| ids[a] == ids[b]) {
        sum.fill(0.0);
        for &i in run {
            E::widen(&dy[i * m..(i + 1) * m], &mut row);
            sum.iter_mut().zip(row.iter()).for_each(|(s, r)| *s += *r);
        }
        let id = ids[run[0]];
        let at = dw
            .get_mut(id * m..(id + 1) * m)
            .ok_or(CpuError::WrongNumElements)?;
        E::widen(at, &mut row);
        row.iter_mut().zip(sum.iter()).for_each(|(r, s)| *r += *s);
        E::round(&row, at);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use dfdx::prelude::*;
    use half::f16;

    /// Over a batch of sequences with repeated tokens and a gradient already in the table: the
    /// output is dfdx's gather, and the table's gradient is the sum of each token's rows in f64
    /// (exact here) added to what was there, rounded once; dfdx's own f16 embedding gives the same
    /// rows.
    #[test]
    fn rows_are_gathered_and_each_tokens_gradient_is_summed_then_rounded_once() {
        const V: usize = 7;
        const M: usize = 5;
        let dev = Cpu::default();
        let table: Vec<f16> = (0..V * M)
            .map(|i| f16::from_f32((i as f32 * 0.37).sin()))
            .collect();
        let w = dev.tensor_from_vec(table, (Const::<V>, Const::<M>));
        let emb = super::Embedding { weight: w.clone() };
        let ids = [[3usize, 1, 3, 3], [0, 6, 1, 3]];
        let dy: Vec<f16> = (0..2 * 4 * M)
            .map(|i| f16::from_f32(((i as f32) * 0.77).cos() * 0.01 + 1.0))
            .collect();
        let dy_t = dev.tensor_from_vec(dy.clone(), (Const::<2>, Const::<4>, Const::<M>));
        // an earlier contribution to the table's gradient: `w * 0.25` summed
        let y = emb.forward(dev.tensor(ids).leaky_traced());
        let want_rows = dfdx::nn::modules::Embedding { weight: w.clone() }
            .forward(dev.tensor(ids))
            .as_vec();
        assert_eq!(y.with_empty_tape().as_vec(), want_rows);
        let g = ((y * dy_t).sum() + (w.leaky_trace() * 0.25).sum()).backward();
        let got = g.get(&emb.weight).as_vec();
        for v in 0..V {
            for j in 0..M {
                let mut s = 0.0f64;
                for (b, row) in ids.iter().enumerate() {
                    for (t, &id) in row.iter().enumerate() {
                        if id == v {
                            s += f64::from(dy[(b * 4 + t) * M + j].to_f32());
                        }
                    }
                }
                #[allow(clippy::cast_possible_truncation)]
                let want = f16::from_f32(0.25 + s as f32);
                assert_eq!(got[v * M + j].to_bits(), want.to_bits(), "token {v}, {j}");
            }
        }
    }
}
