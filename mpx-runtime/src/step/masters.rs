//! The masters one [`GradScaler`](super::GradScaler) serves: a working copy and a pending
//! verdict per master model, found by the master's identity, and the iteration that decides
//! when the one loss scale is adjusted.
//!
//! PyTorch's `GradScaler` serves any number of models and optimizers: each `scaler.step(opt)`
//! is skipped on its own gradients' finiteness, and `scaler.update()` adjusts the one scale once
//! per iteration. Here the update of each master is that master's step; an iteration is over
//! when every master that took part in the last one, and every master whose gradients wait for
//! their update, has been updated once (a master updated twice before the others closes the
//! iteration early, and those others stop taking part until they are updated again). With one
//! master, every update is an iteration.

use super::error::StepError;
use super::layout::Identity;
use super::workspace::ErasedWorking;
use crate::boundary::MasterModel;
use dfdx::tensor_ops::Device;

/// Closed iterations an entry may go unused before its working copy is freed (a model of an
/// earlier fold, a discarded ensemble member).
const KEEP_UNUSED: u64 = 16;

/// What the backward passes since a master's last update saw of its gradients.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pending {
    pub(super) backwards: u64,
    pub(super) grads_finite: bool,
    /// `grads_finite` before the last backward pass.
    pub(super) grads_finite_before: bool,
    pub(super) loss_finite: bool,
    pub(super) loss: f32,
    pub(super) scale: f32,
}

impl Pending {
    pub(super) const NONE: Pending = Pending {
        backwards: 0,
        grads_finite: true,
        grads_finite_before: true,
        loss_finite: true,
        loss: f32::NAN,
        scale: f32::NAN,
    };
}

/// One master model.
pub(super) struct Entry {
    /// The master's type, by name (with the ids, a key no two masters share).
    type_name: &'static str,
    identity: Identity,
    pub(super) working: Box<dyn ErasedWorking>,
    pub(super) pending: Pending,
    /// Reached by the last backward pass.
    pub(super) touched: bool,
    /// Updated in the current iteration.
    updated: bool,
    /// Takes part in iterations: updated in the last closed one, or since.
    participating: bool,
    /// The iteration of the last forward pass or update.
    last_used: u64,
}

/// Every master a scaler serves.
#[derive(Default)]
pub(super) struct Masters {
    entries: Vec<Entry>,
    /// The identity of the master being looked up (reused buffer).
    probe: Identity,
    iteration: u64,
    /// Whether an update of the current iteration was skipped.
    found_inf: bool,
}

impl Masters {
    /// The entry of `master`, if it has one.
    pub(super) fn find<D: Device<f32>, M: MasterModel<D>>(
        &mut self,
        master: &M,
        err: fn(D::Err) -> StepError,
    ) -> Result<Option<usize>, StepError> {
        self.probe.read::<D, M>(master).map_err(err)?;
        let type_name = std::any::type_name::<M>();
        Ok(self
            .entries
            .iter()
            .position(|e| e.type_name == type_name && e.identity == self.probe))
    }

    /// The entry of `master`, made with `make` if it has none; marked as used.
    pub(super) fn find_or_insert<D: Device<f32>, M: MasterModel<D>>(
        &mut self,
        master: &M,
        err: fn(D::Err) -> StepError,
        make: impl FnOnce(&M) -> Result<Box<dyn ErasedWorking>, StepError>,
    ) -> Result<usize, StepError> {
        let i = if let Some(i) = self.find::<D, M>(master, err)? {
            i
        } else {
            self.entries.push(Entry {
                type_name: std::any::type_name::<M>(),
                identity: self.probe.clone(),
                working: make(master)?,
                pending: Pending::NONE,
                touched: false,
                updated: false,
                participating: false,
                last_used: self.iteration,
            });
            self.entries.len() - 1
        };
        self.entries[i].last_used = self.iteration;
        Ok(i)
    }

    pub(super) fn get_mut(&mut self, i: usize) -> &mut Entry {
        &mut self.entries[i]
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Entry> {
        self.entries.iter_mut()
    }

    /// Records that entry `i` was updated (`applied` or skipped) and returns the scale
    /// adjustments due now, in order: `Some(finite)` to close an earlier iteration that this
    /// master already had its update in, then `Some(finite)` if this update completes the
    /// current one.
    pub(super) fn updated(&mut self, i: usize, applied: bool) -> [Option<bool>; 2] {
        let mut due = [None, None];
        if self.entries[i].updated {
            due[0] = Some(self.close());
        }
        let iteration = self.iteration;
        let e = &mut self.entries[i];
        e.updated = true;
        e.participating = true;
        e.last_used = iteration;
        e.pending = Pending::NONE;
        self.found_inf |= !applied;
        // Over when every master taking part, and every master with gradients waiting for
        // their update (one whose first iteration this is), has had its update.
        if self
            .entries
            .iter()
            .all(|e| e.updated || (!e.participating && e.pending.backwards == 0))
        {
            due[1] = Some(self.close());
        }
        let now = self.iteration;
        self.entries
            .retain(|e| e.participating || e.last_used + KEEP_UNUSED >= now);
        due
    }

    /// Ends the current iteration: returns whether all its updates were applied.
    fn close(&mut self) -> bool {
        let finite = !self.found_inf;
        self.found_inf = false;
        self.iteration += 1;
        for e in &mut self.entries {
            e.participating = e.updated;
            e.updated = false;
        }
        finite
    }
}
