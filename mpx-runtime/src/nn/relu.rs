//! [`ReLU`]: dfdx's `ReLU`, computed as dfdx computes it (`max(x, 0)`, gradient where `x > 0`)
//! in passes the host's vector units run: the layer a mixed step's working copy runs for a
//! model's `ReLU`. dfdx's own converts each f16 element to f32 and back, one at a time.

use dfdx::nn::{Module, NonMutableModule, ZeroSizedModule};
use dfdx::shapes::{Dtype, HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Tape, Tensor, TensorFromVec};
use dfdx::tensor_ops::Device;

use super::contiguous::contiguous;
use super::half_ops::{grad_slice, relu_mask_of, shape_err};
use super::mixed::MixedModule;
use super::scratch;
use crate::precision::{FloatSlice, FloatSliceMut, Precision};

/// `max(x, 0)`, element by element, on f32, f16 and `AMP<f16>` tensors (and emulated bf16's f32
/// storage, which it keeps bf16: a bf16 value or 0): the same values and gradients as dfdx's
/// `ReLU`, bit for bit, its special values included (dfdx's f32 `max` turns NaN to 0, its f16
/// `max` keeps NaN and `-0`).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::{nn, precision::f16};
/// let dev = Cpu::default();
/// let x = dev.tensor([-1.0f32, 0.5, 0.0]).to_dtype::<f16>();
/// let y = nn::ReLU.forward(x.leaky_trace());
/// assert_eq!(y.as_vec(), [0.0, 0.5, 0.0].map(f16::from_f32));
/// let g = y.sum().backward();
/// assert_eq!(g.get(&x).as_vec(), [0.0, 1.0, 0.0].map(f16::from_f32));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReLU;

impl ZeroSizedModule for ReLU {}
impl NonMutableModule for ReLU {}

impl<S: Shape, E: Precision<Elem = E> + Dtype, T: Tape<E, Cpu>> Module<Tensor<S, E, Cpu, T>>
    for ReLU
where
    Cpu: Device<E>,
{
    type Output = Tensor<S, E, Cpu, T>;
    type Error = CpuError;
    fn try_forward(&self, x: Tensor<S, E, Cpu, T>) -> Result<Self::Output, CpuError> {
        relu(x)
    }
}

impl<P: Precision, S: Shape, T: Tape<P::Elem, Cpu>> MixedModule<P, Tensor<S, P::Elem, Cpu, T>>
    for ReLU
where
    P::Elem: Precision<Elem = P::Elem> + Dtype,
    Cpu: Device<P::Elem>,
{
    type Output = Tensor<S, P::Elem, Cpu, T>;
    fn try_mixed_forward(&self, x: Tensor<S, P::Elem, Cpu, T>) -> Result<Self::Output, CpuError> {
        relu(x)
    }
}

/// `max(x, 0)` as dfdx computes it on f16 (`half`'s `max`): 0 where `x < 0`, `x` itself
/// everywhere else (NaN and `-0` included).
fn f16_relu(b: u16) -> u16 {
    let mag = b & 0x7fff;
    // 1 for a negative number (sign set, not -0, not NaN), as a mask without branches (a
    // vector loop)
    let negative = (b >> 15) & u16::from(mag != 0) & u16::from(mag <= 0x7c00);
    b & negative.wrapping_sub(1)
}

/// `y = max(y, 0)` in place.
fn forward_pass(y: FloatSliceMut<'_>) {
    match y {
        FloatSliceMut::F32(v) => {
            for y in v.iter_mut() {
                *y = if *y > 0.0 { *y } else { 0.0 };
            }
        }
        FloatSliceMut::F16(v) => {
            for y in v.iter_mut() {
                *y = half::f16::from_bits(f16_relu(y.to_bits()));
            }
        }
    }
}

/// The op: the output, and on a tape the gradient `dx += dy * (x > 0)`, the sum rounded once
/// to the element type as dfdx's is.
fn relu<S: Shape, E: Precision<Elem = E> + Dtype, T: Tape<E, Cpu>>(
    x: Tensor<S, E, Cpu, T>,
) -> Result<Tensor<S, E, Cpu, T>, CpuError>
where
    Cpu: Device<E>,
{
    // contiguous on its own tape (dfdx's op): the gradient below is laid out as the values
    let (x, mut tape) = contiguous(x)?.split_tape();
    let shape = *x.shape();
    let n = shape.num_elements();
    let mut y = vec![E::default(); n];
    x.copy_into(&mut y);
    forward_pass(E::floats_mut(&mut y));
    // where the output is positive, as where the input is (one bit per element)
    let mask = T::OWNS_TAPE.then(|| relu_mask_of(&y));
    let y = x.device().try_tensor_from_vec(y, shape)?;
    if T::OWNS_TAPE {
        let (x_id, y_id) = (x.ghost(), y.ghost());
        drop(x);
        tape.add_backward_op(move |grads| {
            let mut dz = scratch::copy_of(grad_slice::<E>(grads.get_or_alloc_mut(&y_id)?));
            if let Some(mask) = &mask {
                mask.zero_where_clear(E::floats_mut(&mut dz))
                    .map_err(shape_err)?;
            }
            let gx = grad_slice::<E>(grads.get_or_alloc_mut(&x_id)?);
            if gx.len() != dz.len() {
                return Err(CpuError::WrongNumElements);
            }
            match (E::floats_mut(gx), E::floats(&dz)) {
                (FloatSliceMut::F32(g), FloatSlice::F32(d) | FloatSlice::Bf16(d)) => {
                    g.iter_mut().zip(d).for_each(|(g, d)| *g += *d);
                }
                // the sum in f32, rounded once, in one pass
                (FloatSliceMut::F16(g), FloatSlice::F16(d)) => {
                    mpx_kernels::add_scaled_f16(d, half::f16::ONE, g);
                }
                (FloatSliceMut::F16(_), _) | (FloatSliceMut::F32(_), FloatSlice::F16(_)) => {
                    return Err(CpuError::WrongNumElements);
                }
            }
            Ok(())
        });
    }
    Ok(y.put_tape(tape))
}

#[cfg(test)]
mod tests {
    use dfdx::prelude::*;
    use half::f16;

    /// Output and gradient bits of `relu(x) * c + x` (the gradient of `x` gets a second
    /// contribution besides the `ReLU`'s), with dfdx's `ReLU` or mpx's.
    fn run<E: Dtype + crate::precision::Precision<Elem = E>>(
        xs: Vec<E>,
        c: Vec<E>,
        mpx: bool,
    ) -> (Vec<E>, Vec<E>)
    where
        Cpu: Device<E>,
    {
        let dev = Cpu::default();
        let n = xs.len();
        let x = dev.tensor_from_vec(xs, (n,));
        let c = dev.tensor_from_vec(c, (n,));
        let r = if mpx {
            super::ReLU.forward(x.leaky_trace())
        } else {
            ReLU.forward(x.leaky_trace())
        };
        let y = r.with_empty_tape();
        let out = r * c + x.leaky_trace();
        let g = out.sum().backward();
        (y.as_vec(), g.get(&x).as_vec())
    }

    #[test]
    fn every_f16_value_gives_dfdxs_output_and_gradient() {
        let xs: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let c: Vec<f16> = (0..xs.len())
            .map(|i| f16::from_f32(0.5 + (i % 7) as f32 * 0.125))
            .collect();
        let want = run(xs.clone(), c.clone(), false);
        let got = run(xs, c, true);
        for (what, g, w) in [("forward", &got.0, &want.0), ("gradient", &got.1, &want.1)] {
            let differ: Vec<(u16, u16, u16)> = (0..g.len())
                .filter(|&i| g[i].to_bits() != w[i].to_bits())
                .map(|i| (i as u16, g[i].to_bits(), w[i].to_bits()))
                .collect();
            assert!(
                differ.is_empty(),
                "{what}: {} values differ, (x, mpx, dfdx) bits: {:x?}",
                differ.len(),
                &differ[..differ.len().min(6)]
            );
        }
    }

    #[test]
    fn f32_special_values_give_dfdxs_output_and_gradient() {
        let xs = vec![
            -1.0f32,
            -0.0,
            0.0,
            1e-45,
            -1e-45,
            2.5,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MAX,
        ];
        let c: Vec<f32> = (0..xs.len()).map(|i| 0.25 + i as f32).collect();
        let want = run(xs.clone(), c.clone(), false);
        let got = run(xs, c, true);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got.0), bits(&want.0), "forward");
        assert_eq!(bits(&got.1), bits(&want.1), "gradient");
    }

    /// A permuted (not contiguous) traced input: its gradient in its own layout, dfdx's bits.
    #[test]
    fn a_permuted_input_gets_dfdxs_gradient() {
        let dev = Cpu::default();
        let x = dev
            .tensor([[-1.0f32, 2.0, 0.5], [3.0, -0.25, 1.0]])
            .to_dtype::<f16>();
        let w = dev
            .tensor([[1.0f32, 2.0], [3.0, 4.0], [5.0, 6.0]])
            .to_dtype::<f16>();
        let grad = |mpx: bool| {
            let xt = x.leaky_trace().permute::<Rank2<3, 2>, _>();
            let y = if mpx {
                super::ReLU.forward(xt)
            } else {
                ReLU.forward(xt)
            };
            (y * w.clone()).sum().backward().get(&x).as_vec()
        };
        assert_eq!(grad(true), grad(false));
        assert_eq!(
            grad(true),
            [0.0f32, 3.0, 5.0, 2.0, 0.0, 6.0].map(f16::from_f32)
        );
    }
}
