//! [`GradScaler`]: the one state object of mixed-precision training, kept across steps.

use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;

use dfdx::nn::tensor_collection::{RecursiveWalker, TensorCollection};
use dfdx::optim::{Optimizer, OptimizerUpdateError};
use dfdx::shapes::Rank0;
use dfdx::tensor::{AsArray, Cpu, Gradients, HasErr, OwnedTape, Tensor};

use super::device::MixedDevice;
use super::error::StepError;
use super::half_region::{HalfInput, HalfOutput, Region};
use super::layout::{WorkingCopy, WriteState, first_device};
use super::mapped::HalfLayers;
use super::masters::Masters;
use super::outcome::{SkipReason, UpdateOutcome};
use super::report::StepReport;
use super::working::{Kind, Mapped, Same, Working, WorkspaceOn};
use crate::boundary::MasterModel;
use crate::precision::{Precision, f16};
use crate::scaling::{DynamicLossScale, LossScale};

/// The state of mixed-precision training, kept across steps like PyTorch's `GradScaler`: the
/// loss scale, the half working copy of the master and its gradient buffers, the skip counters
/// and the optional limit on consecutive skips, and what the last step did.
///
/// Declare it once, outside the training loop (a local before the loop, a field of the struct
/// that owns the model, or a parameter), and name it in `#[mixed_step(scaling = ..)]`; or call
/// its methods by hand:
///
/// | f32 dfdx step | mixed step, by hand |
/// |---|---|
/// | `let y = model.forward_mut(x.traced(grads));` | `let y = scaler.forward(&model, x.traced(grads), \|m, x\| m.forward_mut(x));` |
/// | `grads = loss.backward();` | `grads = scaler.backward(loss);` |
/// | `opt.update(&mut model, &grads)?;` | `scaler.update(&mut model, &mut opt, &grads)?;` |
///
/// * [`forward`](Self::forward) runs the model's forward pass on the half working copy (cast
///   from the master, in place, at most once per step), with the traced f32 input rounded to
///   `H` and the output widened back to f32: the loss and everything else stays f32 code.
/// * [`backward`](Self::backward) runs the f32 backward; where the gradient enters the half
///   graph it is multiplied by the loss scale, and the working copy's gradients come back
///   unscaled (with the scale that was applied) and added to the master's f32 gradients, which
///   are checked for finiteness. Gradients accumulate over several backward calls, as in dfdx.
///   mpx's fused layers ([`nn::Linear`](crate::nn::Linear), [`nn::LinearReLU`](crate::nn::LinearReLU))
///   skip the half gradient: they write theirs in f32 straight into the master's, unscaled and
///   checked in the same pass.
/// * [`update`](Self::update) runs the optimizer only when every backward since the last update
///   was finite (gradients and loss), then adjusts the loss scale once; a skipped step leaves the
///   master and the optimizer state untouched.
///
/// `H` is the half precision (`f16`, `AMP<f16>`, emulated `bf16`, or `f32` to check the
/// machinery), `L` the loss scale. One scaler serves any number of master models (a working copy
/// each, each update skipped on its own master's gradients, the scale adjusted once per
/// iteration: see `docs/dsl.md`).
///
/// # Examples
/// ```
/// use dfdx::{optim::*, prelude::*};
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::scaling::DynamicLossScale;
/// use mpx_runtime::step::GradScaler;
///
/// let dev: Cpu = Default::default();
/// type Mlp = (Linear<4, 8>, ReLU, Linear<8, 2>);
/// let mut model = dev.build_module::<Mlp, f32>();
/// let mut opt = Adam::new(&model, AdamConfig::default());
/// let mut scaler = GradScaler::<f16>::new(DynamicLossScale::default());
/// let mut grads = model.alloc_grads();
/// let x: Tensor<Rank2<3, 4>, f32, _> = dev.sample_normal();
/// let y: Tensor<Rank2<3, 2>, f32, _> = dev.sample_normal();
/// for _ in 0..3 {
///     let out = scaler.forward(&model, x.trace(grads), |m, x| m.forward(x));
///     let loss = mse_loss(out, y.clone()); // f32
///     grads = scaler.backward(loss);
///     scaler.update(&mut model, &mut opt, &grads)?;
///     model.zero_grads(&mut grads);
/// }
/// let last = scaler.last_step().unwrap();
/// assert!(last.is_applied() && last.loss.is_finite());
/// assert_eq!(scaler.applied_steps(), 3);
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
pub struct GradScaler<H: Precision = f16, L: LossScale = DynamicLossScale> {
    pub(super) scaling: L,
    masters: Masters,
    pub(super) max_consecutive_skips: Option<u64>,
    pub(super) applied: u64,
    pub(super) skipped: u64,
    pub(super) consecutive: u64,
    last: Option<StepReport>,
    marker: PhantomData<fn() -> H>,
    /// The data-parallel all-reduce (`with_reducer`, in `crate::distributed`).
    #[cfg(feature = "mpi")]
    pub(crate) reducer: Option<crate::distributed::Reducer>,
}

impl<H: Precision, L: LossScale> std::fmt::Debug for GradScaler<H, L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradScaler")
            .field("precision", &H::DTYPE.name())
            .field("loss_scale", &self.scaling.loss_scale())
            .field("applied_steps", &self.applied)
            .field("skipped_steps", &self.skipped)
            .field("consecutive_skips", &self.consecutive)
            .field("max_consecutive_skips", &self.max_consecutive_skips)
            .field("last_step", &self.last)
            .finish_non_exhaustive()
    }
}

impl<H: Precision, L: LossScale> GradScaler<H, L> {
    /// A scaler with the given loss scale (`DynamicLossScale`, `StaticLossScale` or
    /// `NoOpLossScale`). Buffers are allocated on the first forward pass.
    ///
    /// The first scaler of a process also allocates a 16 MiB block and frees it at once, without
    /// writing to it, so that glibc's `malloc` keeps freed memory below that size for reuse
    /// instead of returning it to the system: the tensors a step hands to dfdx, which dfdx frees,
    /// then do not fault their pages in again every step (see `nn/scratch.rs`).
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::precision::bf16;
    /// use mpx_runtime::scaling::NoOpLossScale;
    /// use mpx_runtime::step::GradScaler;
    /// let scaler = GradScaler::<bf16, _>::new(NoOpLossScale);
    /// assert_eq!(scaler.loss_scale(), 1.0);
    /// ```
    pub fn new(scaling: L) -> Self {
        crate::nn::scratch::keep_freed_memory();
        Self {
            scaling,
            masters: Masters::default(),
            max_consecutive_skips: None,
            applied: 0,
            skipped: 0,
            consecutive: 0,
            last: None,
            marker: PhantomData,
            #[cfg(feature = "mpi")]
            reducer: None,
        }
    }

    /// Sets a limit on consecutive skipped steps: the `(limit + 1)`-th skip in a row makes
    /// [`update`](Self::update) return [`StepError::TooManySkips`] (master and optimizer still
    /// untouched). Off by default (optax's `apply_if_finite(max_consecutive_errors)` applies the
    /// bad update at that point instead; PyTorch has no limit).
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::step::GradScaler;
    /// let scaler = GradScaler::<mpx_runtime::precision::f16>::default().with_max_consecutive_skips(10);
    /// assert_eq!(scaler.max_consecutive_skips(), Some(10));
    /// ```
    #[must_use]
    pub fn with_max_consecutive_skips(mut self, limit: u64) -> Self {
        self.max_consecutive_skips = Some(limit);
        self
    }

    /// The limit set with [`with_max_consecutive_skips`](Self::with_max_consecutive_skips).
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::step::GradScaler;
    /// assert_eq!(GradScaler::<mpx_runtime::precision::f16>::default().max_consecutive_skips(), None);
    /// ```
    pub fn max_consecutive_skips(&self) -> Option<u64> {
        self.max_consecutive_skips
    }

    /// The loss scale the next backward pass applies (PyTorch's `get_scale()`).
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::scaling::StaticLossScale;
    /// use mpx_runtime::step::GradScaler;
    /// let s = GradScaler::<mpx_runtime::precision::f16, _>::new(StaticLossScale::new(128.0).unwrap());
    /// assert_eq!(s.loss_scale(), 128.0);
    /// ```
    pub fn loss_scale(&self) -> f32 {
        self.scaling.loss_scale()
    }

    /// The loss-scale object (to save its state, for example).
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::step::GradScaler;
    /// let s = GradScaler::<mpx_runtime::precision::f16>::default();
    /// assert_eq!(s.scaling().loss_scale(), s.loss_scale());
    /// ```
    pub fn scaling(&self) -> &L {
        &self.scaling
    }

    /// The loss-scale object, mutably (to restore its state, for example).
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::scaling::{DynamicLossScale, LossScale};
    /// use mpx_runtime::step::GradScaler;
    /// let mut s = GradScaler::<mpx_runtime::precision::f16>::default();
    /// *s.scaling_mut() = DynamicLossScale::builder().initial(8.0).build().unwrap();
    /// assert_eq!(s.loss_scale(), 8.0);
    /// ```
    pub fn scaling_mut(&mut self) -> &mut L {
        &mut self.scaling
    }

    /// What the last [`update`](Self::update) did: loss, finiteness, the scale applied and the
    /// next one, applied or skipped. `None` before the first update.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::step::GradScaler;
    /// assert!(GradScaler::<mpx_runtime::precision::f16>::default().last_step().is_none());
    /// ```
    pub fn last_step(&self) -> Option<StepReport> {
        self.last
    }

    /// Updates applied so far.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::step::GradScaler;
    /// assert_eq!(GradScaler::<mpx_runtime::precision::f16>::default().applied_steps(), 0);
    /// ```
    pub fn applied_steps(&self) -> u64 {
        self.applied
    }

    /// Updates skipped so far (non-finite gradients or loss).
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::step::GradScaler;
    /// assert_eq!(GradScaler::<mpx_runtime::precision::f16>::default().skipped_steps(), 0);
    /// ```
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// Updates skipped in a row, up to the last one.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::step::GradScaler;
    /// assert_eq!(GradScaler::<mpx_runtime::precision::f16>::default().consecutive_skips(), 0);
    /// ```
    pub fn consecutive_skips(&self) -> u64 {
        self.consecutive
    }

    /// Runs a model's forward pass in half precision: `f` gets the working copy of `master`
    /// (cast in place when the master may have changed since) and `input` rounded to `H` on a
    /// half tape; its output comes back widened to f32, on the input's f32 tape. The input is
    /// what an f32 step passes (`x.traced(grads)`, an integer tensor of token ids, a tuple); the
    /// output may be a tensor, a tuple of tensors or the `Result` of a `try_forward`.
    ///
    /// # Panics
    /// When the device cannot allocate, as dfdx's infallible operations do; see
    /// [`try_forward`](Self::try_forward).
    ///
    /// # Examples
    /// See [`GradScaler`].
    pub fn forward<M, X, Y, F, D>(&mut self, master: &M, input: X, f: F) -> Y::Full
    where
        D: MixedDevice<H>,
        M: MasterModel<D> + 'static,
        WorkingCopy<H, M, D>: TensorCollection<H::Elem, D> + WorkspaceOn<D>,
        X: HalfInput<H, D>,
        Y: HalfOutput<H, D>,
        F: FnOnce(&mut WorkingCopy<H, M, D>, X::Half) -> Y,
    {
        match self.try_forward(master, input, f) {
            Ok(y) => y,
            Err(e) => panic!("mixed-precision forward pass failed: {e}"),
        }
    }

    /// Fallible form of [`forward`](Self::forward).
    ///
    /// # Errors
    /// [`StepError::Device`] when the device cannot allocate, [`StepError::InvalidScale`] for a
    /// loss scale that is not finite and positive or whose reciprocal is not finite.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, step::GradScaler};
    /// let dev: Cpu = Default::default();
    /// let model = dev.build_module::<Linear<2, 2>, f32>();
    /// let mut scaler = GradScaler::<f16>::default();
    /// let x = dev.tensor([[1.0f32, 2.0]]);
    /// let y = scaler.try_forward(&model, x.leaky_trace(), |m, x| m.forward(x))?;
    /// assert_eq!(y.array()[0].len(), 2); // f32 again
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn try_forward<M, X, Y, F, D>(
        &mut self,
        master: &M,
        input: X,
        f: F,
    ) -> Result<Y::Full, StepError>
    where
        D: MixedDevice<H>,
        M: MasterModel<D> + 'static,
        WorkingCopy<H, M, D>: TensorCollection<H::Elem, D> + WorkspaceOn<D>,
        X: HalfInput<H, D>,
        Y: HalfOutput<H, D>,
        F: FnOnce(&mut WorkingCopy<H, M, D>, X::Half) -> Y,
    {
        self.run::<M, Same, X, Y, F, D>(master, input, f)
    }

    /// Runs a model's forward pass in half precision on its working copy made of mpx's layers
    /// ([`HalfLayers`]): the same as [`forward`](Self::forward), but each dfdx `Linear` of
    /// `master` runs as mpx's fused [`nn::Linear`](crate::nn::Linear) (mpx's GEMM with f32
    /// sums, weight and bias gradients written in f32 straight into the master's), and its
    /// layer norms, attention and transformer encoder blocks as [`mpx::nn`](crate::nn)'s. The model's
    /// type does not change; `#[mixed_step]` picks this wherever the model implements
    /// [`HalfLayers`]. A master runs through one of the two working copies: running it through
    /// both with one scaler is an error ([`StepError::WorkspaceMismatch`]).
    ///
    /// # Panics
    /// When the device cannot allocate, as dfdx's infallible operations do; see
    /// [`try_forward_mapped`](Self::try_forward_mapped).
    ///
    /// # Examples
    /// ```
    /// use dfdx::{optim::*, prelude::*};
    /// use mpx_runtime::{precision::f16, step::GradScaler};
    /// let dev: Cpu = Default::default();
    /// let mut model = dev.build_module::<(Linear<4, 8>, ReLU, Linear<8, 2>), f32>();
    /// let mut opt = Sgd::new(&model, Default::default());
    /// let mut scaler = GradScaler::<f16>::default();
    /// let x: Tensor<Rank2<3, 4>, f32, _> = dev.sample_normal();
    /// let y = scaler.forward_mapped(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x));
    /// let grads = scaler.backward(y.square().mean());
    /// assert!(scaler.update(&mut model, &mut opt, &grads)?.is_applied());
    /// assert!(scaler.last_step().unwrap().mpx_layers);
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn forward_mapped<M, X, Y, F>(&mut self, master: &M, input: X, f: F) -> Y::Full
    where
        M: HalfLayers<H> + Send + Sync + 'static,
        Cpu: MixedDevice<H>,
        X: HalfInput<H>,
        Y: HalfOutput<H>,
        F: FnOnce(&mut M::Working, X::Half) -> Y,
    {
        match self.try_forward_mapped(master, input, f) {
            Ok(y) => y,
            Err(e) => panic!("mixed-precision forward pass failed: {e}"),
        }
    }

    /// Fallible form of [`forward_mapped`](Self::forward_mapped).
    ///
    /// # Errors
    /// As [`try_forward`](Self::try_forward); [`StepError::WorkspaceMismatch`] when this scaler
    /// already ran `master` through its plain working copy.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, step::GradScaler};
    /// let dev: Cpu = Default::default();
    /// let model = dev.build_module::<(Linear<2, 3>, Tanh), f32>();
    /// let mut scaler = GradScaler::<f16>::default();
    /// let x = dev.tensor([[1.0f32, 2.0]]);
    /// let y = scaler.try_forward_mapped(&model, x.leaky_trace(), |m, x| m.forward(x))?;
    /// assert_eq!(y.array()[0].len(), 3);
    /// // the same master through the plain working copy: an error, not stale data
    /// assert!(scaler.try_forward(&model, x.leaky_trace(), |m, x| m.forward(x)).is_err());
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn try_forward_mapped<M, X, Y, F>(
        &mut self,
        master: &M,
        input: X,
        f: F,
    ) -> Result<Y::Full, StepError>
    where
        M: HalfLayers<H> + Send + Sync + 'static,
        Cpu: MixedDevice<H>,
        X: HalfInput<H>,
        Y: HalfOutput<H>,
        F: FnOnce(&mut M::Working, X::Half) -> Y,
    {
        self.run::<M, Mapped, X, Y, F, Cpu>(master, input, f)
    }

    /// A forward pass on the working copy of kind `K`.
    fn run<M, K, X, Y, F, D>(&mut self, master: &M, input: X, f: F) -> Result<Y::Full, StepError>
    where
        D: MixedDevice<H>,
        M: MasterModel<D> + 'static,
        K: Kind<H, M, D>,
        X: HalfInput<H, D>,
        Y: HalfOutput<H, D>,
        F: FnOnce(&mut K::Copy, X::Half) -> Y,
    {
        let (scale, inv) = self.checked_scale()?;
        let dev = master_device::<H, D, M>(master)?;
        D::ready(&dev)?;
        let i = self
            .masters
            .find_or_insert::<D, M>(master, D::step_error, |m| {
                Ok(K::hold(Working::<H, M, K, D>::new(m)?))
            })?;
        let workspace = &mut *self.masters.get_mut(i).working;
        let (mapped, f32_run) = (workspace.mapped(), workspace.in_f32());
        let mut job = Some((input, f, dev));
        let mut out = None;
        workspace.with_any(&mut |any| {
            let working = typed::<H, M, K, D>(any, mapped, f32_run)?;
            if let Some((input, f, dev)) = job.take() {
                out = Some(run_on(working, master, dev, scale, inv, input, f)?);
            }
            Ok(())
        })?;
        out.ok_or(StepError::Cast(crate::cast::CastError::NotRebuilt))
    }

    /// The scale to apply and its reciprocal (the loss scale's own `inv_loss_scale`), both
    /// checked.
    fn checked_scale(&self) -> Result<(f32, f32), StepError> {
        let scale = self.scaling.loss_scale();
        let inv = self.scaling.inv_loss_scale();
        if scale.is_finite() && scale > 0.0 && inv.is_finite() && inv > 0.0 {
            Ok((scale, inv))
        } else {
            Err(StepError::InvalidScale { scale })
        }
    }
    /// Runs the backward pass of an f32 `loss` whose graph went through
    /// [`forward`](Self::forward): the master's f32 gradients (the `Gradients` the input was
    /// traced with) come back with the working copy's gradients added, unscaled with the scale
    /// that was applied, and checked for finiteness. The loss value and the check are kept
    /// for the next [`update`](Self::update).
    ///
    /// # Panics
    /// When the device cannot allocate or the workspace does not match the model, as dfdx's
    /// `backward` panics on device errors; see [`try_backward`](Self::try_backward).
    ///
    /// # Examples
    /// See [`GradScaler`].
    pub fn backward<D: MixedDevice<H>>(
        &mut self,
        loss: Tensor<Rank0, f32, D, OwnedTape<f32, D>>,
    ) -> Gradients<f32, D> {
        match self.try_backward(loss) {
            Ok(g) => g,
            Err(e) => panic!("mixed-precision backward pass failed: {e}"),
        }
    }

    /// Fallible form of [`backward`](Self::backward).
    ///
    /// # Errors
    /// [`StepError::Device`] when the device cannot allocate, [`StepError::WorkspaceMismatch`]
    /// when the gradients do not belong to the model the forward pass ran.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, step::GradScaler};
    /// let dev: Cpu = Default::default();
    /// let model = dev.build_module::<Linear<2, 1>, f32>();
    /// let mut scaler = GradScaler::<f16>::default();
    /// let x = dev.tensor([[0.5f32, -1.0]]);
    /// let y = scaler.forward(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x));
    /// let grads = scaler.try_backward(y.sum())?;
    /// // d(sum(W x + b))/db = 1, unscaled
    /// assert_eq!(grads.get(&model.bias).array(), [1.0]);
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn try_backward<D: MixedDevice<H>>(
        &mut self,
        loss: Tensor<Rank0, f32, D, OwnedTape<f32, D>>,
    ) -> Result<Gradients<f32, D>, StepError> {
        let backward = dfdx::tensor_ops::Backward::try_backward;
        self.try_backward_with(loss, |l| backward(l).map_err(D::step_error))
    }

    /// [`try_backward`](Self::try_backward) with the backward call given as a closure (what
    /// `#[mixed_step]` generates, so the step's own `loss.backward()` runs): `backward` gets
    /// the loss and returns the gradients the input was traced with.
    ///
    /// # Errors
    /// As [`try_backward`](Self::try_backward); an error of `backward` itself is
    /// [`StepError::Device`].
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, step::GradScaler};
    /// let dev: Cpu = Default::default();
    /// let model = dev.build_module::<Linear<2, 1>, f32>();
    /// let mut scaler = GradScaler::<f16>::default();
    /// let x = dev.tensor([[0.5f32, -1.0]]);
    /// let y = scaler.forward(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x));
    /// let grads = scaler.try_backward_with(y.sum(), |loss| loss.try_backward())?;
    /// assert_eq!(grads.get(&model.bias).array(), [1.0]);
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn try_backward_with<T, F, E, D>(
        &mut self,
        loss: T,
        backward: F,
    ) -> Result<Gradients<f32, D>, StepError>
    where
        D: MixedDevice<H>,
        T: AsArray<Array = f32>,
        F: FnOnce(T) -> Result<Gradients<f32, D>, E>,
        StepError: From<E>,
    {
        let loss_value = loss.array();
        let mut grads = backward(loss)?;
        let scale = self.scaling.loss_scale();
        let mut touched = 0;
        for entry in self.masters.iter_mut() {
            let Some(grads_finite) = entry.working.transfer(&mut grads as &mut dyn Any)? else {
                entry.touched = false;
                continue;
            };
            entry.touched = true;
            touched += 1;
            let p = &mut entry.pending;
            p.backwards += 1;
            p.grads_finite_before = p.grads_finite;
            p.grads_finite &= grads_finite;
            p.loss_finite &= loss_value.is_finite();
            p.loss = loss_value;
            p.scale = scale;
        }
        if touched > 1 {
            // Several masters in one graph (a generator trained through the discriminator):
            // as in the f32 step, `grads` keeps only the gradients of its own leaves (those
            // `alloc_grads` made it for), and each master is judged on what remains of its own.
            grads.drop_non_leafs();
            for entry in self.masters.iter_mut().filter(|e| e.touched) {
                let finite = entry.working.check(&mut grads as &mut dyn Any)?;
                entry.pending.grads_finite = entry.pending.grads_finite_before && finite;
            }
            grads.drop_non_leafs();
        }
        #[cfg(feature = "mpi")]
        {
            let any: &mut dyn Any = &mut grads;
            match any.downcast_mut::<Gradients<f32, Cpu>>() {
                Some(g) => self.reduce(g, loss_value.is_finite())?,
                None if self.reducer.is_some() => {
                    return Err(StepError::WorkspaceMismatch {
                        expected: "gradients on the `Cpu` under a data-parallel reducer".into(),
                        found: std::any::type_name::<D>().into(),
                    });
                }
                None => {}
            }
        }
        Ok(grads)
    }

    /// [`backward`](Self::backward) with the backward call given as a closure (what
    /// `#[mixed_step]` generates for `loss.backward()`).
    ///
    /// # Panics
    /// As [`backward`](Self::backward).
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, step::GradScaler};
    /// let dev: Cpu = Default::default();
    /// let model = dev.build_module::<Linear<2, 1>, f32>();
    /// let mut scaler = GradScaler::<f16>::default();
    /// let x = dev.tensor([[0.5f32, -1.0]]);
    /// let y = scaler.forward(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x));
    /// let grads = scaler.backward_with(y.sum(), |loss| loss.backward());
    /// assert_eq!(grads.get(&model.bias).array(), [1.0]);
    /// ```
    pub fn backward_with<T, F, D>(&mut self, loss: T, backward: F) -> Gradients<f32, D>
    where
        D: MixedDevice<H>,
        T: AsArray<Array = f32>,
        F: FnOnce(T) -> Gradients<f32, D>,
    {
        match self.try_backward_with(loss, |l| Ok::<_, StepError>(backward(l))) {
            Ok(g) => g,
            Err(e) => panic!("mixed-precision backward pass failed: {e}"),
        }
    }

    /// Updates the f32 master with any dfdx optimizer, only when every backward pass since the
    /// last update was finite (gradients and loss); otherwise the optimizer does not run at
    /// all, so master weights and optimizer state stay bit-identical. Then the loss scale is
    /// adjusted once (a skipped step never counts toward growth), and [`last_step`](Self::last_step)
    /// records what happened. Non-parameter state the half forward pass changed (batch-norm
    /// running statistics) is copied into the master when the update is applied.
    ///
    /// # Errors
    /// [`StepError::TooManySkips`] when a limit is set and this skip exceeds it (nothing is
    /// changed); [`StepError::Optimizer`] when dfdx's optimizer fails;
    /// [`StepError::WorkspaceMismatch`] when `master` is not the model the forward pass ran.
    ///
    /// # Examples
    /// See [`GradScaler`].
    pub fn update<M, O, D>(
        &mut self,
        master: &mut M,
        optimizer: &mut O,
        grads: &Gradients<f32, D>,
    ) -> Result<UpdateOutcome, StepError>
    where
        D: MixedDevice<H>,
        M: MasterModel<D>,
        O: Optimizer<M, D, f32>,
    {
        self.update_with(master, |m| optimizer.update(m, grads))
    }

    /// [`update`](Self::update) with the optimizer call given as a closure (what
    /// `#[mixed_step]` generates, so the step's own `opt.update(model, &grads)` runs): `apply`
    /// gets the master and is called only when the step is applied.
    ///
    /// # Errors
    /// As [`update`](Self::update); an error of `apply` is [`StepError::Optimizer`].
    ///
    /// # Examples
    /// ```
    /// use dfdx::{optim::*, prelude::*};
    /// use mpx_runtime::{precision::f16, step::GradScaler};
    /// let dev: Cpu = Default::default();
    /// let mut model = dev.build_module::<Linear<2, 1>, f32>();
    /// let mut opt = Sgd::new(&model, Default::default());
    /// let mut scaler = GradScaler::<f16>::default();
    /// let x = dev.tensor([[0.5f32, -1.0]]);
    /// let y = scaler.forward(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x));
    /// let grads = scaler.backward(y.sum());
    /// let outcome = scaler.update_with(&mut model, |m| opt.update(m, &grads))?;
    /// assert!(outcome.is_applied());
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn update_with<M, F, D>(
        &mut self,
        master: &mut M,
        apply: F,
    ) -> Result<UpdateOutcome, StepError>
    where
        D: MixedDevice<H>,
        M: MasterModel<D>,
        F: FnOnce(&mut M) -> Result<(), OptimizerUpdateError<<D as HasErr>::Err>>,
    {
        let verdict = self.begin_update::<M, D>(master)?;
        let applied = match verdict.reason {
            None => Some(apply(master).map_err(D::optimizer_error)),
            Some(_) => None,
        };
        self.finish_update(verdict, applied)
    }

    /// The first half of an update (what `#[mixed_step]` generates around the step's own
    /// `opt.update(..)`, which then runs only when [`Verdict::applies`]): finds the master's
    /// pending verdict, checks the skip limit, and on an applied step copies the working copy's
    /// non-parameter state (batch-norm statistics) into the master. Hand the verdict, and the
    /// optimizer's result when it ran, to [`end_update`](Self::end_update).
    ///
    /// # Errors
    /// [`StepError::UnknownMaster`] when no forward pass of `master` ran through this scaler;
    /// [`StepError::NoBackward`] when no backward pass reached `master`'s working copy since its
    /// last update (a second update of the same gradients).
    ///
    /// # Examples
    /// ```
    /// use dfdx::{optim::*, prelude::*};
    /// use mpx_runtime::{precision::f16, step::GradScaler};
    /// let dev: Cpu = Default::default();
    /// let mut model = dev.build_module::<Linear<2, 1>, f32>();
    /// let mut opt = Sgd::new(&model, Default::default());
    /// let mut scaler = GradScaler::<f16>::default();
    /// let x = dev.tensor([[0.5f32, -1.0]]);
    /// let y = scaler.forward(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x));
    /// let grads = scaler.backward(y.sum());
    /// let verdict = scaler.begin_update(&mut model)?;
    /// let ran = verdict.applies().then(|| opt.update(&mut model, &grads));
    /// assert!(scaler.end_update(verdict, ran)?.is_applied());
    /// // the same gradients a second time: an error, not a second step
    /// assert!(scaler.begin_update(&mut model).is_err());
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn begin_update<M, D>(&mut self, master: &mut M) -> Result<Verdict, StepError>
    where
        D: MixedDevice<H>,
        M: MasterModel<D>,
    {
        #[cfg(feature = "mpi")]
        crate::distributed::before_update(self.reducer.as_mut())?;
        let Some(index) = self.masters.find::<D, M>(master, D::step_error)? else {
            return Err(StepError::UnknownMaster {
                model: std::any::type_name::<M>(),
            });
        };
        let entry = self.masters.get_mut(index);
        let p = entry.pending;
        if p.backwards == 0 {
            return Err(StepError::NoBackward {
                model: std::any::type_name::<M>(),
            });
        }
        let reason = if !p.grads_finite {
            Some(SkipReason::GradsNotFinite)
        } else if !p.loss_finite {
            Some(SkipReason::LossNotFinite)
        } else {
            None
        };
        if reason.is_none() {
            entry.working.with_state(&mut |state| {
                write_state::<D, M>(master, state).map_err(D::step_error)?
            })?;
        }
        Ok(Verdict {
            index,
            reason,
            loss: p.loss,
            scale: p.scale,
            precision: if entry.working.in_f32() {
                crate::precision::DType::Float32.name()
            } else {
                H::DTYPE.name()
            },
            mpx_layers: entry.working.mapped(),
        })
    }

    /// The second half of an update begun with [`begin_update`](Self::begin_update): `applied`
    /// is the optimizer's result when it ran (`None` when the verdict was a skip). Counts the
    /// step, adjusts the loss scale when the iteration is over, and records
    /// [`last_step`](Self::last_step).
    ///
    /// # Errors
    /// [`StepError::TooManySkips`] when a limit is set and this skip exceeds it;
    /// [`StepError::Optimizer`] when the optimizer failed (dfdx's Adam has then already
    /// counted the step in its `t`).
    ///
    /// # Examples
    /// See [`begin_update`](Self::begin_update).
    pub fn end_update<Err>(
        &mut self,
        verdict: Verdict,
        applied: Option<Result<(), OptimizerUpdateError<Err>>>,
    ) -> Result<UpdateOutcome, StepError>
    where
        StepError: From<OptimizerUpdateError<Err>>,
    {
        self.finish_update(verdict, applied.map(|r| r.map_err(StepError::from)))
    }

    /// [`end_update`](Self::end_update) with the optimizer's error already a [`StepError`].
    fn finish_update(
        &mut self,
        verdict: Verdict,
        applied: Option<Result<(), StepError>>,
    ) -> Result<UpdateOutcome, StepError> {
        let outcome = match (verdict.reason, applied) {
            (None, Some(result)) => {
                result?;
                self.consecutive = 0;
                self.applied += 1;
                UpdateOutcome::Applied
            }
            (reason, _) => {
                self.consecutive += 1;
                self.skipped += 1;
                UpdateOutcome::Skipped {
                    reason: reason.unwrap_or(SkipReason::Requested),
                    consecutive: self.consecutive,
                    total: self.skipped,
                }
            }
        };
        for finite in self
            .masters
            .updated(verdict.index, outcome.is_applied())
            .into_iter()
            .flatten()
        {
            self.scaling.adjust(finite);
        }
        self.last = Some(StepReport {
            loss: verdict.loss,
            grads_finite: verdict.reason != Some(SkipReason::GradsNotFinite),
            scale: verdict.scale,
            new_scale: self.scaling.loss_scale(),
            precision: verdict.precision,
            mpx_layers: verdict.mpx_layers,
            outcome,
        });
        if let (UpdateOutcome::Skipped { consecutive, .. }, Some(limit)) =
            (outcome, self.max_consecutive_skips)
            && consecutive > limit
        {
            return Err(StepError::TooManySkips {
                consecutive,
                limit,
                scale: self.scaling.loss_scale(),
            });
        }
        Ok(outcome)
    }

    /// Zeroes `master`'s gradients in `grads` (dfdx's `model.zero_grads(&mut grads)`) and
    /// forgets what the backward passes since its last update saw: gradients thrown away are
    /// not judged at the next update. `#[mixed_step]` generates it for the step's
    /// `model.zero_grads(&mut grads)`.
    ///
    /// # Panics
    /// When the device cannot allocate, as dfdx's `zero_grads` does; see
    /// [`try_zero_grads`](Self::try_zero_grads).
    ///
    /// # Examples
    /// ```
    /// use dfdx::{optim::*, prelude::*};
    /// use mpx_runtime::{precision::f16, step::GradScaler};
    /// let dev: Cpu = Default::default();
    /// let mut model = dev.build_module::<Linear<2, 1>, f32>();
    /// let mut opt = Sgd::new(&model, Default::default());
    /// let mut scaler = GradScaler::<f16>::default();
    /// let mut grads = model.alloc_grads();
    /// // a bad batch: its gradients are thrown away, as an f32 loop does
    /// let y = scaler.forward(&model, dev.tensor([[f32::NAN, 1.0]]).trace(grads), |m, x| m.forward(x));
    /// grads = scaler.backward(y.sum());
    /// scaler.zero_grads(&model, &mut grads);
    /// // the next batch is judged on its own gradients
    /// let y = scaler.forward(&model, dev.tensor([[0.5f32, 1.0]]).trace(grads), |m, x| m.forward(x));
    /// grads = scaler.backward(y.sum());
    /// assert!(scaler.update(&mut model, &mut opt, &grads)?.is_applied());
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn zero_grads<M, D>(&mut self, master: &M, grads: &mut Gradients<f32, D>)
    where
        D: MixedDevice<H>,
        M: MasterModel<D>,
    {
        if let Err(e) = self.try_zero_grads(master, grads) {
            panic!("zeroing the master's gradients failed: {e}");
        }
    }

    /// Fallible form of [`zero_grads`](Self::zero_grads).
    ///
    /// # Errors
    /// [`StepError::Device`] when the device cannot allocate.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, step::GradScaler};
    /// let dev: Cpu = Default::default();
    /// let model = dev.build_module::<Linear<2, 1>, f32>();
    /// let mut grads = model.alloc_grads();
    /// GradScaler::<f16>::default().try_zero_grads(&model, &mut grads)?;
    /// assert_eq!(grads.get(&model.bias).array(), [0.0]);
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn try_zero_grads<M, D>(
        &mut self,
        master: &M,
        grads: &mut Gradients<f32, D>,
    ) -> Result<(), StepError>
    where
        D: MixedDevice<H>,
        M: MasterModel<D>,
    {
        dfdx::nn::ZeroGrads::try_zero_grads(master, grads).map_err(D::step_error)?;
        if let Some(i) = self.masters.find::<D, M>(master, D::step_error)? {
            self.masters.get_mut(i).pending = super::masters::Pending::NONE;
        }
        Ok(())
    }
}

impl<H: Precision, L: LossScale> GradScaler<H, L> {
    /// Data-parallel: after a backward pass, the ranks agree on one verdict and average the
    /// gradients of the master it reached (see [`crate::distributed`]). One master per backward
    /// pass: a graph through several masters is an error under a reducer.
    #[cfg(feature = "mpi")]
    fn reduce(
        &mut self,
        grads: &mut Gradients<f32, Cpu>,
        loss_finite: bool,
    ) -> Result<(), StepError> {
        if self.reducer.is_none() {
            return Ok(());
        }
        let mut touched = self.masters.iter_mut().filter(|e| e.touched);
        let (Some(entry), None) = (touched.next(), touched.next()) else {
            return Err(StepError::WorkspaceMismatch {
                expected: "one master model per backward pass under a data-parallel reducer".into(),
                found: "none or several".into(),
            });
        };
        let agreed = crate::distributed::after_backward(
            self.reducer.as_mut(),
            Some(entry.working.master_slots()),
            grads,
            entry.pending.grads_finite,
            loss_finite,
            self.scaling.loss_scale(),
        )?;
        if let Some(agreed) = agreed {
            // every rank takes the same decision: the loss's finiteness is part of it
            entry.pending.grads_finite = agreed;
            entry.pending.loss_finite = agreed;
        }
        Ok(())
    }

    /// Registers a forward pass of `master` run in f32 on the master itself (see
    /// [`super::device::FullWorking`]), so that the backward pass and the update judge its gradients.
    pub(crate) fn forward_full<M, D>(&mut self, master: &M) -> Result<(), StepError>
    where
        D: MixedDevice<H>,
        M: MasterModel<D>,
    {
        let i = self
            .masters
            .find_or_insert::<D, M>(master, D::step_error, |m| {
                Ok(D::hold_full(super::device::FullWorking::<H, D>::new(m)?))
            })?;
        if self.masters.get_mut(i).working.mark_used() {
            Ok(())
        } else {
            Err(StepError::WorkspaceMismatch {
                expected: "a master whose forward pass runs in f32 (a generic model)".into(),
                found: format!(
                    "`{}`, already run in half precision by this scaler",
                    std::any::type_name::<M>()
                ),
            })
        }
    }

    /// Whether the gradients of `master` seen since its last update were all finite.
    pub(super) fn pending_grads_finite<M, D>(&mut self, master: &M) -> Result<bool, StepError>
    where
        D: MixedDevice<H>,
        M: MasterModel<D>,
    {
        Ok(match self.masters.find::<D, M>(master, D::step_error)? {
            Some(i) => self.masters.get_mut(i).pending.grads_finite,
            None => true,
        })
    }
}

/// Writes the non-parameter tensors (batch-norm statistics) a working copy's forward pass
/// updated into the master.
/// The outer `Result` is the device's, the inner one a layout mismatch.
fn write_state<D: dfdx::tensor_ops::Device<f32>, M: MasterModel<D>>(
    master: &mut M,
    state: &[Vec<f32>],
) -> Result<Result<(), StepError>, D::Err> {
    if state.is_empty() {
        return Ok(Ok(()));
    }
    let mut write = WriteState {
        after: state,
        index: 0,
        mismatch: None,
    };
    M::iter_tensors(&mut RecursiveWalker {
        m: master,
        f: &mut write,
    })?;
    Ok(write.mismatch.map_or(Ok(()), Err))
}

/// The device `master` lives on: that of its first tensor (a master without tensors: the
/// `Cpu`, or an error on another device).
fn master_device<H: Precision, D: MixedDevice<H>, M: MasterModel<D>>(
    master: &M,
) -> Result<D, StepError> {
    first_device::<f32, D, M>(master)
        .map_err(D::step_error)?
        .or_else(D::fallback_device)
        .ok_or_else(|| StepError::WorkspaceMismatch {
            expected: "a master model with at least one tensor (its device is the step's)".into(),
            found: format!("`{}`, which has none", std::any::type_name::<M>()),
        })
}

/// A forward pass on a master's typed workspace.
#[allow(clippy::too_many_arguments)]
fn run_on<H, M, K, X, Y, F, D>(
    working: &mut Working<H, M, K, D>,
    master: &M,
    dev: D,
    scale: f32,
    inv: f32,
    input: X,
    f: F,
) -> Result<Y::Full, StepError>
where
    H: Precision,
    D: MixedDevice<H>,
    M: MasterModel<D> + 'static,
    K: Kind<H, M, D>,
    X: HalfInput<H, D>,
    Y: HalfOutput<H, D>,
    F: FnOnce(&mut K::Copy, X::Half) -> Y,
{
    working.inv = inv;
    if let Some(d) = &working.direct {
        d.set_inv(inv);
    }
    let stash = Arc::clone(&working.stash);
    let direct = working.direct.clone();
    let (half, grads) = working.prepare(master)?;
    let mut region = Region::<H, D>::new(dev, grads, scale, inv, stash, direct.clone());
    let x = input.enter(&mut region).map_err(D::step_error)?;
    // mpx's fused layers of the working copy find their master tensors in this scope
    let scope = D::enter_scope(&*half, direct.as_ref())?;
    // and those of f32 elements run in emulated bf16 when `H` is
    let emulation = crate::precision::emulation::emulate::<H>();
    let y = f(half, x);
    drop((emulation, scope));
    let out = y.leave(&mut region).map_err(D::step_error)?;
    // Unused (no traced input): kept for the next forward pass, where the working copy keeps its
    // tensors; a rebuilt one (`Cuda`) gets buffers of its own.
    if let Some(unused) = region.pool.take()
        && D::IN_PLACE
    {
        working.pool.push(unused);
    }
    Ok(out)
}

/// A master's typed workspace, from its type-erased entry: an error when the master ran
/// through another kind of working copy (or in f32) with this scaler.
fn typed<H, M, K, D>(
    working: &mut dyn Any,
    mapped: bool,
    f32_run: bool,
) -> Result<&mut Working<H, M, K, D>, StepError>
where
    H: Precision,
    D: MixedDevice<H>,
    M: MasterModel<D> + 'static,
    K: Kind<H, M, D>,
{
    working
        .downcast_mut::<Working<H, M, K, D>>()
        .ok_or_else(|| StepError::WorkspaceMismatch {
            expected: format!(
                "`{}` run through one kind of working copy with this scaler",
                std::any::type_name::<M>()
            ),
            found: format!(
                "a forward pass through {}, after one through {}",
                kind_name(K::MAPPED, false),
                kind_name(mapped, f32_run)
            ),
        })
}

/// The name of a kind of working copy, for errors.
fn kind_name(mapped: bool, f32_run: bool) -> &'static str {
    match (mapped, f32_run) {
        (_, true) => "the master itself in f32",
        (true, false) => "mpx's layers (`forward_mapped`)",
        (false, false) => "the master's own layers (`forward`)",
    }
}

/// What [`GradScaler::begin_update`] decided for one master: apply, or skip and why.
///
/// # Examples
/// See [`GradScaler::begin_update`].
#[derive(Debug, Clone, Copy, PartialEq)]
#[must_use = "hand the verdict to `GradScaler::end_update`, which counts the step and adjusts the scale"]
pub struct Verdict {
    index: usize,
    reason: Option<SkipReason>,
    loss: f32,
    scale: f32,
    precision: &'static str,
    mpx_layers: bool,
}

impl Verdict {
    /// Whether the optimizer should run.
    ///
    /// # Examples
    /// See [`GradScaler::begin_update`].
    pub fn applies(&self) -> bool {
        self.reason.is_none()
    }

    /// Why the step is skipped, if it is.
    ///
    /// # Examples
    /// See [`GradScaler::begin_update`].
    pub fn skip_reason(&self) -> Option<SkipReason> {
        self.reason
    }
}

impl<H: Precision, L: LossScale + Default> Default for GradScaler<H, L> {
    /// A scaler with the loss scale's default (for [`DynamicLossScale`]: jmp's and mpx's
    /// defaults).
    fn default() -> Self {
        Self::new(L::default())
    }
}

/// Implemented by [`GradScaler`] alone: what `#[mixed_step(scaling = ..)]` must name.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a `GradScaler<{H}, _>`: `#[mixed_step(scaling = ..)]` needs the mixed-precision state, in the precision the step runs in",
    label = "expected a `GradScaler<{H}, _>` (or a `&mut` one)",
    note = "declare it once, outside the loop: `let mut scaler = mpx::step::GradScaler::new(DynamicLossScale::default());` (a field or a `&mut GradScaler` parameter works too); it holds the loss scale, the half working copy and the skip counters"
)]
pub trait MixedScaler<H: Precision> {
    /// The loss scale type.
    type Loss: LossScale;
    /// The scaler itself.
    fn scaler(&mut self) -> &mut GradScaler<H, Self::Loss>;
}

impl<H: Precision, L: LossScale> MixedScaler<H> for GradScaler<H, L> {
    type Loss = L;
    fn scaler(&mut self) -> &mut GradScaler<H, L> {
        self
    }
}

/// A scaler reached through a reference, a box or a lock guard (`scaler.lock().unwrap()`,
/// `cell.borrow_mut()`) is the scaler.
macro_rules! through {
    ($($t:ty),*) => {$(
        impl<H: Precision, S: MixedScaler<H> + ?Sized> MixedScaler<H> for $t {
            type Loss = S::Loss;
            fn scaler(&mut self) -> &mut GradScaler<H, S::Loss> {
                (**self).scaler()
            }
        }
    )*};
}
through!(
    &mut S,
    Box<S>,
    std::sync::MutexGuard<'_, S>,
    std::sync::RwLockWriteGuard<'_, S>,
    std::cell::RefMut<'_, S>
);

/// The scaler a `#[mixed_step]` names, checked to be a [`GradScaler`] of precision `H` (the
/// macro's `half = ..`; without it, `H` is the scaler's own).
///
/// # Examples
/// ```
/// use mpx_runtime::{precision::f16, step::{GradScaler, scaler_of}};
/// let mut s = GradScaler::<f16>::default();
/// assert_eq!(scaler_of::<f16, _>(&mut s).loss_scale(), s.loss_scale());
/// ```
pub fn scaler_of<H: Precision, S: MixedScaler<H> + ?Sized>(
    s: &mut S,
) -> &mut GradScaler<H, S::Loss> {
    s.scaler()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precision::{AMP, bf16};
    use crate::scaling::{NoOpLossScale, StaticLossScale};

    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn the_state_is_send_and_sync() {
        send_sync::<GradScaler>();
        send_sync::<GradScaler<AMP<f16>, StaticLossScale>>();
        send_sync::<GradScaler<bf16, NoOpLossScale>>();
        send_sync::<GradScaler<f32, DynamicLossScale>>();
    }
}
