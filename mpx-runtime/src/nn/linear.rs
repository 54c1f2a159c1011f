//! [`Linear`] and [`LinearReLU`]: dfdx's `Linear` (optionally followed by a `ReLU`) as one fused
//! operation on the tape, computed by mpx's [kernels](crate::kernels).
//!
//! - **Forward:** one GEMM `X·Wᵀ` (f32 sums), then one pass adding the bias, applying the
//!   activation and rounding to the layer's dtype.
//! - **Backward** (one op on the tape): one pass applying `ReLU`'s mask to `dY` and summing the bias
//!   gradient, then `dX += dZ·W` and `dW += dZᵀ·X` ([`write_weight_grad`]).
//! - **Inside a [`GradScaler`](crate::step::GradScaler) forward pass** the layer of the working
//!   copy is linked to the master tensors it stands for: `dW` and `db` are added in f32 straight
//!   to the master's gradients, unscaled and checked for finiteness in the same pass, with no half
//!   gradient and no transfer for them.
//!
//! The parameters are dfdx's (`weight: (O, I)`, `bias: (O,)`), so optimizers, `alloc_grads`,
//! mpx's casts and the mixed step's working copy treat the layer like dfdx's; [`From`] converts
//! either way, and [`IntoMpx`] converts the `Linear` layers of a whole model.
//!
//! Element types: `f32`, `f16` and `AMP<f16>` (f16 storage; sums in f32 on every path but
//! the AVX512-FP16 kernel path, which sums up to 32 products in f16:
//! see the kernels' error bounds). Emulated bf16 stores f32: its products run on bf16 pair dot
//! products (AVX512-BF16) where the CPU has them, else on the f32 kernels, on the values rounded
//! to bf16.

use std::fmt::Debug;
use std::marker::PhantomData;

use dfdx::nn::modules::Linear as DfdxLinear;
use dfdx::nn::modules::ReLU as DfdxReLU;
use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection, TensorOptions};
use dfdx::nn::{BuildModule, BuildOnDevice, Module, NonMutableModule};
use dfdx::shapes::{Const, Dim, Dtype, HasShape, Rank1, Rank2, Shape};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Storage, Tape, Tensor, TensorFromVec};
use dfdx::tensor_ops::{Device, ReshapeTo};

use crate::cast::{Cast, FloatLeaves, FloatSliceMut};
pub use crate::kernels::{Activation, KernelError};
use crate::kernels::{
    Dst, MatRef, Operand, ReluMask, add_f32_into, bias_act_into, gemm, relu_mask_bias_grad_f16,
    relu_mask_bias_grad_f32,
};
use crate::precision::{AMP, FloatBits, Precision, f16};

/// The activation a [`FusedLinear`] applies, as a type (dfdx builds modules from types).
///
/// # Examples
/// ```
/// use mpx_runtime::nn::Activation;
/// use mpx_runtime::nn::{act, FusedActivation};
/// assert_eq!(<act::ReLU as FusedActivation>::ACT, Activation::ReLU);
/// ```
pub trait FusedActivation: 'static + Debug + Clone + Copy + Default + Send + Sync {
    /// The activation the kernels apply.
    const ACT: Activation;
}

/// Activation markers for [`FusedLinear`].
pub mod act {
    use super::{Activation, FusedActivation};

    /// No activation: a plain linear layer.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::nn::{act, FusedActivation};
    /// assert_eq!(act::Identity::ACT, mpx_runtime::nn::Activation::Identity);
    /// ```
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct Identity;
    impl FusedActivation for Identity {
        const ACT: Activation = Activation::Identity;
    }

    /// `max(z, 0)` after the linear map.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::nn::{act, FusedActivation};
    /// assert_eq!(act::ReLU::ACT, mpx_runtime::nn::Activation::ReLU);
    /// ```
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct ReLU;
    impl FusedActivation for ReLU {
        const ACT: Activation = Activation::ReLU;
    }
}

/// A linear layer `y = act(x·Wᵀ + b)` with the parameters of dfdx's `Linear`. Use the aliases
/// [`Linear`] and [`LinearReLU`], and build it with [`builder::Linear`] / [`builder::LinearReLU`].
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn;
/// let dev = Cpu::default();
/// let layer = dev.build_module::<nn::builder::LinearReLU<3, 2>, f32>();
/// let y = layer.forward(dev.tensor([[1.0f32, -2.0, 0.5]]));
/// assert!(y.as_vec().iter().all(|v| *v >= 0.0));
/// ```
#[derive(Debug, Clone)]
pub struct FusedLinear<const I: usize, const O: usize, E: Dtype, D: Storage<E>, A> {
    /// The weight, shape `(O, I)` as in dfdx's `Linear`.
    pub weight: Tensor<Rank2<O, I>, E, D>,
    /// The bias, shape `(O,)`.
    pub bias: Tensor<Rank1<O>, E, D>,
    act: PhantomData<A>,
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
/// let l = dev.build_module::<mpx_runtime::nn::builder::LinearReLU<3, 2>, f16>();
/// let y = l.forward(dev.tensor([[1.0f32, 2.0, 3.0]]).to_dtype::<f16>());
/// assert!(y.as_vec().iter().all(|v| v.to_f32() >= 0.0));
/// ```
pub type LinearReLU<const I: usize, const O: usize, E, D = Cpu> =
    FusedLinear<I, O, E, D, act::ReLU>;

impl<const I: usize, const O: usize, E: Dtype, D: Storage<E>, A> FusedLinear<I, O, E, D, A> {
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
            act: PhantomData,
        }
    }
}

/// Builders, as dfdx's `dfdx::nn::builders`.
pub mod builder {
    /// Builds a [`Linear`](super::Linear) with `I` inputs and `O` outputs.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// let m = Cpu::default().build_module::<mpx_runtime::nn::builder::Linear<4, 2>, f32>();
    /// assert_eq!(m.weight.shape(), &(Const::<2>, Const::<4>));
    /// ```
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Linear<const I: usize, const O: usize>;

    /// Builds a [`LinearReLU`](super::LinearReLU) with `I` inputs and `O` outputs.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// let m = Cpu::default().build_module::<mpx_runtime::nn::builder::LinearReLU<4, 2>, f32>();
    /// assert_eq!(m.bias.shape(), &(Const::<2>,));
    /// ```
    #[derive(Debug, Clone, Copy, Default)]
    pub struct LinearReLU<const I: usize, const O: usize>;
}

macro_rules! build {
    ($b:ident, $a:ty) => {
        impl<const I: usize, const O: usize, E: Dtype, D: Device<E>> BuildOnDevice<D, E>
            for builder::$b<I, O>
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

impl<const I: usize, const O: usize, E: Dtype, D: Storage<E>, A> NonMutableModule
    for FusedLinear<I, O, E, D, A>
{
}

impl<const I: usize, const O: usize, E: Dtype, D: Device<E>, A: FusedActivation>
    TensorCollection<E, D> for FusedLinear<I, O, E, D, A>
where
    DfdxLinear<I, O, E, D>: BuildModule<D, E>,
{
    type To<E2: Dtype, D2: Device<E2>> = FusedLinear<I, O, E2, D2, A>;

    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            (
                Self::tensor(
                    "weight",
                    |s| &s.weight,
                    |s| &mut s.weight,
                    linear_weight_options(),
                ),
                Self::tensor("bias", |s| &s.bias, |s| &mut s.bias, linear_bias_options()),
            ),
            |(weight, bias)| FusedLinear::new(weight, bias),
        )
    }
}

/// The options of a layer's dfdx-`Linear` weight: trained, and reset as dfdx's `Linear` is
/// (uniform in ±1/sqrt(I)), by building one. Shared by every layer with `Linear`'s parameters.
pub(crate) fn linear_weight_options<const I: usize, const O: usize, E: Dtype, D: Device<E>>()
-> TensorOptions<Rank2<O, I>, E, D>
where
    DfdxLinear<I, O, E, D>: BuildModule<D, E>,
{
    TensorOptions::reset_with(|t| {
        *t = DfdxLinear::<I, O, E, D>::try_build(t.device())?.weight;
        Ok(())
    })
}

/// The options of a layer's dfdx-`Linear` bias (see [`linear_weight_options`]).
pub(crate) fn linear_bias_options<const I: usize, const O: usize, E: Dtype, D: Device<E>>()
-> TensorOptions<Rank1<O>, E, D>
where
    DfdxLinear<I, O, E, D>: BuildModule<D, E>,
{
    TensorOptions::reset_with(|t| {
        *t = DfdxLinear::<I, O, E, D>::try_build(t.device())?.bias;
        Ok(())
    })
}

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

/// Converts a model's dfdx `Linear` layers into mpx's fused [`Linear`], moving the parameters;
/// activations are kept as they are. To fuse a `(Linear, ReLU)` pair into one [`LinearReLU`], use
/// `LinearReLU::from((linear, relu))`.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::IntoMpx;
/// let dev = Cpu::default();
/// let model = dev.build_module::<(Linear<4, 8>, ReLU, Linear<8, 2>), f32>();
/// let x = dev.tensor([[1.0f32, 2.0, 3.0, 4.0]]);
/// let want = model.forward(x.clone());
/// let fused = model.into_mpx(); // (mpx Linear<4, 8>, ReLU, mpx Linear<8, 2>)
/// let got = fused.forward(x);
/// for (a, b) in got.as_vec().iter().zip(want.as_vec()) {
///     assert!((a - b).abs() < 1e-5);
/// }
/// ```
pub trait IntoMpx {
    /// The model with mpx's layers.
    type Mpx;
    /// Converts, moving the parameters.
    fn into_mpx(self) -> Self::Mpx;
}

impl<const I: usize, const O: usize, E: Dtype, D: Storage<E>> IntoMpx for DfdxLinear<I, O, E, D> {
    type Mpx = Linear<I, O, E, D>;
    fn into_mpx(self) -> Self::Mpx {
        self.into()
    }
}

impl IntoMpx for DfdxReLU {
    type Mpx = DfdxReLU;
    fn into_mpx(self) -> Self::Mpx {
        self
    }
}

macro_rules! tuple_into_mpx {
    ($($m:ident . $i:tt),+) => {
        impl<$($m: IntoMpx),+> IntoMpx for ($($m,)+) {
            type Mpx = ($($m::Mpx,)+);
            fn into_mpx(self) -> Self::Mpx {
                ($(self.$i.into_mpx(),)+)
            }
        }
    };
}
tuple_into_mpx!(A.0);
tuple_into_mpx!(A.0, B.1);
tuple_into_mpx!(A.0, B.1, C.2);
tuple_into_mpx!(A.0, B.1, C.2, F.3);
tuple_into_mpx!(A.0, B.1, C.2, F.3, G.4);
tuple_into_mpx!(A.0, B.1, C.2, F.3, G.4, H.5);

// ---- casts -------------------------------------------------------------------------------------

macro_rules! cast_for {
    ($($e:ty),*) => {$(
        impl<const I: usize, const O: usize, A, P: Precision> Cast<P> for FusedLinear<I, O, $e, Cpu, A> {
            type Output = FusedLinear<I, O, P::Elem, Cpu, A>;
            fn cast(&self) -> Self::Output {
                FusedLinear::new(Cast::<P>::cast(&self.weight), Cast::<P>::cast(&self.bias))
            }
        }
        impl<const I: usize, const O: usize, A> FloatLeaves for FusedLinear<I, O, $e, Cpu, A> {
            fn visit_float_bits(&self, visit: &mut dyn FnMut(FloatBits<'_>) -> bool) -> bool {
                self.weight.visit_float_bits(visit) && self.bias.visit_float_bits(visit)
            }
            fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
                self.weight.visit_floats_mut(visit);
                self.bias.visit_floats_mut(visit);
            }
        }
    )*};
}
cast_for!(f32, f16, AMP<f16>);

// ---- the fused op ------------------------------------------------------------------------------

/// `values` as a pass's destination.
fn as_dst<E: Precision<Elem = E> + Dtype>(values: &mut [E]) -> Dst<'_> {
    match E::floats_mut(values) {
        FloatSliceMut::F32(v) => Dst::F32(v),
        FloatSliceMut::F16(v) => Dst::F16(v),
    }
}

/// `ReLU`'s mask of outputs `y`.
fn relu_mask_of<E: Precision<Elem = E> + Dtype>(y: &[E]) -> ReluMask {
    match E::operand(y) {
        Operand::F16(v) => ReluMask::from_f16(v),
        Operand::F32(v) | Operand::Bf16(v) => ReluMask::from_f32(v),
    }
}

/// `ReLU` mask (where given) and bias-gradient column sums, in one pass.
fn mask_bias_grad<E: Precision<Elem = E> + Dtype>(
    dy: &mut [E],
    mask: Option<&ReluMask>,
    bias_grad: &mut [f32],
) -> Result<(), KernelError> {
    match E::floats_mut(dy) {
        FloatSliceMut::F32(v) => relu_mask_bias_grad_f32(v, mask, bias_grad),
        FloatSliceMut::F16(v) => relu_mask_bias_grad_f16(v, mask, bias_grad),
    }
}

/// Rows per GEMM call in the forward and in `dX`: bounds the f32 scratch (`ROW_CHUNK x O` or
/// `ROW_CHUNK x I` values) whatever the batch.
const ROW_CHUNK: usize = 512;

/// Kernel errors cannot happen here (the layer's shapes are fixed by its types); should one, it
/// is reported as dfdx's shape error.
fn shape_err(_: KernelError) -> CpuError {
    CpuError::WrongNumElements
}

/// Runs `f` on `n` f32 values of this thread's reusable scratch, kept across calls and grown
/// only ([`kernels::with_scratch`](crate::kernels::with_scratch)): `f` must overwrite them, as
/// the GEMMs below do with `accumulate = false`.
fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    crate::kernels::with_scratch(n, f)
}

fn read<S: Shape, E: Precision<Elem = E> + Dtype, T>(t: &Tensor<S, E, Cpu, T>) -> Vec<E> {
    let mut v = vec![E::default(); t.shape().num_elements()];
    t.copy_into(&mut v);
    v
}

/// Writes the weight gradient: `dst += dZᵀ·X` with `dZ` (`rows x O`) and `X` (`rows x I`), the
/// product summed in f32 and rounded once into `dst` (`O x I`).
///
/// This is the ordinary path. Inside a [`GradScaler`](crate::step::GradScaler) forward pass, a
/// layer of the working copy is linked to its master tensors and adds the same f32 product,
/// unscaled and checked, straight to the master's f32 gradient instead.
///
/// # Errors
/// [`KernelError::Length`] if `dz` and `x` are not whole rows (`rows` of them) or `dst` does not
/// hold `O x I` values.
///
/// # Examples
/// ```
/// use mpx_runtime::nn::write_weight_grad;
/// // rows = 2, O = 1, I = 2: dW = dz0·x0 + dz1·x1
/// let mut dw = [1.0f32, 1.0];
/// write_weight_grad(&[1.0f32, 2.0], &[1.0, 2.0, 3.0, 4.0], 2, &mut dw).unwrap();
/// assert_eq!(dw, [1.0 + 7.0, 1.0 + 10.0]);
/// ```
pub fn write_weight_grad<E: Precision<Elem = E> + Dtype>(
    dz: &[E],
    x: &[E],
    rows: usize,
    dst: &mut [E],
) -> Result<(), KernelError> {
    let o = dz.len().checked_div(rows).unwrap_or(0);
    let i = x.len().checked_div(rows).unwrap_or(0);
    if dst.len() != o * i {
        return Err(KernelError::Length {
            what: "dst",
            len: dst.len(),
            expected: o * i,
        });
    }
    with_weight_grad(dz, x, rows, |dw| add_f32_into(dw, as_dst(dst)))
}

/// Computes `dZᵀ·X` (f32 sums, `O x I`) into this thread's scratch and hands it to `use_dw`:
/// [`write_weight_grad`] rounds it into a gradient of the layer's dtype, a linked layer adds it
/// to the master's f32 gradient ([`crate::step::direct`]).
fn with_weight_grad<E: Precision<Elem = E> + Dtype, R>(
    dz: &[E],
    x: &[E],
    rows: usize,
    use_dw: impl FnOnce(&mut [f32]) -> Result<R, KernelError>,
) -> Result<R, KernelError> {
    let o = dz.len().checked_div(rows).unwrap_or(0);
    let i = x.len().checked_div(rows).unwrap_or(0);
    for (what, len, expected) in [("dz", dz.len(), rows * o), ("x", x.len(), rows * i)] {
        if len != expected {
            return Err(KernelError::Length {
                what,
                len,
                expected,
            });
        }
    }
    with_scratch(o * i, |dw| {
        gemm(
            MatRef::row_major(E::operand(dz), rows, o)?.t(),
            MatRef::row_major(E::operand(x), rows, i)?,
            dw,
            false,
        )?;
        use_dw(dw)
    })
}

impl<const I: usize, const O: usize, E: Precision<Elem = E> + Dtype, A: FusedActivation>
    FusedLinear<I, O, E, Cpu, A>
where
    Cpu: Device<E>,
{
    /// The fused forward on any input whose last axis is `I`; `out` is the output shape.
    fn fused<Sx: Shape, Sy: Shape, T: Tape<E, Cpu>>(
        &self,
        x: Tensor<Sx, E, Cpu, T>,
        out: Sy,
    ) -> Result<Tensor<Sy, E, Cpu, T>, CpuError> {
        let (x, mut tape) = x.try_contiguous()?.split_tape();
        let rows = x.shape().num_elements() / I;
        let (xv, wv) = (read(&x), read(&self.weight));
        let mut bias = vec![0.0f32; O];
        E::widen(&read(&self.bias), &mut bias);
        let mut y = vec![E::default(); rows * O];
        // f32 sums for at most ROW_CHUNK rows at a time, so the scratch stays small at any batch
        with_scratch(rows.min(ROW_CHUNK) * O, |acc| {
            for (xc, yc) in xv.chunks(ROW_CHUNK * I).zip(y.chunks_mut(ROW_CHUNK * O)) {
                let r = xc.len() / I;
                let acc = &mut acc[..r * O];
                gemm(
                    MatRef::row_major(E::operand(xc), r, I)?,
                    MatRef::row_major(E::operand(&wv), O, I)?.t(),
                    acc,
                    false,
                )?;
                bias_act_into(acc, &bias, A::ACT, as_dst(yc))?;
            }
            Ok(())
        })
        .map_err(shape_err)?;
        let mask = (T::OWNS_TAPE && A::ACT == Activation::ReLU).then(|| relu_mask_of(&y));
        // Inside a scaler's forward pass, the master tensors this layer's weight and bias
        // stand for: their gradients are then written there directly, in f32.
        let link = if T::OWNS_TAPE {
            crate::step::direct::link(&self.weight, &self.bias)
        } else {
            None
        };
        let y = x.device().try_tensor_from_vec(y, out)?;
        if T::OWNS_TAPE {
            // The op keeps the input's values and the weight's (both moved, not copied again),
            // the ReLU mask (1 bit per output) and ghosts for the gradient entries.
            let (x_id, w_id, b_id, y_id) =
                (x.ghost(), self.weight.ghost(), self.bias.ghost(), y.ghost());
            tape.add_backward_op(move |grads| {
                let mut dz: Vec<E> = slice::<E>(grads.get_or_alloc_mut(&y_id)?).to_vec();
                let mut db = vec![0.0f32; O];
                mask_bias_grad(&mut dz, mask.as_ref(), &mut db).map_err(shape_err)?;
                drop(mask);
                if let Some(link) = &link {
                    link.add_bias_grad(&db)?;
                    with_weight_grad(&dz, &xv, rows, |dw| Ok(link.add_weight_grad(dw)))
                        .map_err(shape_err)??;
                } else {
                    add_f32_into(&db, as_dst(slice::<E>(grads.get_or_alloc_mut(&b_id)?)))
                        .map_err(shape_err)?;
                    write_weight_grad(&dz, &xv, rows, slice::<E>(grads.get_or_alloc_mut(&w_id)?))
                        .map_err(shape_err)?;
                }
                drop(xv);
                input_grad::<E, I, O>(&dz, &wv, slice::<E>(grads.get_or_alloc_mut(&x_id)?))
            });
        }
        Ok(y.put_tape(tape))
    }
}

/// A gradient entry as a slice (outside the `Cpu: Device<E>` bound, under which the storage type
/// does not resolve).
fn slice<E: Precision<Elem = E> + Dtype>(v: &mut <Cpu as Storage<E>>::Vec) -> &mut [E] {
    &mut v[..]
}

/// `gx += dZ·W`, in row chunks of f32 sums (`W` as the forward pass read it).
fn input_grad<E: Precision<Elem = E> + Dtype, const I: usize, const O: usize>(
    dz: &[E],
    wv: &[E],
    gx: &mut [E],
) -> Result<(), CpuError> {
    let rows = dz.len() / O;
    with_scratch(rows.min(ROW_CHUNK) * I, |dx| {
        for (dzc, gxc) in dz.chunks(ROW_CHUNK * O).zip(gx.chunks_mut(ROW_CHUNK * I)) {
            let r = dzc.len() / O;
            let dx = &mut dx[..r * I];
            gemm(
                MatRef::row_major(E::operand(dzc), r, O)?,
                MatRef::row_major(E::operand(wv), O, I)?,
                dx,
                false,
            )?;
            add_f32_into(dx, as_dst(gxc))?;
        }
        Ok(())
    })
    .map_err(shape_err)
}

impl<
    const I: usize,
    const O: usize,
    E: Precision<Elem = E> + Dtype,
    A: FusedActivation,
    T: Tape<E, Cpu>,
> Module<Tensor<Rank1<I>, E, Cpu, T>> for FusedLinear<I, O, E, Cpu, A>
where
    Cpu: Device<E>,
{
    type Output = Tensor<Rank1<O>, E, Cpu, T>;
    type Error = CpuError;
    /// One sample.
    fn try_forward(&self, x: Tensor<Rank1<I>, E, Cpu, T>) -> Result<Self::Output, CpuError> {
        self.fused(x, (Const::<O>,))
    }
}

impl<
    const I: usize,
    const O: usize,
    E: Precision<Elem = E> + Dtype,
    A: FusedActivation,
    B: Dim,
    T: Tape<E, Cpu>,
> Module<Tensor<(B, Const<I>), E, Cpu, T>> for FusedLinear<I, O, E, Cpu, A>
where
    Cpu: Device<E>,
{
    type Output = Tensor<(B, Const<O>), E, Cpu, T>;
    type Error = CpuError;
    /// A batch of rows.
    fn try_forward(&self, x: Tensor<(B, Const<I>), E, Cpu, T>) -> Result<Self::Output, CpuError> {
        let out = (x.shape().0, Const::<O>);
        self.fused(x, out)
    }
}

impl<
    const I: usize,
    const O: usize,
    E: Precision<Elem = E> + Dtype,
    A: FusedActivation,
    B: Dim,
    S: Dim,
    T: Tape<E, Cpu>,
> Module<Tensor<(B, S, Const<I>), E, Cpu, T>> for FusedLinear<I, O, E, Cpu, A>
where
    Cpu: Device<E>,
{
    type Output = Tensor<(B, S, Const<O>), E, Cpu, T>;
    type Error = CpuError;
    /// A batch of sequences.
    fn try_forward(
        &self,
        x: Tensor<(B, S, Const<I>), E, Cpu, T>,
    ) -> Result<Self::Output, CpuError> {
        let (b, s, _) = *x.shape();
        self.fused(x, (b, s, Const::<O>))
    }
}
