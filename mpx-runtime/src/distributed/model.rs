//! Whole-model collectives: start every rank from the same master, check that they still agree.

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::tensor::Cpu;
use mpi::traits::{Communicator, Root};

use super::{DistributedError, Reducer, hash_words};
use crate::cast::{module_visit_floats, module_visit_floats_mut};
use crate::precision::{FloatSlice, FloatSliceMut};

/// A model's tensors (trainable or not, in visit order), flat, and their lengths.
fn pack<M: TensorCollection<f32, Cpu>>(model: &M) -> (Vec<f32>, Vec<u64>) {
    let (mut flat, mut lens) = (Vec::new(), Vec::new());
    module_visit_floats::<f32, M>(model, &mut |v| {
        if let FloatSlice::F32(v) = v {
            flat.extend_from_slice(v);
            lens.push(v.len() as u64);
        }
        true
    });
    (flat, lens)
}

/// Writes `flat` (as [`pack`] read it) back into the model's tensors, in visit order.
fn unpack<M: TensorCollection<f32, Cpu>>(model: &mut M, flat: &[f32]) {
    let mut at = 0;
    module_visit_floats_mut::<f32, M>(model, &mut |s| {
        if let FloatSliceMut::F32(v) = s {
            v.copy_from_slice(&flat[at..at + v.len()]);
            at += v.len();
        }
    });
}

impl Reducer {
    /// Overwrites every tensor of `model` (parameters and non-trainable state) with rank
    /// `root`'s, as DDP does when it wraps a model: every rank starts from the same master.
    /// Also how a checkpoint read on one rank reaches the others. Collective.
    ///
    /// # Errors
    /// [`DistributedError::LayoutMismatch`] on every rank when the models' layouts differ
    /// (nothing is changed); [`DistributedError::NoSuchRank`] for a root outside the
    /// communicator.
    ///
    /// # Examples
    /// ```no_run
    /// use dfdx::prelude::*;
    /// use mpx_runtime::distributed::{Reducer, mpi};
    /// let universe = mpi::initialize().unwrap();
    /// let mut reducer = Reducer::new(&universe.world());
    /// let dev: Cpu = Default::default();
    /// let mut model = dev.build_module::<Linear<3, 2>, f32>(); // a different draw on each rank
    /// reducer.broadcast_model(&mut model, 0)?;
    /// assert!(reducer.models_agree(&model)?);
    /// # Ok::<(), mpx_runtime::distributed::DistributedError>(())
    /// ```
    pub fn broadcast_model<M: TensorCollection<f32, Cpu>>(
        &mut self,
        model: &mut M,
        root: usize,
    ) -> Result<(), DistributedError> {
        if root >= self.size {
            return Err(DistributedError::NoSuchRank {
                root,
                size: self.size,
            });
        }
        let (mut flat, lens) = pack(model);
        let layout = hash_words(std::iter::once(lens.len() as u64).chain(lens.iter().copied()));
        if !self.agree(layout, 0, true)?.0 {
            return Err(DistributedError::LayoutMismatch {
                rank: self.rank,
                tensors: lens.len(),
                elements: flat.len(),
            });
        }
        self.comm
            .get()?
            .process_at_rank(root as i32)
            .broadcast_into(&mut flat[..]);
        unpack(model, &flat);
        Ok(())
    }

    /// Whether every tensor of `model` has the same bits on every rank (a hash of them,
    /// compared). Collective.
    ///
    /// # Errors
    /// [`DistributedError::WrongThread`] from a thread MPI's threading level does not allow.
    ///
    /// # Examples
    /// See [`broadcast_model`](Self::broadcast_model).
    pub fn models_agree<M: TensorCollection<f32, Cpu>>(
        &mut self,
        model: &M,
    ) -> Result<bool, DistributedError> {
        let (flat, lens) = pack(model);
        let h = hash_words(
            lens.iter()
                .copied()
                .chain(flat.iter().map(|v| u64::from(v.to_bits()))),
        );
        self.values_agree(&[h])
    }
}
