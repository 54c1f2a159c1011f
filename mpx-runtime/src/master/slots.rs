//! Gradient slots: where one tensor's gradient lives in a `Gradients`, found through a data-free
//! ghost of the tensor (dfdx keys gradients by the tensor's own id and lets no code outside it
//! read that id, so a ghost is the only key it hands out).

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::shapes::{Dtype, HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, Gradients, HasErr, Storage, Tensor};
use dfdx::tensor_ops::Device;

use std::sync::Arc;

use crate::walk::{Each, each};

/// A device whose tensors of element `E` can be keyed by a boxed ghost. On the `Cpu` the box is
/// shared (a clone is another handle on one lookup: a fused layer's link and the forward pass's
/// record hold the same) and `Send + Sync` (so the state that holds it can be); dfdx's `Cuda`
/// device is neither, so a `Cuda` slot is not either.
pub trait SlotDevice<E: Dtype>: Device<E> {
    /// The boxed lookup.
    type Slot;
    /// The slot of tensor `t`.
    fn slot<S: Shape>(t: &Tensor<S, E, Self>) -> Self::Slot;
    /// `t`'s gradient buffer in `grads`, allocated as zeros when `grads` has none.
    ///
    /// # Errors
    /// A device error (allocation).
    fn buffer<'a>(
        slot: &Self::Slot,
        grads: &'a mut Gradients<E, Self>,
    ) -> Result<&'a mut <Self as Storage<E>>::Vec, Self::Err>;
}

/// Constrains a closure to the higher-ranked signature of a slot.
fn lookup<E: Dtype, D: Device<E>, F>(f: F) -> F
where
    F: for<'a> Fn(
        &'a mut Gradients<E, D>,
    ) -> Result<&'a mut <D as Storage<E>>::Vec, <D as HasErr>::Err>,
{
    f
}

/// A `Cpu` slot's lookup.
type CpuLookup<E> = dyn for<'a> Fn(&'a mut Gradients<E, Cpu>) -> Result<&'a mut <Cpu as Storage<E>>::Vec, CpuError>
    + Send
    + Sync;

impl<E: Dtype> SlotDevice<E> for Cpu
where
    Cpu: Device<E>,
{
    type Slot = Arc<CpuLookup<E>>;
    fn slot<S: Shape>(t: &Tensor<S, E, Cpu>) -> Self::Slot {
        let ghost = t.ghost();
        Arc::new(lookup(move |g: &mut Gradients<E, Cpu>| {
            g.get_or_alloc_mut(&ghost)
        }))
    }
    fn buffer<'a>(
        slot: &Self::Slot,
        grads: &'a mut Gradients<E, Cpu>,
    ) -> Result<&'a mut <Cpu as Storage<E>>::Vec, CpuError> {
        slot(grads)
    }
}

/// A `Cuda` slot's lookup (dfdx's `Cuda` device is neither `Send` nor `Sync`).
#[cfg(feature = "cuda")]
type CudaLookup<E> = dyn for<'a> Fn(
    &'a mut Gradients<E, dfdx::tensor::Cuda>,
) -> Result<
    &'a mut <dfdx::tensor::Cuda as Storage<E>>::Vec,
    dfdx::tensor::CudaError,
>;

#[cfg(feature = "cuda")]
impl<E: Dtype> SlotDevice<E> for dfdx::tensor::Cuda
where
    dfdx::tensor::Cuda: Device<E>,
{
    type Slot = Box<CudaLookup<E>>;
    fn slot<S: Shape>(t: &Tensor<S, E, dfdx::tensor::Cuda>) -> Self::Slot {
        let ghost = t.ghost();
        Box::new(lookup(move |g: &mut Gradients<E, dfdx::tensor::Cuda>| {
            g.get_or_alloc_mut(&ghost)
        }))
    }
    fn buffer<'a>(
        slot: &Self::Slot,
        grads: &'a mut Gradients<E, dfdx::tensor::Cuda>,
    ) -> Result<&'a mut <dfdx::tensor::Cuda as Storage<E>>::Vec, dfdx::tensor::CudaError> {
        slot(grads)
    }
}

/// One tensor's gradient buffer, with the tensor's element count and address.
pub struct Slot<E: Dtype, D: SlotDevice<E> = Cpu> {
    pub(crate) len: usize,
    /// Where the tensor lies (tells a part's tensors apart within a model, while both are borrowed).
    pub(crate) addr: usize,
    get: D::Slot,
}

/// A slot of an f32 master tensor.
pub(crate) type MasterSlot<D = Cpu> = Slot<f32, D>;

impl<E: Dtype, D: SlotDevice<E>> Slot<E, D> {
    /// The slot of `t`.
    pub(crate) fn of<S: Shape>(t: &Tensor<S, E, D>) -> Self {
        Self {
            len: t.shape().num_elements(),
            addr: std::ptr::from_ref(t).addr(),
            get: D::slot(t),
        }
    }

    /// The tensor's gradient buffer in `grads` (allocated as zeros when `grads` lacks it).
    pub(crate) fn buffer<'a>(
        &self,
        grads: &'a mut Gradients<E, D>,
    ) -> Result<&'a mut <D as Storage<E>>::Vec, D::Err> {
        D::buffer(&self.get, grads)
    }
}

impl<E: Dtype> Clone for Slot<E, Cpu>
where
    Cpu: Device<E>,
{
    /// Another handle on the same lookup.
    fn clone(&self) -> Self {
        Self {
            len: self.len,
            addr: self.addr,
            get: Arc::clone(&self.get),
        }
    }
}

impl<E: Dtype> Slot<E, Cpu>
where
    Cpu: Device<E>,
{
    /// The gradient buffer on the host, checked to hold the tensor's element count.
    pub(crate) fn slice<'a>(
        &self,
        grads: &'a mut Gradients<E, Cpu>,
    ) -> Result<&'a mut [E], CpuError> {
        let buf = crate::cast::grad_slice::<E>(self.buffer(grads)?);
        if buf.len() == self.len {
            Ok(buf)
        } else {
            Err(CpuError::WrongNumElements)
        }
    }
}

/// The device of `m`'s first tensor, in visit order (`None` for a module without tensors).
#[cfg(feature = "cuda")]
pub(crate) fn first_device<E, D, M>(m: &M) -> Result<Option<D>, D::Err>
where
    E: Dtype,
    D: Device<E>,
    M: TensorCollection<E, D>,
{
    struct First<D>(Option<D>);
    impl<E: Dtype, D: Device<E>> Each<E, D> for First<D> {
        type Error = D::Err;
        fn tensor<S: Shape>(&mut self, _: bool, t: &Tensor<S, E, D>) -> Result<(), D::Err> {
            if self.0.is_none() {
                self.0 = Some(t.device().clone());
            }
            Ok(())
        }
    }
    let mut first = First(None);
    each(m, &mut first, std::convert::identity)?;
    Ok(first.0)
}

/// The slots of `m`'s trainable tensors, in visit order.
pub(crate) fn trainable_slots<D: SlotDevice<f32>, M: TensorCollection<f32, D>>(
    m: &M,
) -> Result<Vec<MasterSlot<D>>, D::Err> {
    struct Slots<D: SlotDevice<f32>>(Vec<MasterSlot<D>>);
    impl<D: SlotDevice<f32>> Each<f32, D> for Slots<D> {
        type Error = D::Err;
        fn tensor<S: Shape>(
            &mut self,
            trainable: bool,
            t: &Tensor<S, f32, D>,
        ) -> Result<(), D::Err> {
            if trainable {
                self.0.push(Slot::of(t));
            }
            Ok(())
        }
    }
    let mut slots = Slots(Vec::new());
    each(m, &mut slots, std::convert::identity)?;
    Ok(slots.0)
}
