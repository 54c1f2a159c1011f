//! [`HalfLayers`], the trait of a master whose working copy is made of mpx's layers, and how
//! such a working copy is built for one forward pass ([`BuildCx`]): by walking its own type and
//! filling each tensor and scalar from the master's by position, every length and trainable
//! flag checked. The map from dfdx's layers to mpx's, the trait's impls, is `mapped.rs`.

use dfdx::nn::tensor_collection::{
    RecursiveWalker, ScalarOptions, TensorCollection, TensorOptions, TensorVisitor,
};
use dfdx::shapes::{HasShape, Rank1, Rank2, Shape};
use dfdx::tensor::{Cpu, CpuError, Tensor};
use dfdx::tensor_ops::{Device, ReshapeTo};
use num_traits::NumCast;

use super::device::MixedDevice;
use super::device::private::Primitives;
use super::error::StepError;
use super::working::{Built, Kind, Mapped};
use crate::boundary::MasterModel;
use crate::cast::CastError;
use crate::master::link::Linker;
use crate::master::slots::{MasterSlot, Slot};
use crate::nn::FusedLinear;
use crate::precision::Precision;
use crate::walk::{Each, each};

/// A master model whose working copy in precision `H` can be made of mpx's layers:
/// - dfdx's `Linear<I, O>` becomes mpx's fused [`nn::Linear`](crate::nn::Linear) in `H::Elem`,
///   linked to the master's weight and bias;
/// - `LayerNorm1D`, `MultiHeadAttention`, the transformer's encoder and decoder blocks,
///   `TransformerDecoder` and `Transformer` become their mixed-ready [`mpx::nn`](crate::nn)
///   counterparts (layer-norm statistics and softmax in f32, matmuls on mpx's GEMM), so a
///   `TransformerEncoder` (dfdx's `Repeated` of blocks) maps too;
/// - `UnbiasedLinear<I, O>` becomes mpx's [`nn::UnbiasedLinear`](crate::nn::UnbiasedLinear)
///   (the fused op with a zero bias, on mpx's GEMM; not linked: its weight's gradient goes
///   through the half gradients);
/// - `BatchNorm1D<C>`, `BatchNorm2D<C>`, `Bias2D<C>`, `PReLU` and `PReLU1D<C>` become dfdx's own
///   in `H::Elem`, run in f32 ([`InF32Copy`](crate::nn::InF32Copy): computed in f32 on an f32
///   copy, the output rounded once; a batch norm's running statistics are written back to the
///   master on an applied update);
/// - `Embedding<V, M>` becomes mpx's [`nn::Embedding`](crate::nn::Embedding) (dfdx's gather; the
///   table's gradient summed in f32 per token, rounded once);
/// - `Exp`, `Ln`, `Softmax` and `LogSoftmax` (autocast's float32 list), `AvgPoolGlobal` (a sum)
///   and the element-wise functions `FastGeLU`, `AccurateGeLU`, the deprecated `GeLU`, `Abs`,
///   `Square`, `Sqrt`, `Sin` and `Cos` run in an f32 region ([`InF32`](crate::nn::InF32)), their
///   output rounded once; `ReLU` becomes mpx's [`nn::ReLU`](crate::nn::ReLU) (the
///   same values and gradients, in vector passes; never fused into the layer before it, so a
///   step that calls the layers one by one sees what it computes); `Tanh` and `Sigmoid` become
///   mpx's [`nn::Tanh`](crate::nn::Tanh) and [`nn::Sigmoid`](crate::nn::Sigmoid) (computed in
///   f32, rounded once, as mpx's layers are); `LeakyReLU` becomes mpx's
///   [`nn::LeakyReLU`](crate::nn::LeakyReLU) (the master's f32 slope, the product in f32,
///   rounded once); the other parameter-free layers (`Dropout`,
///   `DropoutOneIn`, `MaxPoolGlobal`, `MinPoolGlobal`, `Upscale2D`, `Reshape`) stay themselves;
/// - `Residual`, `GeneralizedResidual`, `Repeated`, `AddInto`, `SplitInto` and tuples of up to 6
///   such layers map their layers; the three that add become mpx's
///   [`nn::Residual`](crate::nn::Residual),
///   [`nn::GeneralizedResidual`](crate::nn::GeneralizedResidual) and
///   [`nn::AddInto`](crate::nn::AddInto) (the add of two f16 tensors in vector passes, with
///   dfdx's bits);
/// - mpx's own layers ([`nn::Linear`](crate::nn::Linear) and the rest of [`mpx::nn`](crate::nn))
///   in a master of f32 elements are themselves in `H`, a fused linear layer linked.
///
/// In emulated bf16 (f32 storage) mpx's layers stand in the working copy wrapped in
/// [`InBf16`](crate::nn::InBf16), which runs them in bf16.
///
/// Each counterpart visits dfdx's tensors and scalars in dfdx's order, with the same shapes and
/// trainable flags (the working copy is built by position), and takes the same inputs (`(S, M)`
/// and `(B, S, M)` sequences, attention's `(q, k, v)` tuples).
///
/// That is every layer dfdx 0.13 builds on stable Rust. A model with a layer outside this list
/// (a module of the user's own, dfdx's convolutions and 2D pools, which need its `nightly`
/// feature) does not implement it and runs on its plain working copy
/// ([`WorkingCopy`](super::WorkingCopy)).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::{nn, precision::f16, step::HalfLayers};
/// type Master = (Linear<4, 8>, ReLU, Linear<8, 2>);
/// type Built = <Master as BuildOnDevice<Cpu, f32>>::Built;
/// type Working = <Built as HalfLayers<f16>>::Working;
/// let dev = Cpu::default();
/// let w = Working::build(&dev);
/// assert_eq!(w.2.weight.shape(), &(Const::<2>, Const::<8>));
/// let _: (nn::Linear<4, 8, f16, Cpu>, nn::ReLU, nn::Linear<8, 2, f16, Cpu>) = w;
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` has no working copy of mpx's layers",
    label = "a layer (or a module of your own) without mpx's counterpart",
    note = "a module of your own gets one with `#[derive(mpx::HalfLayers)]` on its struct and `#[mpx::half_forward]` on its `Module` impl (docs/dsl.md, \"Modules of your own\"); dfdx's convolutions and 2D pools have none: a model holding one runs on dfdx's f16 layers, without the derive on the modules around it; the derive takes a field for a tensor by its type's name, so a tensor field written through a type alias is taken for a layer: write it as `Tensor<..>`; a field of a type of your own that is no layer (a settings struct, an enum) is carried into the working copy as it is with `#[half_layers(keep)]` on it"
)]
pub trait HalfLayers<H: Precision>: MasterModel
where
    Cpu: Device<H::Elem>,
{
    /// The working copy, made of mpx's layers, with the master's tensors and scalars in the same
    /// order.
    type Working: TensorCollection<H::Elem, Cpu, To<H::Elem, Cpu> = Self::Working>
        + Send
        + Sync
        + 'static;

    /// Sets what a layer's working copy holds that dfdx's visitors do not carry: a fused layer's
    /// link to the master tensors it stands for, a leaky `ReLU`'s slope. Called on a layer built
    /// as a whole, once its tensors and scalars are filled; layers without any do nothing, and
    /// containers, built part by part, never need it.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{nn, precision::f16, step::{HalfLayers, Linker}};
    /// let master = LeakyReLU(0.2f32);
    /// let mut w = nn::LeakyReLU::default(); // as the walk builds it
    /// HalfLayers::<f16>::finish(&master, &mut w, &Linker::none());
    /// assert_eq!(w.0, 0.2); // the master's slope, not rounded to f16
    /// ```
    fn finish(&self, working: &mut Self::Working, linker: &Linker) {
        let _ = (working, linker);
    }

    /// Builds this part's working copy from it as it is now. Layers build as a whole (their
    /// tensors and scalars filled by position); containers and modules with
    /// `#[derive(HalfLayers)]` build part by part.
    ///
    /// # Errors
    /// A device error, or a working copy whose layout differs from the master's.
    #[doc(hidden)]
    fn build_working(&self, cx: &mut BuildCx<'_, H>) -> Result<Self::Working, StepError> {
        cx.leaf(self)
    }

    /// Takes back from a working copy whose `forward_mut` pass has run what that pass changed
    /// outside its layers and tensors: the fields a module of the user's own carries into its
    /// working copy as they are (a counter, a history, a schedule's state; the field as the pass
    /// left it, swapped into the master). dfdx's layers and mpx's hold none; containers and
    /// modules with `#[derive(HalfLayers)]` take back part by part.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::{precision::f16, step::HalfLayers};
    /// let mut master = (LeakyReLU(0.2f32), ReLU);
    /// let mut w = (mpx_runtime::nn::LeakyReLU(0.2), mpx_runtime::nn::ReLU);
    /// HalfLayers::<f16>::carry_back(&mut master, &mut w); // nothing to take back
    /// assert_eq!(master.0.0, 0.2);
    /// ```
    fn carry_back(&mut self, working: &mut Self::Working) {
        let _ = working;
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
            links,
            linker: <Cpu as Primitives<H>>::linker(links),
            root: master,
            flags: None,
        };
        let copy = master.build_working(&mut cx)?;
        let Built { pairs, state, .. } = cx.built;
        Ok(Built { copy, pairs, state })
    }
    fn carry_back(master: &mut M, copy: &mut Self::Copy) {
        master.carry_back(copy);
    }
}

/// What a mapped working copy is built with, part by part
/// ([`HalfLayers::build_working`](super::HalfLayers::build_working)): the store its buffers come
/// from, the forward pass's links its fused layers are linked through, and the record of each
/// tensor built (the master tensor it stands for and whether a fused layer linked it, or the
/// state it carries). Reachable only through the hidden method, which `#[derive(HalfLayers)]`
/// calls.
#[doc(hidden)]
#[allow(missing_debug_implementations)]
pub struct BuildCx<'a, H: Precision>
where
    Cpu: MixedDevice<H>,
{
    store: &'a mut <Cpu as Primitives<H>>::Store,
    built: Built<H, Cpu, ()>,
    links: &'a <Cpu as Primitives<H>>::Links,
    linker: Linker,
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
        impl Each<f32, Cpu> for Walk {
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
        let _ = each(self, &mut w, std::convert::identity);
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
        each(master, &mut gather, std::convert::identity)?;
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
        let mut copy = copy;
        master.finish(&mut copy, &self.linker);
        for (pair, &addr) in self.built.pairs[first_pair..]
            .iter_mut()
            .zip(&gather.trainable_addrs)
        {
            pair.linked = <Cpu as Primitives<H>>::is_linked(self.links, addr);
        }
        Ok(copy)
    }

    /// The fused working copy of a linear layer with master weight `weight` and bias `bias`
    /// (both trained, as the layer's type says): the two rounded to `H`, linked to the master's.
    ///
    /// # Errors
    /// A device error.
    pub(crate) fn linear<const I: usize, const O: usize, A: Default>(
        &mut self,
        weight: &Tensor<Rank2<O, I>, f32, Cpu>,
        bias: &Tensor<Rank1<O>, f32, Cpu>,
    ) -> Result<FusedLinear<I, O, H::Elem, Cpu, A>, StepError> {
        let (ws, bs) = (Slot::of(weight), Slot::of(bias));
        let link = self.linker.link_slots(&ws, &bs);
        let w =
            <Cpu as Primitives<H>>::to_working(weight, self.store).map_err(StepError::Device)?;
        let b = <Cpu as Primitives<H>>::to_working(bias, self.store).map_err(StepError::Device)?;
        self.built.trainable(&w, ws, link.is_some());
        self.built.trainable(&b, bs, link.is_some());
        let mut layer = FusedLinear::new(w, b);
        layer.set_link(link);
        Ok(layer)
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
            self.built.trainable(&half, Slot::of(t), false);
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

impl Each<f32, Cpu> for Gather {
    type Error = CpuError;

    fn tensor<S: Shape>(
        &mut self,
        trainable: bool,
        t: &Tensor<S, f32, Cpu>,
    ) -> Result<(), CpuError> {
        let n = t.shape().num_elements();
        // a contiguous tensor is reshaped in place (its buffer shared, not copied)
        let flat = t.clone().try_reshape_like(&(n,))?;
        self.tensors.push((flat, trainable));
        if trainable {
            self.slots.push(Some(Slot::of(t)));
            self.trainable_addrs.push(std::ptr::from_ref(t).addr());
        }
        Ok(())
    }

    fn scalar(&mut self, value: f64) -> Result<(), CpuError> {
        self.scalars.push(value);
        Ok(())
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
            self.built.trainable(&t, slot, false);
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
