//! Tensor I/O for casts and leaf visitors: reading a CPU tensor's values out as f32 or as bits,
//! writing f32 values in, and letting a visitor change them in place.
//!
//! dfdx 0.13 lends no slice of a tensor's storage outside its crate, so every read is one memcpy
//! (`copy_into`) into a reused scratch buffer, plus one slice conversion where the element is not
//! f32; every write is the reverse (`copy_from`). `tmp32` and `tmp16` are the scratch buffers:
//! nothing is allocated once they are large enough.

use std::any::Any;

use dfdx::shapes::{Dtype, HasShape, Shape};
use dfdx::tensor::{Cpu, Storage, Tensor};
use dfdx::tensor_ops::ReshapeTo;
use half::f16;

use crate::precision::{FloatSlice, FloatSliceMut, Precision};

/// A gradient buffer (dfdx's private CPU vector) as a slice. Written outside any `Cpu: Device<E>`
/// bound, under which the storage type does not resolve to the vector.
pub(crate) fn grad_slice<E: Dtype>(buf: &mut <Cpu as Storage<E>>::Vec) -> &mut [E] {
    &mut buf[..]
}

/// A contiguous view of the tensor (shares storage when it already is contiguous), so that its
/// physical storage has exactly `num_elements` values in logical order.
fn contiguous<S: Shape, E: dfdx::shapes::Dtype>(t: &Tensor<S, E, Cpu>) -> Tensor<S, E, Cpu> {
    t.clone().contiguous()
}

/// Makes `t` contiguous in place (a no-op for tensors that already are).
fn make_contiguous<S: Shape, E: dfdx::shapes::Dtype>(t: &mut Tensor<S, E, Cpu>) {
    let c = t.clone().contiguous();
    *t = c;
}

/// Reads a CPU tensor's values, in logical order, into `dst` as f32 (exact widening).
/// `dst.len()` must be the tensor's element count. An f32 tensor is copied straight into `dst`;
/// `tmp16` is the scratch for 16-bit elements.
pub(crate) fn read_tensor_f32<E: Precision<Elem = E> + Dtype, S: Shape>(
    t: &Tensor<S, E, Cpu>,
    dst: &mut [f32],
    tmp16: &mut Vec<f16>,
) {
    let t = contiguous(t);
    if E::IDENTITY
        && let Some(t32) = (&t as &dyn Any).downcast_ref::<Tensor<S, f32, Cpu>>()
    {
        t32.copy_into(dst);
    } else {
        // Only 16-bit elements get here: their scratch is `tmp16` (`unused` allocates nothing).
        let mut unused = Vec::new();
        let buf = E::scratch(&mut unused, tmp16, dst.len());
        t.copy_into(buf);
        E::widen(buf, dst);
    }
}

/// Copies a CPU tensor's values into scratch and returns their bit patterns.
pub(crate) fn read_tensor_bits<'a, E: Precision<Elem = E> + Dtype, S: Shape>(
    t: &Tensor<S, E, Cpu>,
    tmp32: &'a mut Vec<f32>,
    tmp16: &'a mut Vec<f16>,
) -> FloatSlice<'a> {
    let buf = E::scratch(tmp32, tmp16, t.shape().num_elements());
    contiguous(t).copy_into(buf);
    E::floats(buf)
}

/// Lets `visit` change a CPU tensor's values in place (copied out to scratch, then back).
pub(crate) fn update_tensor<E: Precision<Elem = E> + Dtype, S: Shape>(
    t: &mut Tensor<S, E, Cpu>,
    tmp32: &mut Vec<f32>,
    tmp16: &mut Vec<f16>,
    visit: &mut dyn FnMut(FloatSliceMut<'_>),
) {
    make_contiguous(t);
    let buf = E::scratch(tmp32, tmp16, t.shape().num_elements());
    t.copy_into(buf);
    visit(E::floats_mut(buf));
    t.copy_from(buf);
}
