//! [`MixedWorkspace`]: the buffers a mixed step reuses (half working copy, gradients, scratch).

use std::cell::Cell;
use std::time::Duration;

use dfdx::nn::ZeroGrads;
use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorRef,
};
use dfdx::shapes::{Dtype, HasShape, Rank0, Shape};
use dfdx::tensor::{Cpu, CpuError, Gradients, Tensor, TensorFromVec, ZerosTensor};
use dfdx::tensor_ops::Device;

use super::error::StepError;
use crate::boundary::MasterModel;
use crate::cast::{CastScratch, cast_module_into, try_cast_module};
use crate::precision::Precision;

/// The working copy of master model `M` in precision `H`: the same module with its float tensors
/// stored as `H::Elem` (`f16`, `AMP<f16>`, or `f32` for emulated bf16).
pub type WorkingCopy<H, M> =
    <M as TensorCollection<f32, Cpu>>::To<<H as crate::precision::Precision>::Elem, Cpu>;

/// Wall-clock time of each phase of the last mixed gradient computation, for profiling (the
/// breakdown of `examples/bench_step.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimings {
    /// Master -> working copy cast.
    pub cast: Duration,
    /// The `forward` closure (half precision, traced).
    pub forward: Duration,
    /// The f32 side: output widening, `loss`, its scaled backward, the output gradient's cast.
    pub loss: Duration,
    /// Backward through the half graph.
    pub backward: Duration,
    /// The one pass moving gradients to the master (widen, check, unscale, zero).
    pub transfer: Duration,
}

impl StepTimings {
    /// Sum of all phases.
    pub fn total(&self) -> Duration {
        self.cast + self.forward + self.loss + self.backward + self.transfer
    }
}

/// Hands out one master gradient buffer; built once per trainable master tensor (it holds a
/// data-free "ghost" of the tensor, keyed by the tensor's id; dfdx does not let the ghost's type
/// be named). `Send + Sync`, so the state that holds it can be.
pub(crate) type GradSlot = Box<
    dyn for<'a> Fn(&'a mut Gradients<f32, Cpu>) -> Result<&'a mut [f32], CpuError> + Send + Sync,
>;

/// A gradient buffer of the f32 master, with its element count.
pub(crate) struct MasterSlot {
    pub(crate) len: usize,
    pub(crate) get: GradSlot,
}

/// Constrains a closure to the higher-ranked signature of [`GradSlot`].
fn slot<F>(f: F) -> F
where
    F: for<'a> Fn(&'a mut Gradients<f32, Cpu>) -> Result<&'a mut [f32], CpuError>,
{
    f
}

/// The reusable state of a mixed step for master model `M` and half precision `H`: the working
/// copy, its gradient buffers, the f32 master-shaped gradients and scratch space. Build it once
/// from the master, pass it to every [`filter_value_and_grad`](super::filter_value_and_grad) call:
/// no large buffer is allocated per step. (mpx has no counterpart: JAX allocates inside `jit`.)
///
/// It also counts skipped steps and holds the optional limit on consecutive skips (optax's
/// `apply_if_finite(max_consecutive_errors)`, except that exceeding the limit is an error here,
/// never a corrupting update).
///
/// The workspace belongs to the master it was built from (and to clones of it, which share tensor
/// ids). A workspace built from another model returns [`StepError::WorkspaceMismatch`] or, at
/// the update, [`StepError::Optimizer`].
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::step::MixedWorkspace;
/// let dev = Cpu::default();
/// let master = dev.build_module::<(Linear<4, 8>, ReLU, Linear<8, 2>), f32>();
/// let ws = MixedWorkspace::<f16, _>::new(&master)?.with_max_consecutive_skips(100);
/// let half = ws.working_copy().expect("an f16 workspace keeps its working copy");
/// assert_eq!(half.0.weight.array()[0][0], f16::from_f32(master.0.weight.array()[0][0]));
/// assert_eq!(ws.skipped_steps(), 0);
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
pub struct MixedWorkspace<H: Precision, M: MasterModel>
where
    Cpu: Device<H::Elem>,
{
    pub(super) dev: Cpu,
    /// `None` only for an [`IDENTITY`](Precision::IDENTITY) precision between steps: its
    /// working copy shares the master's buffers and is released before the update.
    pub(super) half: Option<WorkingCopy<H, M>>,
    /// The working copy's gradients; `None` only while a step holds them on its tape.
    pub(super) half_grads: Option<Gradients<H::Elem, Cpu>>,
    pub(super) master_grads: Gradients<f32, Cpu>,
    pub(super) slots: Vec<MasterSlot>,
    /// Reused buffers of the in-place cast master -> working copy.
    pub(super) cast_scratch: CastScratch,
    /// Non-parameter tensors (batch-norm running statistics): their working-copy values right
    /// after the cast, and their f32 values after the forward pass, with a changed flag.
    pub(super) state_before: Vec<Vec<H::Elem>>,
    pub(super) state_after: Vec<Vec<f32>>,
    pub(super) state_changed: Vec<bool>,
    pub(super) state_scratch: Vec<H::Elem>,
    /// A rank-0 tensor whose tape carries the working copy's gradients into the forward pass.
    pub(super) anchor: Tensor<Rank0, H::Elem, Cpu>,
    pub(super) timings: StepTimings,
    pub(super) max_consecutive_skips: Option<u64>,
    pub(super) consecutive_skips: Cell<u64>,
    pub(super) skipped_steps: Cell<u64>,
    pub(super) applied_steps: Cell<u64>,
}

impl<H: Precision, M: MasterModel> MixedWorkspace<H, M>
where
    Cpu: Device<H::Elem>,
    WorkingCopy<H, M>: TensorCollection<H::Elem, Cpu>,
{
    /// Builds the workspace for `master`: casts a working copy, allocates its gradients and the
    /// f32 master-shaped gradients.
    ///
    /// # Errors
    /// [`StepError::Device`] when the device cannot allocate.
    pub fn new(master: &M) -> Result<Self, StepError> {
        let dev = Cpu::default();
        let half = if H::IDENTITY {
            None
        } else {
            Some(try_cast_module::<H, f32, M>(master)?)
        };
        // An identity working copy carries the master's tensor ids: its gradients are keyed
        // like the master's.
        let half_grads = match &half {
            Some(h) => h.try_alloc_grads()?,
            None => share::<H, M>(master)?.try_alloc_grads()?,
        };
        let master_grads = master.try_alloc_grads()?;
        let layout = master_layout(master)?;
        let zero = H::Elem::default();
        let anchor = dev.try_zeros()?;
        let mut ws = Self {
            dev,
            half,
            half_grads: Some(half_grads),
            master_grads,
            slots: layout.slots,
            cast_scratch: CastScratch::default(),
            state_before: layout.state_lens.iter().map(|&n| vec![zero; n]).collect(),
            state_after: layout.state_lens.iter().map(|&n| vec![0.0; n]).collect(),
            state_changed: vec![false; layout.state_lens.len()],
            state_scratch: vec![zero; layout.state_lens.iter().copied().max().unwrap_or(0)],
            anchor,
            timings: StepTimings::default(),
            max_consecutive_skips: None,
            consecutive_skips: Cell::new(0),
            skipped_steps: Cell::new(0),
            applied_steps: Cell::new(0),
        };
        // The working copy is fresh; record its buffers' cast values for change detection.
        ws.refresh(master)?;
        if H::IDENTITY {
            // Do not hold the master's buffers between steps (the optimizer would copy them).
            ws.half = None;
        }
        Ok(ws)
    }

    /// Sets a limit on consecutive skipped steps: the `(limit + 1)`-th skip in a row makes
    /// [`optimizer_update`](super::optimizer_update) return [`StepError::TooManySkips`] (master
    /// and optimizer still untouched). Off by default. optax's `apply_if_finite` applies the bad
    /// update at that point instead; mpx and PyTorch have no limit.
    #[must_use]
    pub fn with_max_consecutive_skips(mut self, limit: u64) -> Self {
        self.max_consecutive_skips = Some(limit);
        self
    }

    /// The working copy as the last step left it (after its forward pass). `None` for an `f32`
    /// working copy, which shares the master's buffers only during a step.
    pub fn working_copy(&self) -> Option<&WorkingCopy<H, M>> {
        self.half.as_ref()
    }

    /// Where the last [`filter_value_and_grad`](super::filter_value_and_grad) call spent its
    /// time (measured with `Instant` on every call; a few tens of nanoseconds).
    pub fn last_timings(&self) -> StepTimings {
        self.timings
    }

    /// Steps skipped so far (non-finite gradients or loss).
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps.get()
    }

    /// Skipped steps in a row, up to the last update call.
    pub fn consecutive_skips(&self) -> u64 {
        self.consecutive_skips.get()
    }

    /// Steps whose update was applied.
    pub fn applied_steps(&self) -> u64 {
        self.applied_steps.get()
    }

    /// Rewrites the working copy from the master, in place (the cast module's
    /// `cast_module_into`, no allocation after the first step), then snapshots the working
    /// copy's non-parameter tensors so the step can tell which ones its forward pass changed.
    pub(super) fn refresh(&mut self, master: &M) -> Result<(), StepError> {
        let half = match self.half.take() {
            Some(mut half) if !H::IDENTITY => {
                cast_module_into::<H, f32, M>(master, &mut half, &mut self.cast_scratch)?;
                half
            }
            _ => share::<H, M>(master)?,
        };
        let half = self.half.insert(half);
        if self.state_before.is_empty() {
            return Ok(());
        }
        let mut snap = SnapshotState::<H::Elem> {
            before: &mut self.state_before,
            index: 0,
            mismatch: None,
        };
        <WorkingCopy<H, M> as TensorCollection<H::Elem, Cpu>>::iter_tensors(
            &mut RecursiveWalker {
                m: &*half,
                f: &mut snap,
            },
        )?;
        match snap.mismatch {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The working copy of an [`IDENTITY`](Precision::IDENTITY) precision: the master's own
/// tensors (same ids, shared buffers, nothing copied).
pub(super) fn share<H: Precision, M: MasterModel>(
    master: &M,
) -> Result<WorkingCopy<H, M>, StepError>
where
    Cpu: Device<H::Elem>,
{
    M::iter_tensors(&mut RecursiveWalker {
        m: master,
        f: &mut Share::<H>(std::marker::PhantomData),
    })?
    .ok_or(StepError::Cast(crate::cast::CastError::NotRebuilt))
}

pub(super) fn count_mismatch(expected: usize, found: usize) -> StepError {
    StepError::WorkspaceMismatch {
        expected: format!("{expected} tensors"),
        found: format!("{found}"),
    }
}

pub(super) fn len_mismatch(index: usize, expected: usize, found: usize) -> StepError {
    StepError::WorkspaceMismatch {
        expected: format!("{expected} elements in tensor #{index}"),
        found: format!("{found}"),
    }
}

// ---- visitors ------------------------------------------------------------------------------

/// Rebuilds a module from clones of its tensors (shared buffers). For a precision whose element
/// is not `f32` it falls back to a converting copy.
struct Share<H>(std::marker::PhantomData<H>);

impl<H: Precision> TensorVisitor<f32, Cpu> for Share<H>
where
    Cpu: Device<H::Elem>,
{
    type Viewer = ViewTensorRef;
    type Err = CpuError;
    type E2 = H::Elem;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        _opts: TensorOptions<S, f32, Cpu>,
        t: &Tensor<S, f32, Cpu>,
    ) -> Result<Option<Tensor<S, H::Elem, Cpu>>, CpuError> {
        let mut shared = Some(t.clone());
        let any: &mut dyn std::any::Any = &mut shared;
        if let Some(same) = any.downcast_mut::<Option<Tensor<S, H::Elem, Cpu>>>() {
            return Ok(same.take());
        }
        let n = t.shape().num_elements();
        let mut src = vec![0.0f32; n];
        t.copy_into(&mut src);
        let mut dst = vec![H::Elem::default(); n];
        H::round(&src, &mut dst);
        Ok(Some(t.device().try_tensor_from_vec(dst, *t.shape())?))
    }
}

/// The master's layout: a gradient slot per trainable tensor, in visit order, and the element
/// count of each non-parameter tensor (batch-norm statistics).
pub(super) struct Layout {
    pub(super) slots: Vec<MasterSlot>,
    pub(super) state_lens: Vec<usize>,
}

/// Walks `master` once and records its [`Layout`].
pub(super) fn master_layout<M: MasterModel>(master: &M) -> Result<Layout, CpuError> {
    let mut layout = Layout {
        slots: Vec::new(),
        state_lens: Vec::new(),
    };
    M::iter_tensors(&mut RecursiveWalker {
        m: master,
        f: &mut layout,
    })?;
    Ok(layout)
}

impl TensorVisitor<f32, Cpu> for Layout {
    type Viewer = ViewTensorRef;
    type Err = CpuError;
    type E2 = f32;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, f32, Cpu>,
        t: &Tensor<S, f32, Cpu>,
    ) -> Result<Option<Tensor<S, f32, Cpu>>, CpuError> {
        let n = t.shape().num_elements();
        if opts.do_gradient_update {
            let ghost = t.ghost();
            let get: GradSlot = Box::new(slot(move |g: &mut Gradients<f32, Cpu>| {
                let buf = g.get_or_alloc_mut(&ghost)?;
                Ok(&mut buf[..])
            }));
            self.slots.push(MasterSlot { len: n, get });
        } else {
            self.state_lens.push(n);
        }
        Ok(None)
    }
}

/// Copies the working copy's non-parameter tensors (right after the cast) into `before`.
struct SnapshotState<'a, E> {
    before: &'a mut [Vec<E>],
    index: usize,
    mismatch: Option<StepError>,
}

impl<E: Dtype> TensorVisitor<E, Cpu> for SnapshotState<'_, E>
where
    Cpu: Device<E>,
{
    type Viewer = ViewTensorRef;
    type Err = CpuError;
    type E2 = E;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, E, Cpu>,
        t: &Tensor<S, E, Cpu>,
    ) -> Result<Option<Tensor<S, E, Cpu>>, CpuError> {
        if opts.do_gradient_update || self.mismatch.is_some() {
            return Ok(None);
        }
        let j = self.index;
        self.index += 1;
        let n = t.shape().num_elements();
        match self.before.get_mut(j) {
            Some(buf) if buf.len() == n => t.copy_into(buf),
            Some(buf) => self.mismatch = Some(len_mismatch(j, buf.len(), n)),
            None => self.mismatch = Some(count_mismatch(self.before.len(), j + 1)),
        }
        Ok(None)
    }
}
