//! [`MultiHeadAttention`]: dfdx's attention with its scaled softmax in f32.

use dfdx::nn::Module;
use dfdx::shapes::{Axes4, Axis, Const, Dtype, HasShape};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Storage, Tensor};
use dfdx::tensor_ops::{BroadcastTo, PermuteTo, ReshapeTo, TryMatMul};
use mpx_kernels::Activation;

use super::attention_core::attention_core;
use super::fused_linear::fused_linear;
use super::layer_impls::{build_on_device, composite_layer, mixed_module, native_module};
use super::linear::Linear;
use super::mixed::MixedModule;
use crate::region::FullPrecision;

composite_layer! {
    /// Multi-head attention, as dfdx's
    /// [`MultiHeadAttention`](dfdx::nn::modules::MultiHeadAttention) (same fields `w_q`, `w_k`,
    /// `w_v`, `w_o`, same operation order), with `softmax(q k^T / sqrt(d))` in f32.
    ///
    /// In f32 it runs dfdx's operations (bit-identical to dfdx's layer). In a half precision (f16,
    /// `AMP<f16>`, emulated bf16) it runs fused ops on mpx's GEMM: each projection is one op (f32
    /// sums, output rounded once to the half type), and the attention of all heads is one op
    /// reading the projections in place: `q·kᵀ` summed in f32 and kept in f32, the scaled softmax in
    /// f32, the weights rounded to the half type, `weights·v` summed in f32 and rounded once.
    ///
    /// Inputs as dfdx's: a `(q, k, v)` tuple or one tensor (self-attention), batched `(B, S, M)` or
    /// not `(S, M)`. `K_DIM` and `V_DIM` default to `EMBED_DIM` and must be multiples of
    /// `NUM_HEADS` (a compile-time error otherwise).
    ///
    /// `try_forward` (and `try_forward_in`) return `CpuError::WrongNumElements`, the shape error of
    /// dfdx's CPU device, when a sequence is empty (no queries or no keys: the softmax has nothing to
    /// weigh), when `q`, `k` and `v` differ in batch size, or when `k` and `v` differ in length;
    /// `forward` panics there, as dfdx's does on an error.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::nn::MultiHeadAttention;
    /// use mpx_runtime::precision::f16;
    /// let dev = Cpu::default();
    /// let mha = dev.build_module::<MultiHeadAttention<8, 2>, f16>();
    /// let x: Tensor<Rank3<2, 3, 8>, f32, Cpu> = dev.sample_normal();
    /// let x = x.to_dtype::<f16>();
    /// let y = mha.forward(x);
    /// assert!(y.array().iter().flatten().flatten().all(|v| v.is_finite()));
    /// ```
    #[derive(Debug, Clone)]
    pub struct MultiHeadAttention<
        const EMBED_DIM,
        const NUM_HEADS,
        const K_DIM = EMBED_DIM,
        const V_DIM = EMBED_DIM,
    > {
        /// Query projection.
        pub w_q: Linear<EMBED_DIM, K_DIM, E, D>,
        /// Key projection.
        pub w_k: Linear<EMBED_DIM, K_DIM, E, D>,
        /// Value projection.
        pub w_v: Linear<EMBED_DIM, V_DIM, E, D>,
        /// Output projection.
        pub w_o: Linear<V_DIM, EMBED_DIM, E, D>,
    }
}

impl<const M: usize, const H: usize, const K: usize, const V: usize, E: Dtype, D: Storage<E>>
    MultiHeadAttention<M, H, K, V, E, D>
{
    /// Fails to compile when `NUM_HEADS` does not divide `K_DIM` and `V_DIM`.
    pub(crate) const TYPE_CHECK: () = assert!(
        H > 0 && K.is_multiple_of(H) && V.is_multiple_of(H),
        "MultiHeadAttention: NUM_HEADS must divide K_DIM and V_DIM (both default to EMBED_DIM)"
    );
}

build_on_device!(MultiHeadAttention[const M, const H, const K, const V], checks: Self);

native_module!(MultiHeadAttention[const M, const H, const K, const V]);

/// A batched `(B, S, M)` tensor of element `E`.
type Seq<B, S, const M: usize, E, T = dfdx::tensor::NoneTape> = Tensor<(B, S, Const<M>), E, Cpu, T>;

mixed_module! {
    MultiHeadAttention[const M, const H, const K, const V], dims [B, S1, S2],
    /// Batched attention of queries `q` over keys `k` and values `v`.
    fn(self, (q, k, v): (Seq<B, S1, M, E, T>, Seq<B, S2, M, E>, Seq<B, S2, M, E>))
        -> Seq<B, S1, M, E, T>
    {
        #[allow(clippy::let_unit_value)]
        let () = Self::TYPE_CHECK;
        let b = q.shape().0;
        let s1 = q.shape().1;
        let s2 = v.shape().1;
        // Batches that differ, keys and values of different lengths, or an empty sequence (a
        // softmax over no keys, or no queries) are shape errors.
        let agree = b.size() == k.shape().0.size()
            && b.size() == v.shape().0.size()
            && k.shape().1.size() == s2.size();
        if !agree || s1.size() == 0 || s2.size() == 0 {
            return Err(CpuError::WrongNumElements);
        }

        if !P::IDENTITY {
            // Half precision: the projections and the whole attention core as fused ops on
            // mpx's GEMM (f32 sums, softmax in f32, one rounding to P per output).
            let id = Activation::Identity;
            let v = v.retaped::<T>();
            let v = fused_linear::<P, E, M, V, _, _, _>(self.w_v.parts(), id, v, (b, s2, Const))?;
            let k = k.retaped::<T>();
            let k = fused_linear::<P, E, M, K, _, _, _>(self.w_k.parts(), id, k, (b, s2, Const))?;
            let q = fused_linear::<P, E, M, K, _, _, _>(self.w_q.parts(), id, q, (b, s1, Const))?;
            let tokens = attention_core::<P, E, B, S1, S2, K, V, T>(q, k, v, H)?;
            return fused_linear::<P, E, V, M, _, _, _>(self.w_o.parts(), id, tokens, (b, s1, Const));
        }

        let v = self.w_v.as_dfdx().try_forward(v.retaped::<T>())?;
        let v = v.try_reshape_like(&(b, s2, H, V / H))?;
        let v = v.try_permute::<_, Axes4<0, 2, 1, 3>>()?;

        let k = self.w_k.as_dfdx().try_forward(k.retaped::<T>())?;
        let k = k.try_reshape_like(&(b, s2, H, K / H))?;
        let k = k.try_permute::<_, Axes4<0, 2, 3, 1>>()?;

        let q = self.w_q.as_dfdx().try_forward(q)?;
        let q = q.try_reshape_like(&(b, s1, H, K / H))?;
        let q = q.try_permute::<_, Axes4<0, 2, 1, 3>>()?;

        // dfdx: (q k^T * scalar).softmax(), with the scalar rounded to E; here in f32.
        let scalar = (1.0 / ((K / H) as f64).sqrt()) as f32;
        let scores = q.try_matmul(k)?;
        let weights = FullPrecision::<P>::try_run(scores, |w| (w * scalar).softmax::<Axis<3>>())?;

        let tokens = weights.try_matmul(v)?;
        let tokens = tokens.try_permute::<_, Axes4<0, 2, 1, 3>>()?;
        let tokens = tokens.try_reshape_like(&(b, s1, Const::<V>))?;
        self.w_o.as_dfdx().try_forward(tokens)
    }
}

mixed_module! {
    MultiHeadAttention[const M, const H, const K, const V], dims [S1, S2],
    /// Unbatched attention: a batch of one, as dfdx does it.
    fn(
        self,
        (q, k, v): (
            Tensor<(S1, Const<M>), E, Cpu, T>,
            Tensor<(S2, Const<M>), E, Cpu>,
            Tensor<(S2, Const<M>), E, Cpu>,
        )
    ) -> Tensor<(S1, Const<M>), E, Cpu, T> {
        let s1 = q.shape().0;
        let s2 = k.shape().0;
        if v.shape().0.size() != s2.size() {
            return Err(CpuError::WrongNumElements);
        }
        let q = q.try_broadcast_like(&(Const::<1>, s1, Const::<M>))?;
        let k = k.try_broadcast_like(&(Const::<1>, s2, Const::<M>))?;
        let v = v.try_broadcast_like(&(Const::<1>, s2, Const::<M>))?;
        let out = MixedModule::<P, _>::try_mixed_forward(self, (q, k, v))?;
        out.try_reshape_like(&(s1, Const::<M>))
    }
}

/// Self-attention: one tensor is query, key and value (its tape goes with the query).
macro_rules! self_attention {
    ($($d:ident),+) => {
        mixed_module! {
            MultiHeadAttention[const M, const H, const K, const V], dims [$($d),+],
            fn(self, src: Tensor<($($d,)+ Const<M>), E, Cpu, T>)
                -> Tensor<($($d,)+ Const<M>), E, Cpu, T>
            {
                let (src, tape) = src.split_tape();
                MixedModule::<P, _>::try_mixed_forward(
                    self,
                    (src.clone().put_tape(tape), src.clone(), src),
                )
            }
        }
    };
}
self_attention!(S);
self_attention!(B, S);
