//! [`MxLinear`]: a dfdx linear layer whose weights (and optionally inputs) are MX fake-quantized
//! in the forward pass. An [`MxConfig`] is also a family of layers for
//! [`IntoLayers`](crate::nn::IntoLayers), which converts a model's `Linear` layers to `MxLinear`.

use std::fmt::Debug;
use std::marker::PhantomData;

use dfdx::nn::modules::Linear;
use dfdx::nn::{BuildModule, BuildOnDevice, Module, NonMutableModule};
use dfdx::shapes::{Const, Dim, Dtype, HasShape, Rank1, Rank2};
use dfdx::tensor::{Cpu, CpuError, Storage, Tape, Tensor};
use dfdx::tensor_ops::{BroadcastTo, Device, PermuteTo, TryAdd, TryMatMul};

use super::element::MxFormat;
use super::error::MxError;
use super::fake_quant::MxFakeQuant;
use super::spec::MxSpec;
use super::tensor::MxTensor;
use crate::nn::dfdx_linear::linear_collection;
use crate::nn::{Dfdx, IntoLayers};

/// What an [`MxLinear`] quantizes to, as a type (dfdx builds modules from types):
/// the weights' spec, and optionally the inputs'. Implement it for your own marker type to use
/// other formats or block sizes.
///
/// # Examples
/// ```
/// use mpx_runtime::mx::{MxConfig, MxFormat, MxSpec};
/// #[derive(Debug, Clone, Copy, Default)]
/// struct Fp6Block16;
/// impl MxConfig for Fp6Block16 {
///     fn weight_spec() -> MxSpec {
///         // block size 16 is valid, so this never fails
///         MxSpec::new(MxFormat::Fp6E2M3).with_block_size(16).unwrap_or(MxSpec::new(MxFormat::Fp6E2M3))
///     }
/// }
/// assert_eq!(Fp6Block16::weight_spec().block_size(), 16);
/// assert_eq!(Fp6Block16::input_spec(), None);
/// ```
pub trait MxConfig: 'static + Debug + Clone + Copy + Default + Send + Sync {
    /// The weights' spec (blocks along the input dimension, the matmul's reduction axis).
    fn weight_spec() -> MxSpec;
    /// The inputs' spec (blocks along the last axis, the features); `None` leaves them in f32.
    fn input_spec() -> Option<MxSpec> {
        None
    }
}

macro_rules! config {
    ($(#[$doc:meta])* $name:ident, $format:expr, $inputs:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct $name;
        impl MxConfig for $name {
            fn weight_spec() -> MxSpec {
                MxSpec::new($format)
            }
            fn input_spec() -> Option<MxSpec> {
                $inputs.then(|| MxSpec::new($format))
            }
        }
    };
}

config!(
    /// Weights in MXFP8 E4M3, block 32; inputs in f32.
    Mxfp8Weights, MxFormat::Fp8E4M3, false
);
config!(
    /// Weights in MXFP6 E3M2, block 32; inputs in f32.
    Mxfp6Weights, MxFormat::Fp6E3M2, false
);
config!(
    /// Weights in MXFP4 E2M1, block 32; inputs in f32.
    Mxfp4Weights, MxFormat::Fp4E2M1, false
);
config!(
    /// Weights in MXINT8, block 32; inputs in f32.
    Mxint8Weights, MxFormat::Int8, false
);
config!(
    /// Weights and inputs in MXFP8 E4M3, block 32.
    Mxfp8, MxFormat::Fp8E4M3, true
);

impl<const I: usize, const O: usize, C: MxConfig, E: Dtype, D: Device<E>> BuildOnDevice<D, E>
    for crate::nn::builders::MxLinear<I, O, C>
where
    MxLinear<I, O, C, E, D>: BuildModule<D, E>,
{
    type Built = MxLinear<I, O, C, E, D>;
}

/// A linear layer `y = x W^T + b` that trains in f32 and computes its forward pass with MX
/// weights: the f32 master weight is fake-quantized ([`MxFakeQuant`]) along the input dimension
/// on every forward, the inputs too if `C` asks, and gradients pass straight through to the
/// master weight. Same parameters, initialization and layout as dfdx's `Linear<I, O>`, so any
/// dfdx optimizer trains it.
///
/// # Examples
/// ```
/// use dfdx::{optim::*, prelude::*};
/// use mpx_runtime::mx::Mxfp4Weights;
/// use mpx_runtime::nn::builders;
/// let dev: Cpu = Default::default();
/// let mut model = dev.build_module::<(builders::MxLinear<8, 4, Mxfp4Weights>, ReLU), f32>();
/// let mut opt = Sgd::new(&model, SgdConfig { lr: 0.1, ..Default::default() });
/// let x: Tensor<Rank2<2, 8>, f32, _> = dev.sample_normal();
/// let before = model.0.weight.clone();
/// let mut grads = model.alloc_grads();
/// let loss = model.forward(x.trace(grads)).square().mean();
/// grads = loss.backward();
/// opt.update(&mut model, &grads).unwrap();
/// assert_ne!(model.0.weight.as_vec(), before.as_vec());
/// ```
#[derive(Debug, Clone)]
pub struct MxLinear<const I: usize, const O: usize, C, E: Dtype, D: Storage<E>> {
    /// The f32 master weight, shape `(O, I)` as in dfdx's `Linear`.
    pub weight: Tensor<Rank2<O, I>, E, D>,
    /// The bias, shape `(O,)`.
    pub bias: Tensor<Rank1<O>, E, D>,
    config: PhantomData<C>,
}

impl<const I: usize, const O: usize, C: MxConfig, E: Dtype, D: Storage<E>> MxLinear<I, O, C, E, D> {
    /// An MX layer with these parameters (see also [`IntoLayers`]).
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::mx::{MxLinear, Mxfp8Weights};
    /// let dev = Cpu::default();
    /// let l = MxLinear::<2, 1, Mxfp8Weights, f32, Cpu>::new(dev.tensor([[1.0, 2.0]]), dev.tensor([0.5]));
    /// // 1 and 2 are exact in MXFP8
    /// assert_eq!(l.forward(dev.tensor([[1.0f32, 1.0]])).array(), [[3.5]]);
    /// ```
    pub fn new(weight: Tensor<Rank2<O, I>, E, D>, bias: Tensor<Rank1<O>, E, D>) -> Self {
        MxLinear {
            weight,
            bias,
            config: PhantomData,
        }
    }
}

impl<const I: usize, const O: usize, C: MxConfig> MxLinear<I, O, C, f32, Cpu> {
    /// The weight the forward pass uses: the master weight quantized and dequantized.
    ///
    /// # Panics
    /// On a device (allocation) error, as dfdx's infallible operations do.
    pub fn quantized_weight(&self) -> Tensor<Rank2<O, I>, f32, Cpu> {
        self.weight.clone().mx_fake_quant(&C::weight_spec())
    }

    /// The weight packed as an [`MxTensor`] (shape `[O, I]`), for storage or deployment.
    ///
    /// # Errors
    /// None in practice: the shape `[O, I]` always holds the weight; the `Result` is
    /// [`MxTensor::quantize`]'s.
    pub fn weight_mx(&self) -> Result<MxTensor, MxError> {
        MxTensor::quantize(&self.weight.as_vec(), &[O, I], &C::weight_spec())
    }
}

impl<const I: usize, const O: usize, C, E: Dtype, D: Storage<E>> NonMutableModule
    for MxLinear<I, O, C, E, D>
{
}

linear_collection!(
    [C: MxConfig] MxLinear<I, O, C, E, D> => MxLinear<I, O, C, E2, D2>,
    |weight, bias| MxLinear { weight, bias, config: PhantomData },
);

impl<const I: usize, const O: usize, C: MxConfig> MxLinear<I, O, C, f32, Cpu> {
    /// The weight for this forward pass, transposed to `(I, O)`, on tape `T`.
    fn forward_weight<T: Tape<f32, Cpu>>(
        &self,
    ) -> Result<Tensor<Rank2<I, O>, f32, Cpu, T>, CpuError> {
        self.weight
            .retaped::<T>()
            .try_mx_fake_quant(&C::weight_spec())?
            .try_permute()
    }

    fn forward_input<S: dfdx::shapes::Shape, T: Tape<f32, Cpu>>(
        x: Tensor<S, f32, Cpu, T>,
    ) -> Result<Tensor<S, f32, Cpu, T>, CpuError> {
        match C::input_spec() {
            Some(spec) => x.try_mx_fake_quant(&spec),
            None => Ok(x),
        }
    }
}

impl<const I: usize, const O: usize, C: MxConfig, T: Tape<f32, Cpu>>
    Module<Tensor<Rank1<I>, f32, Cpu, T>> for MxLinear<I, O, C, f32, Cpu>
{
    type Output = Tensor<Rank1<O>, f32, Cpu, T>;
    type Error = CpuError;

    fn try_forward(&self, x: Tensor<Rank1<I>, f32, Cpu, T>) -> Result<Self::Output, CpuError> {
        let y = Self::forward_input(x)?.try_matmul(self.forward_weight::<T>()?)?;
        y.try_add(self.bias.retaped::<T>())
    }
}

impl<const I: usize, const O: usize, C: MxConfig, B: Dim, T: Tape<f32, Cpu>>
    Module<Tensor<(B, Const<I>), f32, Cpu, T>> for MxLinear<I, O, C, f32, Cpu>
{
    type Output = Tensor<(B, Const<O>), f32, Cpu, T>;
    type Error = CpuError;

    fn try_forward(&self, x: Tensor<(B, Const<I>), f32, Cpu, T>) -> Result<Self::Output, CpuError> {
        let y = Self::forward_input(x)?.try_matmul(self.forward_weight::<T>()?)?;
        let shape = *y.shape();
        y.try_add(self.bias.retaped::<T>().try_broadcast_like(&shape)?)
    }
}

impl<const I: usize, const O: usize, C: MxConfig, B: Dim, S: Dim, T: Tape<f32, Cpu>>
    Module<Tensor<(B, S, Const<I>), f32, Cpu, T>> for MxLinear<I, O, C, f32, Cpu>
{
    type Output = Tensor<(B, S, Const<O>), f32, Cpu, T>;
    type Error = CpuError;

    fn try_forward(
        &self,
        x: Tensor<(B, S, Const<I>), f32, Cpu, T>,
    ) -> Result<Self::Output, CpuError> {
        let y = Self::forward_input(x)?.try_matmul(self.forward_weight::<T>()?)?;
        let shape = *y.shape();
        y.try_add(self.bias.retaped::<T>().try_broadcast_like(&shape)?)
    }
}

// An MX config is the family of MX layers quantized as it says (see `nn::IntoLayers`).

impl<const I: usize, const O: usize, C: MxConfig> IntoLayers<C> for Linear<I, O, f32, Cpu> {
    type Output = MxLinear<I, O, C, f32, Cpu>;
    /// dfdx's f32 `Linear` to an [`MxLinear`] quantized as `C` says (the weights are the f32
    /// master).
    fn into_layers(self, _: C) -> Self::Output {
        MxLinear::new(self.weight, self.bias)
    }
}

impl<const I: usize, const O: usize, C0: MxConfig, C: MxConfig> IntoLayers<C>
    for MxLinear<I, O, C0, f32, Cpu>
{
    type Output = MxLinear<I, O, C, f32, Cpu>;
    /// The same weights quantized as `C` says.
    fn into_layers(self, _: C) -> Self::Output {
        MxLinear::new(self.weight, self.bias)
    }
}

impl<const I: usize, const O: usize, C: MxConfig, E: Dtype, D: Storage<E>> IntoLayers<Dfdx>
    for MxLinear<I, O, C, E, D>
{
    type Output = Linear<I, O, E, D>;
    /// Back to dfdx's `Linear`, with the f32 master weights.
    fn into_layers(self, _: Dfdx) -> Self::Output {
        Linear {
            weight: self.weight,
            bias: self.bias,
        }
    }
}
