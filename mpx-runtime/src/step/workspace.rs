//! [`Workspace`]: what the scaler does with a master's workspace without knowing its model or
//! its device, and [`ErasedWorking`], a workspace it can hold.

use std::any::Any;

use super::error::StepError;
#[cfg(feature = "mpi")]
use super::layout::MasterSlot;

/// Reads a workspace's non-parameter state.
pub(crate) type StateFn<'a> = dyn FnMut(&[Vec<f32>]) -> Result<(), StepError> + 'a;

/// Gets a workspace's typed form back.
pub(crate) type AnyFn<'a> = dyn FnMut(&mut dyn Any) -> Result<(), StepError> + 'a;

/// What the scaler does with a master's workspace without knowing the model's type (nor its
/// device: the gradients come as `dyn Any`, a `Gradients<f32, D>` of the master's device `D`).
pub trait Workspace: Any {
    /// Moves every finished backward's half gradients into `grads` (the master's f32
    /// gradients, keyed by its tensors), unscaled, and checks the master's gradients for
    /// finiteness on the way. Returns `None` when no backward reached this working copy since
    /// the last call (or `grads` are another device's), else whether all were finite.
    fn transfer(&mut self, grads: &mut dyn Any) -> Result<Option<bool>, StepError>;
    /// Whether the master's gradients in `grads` are all finite (a slot `grads` lacks is
    /// allocated as zeros).
    fn check(&self, grads: &mut dyn Any) -> Result<bool, StepError>;
    /// Hands `f` the working copy's non-parameter tensors (batch-norm statistics) after the
    /// last backward pass, widened to f32, in the master's visit order.
    fn with_state(&self, f: &mut StateFn<'_>) -> Result<(), StepError>;
    /// Marks an f32-run master's forward pass (see [`super::device::FullWorking`]); `false` for a half
    /// working copy, which is not run that way.
    fn mark_used(&mut self) -> bool {
        false
    }
    /// Whether the master's forward passes run in f32 on the master itself.
    fn in_f32(&self) -> bool {
        false
    }
    /// Whether the working copy is made of mpx's layers ([`super::HalfLayers`]).
    fn mapped(&self) -> bool {
        false
    }
    /// Hands `f` the workspace, as `Any`, to get the typed workspace back.
    fn with_any(&mut self, f: &mut AnyFn<'_>) -> Result<(), StepError>;
    /// The master's gradient slots, one per trainable tensor in visit order (what the
    /// data-parallel all-reduce packs).
    #[cfg(feature = "mpi")]
    fn master_slots(&self) -> &[MasterSlot];
}

/// A workspace the scaler can hold: `Send + Sync`, so the scaler is (a workspace that is not,
/// one on dfdx's `Cuda` device, is held through [`super::local`]).
pub trait ErasedWorking: Workspace + Send + Sync {}

impl<T: Workspace + Send + Sync> ErasedWorking for T {}
