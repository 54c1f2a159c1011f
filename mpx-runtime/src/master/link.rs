//! Direct gradients: in a mixed step's working copy made of mpx's layers, a fused linear layer
//! holds a [`Link`] to the master tensors its weight and bias stand for, and its backward adds
//! `dW / scale` and `db / scale` in f32 straight into the master's gradients: no half gradient,
//! no rounding of the sums, no transfer pass for them.
//!
//! The link is a value stored in the layer when the working copy is built for one forward pass
//! ([`Linker`], handed to [`HalfLayers::finish`](crate::step::HalfLayers::finish)); it shares the
//! forward pass's [`RegionLinks`]: the master's gradients, lent by the region's backward bridge
//! while the half backward runs, the reciprocal of the scale that pass applied, and the half
//! gradients of inputs whose gradient nothing reads ([`Batch`](crate::step::Batch)), whose `dX = dZ·W`
//! a linked layer skips. A layer outside a mixed step has no link and writes its gradients as any
//! dfdx layer does.
//!
//! Nothing is lost: the transfer still looks at a linked tensor's half gradient, and moves it
//! when something else in the working copy also used the tensor in half precision.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use dfdx::shapes::Shape;
use dfdx::tensor::{Cpu, CpuError, Gradients, Tensor};
use mpx_kernels::zip_parts;

use super::slots::MasterSlot;
use crate::finite::add_scaled_checked;

/// What the linked layers of one forward pass share with its backward bridge. Named by the
/// sealed device trait, reachable by nobody outside the crate.
#[derive(Debug)]
#[allow(unreachable_pub)]
pub struct RegionLinks {
    /// The master's gradients while the half backward runs.
    lent: Mutex<Option<Gradients<f32, Cpu>>>,
    /// The reciprocal of the scale the forward pass applied.
    inv: f32,
    /// Addresses of the half gradients of inputs nothing reads.
    unread: Mutex<Vec<usize>>,
    /// Addresses of the master tensors linked while the working copy was built.
    linked: Mutex<Vec<usize>>,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RegionLinks {
    pub(crate) fn new(inv: f32) -> Arc<Self> {
        Arc::new(Self {
            lent: Mutex::new(None),
            inv,
            unread: Mutex::new(Vec::new()),
            linked: Mutex::new(Vec::new()),
        })
    }

    /// Lends the master's gradients to the linked layers (an empty set stands in their place).
    pub(crate) fn lend(&self, grads: &mut Gradients<f32, Cpu>) {
        *locked(&self.lent) = Some(std::mem::replace(grads, Gradients::leaky()));
    }

    /// Takes the lent gradients back.
    pub(crate) fn restore(&self, grads: &mut Gradients<f32, Cpu>) {
        if let Some(lent) = locked(&self.lent).take() {
            *grads = lent;
        }
    }

    /// Records that the half gradient at `addr` belongs to an input nothing reads.
    pub(crate) fn mark_unread(&self, addr: usize) {
        locked(&self.unread).push(addr);
    }

    /// Whether the master tensor at `addr` was linked.
    pub(crate) fn is_linked(&self, addr: usize) -> bool {
        locked(&self.linked).contains(&addr)
    }

    /// `master_grad += values / scale`.
    fn add(&self, slot: &MasterSlot, values: &[f32]) -> Result<(), CpuError> {
        if slot.len != values.len() {
            return Err(CpuError::WrongNumElements);
        }
        let inv = self.inv;
        self.with_lent(|grads| {
            let dst = slot.slice(grads)?;
            // finiteness is checked once the whole backward pass has run
            zip_parts(dst, values, &|d, v| add_scaled_checked(d, v, inv));
            Ok(())
        })
    }

    /// Runs `f` on the f32 gradients lent to this pass (an error when none are: only a
    /// bridge runs the half backward, and it lends first).
    pub(crate) fn with_lent<T>(
        &self,
        f: impl FnOnce(&mut Gradients<f32, Cpu>) -> Result<T, CpuError>,
    ) -> Result<T, CpuError> {
        f(locked(&self.lent)
            .as_mut()
            .ok_or(CpuError::WrongNumElements)?)
    }
}

/// A fused linear layer's link to the master tensors its weight and bias stand for, in one
/// forward pass of a mixed step.
#[derive(Clone)]
pub struct Link {
    region: Arc<RegionLinks>,
    weight: MasterSlot,
    bias: MasterSlot,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("weight_len", &self.weight.len)
            .field("bias_len", &self.bias.len)
            .finish_non_exhaustive()
    }
}

impl Link {
    /// Adds the weight gradient (f32 sums, scaled as the backward computed them) to the master's.
    pub(crate) fn add_weight_grad(&self, values: &[f32]) -> Result<(), CpuError> {
        self.region.add(&self.weight, values)
    }

    /// Adds the bias gradient (f32 sums, scaled) to the master's.
    pub(crate) fn add_bias_grad(&self, values: &[f32]) -> Result<(), CpuError> {
        self.region.add(&self.bias, values)
    }

    /// Whether `grad` is the half gradient of an input nothing reads: nothing reads what would
    /// be added to it.
    pub(crate) fn is_unread<E>(&self, grad: &[E]) -> bool {
        !grad.is_empty() && locked(&self.region.unread).contains(&grad.as_ptr().addr())
    }
}

/// Hands out the links of one forward pass's working copy, to
/// [`HalfLayers::finish`](crate::step::HalfLayers::finish).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::step::Linker;
/// let dev = Cpu::default();
/// let l = dev.build_module::<Linear<2, 3>, f32>();
/// // outside a mixed step there is nothing to link to
/// assert!(Linker::none().link(&l.weight, &l.bias).is_none());
/// ```
#[derive(Debug)]
pub struct Linker {
    region: Option<Arc<RegionLinks>>,
}

impl Linker {
    pub(crate) fn new(region: Arc<RegionLinks>) -> Self {
        Self {
            region: Some(region),
        }
    }

    /// A linker that links nothing: the working copy's layers write their gradients as dfdx's
    /// do (a forward pass without a scaler, or a device without direct gradients).
    pub fn none() -> Self {
        Self { region: None }
    }

    /// The link of a fused layer whose weight and bias stand for the master's `weight` and
    /// `bias` (`None` outside a mixed step).
    pub fn link<S: Shape, B: Shape>(
        &self,
        weight: &Tensor<S, f32, Cpu>,
        bias: &Tensor<B, f32, Cpu>,
    ) -> Option<Link> {
        let region = self.region.as_ref()?;
        locked(&region.linked).extend([
            std::ptr::from_ref(weight).addr(),
            std::ptr::from_ref(bias).addr(),
        ]);
        Some(Link {
            region: Arc::clone(region),
            weight: MasterSlot::of(weight),
            bias: MasterSlot::of(bias),
        })
    }

    /// The link of a layer built straight from master tensors whose slots the forward pass
    /// records itself (`weight`, `bias`: handles on those slots); `None` outside a mixed step.
    pub(crate) fn link_slots(&self, weight: &MasterSlot, bias: &MasterSlot) -> Option<Link> {
        Some(Link {
            region: Arc::clone(self.region.as_ref()?),
            weight: weight.clone(),
            bias: bias.clone(),
        })
    }
}
