//! [`Tanh`] and [`Sigmoid`]: dfdx's activations of the same names as a mixed step's mapped
//! working copy runs them: each value widened to f32, the function and its derivative computed
//! there, and rounded once to the precision (dfdx rounds to f16 after every operation, and
//! converts element by element). The gradient is `dy * f'(x)` from the output, as dfdx's.

use dfdx::nn::{Module, NonMutableModule, ZeroSizedModule};
use dfdx::shapes::{Dtype, HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Tape, Tensor, TensorFromVec};
use dfdx::tensor_ops::{Device, ReshapeTo};

use super::half_ops::grad_slice;
use super::mixed::MixedModule;
use super::scratch::{self, CHUNK};
use crate::precision::Precision;

/// An activation computed in f32: its function and its derivative from the output.
trait Activation: Copy + Send + Sync + 'static {
    fn f(x: f32) -> f32;
    fn df(fx: f32) -> f32;
}

/// `tanh(x)`, computed in f32 and rounded once; gradient `dy * (1 - tanh(x)^2)`.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::{nn, precision::f16};
/// let dev = Cpu::default();
/// let x = dev.tensor([0.0f32, 1.0, -20.0]).to_dtype::<f16>();
/// let y = nn::Tanh.forward(x.leaky_trace());
/// assert_eq!(y.as_vec(), [0.0f32, 1.0f32.tanh(), -1.0].map(f16::from_f32));
/// let g = y.sum().backward();
/// assert_eq!(g.get(&x).as_vec()[0], f16::from_f32(1.0));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tanh;

/// `1 / (1 + exp(-x))`, computed in f32 and rounded once; gradient `dy * s (1 - s)`.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::{nn, precision::f16};
/// let dev = Cpu::default();
/// let x = dev.tensor([0.0f32, 30.0]).to_dtype::<f16>();
/// let y = nn::Sigmoid.forward(x.leaky_trace());
/// assert_eq!(y.as_vec(), [0.5f32, 1.0].map(f16::from_f32));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sigmoid;

impl Activation for Tanh {
    fn f(x: f32) -> f32 {
        x.tanh()
    }
    fn df(fx: f32) -> f32 {
        1.0 - fx * fx
    }
}

impl Activation for Sigmoid {
    fn f(x: f32) -> f32 {
        1.0 / (1.0 + (-x).exp())
    }
    fn df(fx: f32) -> f32 {
        fx * (1.0 - fx)
    }
}

/// The impls each activation shares: a zero-sized dfdx module, running in the element type as
/// the precision, or in `P` inside a mixed step.
macro_rules! activation {
    ($($a:ident),*) => {$(
        impl ZeroSizedModule for $a {}
        impl NonMutableModule for $a {}

        impl<S: Shape, E: Precision<Elem = E> + Dtype, T: Tape<E, Cpu>>
            Module<Tensor<S, E, Cpu, T>> for $a
        where
            Cpu: Device<E>,
        {
            type Output = Tensor<S, E, Cpu, T>;
            type Error = CpuError;
            fn try_forward(&self, x: Tensor<S, E, Cpu, T>) -> Result<Self::Output, CpuError> {
                apply::<E, $a, S, T>(x)
            }
        }

        impl<P: Precision, S: Shape, T: Tape<P::Elem, Cpu>>
            MixedModule<P, Tensor<S, P::Elem, Cpu, T>> for $a
        where
            P::Elem: Dtype,
            Cpu: Device<P::Elem>,
        {
            type Output = Tensor<S, P::Elem, Cpu, T>;
            fn try_mixed_forward(
                &self,
                x: Tensor<S, P::Elem, Cpu, T>,
            ) -> Result<Self::Output, CpuError> {
                apply::<P, $a, S, T>(x)
            }
        }
    )*};
}
activation!(Tanh, Sigmoid);

/// The op in precision `P`: the output rounded to `P` once, and on a tape the gradient
/// `dx += dy * f'(y)`, the sum rounded once.
fn apply<P: Precision, A: Activation, S: Shape, T: Tape<P::Elem, Cpu>>(
    x: Tensor<S, P::Elem, Cpu, T>,
) -> Result<Tensor<S, P::Elem, Cpu, T>, CpuError>
where
    P::Elem: Dtype,
    Cpu: Device<P::Elem>,
{
    let (x, mut tape) = x.split_tape();
    let shape = *x.shape();
    let n = shape.num_elements();
    let mut xs = scratch::take::<P::Elem>(n);
    x.clone().try_contiguous()?.copy_into(&mut xs);
    let mut wide = scratch::take::<f32>(n);
    P::widen(&xs, &mut wide);
    for v in wide.iter_mut() {
        *v = A::f(*v);
    }
    let mut y = vec![P::Elem::default(); n];
    P::round(&wide, &mut y);
    drop((xs, wide));
    // the output as stored, for the derivative
    let kept = T::OWNS_TAPE.then(|| y.clone());
    let y = x.device().try_tensor_from_vec(y, shape)?;
    if let Some(fy) = kept {
        let (x_id, y_id) = (x.ghost(), y.ghost());
        drop(x);
        tape.add_backward_op(move |grads| {
            // a chunk at a time (each gradient looked up once per chunk): no f32 copy of the
            // whole gradient at the step's peak
            let (mut d, mut g) = (
                scratch::take::<f32>(n.min(CHUNK)),
                scratch::take::<f32>(n.min(CHUNK)),
            );
            for (i, fy) in fy.chunks(CHUNK).enumerate() {
                let at = i * CHUNK..i * CHUNK + fy.len();
                let (d, g) = (&mut d[..fy.len()], &mut g[..fy.len()]);
                P::widen(fy, d);
                let dy = grad_slice::<P::Elem>(grads.get_or_alloc_mut(&y_id)?);
                P::widen(dy.get(at.clone()).ok_or(CpuError::WrongNumElements)?, g);
                for (d, g) in d.iter_mut().zip(g.iter()) {
                    *d = A::df(*d) * *g;
                }
                let gx = grad_slice::<P::Elem>(grads.get_or_alloc_mut(&x_id)?);
                let gx = gx.get_mut(at).ok_or(CpuError::WrongNumElements)?;
                P::widen(gx, g);
                for (g, d) in g.iter_mut().zip(d.iter()) {
                    *g += *d;
                }
                P::round(g, gx);
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

    /// `f(x) * c + x` in f16 through mpx's op over `n` values (several backward chunks and a
    /// partial one), its output and gradient bits against the op's definition computed here
    /// value by value: `y = f16(f(x))`, and `dx = f16(1 + f'(y) * c)` (the `+ x` adds 1 first,
    /// then the op adds its f32 product to it, rounded once).
    fn check(
        f: impl Fn(f32) -> f32,
        df: impl Fn(f32) -> f32,
        forward: impl Fn(
            Tensor<(usize,), f16, Cpu, OwnedTape<f16, Cpu>>,
        ) -> Tensor<(usize,), f16, Cpu, OwnedTape<f16, Cpu>>,
    ) {
        let n = 2 * super::CHUNK + 317;
        let dev = Cpu::default();
        let xs: Vec<f16> = (0..n)
            .map(|i| f16::from_f32((i as f32 - n as f32 / 2.0) / 700.0))
            .collect();
        let cs: Vec<f16> = (0..n)
            .map(|i| f16::from_f32(0.5 + (i % 7) as f32 * 0.125))
            .collect();
        let x = dev.tensor_from_vec(xs.clone(), (n,));
        let c = dev.tensor_from_vec(cs.clone(), (n,));
        let r = forward(x.leaky_trace());
        let y = r.with_empty_tape().as_vec();
        let g = (r * c + x.leaky_trace()).sum().backward().get(&x).as_vec();
        for i in 0..n {
            let want_y = f16::from_f32(f(xs[i].to_f32()));
            let want_g = f16::from_f32(1.0 + df(want_y.to_f32()) * cs[i].to_f32());
            assert_eq!(y[i].to_bits(), want_y.to_bits(), "output {i}");
            assert_eq!(g[i].to_bits(), want_g.to_bits(), "gradient {i}");
        }
    }

    #[test]
    fn gradients_over_several_chunks_are_the_ops_definition() {
        check(f32::tanh, |y| 1.0 - y * y, |x| super::Tanh.forward(x));
        check(
            |x| 1.0 / (1.0 + (-x).exp()),
            |y| y * (1.0 - y),
            |x| super::Sigmoid.forward(x),
        );
    }
}
