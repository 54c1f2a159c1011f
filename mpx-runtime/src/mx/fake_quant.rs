//! Fake quantization of dfdx tensors: MX quantize-dequantize in the forward pass, a
//! straight-through gradient in the backward pass.

use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Tape, Tensor, TensorFromVec};
use dfdx::tensor_ops::ReshapeTo;

use super::spec::MxSpec;
use super::tensor::quantize_dequantize_into;

/// MX fake quantization of a tensor: the forward pass returns
/// [`quantize_dequantize`](super::quantize_dequantize) of the values, with blocks along the last
/// axis; the backward pass is the straight-through estimator (the output's gradient is added to
/// the input's unchanged). Works on traced tensors (`OwnedTape`) and plain ones (`NoneTape`);
/// f32 on `Cpu`.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::mx::{MxFakeQuant, MxFormat, MxSpec};
/// let dev = Cpu::default();
/// let x: Tensor<Rank2<1, 4>, f32, Cpu> = dev.tensor([[0.3, 1.0, -2.6, 6.0]]);
/// let spec = MxSpec::new(MxFormat::Fp4E2M1);
/// let y = x.leaky_trace().mx_fake_quant(&spec);
/// assert_eq!(y.array(), [[0.5, 1.0, -3.0, 6.0]]);
/// let g = (y * dev.tensor([[1.0, 2.0, 3.0, 4.0]])).sum().backward();
/// assert_eq!(g.get(&x).array(), [[1.0, 2.0, 3.0, 4.0]]); // passes straight through
/// ```
pub trait MxFakeQuant: Sized {
    /// Fallible form of [`mx_fake_quant`](MxFakeQuant::mx_fake_quant): errors only on a device
    /// (allocation) error, like dfdx's `try_*` operations.
    ///
    /// # Errors
    /// dfdx's [`CpuError`] when the output cannot be allocated.
    fn try_mx_fake_quant(self, spec: &MxSpec) -> Result<Self, CpuError>;

    /// Quantize-dequantize forward, straight-through backward.
    ///
    /// # Panics
    /// On a device (allocation) error, as dfdx's infallible operations do.
    #[must_use]
    fn mx_fake_quant(self, spec: &MxSpec) -> Self {
        match self.try_mx_fake_quant(spec) {
            Ok(t) => t,
            Err(e) => panic!("mx_fake_quant: {e}"),
        }
    }
}

impl<S: Shape, T: Tape<f32, Cpu>> MxFakeQuant for Tensor<S, f32, Cpu, T> {
    fn try_mx_fake_quant(self, spec: &MxSpec) -> Result<Self, CpuError> {
        // A permuted or broadcast input is first made contiguous (inside the graph), so its
        // gradient buffer lines up with the logical order the output uses.
        let (x, mut tape) = self.try_contiguous()?.split_tape();
        let shape = *x.shape();
        let dims: Vec<usize> = shape.concrete().into_iter().collect();
        let values = x.as_vec();
        let mut out = vec![0.0f32; values.len()];
        // The spec is valid by construction and the shape is the tensor's own, so this cannot
        // fail; a mismatch would be a wrong element count.
        quantize_dequantize_into(&values, &dims, spec, &mut out)
            .map_err(|_| CpuError::WrongNumElements)?;
        let y: Tensor<S, f32, Cpu> = x.device().try_tensor_from_vec(out, shape)?;
        if T::OWNS_TAPE {
            let (x_id, y_id) = (x.ghost(), y.ghost());
            tape.add_backward_op(move |grads| {
                let gy = grads.get_or_alloc_mut(&y_id)?.to_vec();
                let gx = grads.get_or_alloc_mut(&x_id)?;
                for (a, b) in gx.iter_mut().zip(&gy) {
                    *a += *b;
                }
                Ok(())
            });
        }
        Ok(y.put_tape(tape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mx::{MxFormat, quantize_dequantize};
    use dfdx::prelude::*;

    #[test]
    fn forward_matches_quantize_dequantize_and_gradients_accumulate() {
        let dev = Cpu::default();
        let x: Tensor<Rank2<3, 5>, f32, Cpu> = dev.sample_normal();
        let spec = MxSpec::new(MxFormat::Fp4E2M1).with_block_size(2).unwrap();
        let want = quantize_dequantize(&x.as_vec(), &[3, 5], &spec).unwrap();
        // used twice: once through the op, once directly; the gradients add up
        let xt = x.leaky_trace();
        let y = xt.with_empty_tape().mx_fake_quant(&spec);
        assert_eq!(y.as_vec(), want);
        let g = (y * 2.0 + xt).sum().backward();
        assert_eq!(g.get(&x).as_vec(), vec![3.0; 15]);
    }

    #[test]
    fn permuted_inputs_quantize_in_logical_order() {
        let dev = Cpu::default();
        let x: Tensor<Rank2<2, 3>, f32, Cpu> = dev.tensor([[1.0, 100.0, 3.0], [0.1, 0.2, 0.3]]);
        let spec = MxSpec::new(MxFormat::Fp4E2M1).with_block_size(2).unwrap();
        let xt: Tensor<Rank2<3, 2>, f32, Cpu, _> = x.leaky_trace().permute();
        let y = xt.mx_fake_quant(&spec);
        let logical = [1.0, 0.1, 100.0, 0.2, 3.0, 0.3];
        let want = quantize_dequantize(&logical, &[3, 2], &spec).unwrap();
        assert_eq!(y.as_vec(), want);
        let w = dev.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]);
        let g = (y * w).sum().backward();
        assert_eq!(g.get(&x).array(), [[1.0, 3.0, 5.0], [2.0, 4.0, 6.0]]);
    }
}
