//! Leaves: dfdx CPU tensors and scalars. Float leaves (f32, f16, `AMP<f16>`) are converted;
//! integer, bool and f64 leaves and plain values are returned unchanged.

use std::any::Any;
use std::cell::Cell;

use dfdx::shapes::{Dtype, HasShape, Shape};
use dfdx::tensor::{Cpu, Tensor, TensorFromVec};

use super::tensor_io::{read_tensor_bits, read_tensor_f32, update_tensor};
use super::{Cast, FloatLeaves, FloatSliceMut};
use crate::precision::{AMP, FloatSlice, Precision, f16, sized};

thread_local! {
    /// Per-thread scratch for tensor reads, so that visiting or casting a tensor allocates nothing
    /// once the buffers are large enough. Taken out while in use (re-entrant calls get fresh ones).
    static SCRATCH: Cell<(Vec<f32>, Vec<f16>)> = const { Cell::new((Vec::new(), Vec::new())) };
}

/// Runs `f` with this thread's scratch buffers.
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut Vec<f32>, &mut Vec<f16>) -> R) -> R {
    let (mut a, mut b) = SCRATCH.with(Cell::take);
    let r = f(&mut a, &mut b);
    SCRATCH.with(|c| c.set((a, b)));
    r
}

/// Casts one float tensor to precision `P`: one read into scratch, one slice conversion, one new
/// tensor. A cast that changes nothing (f16 to f16, f32 to f32) shares the storage, as `clone` does.
pub(crate) fn cast_tensor<P: Precision, E: Precision<Elem = E> + Dtype, S: Shape>(
    t: &Tensor<S, E, Cpu>,
) -> Tensor<S, P::Elem, Cpu> {
    // already in `P` (the same precision, so the same element type): share it
    if P::DTYPE == E::DTYPE
        && let Some(same) = (t as &dyn Any).downcast_ref::<Tensor<S, P::Elem, Cpu>>()
    {
        return same.clone();
    }
    let n = t.shape().num_elements();
    with_scratch(|s32, s16| {
        let vals = sized(s32, n);
        read_tensor_f32(t, vals, s16);
        let mut out = vec![P::Elem::default(); n];
        P::round(vals, &mut out);
        t.device().tensor_from_vec(out, *t.shape())
    })
}

macro_rules! float_tensor {
    ($($e:ty),*) => {$(
        impl<S: Shape, P: Precision> Cast<P> for Tensor<S, $e, Cpu> {
            type Output = Tensor<S, P::Elem, Cpu>;
            fn cast(&self) -> Self::Output {
                cast_tensor::<P, $e, S>(self)
            }
        }

        impl<S: Shape> FloatLeaves for Tensor<S, $e, Cpu> {
            fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
                with_scratch(|a, b| visit(read_tensor_bits(self, a, b)))
            }
            fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
                with_scratch(|a, b| update_tensor(self, a, b, visit))
            }
        }
    )*};
}
float_tensor!(f32, f16, AMP<f16>);

macro_rules! untouched_tensor {
    ($($e:ty),*) => {$(
        impl<S: Shape, P: Precision> Cast<P> for Tensor<S, $e, Cpu> {
            type Output = Tensor<S, $e, Cpu>;
            /// Not a float leaf (or f64, which mpx does not cast): returned unchanged.
            fn cast(&self) -> Self::Output {
                self.clone()
            }
        }

        impl<S: Shape> FloatLeaves for Tensor<S, $e, Cpu> {
            fn visit_floats(&self, _: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
                true
            }
            fn visit_floats_mut(&mut self, _: &mut dyn FnMut(FloatSliceMut<'_>)) {}
        }
    )*};
}
untouched_tensor!(
    u8, u16, u32, u64, usize, i8, i16, i32, i64, isize, bool, f64
);

// ---- scalars -------------------------------------------------------------------------------

fn scalar_to<P: Precision>(v: f32) -> P::Elem {
    let mut out = [P::Elem::default()];
    P::round(&[v], &mut out);
    out[0]
}

impl<P: Precision> Cast<P> for f32 {
    type Output = P::Elem;
    fn cast(&self) -> P::Elem {
        scalar_to::<P>(*self)
    }
}
impl<P: Precision> Cast<P> for f16 {
    type Output = P::Elem;
    fn cast(&self) -> P::Elem {
        scalar_to::<P>(self.to_f32())
    }
}
impl<P: Precision> Cast<P> for AMP<f16> {
    type Output = P::Elem;
    fn cast(&self) -> P::Elem {
        scalar_to::<P>(self.0.to_f32())
    }
}

impl FloatLeaves for f32 {
    fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
        visit(<f32 as Precision>::floats(std::slice::from_ref(self)))
    }
    fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
        visit(FloatSliceMut::F32(std::slice::from_mut(self)));
    }
}
impl FloatLeaves for f16 {
    fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
        visit(<f16 as Precision>::floats(std::slice::from_ref(self)))
    }
    fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
        visit(FloatSliceMut::F16(std::slice::from_mut(self)));
    }
}
impl FloatLeaves for AMP<f16> {
    fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
        visit(<AMP<f16> as Precision>::floats(std::slice::from_ref(self)))
    }
    fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
        visit(<AMP<f16> as Precision>::floats_mut(std::slice::from_mut(
            self,
        )));
    }
}

macro_rules! untouched_value {
    ($($t:ty),*) => {$(
        impl<P: Precision> Cast<P> for $t {
            type Output = $t;
            fn cast(&self) -> $t {
                self.clone()
            }
        }
        impl FloatLeaves for $t {
            fn visit_floats(&self, _: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
                true
            }
            fn visit_floats_mut(&mut self, _: &mut dyn FnMut(FloatSliceMut<'_>)) {}
        }
    )*};
}
untouched_value!(
    u8,
    u16,
    u32,
    u64,
    u128,
    usize,
    i8,
    i16,
    i32,
    i64,
    i128,
    isize,
    bool,
    char,
    f64,
    String,
    &'static str,
    ()
);
