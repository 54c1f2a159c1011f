//! dfdx modules, walked through `TensorCollection`: a cast of every tensor ([`cast_module`]),
//! every setting that is not a tensor carried as it is ([`copy_scalar`](super::copy_scalar)).

use std::marker::PhantomData;

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::shapes::{Dtype, Shape};
use dfdx::tensor::{Cpu, CpuError, Tensor};
use dfdx::tensor_ops::Device;

use super::FloatSliceMut;
use super::leaf::{cast_tensor, with_scratch};
use super::tensor_io::{read_tensor_bits, update_tensor};
use crate::precision::{FloatSlice, Precision};
use crate::walk::{Each, EachMut, Map, each, each_mut, map};

/// Why a module cast failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CastError {
    /// A module built from another by position (a mixed step's working copy made of mpx's
    /// layers) does not line up with it: a tensor has another size, or the counts differ.
    #[error(
        "tensor #{index} (in visit order) has {dst} elements in the copy but {src} in the model it is built from; the copy must visit the model's tensors in the same order and shapes"
    )]
    LengthMismatch {
        /// Position of the tensor in visit order.
        index: usize,
        /// Elements in the source tensor (0 when the source has fewer tensors).
        src: usize,
        /// Elements in the destination tensor (0 when the destination has fewer tensors).
        dst: usize,
    },
    /// The destination's tensor at `index` is trained (or not) where the source's is not (or
    /// is): the two do not line up.
    #[error(
        "cast into another module: tensor #{index} is trained in one module and not in the other; the destination must hold the source's tensors in the same order"
    )]
    TrainableMismatch {
        /// Position of the tensor in visit order.
        index: usize,
    },
    /// A module built from another by position takes another number of scalar settings (a
    /// norm's `epsilon`, dropout's `p`) than the model has: the one at `index` has no
    /// counterpart.
    #[error(
        "scalar setting #{index} (in visit order) has no counterpart: the copy must visit the model's scalar settings in the same order"
    )]
    ScalarMismatch {
        /// Position of the scalar in visit order.
        index: usize,
    },
    /// A module's `TensorCollection` impl did not build its output (a third-party impl that
    /// returns `None` for a field).
    #[error(
        "cast_module: the module's TensorCollection impl did not rebuild it; every field must be listed in iter_tensors"
    )]
    NotRebuilt,
}

// ---- fresh casts -----------------------------------------------------------------------------

struct Converter<P>(PhantomData<P>);

impl<E: Precision<Elem = E> + Dtype, P: Precision> Map<E, P::Elem, Cpu> for Converter<P>
where
    Cpu: Device<E> + Device<P::Elem>,
{
    type Error = CastError;

    fn tensor<S: Shape>(
        &mut self,
        _: bool,
        t: &Tensor<S, E, Cpu>,
    ) -> Result<Tensor<S, P::Elem, Cpu>, CastError> {
        Ok(cast_tensor::<P, E, S>(t))
    }
}

/// Casts every tensor of a dfdx module to precision `P`: mpx's `cast_to_half_precision(model)`
/// for dfdx. Walks the module's `TensorCollection`; each tensor is converted with one slice
/// conversion (dfdx's `to_dtype` converts element by element, about 6x slower).
///
/// Every setting the module lists as a scalar (batch norm's `epsilon` and `momentum`, dropout's
/// `p`, a user's own) is carried as it is (dfdx's `to_dtype` resets them to their defaults).
///
/// # Panics
/// When a hand-written `TensorCollection` impl does not rebuild the module (see
/// [`try_cast_module`]).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::cast::cast_module;
/// use mpx_runtime::precision::f16;
///
/// let dev = Cpu::default();
/// let m = dev.build_module::<Linear<3, 2>, f32>();
/// let h: dfdx::nn::modules::Linear<3, 2, f16, Cpu> = cast_module::<f16, f32, _>(&m);
/// assert_eq!(h.weight.as_vec()[0], f16::from_f32(m.weight.as_vec()[0]));
/// ```
pub fn cast_module<P, E, M>(module: &M) -> M::To<P::Elem, Cpu>
where
    P: Precision,
    E: Precision<Elem = E> + Dtype,
    M: TensorCollection<E, Cpu>,
    Cpu: Device<E> + Device<P::Elem>,
{
    match try_cast_module::<P, E, M>(module) {
        Ok(m) => m,
        // Only a hand-written TensorCollection that skips a field gets here.
        Err(e) => panic!("{e}"),
    }
}

/// Fallible form of [`cast_module`].
///
/// # Errors
/// [`CastError::NotRebuilt`] when a hand-written `TensorCollection` impl does not rebuild its
/// module.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::cast::try_cast_module;
/// use mpx_runtime::precision::bf16;
///
/// let dev = Cpu::default();
/// let m = dev.build_module::<Linear<3, 2>, f32>();
/// let b = try_cast_module::<bf16, f32, _>(&m).unwrap();
/// assert_eq!(b.bias.as_vec()[0], half::bf16::from_f32(m.bias.as_vec()[0]).to_f32());
/// ```
pub fn try_cast_module<P, E, M>(module: &M) -> Result<M::To<P::Elem, Cpu>, CastError>
where
    P: Precision,
    E: Precision<Elem = E> + Dtype,
    M: TensorCollection<E, Cpu>,
    Cpu: Device<E> + Device<P::Elem>,
{
    map::<E, P::Elem, Cpu, M, _>(module, &mut Converter::<P>(PhantomData))?
        .ok_or(CastError::NotRebuilt)
}

// ---- float leaves of modules -------------------------------------------------------------------

struct Floats<'a>(&'a mut dyn FnMut(FloatSlice<'_>) -> bool);

/// Stops a walk early (not an error).
struct Stop;

impl<E: Precision<Elem = E> + Dtype> Each<E, Cpu> for Floats<'_>
where
    Cpu: Device<E>,
{
    type Error = Stop;

    fn tensor<S: Shape>(&mut self, _: bool, t: &Tensor<S, E, Cpu>) -> Result<(), Stop> {
        let keep_going = with_scratch(|a, b| (self.0)(read_tensor_bits(t, a, b)));
        if keep_going { Ok(()) } else { Err(Stop) }
    }
}

struct FloatsMut<'a>(&'a mut dyn FnMut(FloatSliceMut<'_>));

impl<E: Precision<Elem = E> + Dtype> EachMut<E, Cpu> for FloatsMut<'_>
where
    Cpu: Device<E>,
{
    type Error = CpuError;

    fn tensor<S: Shape>(&mut self, _: bool, t: &mut Tensor<S, E, Cpu>) -> Result<(), CpuError> {
        with_scratch(|a, b| update_tensor(t, a, b, self.0));
        Ok(())
    }
}

/// [`super::FloatLeaves::visit_floats`] for any dfdx module: visits the values of every tensor
/// in `TensorCollection` order, stopping when `visit` returns `false`.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::cast::module_visit_floats;
/// let dev = Cpu::default();
/// let m = dev.build_module::<Linear<3, 2>, f32>();
/// let mut n = 0;
/// assert!(module_visit_floats::<f32, _>(&m, &mut |v| { n += v.len(); true }));
/// assert_eq!(n, 3 * 2 + 2);
/// ```
pub fn module_visit_floats<E, M>(module: &M, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool
where
    E: Precision<Elem = E> + Dtype,
    M: TensorCollection<E, Cpu>,
    Cpu: Device<E>,
{
    each(module, &mut Floats(visit), |_| Stop).is_ok()
}

/// [`super::FloatLeaves::visit_floats_mut`] for any dfdx module: lets `visit` rewrite every
/// tensor's values in `TensorCollection` order.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::cast::{FloatSliceMut, module_visit_floats_mut};
/// let dev = Cpu::default();
/// let mut m = dev.build_module::<Linear<3, 2>, f32>();
/// module_visit_floats_mut::<f32, _>(&mut m, &mut |s| if let FloatSliceMut::F32(v) = s {
///     v.fill(0.5)
/// });
/// assert_eq!(m.bias.array(), [0.5, 0.5]);
/// ```
pub fn module_visit_floats_mut<E, M>(module: &mut M, visit: &mut dyn FnMut(FloatSliceMut<'_>))
where
    E: Precision<Elem = E> + Dtype,
    M: TensorCollection<E, Cpu>,
    Cpu: Device<E>,
{
    // neither the Cpu's walk nor `visit` fails
    let _ = each_mut(module, &mut FloatsMut(visit), std::convert::identity);
}
