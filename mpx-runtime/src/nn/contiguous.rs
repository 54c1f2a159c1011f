//! A tensor made contiguous, as mpx's half ops need their operands, with a backward pass that
//! sums in f32.
//!
//! A `#[half_forward]` working copy's code reads its weights through views: a bias broadcast
//! over the batch (`self.b.clone().broadcast()`), a weight permuted (`self.w.clone().permute()`).
//! dfdx's own `contiguous` copies such a view and, on the way back, adds each output gradient
//! into the view's buffer one element at a time, `grad[i] += dy[o]`: on f16 every one of those
//! adds converts both sides in software and rounds, and a broadcast bias's gradient is a sum of
//! a whole batch of them, rounded at every step.
//!
//! [`contiguous`] copies the view (a row at a time where its last axis is contiguous) and sums
//! each buffer element's gradient in f32, rounded once when it is added to the gradient already
//! there: a permuted view's gradient has dfdx's f16 bits (one add per element), a broadcast's is
//! its f32 sum rounded once (as mpx's fused `Linear` sums its bias gradient). Tensors of other
//! element types keep dfdx's op.

use dfdx::shapes::{Dtype, HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, Gradients, PutTape, SplitTape, Tape, Tensor, TensorFromVec};
use dfdx::tensor_ops::ReshapeTo;

use super::half_ops::{accumulate, grad_slice, read};
use super::scratch::{self, Buf};
use crate::precision::{FloatSlice, Precision};

/// `t` made contiguous on its own tape (see the [module docs](self)): `t` itself when it already
/// is, else a copy whose gradient is summed back into `t`'s in f32.
///
/// # Errors
/// A device (allocation) error; in the backward pass, a shape error should a gradient buffer not
/// match the view (dfdx's tensors cannot make one).
pub(crate) fn contiguous<S, E, T>(t: Tensor<S, E, Cpu, T>) -> Result<Tensor<S, E, Cpu, T>, CpuError>
where
    S: Shape,
    E: Precision<Elem = E> + Dtype,
    T: Tape<E, Cpu>,
{
    let half = matches!(E::floats(&[]), FloatSlice::F16(_));
    if !half || t.shape().num_elements() == 0 {
        return t.try_contiguous();
    }
    let view = View::of(&t);
    if view.is_contiguous() {
        // itself (or, for an axis of one element with an odd stride, dfdx's copy: one add per
        // element on the way back, dfdx's bits)
        return t.try_contiguous();
    }
    let (t, mut tape) = t.split_tape();
    let mut values = vec![E::default(); view.elements()];
    gather(&t, &view, &mut values)?;
    let y = t.device().try_tensor_from_vec(values, *t.shape())?;
    if T::OWNS_TAPE {
        let (t_id, y_id) = (t.ghost(), y.ghost());
        tape.add_backward_op(move |grads| {
            let g = grad_slice::<E>(grads.get_or_alloc_mut(&y_id)?);
            if g.len() != view.elements() {
                return Err(CpuError::WrongNumElements);
            }
            let mut dy = scratch::take::<f32>(g.len());
            E::widen(g, &mut dy);
            add_grad::<E, S>(
                grad_slice::<E>(grads.get_or_alloc_mut(&t_id)?),
                Some(&view),
                &dy,
            )
        });
    }
    Ok(y.put_tape(tape))
}

/// An untraced operand (a bias, a residual) made contiguous on a fresh tape of kind `T`, the
/// tape returned for the caller to merge into its own: a view becomes a copy under a new id whose
/// gradient still goes back to the view's tensor.
///
/// # Errors
/// As [`contiguous`].
fn contiguous_onto<T, S, E>(t: Tensor<S, E, Cpu>) -> Result<(Tensor<S, E, Cpu>, T), CpuError>
where
    S: Shape,
    E: Precision<Elem = E> + Dtype,
    T: Tape<E, Cpu>,
{
    Ok(contiguous(t.put_tape(T::default()))?.split_tape())
}

/// An untraced operand of an element-wise op as the op reads it: a view of f16 values (a
/// broadcast bias, a permuted weight) as it is, with its [`View`], for the op to gather its
/// values ([`values`]) and sum its gradient back per buffer element ([`add_grad`]) with no copy
/// of its own; any other operand made contiguous first ([`contiguous_onto`], on a fresh tape of
/// kind `T`, returned for the caller to merge).
///
/// # Errors
/// As [`contiguous`].
pub(crate) fn operand<T, S, E>(t: Tensor<S, E, Cpu>) -> Result<(Operand<S, E>, T), CpuError>
where
    S: Shape,
    E: Precision<Elem = E> + Dtype,
    T: Tape<E, Cpu>,
{
    let half = matches!(E::floats(&[]), FloatSlice::F16(_));
    if half && t.shape().num_elements() > 0 {
        let view = View::of(&t);
        if !view.is_contiguous() {
            return Ok(((t, Some(view)), T::default()));
        }
    }
    let (t, tape) = contiguous_onto::<T, _, _>(t)?;
    Ok(((t, None), tape))
}

/// An [`operand`] without its tape, with its [`View`] where it is read in place.
pub(crate) type Operand<S, E> = (Tensor<S, E, Cpu>, Option<View<S>>);

/// `t`'s values in logical order into `out` (`t`'s element count): one copy of its buffer when it
/// is contiguous, else gathered through it. No tensor is made.
///
/// # Errors
/// A shape error if `out` does not hold `t`'s elements; a device (allocation) error.
pub(crate) fn read_into<S: Shape, E: Precision<Elem = E> + Dtype, T>(
    t: &Tensor<S, E, Cpu, T>,
    out: &mut [E],
) -> Result<(), CpuError> {
    if out.len() != t.shape().num_elements() {
        return Err(CpuError::WrongNumElements);
    }
    if out.is_empty() {
        return Ok(());
    }
    let view = View::of(t);
    if view.is_contiguous() {
        t.copy_into(out);
        Ok(())
    } else {
        gather(t, &view, out)
    }
}

/// An [`operand`]'s values in logical order.
///
/// # Errors
/// A device (allocation) error.
pub(crate) fn values<S, E>(
    t: &Tensor<S, E, Cpu>,
    view: Option<&View<S>>,
) -> Result<Buf<E>, CpuError>
where
    S: Shape,
    E: Precision<Elem = E> + Dtype,
{
    let Some(view) = view else {
        return Ok(read(t));
    };
    let mut v = scratch::take::<E>(view.elements());
    gather(t, view, &mut v)?;
    Ok(v)
}

/// Adds an [`operand`]'s gradient, `add` (in logical order), to its gradient buffer `g`,
/// rounded once to `P`: element by element for a contiguous operand; for a view, each buffer
/// element's share summed in f32 first.
///
/// # Errors
/// A shape error should `g` or `add` not match the operand.
pub(crate) fn add_grad<P: Precision, S: Shape>(
    g: &mut [P::Elem],
    view: Option<&View<S>>,
    add: &[f32],
) -> Result<(), CpuError> {
    let Some(view) = view else {
        if g.len() != add.len() {
            return Err(CpuError::WrongNumElements);
        }
        return accumulate::<P>(g, add);
    };
    let mut sums = scratch::take_zeroed::<f32>(g.len());
    view.scatter_sum(add, &mut sums)?;
    accumulate::<P>(g, &sums)
}

/// `t`'s values in logical order into `out`, read through its whole buffer (whose length only a
/// gradient buffer for it tells).
fn gather<S: Shape, E: Precision<Elem = E> + Dtype, T>(
    t: &Tensor<S, E, Cpu, T>,
    view: &View<S>,
    out: &mut [E],
) -> Result<(), CpuError> {
    let len = grad_slice::<E>(Gradients::<E, Cpu>::leaky().get_or_alloc_mut(t)?).len();
    let mut raw = scratch::take::<E>(len);
    t.copy_into(&mut raw);
    view.gather(&raw, out)
}

/// How a (non-empty) tensor's elements, in logical order, lie in its buffer: its dims and, per
/// axis, how far apart in the buffer two neighbours along it lie.
#[derive(Clone, Copy, Debug)]
pub(crate) struct View<S: Shape> {
    dims: S::Concrete,
    strides: S::Concrete,
}

impl<S: Shape> View<S> {
    /// `t`'s view, its strides read from where dfdx's indexing finds the neighbours of the first
    /// element. An axis of one element gets stride 0 (it is never stepped along).
    fn of<E: Dtype, T>(t: &Tensor<S, E, Cpu, T>) -> Self {
        let dims = t.shape().concrete();
        let origin = S::Concrete::default();
        let base = std::ptr::from_ref(&t[origin]).addr();
        let mut strides = S::Concrete::default();
        for k in 0..S::NUM_DIMS {
            if dims[k] > 1 {
                let mut next = origin;
                next[k] = 1;
                let at = std::ptr::from_ref(&t[next]).addr();
                strides[k] = at.wrapping_sub(base) / std::mem::size_of::<E>();
            }
        }
        Self { dims, strides }
    }

    fn elements(&self) -> usize {
        self.dims.into_iter().product()
    }

    /// Whether every axis longer than one has the stride of a contiguous tensor of these dims.
    fn is_contiguous(&self) -> bool {
        let mut step = 1;
        for k in (0..S::NUM_DIMS).rev() {
            if self.dims[k] > 1 && self.strides[k] != step {
                return false;
            }
            step *= self.dims[k];
        }
        true
    }

    /// Each row of the view (its elements along the last axis) as its first element's offset in
    /// the buffer, in logical order, with the last axis's length and stride.
    fn rows(&self) -> (impl Iterator<Item = usize> + '_, usize, usize) {
        let dims = self.dims.as_ref();
        let strides = self.strides.as_ref();
        let (inner, outer) = dims.split_last().map_or((1, &[][..]), |(i, o)| (*i, o));
        let inner_stride = strides.last().copied().unwrap_or(0);
        let rows = outer.iter().product::<usize>();
        // an odometer over the outer axes, and the offset it stands for
        let mut at = vec![0usize; outer.len()];
        let mut base = 0usize;
        let offsets = (0..rows).map(move |_| {
            let here = base;
            for k in (0..outer.len()).rev() {
                at[k] += 1;
                base += strides[k];
                if at[k] < outer[k] {
                    break;
                }
                base -= strides[k] * at[k];
                at[k] = 0;
            }
            here
        });
        (offsets, inner, inner_stride)
    }

    /// `out[o] = raw[buffer index of o]`: the view's values in logical order.
    ///
    /// # Errors
    /// A shape error if `out` does not hold the view's elements or the view reaches past `raw`.
    fn gather<E: Copy>(&self, raw: &[E], out: &mut [E]) -> Result<(), CpuError> {
        let (offsets, inner, stride) = self.rows();
        if out.len() != self.elements() {
            return Err(CpuError::WrongNumElements);
        }
        for (row, base) in out.chunks_exact_mut(inner).zip(offsets) {
            match stride {
                0 => row.fill(*raw.get(base).ok_or(CpuError::WrongNumElements)?),
                1 => row.copy_from_slice(
                    raw.get(base..base + inner)
                        .ok_or(CpuError::WrongNumElements)?,
                ),
                s => {
                    for (j, v) in row.iter_mut().enumerate() {
                        *v = *raw.get(base + j * s).ok_or(CpuError::WrongNumElements)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// `sums[buffer index of o] += dy[o]` for every element `o` of the view.
    ///
    /// # Errors
    /// A shape error if `dy` does not hold the view's elements or the view reaches past `sums`.
    fn scatter_sum(&self, dy: &[f32], sums: &mut [f32]) -> Result<(), CpuError> {
        let (offsets, inner, stride) = self.rows();
        if dy.len() != self.elements() {
            return Err(CpuError::WrongNumElements);
        }
        for (row, base) in dy.chunks_exact(inner).zip(offsets) {
            match stride {
                0 => {
                    *sums.get_mut(base).ok_or(CpuError::WrongNumElements)? +=
                        row.iter().sum::<f32>();
                }
                1 => {
                    let dst = sums
                        .get_mut(base..base + inner)
                        .ok_or(CpuError::WrongNumElements)?;
                    dst.iter_mut().zip(row).for_each(|(s, g)| *s += g);
                }
                s => {
                    for (j, g) in row.iter().enumerate() {
                        *sums
                            .get_mut(base + j * s)
                            .ok_or(CpuError::WrongNumElements)? += g;
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use dfdx::prelude::*;
    use half::f16;

    use super::*;

    type Taped<S> = Tensor<S, f16, Cpu, OwnedTape<f16, Cpu>>;

    /// Weights `(o % 16 + 1) / 16` for the view's elements: sums of them are exact in f32 (in
    /// any order), not in f16 once they pass 128.
    fn weights<S: Shape>(dev: &Cpu, shape: S) -> Tensor<S, f16, Cpu> {
        let n = shape.num_elements();
        let w = (0..n)
            .map(|o| f16::from_f32((o % 16 + 1) as f32 / 16.0))
            .collect();
        dev.tensor_from_vec(w, shape)
    }

    /// The gradient of `sum(view(src) * w)` into `src` with dfdx's contiguous op or mpx's.
    fn grad<Src: Shape, Dst: Shape>(
        src: &Tensor<Src, f16, Cpu>,
        view: &impl Fn(Taped<Src>) -> Taped<Dst>,
        w: &Tensor<Dst, f16, Cpu>,
        ours: bool,
    ) -> Vec<f16> {
        let v = view(src.leaky_trace());
        let v = if ours {
            contiguous(v).unwrap()
        } else {
            v.try_contiguous().unwrap()
        };
        let g = (v * w.clone()).sum::<Rank0, _>().backward();
        g.get(src).as_vec()
    }

    /// mpx's op on a view of `src`: dfdx's values, and the gradient each source element gets is
    /// the f32 sum of the weights of the view's elements that read it (found through the view
    /// of a tensor of indices), rounded once. Returns whether dfdx's gradient differs.
    fn check<Src: Shape, Dst: Shape>(
        src: &Tensor<Src, f16, Cpu>,
        dst: Dst,
        view: impl Fn(Taped<Src>) -> Taped<Dst>,
    ) -> bool {
        let dev = src.device().clone();
        let w = weights(&dev, dst);
        let theirs = view(src.leaky_trace()).try_contiguous().unwrap();
        assert_eq!(
            contiguous(view(src.leaky_trace())).unwrap().as_vec(),
            theirs.as_vec()
        );
        let n = src.shape().num_elements();
        let index = (0..n).map(|i| f16::from_f32(i as f32)).collect();
        let index = dev.tensor_from_vec(index, *src.shape());
        let mut want = vec![0.0f32; n];
        for (i, w) in view(index.leaky_trace()).as_vec().iter().zip(w.as_vec()) {
            want[i.to_f32() as usize] += w.to_f32();
        }
        let want: Vec<f16> = want.iter().map(|v| f16::from_f32(*v)).collect();
        assert_eq!(grad(src, &view, &w, true), want);
        grad(src, &view, &w, false) != want
    }

    #[test]
    fn a_broadcast_bias_sums_its_gradient_in_f32_and_rounds_once() {
        let dev = Cpu::default();
        let b: Tensor<Rank1<5>, f16, Cpu> = dev.sample_normal();
        let dst = Rank2::<300, 5>::default();
        let dfdx_rounds = check(&b, dst, BroadcastTo::broadcast::<Rank2<300, 5>, Axis<0>>);
        assert!(
            dfdx_rounds,
            "the sums are past f16's exact range: dfdx's f16 adds round"
        );
    }

    #[test]
    fn other_views_match_the_f32_sums() {
        let dev = Cpu::default();
        let c: Tensor<Rank1<4>, f16, Cpu> = dev.sample_normal();
        check(&c, Rank3::<4, 3, 6>::default(), |t| {
            t.broadcast::<Rank3<4, 3, 6>, Axes2<1, 2>>()
        });
        let m: Tensor<Rank3<2, 3, 4>, f16, Cpu> = dev.sample_normal();
        check(&m, Rank3::<4, 2, 3>::default(), |t| {
            t.permute::<Rank3<4, 2, 3>, Axes3<2, 0, 1>>()
        });
        let s: Tensor<Rank0, f16, Cpu> = dev.sample_normal();
        check(&s, Rank2::<3, 2>::default(), |t| {
            t.broadcast::<Rank2<3, 2>, Axes2<0, 1>>()
        });
    }

    #[test]
    fn a_permuted_view_has_dfdx_bits() {
        let dev = Cpu::default();
        let m: Tensor<Rank2<7, 9>, f16, Cpu> = dev.sample_normal();
        let w: Tensor<Rank2<9, 7>, f16, Cpu> = dev.sample_normal();
        let view = |t: Taped<Rank2<7, 9>>| t.permute::<Rank2<9, 7>, Axes2<1, 0>>();
        assert_eq!(grad(&m, &view, &w, true), grad(&m, &view, &w, false));
    }

    #[test]
    fn read_into_gives_the_values_in_logical_order() {
        let dev = Cpu::default();
        let m: Tensor<Rank2<3, 5>, f32, Cpu> = dev.sample_normal();
        let mut out = vec![0.0f32; 15];
        read_into(&m, &mut out).unwrap();
        assert_eq!(out, m.as_vec());
        let t = m.clone().permute::<Rank2<5, 3>, Axes2<1, 0>>();
        read_into(&t, &mut out).unwrap();
        assert_eq!(out, t.as_vec());
        let b: Tensor<Rank1<5>, f16, Cpu> = dev.sample_normal();
        let v = b.broadcast::<Rank2<4, 5>, Axis<0>>();
        let mut out = vec![f16::ZERO; 20];
        read_into(&v, &mut out).unwrap();
        assert_eq!(out, v.as_vec());
        assert!(read_into(&v, &mut [f16::ZERO; 5]).is_err());
    }

    #[test]
    fn a_contiguous_tensor_is_itself() {
        let dev = Cpu::default();
        let x: Tensor<Rank2<3, 4>, f16, Cpu> = dev.sample_normal();
        let y = contiguous(x.leaky_trace()).unwrap();
        assert!(std::ptr::eq(&raw const x[[0, 0]], &raw const y[[0, 0]]));
    }
}
