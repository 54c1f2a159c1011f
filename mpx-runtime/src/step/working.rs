//! The buffers a [`GradScaler`](super::GradScaler) keeps for one master model: the half working
//! copy, its reusable gradient buffers, and the pass that moves its gradients to the master.

use std::any::Any;
use std::marker::PhantomData;
use std::sync::{Arc, PoisonError};

use dfdx::nn::ZeroGrads;
use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorRef,
};
use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, Gradients, Tensor};
use dfdx::tensor_ops::Device;

use super::direct::{Direct, all_zero};
use super::error::StepError;
use super::half_region::Stash;
use super::layout::{MasterSlot, WorkingCopy, count_mismatch, len_mismatch, master_layout, share};
use super::mapped::{HalfLayers, MapScratch};
use crate::boundary::MasterModel;
use crate::cast::{CastScratch, cast_module_into, grad_slice, try_cast_module};
use crate::finite::{add_scaled_checked, all_finite_f32};
use crate::precision::Precision;

/// What the scaler does with a master's workspace without knowing the model's type.
pub(crate) trait ErasedWorking: Any + Send + Sync {
    /// Moves every finished backward's half gradients into `grads` (the master's f32
    /// gradients, keyed by its tensors), unscaled, and checks the master's gradients for
    /// finiteness on the way. Returns `None` when no backward reached this working copy since
    /// the last call, else whether all were finite.
    fn transfer(&mut self, grads: &mut Gradients<f32, Cpu>) -> Result<Option<bool>, StepError>;
    /// Whether the master's gradients in `grads` are all finite (a slot `grads` lacks is
    /// allocated as zeros).
    fn check(&self, grads: &mut Gradients<f32, Cpu>) -> Result<bool, StepError>;
    /// The working copy's non-parameter tensors (batch-norm statistics) after the last backward
    /// pass, widened to f32, in the master's visit order.
    fn state(&self) -> &[Vec<f32>];
    /// Marks an f32-run master's forward pass (see [`super::full`]); `false` for a half
    /// working copy, which is not run that way.
    fn mark_used(&mut self) -> bool {
        false
    }
    /// Whether the master's forward passes run in f32 on the master itself.
    fn in_f32(&self) -> bool {
        false
    }
    /// Whether the working copy is made of mpx's layers ([`super::HalfLayers`]).
    fn mapped(&self) -> bool {
        false
    }
    /// The workspace, as `Any`, to get the typed workspace back.
    fn as_any_mut(&mut self) -> &mut dyn Any;
    /// The master's gradient slots, one per trainable tensor in visit order (what the
    /// data-parallel all-reduce packs).
    #[cfg(feature = "mpi")]
    fn master_slots(&self) -> &[MasterSlot];
}

/// How a master's working copy is made: [`Same`] (the master's own layers in `H`) or
/// [`Mapped`] (mpx's layers, [`HalfLayers`]).
pub(crate) trait Kind<H: Precision, M: MasterModel>: 'static
where
    Cpu: Device<H::Elem>,
{
    /// The working copy.
    type Copy: TensorCollection<H::Elem, Cpu> + Send + Sync + 'static;
    /// Whether the working copy is made of mpx's layers.
    const MAPPED: bool;
    /// The working copy with `master`'s values: `half` cast in place, or built when `None`.
    fn refresh(
        master: &M,
        half: Option<Self::Copy>,
        scratch: &mut Scratch<H::Elem>,
    ) -> Result<Self::Copy, StepError>;
}

/// The working copy is the master's own module in `H` ([`WorkingCopy`]).
pub(crate) struct Same;

/// The working copy is made of mpx's layers ([`HalfLayers::Working`]).
pub(crate) struct Mapped;

/// The reused buffers of both casts.
pub(crate) struct Scratch<E> {
    cast: CastScratch,
    mapped: MapScratch<E>,
}

impl<H: Precision, M: MasterModel> Kind<H, M> for Same
where
    Cpu: Device<H::Elem>,
    WorkingCopy<H, M>: TensorCollection<H::Elem, Cpu> + Send + Sync + 'static,
{
    type Copy = WorkingCopy<H, M>;
    const MAPPED: bool = false;
    fn refresh(
        master: &M,
        half: Option<Self::Copy>,
        scratch: &mut Scratch<H::Elem>,
    ) -> Result<Self::Copy, StepError> {
        Ok(match half {
            Some(mut half) if !H::IDENTITY => {
                cast_module_into::<H, f32, M>(master, &mut half, &mut scratch.cast)?;
                half
            }
            _ if H::IDENTITY => share::<H, M>(master)?,
            _ => {
                // Built once; the in-place cast sizes its scratch now, so that every later
                // step allocates nothing of the model's size.
                let mut half = try_cast_module::<H, f32, M>(master)?;
                cast_module_into::<H, f32, M>(master, &mut half, &mut scratch.cast)?;
                half
            }
        })
    }
}

impl<H: Precision, M: HalfLayers<H>> Kind<H, M> for Mapped
where
    Cpu: Device<H::Elem>,
{
    type Copy = M::Working;
    const MAPPED: bool = true;
    fn refresh(
        master: &M,
        half: Option<Self::Copy>,
        scratch: &mut Scratch<H::Elem>,
    ) -> Result<Self::Copy, StepError> {
        super::mapped::refresh::<H, M>(master, half, &mut scratch.mapped)
    }
}

/// A forward pass's working copy and gradient buffers.
type Prepared<'a, H, C> = (
    &'a mut C,
    Gradients<<H as crate::precision::Precision>::Elem, Cpu>,
);

/// The typed workspace for master model `M` in precision `H`, with the working copy of kind
/// `K`.
pub(crate) struct Working<H: Precision, M: MasterModel, K: Kind<H, M>>
where
    Cpu: Device<H::Elem>,
{
    /// The working copy; `None` for an identity precision between steps (it shares the
    /// master's buffers, which the optimizer must own alone).
    half: Option<K::Copy>,
    /// Whether `half` was cast from the master since the last backward or update.
    fresh: bool,
    /// Zeroed half gradient buffers keyed by the working copy, ready for the next forward.
    pub(crate) pool: Vec<Gradients<H::Elem, Cpu>>,
    pub(crate) stash: Stash<H::Elem>,
    master: Arc<[MasterSlot]>,
    /// What the linked fused layers share with the workspace ([`super::direct`]).
    pub(crate) direct: Arc<Direct>,
    /// The positions the linked layers wrote in the last backward (reused buffer).
    written: Vec<bool>,
    scratch: Scratch<H::Elem>,
    /// Non-parameter tensors (batch-norm statistics) of the working copy, widened; every one is
    /// written back on an applied step.
    state: Vec<Vec<f32>>,
    marker: PhantomData<fn() -> (M, K)>,
}

impl<H: Precision, M: MasterModel + Send + Sync + 'static, K: Kind<H, M>> Working<H, M, K>
where
    Cpu: Device<H::Elem>,
{
    /// Records the master's layout; the working copy is cast on the first forward.
    pub(crate) fn new(master: &M) -> Result<Self, StepError> {
        let layout = master_layout(master)?;
        let slots: Arc<[MasterSlot]> = layout.slots.into();
        Ok(Self {
            half: None,
            fresh: false,
            pool: Vec::new(),
            stash: Arc::default(),
            direct: Arc::new(Direct::new(Arc::clone(&slots))),
            written: Vec::new(),
            master: slots,
            scratch: Scratch {
                cast: CastScratch::default(),
                mapped: MapScratch::default(),
            },
            state: layout.state_lens.iter().map(|&n| vec![0.0; n]).collect(),
            marker: PhantomData,
        })
    }

    /// The working copy, cast from `master` if it is not fresh, and a gradient buffer for its
    /// forward pass.
    pub(crate) fn prepare(&mut self, master: &M) -> Result<Prepared<'_, H, K::Copy>, StepError> {
        if !self.fresh || self.half.is_none() {
            let half = K::refresh(master, self.half.take(), &mut self.scratch)?;
            self.half = Some(half);
            self.fresh = true;
        }
        let Some(half) = self.half.as_mut() else {
            return Err(StepError::Cast(crate::cast::CastError::NotRebuilt));
        };
        let grads = match self.pool.pop() {
            Some(g) => g,
            None => half.try_alloc_grads()?,
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
                mismatch: None,
                marker: std::marker::PhantomData,
            };
            <K::Copy as TensorCollection<H::Elem, Cpu>>::iter_tensors(&mut RecursiveWalker {
                m: half,
                f: &mut read,
            })?;
            if let Some(e) = read.mismatch {
                return Err(e);
            }
        }
        if H::IDENTITY {
            self.half = None;
        }
        self.fresh = false;
        Ok(())
    }
}

impl<H: Precision, M: MasterModel + Send + Sync + 'static, K: Kind<H, M>> ErasedWorking
    for Working<H, M, K>
where
    Cpu: Device<H::Elem>,
{
    fn transfer(&mut self, grads: &mut Gradients<f32, Cpu>) -> Result<Option<bool>, StepError> {
        let mut half_grads: Vec<Gradients<H::Elem, Cpu>> = self
            .stash
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
            .collect();
        let mut finite = self.direct.drain(&mut self.written);
        if half_grads.is_empty() && !self.written.contains(&true) {
            return Ok(None);
        }
        // The next forward casts the master again (the user may change it before then).
        self.fresh = false;
        match (&self.half, half_grads.is_empty()) {
            (Some(half), false) => {
                let mut mover = Mover::<H> {
                    half_grads: &mut half_grads,
                    master_grads: grads,
                    master: &self.master,
                    inv_scale: self.direct.inv(),
                    written: &self.written,
                    finite: true,
                    index: 0,
                    mismatch: None,
                };
                <K::Copy as TensorCollection<H::Elem, Cpu>>::iter_tensors(&mut RecursiveWalker {
                    m: half,
                    f: &mut mover,
                })?;
                let (seen, mismatch) = (mover.index, mover.mismatch.take());
                finite &= mover.finite;
                if let Some(e) = mismatch {
                    return Err(e);
                }
                if seen != self.master.len() {
                    return Err(count_mismatch(self.master.len(), seen));
                }
            }
            _ => {
                // No half contribution: the gradients are plain f32 ones; still check them.
                for ghost in self.master.iter() {
                    finite &= all_finite_f32((ghost.get)(grads)?);
                }
            }
        }
        self.pool.append(&mut half_grads);
        self.finish_backward()?;
        Ok(Some(finite))
    }

    fn state(&self) -> &[Vec<f32>] {
        &self.state
    }

    fn mapped(&self) -> bool {
        K::MAPPED
    }

    fn check(&self, grads: &mut Gradients<f32, Cpu>) -> Result<bool, StepError> {
        let mut finite = true;
        for slot in self.master.iter() {
            finite &= all_finite_f32((slot.get)(grads)?);
        }
        Ok(finite)
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    #[cfg(feature = "mpi")]
    fn master_slots(&self) -> &[MasterSlot] {
        &self.master
    }
}

/// Elements moved per chunk (widened, unscaled, added and checked while in cache).
const CHUNK: usize = 1024;

/// Adds `src` (scaled half gradients) times `inv_scale` to `dst`, zeroes `src`, and returns
/// whether `dst` is finite afterwards: each chunk is widened into a stack buffer, then added
/// with the check folded in ([`add_scaled_checked`]), so `dst` is read once.
fn add_unscaled<H: Precision>(src: &mut [H::Elem], inv_scale: f32, dst: &mut [f32]) -> bool {
    let mut buf = [0.0f32; CHUNK];
    let zero = H::Elem::default();
    let mut finite = true;
    for (s, d) in src.chunks_mut(CHUNK).zip(dst.chunks_mut(CHUNK)) {
        let b = &mut buf[..s.len()];
        H::widen(s, b);
        finite &= add_scaled_checked(d, b, inv_scale);
        s.fill(zero);
    }
    // `dst` longer than `src` cannot happen (the lengths are checked before); its tail would
    // still be checked here.
    let tail = dst.get(src.len()..).unwrap_or(&[]);
    finite && all_finite_f32(tail)
}

/// Walks the working copy: each trainable tensor's half gradients (from every finished
/// backward) are added, unscaled, to the master's entry at the same position.
struct Mover<'a, H: Precision>
where
    Cpu: Device<H::Elem>,
{
    half_grads: &'a mut [Gradients<H::Elem, Cpu>],
    master_grads: &'a mut Gradients<f32, Cpu>,
    master: &'a [MasterSlot],
    inv_scale: f32,
    /// Positions a linked layer wrote directly: their half gradients are moved only when
    /// something else also added to them.
    written: &'a [bool],
    finite: bool,
    index: usize,
    mismatch: Option<StepError>,
}

impl<H: Precision> TensorVisitor<H::Elem, Cpu> for Mover<'_, H>
where
    Cpu: Device<H::Elem>,
{
    type Viewer = ViewTensorRef;
    type Err = CpuError;
    type E2 = H::Elem;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, H::Elem, Cpu>,
        t: &Tensor<S, H::Elem, Cpu>,
    ) -> Result<Option<Tensor<S, H::Elem, Cpu>>, CpuError> {
        if !opts.do_gradient_update || self.mismatch.is_some() {
            return Ok(None);
        }
        let i = self.index;
        self.index += 1;
        let Some(ghost) = self.master.get(i) else {
            self.mismatch = Some(count_mismatch(self.master.len(), i + 1));
            return Ok(None);
        };
        let n = t.shape().num_elements();
        let dst = (ghost.get)(self.master_grads)?;
        if dst.len() != n {
            self.mismatch = Some(len_mismatch(i, dst.len(), n));
            return Ok(None);
        }
        let mut finite = true;
        let direct = self.written.get(i).copied().unwrap_or(false);
        for g in self.half_grads.iter_mut() {
            let src = grad_slice::<H::Elem>(g.get_or_alloc_mut(t)?);
            if src.len() != n {
                self.mismatch = Some(len_mismatch(i, n, src.len()));
                return Ok(None);
            }
            if direct && all_zero(H::floats(src)) {
                // written straight into `dst` (and checked there) by a linked layer
                continue;
            }
            finite &= add_unscaled::<H>(src, self.inv_scale, dst);
        }
        self.finite &= finite;
        Ok(None)
    }
}

/// Reads the working copy's non-parameter tensors, widened to f32.
struct ReadState<'a, H> {
    out: &'a mut [Vec<f32>],
    index: usize,
    mismatch: Option<StepError>,
    marker: std::marker::PhantomData<H>,
}

impl<H: Precision> TensorVisitor<H::Elem, Cpu> for ReadState<'_, H>
where
    Cpu: Device<H::Elem>,
{
    type Viewer = ViewTensorRef;
    type Err = CpuError;
    type E2 = H::Elem;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, H::Elem, Cpu>,
        t: &Tensor<S, H::Elem, Cpu>,
    ) -> Result<Option<Tensor<S, H::Elem, Cpu>>, CpuError> {
        if opts.do_gradient_update || self.mismatch.is_some() {
            return Ok(None);
        }
        let j = self.index;
        self.index += 1;
        let n = t.shape().num_elements();
        match self.out.get_mut(j) {
            Some(dst) if dst.len() == n => H::widen(&t.as_vec(), dst),
            Some(dst) => self.mismatch = Some(len_mismatch(j, dst.len(), n)),
            None => self.mismatch = Some(count_mismatch(self.out.len(), j + 1)),
        }
        Ok(None)
    }
}
