//! dfdx modules, walked through `TensorCollection`: a fresh cast ([`cast_module`]) and an
//! in-place one for the per-step working copy ([`cast_module_into`]).

use std::marker::PhantomData;

use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorMut, ViewTensorRef,
};
use dfdx::shapes::{Dtype, HasShape, Shape};
use dfdx::tensor::{Cpu, Tensor};
use dfdx::tensor_ops::Device;

use super::FloatSliceMut;
use super::leaf::{cast_tensor, with_scratch};
use super::tensor_io::{read_tensor_bits, read_tensor_f32, update_tensor, write_tensor_from_f32};
use crate::kernels::each_range;
use crate::precision::{FloatSlice, Precision, f16};

/// Why a module cast failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CastError {
    /// The destination of [`cast_module_into`] does not line up with the source (a tensor with
    /// runtime dimensions has a different size, or the tensor counts differ).
    #[error(
        "cast_module_into: tensor #{index} of the destination has {dst} elements but the source has {src}; the destination must be a cast of the same model (same runtime dimensions)"
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
    /// A module's `TensorCollection` impl did not build its output (a third-party impl that
    /// returns `None` for a field).
    #[error(
        "cast_module: the module's TensorCollection impl did not rebuild it; every field must be listed in iter_tensors"
    )]
    NotRebuilt,
}

/// Reused buffers for [`cast_module_into`]: after the first call with a given model nothing is
/// allocated.
///
/// # Examples
/// ```
/// use mpx_runtime::cast::CastScratch;
/// let scratch = CastScratch::default();
/// assert_eq!(scratch.capacity_bytes(), 0);
/// ```
#[derive(Debug, Default, Clone)]
pub struct CastScratch {
    /// Every source value, as f32, in visit order.
    flat: Vec<f32>,
    /// Element count and trainable flag of each source tensor, in visit order.
    lens: Vec<(usize, bool)>,
    tmp32: Vec<f32>,
    tmp16: Vec<f16>,
}

impl CastScratch {
    /// New, empty scratch (the same as `Default`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes held by the buffers (their capacity).
    pub fn capacity_bytes(&self) -> usize {
        self.flat.capacity() * 4
            + self.lens.capacity() * std::mem::size_of::<(usize, bool)>()
            + self.tmp32.capacity() * 4
            + self.tmp16.capacity() * 2
    }
}

// ---- fresh casts -----------------------------------------------------------------------------

struct Converter<P>(PhantomData<P>);

impl<E: Precision<Elem = E> + Dtype, P: Precision> TensorVisitor<E, Cpu> for Converter<P>
where
    Cpu: Device<E> + Device<P::Elem>,
{
    type Viewer = ViewTensorRef;
    type Err = CastError;
    type E2 = P::Elem;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        _: TensorOptions<S, E, Cpu>,
        t: &Tensor<S, E, Cpu>,
    ) -> Result<Option<Tensor<S, P::Elem, Cpu>>, CastError> {
        Ok(Some(cast_tensor::<P, E, S>(t)))
    }
}

/// Casts every tensor of a dfdx module to precision `P`: mpx's `cast_to_half_precision(model)`
/// for dfdx. Walks the module's `TensorCollection`; each tensor is converted with one slice
/// conversion (dfdx's `to_dtype` converts element by element, about 6x slower).
///
/// Scalar fields (batch norm's `epsilon` and `momentum`) come back at their defaults, as with
/// dfdx's `to_dtype`: dfdx's visitor API does not let code outside dfdx read them generically.
/// The [`Cast`](super::Cast) impls of `BatchNorm1D`/`BatchNorm2D` copy them over.
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
    M::iter_tensors(&mut RecursiveWalker {
        m: module,
        f: &mut Converter::<P>(PhantomData),
    })?
    .ok_or(CastError::NotRebuilt)
}

// ---- in-place casts --------------------------------------------------------------------------

/// A long source tensor's read into its part of `CastScratch::flat`. It holds the tensor itself
/// (shared, not copied), boxed so that tensors of every shape can be read on the pool's threads
/// once the walk has listed them all.
type Read = Box<dyn Fn(&mut [f32]) + Send + Sync>;

/// Tensors shorter than this are read during the walk, on the calling thread; longer ones after
/// it, on the pool's threads, one tensor each (dfdx copies a tensor out only whole).
const READ_APART: usize = 1 << 16;

/// Walks the source: each tensor's length goes to `s.lens`; a short tensor's values are read
/// into `s.flat` at once, a long one's read is listed in `reads` with its range of `s.flat`.
struct Gather<'a> {
    s: &'a mut CastScratch,
    /// Values of `s.flat` taken so far (`flat` keeps its length across calls, so that it is not
    /// zeroed again each time).
    filled: usize,
    reads: Vec<((usize, usize), Read)>,
}

impl<E: Precision<Elem = E> + Dtype> TensorVisitor<E, Cpu> for Gather<'_>
where
    Cpu: Device<E>,
{
    type Viewer = ViewTensorRef;
    type Err = CastError;
    type E2 = E;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, E, Cpu>,
        t: &Tensor<S, E, Cpu>,
    ) -> Result<Option<Tensor<S, E, Cpu>>, CastError> {
        let n = t.shape().num_elements();
        let (start, end) = (self.filled, self.filled + n);
        if self.s.flat.len() < end {
            self.s.flat.resize(end, 0.0);
        }
        if n < READ_APART {
            read_tensor_f32(t, &mut self.s.flat[start..end], &mut self.s.tmp16);
        } else {
            let t = t.clone();
            self.reads.push((
                (start, n),
                Box::new(move |dst| with_scratch(|_, tmp16| read_tensor_f32(&t, dst, tmp16))),
            ));
        }
        self.filled = end;
        self.s.lens.push((n, opts.do_gradient_update));
        Ok(None)
    }
}

struct Scatter<'a, P> {
    s: &'a mut CastScratch,
    index: usize,
    offset: usize,
    p: PhantomData<P>,
}

impl<P: Precision> TensorVisitor<P::Elem, Cpu> for Scatter<'_, P>
where
    Cpu: Device<P::Elem>,
{
    type Viewer = ViewTensorMut;
    type Err = CastError;
    type E2 = P::Elem;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, P::Elem, Cpu>,
        t: &mut Tensor<S, P::Elem, Cpu>,
    ) -> Result<Option<Tensor<S, P::Elem, Cpu>>, CastError> {
        let n = t.shape().num_elements();
        let (src, trainable) = self.s.lens.get(self.index).copied().unwrap_or((0, false));
        if src != n || self.index >= self.s.lens.len() {
            return Err(CastError::LengthMismatch {
                index: self.index,
                src,
                dst: n,
            });
        }
        if trainable != opts.do_gradient_update {
            return Err(CastError::TrainableMismatch { index: self.index });
        }
        let vals = &self.s.flat[self.offset..self.offset + n];
        write_tensor_from_f32::<P, S>(t, vals, &mut self.s.tmp32, &mut self.s.tmp16);
        self.index += 1;
        self.offset += n;
        Ok(None)
    }
}

/// Rewrites `dst` (an existing cast of `src`, e.g. last step's half working copy) with the values
/// of `src` cast to precision `P`, without allocating new tensors: the step's `cast_to_half_precision`.
///
/// The source is gathered into `scratch` as f32 in visit order, then the destination is walked
/// and each tensor overwritten with its converted chunk (`copy_from`). dfdx copies a tensor out
/// only whole, on one thread, so tensors of 65,536 values or more are copied out after the walk,
/// several at once on the GEMM's threads. After the first call with a given model no buffer is
/// allocated: dfdx's own walk over a tuple module formats each field's name (a few bytes), and
/// each long tensor takes a small handle for its copy (about a hundred bytes), nothing else. If
/// someone else still holds a clone of a destination tensor, dfdx's copy-on-write copies that one
/// tensor. The reverse direction (half copy into an f32 model) is the same call with `P = f32`.
///
/// # Errors
/// [`CastError::LengthMismatch`] when a tensor of `dst` has a different element count than the
/// matching tensor of `src` (possible only with runtime dimensions).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::cast::{CastScratch, cast_module, cast_module_into};
/// use mpx_runtime::precision::f16;
///
/// let dev = Cpu::default();
/// let mut master = dev.build_module::<Linear<4, 2>, f32>();
/// let mut work = cast_module::<f16, f32, _>(&master);
/// let mut scratch = CastScratch::default();
/// master.weight = master.weight.clone() * 2.0; // an optimizer step
/// cast_module_into::<f16, f32, _>(&master, &mut work, &mut scratch).unwrap();
/// assert_eq!(work.weight.as_vec()[3], f16::from_f32(master.weight.as_vec()[3]));
/// // back to f32: the same function with P = f32
/// cast_module_into::<f32, f16, _>(&work, &mut master, &mut scratch).unwrap();
/// ```
pub fn cast_module_into<P, E, M>(
    src: &M,
    dst: &mut M::To<P::Elem, Cpu>,
    scratch: &mut CastScratch,
) -> Result<(), CastError>
where
    P: Precision,
    E: Precision<Elem = E> + Dtype,
    M: TensorCollection<E, Cpu>,
    M::To<P::Elem, Cpu>: TensorCollection<P::Elem, Cpu>,
    Cpu: Device<E> + Device<P::Elem>,
{
    cast_by_position::<P, E, M, M::To<P::Elem, Cpu>>(src, dst, scratch)
}

/// [`cast_module_into`] between any two modules that hold the same tensors in the same visit
/// order (counts, element counts and trainable flags checked), whatever their types: the mixed
/// step's working copy made of mpx's layers is cast from a master made of dfdx's this way.
pub(crate) fn cast_by_position<P, E, M, W>(
    src: &M,
    dst: &mut W,
    scratch: &mut CastScratch,
) -> Result<(), CastError>
where
    P: Precision,
    E: Precision<Elem = E> + Dtype,
    M: TensorCollection<E, Cpu>,
    W: TensorCollection<P::Elem, Cpu>,
    Cpu: Device<E> + Device<P::Elem>,
{
    scratch.lens.clear();
    let mut gather = Gather {
        s: scratch,
        filled: 0,
        reads: Vec::new(),
    };
    M::iter_tensors(&mut RecursiveWalker {
        m: src,
        f: &mut gather,
    })?;
    let reads = gather.reads;
    if !reads.is_empty() {
        let ranges: Vec<(usize, usize)> = reads.iter().map(|&(range, _)| range).collect();
        each_range(&mut scratch.flat, &ranges, &|i, part| (reads[i].1)(part));
    }
    // the source's tensors are no longer shared (a shared tensor is copied when next written)
    drop(reads);
    let mut scatter = Scatter::<P> {
        s: scratch,
        index: 0,
        offset: 0,
        p: PhantomData,
    };
    W::iter_tensors(&mut RecursiveWalker {
        m: dst,
        f: &mut scatter,
    })?;
    if let Some(&(src, _)) = scatter.s.lens.get(scatter.index) {
        return Err(CastError::LengthMismatch {
            index: scatter.index,
            src,
            dst: 0,
        });
    }
    Ok(())
}

// ---- float leaves of modules -------------------------------------------------------------------

struct FloatsVisitor<'a, 'v> {
    visit: &'a mut dyn FnMut(FloatSlice<'_>) -> bool,
    p: PhantomData<&'v ()>,
}

/// Stops a walk early (not an error).
struct Stop;

impl<E: Precision<Elem = E> + Dtype> TensorVisitor<E, Cpu> for FloatsVisitor<'_, '_>
where
    Cpu: Device<E>,
{
    type Viewer = ViewTensorRef;
    type Err = Stop;
    type E2 = E;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        _: TensorOptions<S, E, Cpu>,
        t: &Tensor<S, E, Cpu>,
    ) -> Result<Option<Tensor<S, E, Cpu>>, Stop> {
        let keep_going = with_scratch(|a, b| (self.visit)(read_tensor_bits(t, a, b)));
        if keep_going { Ok(None) } else { Err(Stop) }
    }
}

struct MutVisitor<'a> {
    visit: &'a mut dyn FnMut(FloatSliceMut<'_>),
}

impl<E: Precision<Elem = E> + Dtype> TensorVisitor<E, Cpu> for MutVisitor<'_>
where
    Cpu: Device<E>,
{
    type Viewer = ViewTensorMut;
    type Err = std::convert::Infallible;
    type E2 = E;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        _: TensorOptions<S, E, Cpu>,
        t: &mut Tensor<S, E, Cpu>,
    ) -> Result<Option<Tensor<S, E, Cpu>>, Self::Err> {
        with_scratch(|a, b| update_tensor(t, a, b, self.visit));
        Ok(None)
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
    let mut v = FloatsVisitor {
        visit,
        p: PhantomData,
    };
    M::iter_tensors(&mut RecursiveWalker {
        m: module,
        f: &mut v,
    })
    .is_ok()
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
    let mut v = MutVisitor { visit };
    let _ = M::iter_tensors(&mut RecursiveWalker {
        m: module,
        f: &mut v,
    });
}

#[cfg(test)]
mod tests {
    use dfdx::nn::{DeviceBuildExt, builders};

    use super::*;

    /// Two modules of other types line up by position: element counts and trainable flags.
    #[test]
    fn a_cast_by_position_checks_what_is_trained() {
        let dev = Cpu::default();
        let bn = dev.build_module::<builders::BatchNorm1D<4>, f32>();
        let mut scratch = CastScratch::default();
        // scale, bias (trained), running mean and variance (not): 4 + 4 + 4 + 4
        let mut norms =
            dev.build_module::<(builders::LayerNorm1D<4>, builders::LayerNorm1D<4>), f16>();
        let e = cast_by_position::<f16, f32, _, _>(&bn, &mut norms, &mut scratch).unwrap_err();
        assert_eq!(e, CastError::TrainableMismatch { index: 2 });
        // fewer tensors in the destination
        let mut one = dev.build_module::<builders::LayerNorm1D<4>, f16>();
        let e = cast_by_position::<f16, f32, _, _>(&bn, &mut one, &mut scratch).unwrap_err();
        assert_eq!(
            e,
            CastError::LengthMismatch {
                index: 2,
                src: 4,
                dst: 0
            }
        );
        // the same layout: the values, rounded
        let mut same = dev.build_module::<builders::BatchNorm1D<4>, f16>();
        cast_by_position::<f16, f32, _, _>(&bn, &mut same, &mut scratch).unwrap();
        assert_eq!(same.running_var.as_vec(), vec![f16::ONE; 4]);
    }
}
