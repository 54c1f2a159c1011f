//! [`MixedModule`]: a forward pass that knows the precision it runs in, and [`ForwardIn`], the
//! `model.forward_in::<P, _>(x)` call that names it.

use dfdx::tensor::CpuError;

use crate::precision::Precision;

/// A layer's forward pass in precision `P`: matmuls and residual adds in `P::Elem`, the
/// precision-critical operations (layer-norm statistics, the attention softmax) in an f32
/// [`FullPrecision`](crate::region::FullPrecision) region whose result is rounded to `P`.
///
/// `P` matters beyond the element type for emulated [`bf16`](crate::precision::bf16): its
/// tensors are f32, and only `P` says that region outputs and gradients are rounded to bf16.
/// Each `mpx::nn` layer also implements dfdx's `Module`, which runs in its element type as the
/// precision (f16 or `AMP<f16>`), and for f32 elements in f32, or in emulated bf16 inside the
/// forward pass of a mixed step in emulated bf16 (which says so for its thread; an f32 region
/// inside it says f32 again).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::MixedModule;
/// use mpx_runtime::precision::bf16;
/// let dev = Cpu::default();
/// let ln = dev.build_module::<mpx_runtime::nn::LayerNorm1D<4>, f32>();
/// let x: Tensor<Rank1<4>, f32, Cpu> = dev.tensor([1.0, 2.0, 3.0, 4.0]);
/// let y = MixedModule::<bf16, _>::try_mixed_forward(&ln, x)?;
/// // The region's output is rounded to bf16: 8 significant bits.
/// assert!(y.array().iter().all(|v| v.to_bits() & 0xffff == 0));
/// # Ok::<(), dfdx::tensor::CpuError>(())
/// ```
pub trait MixedModule<P: Precision, X> {
    /// What the forward pass returns.
    type Output;
    /// Runs the forward pass in precision `P`.
    ///
    /// # Errors
    /// A device error (allocation), as dfdx's `try_forward`.
    fn try_mixed_forward(&self, x: X) -> Result<Self::Output, CpuError>;
}

/// A borrowed layer runs as the layer (so `m.forward_in::<P, _>(x)` works on the `&mut` working
/// copy a mixed step's forward closure receives).
impl<P: Precision, X, M: MixedModule<P, X> + ?Sized> MixedModule<P, X> for &M {
    type Output = M::Output;
    fn try_mixed_forward(&self, x: X) -> Result<Self::Output, CpuError> {
        (**self).try_mixed_forward(x)
    }
}

/// As for `&M`.
impl<P: Precision, X, M: MixedModule<P, X> + ?Sized> MixedModule<P, X> for &mut M {
    type Output = M::Output;
    fn try_mixed_forward(&self, x: X) -> Result<Self::Output, CpuError> {
        (**self).try_mixed_forward(x)
    }
}

/// `model.forward_in::<P, _>(x)`: calls [`MixedModule`] with the precision named at the call.
/// Implemented for every type.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::ForwardIn;
/// use mpx_runtime::precision::f16;
/// let dev = Cpu::default();
/// let ln = dev.build_module::<mpx_runtime::nn::LayerNorm1D<4>, f16>();
/// let x = dev.tensor([40000.0f32, 40000.0, 1.0, 2.0]).to_dtype::<f16>();
/// let y = ln.forward_in::<f16, _>(x.clone());
/// assert!(y.array().iter().all(|v| v.is_finite()));
/// assert!(ln.try_forward_in::<f16, _>(x).is_ok());
/// ```
pub trait ForwardIn {
    /// Runs `x` through `self` in precision `P`; panics on a device error, as dfdx's `forward`.
    fn forward_in<P: Precision, X>(&self, x: X) -> <Self as MixedModule<P, X>>::Output
    where
        Self: MixedModule<P, X>,
    {
        self.try_mixed_forward(x)
            .unwrap_or_else(|e| panic!("mpx::nn forward: device error {e:?}"))
    }

    /// Fallible form of [`ForwardIn::forward_in`].
    ///
    /// # Errors
    /// A device error (allocation).
    fn try_forward_in<P: Precision, X>(
        &self,
        x: X,
    ) -> Result<<Self as MixedModule<P, X>>::Output, CpuError>
    where
        Self: MixedModule<P, X>,
    {
        self.try_mixed_forward(x)
    }
}

impl<T: ?Sized> ForwardIn for T {}
