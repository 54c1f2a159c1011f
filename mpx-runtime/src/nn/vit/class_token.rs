//! [`ClassToken`]: a learned token put in front of every sequence, read out by the head.

use dfdx::nn::tensor_collection::TensorOptions;
use dfdx::shapes::{Axis, Const, Dim, Dtype, HasShape, Rank1};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Storage, Tape, Tensor};
use dfdx::tensor_ops::{BroadcastTo, Device, ReshapeTo, TryConcatAlong};

use crate::nn::layer_impls::{build_on_device, mixed_module, module_collection, native_module};
use crate::precision::Precision;

/// A ViT class token: a learned `M`-vector prepended to each `(S, M)` sequence of a batch,
/// giving `(B, S + 1, M)` (the length as a runtime `usize`, since stable Rust cannot add
/// const generics); [`ClassToken::try_take`] reads it back out after the encoder, for the
/// [`ClassificationHead`](super::ClassificationHead)'s `(B, M)` input. Initialised to zeros.
///
/// A [`PositionEmbedding<SEQ, M>`](super::PositionEmbedding) takes the longer sequence when
/// `SEQ = S + 1`.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::vit::ClassToken;
/// let dev = Cpu::default();
/// let mut cls = dev.build_module::<ClassToken<2>, f32>();
/// cls.token = dev.tensor([7.0, 8.0]);
/// let x: Tensor<Rank3<1, 2, 2>, f32, Cpu> = dev.tensor([[[1.0, 2.0], [3.0, 4.0]]]);
/// let y = cls.forward(x);
/// assert_eq!(y.as_vec(), [7.0, 8.0, 1.0, 2.0, 3.0, 4.0]);
/// assert_eq!(ClassToken::<2>::try_take(y)?.array(), [[7.0, 8.0]]);
/// # Ok::<(), dfdx::tensor::CpuError>(())
/// ```
#[derive(Debug, Clone)]
pub struct ClassToken<const M: usize, E: Dtype = f32, D: Storage<E> = Cpu> {
    /// The learned token.
    pub token: Tensor<Rank1<M>, E, D>,
}

module_collection!(ClassToken[const M] { tensor token: TensorOptions::reset_to_zeros() });

build_on_device!(ClassToken[const M]);
native_module!(ClassToken[const M]);

impl<const M: usize, E: Precision<Elem = E> + Dtype, D: Storage<E>> ClassToken<M, E, D>
where
    Cpu: Device<E>,
{
    /// The first token of each sequence, `(B, S, M) -> (B, M)`: the class token after the
    /// encoder. The tape goes along.
    ///
    /// # Errors
    /// A device error (allocation).
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::nn::vit::ClassToken;
    /// let dev = Cpu::default();
    /// let x: Tensor<Rank3<2, 3, 1>, f32, Cpu> = dev.tensor([[[1.0], [2.0], [3.0]], [[4.0], [5.0], [6.0]]]);
    /// assert_eq!(ClassToken::<1>::try_take(x)?.array(), [[1.0], [4.0]]);
    /// # Ok::<(), dfdx::tensor::CpuError>(())
    /// ```
    #[allow(clippy::type_complexity)]
    pub fn try_take<B: Dim, S: Dim, T: Tape<E, Cpu>>(
        x: Tensor<(B, S, Const<M>), E, Cpu, T>,
    ) -> Result<Tensor<(B, Const<M>), E, Cpu, T>, CpuError> {
        let b = x.shape().0;
        let first = x.try_slice((.., 0..1, ..))?;
        first.try_reshape_like(&(b, Const::<M>))
    }
}

mixed_module! {
    ClassToken[const M], dims [B, S],
    fn(self, x: Tensor<(B, S, Const<M>), E, Cpu, T>) -> Tensor<(B, usize, Const<M>), E, Cpu, T> {
        let (b, s, _) = *x.shape();
        let (x, tape) = x.split_tape();
        let x = x.try_reshape_like(&(b, s.size(), Const::<M>))?;
        let token = self
            .token
            .clone()
            .put_tape(tape)
            .try_broadcast_like(&(b, 1usize, Const::<M>))?;
        (token, x).try_concat_along(Axis::<1>)
    }
}
