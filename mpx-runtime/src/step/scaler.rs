//! [`GradScaler`]: the state of mixed-precision training that spans models and steps: the loss
//! scale, the step counters, what the last update did.

use std::marker::PhantomData;
use std::panic::Location;
use std::sync::{Arc, PoisonError};

use dfdx::optim::{Optimizer, OptimizerUpdateError};
use dfdx::shapes::{HasShape, Rank0, Shape};
use dfdx::tensor::{AsArray, Cpu, Gradients, HasErr, OwnedTape, Tensor};

use super::device::{MixedDevice, check_all};
use super::error::StepError;
use super::full::FullInput;
use super::half_region::{Finished, HalfInput, HalfOutput, Handoff, Inbox, Region, finished};
use super::iteration::{Iteration, Site};
use super::mixed::Mixed;
use super::outcome::{SkipReason, UpdateOutcome};
use super::owners::Owners;
use super::pending::{Cell, Ran};
use super::report::StepReport;
use super::streaks::Streaks;
use super::working::Kind;
use crate::boundary::MasterModel;
use crate::master::slots::trainable_slots;
use crate::precision::{DType, Precision, f16};
use crate::scaling::{DynamicLossScale, LossScale};
use crate::walk::{EachMut, each_mut};

/// Skips in a row at a loss scale that does not move, of the scaler's updates or of one update
/// (one master's, at one place in the code), after which a step is an error even without a
/// limit ([`StepError::ScaleStuck`]): a static scale that overflows every step, or a dynamic one
/// at its minimum, trains nothing in that master, whatever the step's other masters do.
const STUCK_SKIPS: u64 = 20;

/// The state of mixed-precision training, kept across steps like PyTorch's `GradScaler`: the
/// loss scale, the skip counters and the optional limit on consecutive skips, and what the last
/// step did. One scaler serves any number of models (a GAN's generator and discriminator, an
/// actor and a critic): each update is skipped on its own model's gradients, and the one loss
/// scale is adjusted once per iteration.
///
/// Declare it once, outside the training loop, and name it in `#[mixed_step(scaling = ..)]`;
/// or call its methods by hand, on the model held as a [`Mixed`]:
///
/// | f32 dfdx step | mixed step, by hand |
/// |---|---|
/// | `let y = model.forward(x.traced(grads));` | `let y = scaler.forward(&model, x.traced(grads), \|m, x\| m.forward(x))?;` |
/// | `let y = model.forward_mut(x.traced(grads));` | `let y = scaler.forward_mut(&mut model, x.traced(grads), \|m, x\| m.forward_mut(x))?;` |
/// | `grads = loss.backward();` | `grads = scaler.backward(loss)?;` |
/// | `opt.update(&mut model, &grads)?;` | `scaler.update(&mut model, &mut opt, &grads)?;` |
///
/// * [`forward`](Self::forward) runs the model's forward pass on a working copy in `H`, built
///   from the master as it is now, with the traced f32 input rounded to `H` and the output
///   widened back to f32: the loss and everything else stays f32 code. Its closure gets the
///   copy shared, as dfdx's `forward` gets `&self`; a pass that may change the model (dropout,
///   batch norm, a module of the user's own that keeps state) is
///   [`forward_mut`](Self::forward_mut), which takes back what it changed.
/// * [`backward`](Self::backward) runs the f32 backward; where the gradient enters the half
///   graph it is multiplied by the loss scale, and the working copy's gradients come back
///   unscaled and added to the master's f32 gradients, which are then checked for finiteness.
///   Gradients accumulate over several backward calls, as in dfdx.
/// * [`update`](Self::update) runs the optimizer only when the master's gradients and the loss
///   of the last backward pass that reached it were finite, then adjusts the loss scale when the
///   iteration is over; a skipped step leaves the master and the optimizer state untouched.
///
/// `H` is the half precision (`f16`, `AMP<f16>`, emulated `bf16`, or `f32` to check the
/// machinery), `L` the loss scale, `D` the device (the `Cpu`; dfdx's `Cuda` with the `cuda`
/// feature).
///
/// # Examples
/// ```
/// use dfdx::{optim::*, prelude::*};
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::scaling::DynamicLossScale;
/// use mpx_runtime::step::{GradScaler, Mixed};
///
/// let dev: Cpu = Default::default();
/// type Mlp = (Linear<4, 8>, ReLU, Linear<8, 2>);
/// let mut model = Mixed::new(dev.build_module::<Mlp, f32>());
/// let mut opt = Adam::new(&*model, AdamConfig::default());
/// let mut scaler = GradScaler::<f16>::new(DynamicLossScale::default());
/// let mut grads = model.alloc_grads();
/// let x: Tensor<Rank2<3, 4>, f32, _> = dev.sample_normal();
/// let y: Tensor<Rank2<3, 2>, f32, _> = dev.sample_normal();
/// for _ in 0..3 {
///     let out = scaler.forward(&model, x.trace(grads), |m, x| m.forward(x))?;
///     let loss = mse_loss(out, y.clone()); // f32
///     grads = scaler.backward(loss)?;
///     scaler.update(&mut model, &mut opt, &grads)?;
///     model.zero_grads(&mut grads);
/// }
/// let last = scaler.last_step().unwrap();
/// assert!(last.is_applied() && last.loss.is_finite());
/// assert_eq!(scaler.applied_steps(), 3);
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
pub struct GradScaler<H: Precision = f16, L: LossScale = DynamicLossScale, D: MixedDevice<H> = Cpu>
{
    pub(super) scaling: L,
    pub(super) max_consecutive_skips: Option<u64>,
    pub(super) applied: u64,
    pub(super) skipped: u64,
    pub(super) consecutive: u64,
    /// Each update's skips in a row (by site and master): what stops a run in which one master
    /// never trains.
    pub(super) streaks: Streaks,
    /// The scaler's skips in a row that left the loss scale where it was.
    stuck: u64,
    last: Option<StepReport>,
    iteration: Iteration,
    /// What the backward bridges of this scaler's forward passes finished.
    inbox: Inbox<D, H>,
    /// What working copies are built in, kept from one to the next.
    store: D::Store,
    /// The data-parallel all-reduce (`with_reducer`, in `crate::distributed`): part of the
    /// scaler's configuration, kept by a restore.
    #[cfg(feature = "mpi")]
    pub(crate) reducer: Option<crate::distributed::Reducer>,
    marker: PhantomData<fn() -> H>,
}

impl<H: Precision, L: LossScale, D: MixedDevice<H>> std::fmt::Debug for GradScaler<H, L, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradScaler")
            .field("precision", &H::DTYPE)
            .field("loss_scale", &self.scaling.loss_scale())
            .field("applied_steps", &self.applied)
            .field("skipped_steps", &self.skipped)
            .field("consecutive_skips", &self.consecutive)
            .field("max_consecutive_skips", &self.max_consecutive_skips)
            .field("last_step", &self.last)
            .finish_non_exhaustive()
    }
}

impl<H: Precision, L: LossScale + Default, D: MixedDevice<H>> Default for GradScaler<H, L, D> {
    /// A scaler with the loss scale's default (for [`DynamicLossScale`]: jmp's and mpx's
    /// defaults).
    fn default() -> Self {
        Self::new(L::default())
    }
}

impl<H: Precision, L: LossScale, D: MixedDevice<H>> GradScaler<H, L, D> {
    /// A scaler with the given loss scale (`DynamicLossScale`, `StaticLossScale` or
    /// `NoOpLossScale`).
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
        Self {
            scaling,
            max_consecutive_skips: None,
            applied: 0,
            skipped: 0,
            consecutive: 0,
            streaks: Streaks::default(),
            stuck: 0,
            last: None,
            iteration: Iteration::default(),
            inbox: Inbox::default(),
            store: D::Store::default(),
            #[cfg(feature = "mpi")]
            reducer: None,
            marker: PhantomData,
        }
    }

    /// Sets a limit on consecutive skipped steps: the `(limit + 1)`-th skip in a row makes
    /// [`update`](Self::update) return [`StepError::TooManySkips`] (master and optimizer still
    /// untouched). Skips are counted in a row over the scaler's updates and, for each model,
    /// over that model's updates at one place in the code, so a model that is skipped at every
    /// iteration while the step's others train (a GAN's generator) reaches the limit too. Off by
    /// default (optax's `apply_if_finite(max_consecutive_errors)`, one per optimizer, applies
    /// the bad update at that point instead; PyTorch has no limit). Without it, 20 skips of one
    /// model's update in a row at a loss scale that cannot back off any further are
    /// [`StepError::ScaleStuck`].
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

    /// The loss-scale object.
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

    /// The loss-scale object, mutably (to change its settings between steps).
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

    /// What the last update did: loss, finiteness, the scale applied and the next one, the
    /// precision the forward passes ran in, applied or skipped. `None` before the first update.
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

    /// Runs a model's forward pass in half precision: `f` gets a working copy of the master,
    /// built from it as it is now ([`Plain`](super::Plain): its own layers in `H`;
    /// [`Mapped`](super::Mapped): mpx's layers), and `input` rounded to `H` on a half tape; its
    /// output comes back widened to f32, on the input's f32 tape. The input is what an f32 step
    /// passes (`x.traced(grads)`, an integer tensor of token ids, a tuple, a [`Batch`](super::Batch));
    /// the output may be a tensor, a tuple of tensors or the `Result` of a `try_forward`.
    ///
    /// # Errors
    /// [`StepError::Device`] when the device cannot allocate, [`StepError::InvalidScale`] for a
    /// loss scale that is not finite and positive, [`StepError::Cast`] when a working copy of
    /// mpx's layers does not line up with the master.
    ///
    /// # Examples
    /// See [`GradScaler`].
    pub fn forward<M, K, X, Y, F>(
        &mut self,
        master: &Mixed<M, K>,
        input: X,
        f: F,
    ) -> Result<Y::Full, StepError>
    where
        M: MasterModel<D>,
        K: Kind<H, M, D>,
        X: HalfInput<H, D>,
        Y: HalfOutput<H, D>,
        F: FnOnce(&K::Copy, X::Half) -> Y,
    {
        let owners = Owners::Whole(master.cell.clone());
        let shared = |copy: &mut K::Copy, x: X::Half| f(copy, x);
        Ok(self.run::<M, K, X, Y, _>(master, &owners, input, shared)?.0)
    }

    /// [`forward`](Self::forward) for a pass that may change the model (`forward_mut`, as
    /// dropout's and batch norm's training mode do): `f` gets the working copy mutably, and once
    /// it has run, what it changed in the
    /// working copy outside the layers and tensors comes back to the master
    /// ([`HalfLayers::carry_back`](super::HalfLayers::carry_back): a counter or a history in a
    /// module of the user's own), as the same pass in f32 leaves it in the model.
    ///
    /// # Errors
    /// As [`forward`](Self::forward).
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, step::{GradScaler, Mixed}};
    /// let dev: Cpu = Default::default();
    /// let mut model = Mixed::mapped(dev.build_module::<(Linear<4, 8>, Dropout, Linear<8, 2>), f32>());
    /// let mut scaler = GradScaler::<f16>::default();
    /// let x: Tensor<Rank2<3, 4>, f32, _> = dev.sample_normal();
    /// let grads = model.alloc_grads();
    /// let y = scaler.forward_mut(&mut model, x.trace(grads), |m, x| m.forward_mut(x))?;
    /// let grads = scaler.backward(y.square().mean())?;
    /// assert!(grads.get(&model.0.weight).as_vec().iter().any(|g| *g != 0.0));
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn forward_mut<M, K, X, Y, F>(
        &mut self,
        master: &mut Mixed<M, K>,
        input: X,
        f: F,
    ) -> Result<Y::Full, StepError>
    where
        M: MasterModel<D>,
        K: Kind<H, M, D>,
        X: HalfInput<H, D>,
        Y: HalfOutput<H, D>,
        F: FnOnce(&mut K::Copy, X::Half) -> Y,
    {
        let owners = Owners::Whole(master.cell.clone());
        let (y, mut copy) = self.run::<M, K, X, Y, F>(master, &owners, input, f)?;
        K::carry_back(&mut **master, &mut copy);
        Ok(y)
    }

    /// A forward pass of `master` on its working copy of kind `K`, whose gradients are `owners'`
    /// (the master's own cell, or those of the parts of it the step updates).
    pub(crate) fn run<M, K, X, Y, F>(
        &mut self,
        master: &M,
        owners: &Owners,
        input: X,
        f: F,
    ) -> Result<(Y::Full, K::Copy), StepError>
    where
        M: MasterModel<D>,
        K: Kind<H, M, D>,
        X: HalfInput<H, D>,
        Y: HalfOutput<H, D>,
        F: FnOnce(&mut K::Copy, X::Half) -> Y,
    {
        let (scale, inv) = self.checked_scale()?;
        let dev = D::region_device(master, &mut self.store)?;
        let links = D::links(inv);
        // the last pass's working copy was dropped when it returned
        D::recycle(&mut self.store);
        let built = K::build(master, &links, &mut self.store)?;
        owners.check_parts_of::<M, _>(&built.pairs, |p| p.master.addr)?;
        for cell in owners.cells() {
            cell.lock().ran = Some(Ran {
                precision: H::DTYPE,
                mapped: K::MAPPED,
            });
        }
        let super::working::Built {
            mut copy,
            pairs,
            mut state,
        } = built;
        // statistics an earlier pass left that no update has written yet (an accumulation); a
        // copy without non-trainable tensors has none
        let base = state.initial().to_vec();
        if !base.is_empty()
            && let Some(pending) = owners.pending_state::<D, M>(master, &base, D::step_error)?
        {
            state.resume(&mut copy, &pending)?;
        }
        let handoff = Handoff {
            pairs,
            owners: owners.clone(),
            inbox: Arc::clone(&self.inbox),
        };
        let mut region = Region::<H, D>::new(dev, (scale, inv), links, handoff);
        let x = input.enter(&mut region).map_err(D::step_error)?;
        let y = f(&mut copy, x);
        let out = y.leave(&mut region).map_err(D::step_error)?;
        // statistics a training-mode pass changed, for the master on an applied update
        if let Some(changed) = state.changed(&copy).map_err(D::step_error)? {
            owners.share_state::<D, M>(master, (changed, &base), D::step_error)?;
        }
        Ok((out, copy))
    }

    /// A forward pass of `master` run in f32 on the master itself (a model the step cannot run
    /// in `H`): its gradients are judged and its update counted as any master's.
    pub(crate) fn run_full<M, X>(
        &mut self,
        master: &M,
        owners: &Owners,
        input: X,
    ) -> Result<X::Plain, StepError>
    where
        M: MasterModel<D>,
        X: FullInput<D>,
    {
        let slots = trainable_slots::<D, M>(master).map_err(D::step_error)?;
        owners.check_parts_of::<M, _>(&slots, |s| s.addr)?;
        for cell in owners.cells() {
            cell.lock().ran = Some(Ran {
                precision: DType::Float32,
                mapped: false,
            });
        }
        let (inbox, owners) = (Arc::clone(&self.inbox), owners.clone());
        let mut post = Some(Box::new(move |_: &mut Gradients<f32, D>| {
            finished(&inbox, &owners, slots);
            Ok(())
        }) as super::full::PostOp<D>);
        Ok(input.attach(&mut post))
    }

    /// Tells this scaler apart from any other alive: where its inbox is.
    fn address(&self) -> usize {
        Arc::as_ptr(&self.inbox).addr()
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
    /// that was applied, and checked for finiteness; what the check found and the loss are kept
    /// for each master's next [`update`](Self::update).
    ///
    /// # Errors
    /// [`StepError::Device`] when the device cannot allocate or dfdx's backward fails.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, step::{GradScaler, Mixed}};
    /// let dev: Cpu = Default::default();
    /// let model = Mixed::new(dev.build_module::<Linear<2, 1>, f32>());
    /// let mut scaler = GradScaler::<f16>::default();
    /// let x = dev.tensor([[0.5f32, -1.0]]);
    /// let y = scaler.forward(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x))?;
    /// let grads = scaler.backward(y.sum())?;
    /// // d(sum(W x + b))/db = 1, unscaled
    /// assert_eq!(grads.get(&model.bias).array(), [1.0]);
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn backward(
        &mut self,
        loss: Tensor<Rank0, f32, D, OwnedTape<f32, D>>,
    ) -> Result<Gradients<f32, D>, StepError> {
        let backward = dfdx::tensor_ops::Backward::try_backward;
        self.backward_with(loss, |l| backward(l).map_err(D::step_error))
    }

    /// [`backward`](Self::backward) with the backward call given (what `#[mixed_step]`
    /// generates, so the step's own `loss.backward()` runs): errors are the call's own type.
    pub(crate) fn backward_with<T, E>(
        &mut self,
        loss: T,
        backward: impl FnOnce(T) -> Result<Gradients<f32, D>, E>,
    ) -> Result<Gradients<f32, D>, E>
    where
        T: AsArray<Array = f32>,
        E: From<StepError>,
    {
        let value = loss.array();
        // what a backward pass not run through this scaler left (its gradients were not judged)
        self.inbox
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        let mut grads = backward(loss)?;
        self.judge(&mut grads, value)?;
        Ok(grads)
    }

    /// After a backward pass: judges the gradients of each master it reached, once every op has
    /// added to them, and records the verdicts in the masters' cells.
    fn judge(&mut self, grads: &mut Gradients<f32, D>, loss: f32) -> Result<(), StepError> {
        // judged in place, under the inbox's lock (nothing a judgement runs posts to it), and
        // emptied whatever happens: the inbox keeps its buffer from step to step
        let inbox = Arc::clone(&self.inbox);
        let mut finished = inbox.lock().unwrap_or_else(PoisonError::into_inner);
        let judged = self.judge_all(&mut finished, grads, loss);
        finished.clear();
        judged
    }

    /// [`judge`](Self::judge) on the passes `finished`, in the order they finished.
    fn judge_all(
        &mut self,
        finished: &mut [Finished<D, H>],
        grads: &mut Gradients<f32, D>,
        loss: f32,
    ) -> Result<(), StepError> {
        for i in 0..finished.len() {
            let (earlier, rest) = finished.split_at_mut(i);
            let f = &mut rest[0];
            // several passes of one master: one judgement
            if earlier
                .iter()
                .any(|m| m.verdict.is_some() && m.cell.same(&f.cell))
            {
                continue;
            }
            // a master these gradients dropped (reached through another model's graph, as the
            // discriminator when the generator trains) is not judged on them
            if let Some(first) = f.slots.first()
                && !D::kept(first, grads)?
            {
                continue;
            }
            f.verdict = Some(check_all::<H, D>(&f.slots, grads)?);
        }
        let scale = self.scaling.loss_scale();
        // data-parallel: every rank takes the one decision the ranks agreed on (`None` before
        // the last micro-batch of an accumulation, and without a reducer)
        #[cfg(feature = "mpi")]
        let agreed = D::reduce(
            self.reducer.as_mut(),
            &finished
                .iter()
                .filter(|m| m.verdict.is_some())
                .flat_map(|m| &m.slots)
                .collect::<Vec<_>>(),
            grads,
            finished.iter().filter_map(|m| m.verdict).all(|v| v),
            loss.is_finite(),
            scale,
            [self.applied, self.skipped],
        )?;
        #[cfg(not(feature = "mpi"))]
        let agreed: Option<bool> = None;
        for m in finished.iter() {
            let Some(finite) = m.verdict else {
                continue;
            };
            let mut p = m.cell.lock();
            p.backwards = p.backwards.saturating_add(1);
            (p.grads_finite, p.loss_finite) = match agreed {
                Some(all) => (all, all),
                None => (finite, loss.is_finite()),
            };
            p.loss = loss;
            p.scale = scale;
            drop(p);
            self.iteration.reached(&m.cell);
        }
        Ok(())
    }

    /// Updates the f32 master with any dfdx optimizer, only when the gradients and the loss of
    /// the last backward pass that reached it were finite; otherwise the optimizer does not run
    /// at all, so master weights and optimizer state stay bit-identical. Then the loss scale is
    /// adjusted when the iteration is over (a skipped step never counts toward growth), and
    /// [`last_step`](Self::last_step) records what happened. Non-parameter state the forward
    /// passes changed (batch-norm running statistics) is copied into the master when the update
    /// is applied.
    ///
    /// # Errors
    /// [`StepError::NoBackward`] when no backward pass reached `master` since its last update
    /// (the same gradients a second time); [`StepError::TooManySkips`] when a limit is set and
    /// this skip exceeds it (nothing is changed); [`StepError::ScaleStuck`] after 20 skips in a
    /// row at a scale that does not move; [`StepError::Optimizer`] when dfdx's optimizer fails.
    ///
    /// # Examples
    /// See [`GradScaler`].
    #[track_caller]
    pub fn update<M, K, O>(
        &mut self,
        master: &mut Mixed<M, K>,
        optimizer: &mut O,
        grads: &Gradients<f32, D>,
    ) -> Result<UpdateOutcome, StepError>
    where
        M: MasterModel<D>,
        O: Optimizer<M, D, f32>,
    {
        let (cell, site) = (master.cell.clone(), Site::Call(Location::caller()));
        self.update_of(&cell, &mut **master, site, |m| optimizer.update(m, grads))
    }

    /// [`update`](Self::update) with the optimizer call given as a closure (PyTorch's
    /// `scaler.step(opt)` for an optimizer of your own): `apply` gets the master and is called
    /// only when the step is applied.
    ///
    /// # Errors
    /// As [`update`](Self::update); an error of `apply` is [`StepError::Optimizer`].
    ///
    /// # Examples
    /// ```
    /// use dfdx::{optim::*, prelude::*};
    /// use mpx_runtime::{precision::f16, step::{GradScaler, Mixed}};
    /// let dev: Cpu = Default::default();
    /// let mut model = Mixed::new(dev.build_module::<Linear<2, 1>, f32>());
    /// let mut opt = Sgd::new(&*model, Default::default());
    /// let mut scaler = GradScaler::<f16>::default();
    /// let x = dev.tensor([[0.5f32, -1.0]]);
    /// let y = scaler.forward(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x))?;
    /// let grads = scaler.backward(y.sum())?;
    /// let outcome = scaler.update_with(&mut model, |m| opt.update(m, &grads))?;
    /// assert!(outcome.is_applied());
    /// // the same gradients a second time: an error, not a second step
    /// assert!(scaler.update_with(&mut model, |m| opt.update(m, &grads)).is_err());
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    #[track_caller]
    pub fn update_with<M, K, F>(
        &mut self,
        master: &mut Mixed<M, K>,
        apply: F,
    ) -> Result<UpdateOutcome, StepError>
    where
        M: MasterModel<D>,
        F: FnOnce(&mut M) -> Result<(), OptimizerUpdateError<<D as HasErr>::Err>>,
    {
        let (cell, site) = (master.cell.clone(), Site::Call(Location::caller()));
        self.update_of(&cell, &mut **master, site, apply)
    }

    /// The update of `master`, whose state is `cell` (a [`Mixed`] handle's, or a part's).
    pub(crate) fn update_of<M, F>(
        &mut self,
        cell: &Cell,
        master: &mut M,
        site: Site,
        apply: F,
    ) -> Result<UpdateOutcome, StepError>
    where
        M: MasterModel<D>,
        F: FnOnce(&mut M) -> Result<(), OptimizerUpdateError<<D as HasErr>::Err>>,
    {
        let verdict = self.begin(cell, master, site)?;
        let ran = verdict.applies().then(|| apply(master));
        let outcome = self.end(verdict, ran.as_ref().map(Result::is_ok))?;
        match ran {
            Some(Err(e)) => Err(D::optimizer_error(e)),
            _ => Ok(outcome),
        }
    }

    /// The first half of an update: the verdict of the master whose state is `cell`; on an
    /// applied step, the working copy's non-parameter state is copied into the master.
    pub(crate) fn begin<M: MasterModel<D>>(
        &mut self,
        cell: &Cell,
        master: &mut M,
        site: Site,
    ) -> Result<Verdict, StepError> {
        #[cfg(feature = "mpi")]
        D::before_update(self.reducer.as_mut())?;
        let p = cell.lock().clone();
        let model = std::any::type_name::<M>();
        let Some(ran) = p.ran else {
            return Err(StepError::UnknownMaster { model });
        };
        if p.backwards == 0 {
            return Err(StepError::NoBackward { model });
        }
        let reason = if !p.grads_finite {
            Some(SkipReason::GradsNotFinite)
        } else if !p.loss_finite {
            Some(SkipReason::LossNotFinite)
        } else {
            None
        };
        if reason.is_none()
            && let Some(state) = &p.state
        {
            write_state::<H, D, M>(master, &state.values)?;
        }
        Ok(Verdict {
            cell: cell.clone(),
            master: std::ptr::from_mut(master).addr(),
            scaler: self.address(),
            site,
            reason,
            loss: p.loss,
            scale: p.scale,
            ran,
        })
    }

    /// The second half of an update begun with [`begin`](Self::begin): `ran` is whether the
    /// optimizer succeeded when it ran (`None` when the verdict was a skip). Counts the step,
    /// adjusts the loss scale when the iteration is over, and records
    /// [`last_step`](Self::last_step). A failed optimizer is not counted (its error is the
    /// caller's to return).
    pub(crate) fn end(
        &mut self,
        verdict: Verdict,
        ran: Option<bool>,
    ) -> Result<UpdateOutcome, StepError> {
        let Verdict {
            cell,
            master,
            scaler,
            site,
            reason,
            loss,
            scale,
            ran: what_ran,
        } = verdict;
        if scaler != self.address() {
            return Err(StepError::OtherScaler);
        }
        cell.lock().consumed();
        let before = self.scaling.loss_scale();
        let mut stuck = 0;
        let outcome = match (reason, ran) {
            (None, Some(false)) => return Ok(UpdateOutcome::Applied),
            (None, Some(true)) => {
                self.consecutive = 0;
                self.stuck = 0;
                self.streaks.applied(site, master);
                self.applied = self.applied.saturating_add(1);
                UpdateOutcome::Applied
            }
            (reason, _) => {
                self.consecutive = self.consecutive.saturating_add(1);
                self.skipped = self.skipped.saturating_add(1);
                let (skips, at_one_scale) = self.streaks.skipped(site, master, scale);
                stuck = at_one_scale;
                UpdateOutcome::Skipped {
                    reason: reason.unwrap_or(SkipReason::GradsNotFinite),
                    consecutive: self.consecutive.max(skips),
                    total: self.skipped,
                }
            }
        };
        let due = self.iteration.updated(&cell, site, outcome.is_applied());
        for finite in due.into_iter().flatten() {
            self.scaling.adjust(finite);
        }
        if !outcome.is_applied() {
            let moved = self.scaling.loss_scale() < before;
            self.stuck = if moved {
                0
            } else {
                self.stuck.saturating_add(1)
            };
            stuck = stuck.max(self.stuck);
        }
        self.last = Some(StepReport {
            loss,
            grads_finite: reason != Some(SkipReason::GradsNotFinite),
            scale,
            new_scale: self.scaling.loss_scale(),
            precision: what_ran.precision,
            mpx_layers: what_ran.mapped,
            outcome,
        });
        if let UpdateOutcome::Skipped { consecutive, .. } = outcome {
            match self.max_consecutive_skips {
                Some(limit) if consecutive > limit => {
                    return Err(StepError::TooManySkips {
                        consecutive,
                        limit,
                        scale: self.scaling.loss_scale(),
                    });
                }
                None if stuck >= STUCK_SKIPS => {
                    return Err(StepError::ScaleStuck {
                        consecutive: stuck,
                        scale: self.scaling.loss_scale(),
                    });
                }
                _ => {}
            }
        }
        Ok(outcome)
    }
}

/// What an update decided for one master: apply, or skip and why. Consumed by the end of the
/// update, so one backward pass's verdict ends one update, on the scaler that began it.
#[derive(Debug)]
#[must_use = "an update ends by handing the verdict back to the scaler that gave it"]
pub struct Verdict {
    cell: Cell,
    /// The address of the master (or part) the update names.
    master: usize,
    /// The scaler that began the update ([`GradScaler::address`]).
    scaler: usize,
    site: Site,
    reason: Option<SkipReason>,
    loss: f32,
    scale: f32,
    ran: Ran,
}

impl Verdict {
    /// Whether the optimizer should run.
    pub fn applies(&self) -> bool {
        self.reason.is_none()
    }

    /// Why the step is skipped, if it is.
    pub fn skip_reason(&self) -> Option<SkipReason> {
        self.reason
    }
}

/// Writes the non-parameter tensors (batch-norm statistics) a working copy's forward pass
/// updated into the master.
fn write_state<H: Precision, D: MixedDevice<H>, M: MasterModel<D>>(
    master: &mut M,
    state: &[f32],
) -> Result<(), StepError> {
    struct Write<'a> {
        state: &'a [f32],
        offset: usize,
        model: &'static str,
    }
    impl<D: dfdx::tensor_ops::Device<f32>> EachMut<f32, D> for Write<'_> {
        type Error = StepError;
        fn tensor<S: Shape>(
            &mut self,
            trainable: bool,
            t: &mut Tensor<S, f32, D>,
        ) -> Result<(), StepError> {
            if trainable {
                return Ok(());
            }
            let n = t.shape().num_elements();
            let values = self.state.get(self.offset..self.offset + n);
            t.copy_from(values.ok_or(StepError::MasterChanged { model: self.model })?);
            self.offset += n;
            Ok(())
        }
    }
    let model = std::any::type_name::<M>();
    let mut write = Write {
        state,
        offset: 0,
        model,
    };
    each_mut(master, &mut write, D::step_error)?;
    if write.offset == state.len() {
        Ok(())
    } else {
        Err(StepError::MasterChanged { model })
    }
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
