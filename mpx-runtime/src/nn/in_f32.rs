//! [`InF32`]: a parameter-free layer run in an f32 region inside a half-precision graph.

use dfdx::nn::{Module, NonMutableModule, ZeroSizedModule};
use dfdx::shapes::{Dtype, Shape};
use dfdx::tensor::{Cpu, CpuError, OwnedTape, Tape, Tensor};
use dfdx::tensor_ops::Device;

use crate::precision::Precision;
use crate::region::FullPrecision;

/// A parameter-free layer `A` (dfdx's `Softmax`, `LogSoftmax`, `Exp`, `Ln`, `AvgPoolGlobal`, ..)
/// run in f32 on a half-precision input: the input is widened, `A` runs on the f32 values on the
/// region's own tape, and its output (of `A`'s shape, which may differ from the input's: a
/// pool's) is rounded back once, with the gradient flowing through in f32 ([`FullPrecision`]).
/// What PyTorch's autocast does for the operations on its float32 list; the mixed step's working
/// copy ([`HalfLayers`](crate::step::HalfLayers)) runs dfdx's softmax, log-softmax, exp, log and
/// global average pool (a sum) this way.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::InF32;
/// use mpx_runtime::precision::f16;
/// let dev = Cpu::default();
/// let x = dev.tensor([2.0f32, 1.0, 0.1, -3.0]).to_dtype::<f16>();
/// let y = InF32(Softmax).forward(x.clone());
/// // the softmax of the f16 inputs computed in f32, rounded to f16 once
/// let want = x.to_dtype::<f32>().softmax::<Axis<0>>().to_dtype::<f16>();
/// assert_eq!(y.array(), want.array());
///
/// // a global average pool (one channel of 1 x 5) sums in f32: 2048 + 1 is no f16 value, so a
/// // sum kept in f16 would stay at 2048 and give 409.5
/// let x = dev.tensor([[[2048.0f32, 1.0, 1.0, 1.0, 1.0]]]).to_dtype::<f16>();
/// let y = InF32(AvgPoolGlobal).forward(x);
/// assert_eq!(y.array(), [f16::from_f32(2052.0 / 5.0)]); // 410.5, the f16 nearest 410.4
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InF32<A>(pub A);

impl<A: Default> ZeroSizedModule for InF32<A> {}
impl<A> NonMutableModule for InF32<A> {}

type Full<S> = Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>;

impl<A, S, S2, E, T> Module<Tensor<S, E, Cpu, T>> for InF32<A>
where
    A: Module<Full<S>, Output = Full<S2>, Error = CpuError>,
    S: Shape,
    S2: Shape,
    E: Precision<Elem = E> + Dtype,
    Cpu: Device<E>,
    T: Tape<E, Cpu>,
{
    type Output = Tensor<S2, E, Cpu, T>;
    type Error = CpuError;
    fn try_forward(&self, x: Tensor<S, E, Cpu, T>) -> Result<Self::Output, CpuError> {
        FullPrecision::<E>::try_run_fallible(x, |x| self.0.try_forward(x))
    }
}
