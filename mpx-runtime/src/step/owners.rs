//! Whose gradients a forward pass computes: the master's whose forward pass it is, or the
//! parts of it the step updates each with its own optimizer ([`parts`](super::parts)); the
//! gradients' slots shared out among them by tensor.

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::Tensor;
use dfdx::tensor_ops::Device;

use super::error::StepError;
use super::pending::{Cell, StateLeft};
use crate::walk::{Each, each};

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
    /// The addresses of the part's non-trainable tensors (batch-norm statistics).
    state: Vec<usize>,
    /// The part's type, for messages.
    name: &'static str,
}

impl Part {
    /// `part`, whose state is `cell`.
    pub(crate) fn of<D: Device<f32>, M: TensorCollection<f32, D>>(
        cell: Cell,
        part: &M,
    ) -> Result<Self, D::Err> {
        let Places { trained, state } = places::<D, M>(part)?;
        Ok(Part {
            cell,
            tensors: trained,
            state: state.into_iter().map(|(a, _)| a).collect(),
            name: std::any::type_name::<M>(),
        })
    }

    /// Records in the part's state which part it was made of, for [`check_named`] (a state the
    /// user's code holds and names at the update, [`MixedPart`](super::MixedPart)).
    pub(crate) fn record(&self) {
        self.cell.lock().part = Some((self.tensors.clone(), self.name));
    }
}

/// Checks that an update through the part state `cell` names the part it was last made of
/// ([`Part::record`]).
///
/// # Errors
/// [`StepError::OtherPart`] for another part (of the same model or another's); a device error
/// (`device_error`) reading `part`'s tensors.
pub(crate) fn check_named<D: Device<f32>, P: TensorCollection<f32, D>>(
    cell: &Cell,
    part: &P,
    device_error: impl Fn(D::Err) -> StepError,
) -> Result<(), StepError> {
    let named = places::<D, P>(part).map_err(device_error)?.trained;
    match &cell.lock().part {
        Some((tensors, state)) if *tensors != named => Err(StepError::OtherPart {
            state,
            part: std::any::type_name::<P>(),
        }),
        _ => Ok(()),
    }
}

/// Where a model's tensors lie, in visit order (one walk, nothing allocated per tensor but the
/// entry): the trained tensors' addresses, and each non-trainable tensor's (batch-norm
/// statistics) address and element count.
struct Places {
    trained: Vec<usize>,
    state: Vec<(usize, usize)>,
}

impl<D: Device<f32>> Each<f32, D> for Places {
    type Error = D::Err;
    fn tensor<S: Shape>(&mut self, trainable: bool, t: &Tensor<S, f32, D>) -> Result<(), D::Err> {
        let addr = std::ptr::from_ref(t).addr();
        if trainable {
            self.trained.push(addr);
        } else {
            self.state.push((addr, t.shape().num_elements()));
        }
        Ok(())
    }
}

/// The [`Places`] of `m`'s tensors.
fn places<D: Device<f32>, M: TensorCollection<f32, D>>(m: &M) -> Result<Places, D::Err> {
    let mut places = Places {
        trained: Vec::new(),
        state: Vec::new(),
    };
    each(m, &mut places, std::convert::identity)?;
    Ok(places)
}

impl Owners {
    /// Hands the non-trainable values a forward pass of `master` changed (`changed`, widened, in
    /// its visit order) to their owners, for their applied updates, with the values the pass
    /// started from (`from`, the master's as the copy was built): all of them to a whole master;
    /// to each part the values of its own tensors, in its visit order.
    ///
    /// # Errors
    /// [`StepError::PartsState`] when a changed tensor is in no part the step updates (a frozen
    /// part run in training mode: its statistics would reach no master);
    /// [`StepError::MasterChanged`] when `changed` does not line up with the master's tensors;
    /// a device error (`device_error`) reading them.
    pub(crate) fn share_state<D: Device<f32>, M: TensorCollection<f32, D>>(
        &self,
        master: &M,
        (changed, from): (Vec<f32>, &[f32]),
        device_error: impl Fn(D::Err) -> StepError,
    ) -> Result<(), StepError> {
        let model = std::any::type_name::<M>();
        if changed.len() != from.len() {
            return Err(StepError::MasterChanged { model });
        }
        let parts = match self {
            Owners::Whole(cell) => {
                let mut p = cell.lock();
                p.state = Some(StateLeft {
                    values: changed,
                    from: from.to_vec(),
                });
                return Ok(());
            }
            Owners::Parts(parts) => parts,
        };
        let mut shares: Vec<(Vec<f32>, Vec<f32>)> =
            parts.iter().map(|_| Default::default()).collect();
        let mut offset = 0;
        for (addr, n) in places::<D, M>(master).map_err(device_error)?.state {
            let range = offset..offset + n;
            let values = changed
                .get(range.clone())
                .ok_or(StepError::MasterChanged { model })?;
            offset += n;
            let i = parts
                .iter()
                .position(|p| p.state.contains(&addr))
                .ok_or(StepError::PartsState { model })?;
            shares[i].0.extend_from_slice(values);
            shares[i].1.extend_from_slice(&from[range]);
        }
        if offset != changed.len() {
            return Err(StepError::MasterChanged { model });
        }
        for (part, (values, from)) in parts.iter().zip(shares) {
            if !values.is_empty() {
                let mut p = part.cell.lock();
                p.state = Some(StateLeft { values, from });
            }
        }
        Ok(())
    }

    /// What the owners' earlier forward passes left in `master`'s non-trainable tensors that no
    /// update has written into it yet (see [`share_state`](Self::share_state)), where the master
    /// still holds what those passes started from (`base`: its values now, widened, in visit
    /// order; a checkpoint written into it in place in between wins): one entry per
    /// non-trainable tensor, in visit order, the values to start from or `None` (the master's);
    /// `None` when no owner has any waiting.
    ///
    /// # Errors
    /// [`StepError::MasterChanged`] when what is waiting does not line up with the master's
    /// tensors; a device error (`device_error`) reading them.
    pub(crate) fn pending_state<D: Device<f32>, M: TensorCollection<f32, D>>(
        &self,
        master: &M,
        base: &[f32],
        device_error: impl Fn(D::Err) -> StepError,
    ) -> Result<Option<Vec<Option<Vec<f32>>>>, StepError> {
        if self.cells().all(|c| c.lock().state.is_none()) {
            return Ok(None);
        }
        let model = std::any::type_name::<M>();
        let changed = || StepError::MasterChanged { model };
        // each owner's waiting values (and what they started from), and how many are taken
        let waiting: Vec<Option<StateLeft>> =
            self.cells().map(|c| c.lock().state.clone()).collect();
        let mut taken = vec![0; waiting.len()];
        let mut out = Vec::new();
        let mut offset = 0;
        for (addr, n) in places::<D, M>(master).map_err(&device_error)?.state {
            let now = base.get(offset..offset + n).ok_or_else(changed)?;
            offset += n;
            // the whole master's owner holds every tensor; a part, its own
            let owner = match self {
                Owners::Whole(_) => Some(0),
                Owners::Parts(parts) => parts.iter().position(|p| p.state.contains(&addr)),
            };
            let Some((i, StateLeft { values, from })) =
                owner.and_then(|i| waiting[i].as_ref().map(|w| (i, w)))
            else {
                out.push(None);
                continue;
            };
            let range = taken[i]..taken[i] + n;
            taken[i] += n;
            let (values, from) = (
                values.get(range.clone()).ok_or_else(changed)?,
                from.get(range).ok_or_else(changed)?,
            );
            let unchanged = from
                .iter()
                .zip(now)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            out.push(unchanged.then(|| values.to_vec()));
        }
        if offset != base.len()
            || waiting
                .iter()
                .zip(&taken)
                .any(|(w, &t)| w.as_ref().is_some_and(|w| w.values.len() != t))
        {
            return Err(changed());
        }
        Ok(Some(out))
    }

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
