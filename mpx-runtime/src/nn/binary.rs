//! `a + b`, `a - b`, `a * b` and `a / b` of two f16 tensors of one shape, `a + s`, `a - s`,
//! `a * s`, `a / s` of an f16 tensor and a scalar, and `-a`, as a `#[half_forward]` working copy
//! runs them: in vector passes, with the same bits as dfdx's f16 ops, which convert every
//! element through a function call (a user's RNN step spent most of its time there).
//!
//! dfdx computes each f16 result in f32 and rounds it once (`f16 + f16` is
//! `f16::from_f32(a.to_f32() + b.to_f32())`), and accumulates a gradient the same way:
//! `da += df/da * dy`, the product rounded to f16, then the sum. So does this op: the output
//! `round(wide(a) op wide(b))`, and on a tape `da = round(wide(da) + wide(round(df/da * dy)))`,
//! likewise `db` (a quotient's derivatives rounded at each of dfdx's f16 steps, [`quotient`]).
//! A view operand (a bias broadcast over the batch, a permuted weight) is read where it lies, its
//! gradient summed back per buffer element in f32 ([`operand`]); the scalar ops make theirs
//! contiguous first ([`contiguous`]).

use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, Merge, PutTape, SplitTape, Tape, Tensor, TensorFromVec};
use half::f16;

use super::contiguous::{Operand, add_grad, contiguous, operand, values};
use super::half_ops::{grad_slice, widen_values};
use super::scratch::{self, Buf};
use crate::precision::Precision;
use mpx_kernels::{Arith, add_scaled_f16, apply_scalar_f16, zip_f16};

/// `a op b` on two f16 tensors of one shape (see the [module docs](self)). A view (a bias
/// broadcast over the batch) is read where it lies and its gradient summed back in f32
/// ([`operand`]), with no copy of its own.
pub(crate) fn binary<S: Shape, LT, RT>(
    op: Arith,
    a: Tensor<S, f16, Cpu, LT>,
    b: Tensor<S, f16, Cpu, RT>,
) -> Result<Tensor<S, f16, Cpu, LT>, CpuError>
where
    LT: Tape<f16, Cpu> + Merge<RT>,
    RT: Tape<f16, Cpu>,
{
    let ((a, va), (b, vb), mut tape) = operands(a, b)?;
    let shape = *a.shape();
    let n = shape.num_elements();
    let mut y = vec![f16::ZERO; n];
    zip_f16(
        &values(&a, va.as_ref())?,
        &values(&b, vb.as_ref())?,
        op,
        &mut y,
    );
    let y = a.device().try_tensor_from_vec(y, shape)?;
    if LT::OWNS_TAPE {
        let (a_id, b_id, y_id) = (a.ghost(), b.ghost(), y.ghost());
        // `Mul`'s and `Div`'s derivatives are made of the operands' values: the tensors are
        // kept (their buffers shared, not copied), as dfdx's own op keeps them
        let kept = matches!(op, Arith::Mul | Arith::Div).then(|| (a.clone(), b.clone()));
        drop((a, b));
        tape.add_backward_op(move |grads| {
            // a copy: dfdx lends one gradient at a time
            let dy = scratch::copy_of(grad_slice::<f16>(grads.get_or_alloc_mut(&y_id)?));
            if dy.len() != n {
                return Err(CpuError::WrongNumElements);
            }
            if let Some((a, b)) = &kept {
                // dfdx's f16 `+=`: the sum in f32, rounded once
                let mut add = |id, view, contribution: &[f32]| {
                    add_grad::<f16, S>(grad_slice(grads.get_or_alloc_mut(id)?), view, contribution)
                };
                let (wa, wb) = (
                    widen_values(&values(a, va.as_ref())?),
                    widen_values(&values(b, vb.as_ref())?),
                );
                let dy = widen_values(&dy);
                let (da, db) = if op == Arith::Div {
                    quotient(&wa, wb, &dy)
                } else {
                    (product(wb, &dy), product(wa, &dy))
                };
                add(&a_id, va.as_ref(), &da)?;
                return add(&b_id, vb.as_ref(), &db);
            }
            // `dy` itself for both, negated for `b` of a difference: a contiguous operand's
            // gradient in one pass over the f16 values, a view's summed per buffer element
            let db = if op == Arith::Sub {
                f16::NEG_ONE
            } else {
                f16::ONE
            };
            let mut wide: Option<Buf<f32>> = None;
            for (id, view, d) in [(&a_id, va.as_ref(), f16::ONE), (&b_id, vb.as_ref(), db)] {
                let Some(view) = view else {
                    let g = grad_slice::<f16>(grads.get_or_alloc_mut(id)?);
                    if g.len() != n {
                        return Err(CpuError::WrongNumElements);
                    }
                    add_scaled_f16(&dy, d, g);
                    continue;
                };
                let w = wide.get_or_insert_with(|| widen_values(&dy));
                if d != f16::ONE {
                    w.iter_mut().for_each(|g| *g = -*g);
                }
                add_grad::<f16, S>(grad_slice(grads.get_or_alloc_mut(id)?), Some(view), w)?;
            }
            Ok(())
        });
    }
    Ok(y.put_tape(tape))
}

/// Two f16 operands as [`operands`] gives them, and their merged tape.
pub(crate) type ReadPair<SA, SB, LT> = (Operand<SA, f16>, Operand<SB, f16>, LT);

/// Two f16 operands as their op reads them ([`operand`]: a view where it lies, anything else
/// contiguous), and their tapes merged (with the tape of a copy the second needed).
pub(crate) fn operands<SA: Shape, SB: Shape, LT, RT>(
    a: Tensor<SA, f16, Cpu, LT>,
    b: Tensor<SB, f16, Cpu, RT>,
) -> Result<ReadPair<SA, SB, LT>, CpuError>
where
    LT: Tape<f16, Cpu> + Merge<RT>,
    RT: Tape<f16, Cpu>,
{
    let ((a, a_tape), (b, b_tape)) = (a.split_tape(), b.split_tape());
    let (a, a_copy) = operand::<LT, _, _>(a)?;
    let (b, b_copy) = operand::<LT, _, _>(b)?;
    Ok((a, b, a_tape.merge(b_tape).merge(a_copy).merge(b_copy)))
}

/// `d * dy` per element for the values `d` of a tensor (widened), rounded to f16 and widened
/// again: dfdx's f16 product `df * go`, which it rounds before adding it to the gradient.
fn product(mut p: Buf<f32>, dy: &[f32]) -> Buf<f32> {
    for (p, &g) in p.iter_mut().zip(dy) {
        *p *= g;
    }
    through_f16(&mut p);
    p
}

/// The contributions of `dy` to the gradients of `a / b`, each step rounded to f16 as dfdx's f16
/// derivatives round it: `dA = round(round(1 / b) * dy)` and
/// `dB = round(round(-a / round(b * b)) * dy)`.
fn quotient(wa: &[f32], mut da: Buf<f32>, dy: &[f32]) -> (Buf<f32>, Buf<f32>) {
    let mut db = scratch::take::<f32>(da.len());
    for (d, q) in da.iter_mut().zip(db.iter_mut()) {
        *q = *d * *d;
        *d = 1.0 / *d;
    }
    through_f16(&mut da);
    through_f16(&mut db);
    for (q, x) in db.iter_mut().zip(wa.iter()) {
        *q = -*x / *q;
    }
    through_f16(&mut db);
    for ((d, q), g) in da.iter_mut().zip(db.iter_mut()).zip(dy) {
        *d *= g;
        *q *= g;
    }
    through_f16(&mut da);
    through_f16(&mut db);
    (da, db)
}

/// Values rounded to f16 and widened again, in place: 256 at a time through a buffer on the
/// stack (no allocation, in the backward passes' inner loops too).
fn through_f16(p: &mut [f32]) {
    let mut rounded = [f16::ZERO; 256];
    for chunk in p.chunks_mut(256) {
        let r = &mut rounded[..chunk.len()];
        f16::round(chunk, r);
        f16::widen(r, chunk);
    }
}

/// An op of a tensor and a scalar, or negation (whose scalar is -1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ScalarOp {
    Of(Arith),
    Neg,
}

impl ScalarOp {
    /// The derivative, in f16 as dfdx computes it (`1 / s` rounded for a division).
    fn df(self, s: f16) -> f16 {
        match self {
            ScalarOp::Of(Arith::Add | Arith::Sub) => f16::ONE,
            ScalarOp::Of(Arith::Mul) | ScalarOp::Neg => s,
            ScalarOp::Of(Arith::Div) => f16::ONE / s,
        }
    }
}

/// `a op s` of an f16 tensor and an f16 scalar with dfdx's f16 bits, each way in one pass: the
/// output `round(wide(a) op wide(s))` (`-a` for a negation), and on a tape
/// `da = round(wide(da) + wide(round(df * dy)))` with dfdx's constant derivative `df` (1, `s`,
/// or `1 / s` rounded; -1 for a negation).
pub(crate) fn scalar<S: Shape, T: Tape<f16, Cpu>>(
    op: ScalarOp,
    a: Tensor<S, f16, Cpu, T>,
    s: f16,
) -> Result<Tensor<S, f16, Cpu, T>, CpuError> {
    let (a, mut tape) = contiguous(a)?.split_tape();
    let shape = *a.shape();
    let n = shape.num_elements();
    let mut y = vec![f16::ZERO; n];
    a.copy_into(&mut y);
    match op {
        ScalarOp::Of(op) => apply_scalar_f16(&mut y, op, s.to_f32()),
        // a negation flips the sign bit, as dfdx's does, NaN payloads included
        ScalarOp::Neg => y.iter_mut().for_each(|v| *v = -*v),
    }
    let y = a.device().try_tensor_from_vec(y, shape)?;
    if T::OWNS_TAPE {
        let df = op.df(s);
        let (a_id, y_id) = (a.ghost(), y.ghost());
        drop(a);
        tape.add_backward_op(move |grads| {
            // a copy: dfdx lends one gradient at a time
            let dy = scratch::copy_of(grad_slice::<f16>(grads.get_or_alloc_mut(&y_id)?));
            let ga = grad_slice::<f16>(grads.get_or_alloc_mut(&a_id)?);
            if dy.len() != n || ga.len() != n {
                return Err(CpuError::WrongNumElements);
            }
            add_scaled_f16(&dy, df, ga);
            Ok(())
        });
    }
    Ok(y.put_tape(tape))
}

/// The operands of `a op b` in a `#[half_forward]` working copy's code, for the dispatch of
/// [`HalfOps`] and [`AsWritten`]: two f16 tensors of one shape take mpx's op (`Some`); for any
/// other operands the dispatch gives `None` and the generated code runs the operator or method
/// exactly as the user wrote it, on the same two values ([`Operands::into_inner`]). Generated
/// code only.
#[doc(hidden)]
#[allow(missing_debug_implementations)]
pub struct Operands<A, B>(std::cell::Cell<Option<(A, B)>>);

impl<A, B> Operands<A, B> {
    /// The two operands, in order.
    pub fn new(a: A, b: B) -> Self {
        Self(std::cell::Cell::new(Some((a, b))))
    }

    /// The two operands back, for the op as written (after the dispatch gave `None`).
    ///
    /// # Panics
    /// After an op took them (generated code never asks then).
    pub fn into_inner(self) -> (A, B) {
        self.take()
    }

    pub(crate) fn take(&self) -> (A, B) {
        self.0.take().expect("each operand pair is used once")
    }
}

/// The ops on two f16 tensors of one shape, an f16 tensor and a scalar, or an f16 tensor alone
/// (picked first: `(&operands).add_op()`; each op's `None`, its default, runs it as written).
#[doc(hidden)]
pub trait HalfOps {
    /// The op's output.
    type Output;
    /// `a + b`.
    fn add_op(&self) -> Option<Self::Output> {
        self.try_add_op().map(Result::unwrap)
    }
    /// `a - b`.
    fn sub_op(&self) -> Option<Self::Output> {
        self.try_sub_op().map(Result::unwrap)
    }
    /// `a * b`.
    fn mul_op(&self) -> Option<Self::Output> {
        self.try_mul_op().map(Result::unwrap)
    }
    /// `a / b`.
    fn div_op(&self) -> Option<Self::Output> {
        self.try_div_op().map(Result::unwrap)
    }
    /// `a.try_add(b)`.
    fn try_add_op(&self) -> Option<Result<Self::Output, CpuError>> {
        None
    }
    /// `a.try_sub(b)`.
    fn try_sub_op(&self) -> Option<Result<Self::Output, CpuError>> {
        None
    }
    /// `a.try_mul(b)`.
    fn try_mul_op(&self) -> Option<Result<Self::Output, CpuError>> {
        None
    }
    /// `a.try_div(b)`.
    fn try_div_op(&self) -> Option<Result<Self::Output, CpuError>> {
        None
    }
    /// `-a` (the operands `(a, ())`).
    fn neg_op(&self) -> Option<Self::Output> {
        None
    }
}

impl<S: Shape, LT, RT> HalfOps for Operands<Tensor<S, f16, Cpu, LT>, Tensor<S, f16, Cpu, RT>>
where
    LT: Tape<f16, Cpu> + Merge<RT>,
    RT: Tape<f16, Cpu>,
{
    type Output = Tensor<S, f16, Cpu, LT>;
    fn try_add_op(&self) -> Option<Result<Self::Output, CpuError>> {
        let (a, b) = self.take();
        Some(binary(Arith::Add, a, b))
    }
    fn try_sub_op(&self) -> Option<Result<Self::Output, CpuError>> {
        let (a, b) = self.take();
        Some(binary(Arith::Sub, a, b))
    }
    fn try_mul_op(&self) -> Option<Result<Self::Output, CpuError>> {
        let (a, b) = self.take();
        Some(binary(Arith::Mul, a, b))
    }
    fn try_div_op(&self) -> Option<Result<Self::Output, CpuError>> {
        let (a, b) = self.take();
        Some(binary(Arith::Div, a, b))
    }
}

/// An f16 tensor and a scalar: an f16 one, or an f32 one, which dfdx rounds to f16 first.
macro_rules! scalar_ops {
    ($($scalar:ty => $to_f16:expr),*) => {$(
        impl<S: Shape, T: Tape<f16, Cpu>> HalfOps for Operands<Tensor<S, f16, Cpu, T>, $scalar> {
            type Output = Tensor<S, f16, Cpu, T>;
            fn try_add_op(&self) -> Option<Result<Self::Output, CpuError>> {
                let (a, s) = self.take();
                Some(scalar(ScalarOp::Of(Arith::Add), a, $to_f16(s)))
            }
            fn try_sub_op(&self) -> Option<Result<Self::Output, CpuError>> {
                let (a, s) = self.take();
                Some(scalar(ScalarOp::Of(Arith::Sub), a, $to_f16(s)))
            }
            fn try_mul_op(&self) -> Option<Result<Self::Output, CpuError>> {
                let (a, s) = self.take();
                Some(scalar(ScalarOp::Of(Arith::Mul), a, $to_f16(s)))
            }
            fn try_div_op(&self) -> Option<Result<Self::Output, CpuError>> {
                let (a, s) = self.take();
                Some(scalar(ScalarOp::Of(Arith::Div), a, $to_f16(s)))
            }
        }
    )*};
}
scalar_ops!(f16 => std::convert::identity, f32 => f16::from_f32);

/// An f16 tensor alone: its negation.
impl<S: Shape, T: Tape<f16, Cpu>> HalfOps for Operands<Tensor<S, f16, Cpu, T>, ()> {
    type Output = Tensor<S, f16, Cpu, T>;
    fn neg_op(&self) -> Option<Self::Output> {
        let (a, ()) = self.take();
        Some(scalar(ScalarOp::Neg, a, f16::NEG_ONE).unwrap())
    }
}

/// [`AsWritten`] with a `None` method per op.
macro_rules! as_written {
    ($($method:ident),*) => {
        /// Every other pair of operands (picked when [`HalfOps`] or
        /// [`HalfMatMul`](super::matmul::HalfMatMul) does not apply: `(&operands)` autorefs to
        /// `&&Operands`): `None`, of whatever type the op as written has, which the generated
        /// code then runs.
        #[doc(hidden)]
        pub trait AsWritten {
            $(
                /// `None`: the op as written runs.
                fn $method<T>(&self) -> Option<T> {
                    None
                }
            )*
        }
    };
}
as_written!(
    add_op,
    sub_op,
    mul_op,
    try_add_op,
    try_sub_op,
    try_mul_op,
    div_op,
    try_div_op,
    neg_op,
    matmul_op,
    try_matmul_op,
    relu_op,
    try_relu_op,
    tanh_op,
    try_tanh_op,
    sigmoid_op,
    try_sigmoid_op,
    fast_gelu_op,
    try_fast_gelu_op,
    accurate_gelu_op,
    try_accurate_gelu_op,
    abs_op,
    try_abs_op,
    square_op,
    try_square_op,
    sqrt_op,
    try_sqrt_op,
    sin_op,
    try_sin_op,
    cos_op,
    try_cos_op
);

impl<A, B> AsWritten for &Operands<A, B> {}

#[cfg(test)]
#[allow(
    clippy::needless_borrow,
    reason = "the dispatch is by autoref: `(&operands)`, as the generated code writes it"
)]
mod tests {
    use dfdx::prelude::*;
    use half::f16;

    use super::{AsWritten as _, HalfOps as _, Operands};

    /// f16 values over the whole range: zeros of both signs, subnormals, values whose sums and
    /// products overflow, and ordinary ones.
    fn values(n: usize, seed: u32) -> Vec<f16> {
        let special = [0.0, -0.0, 6e-8, -3e-5, 65504.0, -60000.0, 1.0, -2.5];
        (0..n)
            .map(|i| {
                let k = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                if i % 5 == 0 {
                    f16::from_f32(special[(k as usize / 7) % special.len()])
                } else {
                    f16::from_f32(((k % 20_001) as f32 - 10_000.0) / 997.0)
                }
            })
            .collect()
    }

    fn bits(v: &[f16]) -> Vec<u16> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// mpx's op and dfdx's on the same operands (both taped): the output and both gradients
    /// bit for bit, with a gradient `w` flowing into the output (`sum(y * w)`).
    #[test]
    fn the_ops_give_dfdxs_f16_bits_forward_and_backward() {
        let dev = Cpu::default();
        let n = 4 * 33;
        for op in [
            super::Arith::Add,
            super::Arith::Sub,
            super::Arith::Mul,
            super::Arith::Div,
        ] {
            for seed in [1, 7, 99] {
                let t = |s: u32| -> Tensor<Rank2<4, 33>, f16, Cpu> {
                    dev.tensor_from_vec(values(n, s), (Const, Const))
                };
                let (a, b, w) = (t(seed), t(seed + 1), t(seed + 2));
                let run = |ours: bool| {
                    let (ta, tb) = (a.leaky_trace(), b.leaky_trace());
                    let y = if ours {
                        super::binary(op, ta, tb).unwrap()
                    } else {
                        match op {
                            super::Arith::Add => ta.try_add(tb).unwrap(),
                            super::Arith::Sub => ta.try_sub(tb).unwrap(),
                            super::Arith::Mul => ta.try_mul(tb).unwrap(),
                            super::Arith::Div => ta.try_div(tb).unwrap(),
                        }
                    };
                    let out = y.retaped::<NoneTape>().as_vec();
                    let g = (y * w.clone()).sum().backward();
                    (out, g.get(&a).as_vec(), g.get(&b).as_vec())
                };
                let (ours, theirs) = (run(true), run(false));
                assert_eq!(bits(&ours.0), bits(&theirs.0), "{op:?} output, seed {seed}");
                assert_eq!(bits(&ours.1), bits(&theirs.1), "{op:?} da, seed {seed}");
                assert_eq!(bits(&ours.2), bits(&theirs.2), "{op:?} db, seed {seed}");
            }
        }
    }

    /// A view operand read where it lies (a broadcast bias on either side, traced or not; a
    /// permuted tensor) gives the bits of its contiguous copy made by `nn::contiguous` (whose
    /// gradient is the f32 sum of the view's, rounded once): the output and every gradient, for
    /// each op.
    #[test]
    fn a_view_operand_gives_the_bits_of_its_contiguous_copy() {
        use super::super::contiguous::contiguous;
        type Taped<S> = Tensor<S, f16, Cpu, OwnedTape<f16, Cpu>>;
        type X = Rank2<300, 33>;
        let dev = Cpu::default();
        let bias: Tensor<Rank1<33>, f16, Cpu> = dev.tensor_from_vec(values(33, 11), (Const,));
        let m: Tensor<Rank2<33, 300>, f16, Cpu> =
            dev.tensor_from_vec(values(33 * 300, 12), (Const, Const));
        let x: Tensor<X, f16, Cpu> = dev.tensor_from_vec(values(300 * 33, 13), (Const, Const));
        let w: Tensor<X, f16, Cpu> = dev.tensor_from_vec(values(300 * 33, 14), (Const, Const));
        let broadcast = |t: Taped<Rank1<33>>| t.broadcast::<X, Axis<0>>();
        let permute = |t: Taped<Rank2<33, 300>>| t.permute::<X, Axes2<1, 0>>();
        for op in [
            super::Arith::Add,
            super::Arith::Sub,
            super::Arith::Mul,
            super::Arith::Div,
        ] {
            // the output, then the gradients of x, the bias and m (zeros where unused)
            let grads = |y: Taped<X>| {
                let out = bits(&y.retaped::<NoneTape>().as_vec());
                let mut g = (y * w.clone()).sum().backward();
                let dx = bits(g.get_or_alloc_mut(&x).unwrap());
                let db = bits(g.get_or_alloc_mut(&bias).unwrap());
                (out, dx, db, bits(g.get_or_alloc_mut(&m).unwrap()))
            };
            // the traced batch and an untraced broadcast bias (a dense layer written by hand)
            let read_in_place = {
                let b = bias.clone().broadcast::<X, Axis<0>>();
                grads(super::binary(op, x.leaky_trace(), b).unwrap())
            };
            let copied = {
                let b = bias.clone().broadcast::<X, Axis<0>>();
                let b = contiguous(b.put_tape(OwnedTape::<f16, Cpu>::default())).unwrap();
                grads(super::binary(op, x.leaky_trace(), b).unwrap())
            };
            assert_eq!(read_in_place.0, copied.0, "{op:?}: x op bias, output");
            assert_eq!(read_in_place.1, copied.1, "{op:?}: x op bias, dx");
            assert_eq!(read_in_place.2, copied.2, "{op:?}: x op bias, dbias");
            // a traced broadcast, then a traced permuted view, on the left of an untraced x
            let views: [(&str, &dyn Fn() -> Taped<X>); 2] = [
                ("bias op x", &|| broadcast(bias.leaky_trace())),
                ("m^T op x", &|| permute(m.leaky_trace())),
            ];
            for (what, view) in views {
                let read_in_place = grads(super::binary(op, view(), x.clone()).unwrap());
                let copied =
                    grads(super::binary(op, contiguous(view()).unwrap(), x.clone()).unwrap());
                assert_eq!(read_in_place, copied, "{op:?}: {what}");
            }
        }
    }

    /// A tensor and a scalar: mpx's op and dfdx's (`try_add(s)`, .., and `-a`) on the same
    /// operands, the output and the gradient bit for bit, scalars of every kind (a division by
    /// zero included).
    #[test]
    fn the_scalar_ops_give_dfdxs_f16_bits_forward_and_backward() {
        use super::{Arith, ScalarOp};
        let dev = Cpu::default();
        let n = 4 * 33;
        let t = |s: u32| -> Tensor<Rank2<4, 33>, f16, Cpu> {
            dev.tensor_from_vec(values(n, s), (Const, Const))
        };
        let (a, w) = (t(5), t(6));
        let ops = [
            ScalarOp::Of(Arith::Add),
            ScalarOp::Of(Arith::Sub),
            ScalarOp::Of(Arith::Mul),
            ScalarOp::Of(Arith::Div),
            ScalarOp::Neg,
        ];
        for op in ops {
            let scalars: &[f32] = if op == ScalarOp::Neg {
                &[-1.0]
            } else {
                &[2.5, -0.3, 0.0, 65504.0, 6e-8, -1.0]
            };
            for &s in scalars {
                let s = f16::from_f32(s);
                let run = |ours: bool| {
                    let ta = a.leaky_trace();
                    let y = if ours {
                        super::scalar(op, ta, s).unwrap()
                    } else {
                        match op {
                            ScalarOp::Of(Arith::Add) => ta.try_add(s).unwrap(),
                            ScalarOp::Of(Arith::Sub) => ta.try_sub(s).unwrap(),
                            ScalarOp::Of(Arith::Mul) => ta.try_mul(s).unwrap(),
                            ScalarOp::Of(Arith::Div) => ta.try_div(s).unwrap(),
                            ScalarOp::Neg => -ta,
                        }
                    };
                    let out = y.retaped::<NoneTape>().as_vec();
                    let g = (y * w.clone()).sum().backward();
                    (out, g.get(&a).as_vec())
                };
                let (ours, theirs) = (run(true), run(false));
                assert_eq!(bits(&ours.0), bits(&theirs.0), "{op:?} {s} output");
                assert_eq!(bits(&ours.1), bits(&theirs.1), "{op:?} {s} da");
            }
        }
    }

    /// Through the dispatch: two f16 tensors (one taped, one not, as in a residual) take mpx's
    /// op and match dfdx's; anything else gives `None`, for the op as written.
    #[test]
    fn the_dispatch_takes_mpxs_op_for_half_tensors_and_leaves_the_rest_as_written() {
        let dev = Cpu::default();
        let a: Tensor<Rank1<6>, f16, Cpu> = dev.tensor_from_vec(values(6, 3), (Const,));
        let b: Tensor<Rank1<6>, f16, Cpu> = dev.tensor_from_vec(values(6, 4), (Const,));
        let ours = (&Operands::new(a.leaky_trace(), b.clone()))
            .try_mul_op()
            .expect("two f16 tensors take mpx's op")
            .unwrap();
        let theirs = a.leaky_trace().try_mul(b.clone()).unwrap();
        assert_eq!(bits(&ours.as_vec()), bits(&theirs.as_vec()));
        let (g_ours, g_theirs) = (ours.sum().backward(), theirs.sum().backward());
        assert_eq!(
            bits(&g_ours.get(&a).as_vec()),
            bits(&g_theirs.get(&a).as_vec())
        );
        // numbers, f32 tensors, a tensor and a scalar: `None`, and the values come back intact
        let n = Operands::new(2usize, 3usize);
        assert!((&n).add_op::<usize>().is_none());
        assert_eq!(n.into_inner(), (2, 3));
        let x: Tensor<Rank1<2>, f32, Cpu> = dev.tensor([1.0, 2.0]);
        let ops = Operands::new(x.clone(), x.clone());
        assert!((&ops).add_op::<Tensor<Rank1<2>, f32, Cpu>>().is_none());
        let (l, r) = ops.into_inner();
        assert_eq!((l + r).array(), [2.0, 4.0]);
        let ops = Operands::new(x, 3.0f32);
        assert!((&ops).try_mul_op::<()>().is_none());
        // an f16 tensor and a scalar, f16 or f32 (rounded to f16 as dfdx does), and two tensors
        // divided: mpx's op
        let ours = (&Operands::new(a.clone(), 0.1f32)).div_op().unwrap();
        let theirs = a.clone().try_div(0.1f32).unwrap();
        assert_eq!(bits(&ours.as_vec()), bits(&theirs.as_vec()));
        let ours = (&Operands::new(a.clone(), f16::from_f32(3.0)))
            .mul_op()
            .unwrap();
        assert_eq!(
            bits(&ours.as_vec()),
            bits(&(a.clone() * f16::from_f32(3.0)).as_vec())
        );
        let ours = (&Operands::new(a.clone(), b.clone())).div_op().unwrap();
        assert_eq!(
            bits(&ours.as_vec()),
            bits(&(a.clone() / b.clone()).as_vec())
        );
        // a tensor alone: its negation; a number alone: as written
        let ours = (&Operands::new(a.clone(), ())).neg_op().unwrap();
        assert_eq!(bits(&ours.as_vec()), bits(&(-a.clone()).as_vec()));
        assert!((&Operands::new(2.0f32, ())).neg_op::<f32>().is_none());
    }
}
