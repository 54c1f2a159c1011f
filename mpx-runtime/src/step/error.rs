//! Errors of the mixed-precision step.

use dfdx::optim::OptimizerUpdateError;
use dfdx::tensor::CpuError;

/// What can go wrong in a mixed-precision step ([`GradScaler`](super::GradScaler) and the
/// functions over it).
///
/// A non-finite gradient or loss is **not** an error: it is a skipped step, reported in
/// [`UpdateOutcome::Skipped`](super::UpdateOutcome::Skipped). It becomes an error only when a
/// limit on consecutive skips is set and exceeded ([`StepError::TooManySkips`]).
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// The device failed (in practice: out of memory); the device's error is the source.
    #[error("the device failed during the mixed step")]
    Device(#[from] CpuError),

    /// dfdx's `Cuda` device failed (out of memory, a kernel that did not load or launch); the
    /// device's error is in the message (dfdx's `CudaError` is not a `std::error::Error`).
    #[cfg(feature = "cuda")]
    #[error("the CUDA device failed during the mixed step: {0}")]
    Cuda(dfdx::tensor::CudaError),

    /// mpx's CUDA kernels did not compile (NVRTC's log is in the message).
    #[cfg(feature = "cuda")]
    #[error("compiling mpx's CUDA kernels with NVRTC failed: {0}")]
    CudaKernels(String),

    /// The working copy could not be cast from the master (a module whose `TensorCollection`
    /// does not rebuild it, or runtime dimensions that changed).
    #[error("casting the master into the working copy failed")]
    Cast(#[from] crate::cast::CastError),

    /// The loss scale was zero, negative, infinite or NaN.
    #[error(
        "the loss scale must be finite and greater than 0, got {scale}; \
         use a DynamicLossScale with a positive minimum, a StaticLossScale > 0, or NoOpLossScale"
    )]
    InvalidScale {
        /// The offending scale.
        scale: f32,
    },

    /// The master's non-parameter tensors (batch-norm statistics) no longer line up with the
    /// values its forward pass left for it: the model changed shape between its forward pass and
    /// its update.
    #[error(
        "the non-parameter tensors (batch-norm statistics) of this `{model}` no longer line up with those its forward pass changed: the model must keep its layout between its forward pass and its update"
    )]
    MasterChanged {
        /// The model's type.
        model: &'static str,
    },

    /// A forward pass of a model the step updates part by part (an optimizer for each of its
    /// fields) changed batch-norm statistics in no part the step updates (a frozen part run in
    /// training mode): they could not reach the master.
    #[error(
        "the forward pass of this `{model}` changed batch-norm statistics in no part the step updates (a frozen part run in training mode), so they would reach no master: update that part too (an optimizer with a learning rate of 0 keeps its weights), or update the whole model with one optimizer"
    )]
    PartsState {
        /// The model's type.
        model: &'static str,
    },

    /// A part given to a forward pass of a model ([`MixedPart::of`](super::MixedPart::of)) is not
    /// a part of that model: its gradients would be judged on nothing.
    #[error(
        "this `{part}` is not a part of the `{model}` whose forward pass it was given to: make each part with `MixedPart::of(&model.field)` of the model the forward pass runs"
    )]
    NotAPart {
        /// The part's type.
        part: &'static str,
        /// The model's type.
        model: &'static str,
    },

    /// Two parts given to one forward pass share a tensor (a part given twice, or a field and a
    /// field of it): its gradient would be judged for one part's update and not the other's.
    #[error(
        "a tensor of this `{part}` is also in the `{other}` given to the same forward pass: each trained tensor belongs to at most one part (one optimizer); give each optimizer fields of its own"
    )]
    PartsOverlap {
        /// The part's type.
        part: &'static str,
        /// The type of the other part that holds the tensor.
        other: &'static str,
    },

    /// A part's update named another part than the one its state ([`MixedPart`](super::MixedPart))
    /// was made of: that part's gradients were never judged for it.
    #[error(
        "this MixedPart was made of a `{state}`, but its update names a `{part}` (another part, or another model's): update the part whose state it is, `MixedPart::of(&model.field)` with the same field"
    )]
    OtherPart {
        /// The type of the part the state was made of.
        state: &'static str,
        /// The type of the part the update named.
        part: &'static str,
    },

    /// A master model without tensors on a device that has no default one: there is nothing to
    /// train, and no device to run on.
    #[error("`{model}` has no tensors: a master model must have parameters on the step's device")]
    NoTensors {
        /// The model's type.
        model: &'static str,
    },

    /// A tensor field of a module with `#[derive(HalfLayers)]` is trained in its master (its
    /// `TensorCollection` says so) but marked `#[half_layers(state)]`, or the other way round.
    #[error(
        "field `{field}` of `{module}` is {} in the module's TensorCollection, but {} in its #[derive(HalfLayers)]: {}",
        if *trainable { "trained" } else { "not trained (state)" },
        if *trainable { "marked `#[half_layers(state)]`" } else { "not marked `#[half_layers(state)]`" },
        if *trainable { "remove the marker" } else { "mark the field `#[half_layers(state)]`, so that what the forward pass changes in it reaches the master" }
    )]
    FieldTrainable {
        /// The module's type.
        module: &'static str,
        /// The field.
        field: &'static str,
        /// Whether the master trains it.
        trainable: bool,
    },

    /// An update was ended on another scaler than the one that began it.
    #[error(
        "this update was begun on another GradScaler: an update's two halves run on one scaler"
    )]
    OtherScaler,

    /// The optimizer rejected the update; dfdx's `OptimizerUpdateError` is the source.
    ///
    /// The optimizer has already run when this comes back, and dfdx's optimizers do not undo
    /// what they did: Adam has advanced its step count `t` (its bias correction moves on), and
    /// on `UnusedParams` every parameter that had a gradient has been updated. Unlike a
    /// skipped step, this one leaves neither the master nor the optimizer state as it was;
    /// rebuild them (or reload a checkpoint) before training on.
    #[error(
        "the optimizer update failed; if its source names unused tensors, the gradients were not \
         produced for this master model (was the workspace built from a different master?)"
    )]
    Optimizer(#[source] OptimizerUpdateError<CpuError>),

    /// The optimizer rejected an update on the `Cuda` device: as [`StepError::Optimizer`].
    #[cfg(feature = "cuda")]
    #[error(
        "the optimizer update on the CUDA device failed; if its source names unused tensors, the \
         gradients were not produced for this master model"
    )]
    CudaOptimizer(#[source] OptimizerUpdateError<dfdx::tensor::CudaError>),

    /// An update named a model that never ran a forward pass through this scaler, so there are
    /// no gradients of it to judge.
    #[error(
        "this update names a `{model}` that no forward pass of this scaler ran: update the model \
         whose forward pass ran (`scaler.forward(&model, ..)`, or the traced `model.forward(..)` \
         of a `#[mixed_step]`)"
    )]
    UnknownMaster {
        /// The model's type.
        model: &'static str,
    },

    /// A second update without a new backward pass: the gradients were already applied (or
    /// skipped). PyTorch's `scaler.step(opt)` raises the same.
    #[error(
        "no backward pass reached this `{model}` since its last update: each update needs its \
         own backward pass (an `opt.update(..)` followed by `scaler.update(..)` runs the \
         optimizer twice; keep one of them)"
    )]
    NoBackward {
        /// The model's type.
        model: &'static str,
    },

    /// A checkpoint that cannot be restored into this scaler.
    #[error("the checkpoint cannot be restored: {0}")]
    Checkpoint(String),

    /// 20 updates of one model in a row (at one place in the code) were skipped at a loss scale
    /// that did not move: a static scale that overflows every step, or a dynamic one at its
    /// minimum, trains nothing in that model, forever, whatever the step's other models do.
    #[error(
        "{consecutive} steps in a row were skipped and the loss scale ({scale}) could not back off any further, so nothing trains in this model: use a DynamicLossScale (or a lower static scale, or a lower minimum), check the batch and the loss for NaN/inf, or set a limit of your own with `GradScaler::with_max_consecutive_skips`"
    )]
    ScaleStuck {
        /// Skips in a row at an unchanged scale.
        consecutive: u64,
        /// The loss scale.
        scale: f32,
    },

    /// A gradient-clipping bound that is negative, infinite or NaN.
    #[error(
        "clip_grad_norm: max_norm must be a finite number, 0 or more, got {max_norm} (a negative bound would flip every gradient, NaN would never clip)"
    )]
    InvalidClip {
        /// The bound given.
        max_norm: f32,
    },

    /// More consecutive steps were skipped than the limit allows: of the scaler's updates, or of
    /// one model's (at one place in the code) while the step's other models trained.
    #[error(
        "{consecutive} consecutive steps were skipped (limit {limit}) because gradients or the \
         loss were not finite; the loss scale is now {scale}. Check the batch and the loss for \
         NaN/inf, lower the initial scale or the minimum scale, or raise the limit with \
         `GradScaler::with_max_consecutive_skips`"
    )]
    TooManySkips {
        /// Consecutive skipped steps so far, this one included.
        consecutive: u64,
        /// The limit that was set.
        limit: u64,
        /// The loss scale after the last adjust.
        scale: f32,
    },

    /// The data-parallel all-reduce failed or the ranks disagree (model layout, settings,
    /// accumulation count); the [`DistributedError`](crate::distributed::DistributedError) says
    /// which.
    #[cfg(feature = "mpi")]
    #[error("data-parallel step: {0}")]
    Distributed(#[from] crate::distributed::DistributedError),
}

/// dfdx reports a module's and a backward pass's errors as `CpuError`, so a step that returns
/// dfdx's error type (`Result<_, D::Err>`) can still use `?` on a mixed backward pass.
///
/// `CpuError` has two variants, `OutOfMemory` and `WrongNumElements`, so only the causes that
/// are one of them convert:
/// - a device error ([`StepError::Device`], or the optimizer's `DeviceError` inside
///   [`StepError::Optimizer`]) as itself;
/// - tensors that did not line up ([`StepError::MasterChanged`], [`StepError::PartsState`],
///   [`StepError::NotAPart`], [`StepError::PartsOverlap`], [`StepError::OtherPart`],
///   [`StepError::Cast`], the optimizer's `UnusedParams`) as
///   `WrongNumElements`.
///
/// # Panics
/// On the causes `CpuError` has no variant for ([`StepError::TooManySkips`],
/// [`StepError::ScaleStuck`], [`StepError::InvalidScale`], [`StepError::NoBackward`], ...),
/// with the error's own message: `CpuError` has no variant for either, and reporting them as a shape or memory
/// error would send the reader after the wrong cause. A step that should handle them returns
/// [`StepError`] or `Box<dyn Error>` (both keep the cause); dfdx's own `backward` and `update`
/// panic on errors the same way.
///
/// # Examples
/// ```
/// use dfdx::tensor::CpuError;
/// use mpx_runtime::step::StepError;
/// let err = StepError::from(CpuError::OutOfMemory);
/// assert!(matches!(CpuError::from(err), CpuError::OutOfMemory));
/// ```
impl From<StepError> for CpuError {
    fn from(e: StepError) -> Self {
        match e {
            StepError::Device(e) | StepError::Optimizer(OptimizerUpdateError::DeviceError(e)) => e,
            StepError::MasterChanged { .. }
            | StepError::PartsState { .. }
            | StepError::NotAPart { .. }
            | StepError::PartsOverlap { .. }
            | StepError::OtherPart { .. }
            | StepError::Cast(_)
            | StepError::Optimizer(OptimizerUpdateError::UnusedParams(_)) => {
                CpuError::WrongNumElements
            }
            e @ (StepError::TooManySkips { .. }
            | StepError::ScaleStuck { .. }
            | StepError::InvalidScale { .. }
            | StepError::InvalidClip { .. }
            | StepError::UnknownMaster { .. }
            | StepError::NoBackward { .. }
            | StepError::NoTensors { .. }
            | StepError::FieldTrainable { .. }
            | StepError::OtherScaler
            | StepError::Checkpoint(_)) => {
                panic!(
                    "{e} (dfdx's CpuError cannot carry this cause: return StepError or Box<dyn Error> from the step to handle it)"
                )
            }
            #[cfg(feature = "mpi")]
            e @ StepError::Distributed(_) => {
                panic!(
                    "{e} (dfdx's CpuError cannot carry this cause: return StepError or Box<dyn Error> from the step to handle it)"
                )
            }
            #[cfg(feature = "cuda")]
            StepError::Cuda(dfdx::tensor::CudaError::Cpu(e)) => e,
            #[cfg(feature = "cuda")]
            e @ (StepError::Cuda(_) | StepError::CudaOptimizer(_) | StepError::CudaKernels(_)) => {
                panic!(
                    "{e} (a CUDA device's error is not a CpuError: a step on `Cuda` returns CudaError, StepError or Box<dyn Error>)"
                )
            }
        }
    }
}

/// A step on dfdx's `Cuda` device that returns `Result<_, CudaError>` can use `?` on the mixed
/// step's calls: the device's own errors come back as themselves, the others as `CpuError`s
/// inside `CudaError::Cpu` (see `From<StepError> for CpuError`, whose panics apply here too).
///
/// # Examples
/// ```no_run
/// use dfdx::tensor::{CpuError, CudaError};
/// use mpx_runtime::step::StepError;
/// let err = StepError::from(CpuError::OutOfMemory);
/// assert!(matches!(CudaError::from(err), CudaError::Cpu(CpuError::OutOfMemory)));
/// ```
#[cfg(feature = "cuda")]
impl From<StepError> for dfdx::tensor::CudaError {
    fn from(e: StepError) -> Self {
        match e {
            StepError::Cuda(e) | StepError::CudaOptimizer(OptimizerUpdateError::DeviceError(e)) => {
                e
            }
            StepError::CudaOptimizer(OptimizerUpdateError::UnusedParams(_)) => {
                Self::Cpu(CpuError::WrongNumElements)
            }
            e => Self::Cpu(CpuError::from(e)),
        }
    }
}

/// An optimizer update that `#[mixed_step]` rewrote returns the type the step's own
/// `opt.update(..)` returns, so every `?` and `unwrap` on it works as before: the step's own
/// causes arrive as the optimizer's `DeviceError`, by way of `From<StepError> for CpuError`
/// (whose panics apply: a cause `CpuError` cannot carry stops the step with its own message).
///
/// # Examples
/// ```
/// use dfdx::optim::OptimizerUpdateError;
/// use dfdx::tensor::CpuError;
/// use mpx_runtime::step::StepError;
/// let e = OptimizerUpdateError::<CpuError>::from(StepError::from(CpuError::OutOfMemory));
/// assert!(matches!(e, OptimizerUpdateError::DeviceError(CpuError::OutOfMemory)));
/// ```
impl From<StepError> for OptimizerUpdateError<CpuError> {
    fn from(e: StepError) -> Self {
        match e {
            StepError::Optimizer(e) => e,
            e => OptimizerUpdateError::DeviceError(CpuError::from(e)),
        }
    }
}

/// The same for a step on dfdx's `Cuda` device, whose optimizers return
/// `OptimizerUpdateError<CudaError>`: the optimizer's own error as itself, the step's other causes
/// as its `DeviceError`, by way of `From<StepError> for CudaError`.
///
/// # Examples
/// ```no_run
/// use dfdx::optim::OptimizerUpdateError;
/// use dfdx::tensor::{CpuError, CudaError};
/// use mpx_runtime::step::StepError;
/// let e = OptimizerUpdateError::<CudaError>::from(StepError::from(CpuError::OutOfMemory));
/// assert!(matches!(e, OptimizerUpdateError::DeviceError(CudaError::Cpu(CpuError::OutOfMemory))));
/// ```
#[cfg(feature = "cuda")]
impl From<StepError> for OptimizerUpdateError<dfdx::tensor::CudaError> {
    fn from(e: StepError) -> Self {
        match e {
            StepError::CudaOptimizer(e) => e,
            e => OptimizerUpdateError::DeviceError(dfdx::tensor::CudaError::from(e)),
        }
    }
}

/// What went wrong and what to do, as [`Display`](std::fmt::Display) writes it (followed by
/// its sources), so that a step's error reached through `unwrap` or `expect`
/// reads as a sentence rather than a struct.
impl std::fmt::Debug for StepError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")?;
        let mut source = std::error::Error::source(self);
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}

impl From<OptimizerUpdateError<CpuError>> for StepError {
    fn from(e: OptimizerUpdateError<CpuError>) -> Self {
        Self::Optimizer(e)
    }
}

#[cfg(feature = "cuda")]
impl From<dfdx::tensor::CudaError> for StepError {
    fn from(e: dfdx::tensor::CudaError) -> Self {
        Self::Cuda(e)
    }
}

#[cfg(feature = "cuda")]
impl From<OptimizerUpdateError<dfdx::tensor::CudaError>> for StepError {
    fn from(e: OptimizerUpdateError<dfdx::tensor::CudaError>) -> Self {
        Self::CudaOptimizer(e)
    }
}
