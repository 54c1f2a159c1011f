//! A master whose forward pass runs in f32, on the master itself: what `#[mixed_step]` falls
//! back to when the half working copy's forward pass cannot be type-checked (a model whose type
//! is a generic parameter of the `impl`, whose bounds the attribute on the method cannot see).
//! The step keeps the scaler's bookkeeping (one update per backward, skip on non-finite
//! gradients, the iteration's scale adjustment) and reports that it ran in f32
//! ([`StepReport::precision`](super::StepReport::precision)).

use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;

use super::device::MixedDevice;
use super::error::StepError;
use super::layout::{MasterSlot, master_layout};
use super::working::{AnyFn, StateFn, Workspace, check_all};
use crate::boundary::MasterModel;
use crate::precision::Precision;
use dfdx::tensor::Gradients;

/// The gradient slots of an f32-run master on device `D` (checked as precision `H`'s device
/// checks), and whether a forward pass ran since the last backward.
pub struct FullWorking<H: Precision, D: MixedDevice<H>> {
    master: Arc<[MasterSlot<D>]>,
    used: bool,
    marker: PhantomData<fn() -> H>,
}

impl<H: Precision, D: MixedDevice<H>> FullWorking<H, D> {
    pub(crate) fn new<M: MasterModel<D>>(master: &M) -> Result<Self, StepError> {
        Ok(Self {
            master: master_layout::<D, M>(master)
                .map_err(D::step_error)?
                .slots
                .into(),
            used: false,
            marker: PhantomData,
        })
    }
}

impl<H: Precision, D: MixedDevice<H>> Workspace for FullWorking<H, D> {
    fn transfer(&mut self, grads: &mut dyn Any) -> Result<Option<bool>, StepError> {
        if !self.used || !grads.is::<Gradients<f32, D>>() {
            return Ok(None);
        }
        self.used = false;
        self.check(grads).map(Some)
    }

    fn check(&self, grads: &mut dyn Any) -> Result<bool, StepError> {
        match grads.downcast_mut::<Gradients<f32, D>>() {
            Some(grads) => check_all::<H, D>(&self.master, grads),
            None => Ok(true),
        }
    }

    fn with_state(&self, f: &mut StateFn<'_>) -> Result<(), StepError> {
        f(&[])
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
        let any: &dyn Any = &self.master;
        any.downcast_ref::<Arc<[MasterSlot]>>()
            .map_or(&[], |s| &s[..])
    }

    fn with_any(&mut self, f: &mut AnyFn<'_>) -> Result<(), StepError> {
        f(self)
    }
}
