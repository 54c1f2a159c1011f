//! Direct gradients: inside a [`GradScaler`](super::GradScaler) forward pass, mpx's fused linear
//! layers ([`nn::Linear`](crate::nn::Linear), [`nn::LinearReLU`](crate::nn::LinearReLU)) write
//! their weight and bias gradients in f32 straight into the master's gradients, unscaled and
//! checked for finiteness in the same pass. For those tensors there is no half gradient and no
//! transfer pass.
//!
//! **How a layer finds its master tensors.** Before the forward pass, the scaler records in a
//! [`Scope`] on the calling thread where each trainable tensor of the working copy lives (its
//! address inside the working copy) and which master tensor it stands for (its position in the
//! walk, the same position the transfer uses). A fused layer whose weight and bias are both found
//! there gets a [`Link`]. A layer that is not found (a clone, a layer built inside the pass, any
//! forward pass outside a scaler) takes the ordinary path: its gradients go to the half buffers
//! and the transfer moves them. The working copy's layers must therefore stay where the scaler
//! put them during the pass (moving one, with `std::mem::swap` for example, is not supported).
//!
//! **How the gradients get in.** The master's gradients are the `Gradients` the f32 backward is
//! filling. While the region's half backward runs, its bridge lends them to the shared
//! [`Direct`] state ([`Direct::lend`]) and takes them back right after ([`Direct::restore`]).
//! A linked layer's backward adds `dW / scale` and `db / scale` into them and records the
//! finiteness of the sums.
//!
//! **Nothing is lost.** The transfer still looks at a linked tensor's half gradient: when
//! something else also used the tensor in half precision (a clone of the layer, the weight read
//! directly), its half gradient is not zero and is moved as usual. Only an all-zero half
//! gradient is skipped, so the direct path never drops a contribution.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::shapes::{Dtype, Shape};
use dfdx::tensor::{Cpu, CpuError, Gradients, Tensor};
use dfdx::tensor_ops::Device;

use super::layout::{EachTensor, MasterSlot, each_tensor};
use crate::finite::add_scaled_checked;
use crate::kernels::{every_part, zip_parts};
use crate::precision::FloatSlice;

/// The state a scaler's workspace shares with the linked layers of its forward passes.
pub struct Direct {
    state: Mutex<State>,
    /// The address table of the last scope, kept so that a step allocates none.
    spare: Mutex<Vec<(usize, usize)>>,
}

struct State {
    /// The master's gradient buffers, by trainable-tensor position.
    slots: Arc<[MasterSlot]>,
    /// The master's gradients while a half backward runs.
    lent: Option<Gradients<f32, Cpu>>,
    /// The reciprocal of the scale the forward pass applied.
    inv: f32,
    /// Whether every sum written since the last [`Direct::drain`] was finite.
    finite: bool,
    /// Which positions were written since the last [`Direct::drain`].
    written: Vec<bool>,
}

impl Direct {
    /// The shared state for a master with these gradient slots.
    pub(super) fn new(slots: Arc<[MasterSlot]>) -> Self {
        let written = vec![false; slots.len()];
        Self {
            state: Mutex::new(State {
                slots,
                lent: None,
                inv: 1.0,
                finite: true,
                written,
            }),
            spare: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets the reciprocal of the scale the next forward pass applies (the loss scale's own
    /// `inv_loss_scale`): the linked layers and the transfer unscale with it.
    pub(crate) fn set_inv(&self, inv: f32) {
        self.lock().inv = inv;
    }

    /// Lends the master's gradients to the linked layers (an empty set is left in their place).
    pub(crate) fn lend(&self, grads: &mut Gradients<f32, Cpu>) {
        self.lock().lent = Some(std::mem::replace(grads, Gradients::leaky()));
    }

    /// Takes the lent gradients back.
    pub(crate) fn restore(&self, grads: &mut Gradients<f32, Cpu>) {
        if let Some(lent) = self.lock().lent.take() {
            *grads = lent;
        }
    }

    /// Moves the positions written since the last call into `written` (resized to the slot
    /// count), clears them, and returns whether every sum written was finite.
    pub(crate) fn drain(&self, written: &mut Vec<bool>) -> bool {
        let mut s = self.lock();
        written.clear();
        written.extend_from_slice(&s.written);
        s.written.fill(false);
        std::mem::replace(&mut s.finite, true)
    }

    /// `master_grad[slot] += values / scale`, checked.
    fn add(&self, slot: usize, values: &[f32]) -> Result<(), CpuError> {
        let mut guard = self.lock();
        let s = &mut *guard;
        let (Some(grads), Some(master)) = (s.lent.as_mut(), s.slots.get(slot)) else {
            // Only a bridge runs a half backward, and it lends first; positions come from the
            // slots themselves.
            return Err(CpuError::WrongNumElements);
        };
        if master.len != values.len() {
            return Err(CpuError::WrongNumElements);
        }
        let dst = master.slice(grads)?;
        let inv = s.inv;
        s.finite &= zip_parts(dst, values, &|d, v| add_scaled_checked(d, v, inv));
        if let Some(w) = s.written.get_mut(slot) {
            *w = true;
        }
        Ok(())
    }
}

/// A fused layer's link to the master tensors its weight and bias stand for.
pub(crate) struct Link {
    direct: Arc<Direct>,
    weight: usize,
    bias: usize,
}

impl Link {
    /// Adds the weight gradient (f32, scaled as the backward computed it) to the master's.
    pub(crate) fn add_weight_grad(&self, values: &[f32]) -> Result<(), CpuError> {
        self.direct.add(self.weight, values)
    }

    /// Adds the bias gradient (f32, scaled) to the master's.
    pub(crate) fn add_bias_grad(&self, values: &[f32]) -> Result<(), CpuError> {
        self.direct.add(self.bias, values)
    }
}

/// The working copy's trainable tensors, by address, for one forward pass.
struct Scope {
    /// `(address, position)`, sorted by address.
    by_addr: Vec<(usize, usize)>,
    direct: Arc<Direct>,
}

thread_local! {
    static SCOPES: RefCell<Vec<Scope>> = const { RefCell::new(Vec::new()) };
}

/// Ends the scope [`enter`] opened when dropped (also when the forward pass panics).
pub struct ScopeGuard(());

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        if let Some(scope) = SCOPES.with(|s| s.borrow_mut().pop()) {
            *scope
                .direct
                .spare
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = scope.by_addr;
        }
    }
}

fn addr<T>(t: &T) -> usize {
    std::ptr::from_ref(t).addr()
}

/// Opens the scope of one forward pass on `working`, whose trainable tensors stand, in walk
/// order, for the master's gradient slots of `direct`.
pub(crate) fn enter<E, W>(working: &W, direct: &Arc<Direct>) -> Result<ScopeGuard, CpuError>
where
    E: Dtype,
    Cpu: Device<E>,
    W: TensorCollection<E, Cpu>,
{
    let mut by_addr =
        std::mem::take(&mut *direct.spare.lock().unwrap_or_else(PoisonError::into_inner));
    by_addr.clear();
    let mut walk = Addresses { by_addr };
    each_tensor::<E, Cpu, W, _>(working, &mut walk, std::convert::identity)?;
    let mut by_addr = walk.by_addr;
    by_addr.sort_unstable();
    SCOPES.with(|s| {
        s.borrow_mut().push(Scope {
            by_addr,
            direct: Arc::clone(direct),
        });
    });
    Ok(ScopeGuard(()))
}

/// The link of a layer with this weight and bias, when the innermost scope knows both.
pub(crate) fn link<W, B>(weight: &W, bias: &B) -> Option<Link> {
    SCOPES.with(|s| {
        let scopes = s.borrow();
        let scope = scopes.last()?;
        let find = |a: usize| {
            scope
                .by_addr
                .binary_search_by_key(&a, |&(at, _)| at)
                .ok()
                .map(|i| scope.by_addr[i].1)
        };
        Some(Link {
            direct: Arc::clone(&scope.direct),
            weight: find(addr(weight))?,
            bias: find(addr(bias))?,
        })
    })
}

/// Whether every bit of a gradient is zero (nothing was added to it), read on the pool's
/// threads for a long gradient.
pub(crate) fn all_zero(values: FloatSlice<'_>) -> bool {
    match values {
        FloatSlice::F32(v) | FloatSlice::Bf16(v) => {
            every_part(v, &|p| p.iter().fold(0, |acc, x| acc | x.to_bits()) == 0)
        }
        FloatSlice::F16(v) => every_part(v, &|p| p.iter().fold(0, |acc, x| acc | x.to_bits()) == 0),
    }
}

struct Addresses {
    by_addr: Vec<(usize, usize)>,
}

impl<E: Dtype> EachTensor<E, Cpu> for Addresses
where
    Cpu: Device<E>,
{
    type Error = CpuError;
    fn tensor<S: Shape>(&mut self, trainable: bool, t: &Tensor<S, E, Cpu>) -> Result<(), CpuError> {
        if trainable {
            let position = self.by_addr.len();
            self.by_addr.push((addr(t), position));
        }
        Ok(())
    }
}
