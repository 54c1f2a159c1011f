//! Full-precision regions: f32 computations inside a half-precision graph, gradients flowing through.
//!
//! mpx (JAX) writes these as `mpx.force_full_precision(fn, return_dtype)`; PyTorch AMP as a region
//! with `autocast(enabled=False)` and explicit `.float()` casts. Here a region is
//! [`FullPrecision::<H>::run`] (tensors only) or [`FullPrecision::<H>::run_with`] (tensors and a
//! module whose parameters are used inside, such as a `LayerNorm1D`'s gamma and beta); the
//! [`full_precision`](https://docs.rs/mpx-dfdx/latest/mpx/attr.full_precision.html) attribute rewrites a
//! function body into a call of these.
//!
//! # How gradients cross the boundary
//! dfdx tapes are typed per dtype and `to_dtype` drops the tape, so a region is a bridge:
//! 1. the tape is split off the half inputs, f32 copies are made and traced on their own f32 tape;
//! 2. the region runs on the f32 copies (and on an f32 copy of the parameters);
//! 3. its result is cast back to the **caller's** half type `H` (f16, `AMP<f16>`, or f32 storage
//!    rounded to bf16 for emulated bf16; mpx always returns f16, a trap in bf16 mode);
//! 4. one backward op on the outer tape casts the output's gradient to f32, runs the region's
//!    backward as the vector-Jacobian product `sum(y32 * g32)`, and writes the gradients of the
//!    inputs and parameters back, cast to `H`.
//!
//! Gradients that already reached an input or a parameter before the region's backward ran are
//! carried into the f32 accumulation and rounded once, so with `H = f32` a region's gradients are
//! bit-identical to the same computation without it.
//!
//! On the `Cpu` the bridge reads and writes gradient buffers on the host; on dfdx's `Cuda` device
//! (feature `cuda`, in `f16`, `AMP<f16>` and `f32`) the casts are dfdx's `to_dtype` and the
//! gradient sums mpx's own kernels ([`RegionDevice`]).
//!
//! # Examples
//! ```
//! use dfdx::prelude::*;
//! use mpx_runtime::precision::f16;
//! use mpx_runtime::region::FullPrecision;
//!
//! let dev = Cpu::default();
//! // Rows whose sum is past f16's max (65504): a plain f16 softmax/LayerNorm overflows here.
//! let x: Tensor<Rank2<2, 4>, f16, Cpu> =
//!     dev.tensor([[30000.0, 30000.0, 30000.0, 1.0], [1.0, 2.0, 3.0, 4.0]]).to_dtype::<f16>();
//! let y = FullPrecision::<f16>::run(x.leaky_trace(), |x| x.normalize::<Axis<1>>(1e-5));
//! assert!(y.as_vec().iter().all(|v| v.is_finite()));
//! let g = y.sum().backward();
//! assert!(g.get(&x).as_vec().iter().all(|v| v.is_finite()));
//! ```

use std::marker::PhantomData;

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::shapes::{Dtype, HasShape, Rank0, Shape};
use dfdx::tensor::{
    Cpu, CpuError, Gradients, HasErr, Merge, OwnedTape, PutTape, SplitTape, Storage, Tape, Tensor,
    TensorFromVec, Trace, ZerosTensor,
};
use dfdx::tensor_ops::{Backward, Device, ReshapeTo};

use crate::cast::grad_slice;
use crate::precision::Precision;
use crate::walk::Map;

/// Why [`FullPrecision::try_run_with`] failed.
///
/// # Examples
/// ```
/// use mpx_runtime::region::RegionError;
/// let err = RegionError::from(dfdx::tensor::CpuError::OutOfMemory);
/// assert!(std::error::Error::source(&err).is_some());
/// assert!(RegionError::NotRebuilt.to_string().contains("iter_tensors"));
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RegionError {
    /// The device failed (in practice: out of memory); the device's error is the source.
    #[error("the device failed in a full-precision region")]
    Device(#[from] CpuError),
    /// dfdx's `Cuda` device failed (its error is neither `Clone` nor a `std::error::Error`: it is
    /// shared, and in the message).
    #[cfg(feature = "cuda")]
    #[error("the CUDA device failed in a full-precision region: {0}")]
    Cuda(std::sync::Arc<dfdx::tensor::CudaError>),
    /// The parameters' `TensorCollection` impl did not build their f32 copy (a third-party impl
    /// that returns `None` for a field).
    #[error(
        "the parameters of a full-precision region could not be copied to f32: their TensorCollection impl did not rebuild them; every field must be listed in iter_tensors"
    )]
    NotRebuilt,
}

/// dfdx's modules report errors as `CpuError`, so a layer built on regions (`mpx::nn`) passes
/// a region's error on as one: a device error as itself, [`RegionError::NotRebuilt`] as
/// `CpuError::WrongNumElements` (the module's tensors did not line up with its description).
impl From<RegionError> for CpuError {
    fn from(e: RegionError) -> Self {
        match e {
            RegionError::Device(e) => e,
            #[cfg(feature = "cuda")]
            RegionError::Cuda(e) => match *e {
                dfdx::tensor::CudaError::Cpu(e) => e,
                _ => CpuError::OutOfMemory,
            },
            RegionError::NotRebuilt => CpuError::WrongNumElements,
        }
    }
}

/// A layer on `Cuda` passes a region's error on as dfdx's `CudaError`: a device error as itself,
/// [`RegionError::NotRebuilt`] as `CpuError::WrongNumElements` inside it.
#[cfg(feature = "cuda")]
impl From<RegionError> for dfdx::tensor::CudaError {
    fn from(e: RegionError) -> Self {
        match e {
            // the device's own error when this is its only holder
            RegionError::Cuda(e) => {
                std::sync::Arc::try_unwrap(e).unwrap_or(Self::Cpu(CpuError::OutOfMemory))
            }
            RegionError::Device(e) => Self::Cpu(e),
            RegionError::NotRebuilt => Self::Cpu(CpuError::WrongNumElements),
        }
    }
}

/// An input's f32 copy inside a region, on the region's own tape.
pub(crate) type Traced32<S, D> = Tensor<S, f32, D, OwnedTape<f32, D>>;

/// A region's output: in the caller's precision `H`, on the inputs' tape `T`.
type Half<S, H, D, T> = Tensor<S, <H as Precision>::Elem, D, T>;

/// A flattened handle on a contiguous tensor: same id (so the same gradient entry), shape `(n,)`.
pub(crate) type Flat<E, D = Cpu> = Tensor<(usize,), E, D>;

/// The leaves of a region: each outer (half) tensor whose gradient the region produces, paired
/// with its f32 copy inside the region. Opaque; filled by [`RegionInput::enter`].
#[derive(Debug)]
pub struct Leaves<E: Dtype, D: Storage<E> + Storage<f32> = Cpu> {
    pub(crate) outer: Vec<Flat<E, D>>,
    pub(crate) inner: Vec<Flat<f32, D>>,
}

impl<E: Dtype, D: Storage<E> + Storage<f32>> Leaves<E, D> {
    fn new() -> Self {
        Self {
            outer: Vec::new(),
            inner: Vec::new(),
        }
    }
}

/// The device a region runs on, in precision `H`: the `Cpu` (host slices) for every precision,
/// dfdx's `Cuda` (feature `cuda`) for `f32`, `f16` and `AMP<f16>`. Sealed: its methods are the
/// region's own machinery.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::region::RegionDevice;
/// fn regions_on<D: RegionDevice<f16>>() {}
/// regions_on::<Cpu>();
/// ```
pub trait RegionDevice<H: Precision>: Device<f32> + Storage<H::Elem> + sealed::Sealed {
    /// A half input entering the region: made contiguous, its tape split off, its f32 copy
    /// traced on the region's tape, both recorded as a leaf.
    #[doc(hidden)]
    fn enter<S: Shape, T: Tape<H::Elem, Self>>(
        x: Tensor<S, H::Elem, Self, T>,
        leaves: &mut Leaves<H::Elem, Self>,
    ) -> Result<(Traced32<S, Self>, T), Self::Err>;
    /// A half parameter's f32 copy, recorded as a leaf when it is trainable.
    #[doc(hidden)]
    fn widen_param<S: Shape>(
        t: &Tensor<S, H::Elem, Self>,
        trainable: bool,
        leaves: &mut Leaves<H::Elem, Self>,
    ) -> Result<Tensor<S, f32, Self>, Self::Err>;
    /// Casts the region's f32 result back to `H` and registers the backward bridge on `tape`.
    #[doc(hidden)]
    fn bridge<S: Shape, T: Tape<H::Elem, Self>>(
        leaves: Leaves<H::Elem, Self>,
        tape: T,
        y32: Tensor<S, f32, Self, OwnedTape<f32, Self>>,
    ) -> Result<Tensor<S, H::Elem, Self, T>, Self::Err>;
    /// A device error as a region error.
    #[doc(hidden)]
    fn region_error(e: Self::Err) -> RegionError;
}

pub(crate) mod sealed {
    /// Seals [`RegionDevice`](super::RegionDevice).
    pub trait Sealed {}
    impl Sealed for dfdx::tensor::Cpu {}
    #[cfg(feature = "cuda")]
    impl Sealed for dfdx::tensor::Cuda {}
}

/// Converts a half tensor's values to an f32 tensor of the same shape (exact widening).
fn widen<S: Shape, E: Precision<Elem = E> + Dtype, T>(
    x: &Tensor<S, E, Cpu, T>,
) -> Result<Tensor<S, f32, Cpu>, CpuError> {
    let n = x.shape().num_elements();
    let mut h = vec![E::default(); n];
    x.copy_into(&mut h);
    let mut v = vec![0.0f32; n];
    E::widen(&h, &mut v);
    x.device().try_tensor_from_vec(v, *x.shape())
}

impl<H: Precision> RegionDevice<H> for Cpu {
    fn enter<S: Shape, T: Tape<H::Elem, Cpu>>(
        x: Tensor<S, H::Elem, Cpu, T>,
        leaves: &mut Leaves<H::Elem, Cpu>,
    ) -> Result<(Traced32<S, Cpu>, T), CpuError> {
        // A permuted or broadcast input is first made contiguous inside the outer graph, so that
        // its gradient buffer and its logical values line up (mpx's op: its gradient summed in
        // f32, as the half ops' operands are).
        let (x, tape) = crate::nn::contiguous(x)?.split_tape();
        let n = x.shape().num_elements();
        let x32 = widen(&x)?;
        leaves.outer.push(x.try_reshape_like(&(n,))?);
        leaves.inner.push(x32.clone().try_reshape_like(&(n,))?);
        Ok((x32.leaky_traced(), tape))
    }

    fn widen_param<S: Shape>(
        t: &Tensor<S, H::Elem, Cpu>,
        trainable: bool,
        leaves: &mut Leaves<H::Elem, Cpu>,
    ) -> Result<Tensor<S, f32, Cpu>, CpuError> {
        let t32 = widen(t)?;
        if trainable {
            let n = t.shape().num_elements();
            leaves.outer.push(t.clone().try_reshape_like(&(n,))?);
            leaves.inner.push(t32.clone().try_reshape_like(&(n,))?);
        }
        Ok(t32)
    }

    fn bridge<S: Shape, T: Tape<H::Elem, Cpu>>(
        leaves: Leaves<H::Elem, Cpu>,
        mut tape: T,
        y32: Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
    ) -> Result<Tensor<S, H::Elem, Cpu, T>, CpuError> {
        let (y32, inner_tape) = y32.try_contiguous()?.split_tape();
        let dev = y32.device().clone();
        let shape = *y32.shape();
        let n = shape.num_elements();
        let mut v = vec![0.0f32; n];
        y32.copy_into(&mut v);
        let mut h = vec![H::Elem::default(); n];
        H::round(&v, &mut h);
        let y: Tensor<S, H::Elem, Cpu> = dev.try_tensor_from_vec(h, shape)?;
        if !T::OWNS_TAPE {
            return Ok(y.put_tape(tape));
        }
        let y_flat = y.clone().try_reshape_like(&(n,))?;
        let y32_flat = y32.try_reshape_like(&(n,))?;
        tape.add_backward_op(move |grads: &mut Gradients<H::Elem, Cpu>| {
            cpu_backward::<H>(grads, &leaves, &y_flat, &y32_flat, inner_tape)
        });
        Ok(y.put_tape(tape))
    }

    fn region_error(e: CpuError) -> RegionError {
        RegionError::Device(e)
    }
}

/// The region's backward op on the outer tape, on the host.
fn cpu_backward<H: Precision>(
    grads: &mut Gradients<H::Elem, Cpu>,
    leaves: &Leaves<H::Elem, Cpu>,
    y: &Flat<H::Elem>,
    y32: &Flat<f32>,
    mut inner_tape: OwnedTape<f32, Cpu>,
) -> Result<(), CpuError> {
    let n = y.shape().num_elements();
    // Output gradient, widened to f32.
    let mut g32 = vec![0.0f32; n];
    <H::Elem as Precision>::widen(grad_slice::<H::Elem>(grads.get_or_alloc_mut(y)?), &mut g32);

    // What each leaf's gradient holds already (widened). A tensor passed twice shares one
    // gradient entry: only its first occurrence carries that value, the others add to it.
    let mut first_of = Vec::with_capacity(leaves.outer.len());
    let mut buffers: Vec<*const H::Elem> = Vec::with_capacity(leaves.outer.len());
    let mut seeds: Vec<Option<Vec<f32>>> = Vec::with_capacity(leaves.outer.len());
    for (i, leaf) in leaves.outer.iter().enumerate() {
        let buf = grad_slice::<H::Elem>(grads.get_or_alloc_mut(leaf)?);
        let ptr = buf.as_ptr();
        if let Some(j) = buffers.iter().position(|p| *p == ptr && !buf.is_empty()) {
            first_of.push(first_of[j]);
            seeds.push(None);
        } else {
            first_of.push(i);
            let mut s = vec![0.0f32; buf.len()];
            <H::Elem as Precision>::widen(buf, &mut s);
            seeds.push(Some(s));
        }
        buffers.push(ptr);
    }

    // The seed op is added last, so it runs first of the region's own ops (after the VJP's
    // mul and sum): accumulation inside the region continues from the outer values.
    let inner_leaves = leaves.inner.clone();
    inner_tape.add_backward_op(move |g: &mut Gradients<f32, Cpu>| {
        for (leaf, seed) in inner_leaves.iter().zip(seeds) {
            if let Some(seed) = seed {
                let buf = g.get_or_alloc_mut(leaf)?;
                for (b, s) in buf.iter_mut().zip(seed) {
                    *b += s;
                }
            }
        }
        Ok(())
    });
    // The output's gradient, added last so that it runs first of all: `0 + g` into its fresh
    // buffer, what the backward of `sum(y32 * g)` would write there, without that product and
    // sum.
    let y32_id = y32.ghost();
    inner_tape.add_backward_op(move |g: &mut Gradients<f32, Cpu>| {
        let buf = g.get_or_alloc_mut(&y32_id)?;
        if buf.len() != g32.len() {
            return Err(CpuError::WrongNumElements);
        }
        buf.iter_mut().zip(&g32).for_each(|(b, s)| *b += *s);
        Ok(())
    });
    let anchor: Tensor<Rank0, f32, Cpu> = y32.device().try_zeros()?;
    let mut inner = anchor.put_tape(inner_tape).try_backward()?;

    // Sum per gradient entry in f32, then round once into the outer buffer.
    let mut sums: Vec<Option<Vec<f32>>> = vec![None; leaves.inner.len()];
    for (i, leaf) in leaves.inner.iter().enumerate() {
        let g = inner.get_or_alloc_mut(leaf)?;
        let j = first_of[i];
        match &mut sums[j] {
            Some(acc) => acc.iter_mut().zip(g.iter()).for_each(|(a, b)| *a += *b),
            None => sums[j] = Some(g.to_vec()),
        }
    }
    for (leaf, sum) in leaves.outer.iter().zip(sums) {
        if let Some(sum) = sum {
            let buf = grad_slice::<H::Elem>(grads.get_or_alloc_mut(leaf)?);
            H::round(&sum, buf);
        }
    }
    Ok(())
}

/// One or more half-precision tensors entering a region: a tensor, or a tuple (nested as deep as
/// you like) of tensors. Each tensor may carry its own tape; the tapes are merged into the first
/// one's, as dfdx's binary operations do.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot enter a float32 region: only tensors (or tuples of them) of the region's element type do",
    label = "an operation of the float32 list (`exp`, `sqrt`, `recip`, `softmax`, ..) on this value runs in an f32 region",
    note = "`#[half_forward]` and `#[autocast]` run the float32 list's methods in f32 regions by name, and cannot tell a number from a tensor by its name: for a number, call the method by path (`num_traits::Float::recip(s)`, `f32::exp(k)`), which they leave as written"
)]
pub trait RegionInput<E: Dtype, D: Storage<E> + Storage<f32> = Cpu> {
    /// The same tensors as f32, traced on the region's own tape.
    type Full;
    /// The outer tape the region's output carries.
    type Tape: Tape<E, D>;
    /// Splits the tapes off, makes the f32 copies and records the leaves.
    ///
    /// # Errors
    /// A device error (allocation) while making the f32 copies.
    fn enter(
        self,
        leaves: &mut Leaves<E, D>,
    ) -> Result<(Self::Full, Self::Tape), <D as HasErr>::Err>;
}

impl<S, E, D, T> RegionInput<E, D> for Tensor<S, E, D, T>
where
    S: Shape,
    E: Precision<Elem = E> + Dtype,
    D: RegionDevice<E>,
    T: Tape<E, D>,
{
    type Full = Tensor<S, f32, D, OwnedTape<f32, D>>;
    type Tape = T;
    fn enter(self, leaves: &mut Leaves<E, D>) -> Result<(Self::Full, T), D::Err> {
        D::enter(self, leaves)
    }
}

macro_rules! tuple_input {
    ($first:ident $(, $rest:ident)*) => {
        impl<E: Dtype, Dv: Storage<E> + Storage<f32>, $first: RegionInput<E, Dv> $(, $rest: RegionInput<E, Dv>)*> RegionInput<E, Dv>
            for ($first, $($rest,)*)
        where
            $($first::Tape: Merge<$rest::Tape>,)*
        {
            type Full = ($first::Full, $($rest::Full,)*);
            type Tape = $first::Tape;
            #[allow(non_snake_case)]
            fn enter(self, leaves: &mut Leaves<E, Dv>) -> Result<(Self::Full, Self::Tape), <Dv as HasErr>::Err> {
                let ($first, $($rest,)*) = self;
                let ($first, tape) = $first.enter(leaves)?;
                $(
                    let ($rest, t) = $rest.enter(leaves)?;
                    let tape = tape.merge(t);
                )*
                Ok((($first, $($rest,)*), tape))
            }
        }
    };
}
tuple_input!(A);
tuple_input!(A, B);
tuple_input!(A, B, C);
tuple_input!(A, B, C, D);
tuple_input!(A, B, C, D, F);
tuple_input!(A, B, C, D, F, G);

/// Walks a half module: builds its f32 copy and records each trainable parameter as a leaf.
struct Widen<'a, E: Dtype, D: Storage<E> + Storage<f32>> {
    leaves: &'a mut Leaves<E, D>,
}

/// The f32 copy keeps every setting of the module (a norm's `epsilon`, dropout's `p`): the
/// walk carries scalars as they are.
impl<E: Precision<Elem = E> + Dtype, D: RegionDevice<E> + Device<E>> Map<E, f32, D>
    for Widen<'_, E, D>
{
    type Error = D::Err;

    fn tensor<S: Shape>(
        &mut self,
        trainable: bool,
        t: &Tensor<S, E, D>,
    ) -> Result<Tensor<S, f32, D>, D::Err> {
        D::widen_param(t, trainable, self.leaves)
    }
}

/// Runs computations in f32 inside a graph of half type `H`: see the [module docs](self).
///
/// `H` is the caller's precision (`f16`, `AMP<f16>`, `bf16`, or `f32` for an identity bridge);
/// the region's output is rounded to it.
#[derive(Debug, Clone, Copy, Default)]
pub struct FullPrecision<H>(PhantomData<H>);

impl<H: Precision> FullPrecision<H> {
    /// Runs `f` on f32 copies of `x` (a tensor or a tuple of tensors) and returns its result in
    /// `H`, with the outer tape of `x`. See [`FullPrecision::try_run`] for the fallible form.
    ///
    /// # Panics
    /// On a device error (allocation), as dfdx's infallible operations do.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, region::FullPrecision};
    /// let dev = Cpu::default();
    /// let a: Tensor<Rank1<3>, f16, Cpu> = dev.tensor([1.0, 2.0, 3.0]).to_dtype::<f16>();
    /// let b: Tensor<Rank1<3>, f16, Cpu> = dev.tensor([4.0, 5.0, 6.0]).to_dtype::<f16>();
    /// // Two inputs as a tuple; the closure sees them as f32.
    /// let y = FullPrecision::<f16>::run((a.leaky_trace(), b.clone()), |(a, b)| a * b);
    /// let g = y.sum().backward();
    /// assert_eq!(g.get(&a).array(), [4.0, 5.0, 6.0].map(f16::from_f32));
    /// ```
    pub fn run<X, S, F, D>(x: X, f: F) -> Tensor<S, H::Elem, D, X::Tape>
    where
        D: RegionDevice<H>,
        X: RegionInput<H::Elem, D>,
        S: Shape,
        F: FnOnce(X::Full) -> Tensor<S, f32, D, OwnedTape<f32, D>>,
    {
        Self::try_run(x, f).unwrap()
    }

    /// Fallible form of [`FullPrecision::run`].
    ///
    /// # Errors
    /// The device's [`CpuError`] when it cannot allocate.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, region::FullPrecision};
    /// let dev = Cpu::default();
    /// let x: Tensor<Rank1<2>, f16, Cpu> = dev.tensor([1.0f32, 2.0]).to_dtype::<f16>();
    /// let y = FullPrecision::<f16>::try_run(x, |x| x.square())?;
    /// assert_eq!(y.array(), [1.0, 4.0].map(f16::from_f32));
    /// # Ok::<(), dfdx::tensor::CpuError>(())
    /// ```
    pub fn try_run<X, S, F, D>(x: X, f: F) -> Result<Half<S, H, D, X::Tape>, D::Err>
    where
        D: RegionDevice<H>,
        X: RegionInput<H::Elem, D>,
        S: Shape,
        F: FnOnce(X::Full) -> Tensor<S, f32, D, OwnedTape<f32, D>>,
    {
        Self::try_run_fallible(x, |x| Ok(f(x)))
    }

    /// [`FullPrecision::try_run`] with a closure that can fail (a module's `try_forward`): its
    /// error is returned as it is, and nothing is recorded on the input's tape.
    pub(crate) fn try_run_fallible<X, S, F, D>(x: X, f: F) -> Result<Half<S, H, D, X::Tape>, D::Err>
    where
        D: RegionDevice<H>,
        X: RegionInput<H::Elem, D>,
        S: Shape,
        F: FnOnce(X::Full) -> Result<Tensor<S, f32, D, OwnedTape<f32, D>>, D::Err>,
    {
        let mut leaves = Leaves::new();
        let (x32, tape) = x.enter(&mut leaves)?;
        let y32 = f(x32)?;
        <D as RegionDevice<H>>::bridge(leaves, tape, y32)
    }

    /// Like [`FullPrecision::run`], with a module (or any dfdx tensor collection) whose
    /// parameters the region uses: `f` receives an f32 copy of `params`, and the gradients of
    /// that copy's parameters are written to `params`' own gradient entries, in `H`.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, region::FullPrecision};
    /// let dev = Cpu::default();
    /// let ln = dev.build_module::<LayerNorm1D<4>, f16>();
    /// let x: Tensor<Rank2<2, 4>, f16, Cpu> =
    ///     dev.tensor([[40000.0, 40000.0, 1.0, 2.0], [1.0, 2.0, 3.0, 4.0]]).to_dtype::<f16>();
    /// let mut grads = ln.alloc_grads();
    /// let y = FullPrecision::<f16>::run_with(&ln, x.traced(grads), |ln, x| ln.forward(x));
    /// grads = y.square().sum().backward();
    /// assert!(grads.get(&ln.gamma).as_vec().iter().all(|g| g.is_finite()));
    /// assert!(grads.get(&ln.beta).as_vec().iter().any(|g| g.to_f32() != 0.0));
    /// ```
    ///
    /// # Panics
    /// Where [`FullPrecision::try_run_with`] returns an error: on a device error (allocation), or
    /// when `params`' `TensorCollection` impl does not rebuild it.
    pub fn run_with<M, X, S, F, D>(params: &M, x: X, f: F) -> Tensor<S, H::Elem, D, X::Tape>
    where
        D: RegionDevice<H> + RegionDevice<H::Elem> + Device<H::Elem>,
        M: TensorCollection<H::Elem, D>,
        X: RegionInput<H::Elem, D>,
        S: Shape,
        F: FnOnce(&M::To<f32, D>, X::Full) -> Tensor<S, f32, D, OwnedTape<f32, D>>,
    {
        Self::try_run_with(params, x, f).unwrap()
    }

    /// Fallible form of [`FullPrecision::run_with`].
    ///
    /// # Errors
    /// - [`RegionError::Device`]: the device cannot allocate;
    /// - [`RegionError::NotRebuilt`]: `params`' `TensorCollection` impl does not build its f32
    ///   copy (it returns `None` for a field).
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, region::FullPrecision};
    /// let dev = Cpu::default();
    /// let lin = dev.build_module::<Linear<2, 1>, f16>();
    /// let x: Tensor<Rank1<2>, f16, Cpu> = dev.tensor([1.0f32, 2.0]).to_dtype::<f16>();
    /// let y = FullPrecision::<f16>::try_run_with(&lin, x, |lin, x| lin.forward(x))?;
    /// assert!(y.array()[0].is_finite());
    /// # Ok::<(), mpx_runtime::region::RegionError>(())
    /// ```
    pub fn try_run_with<M, X, S, F, D>(
        params: &M,
        x: X,
        f: F,
    ) -> Result<Tensor<S, H::Elem, D, X::Tape>, RegionError>
    where
        D: RegionDevice<H> + RegionDevice<H::Elem> + Device<H::Elem>,
        M: TensorCollection<H::Elem, D>,
        X: RegionInput<H::Elem, D>,
        S: Shape,
        F: FnOnce(&M::To<f32, D>, X::Full) -> Tensor<S, f32, D, OwnedTape<f32, D>>,
    {
        Self::try_run_with_fallible(params, x, |p, x| Ok(f(p, x)))
    }

    /// [`FullPrecision::try_run_with`] with a closure that can fail (a module's `try_forward`),
    /// its error returned as a region error, and that may change the f32 copy (which is then
    /// dropped: [`FullPrecision::try_run_with_mut`] keeps what it changed).
    pub(crate) fn try_run_with_fallible<M, X, S, F, D>(
        params: &M,
        x: X,
        f: F,
    ) -> Result<Tensor<S, H::Elem, D, X::Tape>, RegionError>
    where
        D: RegionDevice<H> + RegionDevice<H::Elem> + Device<H::Elem>,
        M: TensorCollection<H::Elem, D>,
        X: RegionInput<H::Elem, D>,
        S: Shape,
        F: FnOnce(
            &mut M::To<f32, D>,
            X::Full,
        ) -> Result<Tensor<S, f32, D, OwnedTape<f32, D>>, D::Err>,
    {
        let err = <D as RegionDevice<H>>::region_error;
        let mut leaves = Leaves::new();
        let (x32, tape) = x.enter(&mut leaves).map_err(err)?;
        let mut widen = Widen {
            leaves: &mut leaves,
        };
        let p32 = crate::walk::map::<H::Elem, f32, D, M, _>(params, &mut widen).map_err(err)?;
        // `Widen` builds every tensor, but a third-party `TensorCollection` impl may still
        // return `None` for its own fields.
        let mut p32 = p32.ok_or(RegionError::NotRebuilt)?;
        let y32 = f(&mut p32, x32).map_err(err)?;
        <D as RegionDevice<H>>::bridge(leaves, tape, y32).map_err(err)
    }

    /// [`FullPrecision::try_run_with`] for a layer that changes its own state as it runs (a
    /// batch norm's running statistics, in training mode): `f` gets the f32 copy mutably and may
    /// fail, and what it left in the copy's non-trainable tensors is rounded back into
    /// `params`' own.
    pub(crate) fn try_run_with_mut<M, X, S, F, D>(
        params: &mut M,
        x: X,
        f: F,
    ) -> Result<Half<S, H, D, X::Tape>, RegionError>
    where
        D: RegionDevice<H> + RegionDevice<H::Elem> + Device<H::Elem> + Device<f32>,
        M: TensorCollection<H::Elem, D>,
        X: RegionInput<H::Elem, D>,
        S: Shape,
        F: FnOnce(
            &mut M::To<f32, D>,
            X::Full,
        ) -> Result<Tensor<S, f32, D, OwnedTape<f32, D>>, D::Err>,
        M::To<f32, D>: TensorCollection<f32, D>,
    {
        let mut state = State(Vec::new());
        let y = Self::try_run_with_fallible(&*params, x, |p32, x| {
            let y = f(p32, x)?;
            crate::walk::each(&*p32, &mut state, std::convert::identity)?;
            Ok(y)
        })?;
        let mut rounded = vec![H::Elem::default(); state.0.len()];
        H::round(&state.0, &mut rounded);
        let mut back = RoundBack::<H> {
            values: &rounded,
            at: 0,
        };
        crate::walk::each_mut(params, &mut back, <D as RegionDevice<H>>::region_error)?;
        // the copy was built from `params` by its own walk: the same tensors, of the same
        // lengths, in the same order; anything else is a `TensorCollection` impl that does not
        // rebuild what it visits
        if back.at == rounded.len() {
            Ok(y)
        } else {
            Err(RegionError::NotRebuilt)
        }
    }
}

/// The values of a module's non-trainable tensors, in visit order.
struct State(Vec<f32>);

impl<D: Device<f32>> crate::walk::Each<f32, D> for State {
    type Error = D::Err;
    fn tensor<S: Shape>(&mut self, trainable: bool, t: &Tensor<S, f32, D>) -> Result<(), D::Err> {
        if !trainable {
            self.0.extend(t.as_vec());
        }
        Ok(())
    }
}

/// Writes [`State`]'s values, rounded to `H`, into a module's non-trainable tensors, in visit
/// order.
struct RoundBack<'a, H: Precision> {
    values: &'a [H::Elem],
    at: usize,
}

impl<H: Precision, D: RegionDevice<H> + Device<H::Elem>> crate::walk::EachMut<H::Elem, D>
    for RoundBack<'_, H>
{
    type Error = RegionError;
    fn tensor<S: Shape>(
        &mut self,
        trainable: bool,
        t: &mut Tensor<S, H::Elem, D>,
    ) -> Result<(), RegionError> {
        if trainable {
            return Ok(());
        }
        let n = t.shape().num_elements();
        let values = self
            .values
            .get(self.at..self.at + n)
            .ok_or(RegionError::NotRebuilt)?;
        self.at += n;
        // `State` read the values in logical order: they go into a contiguous buffer (the
        // tensor's own when it is one)
        *t = t
            .clone()
            .try_contiguous()
            .map_err(<D as RegionDevice<H>>::region_error)?;
        t.copy_from(values);
        Ok(())
    }
}

/// A layer called inside a full-precision region, whose tensors are f32 copies: what
/// `#[full_precision]` (without `params`) checks each `self.<field>.forward(..)` of its body
/// against, so that a layer whose parameters are in the half type is an error that names the
/// fix.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::region::RegionLayer;
/// fn runs_in_f32<M: RegionLayer<Tensor<Rank1<2>, f32, Cpu>>>(_: &M) {}
/// runs_in_f32(&ReLU); // no parameters: fine in f32
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot run on the f32 tensors of a full-precision region",
    label = "its parameters are not f32",
    note = "inside `#[full_precision]` the tensors are f32 copies; name the layer whose parameters the region uses with `params = self.<field>`, and the region runs it on an f32 copy of them"
)]
pub trait RegionLayer<X> {
    /// The layer's output.
    type Output;
    /// The layer's error.
    type Error;
    /// `Module::try_forward`.
    ///
    /// # Errors
    /// The layer's.
    fn region_try_forward(&self, x: X) -> Result<Self::Output, Self::Error>;
}

impl<M: dfdx::nn::Module<X>, X> RegionLayer<X> for M {
    type Output = M::Output;
    type Error = M::Error;
    fn region_try_forward(&self, x: X) -> Result<M::Output, M::Error> {
        self.try_forward(x)
    }
}
