//! Whole-model collectives: start every rank from the same master, check that they still agree.

use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorMut, ViewTensorRef,
};
use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, Tensor};
use mpi::traits::{Communicator, Root};

use super::{DistributedError, Reducer, hash_words};

/// Appends every tensor of a model (trainable or not, in visit order) to `flat`, and its
/// length to `lens`.
struct Pack<'a> {
    flat: &'a mut Vec<f32>,
    lens: &'a mut Vec<u64>,
}

impl TensorVisitor<f32, Cpu> for Pack<'_> {
    type Viewer = ViewTensorRef;
    type Err = CpuError;
    type E2 = f32;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        _: TensorOptions<S, f32, Cpu>,
        t: &Tensor<S, f32, Cpu>,
    ) -> Result<Option<Tensor<S, f32, Cpu>>, CpuError> {
        let n = t.shape().num_elements();
        let at = self.flat.len();
        self.flat.resize(at + n, 0.0);
        t.copy_into(&mut self.flat[at..]);
        self.lens.push(n as u64);
        Ok(None)
    }
}

/// Writes `flat` back into the model's tensors, in visit order.
struct Unpack<'a> {
    flat: &'a [f32],
    at: usize,
}

impl TensorVisitor<f32, Cpu> for Unpack<'_> {
    type Viewer = ViewTensorMut;
    type Err = CpuError;
    type E2 = f32;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        _: TensorOptions<S, f32, Cpu>,
        t: &mut Tensor<S, f32, Cpu>,
    ) -> Result<Option<Tensor<S, f32, Cpu>>, CpuError> {
        let n = t.shape().num_elements();
        t.copy_from(&self.flat[self.at..self.at + n]);
        self.at += n;
        Ok(None)
    }
}

/// A model's tensors, flat, and their lengths.
fn pack<M: TensorCollection<f32, Cpu>>(model: &M) -> Result<(Vec<f32>, Vec<u64>), CpuError> {
    let (mut flat, mut lens) = (Vec::new(), Vec::new());
    M::iter_tensors(&mut RecursiveWalker {
        m: model,
        f: &mut Pack {
            flat: &mut flat,
            lens: &mut lens,
        },
    })?;
    Ok((flat, lens))
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
        let (mut flat, lens) = pack(model)?;
        let layout = hash_words(std::iter::once(lens.len() as u64).chain(lens.iter().copied()));
        if !self.agree(layout, 0, true).0 {
            return Err(DistributedError::LayoutMismatch {
                rank: self.rank,
                tensors: lens.len(),
                elements: flat.len(),
            });
        }
        self.comm
            .process_at_rank(root as i32)
            .broadcast_into(&mut flat[..]);
        M::iter_tensors(&mut RecursiveWalker {
            m: model,
            f: &mut Unpack { flat: &flat, at: 0 },
        })?;
        Ok(())
    }

    /// Whether every tensor of `model` has the same bits on every rank (a hash of them,
    /// compared). Collective.
    ///
    /// # Errors
    /// A device error when a tensor cannot be read.
    ///
    /// # Examples
    /// See [`broadcast_model`](Self::broadcast_model).
    pub fn models_agree<M: TensorCollection<f32, Cpu>>(
        &mut self,
        model: &M,
    ) -> Result<bool, DistributedError> {
        let (flat, lens) = pack(model)?;
        let h = hash_words(
            lens.iter()
                .copied()
                .chain(flat.iter().map(|v| u64::from(v.to_bits()))),
        );
        Ok(self.values_agree(&[h]))
    }
}
