//! Half regions: a model's forward pass run in half precision inside an f32 graph.
//!
//! This is the mirror image of [`region`](crate::region) (an f32 region inside a half graph).
//! The traced f32 input of a forward pass enters the region: its tape is split off, its values
//! are rounded to the half type, and it is traced again on a half tape of its own. The forward
//! pass runs on the pass's working copy ([`working`](super::working)). Its output
//! leaves the region widened to f32, on the input's f32 tape, so everything after it (the loss,
//! penalties, logging) is ordinary f32 dfdx code.
//!
//! One backward op on the f32 tape carries the gradient back in: it multiplies the output's f32
//! gradient by the **loss scale** (scaling happens exactly where values enter the half type, so
//! f32 code never sees scaled values), rounds it to the half type, runs the half graph's
//! backward, adds the working copy's half gradients, unscaled, to the master's f32 gradients
//! (the ones this backward is filling), and adds the input's gradient, unscaled, to the f32
//! graph, so a forward staged over several calls chains correctly. A [`Batch`] input, whose f32
//! gradient nothing reads, gets none. Last, it leaves the master's gradient slots for the
//! scaler's backward, which judges them once the whole backward pass has run.

use std::sync::{Arc, Mutex, PoisonError};

use dfdx::shapes::{Rank0, Shape};
use dfdx::tensor::{Cpu, Gradients, HasErr, NoneTape, OwnedTape, PutTape, SplitTape, Tape, Tensor};
use dfdx::tensor_ops::{Backward, ReshapeTo};

use super::device::{FullOp, HalfOp, MixedDevice, Pair, SeedOp};
use super::owners::Owners;
use super::pending::Cell;
use crate::master::slots::MasterSlot;
use crate::precision::Precision;

/// A tensor on its own tape.
type Traced<S, E, D> = Tensor<S, E, D, OwnedTape<E, D>>;
/// A forward pass whose half backward has run: its master's gradient slots and the cell its
/// verdict goes to, for the scaler's backward to judge once the whole backward has run.
pub(crate) struct Finished<D: MixedDevice<H>, H: Precision> {
    pub(crate) slots: Vec<MasterSlot<D>>,
    pub(crate) cell: Cell,
    /// Whether its gradients were all finite, once judged (`None` before, and for a pass
    /// that is not judged: another of the same master was, or its gradients were dropped).
    pub(crate) verdict: Option<bool>,
    pub(crate) marker: std::marker::PhantomData<fn() -> H>,
}

/// Where the backward bridges of a scaler's forward passes leave what they finished.
pub(crate) type Inbox<D, H> = Arc<Mutex<Vec<Finished<D, H>>>>;

/// Leaves in `inbox` the gradient slots of a forward pass whose backward has run, shared out
/// among their `owners` (one master, or the parts the step updates).
pub(crate) fn finished<D: MixedDevice<H>, H: Precision>(
    inbox: &Inbox<D, H>,
    owners: &Owners,
    slots: Vec<MasterSlot<D>>,
) {
    let mut inbox = inbox.lock().unwrap_or_else(PoisonError::into_inner);
    owners.share(
        slots,
        |s| s.addr,
        |cell, slots| {
            inbox.push(Finished {
                slots,
                cell: cell.clone(),
                verdict: None,
                marker: std::marker::PhantomData,
            });
        },
    );
}

/// What one forward pass hands its backward bridge: the working copy's tensors and the master
/// tensors they stand for, whose gradients they are (the master's cell, or its parts') and the
/// inbox.
pub(crate) struct Handoff<H: Precision, D: MixedDevice<H>> {
    pub(crate) pairs: Vec<Pair<H, D>>,
    pub(crate) owners: Owners,
    pub(crate) inbox: Inbox<D, H>,
}

/// The state of one region while its input enters and its output leaves, on device `D`.
pub struct Region<H: Precision, D: MixedDevice<H> = Cpu> {
    /// The merged f32 tape of the inputs (taken by the first traced output).
    outer: Option<OwnedTape<f32, D>>,
    /// Adds the inputs' captured half gradients to the f32 graph (where the half tape's own
    /// ops cannot: [`MixedDevice`]'s `input_bridge`).
    writers: Vec<FullOp<D>>,
    /// Mark the half gradients of inputs whose f32 gradient nothing reads ([`Batch`]).
    marks: Vec<HalfOp<H::Elem, D>>,
    /// The merged half tape of the traced outputs.
    inner: Option<OwnedTape<H::Elem, D>>,
    /// One per traced output.
    seeds: Vec<SeedOp<H::Elem, D>>,
    scale: f32,
    /// The loss scale's reciprocal (its own `inv_loss_scale`), for gradients leaving the region.
    inv: f32,
    handoff: Option<Handoff<H, D>>,
    /// The forward pass's link state: the inputs' ops and the bridge reach the f32 gradients
    /// through it.
    links: D::Links,
    dev: D,
}

impl<H: Precision, D: MixedDevice<H>> Region<H, D> {
    pub(crate) fn new(
        dev: D,
        (scale, inv): (f32, f32),
        links: D::Links,
        handoff: Handoff<H, D>,
    ) -> Self {
        Self {
            outer: None,
            writers: Vec::new(),
            marks: Vec::new(),
            inner: None,
            seeds: Vec::new(),
            scale,
            inv,
            links,
            handoff: Some(handoff),
            dev,
        }
    }

    fn merge_outer(&mut self, tape: OwnedTape<f32, D>) {
        self.outer = Some(match self.outer.take() {
            Some(t) => dfdx::tensor::Merge::merge(t, tape),
            None => tape,
        });
    }

    /// Rounds a traced f32 input into the region: `read` says whether its own f32 gradient is
    /// read (else its half gradient is marked unread for the linked layers, and no f32 gradient
    /// is written for it).
    fn enter_traced<S: Shape>(
        &mut self,
        x: Tensor<S, f32, D, OwnedTape<f32, D>>,
        read: bool,
    ) -> Result<Traced<S, H::Elem, D>, D::Err> {
        let (x32, tape) = x.split_tape();
        let x = D::to_half(&x32)?;
        self.merge_outer(tape);
        let mut inner = OwnedTape::<H::Elem, D>::default();
        let mark = if read {
            None
        } else {
            D::unread_mark(&x, &self.links)
        };
        if let Some(mark) = mark {
            self.marks.push(mark);
        } else {
            // Added before the forward pass, so it runs after every op that uses the input:
            // it carries the input's (scaled, half) gradient to the f32 graph.
            let (capture, writer) = D::input_bridge(&x, &x32, self.inv, &self.links);
            inner.add_backward_op(capture);
            self.writers.extend(writer);
        }
        Ok(x.put_tape(inner))
    }
}

/// The traced batch of a forward pass whose own gradient nothing reads: what `x.traced(grads)`
/// is in a dfdx step whose `grads` came from `alloc_grads` (they keep the model's gradients
/// only, so dfdx computes the batch's and drops it). A mixed step then computes none: mpx's
/// fused linear layers skip `dX = dZ·W` for it, as JAX and PyTorch compute no gradient nothing
/// asked for. `#[mixed_step]` wraps a forward pass's input in it where the step's code shows
/// that nothing can read that gradient (see `docs/dsl.md`).
///
/// # Examples
/// ```
/// use dfdx::{optim::*, prelude::*};
/// use mpx_runtime::{precision::f16, step::{Batch, GradScaler, Mixed}};
/// let dev: Cpu = Default::default();
/// let mut model = Mixed::mapped(dev.build_module::<(Linear<4, 8>, ReLU, Linear<8, 2>), f32>());
/// let mut scaler = GradScaler::<f16>::default();
/// let x: Tensor<Rank2<3, 4>, f32, _> = dev.sample_normal();
/// let y = scaler.forward(&model, Batch(x.trace(model.alloc_grads())), |m, x| m.forward(x))?;
/// let grads = scaler.backward(y.square().mean())?;
/// let mut opt = Sgd::new(&*model, Default::default());
/// assert!(scaler.update(&mut model, &mut opt, &grads)?.is_applied());
/// # Ok::<(), mpx_runtime::step::StepError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Batch<T>(pub T);

/// An input of a model's forward pass, as it enters the half region: f32 tensors (traced or
/// not) are rounded to the half type, integer tensors (token ids) keep their values and only
/// change tape, tuples, arrays and `Vec`s (an RNN's time steps) convert element by element.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot enter a half-precision forward pass",
    label = "expected an f32 (or integer) tensor, traced or not, or a tuple, array or `Vec` of them",
    note = "pass the f32 batch as in an f32 step (`x.traced(grads)`): the mixed step rounds it to the half type itself; a half tensor can be widened with `mpx::cast::cast_to_f32(&t)`"
)]
pub trait HalfInput<H: Precision, D: MixedDevice<H> = Cpu> {
    /// The input inside the region.
    type Half;
    /// Converts the input, recording what its backward needs in `region`.
    ///
    /// # Errors
    /// A device error (allocation).
    fn enter(self, region: &mut Region<H, D>) -> Result<Self::Half, <D as HasErr>::Err>;

    /// Converts the input as the batch of a forward pass whose own gradient nothing reads
    /// ([`Batch`]): a traced f32 tensor then gets no gradient; any other input enters as it
    /// always does.
    ///
    /// # Errors
    /// A device error (allocation).
    fn enter_unread(self, region: &mut Region<H, D>) -> Result<Self::Half, <D as HasErr>::Err>
    where
        Self: Sized,
    {
        self.enter(region)
    }
}

impl<H: Precision, D: MixedDevice<H>, S: Shape> HalfInput<H, D>
    for Tensor<S, f32, D, OwnedTape<f32, D>>
{
    type Half = Tensor<S, H::Elem, D, OwnedTape<H::Elem, D>>;
    fn enter(self, region: &mut Region<H, D>) -> Result<Self::Half, D::Err> {
        region.enter_traced(self, true)
    }
    fn enter_unread(self, region: &mut Region<H, D>) -> Result<Self::Half, D::Err> {
        region.enter_traced(self, false)
    }
}

impl<H: Precision, D: MixedDevice<H>, T: HalfInput<H, D>> HalfInput<H, D> for Batch<T> {
    type Half = T::Half;
    fn enter(self, region: &mut Region<H, D>) -> Result<Self::Half, D::Err> {
        self.0.enter_unread(region)
    }
}

impl<H: Precision, D: MixedDevice<H>, S: Shape> HalfInput<H, D> for Tensor<S, f32, D, NoneTape> {
    type Half = Tensor<S, H::Elem, D, NoneTape>;
    fn enter(self, _: &mut Region<H, D>) -> Result<Self::Half, D::Err> {
        D::to_half(&self)
    }
}

macro_rules! integer_input {
    ($($t:ty),*) => {$(
        impl<H: Precision, D: MixedDevice<H> + dfdx::tensor::Storage<$t>, S: Shape> HalfInput<H, D>
            for Tensor<S, $t, D, OwnedTape<f32, D>>
        {
            type Half = Tensor<S, $t, D, OwnedTape<H::Elem, D>>;
            fn enter(self, region: &mut Region<H, D>) -> Result<Self::Half, D::Err> {
                let (ids, tape) = self.split_tape();
                region.merge_outer(tape);
                Ok(ids.put_tape(OwnedTape::<H::Elem, D>::default()))
            }
        }
        impl<H: Precision, D: MixedDevice<H> + dfdx::tensor::Storage<$t>, S: Shape> HalfInput<H, D>
            for Tensor<S, $t, D, NoneTape>
        {
            type Half = Self;
            fn enter(self, _: &mut Region<H, D>) -> Result<Self, D::Err> {
                Ok(self)
            }
        }
    )*};
}
integer_input!(usize, u32, u64, i32, i64, bool);

/// An output of a model's forward pass, as it leaves the half region: half tensors are widened
/// to f32 (traced ones on the inputs' f32 tape, with one backward bridge for all of them, so
/// several heads that share a trunk backpropagate through it together), tuples, arrays, `Vec`s
/// and `Result`s (from `try_forward`) convert element by element.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot leave a half-precision forward pass",
    label = "expected the model's half tensor output (or a tuple, array, `Vec` or `Result` of them)",
    note = "a mixed step runs the model's forward pass in half precision and widens its tensor output to f32"
)]
pub trait HalfOutput<H: Precision, D: MixedDevice<H> = Cpu> {
    /// The output outside the region, in f32.
    type Full;
    /// The output widened, waiting for its tape.
    type Widened;
    /// First pass: widens the values and records the backward seeds in `region`.
    ///
    /// # Errors
    /// A device error (allocation).
    fn widen(self, region: &mut Region<H, D>) -> Result<Self::Widened, <D as HasErr>::Err>;
    /// Second pass, after the bridge is registered: puts the tapes on.
    fn attach(w: Self::Widened, region: &mut Region<H, D>) -> Self::Full;

    /// Converts the output and registers its backward bridge.
    ///
    /// # Errors
    /// A device error (allocation).
    fn leave(self, region: &mut Region<H, D>) -> Result<Self::Full, <D as HasErr>::Err>
    where
        Self: Sized,
    {
        let w = self.widen(region)?;
        region.bridge();
        Ok(Self::attach(w, region))
    }
}

impl<H: Precision, D: MixedDevice<H>> Region<H, D> {
    /// Registers the one backward op of the region on the inputs' f32 tape.
    fn bridge(&mut self) {
        let (Some(mut inner), Some(handoff)) = (self.inner.take(), self.handoff.take()) else {
            return;
        };
        let seeds = std::mem::take(&mut self.seeds);
        let writers = std::mem::take(&mut self.writers);
        let marks = std::mem::take(&mut self.marks);
        let (dev, inv, links) = (self.dev.clone(), self.inv, self.links.clone());
        let mut outer = self.outer.take().unwrap_or_default();
        outer.add_backward_op(move |g32: &mut Gradients<f32, D>| {
            let mut applies: Vec<HalfOp<H::Elem, D>> = Vec::with_capacity(seeds.len());
            for seed in seeds {
                applies.push(seed(g32)?);
            }
            // Added last, so it runs first: the marks before any op that uses an input.
            inner.add_backward_op(move |g: &mut Gradients<H::Elem, D>| {
                for mark in marks {
                    mark(g)?;
                }
                for apply in applies {
                    apply(g)?;
                }
                Ok(())
            });
            let anchor: Tensor<Rank0, H::Elem, D> = dev.try_zeros()?;
            // Linked layers add their f32 gradients to the master's (these `g32`) meanwhile.
            D::lend(&links, g32);
            let half_grads = anchor.put_tape(inner).try_backward();
            D::restore(&links, g32);
            let mut half_grads = half_grads?;
            // the working copy's half gradients, unscaled into the master's
            for pair in &handoff.pairs {
                D::transfer(&mut half_grads, pair, g32, inv)?;
            }
            drop(half_grads);
            for w in &writers {
                w(g32)?;
            }
            let Handoff {
                pairs,
                owners,
                inbox,
            } = handoff;
            finished(
                &inbox,
                &owners,
                pairs.into_iter().map(|p| p.master).collect(),
            );
            Ok(())
        });
        self.outer = Some(outer);
    }
}

impl<H: Precision, D: MixedDevice<H>, S: Shape> HalfOutput<H, D>
    for Tensor<S, H::Elem, D, OwnedTape<H::Elem, D>>
{
    type Full = Tensor<S, f32, D, OwnedTape<f32, D>>;
    type Widened = Tensor<S, f32, D>;
    fn widen(self, region: &mut Region<H, D>) -> Result<Self::Widened, D::Err> {
        // Contiguous, so that the gradient buffer and the logical values line up.
        let (y, tape) = self.try_contiguous()?.split_tape();
        region.inner = Some(match region.inner.take() {
            Some(t) => dfdx::tensor::Merge::merge(t, tape),
            None => tape,
        });
        let y32 = D::to_full(&y)?;
        region.seeds.push(D::output_seed(&y, &y32, region.scale));
        Ok(y32)
    }
    fn attach(w: Self::Widened, region: &mut Region<H, D>) -> Self::Full {
        // The first traced output carries the inputs' tape (with the bridge); the others a fresh
        // one, which merges back when the loss combines them.
        w.put_tape(region.outer.take().unwrap_or_default())
    }
}

impl<H: Precision, D: MixedDevice<H>, S: Shape> HalfOutput<H, D>
    for Tensor<S, H::Elem, D, NoneTape>
{
    type Full = Tensor<S, f32, D, NoneTape>;
    type Widened = Self::Full;
    fn widen(self, _: &mut Region<H, D>) -> Result<Self::Full, D::Err> {
        D::to_full(&self)
    }
    fn attach(w: Self::Full, _: &mut Region<H, D>) -> Self::Full {
        w
    }
}

impl<H: Precision, D: MixedDevice<H>, T: HalfOutput<H, D>, E: From<<D as HasErr>::Err>>
    HalfOutput<H, D> for Result<T, E>
{
    type Full = Result<T::Full, E>;
    type Widened = Result<T::Widened, E>;
    fn widen(self, region: &mut Region<H, D>) -> Result<Self::Widened, D::Err> {
        Ok(match self {
            Ok(t) => t.widen(region).map_err(E::from),
            Err(e) => Err(e),
        })
    }
    fn attach(w: Self::Widened, region: &mut Region<H, D>) -> Self::Full {
        w.map(|w| T::attach(w, region))
    }
}

macro_rules! tuples {
    ($($name:ident),+) => {
        impl<H: Precision, D: MixedDevice<H>, $($name: HalfInput<H, D>),+> HalfInput<H, D> for ($($name,)+) {
            type Half = ($($name::Half,)+);
            #[allow(non_snake_case)]
            fn enter(self, region: &mut Region<H, D>) -> Result<Self::Half, D::Err> {
                let ($($name,)+) = self;
                Ok(($($name.enter(region)?,)+))
            }
        }
        impl<H: Precision, D: MixedDevice<H>, $($name: HalfOutput<H, D>),+> HalfOutput<H, D> for ($($name,)+) {
            type Full = ($($name::Full,)+);
            type Widened = ($($name::Widened,)+);
            #[allow(non_snake_case)]
            fn widen(self, region: &mut Region<H, D>) -> Result<Self::Widened, D::Err> {
                let ($($name,)+) = self;
                Ok(($($name.widen(region)?,)+))
            }
            #[allow(non_snake_case)]
            fn attach(w: Self::Widened, region: &mut Region<H, D>) -> Self::Full {
                let ($($name,)+) = w;
                ($($name::attach($name, region),)+)
            }
        }
    };
}
tuples!(A, B);
tuples!(A, B, C);
tuples!(A, B, C, D4);

/// The `N` values an array's elements became, one for each, as an array again.
fn array_of<T, const N: usize>(values: Vec<T>) -> [T; N] {
    match values.try_into() {
        Ok(array) => array,
        Err(_) => unreachable!("one value for each of the {N} elements"),
    }
}

/// The inputs entered one by one, in order: an array or a `Vec` of them (an RNN's time steps).
fn enter_each<H: Precision, D: MixedDevice<H>, T: HalfInput<H, D>>(
    xs: impl IntoIterator<Item = T>,
    region: &mut Region<H, D>,
) -> Result<Vec<T::Half>, D::Err> {
    xs.into_iter().map(|x| x.enter(region)).collect()
}

impl<H: Precision, D: MixedDevice<H>, T: HalfInput<H, D>> HalfInput<H, D> for Vec<T> {
    type Half = Vec<T::Half>;
    fn enter(self, region: &mut Region<H, D>) -> Result<Self::Half, D::Err> {
        enter_each(self, region)
    }
}

impl<H: Precision, D: MixedDevice<H>, T: HalfInput<H, D>, const N: usize> HalfInput<H, D>
    for [T; N]
{
    type Half = [T::Half; N];
    fn enter(self, region: &mut Region<H, D>) -> Result<Self::Half, D::Err> {
        Ok(array_of(enter_each(self, region)?))
    }
}

impl<H: Precision, D: MixedDevice<H>, T: HalfOutput<H, D>> HalfOutput<H, D> for Vec<T> {
    type Full = Vec<T::Full>;
    type Widened = Vec<T::Widened>;
    fn widen(self, region: &mut Region<H, D>) -> Result<Self::Widened, D::Err> {
        self.into_iter().map(|y| y.widen(region)).collect()
    }
    fn attach(w: Self::Widened, region: &mut Region<H, D>) -> Self::Full {
        w.into_iter().map(|w| T::attach(w, region)).collect()
    }
}

impl<H: Precision, D: MixedDevice<H>, T: HalfOutput<H, D>, const N: usize> HalfOutput<H, D>
    for [T; N]
{
    type Full = [T::Full; N];
    type Widened = Vec<T::Widened>;
    fn widen(self, region: &mut Region<H, D>) -> Result<Self::Widened, D::Err> {
        self.into_iter().map(|y| y.widen(region)).collect()
    }
    fn attach(w: Self::Widened, region: &mut Region<H, D>) -> Self::Full {
        array_of(w.into_iter().map(|w| T::attach(w, region)).collect())
    }
}
