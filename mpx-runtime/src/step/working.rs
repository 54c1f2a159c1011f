//! The buffers a [`GradScaler`](super::GradScaler) keeps for one master model: the half working
//! copy, its reusable gradient buffers, and the pass that moves its gradients to the master.

use std::any::Any;
use std::marker::PhantomData;
use std::sync::{Arc, PoisonError};

use dfdx::nn::ZeroGrads;
use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::{Cpu, Gradients, Tensor};

use super::device::{MixedDevice, check_all};
use super::direct::Direct;
use super::error::StepError;
use super::half_region::Stash;
use super::layout::{
    EachTensor, MasterSlot, WorkingCopy, count_mismatch, each_tensor, len_mismatch, master_layout,
};
use super::mapped::HalfLayers;
use super::workspace::{AnyFn, ErasedWorking, StateFn, Workspace};
use crate::boundary::MasterModel;
use crate::cast::CastScratch;
use crate::precision::Precision;

/// A working copy the scaler can keep for a master on device `D`: on the `Cpu` any `Send +
/// Sync` module (so that the scaler is `Send + Sync`); on `Cuda` any module (dfdx's `Cuda`
/// tensors are neither, so a master's `Cuda` workspace stays on the thread that ran its first
/// forward pass, as the master itself does).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::step::{WorkingCopy, WorkspaceOn};
/// fn keeps<W: WorkspaceOn<Cpu>>() {}
/// keeps::<WorkingCopy<f16, dfdx::nn::modules::Linear<2, 3, f32, Cpu>>>();
/// ```
pub trait WorkspaceOn<D>: Sized + 'static {
    /// Boxes a workspace whose working copy is `Self`.
    #[doc(hidden)]
    fn hold<H, M, K>(w: Working<H, M, K, D>) -> Box<dyn ErasedWorking>
    where
        H: Precision,
        D: MixedDevice<H>,
        M: MasterModel<D> + 'static,
        K: Kind<H, M, D, Copy = Self>;
}

impl<T: Send + Sync + 'static> WorkspaceOn<Cpu> for T {
    fn hold<H, M, K>(w: Working<H, M, K, Cpu>) -> Box<dyn ErasedWorking>
    where
        H: Precision,
        Cpu: MixedDevice<H>,
        M: MasterModel<Cpu> + 'static,
        K: Kind<H, M, Cpu, Copy = T>,
    {
        Box::new(w)
    }
}

#[cfg(feature = "cuda")]
impl<T: 'static> WorkspaceOn<dfdx::tensor::Cuda> for T {
    fn hold<H, M, K>(w: Working<H, M, K, dfdx::tensor::Cuda>) -> Box<dyn ErasedWorking>
    where
        H: Precision,
        dfdx::tensor::Cuda: MixedDevice<H>,
        M: MasterModel<dfdx::tensor::Cuda> + 'static,
        K: Kind<H, M, dfdx::tensor::Cuda, Copy = T>,
    {
        Box::new(super::local::Local::new(w))
    }
}

/// How a master's working copy is made: [`Same`] (the master's own layers in `H`) or
/// [`Mapped`] (mpx's layers, [`HalfLayers`]).
pub trait Kind<H: Precision, M: MasterModel<D>, D: MixedDevice<H>>: 'static {
    /// The working copy.
    type Copy: TensorCollection<H::Elem, D> + 'static;
    /// Whether the working copy is made of mpx's layers.
    const MAPPED: bool;
    /// The working copy with `master`'s values: `half` cast in place, or built when `None`.
    fn refresh(
        master: &M,
        half: Option<Self::Copy>,
        scratch: &mut CastScratch,
    ) -> Result<Self::Copy, StepError>;
    /// Boxes the workspace for the scaler.
    fn hold(w: Working<H, M, Self, D>) -> Box<dyn ErasedWorking>
    where
        Self: Sized,
        M: 'static;
}

/// The working copy is the master's own module in `H` ([`WorkingCopy`]).
pub(crate) struct Same;

/// The working copy is made of mpx's layers ([`HalfLayers::Working`]).
pub(crate) struct Mapped;

impl<H: Precision, D: MixedDevice<H>, M: MasterModel<D>> Kind<H, M, D> for Same
where
    WorkingCopy<H, M, D>: TensorCollection<H::Elem, D> + WorkspaceOn<D>,
{
    type Copy = WorkingCopy<H, M, D>;
    const MAPPED: bool = false;
    fn refresh(
        master: &M,
        half: Option<Self::Copy>,
        scratch: &mut CastScratch,
    ) -> Result<Self::Copy, StepError> {
        D::refresh_same::<M>(master, half, scratch)
    }
    fn hold(w: Working<H, M, Self, D>) -> Box<dyn ErasedWorking>
    where
        M: 'static,
    {
        <WorkingCopy<H, M, D> as WorkspaceOn<D>>::hold(w)
    }
}

impl<H: Precision, M: HalfLayers<H>> Kind<H, M, Cpu> for Mapped
where
    Cpu: MixedDevice<H>,
{
    type Copy = M::Working;
    const MAPPED: bool = true;
    fn refresh(
        master: &M,
        half: Option<Self::Copy>,
        scratch: &mut CastScratch,
    ) -> Result<Self::Copy, StepError> {
        super::mapped::refresh::<H, M>(master, half, scratch)
    }
    fn hold(w: Working<H, M, Self, Cpu>) -> Box<dyn ErasedWorking>
    where
        M: 'static,
    {
        Box::new(w)
    }
}

/// A forward pass's working copy and gradient buffers.
type Prepared<'a, H, C, D> = (
    &'a mut C,
    Gradients<<H as crate::precision::Precision>::Elem, D>,
);

/// The typed workspace for master model `M` in precision `H` on device `D`, with the working
/// copy of kind `K`.
pub struct Working<H: Precision, M: MasterModel<D>, K: Kind<H, M, D>, D: MixedDevice<H>> {
    /// The working copy; `None` for an identity precision between steps (it shares the
    /// master's buffers, which the optimizer must own alone).
    half: Option<K::Copy>,
    /// Whether `half` was cast from the master since the last backward or update.
    fresh: bool,
    /// Zeroed half gradient buffers keyed by the working copy, ready for the next forward.
    pub(crate) pool: Vec<Gradients<H::Elem, D>>,
    pub(crate) stash: Stash<H::Elem, D>,
    master: Arc<[MasterSlot<D>]>,
    /// What the linked fused layers share with the workspace ([`super::direct`]; the `Cpu`'s
    /// alone).
    pub(crate) direct: Option<Arc<Direct>>,
    /// The reciprocal of the scale the last forward pass applied.
    pub(crate) inv: f32,
    /// The positions the linked layers wrote in the last backward (reused buffer).
    written: Vec<bool>,
    scratch: CastScratch,
    /// Non-parameter tensors (batch-norm statistics) of the working copy, widened; every one is
    /// written back on an applied step.
    state: Vec<Vec<f32>>,
    marker: PhantomData<fn() -> (M, K)>,
}

impl<H, M, K, D> Working<H, M, K, D>
where
    H: Precision,
    D: MixedDevice<H>,
    M: MasterModel<D> + 'static,
    K: Kind<H, M, D>,
{
    /// Records the master's layout; the working copy is cast on the first forward.
    pub(crate) fn new(master: &M) -> Result<Self, StepError> {
        let layout = master_layout::<D, M>(master).map_err(D::step_error)?;
        let slots: Arc<[MasterSlot<D>]> = layout.slots.into();
        Ok(Self {
            half: None,
            fresh: false,
            pool: Vec::new(),
            stash: Arc::default(),
            direct: D::links(&slots),
            inv: 1.0,
            written: Vec::new(),
            master: slots,
            scratch: CastScratch::default(),
            state: layout.state_lens.iter().map(|&n| vec![0.0; n]).collect(),
            marker: PhantomData,
        })
    }

    /// The working copy, cast from `master` if it is not fresh, and a gradient buffer for its
    /// forward pass.
    pub(crate) fn prepare(&mut self, master: &M) -> Result<Prepared<'_, H, K::Copy, D>, StepError> {
        if !self.fresh || self.half.is_none() {
            let half = K::refresh(master, self.half.take(), &mut self.scratch)?;
            self.half = Some(half);
            self.fresh = true;
        }
        let Some(half) = self.half.as_mut() else {
            return Err(StepError::Cast(crate::cast::CastError::NotRebuilt));
        };
        // Reused buffers only where the working copy keeps its tensors (their ids key them).
        let grads = match self.pool.pop().filter(|_| D::IN_PLACE) {
            Some(g) => g,
            None => half.try_alloc_grads().map_err(D::step_error)?,
        };
        Ok((half, grads))
    }

    /// After a backward pass: reads the working copy's non-parameter tensors (batch-norm
    /// running statistics its forward pass updated), to be written into the master if the
    /// update is applied; then lets go of an identity working copy's shared buffers, which the
    /// optimizer must own alone.
    fn finish_backward(&mut self) -> Result<(), StepError> {
        if !self.state.is_empty()
            && let Some(half) = &self.half
        {
            let mut read = ReadState::<H> {
                out: &mut self.state,
                index: 0,
                marker: std::marker::PhantomData,
            };
            each_tensor::<H::Elem, D, K::Copy, _>(half, &mut read, D::step_error)?;
        }
        if H::IDENTITY {
            self.half = None;
        }
        self.fresh = false;
        Ok(())
    }
}

impl<H, M, K, D> Workspace for Working<H, M, K, D>
where
    H: Precision,
    D: MixedDevice<H>,
    M: MasterModel<D> + 'static,
    K: Kind<H, M, D>,
{
    fn transfer(&mut self, grads: &mut dyn Any) -> Result<Option<bool>, StepError> {
        let mut half_grads: Vec<Gradients<H::Elem, D>> = self
            .stash
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
            .collect();
        let mut finite = match &self.direct {
            Some(d) => d.drain(&mut self.written),
            None => true,
        };
        if half_grads.is_empty() && !self.written.contains(&true) {
            return Ok(None);
        }
        let Some(grads) = grads.downcast_mut::<Gradients<f32, D>>() else {
            // A backward pass on another device cannot have reached this master: its stash
            // waits for its own.
            self.stash
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .append(&mut half_grads);
            return Ok(None);
        };
        // The next forward casts the master again (the user may change it before then).
        self.fresh = false;
        match (&self.half, half_grads.is_empty()) {
            (Some(half), false) => {
                let mut mover = Mover::<H, D> {
                    half_grads: &mut half_grads,
                    master_grads: grads,
                    master: &self.master,
                    inv_scale: self.inv,
                    written: &self.written,
                    finite: D::Finite::default(),
                    index: 0,
                };
                each_tensor::<H::Elem, D, K::Copy, _>(half, &mut mover, D::step_error)?;
                let seen = mover.index;
                if seen != self.master.len() {
                    return Err(count_mismatch(self.master.len(), seen));
                }
                finite &= D::verdict(mover.finite)?;
            }
            _ => {
                // No half contribution: the gradients are plain f32 ones; still check them.
                finite &= check_all::<H, D>(&self.master, grads)?;
            }
        }
        if D::IN_PLACE {
            self.pool.append(&mut half_grads);
        }
        self.finish_backward()?;
        Ok(Some(finite))
    }

    fn with_state(&self, f: &mut StateFn<'_>) -> Result<(), StepError> {
        f(&self.state)
    }

    fn mapped(&self) -> bool {
        K::MAPPED
    }

    fn check(&self, grads: &mut dyn Any) -> Result<bool, StepError> {
        match grads.downcast_mut::<Gradients<f32, D>>() {
            Some(grads) => check_all::<H, D>(&self.master, grads),
            None => Ok(true),
        }
    }

    fn with_any(&mut self, f: &mut AnyFn<'_>) -> Result<(), StepError> {
        f(self)
    }

    #[cfg(feature = "mpi")]
    fn master_slots(&self) -> &[MasterSlot] {
        let any: &dyn Any = &self.master;
        any.downcast_ref::<Arc<[MasterSlot]>>()
            .map_or(&[], |s| &s[..])
    }
}

/// Walks the working copy: each trainable tensor's half gradients (from every finished
/// backward) are added, unscaled, to the master's entry at the same position.
struct Mover<'a, H: Precision, D: MixedDevice<H>> {
    half_grads: &'a mut [Gradients<H::Elem, D>],
    master_grads: &'a mut Gradients<f32, D>,
    master: &'a [MasterSlot<D>],
    inv_scale: f32,
    /// Positions a linked layer wrote directly: their half gradients are moved only when
    /// something else also added to them.
    written: &'a [bool],
    finite: D::Finite,
    index: usize,
}

impl<H: Precision, D: MixedDevice<H>> EachTensor<H::Elem, D> for Mover<'_, H, D> {
    type Error = StepError;
    fn tensor<S: Shape>(
        &mut self,
        trainable: bool,
        t: &Tensor<S, H::Elem, D>,
    ) -> Result<(), StepError> {
        if !trainable {
            return Ok(());
        }
        let i = self.index;
        self.index += 1;
        let Some(slot) = self.master.get(i) else {
            return Err(count_mismatch(self.master.len(), i + 1));
        };
        let n = t.shape().num_elements();
        if slot.len != n {
            return Err(len_mismatch(i, slot.len, n));
        }
        let direct = self.written.get(i).copied().unwrap_or(false);
        for g in self.half_grads.iter_mut() {
            D::accumulate(
                g,
                t,
                slot,
                i,
                self.master_grads,
                self.inv_scale,
                direct,
                &mut self.finite,
            )?;
        }
        Ok(())
    }
}

/// Reads the working copy's non-parameter tensors, widened to f32.
struct ReadState<'a, H> {
    out: &'a mut [Vec<f32>],
    index: usize,
    marker: std::marker::PhantomData<H>,
}

impl<H: Precision, D: MixedDevice<H>> EachTensor<H::Elem, D> for ReadState<'_, H> {
    type Error = StepError;
    fn tensor<S: Shape>(
        &mut self,
        trainable: bool,
        t: &Tensor<S, H::Elem, D>,
    ) -> Result<(), StepError> {
        if trainable {
            return Ok(());
        }
        let j = self.index;
        self.index += 1;
        let n = t.shape().num_elements();
        match self.out.get_mut(j) {
            Some(dst) if dst.len() == n => {
                H::widen(&t.as_vec(), dst);
                Ok(())
            }
            Some(dst) => Err(len_mismatch(j, dst.len(), n)),
            None => Err(count_mismatch(self.out.len(), j + 1)),
        }
    }
}
