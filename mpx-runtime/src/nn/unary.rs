//! [`Tanh`], [`Sigmoid`] and [`LeakyReLU`]: dfdx's activations of the same names as a mixed
//! step's mapped working copy runs them: each value widened to f32, the function and its
//! derivative computed there, and rounded once to the precision (dfdx rounds to f16 after every
//! operation, and converts element by element). The gradient is `dy * f'(x)`, as dfdx's: from the
//! output for `Tanh` and `Sigmoid`, from the input's sign for `LeakyReLU`.

use dfdx::nn::{Module, NonMutableModule, ZeroSizedModule};
use dfdx::shapes::{Dtype, HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Tape, Tensor, TensorFromVec};
use dfdx::tensor_ops::Device;

use super::contiguous::contiguous;
use super::half_ops::grad_slice;
use super::mixed::MixedModule;
use super::scratch::{self, CHUNK};
use crate::precision::Precision;

/// An activation computed in f32: its function, and its derivative from the values its backward
/// pass keeps (the output, or the input where the output cannot tell).
trait Activation: Copy + Send + Sync + 'static {
    /// Whether the backward pass keeps the input (else the output).
    const KEEPS_INPUT: bool = false;
    fn f(self, x: f32) -> f32;
    /// The derivative at a point, from its kept value.
    fn df(self, kept: f32) -> f32;
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

/// dfdx's `LeakyReLU` with slope `.0`: `x * slope` where `x < 0`, `x` itself elsewhere (zeros of
/// either sign and NaN included), the product computed in f32 with the f32 slope (an f32
/// master's, not rounded to the half type) and rounded once; gradient `dy * slope` where
/// `x < 0`, else `dy`. A mixed step's working copy runs dfdx's `LeakyReLU` as this (dfdx's own
/// in f16 is four ops on its scalar kernels).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::{nn, precision::f16};
/// let dev = Cpu::default();
/// let x = dev.tensor([-3.0f32, 0.5, -0.0]).to_dtype::<f16>();
/// let y = nn::LeakyReLU(0.1).forward(x.leaky_trace());
/// // -3 * 0.1 in f32, rounded once
/// assert_eq!(y.as_vec(), [-0.3f32, 0.5, -0.0].map(f16::from_f32));
/// let g = y.sum().backward();
/// assert_eq!(g.get(&x).as_vec(), [0.1f32, 1.0, 1.0].map(f16::from_f32));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeakyReLU(pub f32);

impl Default for LeakyReLU {
    /// dfdx's default slope, 0.05.
    fn default() -> Self {
        Self(0.05)
    }
}

impl Activation for Tanh {
    fn f(self, x: f32) -> f32 {
        x.tanh()
    }
    fn df(self, fx: f32) -> f32 {
        1.0 - fx * fx
    }
}

impl Activation for Sigmoid {
    fn f(self, x: f32) -> f32 {
        1.0 / (1.0 + (-x).exp())
    }
    fn df(self, fx: f32) -> f32 {
        fx * (1.0 - fx)
    }
}

impl Activation for LeakyReLU {
    const KEEPS_INPUT: bool = true;
    fn f(self, x: f32) -> f32 {
        if x < 0.0 { x * self.0 } else { x }
    }
    fn df(self, x: f32) -> f32 {
        if x < 0.0 { self.0 } else { 1.0 }
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
                apply::<E, $a, S, T>(*self, x)
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
                apply::<P, $a, S, T>(*self, x)
            }
        }
    )*};
}
activation!(Tanh, Sigmoid, LeakyReLU);

/// The op in precision `P`: the output rounded to `P` once, and on a tape the gradient
/// `dx += dy * f'(x)`, the sum rounded once.
fn apply<P: Precision, A: Activation, S: Shape, T: Tape<P::Elem, Cpu>>(
    a: A,
    x: Tensor<S, P::Elem, Cpu, T>,
) -> Result<Tensor<S, P::Elem, Cpu, T>, CpuError>
where
    P::Elem: Dtype,
    Cpu: Device<P::Elem>,
{
    // contiguous on its own tape (dfdx's op): the gradient below is laid out as the values
    let (x, mut tape) = contiguous(x)?.split_tape();
    let shape = *x.shape();
    let n = shape.num_elements();
    let mut xs = scratch::take::<P::Elem>(n);
    x.copy_into(&mut xs);
    let mut wide = scratch::take::<f32>(n);
    P::widen(&xs, &mut wide);
    for v in wide.iter_mut() {
        *v = a.f(*v);
    }
    let mut y = vec![P::Elem::default(); n];
    P::round(&wide, &mut y);
    // the input or the output as stored, for the derivative
    let kept = T::OWNS_TAPE.then(|| {
        if A::KEEPS_INPUT {
            xs.to_vec()
        } else {
            y.clone()
        }
    });
    drop((xs, wide));
    let y = x.device().try_tensor_from_vec(y, shape)?;
    if let Some(kept) = kept {
        let (x_id, y_id) = (x.ghost(), y.ghost());
        drop(x);
        tape.add_backward_op(move |grads| {
            // a chunk at a time (each gradient looked up once per chunk): no f32 copy of the
            // whole gradient at the step's peak
            let (mut d, mut g) = (
                scratch::take::<f32>(n.min(CHUNK)),
                scratch::take::<f32>(n.min(CHUNK)),
            );
            for (i, k) in kept.chunks(CHUNK).enumerate() {
                let at = i * CHUNK..i * CHUNK + k.len();
                let (d, g) = (&mut d[..k.len()], &mut g[..k.len()]);
                P::widen(k, d);
                let dy = grad_slice::<P::Elem>(grads.get_or_alloc_mut(&y_id)?);
                P::widen(dy.get(at.clone()).ok_or(CpuError::WrongNumElements)?, g);
                for (d, g) in d.iter_mut().zip(g.iter()) {
                    *d = a.df(*d) * *g;
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
    /// value by value: `y = f16(f(x))`, and `dx = f16(1 + f'(x) * c)` (the `+ x` adds 1 first,
    /// then the op adds its f32 product to it, rounded once); `df` is given `x` and `y`.
    fn check(
        f: impl Fn(f32) -> f32,
        df: impl Fn(f32, f32) -> f32,
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
            let want_g = f16::from_f32(1.0 + df(xs[i].to_f32(), want_y.to_f32()) * cs[i].to_f32());
            assert_eq!(y[i].to_bits(), want_y.to_bits(), "output {i}");
            assert_eq!(g[i].to_bits(), want_g.to_bits(), "gradient {i}");
        }
    }

    #[test]
    fn gradients_over_several_chunks_are_the_ops_definition() {
        check(f32::tanh, |_, y| 1.0 - y * y, |x| super::Tanh.forward(x));
        check(
            |x| 1.0 / (1.0 + (-x).exp()),
            |_, y| y * (1.0 - y),
            |x| super::Sigmoid.forward(x),
        );
        check(
            |x| if x < 0.0 { x * 0.3 } else { x },
            |x, _| if x < 0.0 { 0.3 } else { 1.0 },
            |x| super::LeakyReLU(0.3).forward(x),
        );
    }

    /// dfdx's f32 `LeakyReLU` on f16 values, rounded once, is mpx's f16 one: output and gradient
    /// bits, zeros of both signs and values whose product is subnormal or underflows included;
    /// dfdx's own f16 layer (its slope rounded to f16 first) gives other outputs.
    #[test]
    fn leaky_relu_is_dfdxs_f32_layer_rounded_once() {
        let dev = Cpu::default();
        let slope = 0.01f32;
        let xs: Vec<f16> = [
            0.0f32, -0.0, 3.0, -3.0, -1e-7, -6e-5, -65504.0, 1.5, -0.7, -123.4,
        ]
        .into_iter()
        .chain((0..200).map(|i| (i as f32 - 100.0) * 0.37))
        .map(f16::from_f32)
        .collect();
        let n = xs.len();
        let x = dev.tensor_from_vec(xs.clone(), (n,));
        let y = super::LeakyReLU(slope).forward(x.leaky_trace());
        let yv = y.with_empty_tape().as_vec();
        let g = (y * 3.0).sum().backward().get(&x).as_vec();

        let x32 = dev.tensor_from_vec(xs.iter().map(|v| v.to_f32()).collect(), (n,));
        let y32 = LeakyReLU(slope).forward(x32.leaky_trace());
        let y32v = y32.with_empty_tape().as_vec();
        let g32 = (y32 * 3.0).sum().backward().get(&x32).as_vec();
        let bits = |v: Vec<f16>| v.into_iter().map(f16::to_bits).collect::<Vec<_>>();
        let round = |v: Vec<f32>| v.into_iter().map(f16::from_f32).collect::<Vec<_>>();
        assert_eq!(bits(yv), bits(round(y32v.clone())));
        assert_eq!(bits(g), bits(round(g32)));
        // dfdx's f16 layer rounds the slope first (0.01 is no f16 value)
        let dfdx16 = LeakyReLU(f16::from_f32(slope)).forward(x).as_vec();
        assert_ne!(bits(dfdx16), bits(round(y32v)));
    }

    /// A permuted (not contiguous) traced input: its gradient in its own layout, as dfdx's f32
    /// layer gives it, rounded.
    #[test]
    fn a_permuted_input_gets_its_gradient_in_its_own_layout() {
        let dev = Cpu::default();
        let x32 = dev.tensor([[-1.0f32, 2.0, 0.5], [3.0, -0.25, 1.0]]);
        let x = x32.clone().to_dtype::<f16>();
        let w32 = dev.tensor([[1.0f32, 2.0], [3.0, 4.0], [5.0, 6.0]]);
        let y = super::LeakyReLU(0.5).forward(x.leaky_trace().permute::<Rank2<3, 2>, _>());
        let g = (y * w32.clone().to_dtype::<f16>())
            .sum()
            .backward()
            .get(&x)
            .as_vec();
        let y32 = LeakyReLU(0.5).forward(x32.leaky_trace().permute::<Rank2<3, 2>, _>());
        let g32 = (y32 * w32).sum().backward().get(&x32).as_vec();
        assert_eq!(g, g32.into_iter().map(f16::from_f32).collect::<Vec<_>>());
    }
}
