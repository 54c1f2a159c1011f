//! A model whose parts are updated each by its own optimizer (a trunk on Adam and a head on
//! SGD, or a frozen trunk and a trained head): one forward pass of the whole model, on its
//! working copy, whose gradients are shared out among the parts by tensor, each part's judged
//! for its own update, as PyTorch's `GradScaler` checks each optimizer's own parameters.
//!
//! By hand: a [`MixedPart`] per part, [`GradScaler::forward_parts`] and
//! [`GradScaler::update_part`]; `#[mixed_step]` does the same for a step that updates parts of
//! a model whose forward pass it runs whole.

use std::panic::Location;

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::optim::Optimizer;
use dfdx::tensor::Gradients;

use super::device::MixedDevice;
use super::error::StepError;
use super::half_region::{HalfInput, HalfOutput};
use super::iteration::Site;
use super::outcome::UpdateOutcome;
use super::pending::Cell;
use super::scaler::GradScaler;
use super::working::Kind;
use crate::boundary::MasterModel;
use crate::master::slots::{SlotDevice, trainable_slots};
use crate::precision::Precision;
use crate::scaling::LossScale;

/// The state a mixed step keeps for one part of a model that its own optimizer updates: what
/// the last backward pass saw of the part's gradients, for the part's next update. The by-hand
/// counterpart of [`Mixed`](super::Mixed) for a part (a field of a model cannot be wrapped in
/// a handle of its own).
///
/// # Examples
/// See [`GradScaler::forward_parts`].
#[derive(Debug, Default)]
pub struct MixedPart {
    cell: Cell,
}

impl MixedPart {
    /// A part no forward pass has reached yet.
    ///
    /// # Examples
    /// See [`GradScaler::forward_parts`].
    pub fn new() -> Self {
        Self::default()
    }

    /// This part's place in a forward pass of the whole model: `part` is the part of the model
    /// (a field) this state is for.
    ///
    /// # Errors
    /// A device error (reading the part's tensors).
    ///
    /// # Examples
    /// See [`GradScaler::forward_parts`].
    pub fn of<D: SlotDevice<f32>, P: TensorCollection<f32, D>>(
        &self,
        part: &P,
    ) -> Result<Part, D::Err> {
        Part::of(self.cell.clone(), part)
    }
}

impl<H: Precision, L: LossScale, D: MixedDevice<H>> GradScaler<H, L, D> {
    /// A forward pass of `model` on its working copy of kind `kind` ([`Plain`](super::Plain) or
    /// [`Mapped`](super::Mapped)), as [`forward`](Self::forward), for a model whose `parts`
    /// (each made by [`MixedPart::of`]) are updated each by its own optimizer
    /// ([`update_part`](Self::update_part)). The backward pass judges each part's gradients for
    /// its own update; a tensor in no part (a frozen trunk's) is not judged.
    ///
    /// # Errors
    /// As [`forward`](Self::forward); [`StepError::PartsState`] when the pass changed the model's
    /// batch-norm statistics (they belong to no part).
    ///
    /// # Examples
    /// ```
    /// use dfdx::{optim::*, prelude::*};
    /// use mpx_runtime::{precision::f16, step::{GradScaler, Mapped, MixedPart}};
    /// let dev: Cpu = Default::default();
    /// let mut model = dev.build_module::<((Linear<4, 8>, Tanh), Linear<8, 2>), f32>();
    /// let (trunk, head) = (MixedPart::new(), MixedPart::new());
    /// let mut trunk_opt = Adam::new(&model.0, Default::default());
    /// let mut head_opt = Sgd::new(&model.1, Default::default());
    /// let mut scaler = GradScaler::<f16>::default();
    /// let x: Tensor<Rank2<3, 4>, f32, _> = dev.sample_normal();
    /// let parts = vec![trunk.of(&model.0)?, head.of(&model.1)?];
    /// let y = scaler.forward_parts(&model, Mapped, parts, x.trace(model.alloc_grads()), |m, x| m.forward(x))?;
    /// let grads = scaler.backward(y.square().mean())?;
    /// assert!(scaler.update_part(&trunk, &mut model.0, &mut trunk_opt, &grads)?.is_applied());
    /// assert!(scaler.update_part(&head, &mut model.1, &mut head_opt, &grads)?.is_applied());
    /// # Ok::<(), mpx_runtime::step::StepError>(())
    /// ```
    pub fn forward_parts<M, K, X, Y, F>(
        &mut self,
        model: &M,
        kind: K,
        parts: Vec<Part>,
        input: X,
        f: F,
    ) -> Result<Y::Full, StepError>
    where
        M: MasterModel<D>,
        K: Kind<H, M, D> + Copy,
        X: HalfInput<H, D>,
        Y: HalfOutput<H, D>,
        F: FnOnce(&mut K::Copy, X::Half) -> Y,
    {
        let _ = kind;
        self.run::<M, K, X, Y, F>(model, &Owners::Parts(parts), input, f)
    }

    /// Updates `part` (the part of the model whose state is `state`) with `optimizer`, as
    /// [`update`](Self::update) a whole master: only when the part's gradients of the last
    /// backward pass were all finite and the loss was finite.
    ///
    /// # Errors
    /// As [`update`](Self::update).
    ///
    /// # Examples
    /// See [`forward_parts`](Self::forward_parts).
    #[track_caller]
    pub fn update_part<P, O>(
        &mut self,
        state: &MixedPart,
        part: &mut P,
        optimizer: &mut O,
        grads: &Gradients<f32, D>,
    ) -> Result<UpdateOutcome, StepError>
    where
        P: MasterModel<D>,
        O: Optimizer<P, D, f32>,
    {
        let site = Site::Call(Location::caller());
        self.update_of(&state.cell, part, site, |p| optimizer.update(p, grads))
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

/// A part of a model (a field, or a field of one) that its own optimizer updates, as a forward
/// pass of the whole model sees it: the part's state and which tensors are the part's. Made by
/// [`MixedPart::of`] for [`GradScaler::forward_parts`] (and by `#[mixed_step]` for a step that
/// updates parts).
///
/// # Examples
/// See [`GradScaler::forward_parts`].
#[derive(Debug, Clone)]
pub struct Part {
    cell: Cell,
    tensors: Vec<usize>,
    /// The part's type, for messages.
    name: &'static str,
}

impl Part {
    /// `part`, whose state is `cell`.
    pub(crate) fn of<D: SlotDevice<f32>, M: TensorCollection<f32, D>>(
        cell: Cell,
        part: &M,
    ) -> Result<Self, D::Err> {
        Ok(Part {
            cell,
            tensors: trainable_slots::<D, M>(part)?
                .iter()
                .map(|s| s.addr)
                .collect(),
            name: std::any::type_name::<M>(),
        })
    }
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

    /// Checks that every tensor of every part is one of the model's trainable tensors
    /// (`tensors`, their addresses): a part of another model would be judged on nothing.
    pub(crate) fn check_parts_of<M>(&self, tensors: &[usize]) -> Result<(), StepError> {
        let Owners::Parts(parts) = self else {
            return Ok(());
        };
        match parts
            .iter()
            .find(|p| p.tensors.iter().any(|t| !tensors.contains(t)))
        {
            Some(p) => Err(StepError::NotAPart {
                part: p.name,
                model: std::any::type_name::<M>(),
            }),
            None => Ok(()),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step::pending::Masters;
    use dfdx::tensor::Tensor;

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
}
