//! [`PositionEmbedding`]: a learned `(SEQ, M)` tensor added to every sequence of a batch.

use dfdx::nn::tensor_collection::TensorOptions;
use dfdx::shapes::{Const, Dtype, HasShape, Rank2};
use dfdx::tensor::{Cpu, Storage, Tensor};
use dfdx::tensor_ops::{BroadcastTo, Device, ReshapeTo, TryAdd};

use crate::nn::layer_impls::{build_on_device, mixed_module, module_collection, native_module};

/// A learned position embedding: `x + pos` for `x` of shape `(B, SEQ, M)` or `(SEQ, M)`, the
/// add in the half type (a residual-style add).
///
/// `pos` starts as the sinusoidal table of "Attention Is All You Need" (`sin` on even
/// features, `cos` on odd ones), so tokens differ by position from the first step; it is a
/// parameter like any other and is trained.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::vit::PositionEmbedding;
/// let dev = Cpu::default();
/// let pe = dev.build_module::<PositionEmbedding<4, 6>, f32>();
/// assert_eq!(pe.pos.array()[0], [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]); // sin 0, cos 0
/// let x: Tensor<Rank3<2, 4, 6>, f32, Cpu> = dev.zeros();
/// assert_eq!(pe.forward(x).array()[1], pe.pos.array());
/// ```
#[derive(Debug, Clone)]
pub struct PositionEmbedding<const SEQ: usize, const M: usize, E: Dtype = f32, D: Storage<E> = Cpu>
{
    /// One learned vector per position.
    pub pos: Tensor<Rank2<SEQ, M>, E, D>,
}

/// The sinusoidal table, written into `t`.
#[allow(
    clippy::unnecessary_wraps,
    reason = "the signature `TensorOptions::reset_with` takes"
)]
fn sinusoid<const SEQ: usize, const M: usize, E: Dtype, D: Device<E>>(
    t: &mut Tensor<Rank2<SEQ, M>, E, D>,
) -> Result<(), D::Err> {
    let mut v = Vec::with_capacity(SEQ * M);
    for i in 0..SEQ {
        for j in 0..M {
            let rate = 10000f64.powf((j - j % 2) as f64 / M as f64);
            let angle = i as f64 / rate;
            let value = if j % 2 == 0 { angle.sin() } else { angle.cos() };
            v.push(E::from_f64(value).unwrap_or_default());
        }
    }
    t.copy_from(&v);
    Ok(())
}

module_collection!(PositionEmbedding[const SEQ, const M] {
    tensor pos: TensorOptions::reset_with(sinusoid::<SEQ, M, E, D>),
});

build_on_device!(PositionEmbedding[const SEQ, const M]);
native_module!(PositionEmbedding[const SEQ, const M]);

mixed_module! {
    PositionEmbedding[const SEQ, const M], dims [B],
    fn(self, x: Tensor<(B, Const<SEQ>, Const<M>), E, Cpu, T>)
        -> Tensor<(B, Const<SEQ>, Const<M>), E, Cpu, T>
    {
        let shape = *x.shape();
        x.try_add(self.pos.retaped::<T>().try_broadcast_like(&shape)?)
    }
}

mixed_module! {
    PositionEmbedding[const SEQ, const M], dims [],
    fn(self, x: Tensor<Rank2<SEQ, M>, E, Cpu, T>) -> Tensor<Rank2<SEQ, M>, E, Cpu, T> {
        x.try_add(self.pos.retaped::<T>())
    }
}

mixed_module! {
    /// A sequence whose length is only known at run time (after a
    /// [`ClassToken`](super::ClassToken)); it must be `SEQ` long.
    PositionEmbedding[const SEQ, const M], dims [B],
    /// Panics when the sequence is not `SEQ` long, as dfdx's shape checks do.
    fn(self, x: Tensor<(B, usize, Const<M>), E, Cpu, T>) -> Tensor<(B, usize, Const<M>), E, Cpu, T> {
        let shape = *x.shape();
        assert_eq!(
            shape.1, SEQ,
            "PositionEmbedding<{SEQ}, {M}>: the sequence has {} tokens",
            shape.1
        );
        let pos = self
            .pos
            .retaped::<T>()
            .try_reshape_like(&(shape.1, Const::<M>))?;
        x.try_add(pos.try_broadcast_like(&shape)?)
    }
}
