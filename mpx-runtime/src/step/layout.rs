//! What the scaler knows of a master model without its type: one gradient slot per trainable
//! tensor, the element counts of its other tensors, and its identity (tensor ids and buffers).

use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorMut, ViewTensorRef,
};
use dfdx::shapes::{Dtype, HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, Gradients, HasErr, Storage, Tensor};
use dfdx::tensor_ops::Device;

use super::error::StepError;
use crate::boundary::MasterModel;

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

/// Hands out one master gradient buffer; built once per trainable master tensor (it holds a
/// data-free "ghost" of the tensor, keyed by the tensor's id; dfdx does not let the ghost's type
/// be named). On the `Cpu` it is `Send + Sync`, so the state that holds it can be; a ghost of a
/// `Cuda` tensor is neither (dfdx's `Cuda` device is not), so the slot is not either there.
pub trait SlotDevice: Device<f32> {
    /// The boxed closure.
    type Slot;
    /// The slot of master tensor `t`.
    fn slot<S: Shape>(t: &Tensor<S, f32, Self>) -> Self::Slot;
    /// The master's gradient buffer in `grads` (allocated as zeros when `grads` lacks it).
    ///
    /// # Errors
    /// A device error (allocation).
    fn buffer<'a>(
        slot: &Self::Slot,
        grads: &'a mut Gradients<f32, Self>,
    ) -> Result<&'a mut <Self as Storage<f32>>::Vec, Self::Err>;
}

/// Constrains a closure to the higher-ranked signature of a slot.
fn slot<D: Device<f32>, F>(f: F) -> F
where
    F: for<'a> Fn(
        &'a mut Gradients<f32, D>,
    ) -> Result<&'a mut <D as Storage<f32>>::Vec, <D as HasErr>::Err>,
{
    f
}

/// A `Cpu` slot's closure: `Send + Sync`.
type CpuSlotFn = dyn for<'a> Fn(&'a mut Gradients<f32, Cpu>) -> Result<&'a mut <Cpu as Storage<f32>>::Vec, CpuError>
    + Send
    + Sync;

impl SlotDevice for Cpu {
    type Slot = Box<CpuSlotFn>;
    fn slot<S: Shape>(t: &Tensor<S, f32, Cpu>) -> Self::Slot {
        let ghost = t.ghost();
        Box::new(slot(move |g: &mut Gradients<f32, Cpu>| {
            g.get_or_alloc_mut(&ghost)
        }))
    }
    fn buffer<'a>(
        slot: &Self::Slot,
        grads: &'a mut Gradients<f32, Cpu>,
    ) -> Result<&'a mut <Cpu as Storage<f32>>::Vec, CpuError> {
        slot(grads)
    }
}

/// A `Cuda` slot's closure (dfdx's `Cuda` device is neither `Send` nor `Sync`).
#[cfg(feature = "cuda")]
type CudaSlotFn = dyn for<'a> Fn(
    &'a mut Gradients<f32, dfdx::tensor::Cuda>,
) -> Result<
    &'a mut <dfdx::tensor::Cuda as Storage<f32>>::Vec,
    dfdx::tensor::CudaError,
>;

#[cfg(feature = "cuda")]
impl SlotDevice for dfdx::tensor::Cuda {
    type Slot = Box<CudaSlotFn>;
    fn slot<S: Shape>(t: &Tensor<S, f32, dfdx::tensor::Cuda>) -> Self::Slot {
        let ghost = t.ghost();
        Box::new(slot(move |g: &mut Gradients<f32, dfdx::tensor::Cuda>| {
            g.get_or_alloc_mut(&ghost)
        }))
    }
    fn buffer<'a>(
        slot: &Self::Slot,
        grads: &'a mut Gradients<f32, dfdx::tensor::Cuda>,
    ) -> Result<&'a mut <dfdx::tensor::Cuda as Storage<f32>>::Vec, dfdx::tensor::CudaError> {
        slot(grads)
    }
}

/// A gradient buffer of the f32 master, with its element count.
pub struct MasterSlot<D: SlotDevice = Cpu> {
    pub(crate) len: usize,
    get: D::Slot,
}

impl<D: SlotDevice> MasterSlot<D> {
    /// The master's gradient buffer in `grads` (allocated as zeros when `grads` lacks it).
    pub(crate) fn buffer<'a>(
        &self,
        grads: &'a mut Gradients<f32, D>,
    ) -> Result<&'a mut <D as Storage<f32>>::Vec, D::Err> {
        D::buffer(&self.get, grads)
    }
}

impl MasterSlot<Cpu> {
    /// The master's gradient buffer on the host (allocated as zeros when `grads` lacks it).
    pub(crate) fn slice<'a>(
        &self,
        grads: &'a mut Gradients<f32, Cpu>,
    ) -> Result<&'a mut [f32], CpuError> {
        Ok(&mut self.buffer(grads)?[..])
    }
}

/// The master's layout: a gradient slot per trainable tensor, in visit order, and the element
/// count of each non-parameter tensor (batch-norm statistics).
pub(super) struct Layout<D: SlotDevice = Cpu> {
    pub(super) slots: Vec<MasterSlot<D>>,
    pub(super) state_lens: Vec<usize>,
}

/// A read-only walk of a module: what it does with each tensor, in visit order. [`each_tensor`]
/// is the one adapter to dfdx's `TensorVisitor`, so a walk states only its own work.
pub(crate) trait EachTensor<E: Dtype, D: Device<E>> {
    /// What stops the walk.
    type Error;
    /// One tensor; `trainable`: whether optimizers update it (else it is state, such as batch
    /// norm's running statistics).
    fn tensor<S: Shape>(&mut self, trainable: bool, t: &Tensor<S, E, D>)
    -> Result<(), Self::Error>;
}

/// Hands every tensor of `m` to `walk`, in visit order, until `walk` returns an error; `err`
/// converts a device error of the walker itself.
pub(crate) fn each_tensor<E, D, M, W>(
    m: &M,
    walk: &mut W,
    err: fn(D::Err) -> W::Error,
) -> Result<(), W::Error>
where
    E: Dtype,
    D: Device<E>,
    M: TensorCollection<E, D>,
    W: EachTensor<E, D>,
{
    struct Adapter<'a, W: EachTensor<E, D>, E: Dtype, D: Device<E>> {
        walk: &'a mut W,
        failed: Option<W::Error>,
        marker: std::marker::PhantomData<fn() -> (E, D)>,
    }
    impl<W: EachTensor<E, D>, E: Dtype, D: Device<E>> TensorVisitor<E, D> for Adapter<'_, W, E, D> {
        type Viewer = ViewTensorRef;
        type Err = D::Err;
        type E2 = E;
        type D2 = D;
        fn visit<S: Shape>(
            &mut self,
            opts: TensorOptions<S, E, D>,
            t: &Tensor<S, E, D>,
        ) -> Result<Option<Tensor<S, E, D>>, D::Err> {
            if self.failed.is_none()
                && let Err(e) = self.walk.tensor(opts.do_gradient_update, t)
            {
                self.failed = Some(e);
            }
            Ok(None)
        }
    }
    let mut adapter = Adapter {
        walk,
        failed: None,
        marker: std::marker::PhantomData,
    };
    M::iter_tensors(&mut RecursiveWalker { m, f: &mut adapter }).map_err(err)?;
    adapter.failed.map_or(Ok(()), Err)
}

/// The device of `m`'s first tensor, in visit order (`None` for a module without tensors).
pub(crate) fn first_device<E, D, M>(m: &M) -> Result<Option<D>, D::Err>
where
    E: Dtype,
    D: Device<E>,
    M: TensorCollection<E, D>,
{
    struct First<D>(Option<D>);
    impl<E: Dtype, D: Device<E>> EachTensor<E, D> for First<D> {
        type Error = D::Err;
        fn tensor<S: Shape>(&mut self, _: bool, t: &Tensor<S, E, D>) -> Result<(), D::Err> {
            if self.0.is_none() {
                self.0 = Some(t.device().clone());
            }
            Ok(())
        }
    }
    let mut first = First(None);
    each_tensor(m, &mut first, std::convert::identity)?;
    Ok(first.0)
}

/// Walks `master` once and records its [`Layout`].
pub(super) fn master_layout<D: SlotDevice, M: MasterModel<D>>(
    master: &M,
) -> Result<Layout<D>, D::Err> {
    let mut layout = Layout {
        slots: Vec::new(),
        state_lens: Vec::new(),
    };
    each_tensor(master, &mut layout, std::convert::identity)?;
    Ok(layout)
}

impl<D: SlotDevice> EachTensor<f32, D> for Layout<D> {
    type Error = D::Err;
    fn tensor<S: Shape>(&mut self, trainable: bool, t: &Tensor<S, f32, D>) -> Result<(), D::Err> {
        let n = t.shape().num_elements();
        if trainable {
            self.slots.push(MasterSlot {
                len: n,
                get: D::slot(t),
            });
        } else {
            self.state_lens.push(n);
        }
        Ok(())
    }
}

/// Who a master is: the ids of its trainable tensors, which its gradients are keyed by. Two
/// models built separately never share one; a clone shares its original's until dfdx gives it
/// new tensors. Filled in place, so a step allocates nothing once it has its size.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Identity {
    pub(super) ids: Vec<u64>,
}

impl Identity {
    /// Reads `master`'s identity into `self`.
    pub(super) fn read<D: Device<f32>, M: MasterModel<D>>(
        &mut self,
        master: &M,
    ) -> Result<(), D::Err> {
        self.ids.clear();
        each_tensor(master, &mut ReadIdentity(self), std::convert::identity)
    }
}

struct ReadIdentity<'a>(&'a mut Identity);

impl<D: Device<f32>> EachTensor<f32, D> for ReadIdentity<'_> {
    type Error = D::Err;
    fn tensor<S: Shape>(&mut self, trainable: bool, t: &Tensor<S, f32, D>) -> Result<(), D::Err> {
        if trainable {
            // An id that cannot be read (a dfdx whose `Debug` differs) keys nothing: the master
            // is then told apart by its type and tensor count alone.
            self.0.ids.push(tensor_id(t).unwrap_or(u64::MAX));
        }
        Ok(())
    }
}

/// The id dfdx keys a tensor's gradient by. dfdx 0.13 exposes it only through `Tensor`'s
/// derived `Debug`, whose first field it is: the formatter is stopped right after it, so no data
/// is printed and nothing is allocated.
fn tensor_id<S: Shape, D: Device<f32>>(t: &Tensor<S, f32, D>) -> Option<u64> {
    use std::fmt::Write;

    /// Collects the digits of `UniqueId(..)`, then stops the formatter.
    struct Digits {
        seen: usize,
        total: usize,
        id: Option<u64>,
        inside: bool,
        value: u64,
    }
    const OPEN: &str = "UniqueId(";
    impl Write for Digits {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            for c in s.chars() {
                if self.inside {
                    match c.to_digit(10) {
                        Some(d) => {
                            self.value = self
                                .value
                                .checked_mul(10)
                                .and_then(|v| v.checked_add(u64::from(d)))
                                .ok_or(std::fmt::Error)?;
                        }
                        None if c == ')' => {
                            self.id = Some(self.value);
                            return Err(std::fmt::Error);
                        }
                        None => return Err(std::fmt::Error),
                    }
                } else if OPEN[self.seen..].starts_with(c) {
                    self.seen += c.len_utf8();
                    self.inside = self.seen == OPEN.len();
                } else {
                    self.seen = usize::from(OPEN.starts_with(c));
                }
            }
            // Only the struct's name comes before the id: give up long before any data.
            self.total += s.len();
            if self.total > 128 {
                return Err(std::fmt::Error);
            }
            Ok(())
        }
    }
    let mut d = Digits {
        seen: 0,
        total: 0,
        id: None,
        inside: false,
        value: 0,
    };
    let _ = write!(d, "{t:?}");
    d.id
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

/// Copies the non-parameter tensors (f32 values of the working copy after the forward pass)
/// into the master.
pub(super) struct WriteState<'a> {
    pub(super) after: &'a [Vec<f32>],
    pub(super) index: usize,
    pub(super) mismatch: Option<StepError>,
}

impl<D: Device<f32>> TensorVisitor<f32, D> for WriteState<'_> {
    type Viewer = ViewTensorMut;
    type Err = D::Err;
    type E2 = f32;
    type D2 = D;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, f32, D>,
        t: &mut Tensor<S, f32, D>,
    ) -> Result<Option<Tensor<S, f32, D>>, D::Err> {
        if opts.do_gradient_update || self.mismatch.is_some() {
            return Ok(None);
        }
        let j = self.index;
        self.index += 1;
        match self.after.get(j) {
            Some(values) if values.len() == t.shape().num_elements() => t.copy_from(values),
            Some(values) => {
                self.mismatch = Some(len_mismatch(j, values.len(), t.shape().num_elements()));
            }
            None => self.mismatch = Some(count_mismatch(self.after.len(), j + 1)),
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dfdx::prelude::*;

    #[test]
    fn a_tensor_id_is_read_and_tells_models_apart() {
        let dev = Cpu::default();
        let a = dev.build_module::<(Linear<3, 4>, ReLU, Linear<4, 2>), f32>();
        let b = dev.build_module::<(Linear<3, 4>, ReLU, Linear<4, 2>), f32>();
        let (mut ia, mut ib, mut ic) = (
            Identity::default(),
            Identity::default(),
            Identity::default(),
        );
        ia.read(&a).unwrap();
        ib.read(&b).unwrap();
        ic.read(&a.clone()).unwrap();
        assert_eq!(ia.ids.len(), 4);
        assert!(ia.ids.iter().all(|&id| id != u64::MAX), "{ia:?}");
        assert_ne!(ia, ib);
        assert_eq!(ia, ic);
        // the ids are dfdx's own: consecutive tensors built one after the other
        let mut sorted = ia.ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 4);
    }

    #[test]
    fn reading_an_id_stops_before_the_data() {
        let dev = Cpu::default();
        let big: Tensor<Rank1<100_000>, f32, _> = dev.zeros();
        assert!(tensor_id(&big).is_some());
    }
}
