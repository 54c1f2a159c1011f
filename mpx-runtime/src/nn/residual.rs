//! [`Residual`], [`GeneralizedResidual`] and [`AddInto`]: dfdx's containers that add their
//! branches, as a mixed step's working copy runs them. Their modules run as they are; the add of
//! two f16 tensors runs in mpx's vector passes ([`binary`](super::binary): dfdx's bits, forward
//! and backward), where dfdx's own f16 add converts every element through a function call.

use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection};
use dfdx::nn::{Module, ModuleMut};
use dfdx::shapes::{Dtype, Shape};
use dfdx::tensor::{Cpu, CpuError, Merge, Tape, Tensor, WithEmptyTape};
use dfdx::tensor_ops::{Device, TryAdd};
use half::f16;

use crate::precision::AMP;

/// dfdx's `Residual`: `f(x) + x`, the add in mpx's vector passes on f16 tensors (the same bits
/// as dfdx's f16 add, forward and backward) and dfdx's own add on any other. A mixed step's
/// working copy runs dfdx's `Residual` as this.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::{nn, precision::f16};
/// let dev = Cpu::default();
/// let x = dev.tensor([-1.0f32, 0.5, 2.0]).to_dtype::<f16>();
/// let y = nn::Residual(ReLU).forward(x.leaky_trace());
/// assert_eq!(y.as_vec(), [-1.0f32, 1.0, 4.0].map(f16::from_f32));
/// // the same bits as dfdx's own `Residual`, forward and backward
/// let want = Residual(ReLU).forward(x.leaky_trace());
/// assert_eq!(y.as_vec(), want.as_vec());
/// let (g, gw) = (y.sum().backward(), want.sum().backward());
/// assert_eq!(g.get(&x).as_vec(), gw.get(&x).as_vec());
/// ```
#[derive(Debug, Clone, Default)]
pub struct Residual<F>(pub F);

/// dfdx's `GeneralizedResidual`: `f(x) + r(x)`, the add as [`Residual`]'s. A mixed step's
/// working copy runs dfdx's `GeneralizedResidual` as this.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::{nn, precision::f16};
/// let dev = Cpu::default();
/// let x = dev.tensor([-1.0f32, 0.5, 2.0]).to_dtype::<f16>();
/// let y = nn::GeneralizedResidual { f: ReLU, r: Square }.forward(x.clone());
/// assert_eq!(y.as_vec(), [1.0f32, 0.75, 6.0].map(f16::from_f32));
/// ```
#[derive(Debug, Clone, Default)]
pub struct GeneralizedResidual<F, R> {
    /// The first branch.
    pub f: F,
    /// The second branch.
    pub r: R,
}

/// dfdx's `AddInto`: one module per input of a tuple, their outputs summed (`a + (b + ..)`, as
/// dfdx sums them), each add as [`Residual`]'s. A mixed step's working copy runs dfdx's
/// `AddInto` as this.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::{nn, precision::f16};
/// let dev = Cpu::default();
/// let a = dev.tensor([-1.0f32, 0.5]).to_dtype::<f16>();
/// let b = dev.tensor([3.0f32, -2.0]).to_dtype::<f16>();
/// let y = nn::AddInto((ReLU, Square)).forward((a.clone(), b.clone()));
/// assert_eq!(y.as_vec(), [9.0f32, 4.5].map(f16::from_f32));
/// assert_eq!(y.as_vec(), AddInto((ReLU, Square)).forward((a, b)).as_vec());
/// ```
#[derive(Debug, Clone, Default)]
pub struct AddInto<T>(pub T);

impl<E: Dtype, D: Device<E>, F: TensorCollection<E, D>> TensorCollection<E, D> for Residual<F> {
    type To<E2: Dtype, D2: Device<E2>> = Residual<F::To<E2, D2>>;

    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        // dfdx's field name and order
        visitor.visit_fields(Self::module("0", |s| &s.0, |s| &mut s.0), Residual)
    }
}

impl<E: Dtype, D: Device<E>, T: TensorCollection<E, D>> TensorCollection<E, D> for AddInto<T> {
    type To<E2: Dtype, D2: Device<E2>> = AddInto<T::To<E2, D2>>;

    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        // dfdx's field name and order
        visitor.visit_fields(Self::module("0", |s| &s.0, |s| &mut s.0), AddInto)
    }
}

impl<E: Dtype, D: Device<E>, F: TensorCollection<E, D>, R: TensorCollection<E, D>>
    TensorCollection<E, D> for GeneralizedResidual<F, R>
{
    type To<E2: Dtype, D2: Device<E2>> = GeneralizedResidual<F::To<E2, D2>, R::To<E2, D2>>;

    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        // dfdx's field names and order
        visitor.visit_fields(
            (
                Self::module("f", |s| &s.f, |s| &mut s.f),
                Self::module("r", |s| &s.r, |s| &mut s.r),
            ),
            |(f, r)| GeneralizedResidual { f, r },
        )
    }
}

/// `a + b` as the residual containers add: mpx's vector passes on two f16 tensors, dfdx's own
/// add on tensors of the other element types.
#[doc(hidden)]
pub trait ResidualAdd: Sized {
    /// `a + b`.
    ///
    /// # Errors
    /// A device error (allocation).
    fn residual_add(self, b: Self) -> Result<Self, CpuError>;
}

impl<S: Shape, T: Tape<f16, Cpu> + Merge<T>> ResidualAdd for Tensor<S, f16, Cpu, T> {
    fn residual_add(self, b: Self) -> Result<Self, CpuError> {
        super::binary::binary(mpx_kernels::Arith::Add, self, b)
    }
}

/// dfdx's own add (its f32 kernels are vector loops; `AMP<f16>` keeps dfdx's op).
macro_rules! dfdx_add {
    ($($e:ty),*) => {$(
        impl<S: Shape, T: Tape<$e, Cpu> + Merge<T>> ResidualAdd for Tensor<S, $e, Cpu, T> {
            fn residual_add(self, b: Self) -> Result<Self, CpuError> {
                self.try_add(b)
            }
        }
    )*};
}
dfdx_add!(f32, AMP<f16>);

/// `Module` and `ModuleMut` of both containers: the same passes through `&self` or `&mut self`,
/// in dfdx's order (`f` on the input without its tape, then the add with the input, or with `r`
/// of it).
macro_rules! passes {
    ($pass:ident, $method:ident $(, $mut:tt)?) => {
        impl<X, F> $pass<X> for Residual<F>
        where
            X: WithEmptyTape + ResidualAdd,
            F: $pass<X, Output = X, Error = CpuError>,
        {
            type Output = X;
            type Error = CpuError;
            fn $method(&$($mut)? self, x: X) -> Result<X, CpuError> {
                self.0.$method(x.with_empty_tape())?.residual_add(x)
            }
        }

        impl<X, Y, F, R> $pass<X> for GeneralizedResidual<F, R>
        where
            X: WithEmptyTape,
            Y: ResidualAdd,
            F: $pass<X, Output = Y, Error = CpuError>,
            R: $pass<X, Output = Y, Error = CpuError>,
        {
            type Output = Y;
            type Error = CpuError;
            fn $method(&$($mut)? self, x: X) -> Result<Y, CpuError> {
                let f = self.f.$method(x.with_empty_tape())?;
                f.residual_add(self.r.$method(x)?)
            }
        }
    };
}
passes!(Module, try_forward);
passes!(ModuleMut, try_forward_mut, mut);

/// `a + (b + (c + ..))`, dfdx's `AddInto` order.
macro_rules! sum {
    ($a:expr) => { $a };
    ($a:expr, $($rest:expr),+) => { $a.residual_add(sum!($($rest),+))? };
}

/// `AddInto`'s `Module` and `ModuleMut` for a tuple of branches (`$m`, their inputs `$x`).
macro_rules! add_into {
    ($pass:ident, $method:ident, ($($m:ident $x:ident),+) $(, $mut:tt)?) => {
        impl<Y: ResidualAdd, $($x,)+ $($m: $pass<$x, Output = Y, Error = CpuError>,)+>
            $pass<($($x,)+)> for AddInto<($($m,)+)>
        {
            type Output = Y;
            type Error = CpuError;
            #[allow(non_snake_case)]
            fn $method(&$($mut)? self, ($($x,)+): ($($x,)+)) -> Result<Y, CpuError> {
                let ($($m,)+) = &$($mut)? self.0;
                // each branch in order, then the sum
                $(let $x = $m.$method($x)?;)+
                Ok(sum!($($x),+))
            }
        }
    };
}

/// Both passes for tuples of 2 to 6 branches, as dfdx has them.
macro_rules! add_into_tuples {
    ($(($($m:ident $x:ident),+);)+) => {$(
        add_into!(Module, try_forward, ($($m $x),+));
        add_into!(ModuleMut, try_forward_mut, ($($m $x),+), mut);
    )+};
}
add_into_tuples! {
    (A Ai, B Bi);
    (A Ai, B Bi, C Ci);
    (A Ai, B Bi, C Ci, D Di);
    (A Ai, B Bi, C Ci, D Di, E Ei);
    (A Ai, B Bi, C Ci, D Di, E Ei, F Fi);
}

#[cfg(test)]
mod tests {
    use dfdx::prelude::*;
    use half::f16;

    /// mpx's containers against dfdx's on the same f16 values (sums that round, over three
    /// branches): the outputs and the input gradients bit for bit.
    #[test]
    fn the_containers_give_dfdxs_f16_bits() {
        let dev = Cpu::default();
        let vals = |k: f32| -> Tensor<Rank1<64>, f16, Cpu> {
            dev.tensor(std::array::from_fn(|i| {
                f16::from_f32(((i as f32 + k) * 0.731).sin() * 300.0)
            }))
        };
        let bits = |v: Vec<f16>| v.into_iter().map(f16::to_bits).collect::<Vec<_>>();
        let (a, b, c) = (vals(0.0), vals(1.0), vals(2.0));
        let w = vals(3.0);
        macro_rules! both {
            ($ours:expr, $dfdx:expr, $x:expr, $grad_of:expr) => {{
                let (y, z) = ($ours.forward($x), $dfdx.forward($x));
                assert_eq!(
                    bits(y.with_empty_tape().as_vec()),
                    bits(z.with_empty_tape().as_vec())
                );
                let (gy, gz) = (
                    (y * w.clone()).sum().backward(),
                    (z * w.clone()).sum().backward(),
                );
                assert_eq!(
                    bits(gy.get($grad_of).as_vec()),
                    bits(gz.get($grad_of).as_vec())
                );
            }};
        }
        both!(
            super::AddInto((Square, Tanh, Sin)),
            AddInto((Square, Tanh, Sin)),
            (a.leaky_trace(), b.leaky_trace(), c.leaky_trace()),
            &a
        );
        both!(
            super::Residual(Square),
            Residual(Square),
            a.leaky_trace(),
            &a
        );
        both!(
            super::GeneralizedResidual { f: Square, r: Cos },
            GeneralizedResidual { f: Square, r: Cos },
            a.leaky_trace(),
            &a
        );
    }
}
