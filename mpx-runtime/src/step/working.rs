//! The working copy of one forward pass, built from the master when the pass starts: the
//! master's tensors rounded to the half type, and every setting that is not a tensor (a norm's
//! `epsilon` and `momentum`, dropout's `p`, a user's own scalar fields) copied as the master has
//! it now. When a `forward_mut` pass returns, what it changed in the copy outside its layers and
//! tensors (a module of the user's own's counter or history) goes back to the master
//! ([`Kind::carry_back`]) and the copy is dropped; its tensors live on in the tape until the
//! backward pass has run.
//!
//! A fresh copy per pass is what makes the working copy the user's model: a change to the
//! master between two passes (an evaluation pass, a schedule, a restored checkpoint) is seen by
//! the next, a clone of the master gets a copy of its own, and two passes of one master before
//! one backward pass never share buffers. Its large tensors are the last copy's, kept by the
//! scaler and written again in place (dfdx copies a buffer something else still holds before it
//! writes it); the small ones come from the allocator, which hands the last step's back.
//!
//! Two kinds ([`Kind`]): [`Plain`], the master's own layers in the half type
//! (`<M as TensorCollection<f32, D>>::To<H::Elem, D>`), built by walking the master; and
//! [`Mapped`], a working copy made of mpx's layers ([`HalfLayers`](super::HalfLayers)), built by walking its own
//! type and filling its tensors and scalars from the master's by position.

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::{Cpu, Tensor};

use super::device::{MixedDevice, Pair};
use super::error::StepError;
use crate::boundary::MasterModel;
use crate::cast::CastError;
use crate::master::slots::{MasterSlot, Slot};
use crate::precision::{Precision, Stored};
use crate::walk::{Each, EachMut, Map, each, each_mut};

/// The working copy of master model `M` in precision `H` on device `D` (the `Cpu` unless named):
/// the same module with its float tensors stored as `H::Elem` (`f16`, `AMP<f16>`, or `f32` for
/// emulated bf16).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::step::WorkingCopy;
/// type Master = dfdx::nn::modules::Linear<2, 3, f32, Cpu>;
/// let dev = Cpu::default();
/// let half: WorkingCopy<f16, Master> = dev.build_module::<Linear<2, 3>, f16>();
/// assert_eq!(half.weight.shape(), &(Const::<3>, Const::<2>));
/// ```
pub type WorkingCopy<H, M, D = Cpu> =
    <M as TensorCollection<f32, D>>::To<<H as crate::precision::Precision>::Elem, D>;

/// A working copy and what its forward pass and backward pass need to know of it.
pub(crate) struct Built<H: Precision, D: MixedDevice<H>, C> {
    pub(crate) copy: C,
    /// Each trainable tensor with the master tensor it stands for, in visit order.
    pub(crate) pairs: Vec<Pair<H, D>>,
    /// The non-trainable tensors.
    pub(crate) state: StateWatch<H, D>,
}

/// The values of a working copy's non-trainable tensors (batch-norm statistics) as it was built
/// with them, widened: what its forward pass changed is read against them.
pub(crate) struct StateWatch<H: Precision, D: MixedDevice<H>> {
    initial: Vec<f32>,
    any: bool,
    marker: std::marker::PhantomData<fn() -> (H, D)>,
}

impl<H: Precision, D: MixedDevice<H>, C> Built<H, D, C> {
    pub(super) fn new(copy: C) -> Self {
        Self {
            copy,
            pairs: Vec::new(),
            state: StateWatch {
                initial: Vec::new(),
                any: false,
                marker: std::marker::PhantomData,
            },
        }
    }

    /// Records a trainable tensor of the copy, standing for master tensor `master` (`linked`: a
    /// fused layer writes its gradient straight into the master's).
    pub(super) fn trainable<S: Shape>(
        &mut self,
        half: &Tensor<S, H::Elem, D>,
        master: MasterSlot<D>,
        linked: bool,
    ) {
        self.pairs.push(Pair {
            half: Slot::of(half),
            master,
            linked,
        });
    }

    /// Records a non-trainable tensor of the copy, to compare after the forward pass.
    pub(super) fn state<S: Shape>(&mut self, half: &Tensor<S, H::Elem, D>) {
        self.state.any = true;
        widen_into::<H, S, D>(half, &mut self.state.initial);
    }
}

impl<H: Precision, D: MixedDevice<H>> StateWatch<H, D> {
    /// The non-trainable tensors of `copy` as its forward pass left them, when it changed any
    /// (`None` otherwise: a forward pass in evaluation mode leaves the master's statistics
    /// alone).
    pub(crate) fn changed<C: TensorCollection<H::Elem, D>>(
        &self,
        copy: &C,
    ) -> Result<Option<Vec<f32>>, D::Err> {
        struct Read<H, D>(Vec<f32>, std::marker::PhantomData<fn() -> (H, D)>);
        impl<H: Precision, D: MixedDevice<H>> Each<H::Elem, D> for Read<H, D> {
            type Error = D::Err;
            fn tensor<S: Shape>(
                &mut self,
                trainable: bool,
                t: &Tensor<S, H::Elem, D>,
            ) -> Result<(), D::Err> {
                if !trainable {
                    widen_into::<H, S, D>(t, &mut self.0);
                }
                Ok(())
            }
        }
        if !self.any {
            return Ok(None);
        }
        let mut now = Read::<H, D>(
            Vec::with_capacity(self.initial.len()),
            std::marker::PhantomData,
        );
        each(copy, &mut now, std::convert::identity)?;
        let now = now.0;
        let same = now.len() == self.initial.len()
            && now
                .iter()
                .zip(&self.initial)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        Ok((!same).then_some(now))
    }
}

impl<H: Precision, D: MixedDevice<H>> StateWatch<H, D> {
    /// The non-trainable tensors' values as the copy was built (widened, in visit order; after a
    /// [`resume`](Self::resume), as it left them).
    pub(crate) fn initial(&self) -> &[f32] {
        &self.initial
    }

    /// Starts `copy`'s non-trainable tensors from `pending`: what an earlier forward pass of the
    /// master left in them that no update has written into the master yet (each micro-batch of
    /// an accumulation moves batch norm's running statistics on, as in f32). One entry per
    /// non-trainable tensor, in visit order: its values, or `None` to keep the master's.
    ///
    /// # Errors
    /// [`StepError::MasterChanged`] when `pending` does not line up with the copy's tensors; a
    /// device error.
    pub(crate) fn resume<C: TensorCollection<H::Elem, D>>(
        &mut self,
        copy: &mut C,
        pending: &[Option<Vec<f32>>],
    ) -> Result<(), StepError> {
        struct Resume<'a, H, D> {
            pending: &'a [Option<Vec<f32>>],
            next: usize,
            initial: Vec<f32>,
            model: &'static str,
            marker: std::marker::PhantomData<fn() -> (H, D)>,
        }
        impl<H: Precision, D: MixedDevice<H>> EachMut<H::Elem, D> for Resume<'_, H, D> {
            type Error = StepError;
            fn tensor<S: Shape>(
                &mut self,
                trainable: bool,
                t: &mut Tensor<S, H::Elem, D>,
            ) -> Result<(), StepError> {
                if trainable {
                    return Ok(());
                }
                let entry = self.pending.get(self.next);
                self.next += 1;
                match entry.ok_or(StepError::MasterChanged { model: self.model })? {
                    Some(values) if values.len() == t.shape().num_elements() => {
                        let mut half = vec![H::Elem::default(); values.len()];
                        H::round(values, &mut half);
                        t.copy_from(&half);
                    }
                    Some(_) => return Err(StepError::MasterChanged { model: self.model }),
                    None => {}
                }
                widen_into::<H, S, D>(t, &mut self.initial);
                Ok(())
            }
        }
        let mut walk = Resume::<H, D> {
            pending,
            next: 0,
            initial: Vec::with_capacity(self.initial.len()),
            model: std::any::type_name::<C>(),
            marker: std::marker::PhantomData,
        };
        each_mut(copy, &mut walk, D::step_error)?;
        if walk.next != pending.len() {
            return Err(StepError::MasterChanged { model: walk.model });
        }
        self.initial = walk.initial;
        Ok(())
    }
}

/// Appends `t`'s values, widened to f32, to `out`.
fn widen_into<H: Precision, S: Shape, D: MixedDevice<H>>(
    t: &Tensor<S, H::Elem, D>,
    out: &mut Vec<f32>,
) {
    let values = t.as_vec();
    let start = out.len();
    out.resize(start + values.len(), 0.0);
    H::widen(&values, &mut out[start..]);
}

/// How a master's working copy is made: [`Plain`] (the master's own layers in `H`) or
/// [`Mapped`] (mpx's layers, [`HalfLayers`](super::HalfLayers)). Sealed.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot make a working copy of `{M}` in `{H}`",
    label = "no working copy of this kind",
    note = "`Mixed::new` (`Plain`) runs the model's own layers in `H`, which needs a precision dfdx stores (f16, `AMP<f16>`); `Mixed::mapped` (`Mapped`) runs mpx's layers, which needs every layer of the model to map to one (`HalfLayers`), and runs emulated bf16"
)]
pub trait Kind<H: Precision, M, D: MixedDevice<H>>: sealed::Sealed + 'static {
    /// The working copy.
    type Copy: TensorCollection<H::Elem, D>;
    /// Whether the working copy is made of mpx's layers.
    const MAPPED: bool;
    /// The working copy of `master` for one forward pass, linked through `links`.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn build(
        master: &M,
        links: &D::Links,
        store: &mut D::Store,
    ) -> Result<Built<H, D, Self::Copy>, StepError>;
    /// Takes back into `master` what a `forward_mut` pass changed in `copy` outside its layers
    /// and tensors ([`HalfLayers::carry_back`](super::HalfLayers::carry_back)); nothing for
    /// [`Plain`], whose copy dfdx's visitors rebuild from the master's tensors and scalars.
    #[doc(hidden)]
    fn carry_back(master: &mut M, copy: &mut Self::Copy) {
        let _ = (master, copy);
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Plain {}
    impl Sealed for super::Mapped {}
}

/// The working copy is the master's own module in `H` ([`WorkingCopy`]), for the precisions
/// dfdx stores in their own type ([`Stored`]: f16, `AMP<f16>`, f32).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::step::{Mixed, Plain};
/// let model = Cpu::default().build_module::<Linear<2, 1>, f32>();
/// let _: Mixed<_, Plain> = Mixed::new(model);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Plain;

/// The working copy is made of mpx's layers ([`HalfLayers::Working`](super::HalfLayers::Working)).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::step::{Mapped, Mixed};
/// let model = Cpu::default().build_module::<Linear<2, 1>, f32>();
/// let _: Mixed<_, Mapped> = Mixed::mapped(model);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Mapped;

impl<H, M, D> Kind<H, M, D> for Plain
where
    H: Stored,
    D: MixedDevice<H>,
    M: MasterModel<D>,
    WorkingCopy<H, M, D>: TensorCollection<H::Elem, D>,
{
    type Copy = WorkingCopy<H, M, D>;
    const MAPPED: bool = false;
    #[allow(private_interfaces)]
    fn build(
        master: &M,
        _: &D::Links,
        store: &mut D::Store,
    ) -> Result<Built<H, D, Self::Copy>, StepError> {
        let mut walk = ToHalf::<H, D> {
            built: Built::new(()),
            store,
        };
        let copy = crate::walk::map::<f32, H::Elem, D, M, _>(master, &mut walk)
            .map_err(D::step_error)?
            .ok_or(StepError::Cast(CastError::NotRebuilt))?;
        let Built { pairs, state, .. } = walk.built;
        Ok(Built { copy, pairs, state })
    }
}

/// Walks the master, returning each tensor rounded to `H` and each scalar as the master has it.
struct ToHalf<'a, H: Precision, D: MixedDevice<H>> {
    built: Built<H, D, ()>,
    store: &'a mut D::Store,
}

impl<H: Precision, D: MixedDevice<H>> Map<f32, H::Elem, D> for ToHalf<'_, H, D> {
    type Error = D::Err;

    fn tensor<S: Shape>(
        &mut self,
        trainable: bool,
        t: &Tensor<S, f32, D>,
    ) -> Result<Tensor<S, H::Elem, D>, D::Err> {
        let half = D::to_working(t, self.store)?;
        if trainable {
            self.built.trainable(&half, Slot::of(t), false);
        } else {
            self.built.state(&half);
        }
        Ok(half)
    }
}
