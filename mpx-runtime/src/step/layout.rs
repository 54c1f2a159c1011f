//! What the scaler knows of a master model without its type: one gradient slot per trainable
//! tensor, the element counts of its other tensors, and its identity (tensor ids and buffers).

use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorMut, ViewTensorRef,
};
use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, Gradients, Tensor, TensorFromVec};
use dfdx::tensor_ops::Device;

use super::error::StepError;
use crate::boundary::MasterModel;
use crate::precision::Precision;

/// The working copy of master model `M` in precision `H`: the same module with its float tensors
/// stored as `H::Elem` (`f16`, `AMP<f16>`, or `f32` for emulated bf16).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::step::WorkingCopy;
/// type Master = dfdx::nn::modules::Linear<2, 3, f32, Cpu>;
/// let dev = Cpu::default();
/// let half: WorkingCopy<f16, Master> = dev.build_module::<Linear<2, 3>, f16>();
/// assert_eq!(half.weight.shape(), &(Const::<3>, Const::<2>));
/// ```
pub type WorkingCopy<H, M> =
    <M as TensorCollection<f32, Cpu>>::To<<H as crate::precision::Precision>::Elem, Cpu>;

/// Hands out one master gradient buffer; built once per trainable master tensor (it holds a
/// data-free "ghost" of the tensor, keyed by the tensor's id; dfdx does not let the ghost's type
/// be named). `Send + Sync`, so the state that holds it can be.
pub(super) type GradSlot = Box<
    dyn for<'a> Fn(&'a mut Gradients<f32, Cpu>) -> Result<&'a mut [f32], CpuError> + Send + Sync,
>;

/// A gradient buffer of the f32 master, with its element count.
pub(crate) struct MasterSlot {
    pub(crate) len: usize,
    pub(crate) get: GradSlot,
}

/// Constrains a closure to the higher-ranked signature of [`GradSlot`].
fn slot<F>(f: F) -> F
where
    F: for<'a> Fn(&'a mut Gradients<f32, Cpu>) -> Result<&'a mut [f32], CpuError>,
{
    f
}

/// The master's layout: a gradient slot per trainable tensor, in visit order, and the element
/// count of each non-parameter tensor (batch-norm statistics).
pub(super) struct Layout {
    pub(super) slots: Vec<MasterSlot>,
    pub(super) state_lens: Vec<usize>,
}

/// Walks `master` once and records its [`Layout`].
pub(super) fn master_layout<M: MasterModel>(master: &M) -> Result<Layout, CpuError> {
    let mut layout = Layout {
        slots: Vec::new(),
        state_lens: Vec::new(),
    };
    M::iter_tensors(&mut RecursiveWalker {
        m: master,
        f: &mut layout,
    })?;
    Ok(layout)
}

impl TensorVisitor<f32, Cpu> for Layout {
    type Viewer = ViewTensorRef;
    type Err = CpuError;
    type E2 = f32;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, f32, Cpu>,
        t: &Tensor<S, f32, Cpu>,
    ) -> Result<Option<Tensor<S, f32, Cpu>>, CpuError> {
        let n = t.shape().num_elements();
        if opts.do_gradient_update {
            let ghost = t.ghost();
            let get: GradSlot = Box::new(slot(move |g: &mut Gradients<f32, Cpu>| {
                let buf = g.get_or_alloc_mut(&ghost)?;
                Ok(&mut buf[..])
            }));
            self.slots.push(MasterSlot { len: n, get });
        } else {
            self.state_lens.push(n);
        }
        Ok(None)
    }
}

/// Who a master is: the ids of its trainable tensors, which its gradients are keyed by. Two
/// models built separately never share one; a clone shares its original's until dfdx gives it
/// new tensors. Filled in place, so a step allocates nothing once it has its size.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Identity {
    pub(super) ids: Vec<u64>,
}

impl Identity {
    /// Reads `master`'s identity into `self`.
    pub(super) fn read<M: MasterModel>(&mut self, master: &M) -> Result<(), CpuError> {
        self.ids.clear();
        M::iter_tensors(&mut RecursiveWalker {
            m: master,
            f: &mut ReadIdentity(self),
        })?;
        Ok(())
    }
}

struct ReadIdentity<'a>(&'a mut Identity);

impl TensorVisitor<f32, Cpu> for ReadIdentity<'_> {
    type Viewer = ViewTensorRef;
    type Err = CpuError;
    type E2 = f32;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, f32, Cpu>,
        t: &Tensor<S, f32, Cpu>,
    ) -> Result<Option<Tensor<S, f32, Cpu>>, CpuError> {
        if opts.do_gradient_update {
            // An id that cannot be read (a dfdx whose `Debug` differs) keys nothing: the master
            // is then told apart by its type and tensor count alone.
            self.0.ids.push(tensor_id(t).unwrap_or(u64::MAX));
        }
        Ok(None)
    }
}

/// The id dfdx keys a tensor's gradient by. dfdx 0.13 exposes it only through `Tensor`'s
/// derived `Debug`, whose first field it is: the formatter is stopped right after it, so no data
/// is printed and nothing is allocated.
fn tensor_id<S: Shape>(t: &Tensor<S, f32, Cpu>) -> Option<u64> {
    use std::fmt::Write;

    /// Collects the digits of `UniqueId(..)`, then stops the formatter.
    struct Digits {
        seen: usize,
        total: usize,
        id: Option<u64>,
        inside: bool,
        value: u64,
    }
    const OPEN: &str = "UniqueId(";
    impl Write for Digits {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            for c in s.chars() {
                if self.inside {
                    match c.to_digit(10) {
                        Some(d) => {
                            self.value = self
                                .value
                                .checked_mul(10)
                                .and_then(|v| v.checked_add(u64::from(d)))
                                .ok_or(std::fmt::Error)?;
                        }
                        None if c == ')' => {
                            self.id = Some(self.value);
                            return Err(std::fmt::Error);
                        }
                        None => return Err(std::fmt::Error),
                    }
                } else if OPEN[self.seen..].starts_with(c) {
                    self.seen += c.len_utf8();
                    self.inside = self.seen == OPEN.len();
                } else {
                    self.seen = usize::from(OPEN.starts_with(c));
                }
            }
            // Only the struct's name comes before the id: give up long before any data.
            self.total += s.len();
            if self.total > 128 {
                return Err(std::fmt::Error);
            }
            Ok(())
        }
    }
    let mut d = Digits {
        seen: 0,
        total: 0,
        id: None,
        inside: false,
        value: 0,
    };
    let _ = write!(d, "{t:?}");
    d.id
}

/// The working copy of an [`IDENTITY`](Precision::IDENTITY) precision: the master's own
/// tensors (same ids, shared buffers, nothing copied).
pub(super) fn share<H: Precision, M: MasterModel>(
    master: &M,
) -> Result<WorkingCopy<H, M>, StepError>
where
    Cpu: Device<H::Elem>,
{
    M::iter_tensors(&mut RecursiveWalker {
        m: master,
        f: &mut Share::<H>(std::marker::PhantomData),
    })?
    .ok_or(StepError::Cast(crate::cast::CastError::NotRebuilt))
}

/// Rebuilds a module from clones of its tensors (shared buffers). For a precision whose element
/// is not `f32` it falls back to a converting copy.
struct Share<H>(std::marker::PhantomData<H>);

impl<H: Precision> TensorVisitor<f32, Cpu> for Share<H>
where
    Cpu: Device<H::Elem>,
{
    type Viewer = ViewTensorRef;
    type Err = CpuError;
    type E2 = H::Elem;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        _opts: TensorOptions<S, f32, Cpu>,
        t: &Tensor<S, f32, Cpu>,
    ) -> Result<Option<Tensor<S, H::Elem, Cpu>>, CpuError> {
        let mut shared = Some(t.clone());
        let any: &mut dyn std::any::Any = &mut shared;
        if let Some(same) = any.downcast_mut::<Option<Tensor<S, H::Elem, Cpu>>>() {
            return Ok(same.take());
        }
        let n = t.shape().num_elements();
        let mut src = vec![0.0f32; n];
        t.copy_into(&mut src);
        let mut dst = vec![H::Elem::default(); n];
        H::round(&src, &mut dst);
        Ok(Some(t.device().try_tensor_from_vec(dst, *t.shape())?))
    }
}

pub(super) fn count_mismatch(expected: usize, found: usize) -> StepError {
    StepError::WorkspaceMismatch {
        expected: format!("{expected} tensors"),
        found: format!("{found}"),
    }
}

pub(super) fn len_mismatch(index: usize, expected: usize, found: usize) -> StepError {
    StepError::WorkspaceMismatch {
        expected: format!("{expected} elements in tensor #{index}"),
        found: format!("{found}"),
    }
}

/// Copies the non-parameter tensors (f32 values of the working copy after the forward pass)
/// into the master.
pub(super) struct WriteState<'a> {
    pub(super) after: &'a [Vec<f32>],
    pub(super) index: usize,
    pub(super) mismatch: Option<StepError>,
}

impl TensorVisitor<f32, Cpu> for WriteState<'_> {
    type Viewer = ViewTensorMut;
    type Err = CpuError;
    type E2 = f32;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, f32, Cpu>,
        t: &mut Tensor<S, f32, Cpu>,
    ) -> Result<Option<Tensor<S, f32, Cpu>>, CpuError> {
        if opts.do_gradient_update || self.mismatch.is_some() {
            return Ok(None);
        }
        let j = self.index;
        self.index += 1;
        match self.after.get(j) {
            Some(values) if values.len() == t.shape().num_elements() => t.copy_from(values),
            Some(values) => {
                self.mismatch = Some(len_mismatch(j, values.len(), t.shape().num_elements()));
            }
            None => self.mismatch = Some(count_mismatch(self.after.len(), j + 1)),
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dfdx::prelude::*;

    #[test]
    fn a_tensor_id_is_read_and_tells_models_apart() {
        let dev = Cpu::default();
        let a = dev.build_module::<(Linear<3, 4>, ReLU, Linear<4, 2>), f32>();
        let b = dev.build_module::<(Linear<3, 4>, ReLU, Linear<4, 2>), f32>();
        let (mut ia, mut ib, mut ic) = (
            Identity::default(),
            Identity::default(),
            Identity::default(),
        );
        ia.read(&a).unwrap();
        ib.read(&b).unwrap();
        ic.read(&a.clone()).unwrap();
        assert_eq!(ia.ids.len(), 4);
        assert!(ia.ids.iter().all(|&id| id != u64::MAX), "{ia:?}");
        assert_ne!(ia, ib);
        assert_eq!(ia, ic);
        // the ids are dfdx's own: consecutive tensors built one after the other
        let mut sorted = ia.ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 4);
    }

    #[test]
    fn reading_an_id_stops_before_the_data() {
        let dev = Cpu::default();
        let big: Tensor<Rank1<100_000>, f32, _> = dev.zeros();
        assert!(tensor_id(&big).is_some());
    }
}
