//! The one walk of a dfdx module: every tensor in `TensorCollection` order, with its trainable
//! flag, and every scalar setting (a norm's `epsilon`, dropout's `p`, a user's own field). dfdx
//! hands a module's parts to a `TensorVisitor`; the three adapters here are the crate's only
//! visitors of an existing module, so each walk states only its own work:
//!
//! | walk | what it sees | what it gives back |
//! |---|---|---|
//! | [`Each`] / [`each`] | `&Tensor`, each scalar as `f64` | nothing |
//! | [`EachMut`] / [`each_mut`] | `&mut Tensor` | nothing (the tensors changed in place) |
//! | [`Map`] / [`map`] | `&Tensor` | the module in another element type, every scalar as it is |
//!
//! (A working copy built from nothing, by position, is the one other visitor:
//! `step::half_layers`' `Fill`.)

use dfdx::nn::tensor_collection::{
    RecursiveWalker, ScalarOptions, TensorCollection, TensorOptions, TensorVisitor, ViewTensorMut,
    ViewTensorRef,
};
use dfdx::shapes::{Dtype, Shape};
use dfdx::tensor::Tensor;
use dfdx::tensor_ops::Device;
use num_traits::NumCast;

/// A read-only walk: what it does with each tensor and each scalar setting, in visit order.
pub(crate) trait Each<E: Dtype, D: Device<E>> {
    /// What stops the walk.
    type Error;
    /// One tensor; `trainable`: whether optimizers update it (else it is state, such as batch
    /// norm's running statistics).
    fn tensor<S: Shape>(&mut self, trainable: bool, t: &Tensor<S, E, D>)
    -> Result<(), Self::Error>;
    /// One scalar setting, as `f64` (NaN for a value `f64` cannot hold); ignored by default.
    fn scalar(&mut self, value: f64) -> Result<(), Self::Error> {
        let _ = value;
        Ok(())
    }
}

/// A read or write walk between dfdx and the walk: the walk, and its first error (dfdx's
/// visitor can only stop on a device error, so a walk's own error is kept and the rest of the
/// tensors skipped).
struct Stash<'a, W, Err, Marker> {
    walk: &'a mut W,
    failed: Option<Err>,
    marker: std::marker::PhantomData<fn() -> Marker>,
}

impl<'a, W, Err, Marker> Stash<'a, W, Err, Marker> {
    fn new(walk: &'a mut W) -> Self {
        Self {
            walk,
            failed: None,
            marker: std::marker::PhantomData,
        }
    }

    /// Runs `f` on the walk unless it failed already.
    fn run(&mut self, f: impl FnOnce(&mut W) -> Result<(), Err>) {
        if self.failed.is_none()
            && let Err(e) = f(self.walk)
        {
            self.failed = Some(e);
        }
    }

    /// What the walk ended with.
    fn finish(self) -> Result<(), Err> {
        self.failed.map_or(Ok(()), Err)
    }
}

/// Marks a [`Stash`] of an [`Each`] walk.
enum Reads {}
/// Marks a [`Stash`] of an [`EachMut`] walk.
enum Writes {}

impl<W: Each<E, D>, E: Dtype, D: Device<E>> TensorVisitor<E, D>
    for Stash<'_, W, W::Error, (Reads, E, D)>
{
    type Viewer = ViewTensorRef;
    type Err = D::Err;
    type E2 = E;
    type D2 = D;
    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, E, D>,
        t: &Tensor<S, E, D>,
    ) -> Result<Option<Tensor<S, E, D>>, D::Err> {
        self.run(|w| w.tensor(opts.do_gradient_update, t));
        Ok(None)
    }
    fn visit_scalar<N: NumCast>(
        &mut self,
        _: ScalarOptions<N>,
        value: &N,
    ) -> Result<Option<N>, D::Err> {
        self.run(|w| w.scalar(value.to_f64().unwrap_or(f64::NAN)));
        Ok(None)
    }
}

impl<W: EachMut<E, D>, E: Dtype, D: Device<E>> TensorVisitor<E, D>
    for Stash<'_, W, W::Error, (Writes, E, D)>
{
    type Viewer = ViewTensorMut;
    type Err = D::Err;
    type E2 = E;
    type D2 = D;
    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, E, D>,
        t: &mut Tensor<S, E, D>,
    ) -> Result<Option<Tensor<S, E, D>>, D::Err> {
        self.run(|w| w.tensor(opts.do_gradient_update, t));
        Ok(None)
    }
}

/// Hands every tensor and scalar of `m` to `walk`, in visit order, until `walk` returns an
/// error; `err` converts a device error of the walker itself.
pub(crate) fn each<E, D, M, W>(
    m: &M,
    walk: &mut W,
    err: fn(D::Err) -> W::Error,
) -> Result<(), W::Error>
where
    E: Dtype,
    D: Device<E>,
    M: TensorCollection<E, D>,
    W: Each<E, D>,
{
    let mut stash = Stash::<_, _, (Reads, E, D)>::new(walk);
    M::iter_tensors(&mut RecursiveWalker { m, f: &mut stash }).map_err(err)?;
    stash.finish()
}

/// A walk that changes tensors in place, in visit order.
pub(crate) trait EachMut<E: Dtype, D: Device<E>> {
    /// What stops the walk.
    type Error;
    /// One tensor (see [`Each::tensor`]).
    fn tensor<S: Shape>(
        &mut self,
        trainable: bool,
        t: &mut Tensor<S, E, D>,
    ) -> Result<(), Self::Error>;
}

/// Hands every tensor of `m` to `walk` to change, in visit order, until it returns an error.
pub(crate) fn each_mut<E, D, M, W>(
    m: &mut M,
    walk: &mut W,
    err: fn(D::Err) -> W::Error,
) -> Result<(), W::Error>
where
    E: Dtype,
    D: Device<E>,
    M: TensorCollection<E, D>,
    W: EachMut<E, D>,
{
    let mut stash = Stash::<_, _, (Writes, E, D)>::new(walk);
    M::iter_tensors(&mut RecursiveWalker { m, f: &mut stash }).map_err(err)?;
    stash.finish()
}

/// A walk that builds the module again in element type `E2`: each tensor mapped, each scalar
/// setting carried as it is ([`copy_scalar`]).
pub(crate) trait Map<E: Dtype, E2: Dtype, D: Device<E> + Device<E2>> {
    /// What stops the walk (a device error included).
    type Error;
    /// One tensor's counterpart (see [`Each::tensor`] for `trainable`).
    fn tensor<S: Shape>(
        &mut self,
        trainable: bool,
        t: &Tensor<S, E, D>,
    ) -> Result<Tensor<S, E2, D>, Self::Error>;
}

/// `m` rebuilt by `walk` (see [`Map`]); `None` when a hand-written `TensorCollection` impl does
/// not rebuild the module (it returns `None` for a field).
pub(crate) fn map<E, E2, D, M, W>(m: &M, walk: &mut W) -> Result<Option<M::To<E2, D>>, W::Error>
where
    E: Dtype,
    E2: Dtype,
    D: Device<E> + Device<E2>,
    M: TensorCollection<E, D>,
    W: Map<E, E2, D>,
{
    struct Adapter<'a, W, E2>(&'a mut W, std::marker::PhantomData<E2>);
    impl<W: Map<E, E2, D>, E: Dtype, E2: Dtype, D: Device<E> + Device<E2>> TensorVisitor<E, D>
        for Adapter<'_, W, E2>
    {
        type Viewer = ViewTensorRef;
        type Err = W::Error;
        type E2 = E2;
        type D2 = D;
        fn visit<S: Shape>(
            &mut self,
            opts: TensorOptions<S, E, D>,
            t: &Tensor<S, E, D>,
        ) -> Result<Option<Tensor<S, E2, D>>, W::Error> {
            self.0.tensor(opts.do_gradient_update, t).map(Some)
        }
        fn visit_scalar<N: NumCast>(
            &mut self,
            opts: ScalarOptions<N>,
            value: &N,
        ) -> Result<Option<N>, W::Error> {
            Ok(Some(copy_scalar(value).unwrap_or(opts.default)))
        }
    }
    M::iter_tensors(&mut RecursiveWalker {
        m,
        f: &mut Adapter(walk, std::marker::PhantomData),
    })
}

/// A copy of a module's scalar setting (dfdx hands it to a visitor as `&N` with `N: NumCast`,
/// which is not `Clone`): exact for integers and for `f32` / `f64` / `f16` values; `None` only
/// for a value `N` cannot hold as `f64` or `i128`.
///
/// # Examples
/// ```
/// use mpx_runtime::cast::copy_scalar;
/// assert_eq!(copy_scalar(&0.2f64), Some(0.2));
/// assert_eq!(copy_scalar(&1e-5f32), Some(1e-5f32));
/// assert_eq!(copy_scalar(&u64::MAX), Some(u64::MAX));
/// assert_eq!(copy_scalar(&-3i32), Some(-3));
/// ```
pub fn copy_scalar<N: NumCast>(value: &N) -> Option<N> {
    // an integer-valued number through i128 (exact for every integer type), else through f64
    // (exact for every float type mpx meets)
    if let Some(i) = value.to_i128()
        && let Some(n) = N::from(i)
        && n.to_f64() == value.to_f64()
    {
        return Some(n);
    }
    N::from(value.to_f64()?)
}
