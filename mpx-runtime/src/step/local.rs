//! Workspaces that stay on their thread: a master on dfdx's `Cuda` device has a working copy of
//! `Cuda` tensors, and dfdx's `Cuda` device is neither `Send` nor `Sync`. Such a workspace lives
//! in a table of the thread that ran the master's first forward pass; the scaler holds a
//! [`Local`] handle to it, which is `Send + Sync`, so a scaler stays `Send + Sync` whatever it
//! serves. A backward pass on another thread has not reached it (the master's tensors cannot
//! leave their thread); a forward pass or an update of it from another thread is a
//! [`StepError::WorkspaceMismatch`].
//! A handle dropped on its own thread frees its workspace; one dropped on another thread leaves
//! it to the end of the thread that holds it.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::error::StepError;
#[cfg(feature = "mpi")]
use super::layout::MasterSlot;
use super::workspace::{AnyFn, StateFn, Workspace};

type Shared = Rc<RefCell<Box<dyn Workspace>>>;

thread_local! {
    /// This thread's workspaces, by handle id.
    static TABLE: RefCell<HashMap<u64, Shared>> = RefCell::new(HashMap::new());
}

/// Ids of handles, never reused.
static NEXT: AtomicU64 = AtomicU64::new(0);

/// The scaler's handle to a workspace kept on its thread.
pub(crate) struct Local {
    id: u64,
    in_f32: bool,
    mapped: bool,
}

impl Local {
    /// Puts `w` into this thread's table.
    pub(crate) fn new<W: Workspace>(w: W) -> Self {
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let (in_f32, mapped) = (w.in_f32(), w.mapped());
        let shared: Shared = Rc::new(RefCell::new(Box::new(w)));
        TABLE.with(|t| t.borrow_mut().insert(id, shared));
        Self { id, in_f32, mapped }
    }

    /// The workspace, when this is its thread.
    fn get(&self) -> Result<Shared, StepError> {
        TABLE
            .with(|t| t.borrow().get(&self.id).cloned())
            .ok_or_else(|| StepError::WorkspaceMismatch {
                expected: "the thread that ran this master's first forward pass (a `Cuda` \
                           workspace stays on its thread, as dfdx's `Cuda` tensors do)"
                    .into(),
                found: format!("{:?}", std::thread::current().id()),
            })
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        // Taken out of the table first, so that the workspace drops with the table released.
        let taken = TABLE
            .try_with(|t| t.borrow_mut().remove(&self.id))
            .ok()
            .flatten();
        drop(taken);
    }
}

impl Workspace for Local {
    fn transfer(&mut self, grads: &mut dyn Any) -> Result<Option<bool>, StepError> {
        // A backward pass on another thread cannot have reached this workspace (its tensors
        // cannot leave this one).
        match self.get() {
            Ok(w) => w.borrow_mut().transfer(grads),
            Err(_) => Ok(None),
        }
    }

    fn check(&self, grads: &mut dyn Any) -> Result<bool, StepError> {
        match self.get() {
            Ok(w) => w.borrow().check(grads),
            Err(_) => Ok(true),
        }
    }

    fn with_state(&self, f: &mut StateFn<'_>) -> Result<(), StepError> {
        self.get()?.borrow().with_state(f)
    }

    fn mark_used(&mut self) -> bool {
        self.get().is_ok_and(|w| w.borrow_mut().mark_used())
    }

    fn in_f32(&self) -> bool {
        self.in_f32
    }

    fn mapped(&self) -> bool {
        self.mapped
    }

    fn with_any(&mut self, f: &mut AnyFn<'_>) -> Result<(), StepError> {
        self.get()?.borrow_mut().with_any(f)
    }

    #[cfg(feature = "mpi")]
    fn master_slots(&self) -> &[MasterSlot] {
        &[]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precision::f16;
    use crate::step::device::FullWorking;
    use dfdx::prelude::*;

    fn table_len() -> usize {
        TABLE.with(|t| t.borrow().len())
    }

    /// A workspace held through a handle: found on its thread, reached by no backward pass of
    /// another thread, an error for a forward pass there, and freed when the handle drops.
    #[test]
    fn a_local_workspace_stays_on_its_thread_and_is_freed_with_its_handle() {
        let dev = Cpu::default();
        let model = dev.build_module::<Linear<2, 2>, f32>();
        let before = table_len();
        let mut held = Local::new(FullWorking::<f16, Cpu>::new(&model).unwrap());
        assert_eq!(table_len(), before + 1);
        assert!(held.in_f32() && !held.mapped());
        // on its thread: the workspace itself (marked used, its gradients checked)
        assert!(held.mark_used());
        let mut grads: Gradients<f32, Cpu> = model.alloc_grads();
        assert_eq!(held.transfer(&mut grads).unwrap(), Some(true));
        let mut seen = false;
        held.with_any(&mut |any| {
            seen = any.is::<FullWorking<f16, Cpu>>();
            Ok(())
        })
        .unwrap();
        assert!(seen);
        // on another thread: not reached by its backward passes, and no forward pass there
        let held = std::thread::spawn(move || {
            let mut held = held;
            let mut grads: Gradients<f32, Cpu> = Gradients::leaky();
            assert_eq!(held.transfer(&mut grads).unwrap(), None);
            assert!(held.check(&mut grads).unwrap());
            let e = held.with_any(&mut |_| Ok(())).unwrap_err();
            assert!(matches!(e, StepError::WorkspaceMismatch { .. }), "{e}");
            held
        })
        .join()
        .unwrap();
        // back home it is still there, and dropping the handle frees it
        let mut state_len = None;
        held.with_state(&mut |s| {
            state_len = Some(s.len());
            Ok(())
        })
        .unwrap();
        assert_eq!(state_len, Some(0));
        drop(held);
        assert_eq!(table_len(), before);
    }
}
