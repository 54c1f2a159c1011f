//! A master whose forward pass runs in f32, on the master itself: what `#[mixed_step]` falls
//! back to when the half working copy's forward pass cannot be type-checked (a model whose type
//! is a generic parameter of the `impl`, whose bounds the attribute on the method cannot see).
//! The step keeps the scaler's bookkeeping (one update per backward, skip on non-finite
//! gradients, the iteration's scale adjustment) and reports that it ran in f32
//! ([`StepReport::precision`](super::StepReport::precision)).

use std::any::Any;
use std::sync::Arc;

use dfdx::tensor::{Cpu, Gradients};

use super::error::StepError;
use super::layout::{MasterSlot, master_layout};
use super::working::ErasedWorking;
use crate::boundary::MasterModel;
use crate::finite::all_finite_f32;

/// The gradient slots of an f32-run master, and whether a forward pass ran since the last
/// backward.
pub(crate) struct FullWorking {
    master: Arc<[MasterSlot]>,
    used: bool,
}

impl FullWorking {
    pub(crate) fn new<M: MasterModel>(master: &M) -> Result<Self, StepError> {
        Ok(Self {
            master: master_layout(master)?.slots.into(),
            used: false,
        })
    }
}

impl ErasedWorking for FullWorking {
    fn transfer(&mut self, grads: &mut Gradients<f32, Cpu>) -> Result<Option<bool>, StepError> {
        if !std::mem::replace(&mut self.used, false) {
            return Ok(None);
        }
        self.check(grads).map(Some)
    }

    fn check(&self, grads: &mut Gradients<f32, Cpu>) -> Result<bool, StepError> {
        let mut finite = true;
        for slot in self.master.iter() {
            finite &= all_finite_f32((slot.get)(grads)?);
        }
        Ok(finite)
    }

    fn state(&self) -> &[Vec<f32>] {
        &[]
    }

    fn mark_used(&mut self) -> bool {
        self.used = true;
        true
    }

    fn in_f32(&self) -> bool {
        true
    }

    #[cfg(feature = "mpi")]
    fn master_slots(&self) -> &[MasterSlot] {
        &self.master
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
