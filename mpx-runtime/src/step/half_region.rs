//! Half regions: a model's forward pass run in half precision inside an f32 graph.
//!
//! This is the mirror image of [`region`](crate::region) (an f32 region inside a half graph).
//! The traced f32 input of a forward pass enters the region: its tape is split off, its values
//! are rounded to the half type, and it is traced again on a half tape whose gradients are the
//! working copy's reusable buffers. The forward pass runs on the half working copy. Its output
//! leaves the region widened to f32, on the input's f32 tape, so everything after it (the loss,
//! penalties, logging) is ordinary f32 dfdx code.
//!
//! One backward op on the f32 tape carries the gradient back in: it multiplies the output's f32
//! gradient by the **loss scale** (scaling happens exactly where values enter the half type, so
//! f32 code never sees scaled values), rounds it to the half type, runs the half graph's
//! backward, hands the working copy's half gradients to the step (which unscales them into the
//! master's f32 gradients), and adds the input's gradient, unscaled, to the f32 graph, so a
//! forward staged over several calls chains correctly.

use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};

use dfdx::shapes::{HasShape, Rank0, Shape};
use dfdx::tensor::{
    Cpu, CpuError, Gradients, NoneTape, OwnedTape, PutTape, SplitTape, Tape, Tensor, TensorFromVec,
    Trace, ZerosTensor,
};
use dfdx::tensor_ops::{Backward, Device, ReshapeTo};

use super::direct::Direct;
use crate::cast::grad_slice;
use crate::precision::Precision;

/// The working copy's half gradients of each finished backward, waiting to be moved to the
/// master.
pub(crate) type Stash<E> = Arc<Mutex<Vec<Gradients<E, Cpu>>>>;

type Writer = Box<dyn Fn(&mut Gradients<f32, Cpu>) -> Result<(), CpuError>>;

/// The state of one region while its input enters and its output leaves.
pub struct Region<H: Precision>
where
    Cpu: Device<H::Elem>,
{
    /// Gradient buffers for the half tape (taken by the first traced input).
    pub(crate) pool: Option<Gradients<H::Elem, Cpu>>,
    /// The merged f32 tape of the inputs (taken by the first traced output).
    outer: Option<OwnedTape<f32, Cpu>>,
    /// Adds the inputs' captured half gradients to the f32 graph.
    writers: Vec<Writer>,
    /// The merged half tape of the traced outputs.
    inner: Option<OwnedTape<H::Elem, Cpu>>,
    /// One per traced output.
    seeds: Vec<Seed<H::Elem>>,
    pub(crate) scale: f32,
    /// The loss scale's reciprocal (its own `inv_loss_scale`), for gradients leaving the region.
    pub(crate) inv: f32,
    pub(crate) stash: Stash<H::Elem>,
    /// Where linked fused layers write their gradients ([`super::direct`]); lent the master's
    /// gradients while the half backward runs.
    direct: Option<Arc<Direct>>,
    dev: Cpu,
}

impl<H: Precision> Region<H>
where
    Cpu: Device<H::Elem>,
{
    pub(crate) fn new(
        pool: Gradients<H::Elem, Cpu>,
        scale: f32,
        inv: f32,
        stash: Stash<H::Elem>,
        direct: Option<Arc<Direct>>,
    ) -> Self {
        Self {
            pool: Some(pool),
            outer: None,
            writers: Vec::new(),
            inner: None,
            seeds: Vec::new(),
            scale,
            inv,
            stash,
            direct,
            dev: Cpu::default(),
        }
    }

    /// The half tape for a traced input: the reusable buffers for the first, a fresh one after.
    fn inner_tape(&mut self) -> Result<OwnedTape<H::Elem, Cpu>, CpuError> {
        let grads = self.pool.take().unwrap_or_else(Gradients::leaky);
        let anchor: Tensor<Rank0, H::Elem, Cpu> = self.dev.try_zeros()?;
        Ok(anchor.traced(grads).split_tape().1)
    }

    fn merge_outer(&mut self, tape: OwnedTape<f32, Cpu>) {
        self.outer = Some(match self.outer.take() {
            Some(t) => dfdx::tensor::Merge::merge(t, tape),
            None => tape,
        });
    }
}

/// Rounds f32 values to precision `H` into a new tensor of the same shape.
fn to_half<H: Precision, S: Shape, T>(
    x: &Tensor<S, f32, Cpu, T>,
) -> Result<Tensor<S, H::Elem, Cpu>, CpuError>
where
    Cpu: Device<H::Elem>,
{
    let n = x.shape().num_elements();
    // A contiguous view (the same buffer when it already is) read with one memcpy: dfdx's
    // `as_vec` walks the tensor index by index.
    let mut values = vec![0.0f32; n];
    x.retaped::<dfdx::tensor::NoneTape>()
        .try_contiguous()?
        .copy_into(&mut values);
    let mut half = vec![H::Elem::default(); n];
    H::round(&values, &mut half);
    x.device().try_tensor_from_vec(half, *x.shape())
}

/// An input of a model's forward pass, as it enters the half region: f32 tensors (traced or
/// not) are rounded to the half type, integer tensors (token ids) keep their values and only
/// change tape, tuples convert element by element.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot enter a half-precision forward pass",
    label = "expected an f32 (or integer) tensor, traced or not, or a tuple of them",
    note = "pass the f32 batch as in an f32 step (`x.traced(grads)`): the mixed step rounds it to the half type itself; a half tensor can be widened with `mpx::cast::cast_to_f32(&t)`"
)]
pub trait HalfInput<H: Precision>
where
    Cpu: Device<H::Elem>,
{
    /// The input inside the region.
    type Half;
    /// Converts the input, recording what its backward needs in `region`.
    ///
    /// # Errors
    /// A device error (allocation).
    fn enter(self, region: &mut Region<H>) -> Result<Self::Half, CpuError>;
}

impl<H: Precision, S: Shape> HalfInput<H> for Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>
where
    Cpu: Device<H::Elem>,
{
    type Half = Tensor<S, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>;
    fn enter(self, region: &mut Region<H>) -> Result<Self::Half, CpuError> {
        let (x32, tape) = self.split_tape();
        region.merge_outer(tape);
        let x = to_half::<H, S, _>(&x32)?;
        let mut inner = region.inner_tape()?;
        // Added before the forward pass, so it runs after every op that uses the input: it
        // captures the input's (scaled, half) gradient for the f32 graph.
        let captured: Rc<Mutex<Option<Vec<f32>>>> = Rc::default();
        let capture = Rc::clone(&captured);
        let ghost = x.ghost();
        let n = x32.shape().num_elements();
        let inv = region.inv;
        inner.add_backward_op(move |g: &mut Gradients<H::Elem, Cpu>| {
            let mut v = vec![0.0f32; n];
            H::widen(grad_slice::<H::Elem>(g.get_or_alloc_mut(&ghost)?), &mut v);
            if inv != 1.0 {
                for x in &mut v {
                    *x *= inv;
                }
            }
            *capture.lock().unwrap_or_else(PoisonError::into_inner) = Some(v);
            Ok(())
        });
        let outer_ghost = x32.ghost();
        region
            .writers
            .push(Box::new(move |g: &mut Gradients<f32, Cpu>| {
                let taken = captured
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take();
                if let Some(v) = taken {
                    let dst = g.get_or_alloc_mut(&outer_ghost)?;
                    dst.iter_mut().zip(&v).for_each(|(d, s)| *d += *s);
                }
                Ok(())
            }));
        Ok(x.put_tape(inner))
    }
}

impl<H: Precision, S: Shape> HalfInput<H> for Tensor<S, f32, Cpu, NoneTape>
where
    Cpu: Device<H::Elem>,
{
    type Half = Tensor<S, H::Elem, Cpu, NoneTape>;
    fn enter(self, _: &mut Region<H>) -> Result<Self::Half, CpuError> {
        to_half::<H, S, _>(&self)
    }
}

macro_rules! integer_input {
    ($($t:ty),*) => {$(
        impl<H: Precision, S: Shape> HalfInput<H> for Tensor<S, $t, Cpu, OwnedTape<f32, Cpu>>
        where
            Cpu: Device<H::Elem>,
        {
            type Half = Tensor<S, $t, Cpu, OwnedTape<H::Elem, Cpu>>;
            fn enter(self, region: &mut Region<H>) -> Result<Self::Half, CpuError> {
                let (ids, tape) = self.split_tape();
                region.merge_outer(tape);
                Ok(ids.put_tape(region.inner_tape()?))
            }
        }
        impl<H: Precision, S: Shape> HalfInput<H> for Tensor<S, $t, Cpu, NoneTape>
        where
            Cpu: Device<H::Elem>,
        {
            type Half = Self;
            fn enter(self, _: &mut Region<H>) -> Result<Self, CpuError> {
                Ok(self)
            }
        }
    )*};
}
integer_input!(usize, u32, u64, i32, i64, bool);

type SeedFn<E> = Box<dyn FnOnce(&mut Gradients<f32, Cpu>) -> Result<Vec<E>, CpuError>>;
type ApplyFn<E> = Box<dyn FnOnce(&mut Gradients<E, Cpu>, Vec<E>) -> Result<(), CpuError>>;

/// A widened output waiting for its tape, and what its backward seeds.
struct Seed<E: dfdx::dtypes::Unit> {
    /// Reads the output's f32 gradient and writes it, scaled and rounded, into the half graph.
    seed: SeedFn<E>,
    /// Adds the rounded seed to the half output's gradient.
    apply: ApplyFn<E>,
}

/// An output of a model's forward pass, as it leaves the half region: half tensors are widened
/// to f32 (traced ones on the inputs' f32 tape, with one backward bridge for all of them, so
/// several heads that share a trunk backpropagate through it together), tuples and `Result`s
/// (from `try_forward`) convert element by element.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot leave a half-precision forward pass",
    label = "expected the model's half tensor output (or a tuple or `Result` of them)",
    note = "a mixed step runs the model's forward pass in half precision and widens its tensor output to f32"
)]
pub trait HalfOutput<H: Precision>
where
    Cpu: Device<H::Elem>,
{
    /// The output outside the region, in f32.
    type Full;
    /// The output widened, waiting for its tape.
    type Widened;
    /// First pass: widens the values and records the backward seeds in `region`.
    ///
    /// # Errors
    /// A device error (allocation).
    fn widen(self, region: &mut Region<H>) -> Result<Self::Widened, CpuError>;
    /// Second pass, after the bridge is registered: puts the tapes on.
    fn attach(w: Self::Widened, region: &mut Region<H>) -> Self::Full;

    /// Converts the output and registers its backward bridge.
    ///
    /// # Errors
    /// A device error (allocation).
    fn leave(self, region: &mut Region<H>) -> Result<Self::Full, CpuError>
    where
        Self: Sized,
    {
        let w = self.widen(region)?;
        region.bridge();
        Ok(Self::attach(w, region))
    }
}

impl<H: Precision> Region<H>
where
    Cpu: Device<H::Elem>,
{
    /// Registers the one backward op of the region on the inputs' f32 tape.
    fn bridge(&mut self) {
        let Some(mut inner) = self.inner.take() else {
            return;
        };
        let seeds = std::mem::take(&mut self.seeds);
        let writers = std::mem::take(&mut self.writers);
        let (stash, dev, direct) = (
            Arc::clone(&self.stash),
            self.dev.clone(),
            self.direct.clone(),
        );
        let mut outer = self.outer.take().unwrap_or_default();
        outer.add_backward_op(move |g32: &mut Gradients<f32, Cpu>| {
            let mut applies = Vec::with_capacity(seeds.len());
            for s in seeds {
                let values = (s.seed)(g32)?;
                applies.push((s.apply, values));
            }
            inner.add_backward_op(move |g: &mut Gradients<H::Elem, Cpu>| {
                for (apply, values) in applies {
                    apply(g, values)?;
                }
                Ok(())
            });
            let anchor: Tensor<Rank0, H::Elem, Cpu> = dev.try_zeros()?;
            // Linked layers add their f32 gradients to the master's (these `g32`) meanwhile.
            if let Some(d) = &direct {
                d.lend(g32);
            }
            let half_grads = anchor.put_tape(inner).try_backward();
            if let Some(d) = &direct {
                d.restore(g32);
            }
            let half_grads = half_grads?;
            for w in &writers {
                w(g32)?;
            }
            stash
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(half_grads);
            Ok(())
        });
        self.outer = Some(outer);
    }
}

impl<H: Precision, S: Shape> HalfOutput<H> for Tensor<S, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>
where
    Cpu: Device<H::Elem>,
{
    type Full = Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>;
    type Widened = Tensor<S, f32, Cpu>;
    fn widen(self, region: &mut Region<H>) -> Result<Self::Widened, CpuError> {
        // Contiguous, so that the gradient buffer and the logical values line up.
        let (y, tape) = self.try_contiguous()?.split_tape();
        region.inner = Some(match region.inner.take() {
            Some(t) => dfdx::tensor::Merge::merge(t, tape),
            None => tape,
        });
        let n = y.shape().num_elements();
        let mut half = vec![H::Elem::default(); n];
        y.copy_into(&mut half);
        let mut full = vec![0.0f32; n];
        H::widen(&half, &mut full);
        let y32: Tensor<S, f32, Cpu> = region.dev.try_tensor_from_vec(full, *y.shape())?;
        let (y_ghost, y32_ghost, scale) = (y.ghost(), y32.ghost(), region.scale);
        region.seeds.push(Seed {
            seed: Box::new(move |g32: &mut Gradients<f32, Cpu>| {
                let g = g32.get_or_alloc_mut(&y32_ghost)?;
                let mut seed = vec![H::Elem::default(); n];
                if scale == 1.0 {
                    H::round(g, &mut seed);
                } else {
                    // Scaled through a stack buffer, chunk by chunk: no second output-sized vector.
                    let mut buf = [0.0f32; 1024];
                    for (src, dst) in g.chunks(buf.len()).zip(seed.chunks_mut(buf.len())) {
                        let b = &mut buf[..src.len()];
                        b.iter_mut().zip(src).for_each(|(b, v)| *b = v * scale);
                        H::round(b, dst);
                    }
                }
                Ok(seed)
            }),
            apply: Box::new(move |g: &mut Gradients<H::Elem, Cpu>, seed: Vec<H::Elem>| {
                let buf = grad_slice::<H::Elem>(g.get_or_alloc_mut(&y_ghost)?);
                buf.iter_mut().zip(&seed).for_each(|(d, s)| *d += *s);
                Ok(())
            }),
        });
        Ok(y32)
    }
    fn attach(w: Self::Widened, region: &mut Region<H>) -> Self::Full {
        // The first traced output carries the inputs' tape (with the bridge); the others a fresh
        // one, which merges back when the loss combines them.
        w.put_tape(region.outer.take().unwrap_or_default())
    }
}

impl<H: Precision, S: Shape> HalfOutput<H> for Tensor<S, H::Elem, Cpu, NoneTape>
where
    Cpu: Device<H::Elem>,
{
    type Full = Tensor<S, f32, Cpu, NoneTape>;
    type Widened = Self::Full;
    fn widen(self, region: &mut Region<H>) -> Result<Self::Full, CpuError> {
        let n = self.shape().num_elements();
        let half = self.as_vec();
        let mut full = vec![0.0f32; n];
        H::widen(&half, &mut full);
        region.dev.try_tensor_from_vec(full, *self.shape())
    }
    fn attach(w: Self::Full, _: &mut Region<H>) -> Self::Full {
        w
    }
}

impl<H: Precision, T: HalfOutput<H>, E: From<CpuError>> HalfOutput<H> for Result<T, E>
where
    Cpu: Device<H::Elem>,
{
    type Full = Result<T::Full, E>;
    type Widened = Result<T::Widened, E>;
    fn widen(self, region: &mut Region<H>) -> Result<Self::Widened, CpuError> {
        Ok(match self {
            Ok(t) => t.widen(region).map_err(E::from),
            Err(e) => Err(e),
        })
    }
    fn attach(w: Self::Widened, region: &mut Region<H>) -> Self::Full {
        w.map(|w| T::attach(w, region))
    }
}

macro_rules! tuples {
    ($($name:ident),+) => {
        impl<H: Precision, $($name: HalfInput<H>),+> HalfInput<H> for ($($name,)+)
        where
            Cpu: Device<H::Elem>,
        {
            type Half = ($($name::Half,)+);
            #[allow(non_snake_case)]
            fn enter(self, region: &mut Region<H>) -> Result<Self::Half, CpuError> {
                let ($($name,)+) = self;
                Ok(($($name.enter(region)?,)+))
            }
        }
        impl<H: Precision, $($name: HalfOutput<H>),+> HalfOutput<H> for ($($name,)+)
        where
            Cpu: Device<H::Elem>,
        {
            type Full = ($($name::Full,)+);
            type Widened = ($($name::Widened,)+);
            #[allow(non_snake_case)]
            fn widen(self, region: &mut Region<H>) -> Result<Self::Widened, CpuError> {
                let ($($name,)+) = self;
                Ok(($($name.widen(region)?,)+))
            }
            #[allow(non_snake_case)]
            fn attach(w: Self::Widened, region: &mut Region<H>) -> Self::Full {
                let ($($name,)+) = w;
                ($($name::attach($name, region),)+)
            }
        }
    };
}
tuples!(A, B);
tuples!(A, B, C);
tuples!(A, B, C, D);
