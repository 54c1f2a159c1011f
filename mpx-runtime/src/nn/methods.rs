//! Element-wise tensor methods in a `#[half_forward]` working copy's code (`x.tanh()`,
//! `x.try_square()`, ..), run as the layers of the same names run in a mapped working copy:
//! `relu`, `tanh` and `sigmoid` as mpx's [`ReLU`], [`Tanh`] and [`Sigmoid`], the others as
//! [`InF32`] of dfdx's layer (computed in f32 on the half values, rounded once), where dfdx's
//! half methods convert each value on its own. The dispatch is by type, as the operators'
//! ([`HalfOps`](super::binary::HalfOps)): a tensor takes the layer, anything else (a number's
//! `x.sqrt()`) the method as written ([`AsWritten`](super::binary::AsWritten)).

use dfdx::nn::Module;
use dfdx::nn::modules as dfdx_layers;
use dfdx::shapes::{Dtype, Shape};
use dfdx::tensor::{Cpu, CpuError, Tape, Tensor};
use dfdx::tensor_ops::Device;

use super::binary::Operands;
use super::{InF32, ReLU, Sigmoid, Tanh};
use crate::precision::Precision;

/// The trait and its impl for a tensor alone (the operands `(x, ())`): per method, the op that
/// runs it as its layer and the `try_` form's.
macro_rules! methods {
    ($($op:ident, $try_op:ident => $layer:ty;)*) => {
        /// The element-wise methods of a half tensor as mpx's layers (picked first:
        /// `(&operands).tanh_op()` is `Some`; anything else takes `AsWritten`'s `None`).
        #[doc(hidden)]
        pub trait HalfMethods {
            /// The method's output.
            type Output;
            $(
                #[doc = concat!("`x.", stringify!($op), "` as its layer.")]
                fn $op(&self) -> Option<Self::Output>;
                #[doc = concat!("The `try_` form of `", stringify!($op), "`.")]
                fn $try_op(&self) -> Option<Result<Self::Output, CpuError>>;
            )*
        }

        impl<S, E, T> HalfMethods for Operands<Tensor<S, E, Cpu, T>, ()>
        where
            S: Shape,
            E: Precision<Elem = E> + Dtype,
            Cpu: Device<E>,
            T: Tape<E, Cpu>,
            $($layer: Module<Tensor<S, E, Cpu, T>, Output = Tensor<S, E, Cpu, T>, Error = CpuError>,)*
        {
            type Output = Tensor<S, E, Cpu, T>;
            $(
                fn $op(&self) -> Option<Self::Output> {
                    self.$try_op().map(Result::unwrap)
                }
                fn $try_op(&self) -> Option<Result<Self::Output, CpuError>> {
                    let (x, ()) = self.take();
                    Some(<$layer>::default().try_forward(x))
                }
            )*
        }
    };
}

methods! {
    relu_op, try_relu_op => ReLU;
    tanh_op, try_tanh_op => Tanh;
    sigmoid_op, try_sigmoid_op => Sigmoid;
    fast_gelu_op, try_fast_gelu_op => InF32<dfdx_layers::FastGeLU>;
    accurate_gelu_op, try_accurate_gelu_op => InF32<dfdx_layers::AccurateGeLU>;
    abs_op, try_abs_op => InF32<dfdx_layers::Abs>;
    square_op, try_square_op => InF32<dfdx_layers::Square>;
    sqrt_op, try_sqrt_op => InF32<dfdx_layers::Sqrt>;
    sin_op, try_sin_op => InF32<dfdx_layers::Sin>;
    cos_op, try_cos_op => InF32<dfdx_layers::Cos>;
}

#[cfg(test)]
#[allow(
    clippy::needless_borrow,
    reason = "the dispatch is by autoref: `(&operands)`, as the generated code writes it"
)]
mod tests {
    use dfdx::prelude::*;
    use half::f16;

    use super::HalfMethods as _;
    use crate::nn::binary::{AsWritten as _, Operands};

    /// Each method of an f16 tensor through the dispatch against dfdx's f32 method on the same
    /// values: the output the f32 value rounded once, and for those run in an f32 region the
    /// gradient of `sum(y * w)` too (mpx's `Tanh` and `Sigmoid` take theirs from the rounded
    /// output, as dfdx's do: their own tests cover them).
    #[test]
    fn a_half_tensors_methods_are_the_f32_ones_rounded_once() {
        type X<E, T = NoneTape> = Tensor<Rank2<3, 7>, E, Cpu, T>;
        type Ours = fn(&Operands<X<f16, OwnedTape<f16, Cpu>>, ()>) -> X<f16, OwnedTape<f16, Cpu>>;
        type Theirs = fn(X<f32, OwnedTape<f32, Cpu>>) -> X<f32, OwnedTape<f32, Cpu>>;
        let dev = Cpu::seed_from_u64(3);
        // positive values (a square root of each), away from zero (|x|'s kink)
        let x: X<f16> = (dev.sample_uniform::<Rank2<3, 7>>() * 3.0 + 0.1).to_dtype();
        let w: X<f16> = dev.sample_normal();
        let methods: [(&str, Ours, Theirs); 10] = [
            ("relu", |o| o.relu_op().unwrap(), |x| x.relu()),
            ("tanh", |o| o.tanh_op().unwrap(), |x| x.tanh()),
            ("sigmoid", |o| o.sigmoid_op().unwrap(), |x| x.sigmoid()),
            (
                "fast_gelu",
                |o| o.fast_gelu_op().unwrap(),
                |x| x.fast_gelu(),
            ),
            (
                "accurate_gelu",
                |o| o.accurate_gelu_op().unwrap(),
                |x| x.accurate_gelu(),
            ),
            ("abs", |o| o.try_abs_op().unwrap().unwrap(), |x| x.abs()),
            ("square", |o| o.square_op().unwrap(), |x| x.square()),
            ("sqrt", |o| o.try_sqrt_op().unwrap().unwrap(), |x| x.sqrt()),
            ("sin", |o| o.sin_op().unwrap(), |x| x.sin()),
            ("cos", |o| o.cos_op().unwrap(), |x| x.cos()),
        ];
        let round = |v: Vec<f32>| -> Vec<f16> { v.into_iter().map(f16::from_f32).collect() };
        for (i, (name, ours, theirs)) in methods.into_iter().enumerate() {
            let y = ours(&Operands::new(x.leaky_trace(), ()));
            let got_y = y.retaped::<NoneTape>().as_vec();
            let g = (y * w.clone()).sum().backward();
            let x32 = x.clone().to_dtype::<f32>();
            let y32 = theirs(x32.leaky_trace());
            let want_y = round(y32.retaped::<NoneTape>().as_vec());
            let g32 = (y32 * w.clone().to_dtype::<f32>()).sum().backward();
            assert_eq!(got_y, want_y, "{name}: output");
            if i < 3 {
                continue;
            }
            let (got, want) = (g.get(&x).as_vec(), round(g32.get(&x32).as_vec()));
            // the f32 gradient, rounded once (within one f16 step where dfdx's f32 op and the
            // layer's order the same f32 arithmetic differently)
            for (a, b) in got.iter().zip(&want) {
                let tol = b.to_f32().abs() * 2f32.powi(-10);
                assert!(
                    (a.to_f32() - b.to_f32()).abs() <= tol,
                    "{name}: dx {a} against {b}"
                );
            }
        }
        // a number: `None`, for the method as written
        let n = Operands::new(2.0f32, ());
        assert!((&n).sqrt_op::<f32>().is_none());
        assert_eq!(n.into_inner().0.sqrt(), 2.0f32.sqrt());
    }
}
