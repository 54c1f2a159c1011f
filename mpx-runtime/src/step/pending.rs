//! The state of one master model between its backward passes and its update: what the last
//! backward pass that reached it saw of its gradients, and what its forward passes changed that
//! is not a gradient (batch-norm statistics).
//!
//! It is a typed value that the user's code names: the [`Mixed`](super::Mixed) handle of the
//! runtime API holds one, and a `#[mixed_step]` holds one per master in a local of the step
//! ([`Masters`]). Nothing finds it by the master's identity across steps, so a clone of a master,
//! a model built at the address of a dropped one, or a new `Gradients` can never pick up another
//! model's verdict.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::shapes::Shape;
use dfdx::tensor::Tensor;
use dfdx::tensor_ops::Device;

use crate::precision::DType;
use crate::walk::{Each, each};

/// How a master's forward passes ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ran {
    /// The precision of the working copy (`Float32` for a master run on itself).
    pub(crate) precision: DType,
    /// Whether the working copy was made of mpx's layers.
    pub(crate) mapped: bool,
}

/// What the last backward pass that reached a master saw, for its next update.
#[derive(Debug, Clone, Default)]
pub(crate) struct Pending {
    /// Set by the first forward pass.
    pub(crate) ran: Option<Ran>,
    /// Backward passes that reached the master since its last update.
    pub(crate) backwards: u64,
    /// Whether the master's gradients were all finite after the last of them (a non-finite value
    /// stays non-finite under the sums that accumulate gradients, so the last check covers every
    /// backward pass whose gradients these are).
    pub(crate) grads_finite: bool,
    /// Whether the last loss was finite.
    pub(crate) loss_finite: bool,
    pub(crate) loss: f32,
    /// The loss scale that backward pass applied.
    pub(crate) scale: f32,
    /// The non-trainable tensors (batch-norm statistics) as the last forward pass of the working
    /// copy left them, widened to f32, in the master's visit order; `None` when it changed none.
    pub(crate) state: Option<Vec<f32>>,
}

impl Pending {
    /// Forgets what the backward passes saw (after an update).
    pub(crate) fn consumed(&mut self) {
        let ran = self.ran;
        *self = Pending {
            ran,
            ..Pending::default()
        };
    }
}

/// The shared cell of one master's [`Pending`]: the handle, and each forward pass of the master
/// until its backward pass has run, hold it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Cell(Arc<Mutex<Pending>>);

impl Cell {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Pending> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `self` and `other` are the same master's.
    pub(crate) fn same(&self, other: &Cell) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    pub(crate) fn downgrade(&self) -> std::sync::Weak<Mutex<Pending>> {
        Arc::downgrade(&self.0)
    }
}

/// Whose gradients a forward pass computes: the master's whose forward pass it is, or, for a
/// forward pass of a model the step updates part by part (an optimizer for its encoder, another
/// for its head), each part's.
#[derive(Debug, Clone)]
pub(crate) enum Owners {
    /// The master the forward pass runs (its cell).
    Whole(Cell),
    /// The parts of the model the forward pass runs that the step updates.
    Parts(Vec<Part>),
}

/// A part of a model (a field, or a field of one) that the step updates on its own: its cell and
/// the addresses of its trainable tensors.
///
/// Not a public API: `#[mixed_step]` makes it ([`Masters::part`]).
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct Part {
    cell: Cell,
    tensors: Vec<usize>,
}

impl Owners {
    /// Each owner's cell.
    pub(crate) fn cells(&self) -> impl Iterator<Item = &Cell> {
        let (whole, parts) = match self {
            Owners::Whole(cell) => (Some(cell), &[][..]),
            Owners::Parts(parts) => (None, &parts[..]),
        };
        whole.into_iter().chain(parts.iter().map(|p| &p.cell))
    }

    /// Hands each owner its share of `items` (each with the address of the master tensor it
    /// stands for): all of them to a whole master; to each part those of its tensors (a tensor of
    /// the model in no part the step updates goes to none).
    pub(crate) fn share<T>(
        &self,
        items: Vec<T>,
        addr: impl Fn(&T) -> usize,
        mut to: impl FnMut(&Cell, Vec<T>),
    ) {
        match self {
            Owners::Whole(cell) => to(cell, items),
            Owners::Parts(parts) => {
                let mut shares: Vec<Vec<T>> = parts.iter().map(|_| Vec::new()).collect();
                for item in items {
                    let a = addr(&item);
                    if let Some(i) = parts.iter().position(|p| p.tensors.contains(&a)) {
                        shares[i].push(item);
                    }
                }
                for (part, share) in parts.iter().zip(shares) {
                    to(&part.cell, share);
                }
            }
        }
    }
}

/// The masters of one call of a `#[mixed_step]` function, each with its [`Pending`] cell: the
/// per-master state that code generated by the macro names. It lives in a local of the step, so
/// it lasts exactly as long as the step's borrows of its models: within it, a master is the
/// model at its address (two live models cannot share one), and a clone is another master.
///
/// Not a public API: `#[mixed_step]` declares it.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct Masters {
    cells: Mutex<Vec<(usize, &'static str, Cell)>>,
}

impl Masters {
    /// The masters of a new call.
    pub fn new() -> Self {
        Self::default()
    }

    /// `master`'s cell, made on first use (a model is told apart from its first field, at the
    /// same address, by its type).
    pub(crate) fn cell<M>(&self, master: &M) -> Cell {
        let key = (
            std::ptr::from_ref(master).addr(),
            std::any::type_name::<M>(),
        );
        let mut cells = self.cells.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, _, c)) = cells.iter().find(|(a, t, _)| (*a, *t) == key) {
            return c.clone();
        }
        let cell = Cell::default();
        cells.push((key.0, key.1, cell.clone()));
        cell
    }

    /// `part` (a part of the model a forward pass runs, updated on its own): its cell, and the
    /// addresses of its trainable tensors.
    pub(crate) fn part<D: Device<f32>, M: TensorCollection<f32, D>>(
        &self,
        part: &M,
    ) -> Result<Part, D::Err> {
        struct Addrs(Vec<usize>);
        impl<D: Device<f32>> Each<f32, D> for Addrs {
            type Error = D::Err;
            fn tensor<S: Shape>(
                &mut self,
                trainable: bool,
                t: &Tensor<S, f32, D>,
            ) -> Result<(), D::Err> {
                if trainable {
                    self.0.push(std::ptr::from_ref(t).addr());
                }
                Ok(())
            }
        }
        let mut addrs = Addrs(Vec::new());
        each(part, &mut addrs, std::convert::identity)?;
        Ok(Part {
            cell: self.cell(part),
            tensors: addrs.0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_live_models_are_two_masters_and_one_model_is_one() {
        struct Outer([f32; 4]);
        let masters = Masters::new();
        let (a, b) = ([1.0f32; 4], [1.0f32; 4]);
        let ca = masters.cell(&a);
        assert!(ca.same(&masters.cell(&a)));
        assert!(!ca.same(&masters.cell(&b)));
        // a model and its first field share an address, not a type
        let outer = Outer([0.0; 4]);
        assert!(!masters.cell(&outer).same(&masters.cell(&outer.0)));
    }

    #[test]
    fn a_forward_pass_s_gradients_are_shared_out_among_the_parts_by_tensor() {
        let masters = Masters::new();
        let dev = dfdx::tensor::Cpu::default();
        let (trunk, head): (Tensor<dfdx::shapes::Rank1<3>, f32, _>, Tensor<_, f32, _>) = (
            dfdx::tensor::ZerosTensor::zeros(&dev),
            dfdx::tensor::ZerosTensor::zeros(&dev),
        );
        let parts = [masters.part(&trunk).unwrap(), masters.part(&head).unwrap()];
        let owners = Owners::Parts(parts.to_vec());
        let mut got = Vec::new();
        // (the address of the master tensor an item stands for, the item)
        let addr = |t: &Tensor<dfdx::shapes::Rank1<3>, f32, _>| std::ptr::from_ref(t).addr();
        let items = vec![(addr(&head), 'h'), (1, 'x'), (addr(&trunk), 't')];
        owners.share(
            items,
            |i| i.0,
            |cell, share| {
                got.push((
                    cell.clone(),
                    share.into_iter().map(|i| i.1).collect::<String>(),
                ));
            },
        );
        // each part its own tensors', in order; an item of no part goes to none
        assert_eq!(got.len(), 2);
        assert!(got[0].0.same(&parts[0].cell) && got[0].1 == "t");
        assert!(got[1].0.same(&parts[1].cell) && got[1].1 == "h");
        assert!(parts[0].cell.same(&masters.cell(&trunk)));
        // a whole master takes every item
        let whole = Owners::Whole(masters.cell(&trunk));
        let mut n = 0;
        whole.share(vec![1, 2, 3], |_| 0, |_, share| n += share.len());
        assert_eq!(
            (n, whole.cells().count(), owners.cells().count()),
            (3, 1, 2)
        );
    }

    #[test]
    fn an_update_forgets_the_backward_passes_but_not_how_the_model_ran() {
        let cell = Cell::default();
        {
            let mut p = cell.lock();
            p.ran = Some(Ran {
                precision: DType::Float16,
                mapped: true,
            });
            p.backwards = 2;
            p.state = Some(vec![1.0]);
        }
        assert_eq!(cell.lock().backwards, 2);
        cell.lock().consumed();
        assert_eq!(cell.lock().backwards, 0);
        let p = cell.lock();
        assert!(p.state.is_none() && p.ran.is_some_and(|r| r.mapped));
    }
}
