//! Layers run in an f32 region inside a half-precision graph: [`InF32`], a parameter-free one;
//! [`InF32Copy`], one with tensors, on an f32 copy of them.

use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection};
use dfdx::nn::{Module, ModuleMut, NonMutableModule, ZeroSizedModule};
use dfdx::shapes::{Dtype, Shape};
use dfdx::tensor::{Cpu, CpuError, NoneTape, OwnedTape, PutTape, SplitTape, Tape, Tensor};
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

/// A layer with tensors (dfdx's `BatchNorm1D`, `BatchNorm2D`, `PReLU`, `PReLU1D`, `Bias2D`, ..
/// in the half type `E`) run in f32: its input widened, its output computed by the layer's own f32 code on an f32
/// copy of its tensors and rounded to `E` once. Gradients flow to its tensors in `E` and to the
/// input through the region ([`FullPrecision`]); in training mode (`forward_mut`) what the f32
/// pass leaves in the copy's non-trainable tensors (a batch norm's running statistics) is rounded
/// back into its own. It has the forward passes the layer has: a batch norm's `forward` on an
/// untraced input and `forward_mut` on a traced one, a `PReLU`'s or a linear layer's both on
/// either. The mixed
/// step's working copy ([`HalfLayers`](crate::step::HalfLayers)) runs dfdx's layers with tensors
/// that mpx has no kernels of its own for this way in f16 and `AMP<f16>`: dfdx's own in f16 run
/// on scalar kernels several times slower than its f32 ones (a batch norm summing its statistics
/// in f16).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::InF32Copy;
/// use mpx_runtime::precision::f16;
/// let dev = Cpu::default();
/// let bn = dev.build_module::<BatchNorm1D<2>, f32>();
/// let mut half = InF32Copy(bn.clone().to_dtype::<f16>());
/// let x: Tensor<Rank2<4, 2>, f32, Cpu> =
///     dev.tensor([[1.0, -2.0], [3.0, 0.5], [2.0, 1.0], [-1.0, 4.0]]);
/// let xh = x.to_dtype::<f16>();
/// let y = half.forward_mut(xh.clone().leaky_traced());
/// // dfdx's f32 batch norm on the same (f16) values, rounded once
/// let mut bn32 = bn;
/// let want = bn32.forward_mut(xh.clone().to_dtype::<f32>().leaky_traced());
/// let want = want.retaped::<NoneTape>().to_dtype::<f16>();
/// assert_eq!(y.array(), want.array());
/// // and the running statistics it updated, rounded to f16
/// assert_eq!(half.running_mean.array(), bn32.running_mean.clone().to_dtype::<f16>().array());
///
/// // evaluation mode (an untraced input) normalises with the running statistics, in f32
/// let bn32 = half.0.clone().to_dtype::<f32>();
/// let want = bn32.forward(xh.clone().to_dtype::<f32>()).to_dtype::<f16>();
/// assert_eq!(half.forward(xh.clone()).array(), want.array());
///
/// // a linear layer without bias: its product in f32, rounded once, and the weight's gradient
/// let lin = dev.build_module::<UnbiasedLinear<2, 3>, f32>().to_dtype::<f16>();
/// let half = InF32Copy(lin.clone());
/// let want = lin.to_dtype::<f32>().forward(xh.clone().to_dtype::<f32>()).to_dtype::<f16>();
/// assert_eq!(half.forward(xh.clone()).array(), want.array());
/// let g = half.forward(xh.leaky_traced()).sum().backward();
/// assert!(g.get(&half.weight).array().iter().flatten().any(|v| v.to_f32() != 0.0));
/// ```
#[derive(Debug, Clone)]
pub struct InF32Copy<N>(pub N);

/// The layer's fields (`weight`, `running_mean`, `epsilon`, ..) read and set through the
/// wrapper, as on dfdx's own.
impl<N> std::ops::Deref for InF32Copy<N> {
    type Target = N;
    fn deref(&self) -> &N {
        &self.0
    }
}

impl<N> std::ops::DerefMut for InF32Copy<N> {
    fn deref_mut(&mut self) -> &mut N {
        &mut self.0
    }
}

impl<N: TensorCollection<E, D>, E: Dtype, D: Device<E>> TensorCollection<E, D> for InF32Copy<N> {
    type To<E2: Dtype, D2: Device<E2>> = InF32Copy<N::To<E2, D2>>;

    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(Self::module("0", |s| &s.0, |s| &mut s.0), InF32Copy)
    }
}

/// Runs `f` on a region's input without its tape (an untraced input has no gradient to carry:
/// dfdx's batch norm takes an untraced input in evaluation mode), its output put on it again.
fn untraced<S: Shape, S2: Shape>(
    x: Full<S>,
    f: impl FnOnce(Tensor<S, f32, Cpu>) -> Result<Tensor<S2, f32, Cpu>, CpuError>,
) -> Result<Full<S2>, CpuError> {
    let (x, tape) = x.split_tape();
    f(x).map(|y| y.put_tape(tape))
}

/// An untraced input (a batch norm's evaluation mode).
impl<N, S, S2, E> Module<Tensor<S, E, Cpu, NoneTape>> for InF32Copy<N>
where
    N: TensorCollection<E, Cpu>,
    N::To<f32, Cpu>: Module<Tensor<S, f32, Cpu>, Output = Tensor<S2, f32, Cpu>, Error = CpuError>,
    S: Shape,
    S2: Shape,
    E: Precision<Elem = E> + Dtype,
    Cpu: Device<E>,
{
    type Output = Tensor<S2, E, Cpu, NoneTape>;
    type Error = CpuError;
    fn try_forward(&self, x: Tensor<S, E, Cpu, NoneTape>) -> Result<Self::Output, CpuError> {
        Ok(FullPrecision::<E>::try_run_with_fallible(
            &self.0,
            x,
            |n, x| untraced(x, |x| n.try_forward(x)),
        )?)
    }
}

/// A traced input through `forward` (a `PReLU`'s, a linear layer's).
impl<N, S, S2, E> Module<Tensor<S, E, Cpu, OwnedTape<E, Cpu>>> for InF32Copy<N>
where
    N: TensorCollection<E, Cpu>,
    N::To<f32, Cpu>: Module<Full<S>, Output = Full<S2>, Error = CpuError>,
    S: Shape,
    S2: Shape,
    E: Precision<Elem = E> + Dtype,
    Cpu: Device<E>,
{
    type Output = Tensor<S2, E, Cpu, OwnedTape<E, Cpu>>;
    type Error = CpuError;
    fn try_forward(
        &self,
        x: Tensor<S, E, Cpu, OwnedTape<E, Cpu>>,
    ) -> Result<Self::Output, CpuError> {
        Ok(FullPrecision::<E>::try_run_with_fallible(
            &self.0,
            x,
            |n, x| n.try_forward(x),
        )?)
    }
}

/// A traced input through `forward_mut` (a batch norm's training mode: its running statistics
/// rounded back).
impl<N, S, S2, E> ModuleMut<Tensor<S, E, Cpu, OwnedTape<E, Cpu>>> for InF32Copy<N>
where
    N: TensorCollection<E, Cpu>,
    N::To<f32, Cpu>:
        ModuleMut<Full<S>, Output = Full<S2>, Error = CpuError> + TensorCollection<f32, Cpu>,
    S: Shape,
    S2: Shape,
    E: Precision<Elem = E> + Dtype,
    Cpu: Device<E>,
{
    type Output = Tensor<S2, E, Cpu, OwnedTape<E, Cpu>>;
    type Error = CpuError;
    fn try_forward_mut(
        &mut self,
        x: Tensor<S, E, Cpu, OwnedTape<E, Cpu>>,
    ) -> Result<Self::Output, CpuError> {
        Ok(FullPrecision::<E>::try_run_with_mut(
            &mut self.0,
            x,
            ModuleMut::try_forward_mut,
        )?)
    }
}

/// An untraced input through `forward_mut` (a `PReLU`'s, a linear layer's).
impl<N, S, S2, E> ModuleMut<Tensor<S, E, Cpu, NoneTape>> for InF32Copy<N>
where
    N: TensorCollection<E, Cpu>,
    N::To<f32, Cpu>: ModuleMut<Tensor<S, f32, Cpu>, Output = Tensor<S2, f32, Cpu>, Error = CpuError>
        + TensorCollection<f32, Cpu>,
    S: Shape,
    S2: Shape,
    E: Precision<Elem = E> + Dtype,
    Cpu: Device<E>,
{
    type Output = Tensor<S2, E, Cpu, NoneTape>;
    type Error = CpuError;
    fn try_forward_mut(
        &mut self,
        x: Tensor<S, E, Cpu, NoneTape>,
    ) -> Result<Self::Output, CpuError> {
        Ok(FullPrecision::<E>::try_run_with_mut(
            &mut self.0,
            x,
            |n, x| untraced(x, |x| n.try_forward_mut(x)),
        )?)
    }
}
