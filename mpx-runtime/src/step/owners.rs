//! Whose gradients a forward pass computes: the master's whose forward pass it is, or the
//! parts of it the step updates each with its own optimizer ([`parts`](super::parts)); the
//! gradients' slots shared out among them by tensor.

use dfdx::nn::tensor_collection::TensorCollection;

use super::error::StepError;
use super::pending::Cell;
use crate::master::slots::{SlotDevice, trainable_slots};

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
/// [`MixedPart::of`](super::MixedPart::of) for [`GradScaler::forward_parts`](super::GradScaler::forward_parts) (and by `#[mixed_step]` for a step that
/// updates parts).
///
/// # Examples
/// See [`GradScaler::forward_parts`](super::GradScaler::forward_parts).
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
        let (tensors, name) = (addresses::<D, M>(part)?, std::any::type_name::<M>());
        cell.lock().part = Some((tensors.clone(), name));
        Ok(Part {
            cell,
            tensors,
            name,
        })
    }
}

/// The addresses of `part`'s trained tensors, in visit order.
pub(crate) fn addresses<D: SlotDevice<f32>, M: TensorCollection<f32, D>>(
    part: &M,
) -> Result<Vec<usize>, D::Err> {
    Ok(trainable_slots::<D, M>(part)?
        .iter()
        .map(|s| s.addr)
        .collect())
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

    /// Checks that every tensor of every part is one of the model's trainable tensors (`items`,
    /// each with the address of the tensor it stands for), and in one part only: a part of
    /// another model would be judged on nothing, and a tensor shared out to one part of two
    /// would go unjudged for the other's update.
    pub(crate) fn check_parts_of<M, T>(
        &self,
        items: &[T],
        addr: impl Fn(&T) -> usize,
    ) -> Result<(), StepError> {
        let Owners::Parts(parts) = self else {
            return Ok(());
        };
        for (i, p) in parts.iter().enumerate() {
            if let Some(other) = parts[..i]
                .iter()
                .find(|o| o.tensors.iter().any(|t| p.tensors.contains(t)))
            {
                return Err(StepError::PartsOverlap {
                    part: p.name,
                    other: other.name,
                });
            }
        }
        match parts.iter().find(|p| {
            p.tensors
                .iter()
                .any(|&t| !items.iter().any(|i| addr(i) == t))
        }) {
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
        let parts = [
            Part::of(masters.cell(&trunk), &trunk).unwrap(),
            Part::of(masters.cell(&head), &head).unwrap(),
        ];
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
