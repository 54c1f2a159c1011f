//! [`Linear`] and [`LinearReLU`]: dfdx's `Linear` (optionally followed by a `ReLU`) as one fused
//! operation on the tape, computed by mpx's kernels (the `mpx-kernels` crate).
//!
//! - **Forward:** one GEMM `X·Wᵀ` (f32 sums), then one pass adding the bias, applying the
//!   activation and rounding to the layer's dtype.
//! - **Backward** (one op on the tape): one pass applying `ReLU`'s mask to `dY` and summing the bias
//!   gradient, then `dX += dZ·W` and `dW += dZᵀ·X`.
//! - **Inside a [`GradScaler`](crate::step::GradScaler) forward pass** the layer of the working
//!   copy is linked to the master tensors it stands for: `dW` and `db` are added in f32 straight
//!   to the master's gradients, unscaled and checked for finiteness in the same pass, with no half
//!   gradient and no transfer for them.
//!
//! The parameters are dfdx's (`weight: (O, I)`, `bias: (O,)`), so optimizers, `alloc_grads`,
//! mpx's casts and the mixed step's working copy treat the layer like dfdx's; [`From`] converts
//! either way, and [`IntoLayers`] converts the `Linear` layers of a whole model.
//!
//! Element types: `f32`, `f16` and `AMP<f16>` (f16 storage; sums in f32 on every path but
//! the AVX512-FP16 kernel path, which sums up to 32 products in f16: see the kernels' error
//! bounds). Emulated bf16 stores f32: its products run on bf16 pair dot products (AVX512-BF16)
//! where the CPU has them, else on the f32 kernels, on the values the mixed step rounded; run in
//! it with [`forward_in::<bf16, _>`](super::ForwardIn) ([`MixedModule`]), the layer also rounds
//! its output and gradients to bf16.
//!
//! The op's buffers (the input's and the weight's values it keeps for the backward, the f32
//! sums) come from the allocator, or, while a program holds a
//! [`KeepBuffers`](crate::settings::KeepBuffers), from a pool that keeps them across steps.
//!
//! The transformer layers ([`MultiHeadAttention`](super::MultiHeadAttention), the encoder's
//! feed-forward, the ViT's patch embedding and head) run their dfdx `Linear`s through the same
//! fused op, so they get the same direct gradients inside a `GradScaler`.

use std::fmt::Debug;

use dfdx::nn::modules::Linear as DfdxLinear;
use dfdx::nn::modules::ReLU as DfdxReLU;
use dfdx::nn::{BuildModule, BuildOnDevice, Module};
use dfdx::shapes::{Const, Dtype, HasShape, Rank1, Rank2};
use dfdx::tensor::{Cpu, Storage, Tensor};
use dfdx::tensor_ops::Device;

use super::convert::{Dfdx, Mpx, into_layers};
use super::dfdx_linear::linear_collection;
use super::fused_linear::fused_linear;
use super::layer_impls::{mixed_module, native_module};
use crate::cast::{Cast, FloatLeaves};
use crate::master::link::Link;
use crate::precision::{AMP, FloatSlice, FloatSliceMut, Precision, f16};
pub use mpx_kernels::{Activation, KernelError};

/// The activation a [`FusedLinear`] applies, as a marker type ([`act::Identity`],
/// [`act::ReLU`]; dfdx builds modules from types).
///
/// # Examples
/// ```
/// use mpx_runtime::nn::{act, Activation, FusedActivation};
/// assert_eq!(act::ReLU.activation(), Activation::ReLU);
/// assert_eq!(act::Identity.activation(), Activation::Identity);
/// ```
pub trait FusedActivation: 'static + Debug + Clone + Copy + Default + Send + Sync {
    /// The activation the kernels apply.
    fn activation(&self) -> Activation;
}

/// Activation markers for [`FusedLinear`].
pub mod act {
    use super::{Activation, FusedActivation};

    /// No activation: a plain linear layer.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::nn::{act, FusedActivation};
    /// assert_eq!(act::Identity.activation(), mpx_runtime::nn::Activation::Identity);
    /// ```
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct Identity;
    impl FusedActivation for Identity {
        fn activation(&self) -> Activation {
            Activation::Identity
        }
    }

    /// `max(z, 0)` after the linear map.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::nn::{act, FusedActivation};
    /// assert_eq!(act::ReLU.activation(), mpx_runtime::nn::Activation::ReLU);
    /// ```
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct ReLU;
    impl FusedActivation for ReLU {
        fn activation(&self) -> Activation {
            Activation::ReLU
        }
    }
}

/// A linear layer `y = act(x·Wᵀ + b)` with the parameters of dfdx's `Linear`. Use the aliases
/// [`Linear`] and [`LinearReLU`], and build it with [`builders::Linear`] / [`builders::LinearReLU`].
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn;
/// let dev = Cpu::default();
/// let layer = dev.build_module::<nn::builders::LinearReLU<3, 2>, f32>();
/// let y = layer.forward(dev.tensor([[1.0f32, -2.0, 0.5]]));
/// assert!(y.as_vec().iter().all(|v| *v >= 0.0));
/// ```
#[derive(Debug, Clone)]
pub struct FusedLinear<const I: usize, const O: usize, E: Dtype, D: Storage<E>, A> {
    /// The weight, shape `(O, I)` as in dfdx's `Linear`.
    pub weight: Tensor<Rank2<O, I>, E, D>,
    /// The bias, shape `(O,)`.
    pub bias: Tensor<Rank1<O>, E, D>,
    act: A,
    /// Inside a mixed step's forward pass: the master tensors the weight and bias stand for.
    link: Option<Link>,
}

/// A fused linear layer without activation: a drop-in for dfdx's `Linear<I, O, E, D>`.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// let dev = Cpu::default();
/// let dl = dev.build_module::<Linear<3, 2>, f32>();
/// let l: mpx_runtime::nn::Linear<3, 2, f32> = dl.clone().into();
/// let x = dev.tensor([[1.0f32, 2.0, 3.0]]);
/// let (a, b) = (l.forward(x.clone()).array(), dl.forward(x).array());
/// assert!((a[0][0] - b[0][0]).abs() < 1e-6 && (a[0][1] - b[0][1]).abs() < 1e-6);
/// ```
pub type Linear<const I: usize, const O: usize, E, D = Cpu> =
    FusedLinear<I, O, E, D, act::Identity>;

/// A fused linear layer followed by `ReLU`: a drop-in for dfdx's `(Linear<I, O>, ReLU)`.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::precision::f16;
/// let dev = Cpu::default();
/// let l = dev.build_module::<mpx_runtime::nn::builders::LinearReLU<3, 2>, f16>();
/// let y = l.forward(dev.tensor([[1.0f32, 2.0, 3.0]]).to_dtype::<f16>());
/// assert!(y.as_vec().iter().all(|v| v.to_f32() >= 0.0));
/// ```
pub type LinearReLU<const I: usize, const O: usize, E, D = Cpu> =
    FusedLinear<I, O, E, D, act::ReLU>;

impl<const I: usize, const O: usize, E: Dtype, D: Storage<E>, A: Default>
    FusedLinear<I, O, E, D, A>
{
    /// A layer with these parameters.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// let dev = Cpu::default();
    /// let l = mpx_runtime::nn::Linear::<2, 1, f32>::new(dev.tensor([[1.0, 2.0]]), dev.tensor([0.5]));
    /// assert_eq!(l.forward(dev.tensor([[1.0f32, 1.0]])).array(), [[3.5]]);
    /// ```
    pub fn new(weight: Tensor<Rank2<O, I>, E, D>, bias: Tensor<Rank1<O>, E, D>) -> Self {
        Self {
            weight,
            bias,
            act: A::default(),
            link: None,
        }
    }
}

impl<const I: usize, const O: usize, E: Dtype, D: Storage<E>, A: FusedActivation>
    FusedLinear<I, O, E, D, A>
{
    /// The activation this layer applies after its linear map.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::nn::{self, Activation};
    /// let l = Cpu::default().build_module::<nn::builders::LinearReLU<2, 1>, f32>();
    /// assert_eq!(l.activation(), Activation::ReLU);
    /// ```
    pub fn activation(&self) -> Activation {
        self.act.activation()
    }
}

impl<const I: usize, const O: usize, E: Dtype, A> FusedLinear<I, O, E, Cpu, A> {
    /// The weight, bias and link the fused op reads.
    pub(crate) fn parts(&self) -> super::fused_linear::LayerParts<'_, I, O, E> {
        (&self.weight, &self.bias, self.link())
    }
}

impl<const I: usize, const O: usize, E: Dtype, D: Storage<E>, A> FusedLinear<I, O, E, D, A> {
    /// Links the layer to the master tensors its weight and bias stand for in a mixed step's
    /// forward pass ([`Linker::link`](crate::step::Linker::link)): its weight and bias
    /// gradients then go in f32 straight into the master's. `None` unlinks it.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{nn, step::Linker};
    /// let dev = Cpu::default();
    /// let master = dev.build_module::<Linear<2, 1>, f32>();
    /// let mut layer: nn::Linear<2, 1, f32> = master.clone().into();
    /// layer.set_link(Linker::none().link(&master.weight, &master.bias));
    /// assert!(!layer.is_linked());
    /// ```
    pub fn set_link(&mut self, link: Option<Link>) {
        self.link = link;
    }

    /// dfdx's `Linear` on the same tensors (shared, not copied): what the layer computes in f32.
    pub(crate) fn as_dfdx(&self) -> DfdxLinear<I, O, E, D> {
        DfdxLinear {
            weight: self.weight.clone(),
            bias: self.bias.clone(),
        }
    }

    /// The link, inside a mixed step's forward pass.
    pub(crate) fn link(&self) -> Option<&Link> {
        self.link.as_ref()
    }

    /// Whether the layer is linked to master tensors.
    ///
    /// # Examples
    /// See [`set_link`](Self::set_link).
    pub fn is_linked(&self) -> bool {
        self.link.is_some()
    }
}

/// Builders for `dev.build_module::<...>()`, as dfdx's `dfdx::nn::builders`: the types that
/// exist only to be built. mpx's other layers ([`LayerNorm1D`](super::LayerNorm1D),
/// [`MultiHeadAttention`](super::MultiHeadAttention), the encoder, the ViT's parts) build from
/// their own types.
pub mod builders {
    /// Builds a [`Linear`](super::Linear) with `I` inputs and `O` outputs.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// let m = Cpu::default().build_module::<mpx_runtime::nn::builders::Linear<4, 2>, f32>();
    /// assert_eq!(m.weight.shape(), &(Const::<2>, Const::<4>));
    /// ```
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Linear<const I: usize, const O: usize>;

    /// Builds a [`LinearReLU`](super::LinearReLU) with `I` inputs and `O` outputs.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// let m = Cpu::default().build_module::<mpx_runtime::nn::builders::LinearReLU<4, 2>, f32>();
    /// assert_eq!(m.bias.shape(), &(Const::<2>,));
    /// ```
    #[derive(Debug, Clone, Copy, Default)]
    pub struct LinearReLU<const I: usize, const O: usize>;

    /// Builds an [`MxLinear`](crate::mx::MxLinear) with `I` inputs and `O` outputs, quantized
    /// as the [`MxConfig`](crate::mx::MxConfig) `C` says.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::mx::Mxfp8Weights;
    /// use mpx_runtime::nn::builders;
    /// let m = Cpu::default().build_module::<builders::MxLinear<4, 2, Mxfp8Weights>, f32>();
    /// assert_eq!(m.weight.shape(), &(Const::<2>, Const::<4>));
    /// ```
    #[derive(Debug, Clone, Copy, Default)]
    pub struct MxLinear<const I: usize, const O: usize, C>(std::marker::PhantomData<C>);
}

macro_rules! build {
    ($b:ident, $a:ty) => {
        impl<const I: usize, const O: usize, E: Dtype, D: Device<E>> BuildOnDevice<D, E>
            for builders::$b<I, O>
        where
            FusedLinear<I, O, E, D, $a>: BuildModule<D, E>,
        {
            type Built = FusedLinear<I, O, E, D, $a>;
            fn try_build_on_device(device: &D) -> Result<Self::Built, D::Err> {
                Self::Built::try_build(device)
            }
        }
    };
}
build!(Linear, act::Identity);
build!(LinearReLU, act::ReLU);

linear_collection!(
    [A: FusedActivation] FusedLinear<I, O, E, D, A> => FusedLinear<I, O, E2, D2, A>,
    |weight, bias| FusedLinear::new(weight, bias),
);

// ---- conversions -------------------------------------------------------------------------------

impl<const I: usize, const O: usize, E: Dtype, D: Storage<E>> From<DfdxLinear<I, O, E, D>>
    for Linear<I, O, E, D>
{
    /// Moves dfdx's parameters into the fused layer.
    fn from(l: DfdxLinear<I, O, E, D>) -> Self {
        Self::new(l.weight, l.bias)
    }
}

impl<const I: usize, const O: usize, E: Dtype, D: Storage<E>> From<Linear<I, O, E, D>>
    for DfdxLinear<I, O, E, D>
{
    /// Moves the parameters back into dfdx's layer.
    fn from(l: Linear<I, O, E, D>) -> Self {
        DfdxLinear {
            weight: l.weight,
            bias: l.bias,
        }
    }
}

impl<const I: usize, const O: usize, E: Dtype, D: Storage<E>>
    From<(DfdxLinear<I, O, E, D>, DfdxReLU)> for LinearReLU<I, O, E, D>
{
    /// Fuses dfdx's `(Linear, ReLU)` into one layer.
    fn from((l, _): (DfdxLinear<I, O, E, D>, DfdxReLU)) -> Self {
        Self::new(l.weight, l.bias)
    }
}

impl<const I: usize, const O: usize, E: Dtype, D: Storage<E>> From<LinearReLU<I, O, E, D>>
    for (DfdxLinear<I, O, E, D>, DfdxReLU)
{
    /// Splits the fused layer back into dfdx's `(Linear, ReLU)`.
    fn from(l: LinearReLU<I, O, E, D>) -> Self {
        (
            DfdxLinear {
                weight: l.weight,
                bias: l.bias,
            },
            DfdxReLU,
        )
    }
}

into_layers!(
    [const I: usize, const O: usize, E: Dtype, D: Storage<E>]
    /// dfdx's `Linear` to the fused [`Linear`].
    DfdxLinear<I, O, E, D> => Mpx: Linear<I, O, E, D>,
    /// Already dfdx's.
    DfdxLinear<I, O, E, D> => Dfdx,
    /// The fused [`Linear`] back to dfdx's.
    Linear<I, O, E, D> => Dfdx: DfdxLinear<I, O, E, D>,
    /// The fused [`LinearReLU`] back to dfdx's `(Linear, ReLU)`.
    LinearReLU<I, O, E, D> => Dfdx: (DfdxLinear<I, O, E, D>, DfdxReLU),
);
into_layers!(
    [const I: usize, const O: usize, E: Dtype, D: Storage<E>, A]
    /// Already mpx's.
    FusedLinear<I, O, E, D, A> => Mpx,
);

// ---- casts -------------------------------------------------------------------------------------

macro_rules! cast_for {
    ($($e:ty),*) => {$(
        impl<const I: usize, const O: usize, A: Copy, P: Precision> Cast<P> for FusedLinear<I, O, $e, Cpu, A> {
            type Output = FusedLinear<I, O, P::Elem, Cpu, A>;
            fn cast(&self) -> Self::Output {
                FusedLinear {
                    weight: Cast::<P>::cast(&self.weight),
                    bias: Cast::<P>::cast(&self.bias),
                    act: self.act,
                    link: None,
                }
            }
        }
        impl<const I: usize, const O: usize, A> FloatLeaves for FusedLinear<I, O, $e, Cpu, A> {
            fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
                self.weight.visit_floats(visit) && self.bias.visit_floats(visit)
            }
            fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
                self.weight.visit_floats_mut(visit);
                self.bias.visit_floats_mut(visit);
            }
        }
    )*};
}
cast_for!(f32, f16, AMP<f16>);

/// The fused layer on one sample `(I,)`, a batch `(B, I)` or a batch of sequences `(B, S, I)`,
/// in precision `P` (`forward_in::<P, _>`; dfdx's `forward` runs in the element type). With
/// emulated bf16 (f32 storage) the output and the gradients are rounded to bf16.
macro_rules! mixed_forward {
    ($($d:ident),*) => {
        mixed_module! {
            FusedLinear[const I, const O]; A: FusedActivation, dims [$($d),*],
            fn(self, x: Tensor<($($d,)* Const<I>,), E, Cpu, T>) -> Tensor<($($d,)* Const<O>,), E, Cpu, T> {
                if P::IDENTITY {
                    // dfdx's own op in f32: bit for bit what dfdx's `Linear` (and `ReLU`) give
                    let y = self.as_dfdx().try_forward(x)?;
                    return match self.act.activation() {
                        Activation::ReLU => y.try_relu(),
                        Activation::Identity => Ok(y),
                    };
                }
                #[allow(non_snake_case)]
                let ($($d,)* _,) = *x.shape();
                fused_linear::<P, E, I, O, _, _, T>(
                    self.parts(),
                    self.act.activation(),
                    x,
                    ($($d,)* Const::<O>,),
                )
            }
        }
    };
}
mixed_forward!();
mixed_forward!(B);
mixed_forward!(B, S);

native_module!(FusedLinear[const I, const O]; A);
