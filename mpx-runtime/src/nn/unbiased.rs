//! [`UnbiasedLinear`]: dfdx's `UnbiasedLinear` (a linear map without bias) on mpx's fused GEMM.

use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection};
use dfdx::nn::{Module, NonMutableModule};
use dfdx::shapes::{Dtype, Rank2};
use dfdx::tensor::{Cpu, Storage, Tensor};
use dfdx::tensor_ops::Device;

use super::Linear;

/// A linear map without bias, `y = x·Wᵀ`, on mpx's fused linear op ([`Linear`], its bias held
/// at zero and not a parameter): f16 operands, f32 sums rounded once, the weight's gradient
/// summed in f32 and rounded once. Its only tensor is dfdx's `UnbiasedLinear`'s, `weight:
/// (O, I)`, so a mixed step's working copy ([`HalfLayers`](crate::step::HalfLayers)) runs
/// dfdx's `UnbiasedLinear` as this layer in f16 and `AMP<f16>` (dfdx's own in f16 multiplies on
/// its scalar f16 path).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn;
/// use mpx_runtime::precision::f16;
/// let dev = Cpu::default();
/// let w: Tensor<Rank2<2, 3>, f32, Cpu> = dev.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 0.0]]);
/// let l = nn::UnbiasedLinear::new(w.to_dtype::<f16>());
/// let x = dev.tensor([[1.0f32, 1.0, 2.0]]).to_dtype::<f16>();
/// assert_eq!(l.forward(x).to_dtype::<f32>().array(), [[9.0, -0.5]]);
/// assert_eq!(l.weight.shape(), &(Const::<2>, Const::<3>)); // as on dfdx's layer
/// // built, its weight is drawn as dfdx's: uniform in ±1/sqrt(I)
/// let built = nn::UnbiasedLinear::<4, 2, f32>::build(&dev);
/// let w = built.weight.as_vec();
/// assert!(w.iter().all(|v| v.abs() <= 0.5) && w.iter().any(|v| *v != 0.0));
/// ```
#[derive(Debug, Clone)]
pub struct UnbiasedLinear<const I: usize, const O: usize, E: Dtype, D: Storage<E> = Cpu>(
    Linear<I, O, E, D>,
);

impl<const I: usize, const O: usize, E: Dtype, D: Device<E>> UnbiasedLinear<I, O, E, D> {
    /// The layer with this weight.
    ///
    /// # Examples
    /// See [`UnbiasedLinear`].
    pub fn new(weight: Tensor<Rank2<O, I>, E, D>) -> Self {
        let bias = weight.device().zeros();
        Self(Linear::new(weight, bias))
    }
}

/// The layer's `weight` read and set as a field, as on dfdx's `UnbiasedLinear` (code written for
/// dfdx's layer reads `layer.weight`), through the fused layer it runs on (whose zero `bias` is
/// not a parameter).
impl<const I: usize, const O: usize, E: Dtype, D: Storage<E>> std::ops::Deref
    for UnbiasedLinear<I, O, E, D>
{
    type Target = Linear<I, O, E, D>;
    fn deref(&self) -> &Linear<I, O, E, D> {
        &self.0
    }
}

impl<const I: usize, const O: usize, E: Dtype, D: Storage<E>> std::ops::DerefMut
    for UnbiasedLinear<I, O, E, D>
{
    fn deref_mut(&mut self) -> &mut Linear<I, O, E, D> {
        &mut self.0
    }
}

/// Its weight is trained and reset as dfdx's (uniform in ±1/sqrt(I), as `Linear`'s weight).
impl<const I: usize, const O: usize, E: Dtype, D: Device<E>> TensorCollection<E, D>
    for UnbiasedLinear<I, O, E, D>
where
    dfdx::nn::modules::Linear<I, O, E, D>: dfdx::nn::BuildModule<D, E>,
{
    type To<E2: Dtype, D2: Device<E2>> = UnbiasedLinear<I, O, E2, D2>;

    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            Self::tensor(
                "weight",
                |s| &s.0.weight,
                |s| &mut s.0.weight,
                super::dfdx_linear::linear_weight_options(),
            ),
            UnbiasedLinear::new,
        )
    }
}

/// The forward passes of mpx's [`Linear`], whose bias is zero.
impl<const I: usize, const O: usize, E: Dtype, X> Module<X> for UnbiasedLinear<I, O, E, Cpu>
where
    Linear<I, O, E, Cpu>: Module<X>,
{
    type Output = <Linear<I, O, E, Cpu> as Module<X>>::Output;
    type Error = <Linear<I, O, E, Cpu> as Module<X>>::Error;
    fn try_forward(&self, x: X) -> Result<Self::Output, Self::Error> {
        self.0.try_forward(x)
    }
}

impl<const I: usize, const O: usize, E: Dtype, D: Storage<E>> NonMutableModule
    for UnbiasedLinear<I, O, E, D>
{
}
