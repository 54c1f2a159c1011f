//! Gradient clipping by global norm, on the unscaled f32 gradients of the master (PyTorch's
//! `clip_grad_norm_` after `scaler.unscale_(opt)`; with [`GradScaler`](super::GradScaler) the
//! gradients a backward pass returns are already unscaled).

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::shapes::Shape;
use dfdx::tensor::{Cpu, CpuError, Gradients, Tensor};

use super::error::StepError;
use crate::walk::{Each, each};

/// Visits every trainable tensor's gradient.
struct EachGrad<'a, F> {
    grads: &'a mut Gradients<f32, Cpu>,
    f: F,
}

impl<F: FnMut(&mut [f32])> Each<f32, Cpu> for EachGrad<'_, F> {
    type Error = CpuError;
    fn tensor<S: Shape>(
        &mut self,
        trainable: bool,
        t: &Tensor<S, f32, Cpu>,
    ) -> Result<(), CpuError> {
        if trainable {
            (self.f)(&mut self.grads.get_or_alloc_mut(t)?[..]);
        }
        Ok(())
    }
}

fn each_grad<M: TensorCollection<f32, Cpu>>(
    model: &M,
    grads: &mut Gradients<f32, Cpu>,
    f: impl FnMut(&mut [f32]),
) -> Result<(), CpuError> {
    each(model, &mut EachGrad { grads, f }, std::convert::identity)
}

/// The global L2 norm of `model`'s gradients in `grads`, summed in f64 (inf or NaN when a
/// gradient is).
///
/// # Errors
/// A device error when a gradient entry has to be allocated.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::step::grad_norm;
/// let dev: Cpu = Default::default();
/// let model = dev.build_module::<Linear<1, 1>, f32>();
/// let mut grads = model.alloc_grads();
/// grads.get_or_alloc_mut(&model.weight)?.copy_from_slice(&[3.0]);
/// grads.get_or_alloc_mut(&model.bias)?.copy_from_slice(&[4.0]);
/// assert_eq!(grad_norm(&model, &mut grads)?, 5.0);
/// # Ok::<(), dfdx::tensor::CpuError>(())
/// ```
pub fn grad_norm<M: TensorCollection<f32, Cpu>>(
    model: &M,
    grads: &mut Gradients<f32, Cpu>,
) -> Result<f32, CpuError> {
    let mut sum = 0.0f64;
    each_grad(model, grads, |g| {
        sum += g.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>();
    })?;
    Ok(sum.sqrt() as f32)
}

/// Scales `model`'s gradients so that their global L2 norm is at most `max_norm`, and returns
/// the norm before clipping (PyTorch's `clip_grad_norm_`). A non-finite norm leaves the
/// gradients as they are: the step will be skipped anyway, and clipping would hide the
/// overflow.
///
/// # Errors
/// [`StepError::InvalidClip`] for a `max_norm` that is negative, infinite or NaN (nothing is
/// changed); [`StepError::Device`] when a gradient entry has to be allocated and cannot be.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::step::{clip_grad_norm, grad_norm};
/// let dev: Cpu = Default::default();
/// let model = dev.build_module::<Linear<1, 1>, f32>();
/// let mut grads = model.alloc_grads();
/// grads.get_or_alloc_mut(&model.weight)?.copy_from_slice(&[3.0]);
/// grads.get_or_alloc_mut(&model.bias)?.copy_from_slice(&[4.0]);
/// assert_eq!(clip_grad_norm(&model, &mut grads, 1.0)?, 5.0);
/// assert!((grad_norm(&model, &mut grads)? - 1.0).abs() < 1e-6);
/// assert!(clip_grad_norm(&model, &mut grads, -1.0).is_err());
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
pub fn clip_grad_norm<M: TensorCollection<f32, Cpu>>(
    model: &M,
    grads: &mut Gradients<f32, Cpu>,
    max_norm: f32,
) -> Result<f32, StepError> {
    if !(max_norm.is_finite() && max_norm >= 0.0) {
        return Err(StepError::InvalidClip { max_norm });
    }
    let norm = grad_norm(model, grads)?;
    if norm.is_finite() && norm > max_norm {
        let factor = max_norm / (norm + 1e-6);
        each_grad(model, grads, |g| g.iter_mut().for_each(|v| *v *= factor))?;
    }
    Ok(norm)
}
