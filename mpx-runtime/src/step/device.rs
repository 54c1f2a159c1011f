//! The device-specific primitives of the mixed step, behind one trait ([`MixedDevice`]): the
//! rest of the step (the scaler's bookkeeping, the working copy's life cycle, the half region's
//! tapes, the skip decision) is written once, for any device that implements it.
//!
//! | primitive | `Cpu` (host slices) | `Cuda` (device kernels; feature `cuda`) |
//! |---|---|---|
//! | master -> working copy | in place, one rounding pass over a gathered buffer | dfdx's `to_dtype` per tensor (a new working copy per step) |
//! | input entering the region | host rounding | dfdx's `to_dtype` |
//! | output leaving the region | host widening | dfdx's `to_dtype` |
//! | gradient seed (times the loss scale) | chunked scale-and-round | mpx's kernel: `g_half += half(g * scale)` |
//! | unscale-and-accumulate into the master | chunked widen + `dst += g * inv`, checked in the same pass | mpx's kernel: `dst += float(g) * inv; g = 0`, non-finite sums flagged in one device word |
//! | finiteness check | bit test over host slices | mpx's kernel flags into the same word; the word is the one value read back |
//!
//! dfdx 0.13 keeps a tensor's buffer and its gradient kernels crate-private, so a device other
//! than the `Cpu` needs kernels of its own for the two gradient primitives: mpx compiles them
//! with NVRTC at first use, as dfdx does its own (`step/device/cuda.rs`).

use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;

use dfdx::nn::tensor_collection::{RecursiveWalker, TensorOptions, TensorVisitor, ViewTensorRef};
use dfdx::optim::OptimizerUpdateError;
use dfdx::shapes::Shape;
use dfdx::tensor::{Gradients, HasErr, Tensor};
use dfdx::tensor_ops::Device;

use super::direct::{Direct, ScopeGuard};
use super::error::StepError;
use super::layout::{MasterSlot, WorkingCopy, master_layout};
use super::workspace::{AnyFn, StateFn, Workspace};
use crate::boundary::MasterModel;
use crate::cast::CastScratch;
use crate::precision::Precision;

/// A backward op on a half tape.
pub(crate) type HalfOp<E, D> =
    Box<dyn FnOnce(&mut Gradients<E, D>) -> Result<(), <D as HasErr>::Err>>;

/// A traced input's f32 tape, given back, and the op that marks its half gradient unread when
/// nothing can read its f32 gradient ([`Primitives::unread_input`](private::Primitives::unread_input)).
pub(crate) type Unread<E, D> = (dfdx::tensor::OwnedTape<f32, D>, Option<HalfOp<E, D>>);

/// Adds what a half backward op captured to the f32 graph's gradients.
pub(crate) type FullOp<D> = Box<dyn Fn(&mut Gradients<f32, D>) -> Result<(), <D as HasErr>::Err>>;

/// Reads an output's f32 gradient, scales and rounds it, and returns the op that adds it to the
/// half graph.
pub(crate) type SeedOp<E, D> =
    Box<dyn FnOnce(&mut Gradients<f32, D>) -> Result<HalfOp<E, D>, <D as HasErr>::Err>>;

/// A dfdx device the mixed step runs on, in precision `H`: the `Cpu` for every precision, and
/// with the `cuda` feature dfdx's `Cuda` for `f32`, [`f16`](struct@crate::precision::f16) and
/// [`AMP<f16>`](crate::precision::AMP) (emulated bf16 rounds on the host only). Sealed: its
/// primitives are mpx's own (see `docs/gpu.md`).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::precision::{f16, AMP};
/// use mpx_runtime::step::MixedDevice;
/// fn runs_mixed<H: mpx_runtime::precision::Precision, D: MixedDevice<H>>() {}
/// runs_mixed::<f16, Cpu>();
/// runs_mixed::<AMP<f16>, Cpu>();
/// ```
#[diagnostic::on_unimplemented(
    message = "mixed precision in `{H}` does not run on `{Self}`",
    label = "not a device the mixed step runs on in this precision",
    note = "the mixed step runs on dfdx's `Cpu` (every precision) and, with mpx's `cuda` feature, on `Cuda` in `f16`, `AMP<f16>` and `f32` (emulated bf16 is host-only)"
)]
pub trait MixedDevice<H: Precision>:
    Device<f32> + Device<H::Elem> + private::Primitives<H>
{
}

impl<H: Precision, D: Device<f32> + Device<H::Elem> + private::Primitives<H>> MixedDevice<H> for D {}

pub(crate) mod private {
    use super::FullWorking;
    use super::{
        Arc, CastScratch, Device, Direct, FullOp, Gradients, HalfOp, MasterModel, MasterSlot,
        OptimizerUpdateError, Precision, ScopeGuard, SeedOp, Shape, StepError, Tensor, Unread,
        WorkingCopy,
    };
    use crate::step::workspace::ErasedWorking;
    use dfdx::nn::tensor_collection::TensorCollection;
    use dfdx::shapes::Rank0;
    use dfdx::tensor::TensorToArray;

    use crate::step::layout::SlotDevice;

    /// The primitives themselves (see the module's table).
    pub trait Primitives<H: Precision>:
        Device<f32>
        + Device<H::Elem>
        + TensorToArray<Rank0, f32, Array = f32>
        + SlotDevice
        + 'static
    {
        /// Whether the working copy is cast in place, so that its tensors keep their ids and
        /// its gradient buffers are reused from step to step.
        const IN_PLACE: bool;
        /// Whether gradients are all finite, accumulated over tensors.
        type Finite: Default;

        /// A device error as a step error.
        fn step_error(e: Self::Err) -> StepError;
        /// The device of a master without tensors (the `Cpu`'s default; none elsewhere).
        fn fallback_device() -> Option<Self>;
        /// Makes the device ready for a step on `dev` (loads mpx's kernels where it has any).
        ///
        /// # Errors
        /// A kernel that does not compile or load.
        fn ready(dev: &Self) -> Result<(), StepError>;
        /// An optimizer's error as a step error.
        fn optimizer_error(e: OptimizerUpdateError<Self::Err>) -> StepError;

        /// `x` rounded to `H`.
        ///
        /// # Errors
        /// A device error.
        fn to_half<S: Shape, T>(
            x: &Tensor<S, f32, Self, T>,
        ) -> Result<Tensor<S, H::Elem, Self>, Self::Err>;

        /// `y` widened to f32.
        ///
        /// # Errors
        /// A device error.
        fn to_full<S: Shape, T>(
            y: &Tensor<S, H::Elem, Self, T>,
        ) -> Result<Tensor<S, f32, Self>, Self::Err>;

        /// Whether the gradient of `x32`, the f32 input traced on `tape`, can be read once the
        /// backward has run ([`unread`](crate::step::unread)); `Some` op marking its half copy
        /// `x`'s gradient unread when it cannot. Returns the tape, its gradients unchanged.
        ///
        /// # Errors
        /// A device error.
        fn unread_input<S: Shape>(
            x: &Tensor<S, H::Elem, Self>,
            x32: &Tensor<S, f32, Self>,
            tape: dfdx::tensor::OwnedTape<f32, Self>,
        ) -> Result<Unread<H::Elem, Self>, Self::Err>;

        /// The ops that carry a traced input's half gradient (`x`, inside the region) back to
        /// its f32 gradient (`x32`), unscaled with `inv`.
        fn input_bridge<S: Shape>(
            x: &Tensor<S, H::Elem, Self>,
            x32: &Tensor<S, f32, Self>,
            inv: f32,
        ) -> (HalfOp<H::Elem, Self>, FullOp<Self>);

        /// The op that seeds a traced output's half gradient (`y`) with its f32 gradient
        /// (`y32`) times `scale`.
        fn output_seed<S: Shape>(
            y: &Tensor<S, H::Elem, Self>,
            y32: &Tensor<S, f32, Self>,
            scale: f32,
        ) -> SeedOp<H::Elem, Self>;

        /// Adds `t`'s half gradient in `half`, times `inv`, to the master's gradient `slot` in
        /// `grads`, zeroes the half gradient, and folds the finiteness of the sum into `finite`.
        /// `direct`: a linked layer already wrote this position (the `Cpu`'s fused layers).
        ///
        /// # Errors
        /// A device error, or a length that does not match.
        #[allow(clippy::too_many_arguments)]
        fn accumulate<S: Shape>(
            half: &mut Gradients<H::Elem, Self>,
            t: &Tensor<S, H::Elem, Self>,
            slot: &MasterSlot<Self>,
            index: usize,
            grads: &mut Gradients<f32, Self>,
            inv: f32,
            direct: bool,
            finite: &mut Self::Finite,
        ) -> Result<(), StepError>;

        /// Folds the finiteness of the master's gradient `slot` into `finite`.
        ///
        /// # Errors
        /// A device error.
        fn check(
            slot: &MasterSlot<Self>,
            grads: &mut Gradients<f32, Self>,
            finite: &mut Self::Finite,
        ) -> Result<(), StepError>;

        /// The verdict: whether everything folded into `finite` was finite.
        ///
        /// # Errors
        /// A device error.
        fn verdict(finite: Self::Finite) -> Result<bool, StepError>;

        /// The working copy of `master` (its own layers in `H`): `half` cast again, or a new one.
        ///
        /// # Errors
        /// A device or cast error.
        fn refresh_same<M>(
            master: &M,
            half: Option<WorkingCopy<H, M, Self>>,
            scratch: &mut CastScratch,
        ) -> Result<WorkingCopy<H, M, Self>, StepError>
        where
            M: MasterModel<Self>,
            WorkingCopy<H, M, Self>: TensorCollection<H::Elem, Self>;

        /// Boxes the workspace of a master run in f32 for the scaler.
        fn hold_full(w: FullWorking<H, Self>) -> Box<dyn ErasedWorking>;

        /// The state the fused layers share with a workspace (the `Cpu`'s alone).
        fn links(slots: &Arc<[MasterSlot<Self>]>) -> Option<Arc<Direct>>;

        /// Opens the fused layers' scope for a forward pass on `half`.
        ///
        /// # Errors
        /// A device error.
        fn enter_scope<C: TensorCollection<H::Elem, Self>>(
            half: &C,
            direct: Option<&Arc<Direct>>,
        ) -> Result<Option<ScopeGuard>, StepError>;

        /// Lends the master's gradients to the fused layers while a half backward runs.
        fn lend(direct: &Direct, grads: &mut Gradients<f32, Self>);

        /// Takes them back.
        fn restore(direct: &Direct, grads: &mut Gradients<f32, Self>);
    }
}

// ---- a master run in f32 on itself ------------------------------------------------------------
// A master whose forward pass runs in f32, on the master itself: what `#[mixed_step]` falls
// back to when the half working copy's forward pass cannot be type-checked (a model whose type
// is a generic parameter of the `impl`, whose bounds the attribute on the method cannot see).
// The step keeps the scaler's bookkeeping (one update per backward, skip on non-finite
// gradients, the iteration's scale adjustment) and reports that it ran in f32
// ([`StepReport::precision`](super::StepReport::precision)).

/// The gradient slots of an f32-run master on device `D` (checked as precision `H`'s device
/// checks), and whether a forward pass ran since the last backward.
pub struct FullWorking<H: Precision, D: MixedDevice<H>> {
    master: Arc<[MasterSlot<D>]>,
    used: bool,
    marker: PhantomData<fn() -> H>,
}

impl<H: Precision, D: MixedDevice<H>> FullWorking<H, D> {
    pub(crate) fn new<M: MasterModel<D>>(master: &M) -> Result<Self, StepError> {
        Ok(Self {
            master: master_layout::<D, M>(master)
                .map_err(D::step_error)?
                .slots
                .into(),
            used: false,
            marker: PhantomData,
        })
    }
}

impl<H: Precision, D: MixedDevice<H>> Workspace for FullWorking<H, D> {
    fn transfer(&mut self, grads: &mut dyn Any) -> Result<Option<bool>, StepError> {
        if !self.used || !grads.is::<Gradients<f32, D>>() {
            return Ok(None);
        }
        self.used = false;
        self.check(grads).map(Some)
    }

    fn check(&self, grads: &mut dyn Any) -> Result<bool, StepError> {
        match grads.downcast_mut::<Gradients<f32, D>>() {
            Some(grads) => check_all::<H, D>(&self.master, grads),
            None => Ok(true),
        }
    }

    fn with_state(&self, f: &mut StateFn<'_>) -> Result<(), StepError> {
        f(&[])
    }

    fn mark_used(&mut self) -> bool {
        self.used = true;
        true
    }

    fn in_f32(&self) -> bool {
        true
    }

    #[cfg(feature = "mpi")]
    fn master_slots(&self) -> &[MasterSlot] {
        let any: &dyn Any = &self.master;
        any.downcast_ref::<Arc<[MasterSlot]>>()
            .map_or(&[], |s| &s[..])
    }

    fn with_any(&mut self, f: &mut AnyFn<'_>) -> Result<(), StepError> {
        f(self)
    }
}

/// Whether the master's gradients in `grads` are all finite (on the device; one verdict).
pub(super) fn check_all<H: Precision, D: MixedDevice<H>>(
    slots: &[MasterSlot<D>],
    grads: &mut Gradients<f32, D>,
) -> Result<bool, StepError> {
    let mut finite = D::Finite::default();
    for slot in slots {
        D::check(slot, grads, &mut finite)?;
    }
    D::verdict(finite)
}

// ---- the working copy of an identity precision ------------------------------------------------

/// The working copy of an [`IDENTITY`](Precision::IDENTITY) precision: the master's own
/// tensors (same ids, shared buffers, nothing copied).
pub(super) fn share<H: Precision, D: MixedDevice<H>, M: MasterModel<D>>(
    master: &M,
) -> Result<WorkingCopy<H, M, D>, StepError> {
    M::iter_tensors(&mut RecursiveWalker {
        m: master,
        f: &mut Share::<H>(std::marker::PhantomData),
    })
    .map_err(D::step_error)?
    .ok_or(StepError::Cast(crate::cast::CastError::NotRebuilt))
}

/// Rebuilds a module from clones of its tensors (shared buffers). For a precision whose element
/// is not `f32` it falls back to a converting copy.
struct Share<H>(std::marker::PhantomData<H>);

impl<H: Precision, D: MixedDevice<H>> TensorVisitor<f32, D> for Share<H> {
    type Viewer = ViewTensorRef;
    type Err = D::Err;
    type E2 = H::Elem;
    type D2 = D;

    fn visit<S: Shape>(
        &mut self,
        _opts: TensorOptions<S, f32, D>,
        t: &Tensor<S, f32, D>,
    ) -> Result<Option<Tensor<S, H::Elem, D>>, D::Err> {
        let mut shared = Some(t.clone());
        let any: &mut dyn std::any::Any = &mut shared;
        if let Some(same) = any.downcast_mut::<Option<Tensor<S, H::Elem, D>>>() {
            return Ok(same.take());
        }
        D::to_half(t).map(Some)
    }
}

// ---- the Cpu: host slices -----------------------------------------------------------------------

mod cpu {
    use std::rc::Rc;
    use std::sync::{Arc, Mutex, PoisonError};

    use dfdx::nn::tensor_collection::TensorCollection;
    use dfdx::optim::OptimizerUpdateError;
    use dfdx::shapes::{HasShape, Shape};
    use dfdx::tensor::{Cpu, CpuError, Gradients, OwnedTape, Tensor, TensorFromVec};
    use dfdx::tensor_ops::{Device, ReshapeTo};

    use super::private::Primitives;
    use super::{FullOp, HalfOp, SeedOp, Unread};
    use super::{FullWorking, share};
    use crate::boundary::MasterModel;
    use crate::cast::{CastScratch, cast_module_into, grad_slice, try_cast_module};
    use crate::finite::{add_scaled_checked, all_finite_f32};
    use crate::precision::Precision;
    use crate::step::direct::{Direct, ScopeGuard, all_zero};
    use crate::step::error::StepError;
    use crate::step::layout::{MasterSlot, WorkingCopy, len_mismatch};
    use crate::step::unread;
    use crate::step::workspace::ErasedWorking;

    impl<H: Precision> Primitives<H> for Cpu
    where
        Cpu: Device<H::Elem>,
    {
        const IN_PLACE: bool = true;
        type Finite = Finite;

        fn step_error(e: CpuError) -> StepError {
            StepError::Device(e)
        }

        fn fallback_device() -> Option<Cpu> {
            Some(Cpu::default())
        }

        fn ready(_: &Cpu) -> Result<(), StepError> {
            Ok(())
        }

        fn optimizer_error(e: OptimizerUpdateError<CpuError>) -> StepError {
            StepError::Optimizer(e)
        }

        fn to_half<S: Shape, T>(
            x: &Tensor<S, f32, Cpu, T>,
        ) -> Result<Tensor<S, H::Elem, Cpu>, CpuError> {
            let n = x.shape().num_elements();
            // A contiguous view (the same buffer when it already is) read with one memcpy:
            // dfdx's `as_vec` walks the tensor index by index.
            let mut values = vec![0.0f32; n];
            x.retaped::<dfdx::tensor::NoneTape>()
                .try_contiguous()?
                .copy_into(&mut values);
            let mut half = vec![H::Elem::default(); n];
            H::round(&values, &mut half);
            x.device().try_tensor_from_vec(half, *x.shape())
        }

        fn to_full<S: Shape, T>(
            y: &Tensor<S, H::Elem, Cpu, T>,
        ) -> Result<Tensor<S, f32, Cpu>, CpuError> {
            let n = y.shape().num_elements();
            let mut half = vec![H::Elem::default(); n];
            y.retaped::<dfdx::tensor::NoneTape>()
                .try_contiguous()?
                .copy_into(&mut half);
            let mut full = vec![0.0f32; n];
            H::widen(&half, &mut full);
            y.device().try_tensor_from_vec(full, *y.shape())
        }

        fn unread_input<S: Shape>(
            x: &Tensor<S, H::Elem, Cpu>,
            x32: &Tensor<S, f32, Cpu>,
            tape: OwnedTape<f32, Cpu>,
        ) -> Result<Unread<H::Elem, Cpu>, CpuError> {
            let (tape, read) = unread::read_after_backward(x32, tape)?;
            let mark: Option<HalfOp<H::Elem, Cpu>> =
                (!read).then(|| Box::new(unread::mark(x)) as _);
            Ok((tape, mark))
        }

        fn input_bridge<S: Shape>(
            x: &Tensor<S, H::Elem, Cpu>,
            x32: &Tensor<S, f32, Cpu>,
            inv: f32,
        ) -> (HalfOp<H::Elem, Cpu>, FullOp<Cpu>) {
            let (x, x32) = (x.ghost(), x32.ghost());
            let captured: Rc<Mutex<Option<Vec<f32>>>> = Rc::default();
            let capture = Rc::clone(&captured);
            let n = x32.shape().num_elements();
            let inner: HalfOp<H::Elem, Cpu> = Box::new(move |g: &mut Gradients<H::Elem, Cpu>| {
                let mut v = vec![0.0f32; n];
                H::widen(grad_slice::<H::Elem>(g.get_or_alloc_mut(&x)?), &mut v);
                if inv != 1.0 {
                    for x in &mut v {
                        *x *= inv;
                    }
                }
                *capture.lock().unwrap_or_else(PoisonError::into_inner) = Some(v);
                Ok(())
            });
            let writer: FullOp<Cpu> = Box::new(move |g: &mut Gradients<f32, Cpu>| {
                let taken = captured
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take();
                if let Some(v) = taken {
                    let dst = g.get_or_alloc_mut(&x32)?;
                    dst.iter_mut().zip(&v).for_each(|(d, s)| *d += *s);
                }
                Ok(())
            });
            (inner, writer)
        }

        fn output_seed<S: Shape>(
            y: &Tensor<S, H::Elem, Cpu>,
            y32: &Tensor<S, f32, Cpu>,
            scale: f32,
        ) -> SeedOp<H::Elem, Cpu> {
            let (y, y32) = (y.ghost(), y32.ghost());
            let n = y32.shape().num_elements();
            Box::new(move |g32: &mut Gradients<f32, Cpu>| {
                let g = g32.get_or_alloc_mut(&y32)?;
                let mut seed = vec![H::Elem::default(); n];
                if scale == 1.0 {
                    H::round(g, &mut seed);
                } else {
                    // Scaled through a stack buffer, chunk by chunk: no second output-sized
                    // vector.
                    let mut buf = [0.0f32; 1024];
                    for (src, dst) in g.chunks(buf.len()).zip(seed.chunks_mut(buf.len())) {
                        let b = &mut buf[..src.len()];
                        b.iter_mut().zip(src).for_each(|(b, v)| *b = v * scale);
                        H::round(b, dst);
                    }
                }
                let apply: HalfOp<H::Elem, Cpu> =
                    Box::new(move |g: &mut Gradients<H::Elem, Cpu>| {
                        let buf = grad_slice::<H::Elem>(g.get_or_alloc_mut(&y)?);
                        buf.iter_mut().zip(&seed).for_each(|(d, s)| *d += *s);
                        Ok(())
                    });
                Ok(apply)
            })
        }

        fn accumulate<S: Shape>(
            half: &mut Gradients<H::Elem, Cpu>,
            t: &Tensor<S, H::Elem, Cpu>,
            slot: &MasterSlot<Cpu>,
            index: usize,
            grads: &mut Gradients<f32, Cpu>,
            inv: f32,
            direct: bool,
            finite: &mut Finite,
        ) -> Result<(), StepError> {
            let n = t.shape().num_elements();
            let src = grad_slice::<H::Elem>(half.get_or_alloc_mut(t)?);
            if src.len() != n {
                return Err(len_mismatch(index, n, src.len()));
            }
            if direct && all_zero(H::floats(src)) {
                // written straight into the master's gradient (and checked there) by a linked
                // layer
                return Ok(());
            }
            let dst = slot.slice(grads)?;
            if dst.len() != n {
                return Err(len_mismatch(index, dst.len(), n));
            }
            finite.0 &= add_unscaled::<H>(src, inv, dst);
            Ok(())
        }

        fn check(
            slot: &MasterSlot<Cpu>,
            grads: &mut Gradients<f32, Cpu>,
            finite: &mut Finite,
        ) -> Result<(), StepError> {
            finite.0 &= all_finite_f32(slot.slice(grads)?);
            Ok(())
        }

        fn verdict(finite: Finite) -> Result<bool, StepError> {
            Ok(finite.0)
        }

        fn refresh_same<M>(
            master: &M,
            half: Option<WorkingCopy<H, M, Cpu>>,
            scratch: &mut CastScratch,
        ) -> Result<WorkingCopy<H, M, Cpu>, StepError>
        where
            M: MasterModel<Cpu>,
            WorkingCopy<H, M, Cpu>: TensorCollection<H::Elem, Cpu>,
        {
            Ok(match half {
                Some(mut half) if !H::IDENTITY => {
                    cast_module_into::<H, f32, M>(master, &mut half, scratch)?;
                    half
                }
                _ if H::IDENTITY => share::<H, Cpu, M>(master)?,
                _ => {
                    // Built once; the in-place cast sizes its scratch now, so that every later
                    // step allocates nothing of the model's size.
                    let mut half = try_cast_module::<H, f32, M>(master)?;
                    cast_module_into::<H, f32, M>(master, &mut half, scratch)?;
                    half
                }
            })
        }

        fn hold_full(w: FullWorking<H, Cpu>) -> Box<dyn ErasedWorking> {
            Box::new(w)
        }

        fn links(slots: &Arc<[MasterSlot<Cpu>]>) -> Option<Arc<Direct>> {
            Some(Arc::new(Direct::new(Arc::clone(slots))))
        }

        fn enter_scope<C: TensorCollection<H::Elem, Cpu>>(
            half: &C,
            direct: Option<&Arc<Direct>>,
        ) -> Result<Option<ScopeGuard>, StepError> {
            Ok(direct
                .map(|d| crate::step::direct::enter::<H::Elem, C>(half, d))
                .transpose()?)
        }

        fn lend(direct: &Direct, grads: &mut Gradients<f32, Cpu>) {
            direct.lend(grads);
        }

        fn restore(direct: &Direct, grads: &mut Gradients<f32, Cpu>) {
            direct.restore(grads);
        }
    }

    /// Whether every host slice checked was finite.
    pub struct Finite(pub(crate) bool);

    impl Default for Finite {
        fn default() -> Self {
            Self(true)
        }
    }

    /// Elements moved per chunk (widened, unscaled, added and checked while in cache).
    const CHUNK: usize = 1024;

    /// Adds `src` (scaled half gradients) times `inv_scale` to `dst`, zeroes `src`, and returns
    /// whether `dst` is finite afterwards: each chunk is widened into a stack buffer, then added
    /// with the check folded in ([`add_scaled_checked`]), so `dst` is read once.
    pub(crate) fn add_unscaled<H: Precision>(
        src: &mut [H::Elem],
        inv_scale: f32,
        dst: &mut [f32],
    ) -> bool {
        let mut buf = [0.0f32; CHUNK];
        let zero = H::Elem::default();
        let mut finite = true;
        for (s, d) in src.chunks_mut(CHUNK).zip(dst.chunks_mut(CHUNK)) {
            let b = &mut buf[..s.len()];
            H::widen(s, b);
            finite &= add_scaled_checked(d, b, inv_scale);
            s.fill(zero);
        }
        // `dst` longer than `src` cannot happen (the lengths are checked before); its tail
        // would still be checked here.
        let tail = dst.get(src.len()..).unwrap_or(&[]);
        finite && all_finite_f32(tail)
    }
}

#[cfg(feature = "cuda")]
mod cuda;
