//! The device-specific primitives of the mixed step, behind one trait ([`MixedDevice`]): the
//! rest of the step (the working copy, the half region's tapes, the verdict, the update) is
//! written once, for any device that implements it.
//!
//! | primitive | `Cpu` (host slices) | `Cuda` (device kernels; feature `cuda`) |
//! |---|---|---|
//! | a tensor rounded to the half type (master, input) | host rounding | dfdx's `to_dtype` |
//! | an output widened to f32 | host widening | dfdx's `to_dtype` |
//! | gradient seed (times the loss scale) | chunked scale-and-round | mpx's kernel: `g_half += half(g * scale)` |
//! | a half gradient unscaled into the master's | chunked widen + `dst += g * inv` | mpx's kernel: `dst += float(g) * inv` |
//! | finiteness check of the master's gradients | bit test over host slices | mpx's kernel flags one device word, the one value read back |
//! | direct gradients of mpx's fused layers ([`link`](super::link)) | yes | no |
//!
//! dfdx 0.13 keeps a tensor's buffer and its gradient kernels crate-private, so a device other
//! than the `Cpu` needs kernels of its own for the gradient primitives: mpx compiles them with
//! NVRTC at first use, as dfdx does its own (`step/device/cuda.rs`).

use dfdx::optim::OptimizerUpdateError;
use dfdx::tensor::{Gradients, HasErr};

use super::error::StepError;
use crate::master::slots::{MasterSlot, Slot};
use crate::precision::Precision;

/// A backward op on a half tape.
pub(crate) type HalfOp<E, D> =
    Box<dyn FnOnce(&mut Gradients<E, D>) -> Result<(), <D as HasErr>::Err>>;

/// Adds what a half backward op captured to the f32 graph's gradients.
pub(crate) type FullOp<D> = Box<dyn Fn(&mut Gradients<f32, D>) -> Result<(), <D as HasErr>::Err>>;

/// Reads an output's f32 gradient, scales and rounds it, and returns the op that adds it to the
/// half graph.
pub(crate) type SeedOp<E, D> =
    Box<dyn FnOnce(&mut Gradients<f32, D>) -> Result<HalfOp<E, D>, <D as HasErr>::Err>>;

/// A trainable tensor of the working copy and the master tensor it stands for. Named by the
/// sealed device trait, reachable by nobody outside the crate.
#[allow(unreachable_pub)]
pub struct Pair<H: Precision, D: private::Primitives<H>> {
    pub(crate) half: Slot<H::Elem, D>,
    pub(crate) master: MasterSlot<D>,
    /// A linked layer writes this tensor's gradient straight into the master's
    /// ([`link`](super::link)): its half gradient is moved only when something else added to it.
    pub(crate) linked: bool,
}

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
pub trait MixedDevice<H: Precision>: private::Primitives<H> {}

impl<H: Precision, D: private::Primitives<H>> MixedDevice<H> for D {}

pub(crate) mod private {
    use super::{FullOp, HalfOp, OptimizerUpdateError, Pair, Precision, SeedOp, StepError};
    use crate::master::slots::{MasterSlot, SlotDevice};
    use dfdx::shapes::{Rank0, Shape};
    use dfdx::tensor::{Gradients, Tensor, TensorToArray};
    use dfdx::tensor_ops::Device;

    /// The primitives themselves (see the module's table).
    pub trait Primitives<H: Precision>:
        Device<f32>
        + Device<H::Elem>
        + SlotDevice<f32>
        + SlotDevice<H::Elem>
        + TensorToArray<Rank0, f32, Array = f32>
        + 'static
    {
        /// What one forward pass's linked layers share with its bridge (the `Cpu`'s
        /// [`RegionLinks`](crate::master::link::RegionLinks); nothing elsewhere).
        type Links: Clone;
        /// Whether gradients are all finite, accumulated over tensors.
        type Finite: Default;

        /// A device error as a step error.
        fn step_error(e: Self::Err) -> StepError;
        /// An optimizer's error as a step error.
        fn optimizer_error(e: OptimizerUpdateError<Self::Err>) -> StepError;
        /// The device a forward pass of `master` runs its half region's own tensors on, ready
        /// for the step: on the `Cpu`, the store's (any `Cpu` holds host memory, so the
        /// master is not walked); elsewhere, the device of the master's first tensor with mpx's
        /// kernels loaded on it.
        ///
        /// # Errors
        /// [`StepError::NoTensors`] for a master without tensors off the `Cpu`; a kernel that
        /// does not compile or load.
        fn region_device<M: crate::boundary::MasterModel<Self>>(
            master: &M,
            store: &mut Self::Store,
        ) -> Result<Self, StepError>;

        /// The link state of a forward pass that applies the scale whose reciprocal is `inv`.
        fn links(inv: f32) -> Self::Links;
        /// The linker that hands `links` to the fused layers of a working copy of mpx's layers.
        fn linker(links: &Self::Links) -> crate::step::Linker;
        /// Whether the master tensor at `addr` was linked in this forward pass.
        fn is_linked(links: &Self::Links, addr: usize) -> bool;
        /// Lends the master's gradients to the linked layers while a half backward runs.
        fn lend(links: &Self::Links, grads: &mut Gradients<f32, Self>);
        /// Takes them back.
        fn restore(links: &Self::Links, grads: &mut Gradients<f32, Self>);

        /// What a scaler keeps from one working copy to the next, so that building the next
        /// allocates nothing new (the `Cpu`: the last copies' large tensors, written again in
        /// place; a device of its own whose allocation cache takes their gradients' buffers
        /// back when a step drops them; the host buffers the rounding reads through).
        type Store: Default + Send + Sync;

        /// Master tensor `x` rounded to `H`, as a tensor of the working copy (in buffers `store`
        /// keeps, where it keeps any).
        ///
        /// # Errors
        /// A device error.
        fn to_working<S: Shape>(
            x: &Tensor<S, f32, Self>,
            store: &mut Self::Store,
        ) -> Result<Tensor<S, H::Elem, Self>, Self::Err>;

        /// Called before a working copy is built, when the last ones are dropped: `store` may
        /// hand the buffers of the tensors [`to_working`](Self::to_working) made since the last
        /// call to the next copy.
        fn recycle(store: &mut Self::Store);

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

        /// The ops that carry a traced input's half gradient (`x`, inside the region) back to
        /// its f32 gradient (`x32`), unscaled with `inv`: one on the half tape, and one for the
        /// f32 side where the half one cannot reach the f32 gradients (the `Cpu`'s reaches
        /// them through `links`, which hold them while the half backward runs).
        fn input_bridge<S: Shape>(
            x: &Tensor<S, H::Elem, Self>,
            x32: &Tensor<S, f32, Self>,
            inv: f32,
            links: &Self::Links,
        ) -> (HalfOp<H::Elem, Self>, Option<FullOp<Self>>);

        /// The op that marks the half gradient of `x`, an input whose gradient nothing reads,
        /// for the linked layers (`None` where there are none).
        fn unread_mark<S: Shape>(
            x: &Tensor<S, H::Elem, Self>,
            links: &Self::Links,
        ) -> Option<HalfOp<H::Elem, Self>>;

        /// The op that seeds a traced output's half gradient (`y`) with its f32 gradient
        /// (`y32`) times `scale`.
        fn output_seed<S: Shape>(
            y: &Tensor<S, H::Elem, Self>,
            y32: &Tensor<S, f32, Self>,
            scale: f32,
        ) -> SeedOp<H::Elem, Self>;

        /// Adds the working tensor's half gradient in `half`, times `inv`, to its master's
        /// gradient in `grads`.
        ///
        /// # Errors
        /// A device error, or lengths that do not match.
        fn transfer(
            half: &mut Gradients<H::Elem, Self>,
            pair: &Pair<H, Self>,
            grads: &mut Gradients<f32, Self>,
            inv: f32,
        ) -> Result<(), Self::Err>;

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

        /// Whether `grads` keep `slot`'s gradient (it is one of their leaves: the gradients the
        /// model's `alloc_grads` made keep that model's alone), after a backward pass.
        ///
        /// # Errors
        /// A device error.
        fn kept(
            slot: &MasterSlot<Self>,
            grads: &mut Gradients<f32, Self>,
        ) -> Result<bool, StepError>;

        /// Data-parallel: after a backward pass, the ranks agree on one verdict and average
        /// the gradients of the masters it reached (see [`crate::distributed`]); `None` without
        /// a reducer, or before the last backward pass of an accumulation.
        ///
        /// # Errors
        /// The all-reduce failed, or the ranks disagree.
        #[cfg(feature = "mpi")]
        #[allow(clippy::too_many_arguments)]
        fn reduce(
            reducer: Option<&mut crate::distributed::Reducer>,
            slots: &[&MasterSlot<Self>],
            grads: &mut Gradients<f32, Self>,
            grads_finite: bool,
            loss_finite: bool,
            scale: f32,
            counters: [u64; 2],
        ) -> Result<Option<bool>, StepError>;

        /// Data-parallel: before an update, checks that the accumulation count was reached.
        ///
        /// # Errors
        /// The ranks disagree.
        #[cfg(feature = "mpi")]
        fn before_update(
            reducer: Option<&mut crate::distributed::Reducer>,
        ) -> Result<(), StepError>;
    }
}

/// Whether the master's gradients in `grads` are all finite (on the device; one verdict).
pub(crate) fn check_all<H: Precision, D: MixedDevice<H>>(
    slots: &[MasterSlot<D>],
    grads: &mut Gradients<f32, D>,
) -> Result<bool, StepError> {
    let mut finite = D::Finite::default();
    for slot in slots {
        D::check(slot, grads, &mut finite)?;
    }
    D::verdict(finite)
}

// ---- the Cpu: host slices -----------------------------------------------------------------------

mod cpu {
    use std::sync::Arc;

    use dfdx::optim::OptimizerUpdateError;
    use dfdx::shapes::{HasShape, Shape};
    use dfdx::tensor::{Cache, Cpu, CpuError, Gradients, Tensor, TensorFromVec, ZerosTensor};
    use dfdx::tensor_ops::{Device, ReshapeTo};

    use super::private::Primitives;
    use super::{FullOp, HalfOp, Pair, SeedOp};
    use crate::cast::grad_slice;
    use crate::finite::{add_scaled_checked, all_finite_f32};
    use crate::master::link::RegionLinks;
    use crate::master::slots::MasterSlot;
    use crate::nn::{read_into, scratch};
    use crate::precision::{FloatSlice, FloatSliceMut, Precision, sized};
    use crate::step::error::StepError;
    use mpx_kernels::{every_part, zip_parts};

    /// Working-copy tensors of at least this many bytes are kept by the store from one copy to
    /// the next, on the store's device, whose cache hands back the last step's buffers for
    /// their gradients; smaller ones are allocated plainly (on a tiny model the cache's
    /// bookkeeping costs more than the allocator's fast path: with no cache at all, the 2-2-1
    /// and 16-32-4 steps of `cargo run --release --example bench_step_overhead` ran 7% and 5%
    /// faster on a 2-core Zen 5, and `bench_step`'s rows a and f did not move).
    const CACHED_BYTES: usize = 64 << 10;

    /// Most large working-copy tensors the store keeps (far above one model's; beyond it a
    /// dropped copy's tensors are freed).
    const MAX_KEPT: usize = 256;

    /// The `Cpu`'s [`Primitives::Store`]: the large tensors of the last working copies
    /// (from [`CACHED_BYTES`] up), whose buffers the next copies are written into, in place when
    /// nothing else holds them (dfdx's `copy_from` copies a shared buffer first): a buffer
    /// taken from the allocator is zeroed before it is written, one kept is not; a device of the
    /// step's own, with dfdx's allocation cache on, that the kept tensors and so their half
    /// gradients are allocated on; the host buffers a master tensor is read and rounded
    /// through; and a plain device for the half region's own tensors
    /// ([`Primitives::region_device`]). The user's device and its settings are left alone.
    pub struct Store<H: Precision> {
        device: Option<Cpu>,
        region: Option<Cpu>,
        wide: Vec<f32>,
        half: Vec<H::Elem>,
        /// Tensors of dropped working copies, free to be written again.
        spare: Vec<Flat<H::Elem>>,
        /// Tensors of the working copy being built or used.
        lent: Vec<Flat<H::Elem>>,
    }

    /// A kept working-copy tensor, seen as one row of values.
    type Flat<E> = Tensor<(usize,), E, Cpu>;

    impl<H: Precision> Drop for Store<H> {
        /// Frees the kept tensors, then turns the device's cache off, which frees what it holds:
        /// dfdx's `Cpu` frees a cache's buffers only when asked, so one dropped while on would
        /// keep them for the rest of the process (tensors still alive elsewhere free theirs when
        /// they go).
        fn drop(&mut self) {
            self.spare.clear();
            self.lent.clear();
            if let Some(dev) = &self.device {
                // emptying a host cache cannot fail
                let _ = dev.try_disable_cache();
            }
        }
    }

    impl<H: Precision> Default for Store<H> {
        fn default() -> Self {
            Self {
                device: None,
                region: None,
                wide: Vec::new(),
                half: Vec::new(),
                spare: Vec::new(),
                lent: Vec::new(),
            }
        }
    }

    impl<H: Precision> Primitives<H> for Cpu
    where
        Cpu: Device<H::Elem>,
    {
        type Links = Arc<RegionLinks>;
        type Finite = Finite;

        fn step_error(e: CpuError) -> StepError {
            StepError::Device(e)
        }

        fn optimizer_error(e: OptimizerUpdateError<CpuError>) -> StepError {
            StepError::Optimizer(e)
        }

        fn region_device<M>(_: &M, store: &mut Store<H>) -> Result<Cpu, StepError> {
            Ok(store.region.get_or_insert_with(Cpu::default).clone())
        }

        fn links(inv: f32) -> Arc<RegionLinks> {
            RegionLinks::new(inv)
        }

        fn linker(links: &Arc<RegionLinks>) -> crate::step::Linker {
            crate::step::Linker::new(Arc::clone(links))
        }

        fn is_linked(links: &Arc<RegionLinks>, addr: usize) -> bool {
            links.is_linked(addr)
        }

        fn lend(links: &Arc<RegionLinks>, grads: &mut Gradients<f32, Cpu>) {
            links.lend(grads);
        }

        fn restore(links: &Arc<RegionLinks>, grads: &mut Gradients<f32, Cpu>) {
            links.restore(grads);
        }

        type Store = Store<H>;

        fn to_working<S: Shape>(
            x: &Tensor<S, f32, Cpu>,
            store: &mut Store<H>,
        ) -> Result<Tensor<S, H::Elem, Cpu>, CpuError> {
            // f32: the master's own buffer, shared (dfdx copies it before any write)
            if let Some(shared) = H::share(x) {
                return Ok(shared);
            }
            let n = x.shape().num_elements();
            let wide = sized(&mut store.wide, n);
            read_into(x, wide)?;
            if n.saturating_mul(std::mem::size_of::<H::Elem>()) < CACHED_BYTES {
                // rounded straight into the tensor's own buffer, on the master's device
                let mut half = vec![H::Elem::default(); n];
                H::round(wide, &mut half);
                return x.device().try_tensor_from_vec(half, *x.shape());
            }
            let half = sized(&mut store.half, n);
            zip_parts(half, wide, &|dst, src| {
                H::round(src, dst);
                true
            });
            let mut t = if let Some(i) = store.spare.iter().position(|t| t.shape().0 == n) {
                store.spare.swap_remove(i)
            } else {
                let dev = store.device.get_or_insert_with(|| {
                    let dev = Cpu::default();
                    dev.enable_cache();
                    dev
                });
                dev.try_zeros_like(&(n,))?
            };
            t.copy_from(half);
            store.lent.push(t.clone());
            t.try_reshape_like(x.shape())
        }

        fn recycle(store: &mut Store<H>) {
            let room = MAX_KEPT.saturating_sub(store.spare.len());
            // drained, not taken: the list keeps its room for the next copy's tensors
            store.spare.extend(store.lent.drain(..).take(room));
        }

        fn to_half<S: Shape, T>(
            x: &Tensor<S, f32, Cpu, T>,
        ) -> Result<Tensor<S, H::Elem, Cpu>, CpuError> {
            let n = x.shape().num_elements();
            // read with one memcpy (gathered where it is a view): dfdx's `as_vec` walks the
            // tensor index by index; through a fused op's scratch buffer (a short one allocates
            // nothing)
            let mut values = scratch::take::<f32>(n);
            read_into(x, &mut values)?;
            let mut half = vec![H::Elem::default(); n];
            H::round(&values, &mut half);
            x.device().try_tensor_from_vec(half, *x.shape())
        }

        fn to_full<S: Shape, T>(
            y: &Tensor<S, H::Elem, Cpu, T>,
        ) -> Result<Tensor<S, f32, Cpu>, CpuError> {
            let n = y.shape().num_elements();
            // read through a fused op's scratch buffer (a short one allocates nothing)
            let mut half = scratch::take::<H::Elem>(n);
            read_into(y, &mut half)?;
            let mut full = vec![0.0f32; n];
            H::widen(&half, &mut full);
            y.device().try_tensor_from_vec(full, *y.shape())
        }

        fn input_bridge<S: Shape>(
            x: &Tensor<S, H::Elem, Cpu>,
            x32: &Tensor<S, f32, Cpu>,
            inv: f32,
            links: &Arc<RegionLinks>,
        ) -> (HalfOp<H::Elem, Cpu>, Option<FullOp<Cpu>>) {
            let (x, x32, links) = (x.ghost(), x32.ghost(), Arc::clone(links));
            let capture: HalfOp<H::Elem, Cpu> = Box::new(move |g: &mut Gradients<H::Elem, Cpu>| {
                let src = grad_slice::<H::Elem>(g.get_or_alloc_mut(&x)?);
                // widened and unscaled chunk by chunk straight into the f32 gradient, which
                // the links hold while the half backward runs
                links.with_lent(|g32| {
                    let dst = grad_slice::<f32>(g32.get_or_alloc_mut(&x32)?);
                    if dst.len() != src.len() {
                        return Err(CpuError::WrongNumElements);
                    }
                    add_unscaled::<H>(src, inv, dst);
                    Ok(())
                })
            });
            (capture, None)
        }

        fn unread_mark<S: Shape>(
            x: &Tensor<S, H::Elem, Cpu>,
            links: &Arc<RegionLinks>,
        ) -> Option<HalfOp<H::Elem, Cpu>> {
            let (x, links) = (x.ghost(), Arc::clone(links));
            Some(Box::new(move |g: &mut Gradients<H::Elem, Cpu>| {
                let at = grad_slice::<H::Elem>(g.get_or_alloc_mut(&x)?)
                    .as_ptr()
                    .addr();
                links.mark_unread(at);
                Ok(())
            }))
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
                    with_chunk(n, |buf| {
                        for (src, dst) in g.chunks(buf.len()).zip(seed.chunks_mut(buf.len())) {
                            let b = &mut buf[..src.len()];
                            b.iter_mut().zip(src).for_each(|(b, v)| *b = v * scale);
                            H::round(b, dst);
                        }
                    });
                }
                let apply: HalfOp<H::Elem, Cpu> =
                    Box::new(move |g: &mut Gradients<H::Elem, Cpu>| {
                        let buf = grad_slice::<H::Elem>(g.get_or_alloc_mut(&y)?);
                        match (H::floats_mut(buf), H::floats(&seed)) {
                            // `d + s` in f32, rounded once, as `half`'s `+=` computes it, in
                            // vector passes instead of one element at a time
                            (FloatSliceMut::F16(d), FloatSlice::F16(s)) => {
                                // widened through a stack buffer: no allocation per step
                                with_chunk(s.len(), |wide| {
                                    let len = wide.len();
                                    for (dc, sc) in d.chunks_mut(len).zip(s.chunks(len)) {
                                        let w = &mut wide[..sc.len()];
                                        mpx_kernels::convert::widen_f16(sc, w);
                                        mpx_kernels::convert::add_f32_into_f16(w, dc);
                                    }
                                });
                            }
                            (FloatSliceMut::F32(d), FloatSlice::F32(s) | FloatSlice::Bf16(s)) => {
                                d.iter_mut().zip(s).for_each(|(d, s)| *d += *s);
                            }
                            (FloatSliceMut::F32(_), FloatSlice::F16(_))
                            | (FloatSliceMut::F16(_), _) => {
                                return Err(CpuError::WrongNumElements);
                            }
                        }
                        Ok(())
                    });
                Ok(apply)
            })
        }

        fn transfer(
            half: &mut Gradients<H::Elem, Cpu>,
            pair: &Pair<H, Cpu>,
            grads: &mut Gradients<f32, Cpu>,
            inv: f32,
        ) -> Result<(), CpuError> {
            let src = pair.half.slice(half)?;
            if pair.linked && all_zero(H::floats(src)) {
                // written straight into the master's gradient by a linked layer
                return Ok(());
            }
            let dst = pair.master.slice(grads)?;
            if dst.len() != src.len() {
                return Err(CpuError::WrongNumElements);
            }
            add_unscaled::<H>(src, inv, dst);
            Ok(())
        }

        fn check(
            slot: &MasterSlot<Cpu>,
            grads: &mut Gradients<f32, Cpu>,
            finite: &mut Finite,
        ) -> Result<(), StepError> {
            let values = slot.slice(grads)?;
            finite.0 &= every_part(values, &all_finite_f32);
            Ok(())
        }

        fn verdict(finite: Finite) -> Result<bool, StepError> {
            Ok(finite.0)
        }

        fn kept(
            slot: &MasterSlot<Cpu>,
            grads: &mut Gradients<f32, Cpu>,
        ) -> Result<bool, StepError> {
            // A mark written into the gradient survives dropping what is not a leaf exactly
            // when the gradient is one; its value is put back then.
            let buf = slot.slice(grads)?;
            let Some(first) = buf.first_mut() else {
                return Ok(true);
            };
            let saved = std::mem::replace(first, f32::from_bits(MARK));
            grads.drop_non_leafs();
            let buf = slot.slice(grads)?;
            let kept = buf.first().is_some_and(|v| v.to_bits() == MARK);
            if kept {
                buf[0] = saved;
            } else {
                // the zeros just allocated to look
                grads.drop_non_leafs();
            }
            Ok(kept)
        }

        #[cfg(feature = "mpi")]
        fn reduce(
            reducer: Option<&mut crate::distributed::Reducer>,
            slots: &[&MasterSlot<Cpu>],
            grads: &mut Gradients<f32, Cpu>,
            grads_finite: bool,
            loss_finite: bool,
            scale: f32,
            counters: [u64; 2],
        ) -> Result<Option<bool>, StepError> {
            let finite = grads_finite && loss_finite;
            Ok(crate::distributed::after_backward(
                reducer, slots, grads, finite, scale, counters,
            )?)
        }

        #[cfg(feature = "mpi")]
        fn before_update(
            reducer: Option<&mut crate::distributed::Reducer>,
        ) -> Result<(), StepError> {
            Ok(crate::distributed::before_update(reducer)?)
        }
    }

    /// A NaN with a payload of its own: any value but a fresh gradient's (zero) would do.
    const MARK: u32 = 0x7fc0_5a17;

    /// Whether every host slice checked was finite.
    pub struct Finite(pub(crate) bool);

    impl Default for Finite {
        fn default() -> Self {
            Self(true)
        }
    }

    /// Elements moved per chunk (widened, unscaled and added while in cache).
    const CHUNK: usize = 1024;

    /// Adds `src` (scaled half gradients) times `inv_scale` to `dst`: each chunk is widened
    /// into a stack buffer, then added, so `dst` is read once.
    pub(crate) fn add_unscaled<H: Precision>(src: &[H::Elem], inv_scale: f32, dst: &mut [f32]) {
        with_chunk(src.len(), |buf| {
            let len = buf.len();
            for (s, d) in src.chunks(len).zip(dst.chunks_mut(len)) {
                let b = &mut buf[..s.len()];
                H::widen(s, b);
                // finiteness is checked once the whole backward pass has run
                add_scaled_checked(d, b, inv_scale);
            }
        });
    }

    /// Values in a [`with_chunk`] buffer for a short gradient.
    const SHORT: usize = 64;

    /// Runs `f` on a zeroed stack buffer of [`CHUNK`] values, or of [`SHORT`] when `n` values
    /// fit (zeroing 4 KiB costs more than a tiny model's whole gradient).
    fn with_chunk<R>(n: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
        if n <= SHORT {
            f(&mut [0.0; SHORT])
        } else {
            f(&mut [0.0; CHUNK])
        }
    }

    /// Whether every bit of a gradient is zero (nothing was added to it), read on the pool's
    /// threads for a long gradient.
    pub(crate) fn all_zero(values: FloatSlice<'_>) -> bool {
        match values {
            FloatSlice::F32(v) | FloatSlice::Bf16(v) => {
                every_part(v, &|p| p.iter().fold(0, |acc, x| acc | x.to_bits()) == 0)
            }
            FloatSlice::F16(v) => {
                every_part(v, &|p| p.iter().fold(0, |acc, x| acc | x.to_bits()) == 0)
            }
        }
    }
}

// The one module of this crate with `unsafe` (besides `distributed`'s `Send`/`Sync`): it launches
// mpx's own CUDA kernels on dfdx's gradient buffers through cudarc, whose `launch` is unsafe (it
// cannot check a kernel's parameter types). The launches take dfdx's `Cuda` buffers of dfdx's
// element types, are built only with CUDA and run only on a GPU, so they stay next to the code
// that owns those buffers; each checks its lengths first and says why it is sound (`// SAFETY:`).
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda;
