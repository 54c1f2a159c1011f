//! The working copy of one forward pass, built from the master when the pass starts and dropped
//! when its backward pass has run: the master's tensors rounded to the half type, and every
//! setting that is not a tensor (a norm's `epsilon` and `momentum`, dropout's `p`, a user's own
//! scalar fields) copied as the master has it now.
//!
//! A fresh copy per pass is what makes the working copy the user's model: a change to the
//! master between two passes (an evaluation pass, a schedule, a restored checkpoint) is seen by
//! the next, a clone of the master gets a copy of its own, and two passes of one master before
//! one backward pass never share buffers. Its buffers come from the allocator, which hands the
//! last step's back.
//!
//! Two kinds ([`Kind`]): [`Plain`], the master's own layers in the half type
//! (`<M as TensorCollection<f32, D>>::To<H::Elem, D>`), built by walking the master; and
//! [`Mapped`], a working copy made of mpx's layers ([`HalfLayers`]), built by walking its own
//! type and filling its tensors and scalars from the master's by position.

use dfdx::nn::tensor_collection::{
    RecursiveWalker, ScalarOptions, TensorCollection, TensorOptions, TensorVisitor, ViewTensorRef,
};
use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, Tensor};
use dfdx::tensor_ops::ReshapeTo;
use num_traits::NumCast;

use super::device::private::Primitives;
use super::device::{MixedDevice, Pair};
use super::error::StepError;
use super::mapped::HalfLayers;
use super::slots::{EachTensor, MasterSlot, Slot, each_tensor};
use crate::boundary::MasterModel;
use crate::cast::{CastError, copy_scalar};
use crate::precision::{Precision, Stored};

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
    fn new(copy: C) -> Self {
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

    /// Records a trainable tensor of the copy, standing for master tensor `master`.
    fn trainable<S: Shape>(&mut self, half: &Tensor<S, H::Elem, D>, master: MasterSlot<D>) {
        self.pairs.push(Pair {
            half: Slot::of(half),
            master,
            linked: false,
        });
    }

    /// Records a non-trainable tensor of the copy, to compare after the forward pass.
    fn state<S: Shape>(&mut self, half: &Tensor<S, H::Elem, D>) {
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
        impl<H: Precision, D: MixedDevice<H>> EachTensor<H::Elem, D> for Read<H, D> {
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
        each_tensor(copy, &mut now, std::convert::identity)?;
        let now = now.0;
        let same = now.len() == self.initial.len()
            && now
                .iter()
                .zip(&self.initial)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        Ok((!same).then_some(now))
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
/// [`Mapped`] (mpx's layers, [`HalfLayers`]). Sealed.
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

/// The working copy is made of mpx's layers ([`HalfLayers::Working`]).
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
        let copy = M::iter_tensors(&mut RecursiveWalker {
            m: master,
            f: &mut walk,
        })
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

impl<H: Precision, D: MixedDevice<H>> TensorVisitor<f32, D> for ToHalf<'_, H, D> {
    type Viewer = ViewTensorRef;
    type Err = D::Err;
    type E2 = H::Elem;
    type D2 = D;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, f32, D>,
        t: &Tensor<S, f32, D>,
    ) -> Result<Option<Tensor<S, H::Elem, D>>, D::Err> {
        let half = D::to_working(t, self.store)?;
        if opts.do_gradient_update {
            self.built.trainable(&half, Slot::of(t));
        } else {
            self.built.state(&half);
        }
        Ok(Some(half))
    }

    fn visit_scalar<N: NumCast>(
        &mut self,
        opts: ScalarOptions<N>,
        value: &N,
    ) -> Result<Option<N>, D::Err> {
        Ok(Some(copy_scalar(value).unwrap_or(opts.default)))
    }
}

impl<H, M> Kind<H, M, Cpu> for Mapped
where
    H: Precision,
    Cpu: MixedDevice<H>,
    M: HalfLayers<H>,
{
    type Copy = M::Working;
    const MAPPED: bool = true;
    #[allow(private_interfaces)]
    fn build(
        master: &M,
        links: &<Cpu as Primitives<H>>::Links,
        store: &mut <Cpu as Primitives<H>>::Store,
    ) -> Result<Built<H, Cpu, Self::Copy>, StepError> {
        let mut cx = BuildCx {
            store,
            built: Built::new(()),
            addrs: Vec::new(),
            root: master,
            flags: None,
        };
        let copy = master.build_working(&mut cx)?;
        let BuildCx {
            built: Built { pairs, state, .. },
            addrs,
            ..
        } = cx;
        let mut built = Built { copy, pairs, state };
        master.finish(&mut built.copy, &<Cpu as Primitives<H>>::linker(links));
        for (pair, &addr) in built.pairs.iter_mut().zip(&addrs) {
            pair.linked = <Cpu as Primitives<H>>::is_linked(links, addr);
        }
        Ok(built)
    }
}

/// What a mapped working copy is built with, part by part
/// ([`HalfLayers::build_working`](super::HalfLayers::build_working)): the store its buffers come
/// from, and the record of each tensor built (the master tensor it stands for, or the state it
/// carries). Reachable only through the hidden method, which `#[derive(HalfLayers)]` calls.
#[doc(hidden)]
#[allow(missing_debug_implementations)]
pub struct BuildCx<'a, H: Precision>
where
    Cpu: MixedDevice<H>,
{
    store: &'a mut <Cpu as Primitives<H>>::Store,
    built: Built<H, Cpu, ()>,
    /// The master address of each trainable tensor, in the order of `built.pairs`.
    addrs: Vec<usize>,
    /// The whole master, whose walk says which tensors are trainable (read once, when a part
    /// built field by field holds a tensor of its own).
    root: &'a dyn Flags,
    flags: Option<std::collections::HashMap<usize, bool>>,
}

/// Which tensors of a model are trainable, by address.
trait Flags {
    fn flags(&self) -> std::collections::HashMap<usize, bool>;
}

impl<M: TensorCollection<f32, Cpu>> Flags for M {
    fn flags(&self) -> std::collections::HashMap<usize, bool> {
        struct Walk(std::collections::HashMap<usize, bool>);
        impl EachTensor<f32, Cpu> for Walk {
            type Error = CpuError;
            fn tensor<S: Shape>(
                &mut self,
                trainable: bool,
                t: &Tensor<S, f32, Cpu>,
            ) -> Result<(), CpuError> {
                self.0.insert(std::ptr::from_ref(t).addr(), trainable);
                Ok(())
            }
        }
        let mut w = Walk(std::collections::HashMap::new());
        // a walk that reads cannot fail
        let _ = each_tensor(self, &mut w, std::convert::identity);
        w.0
    }
}

impl<H: Precision> BuildCx<'_, H>
where
    Cpu: MixedDevice<H>,
{
    /// The working copy of a layer built as a whole: its tensors and scalars filled by position
    /// from the master's, in dfdx's visit order.
    ///
    /// # Errors
    /// The working copy's layout differs from the master's.
    pub fn leaf<M: HalfLayers<H>>(&mut self, master: &M) -> Result<M::Working, StepError> {
        let mut gather = Gather::default();
        M::iter_tensors(&mut RecursiveWalker {
            m: master,
            f: &mut gather,
        })?;
        let first_pair = self.built.pairs.len();
        let mut fill = Fill::<H> {
            gather: &mut gather,
            store: &mut *self.store,
            built: &mut self.built,
            first_pair,
            tensor: 0,
            scalar: 0,
        };
        let copy = M::Working::iter_tensors(&mut RecursiveWalker {
            m: (),
            f: &mut fill,
        })
        .map_err(StepError::Cast)?
        .ok_or(StepError::Cast(CastError::NotRebuilt))?;
        fill.finish()?;
        self.addrs.extend(gather.trainable_addrs);
        Ok(copy)
    }

    /// Master tensor `t`, field `field` of module `M` (a part built field by field), rounded to
    /// `H`; `trainable`: whether the part's working copy declares it trained.
    ///
    /// # Errors
    /// The master's own walk says otherwise ([`StepError::FieldTrainable`]), or a device error.
    pub fn tensor<M, S: Shape>(
        &mut self,
        t: &Tensor<S, f32, Cpu>,
        trainable: bool,
        field: &'static str,
    ) -> Result<Tensor<S, H::Elem, Cpu>, StepError> {
        let addr = std::ptr::from_ref(t).addr();
        let root = self.root;
        let in_master = self
            .flags
            .get_or_insert_with(|| root.flags())
            .get(&addr)
            .copied()
            .unwrap_or(false);
        if in_master != trainable {
            return Err(StepError::FieldTrainable {
                module: std::any::type_name::<M>(),
                field,
                trainable: in_master,
            });
        }
        let half = <Cpu as Primitives<H>>::to_working(t, self.store).map_err(StepError::Device)?;
        if trainable {
            self.built.trainable(&half, Slot::of(t));
            self.addrs.push(addr);
        } else {
            self.built.state(&half);
        }
        Ok(half)
    }
}

/// A master tensor seen as one row of values (its buffer shared).
type Flat = Tensor<(usize,), f32, Cpu>;

/// One walk of the master: every tensor in visit order (flat, sharing the master's buffer), with
/// its trainable flag, the trainable tensors' slots and addresses, and every scalar.
#[derive(Default)]
struct Gather {
    tensors: Vec<(Flat, bool)>,
    slots: Vec<Option<MasterSlot>>,
    trainable_addrs: Vec<usize>,
    scalars: Vec<f64>,
}

impl TensorVisitor<f32, Cpu> for Gather {
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
        // a contiguous tensor is reshaped in place (its buffer shared, not copied)
        let flat = t.clone().try_reshape_like(&(n,))?;
        self.tensors.push((flat, opts.do_gradient_update));
        if opts.do_gradient_update {
            self.slots.push(Some(Slot::of(t)));
            self.trainable_addrs.push(std::ptr::from_ref(t).addr());
        }
        Ok(None)
    }

    fn visit_scalar<N: NumCast>(
        &mut self,
        _: ScalarOptions<N>,
        value: &N,
    ) -> Result<Option<N>, CpuError> {
        self.scalars.push(value.to_f64().unwrap_or(f64::NAN));
        Ok(None)
    }
}

/// Builds the mapped working copy by walking its own type, filling each tensor and scalar from
/// the master's in visit order; every length and trainable flag is checked.
struct Fill<'a, H: Precision>
where
    Cpu: MixedDevice<H>,
{
    gather: &'a mut Gather,
    store: &'a mut <Cpu as Primitives<H>>::Store,
    built: &'a mut Built<H, Cpu, ()>,
    /// Pairs the parts before this layer recorded.
    first_pair: usize,
    tensor: usize,
    scalar: usize,
}

impl<H: Precision> Fill<'_, H>
where
    Cpu: MixedDevice<H>,
{
    /// Checks that the working copy took every tensor and scalar of the master.
    fn finish(&self) -> Result<(), StepError> {
        if let Some((src, _)) = self.gather.tensors.get(self.tensor) {
            return Err(StepError::Cast(CastError::LengthMismatch {
                index: self.tensor,
                src: src.shape().0,
                dst: 0,
            }));
        }
        if self.scalar != self.gather.scalars.len() {
            return Err(StepError::Cast(CastError::ScalarMismatch {
                index: self.scalar,
            }));
        }
        Ok(())
    }
}

impl<H: Precision> TensorVisitor<H::Elem, Cpu> for Fill<'_, H>
where
    Cpu: MixedDevice<H>,
{
    type Viewer = ();
    type Err = CastError;
    type E2 = H::Elem;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, H::Elem, Cpu>,
        (): (),
    ) -> Result<Option<Tensor<S, H::Elem, Cpu>>, CastError> {
        let index = self.tensor;
        let n = opts.shape.num_elements();
        let Some((source, trainable)) = self.gather.tensors.get(index) else {
            return Err(CastError::LengthMismatch {
                index,
                src: 0,
                dst: n,
            });
        };
        let (src, trainable) = (source.shape().0, *trainable);
        if src != n {
            return Err(CastError::LengthMismatch { index, src, dst: n });
        }
        if trainable != opts.do_gradient_update {
            return Err(CastError::TrainableMismatch { index });
        }
        let t = <Cpu as Primitives<H>>::to_working(source, self.store)
            .and_then(|t| t.try_reshape_like(&opts.shape))
            .map_err(|_| CastError::LengthMismatch { index, src, dst: n })?;
        if trainable {
            let slot = self
                .gather
                .slots
                .get_mut(self.built.pairs.len() - self.first_pair)
                .and_then(Option::take);
            let Some(slot) = slot else {
                return Err(CastError::TrainableMismatch { index });
            };
            self.built.trainable(&t, slot);
        } else {
            self.built.state(&t);
        }
        self.tensor += 1;
        Ok(Some(t))
    }

    fn visit_scalar<N: NumCast>(
        &mut self,
        opts: ScalarOptions<N>,
        (): (),
    ) -> Result<Option<N>, CastError> {
        let index = self.scalar;
        let value = self
            .gather
            .scalars
            .get(index)
            .ok_or(CastError::ScalarMismatch { index })?;
        self.scalar += 1;
        Ok(Some(N::from(*value).unwrap_or(opts.default)))
    }
}
