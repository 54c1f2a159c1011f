//! The two sub-layers every transformer block is made of, shared by the encoder and the decoder:
//! a residual add followed by a layer norm, and the feed-forward network ([`FeedForward`]) with
//! its residual and norm.

use dfdx::nn::Module;
use dfdx::nn::modules::{Linear as DfdxLinear, ReLU, Residual};
use dfdx::shapes::{Const, Dtype, HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Tape, Tensor};
use dfdx::tensor_ops::{Device, TryAdd};
use mpx_kernels::Activation;

use super::fused_linear::fused_linear;
use super::layer_norm::LayerNorm1D;
use super::layer_norm_kernel::add_layer_norm;
use super::linear::Linear;
use super::mixed::MixedModule;
use crate::precision::Precision;

/// The feed-forward part of a transformer block (encoder or decoder): `x + Linear(ReLU(Linear(x)))`, all in the half
/// type (dfdx's own modules), as in dfdx's encoder block.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::{FeedForward, TransformerEncoderBlock};
/// let dev = Cpu::default();
/// let block = dev.build_module::<TransformerEncoderBlock<4, 2, 8>, f32>();
/// let ff: &FeedForward<4, 8, f32, Cpu> = &block.ff;
/// let x: Tensor<Rank1<4>, f32, Cpu> = dev.zeros();
/// // x + W2 relu(W1 x + b1) + b2 at x = 0 is W2 relu(b1) + b2.
/// let want = ff.0.2.forward(ff.0.0.bias.clone().relu());
/// assert_eq!(ff.forward(x).array(), want.array());
/// ```
pub type FeedForward<const M: usize, const F: usize, E, D> =
    Residual<(Linear<M, F, E, D>, ReLU, Linear<F, M, E, D>)>;

/// dfdx's feed-forward sub-layer, what [`FeedForward`] computes in f32.
type DfdxFeedForward<const M: usize, const F: usize, E, D> =
    Residual<(DfdxLinear<M, F, E, D>, ReLU, DfdxLinear<F, M, E, D>)>;

/// `norm(x + residual)`, as dfdx's blocks compute it. In a half precision one fused pass: the sum
/// in f32, not rounded before the norm; in f32 dfdx's add, then the norm.
pub(crate) fn add_norm<P, E, const M: usize, S, T>(
    x: Tensor<S, E, Cpu, T>,
    residual: Tensor<S, E, Cpu>,
    norm: &LayerNorm1D<M, E, Cpu>,
) -> Result<Tensor<S, E, Cpu, T>, CpuError>
where
    P: Precision<Elem = E>,
    E: Precision<Elem = E> + Dtype,
    Cpu: Device<E>,
    S: Shape,
    T: Tape<E, Cpu>,
    LayerNorm1D<M, E, Cpu>: MixedModule<P, Tensor<S, E, Cpu, T>, Output = Tensor<S, E, Cpu, T>>,
{
    if P::IDENTITY {
        let x = x.try_add(residual)?;
        MixedModule::<P, _>::try_mixed_forward(norm, x)
    } else {
        add_layer_norm::<P, E, M, S, T>(x, Some(residual), &norm.gamma, &norm.beta, norm.epsilon)
    }
}

/// `norm(x + Linear(ReLU(Linear(x))))`: the feed-forward network with its residual, then the
/// norm. In a half precision the two `Linear`s run as fused ops on mpx's GEMM (the `ReLU` in the
/// first one's pass) and the residual add in the norm's pass; in f32 dfdx's layers, then the norm.
pub(crate) fn feed_forward_norm<P, E, const M: usize, const F: usize, S, T>(
    x: Tensor<S, E, Cpu, T>,
    ff: &FeedForward<M, F, E, Cpu>,
    norm: &LayerNorm1D<M, E, Cpu>,
) -> Result<Tensor<S, E, Cpu, T>, CpuError>
where
    P: Precision<Elem = E>,
    E: Precision<Elem = E> + Dtype,
    Cpu: Device<E>,
    S: WithLast<F>,
    T: Tape<E, Cpu>,
    DfdxFeedForward<M, F, E, Cpu>:
        Module<Tensor<S, E, Cpu, T>, Output = Tensor<S, E, Cpu, T>, Error = CpuError>,
    LayerNorm1D<M, E, Cpu>: MixedModule<P, Tensor<S, E, Cpu, T>, Output = Tensor<S, E, Cpu, T>>,
{
    if P::IDENTITY {
        // dfdx's own sub-layer on the same tensors (shared): bit for bit dfdx's block
        let (l1, relu, l2) = &ff.0;
        let dfdx: DfdxFeedForward<M, F, E, Cpu> = Residual((l1.as_dfdx(), *relu, l2.as_dfdx()));
        let x = dfdx.try_forward(x)?;
        return MixedModule::<P, _>::try_mixed_forward(norm, x);
    }
    let (x, tape) = x.split_tape();
    let shape = *x.shape();
    let hidden = shape.with_last();
    let (l1, _, l2) = &ff.0;
    let x_in = x.clone().put_tape(tape);
    let h = fused_linear::<P, E, M, F, _, _, _>(l1.parts(), Activation::ReLU, x_in, hidden)?;
    let f = fused_linear::<P, E, F, M, _, _, _>(l2.parts(), Activation::Identity, h, shape)?;
    add_layer_norm::<P, E, M, S, T>(f, Some(x), &norm.gamma, &norm.beta, norm.epsilon)
}

/// `(S, M)` or `(B, S, M)` with the last dimension replaced by `F`.
pub(crate) trait WithLast<const F: usize>: Shape {
    /// The shape with last dimension `F`.
    type Out: Shape;
    /// That shape, for this one's other dimensions.
    fn with_last(&self) -> Self::Out;
}

impl<S: dfdx::shapes::Dim, const M: usize, const F: usize> WithLast<F> for (S, Const<M>) {
    type Out = (S, Const<F>);
    fn with_last(&self) -> Self::Out {
        (self.0, Const)
    }
}

impl<B: dfdx::shapes::Dim, S: dfdx::shapes::Dim, const M: usize, const F: usize> WithLast<F>
    for (B, S, Const<M>)
{
    type Out = (B, S, Const<F>);
    fn with_last(&self) -> Self::Out {
        (self.0, self.1, Const)
    }
}
