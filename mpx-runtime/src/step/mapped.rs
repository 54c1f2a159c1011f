//! [`HalfLayers`]: the working copy of a model of dfdx's layers built from mpx's fused layers,
//! and the cast from the master into it by visit order.
//!
//! A model's plain working copy is `<M as TensorCollection<f32, Cpu>>::To<f16, Cpu>`: dfdx's own
//! layers in f16, which run on dfdx's scalar f16 kernels. For a model made of dfdx's `Linear`,
//! its parameter-free activations and tuples of them, the working copy can instead be made of
//! mpx's fused [`nn::Linear`](crate::nn::Linear) (f16 storage, f32 sums on mpx's GEMM, and
//! direct f32 gradients into the master's inside a [`GradScaler`](super::GradScaler)), with no
//! change to the model's type: [`GradScaler::forward_mapped`](super::GradScaler::forward_mapped)
//! runs on it, and `#[mixed_step]` picks it wherever the model implements [`HalfLayers`].
//!
//! mpx's `Linear` visits `weight (O, I)` then `bias (O,)` as dfdx's does, so the mapped working
//! copy's tensors line up with the master's by position: the cast walks the master into one f32
//! buffer, rounds it, and walks the working copy filling its tensors in the same order. Every
//! count and length is checked ([`StepError::WorkspaceMismatch`](super::StepError) otherwise).

use dfdx::nn::BuildModule;
use dfdx::nn::modules::Linear as DfdxLinear;
use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorMut, ViewTensorRef,
};
use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, Tensor};
use dfdx::tensor_ops::Device;

use super::error::StepError;
use super::layout::{count_mismatch, len_mismatch};
use crate::boundary::MasterModel;
use crate::precision::{AMP, Precision, f16};

/// A master model whose working copy in precision `H` can be built from mpx's fused layers:
/// dfdx's `Linear<I, O>` becomes [`nn::Linear<I, O, H::Elem>`](crate::nn::Linear), dfdx's
/// parameter-free activations (`ReLU`, `Tanh`, `Sigmoid`, `FastGeLU`, `AccurateGeLU`)
/// stay themselves, and tuples of up to 6 such layers map element by element.
///
/// Implemented for `H` = [`f16`](struct@f16) and [`AMP<f16>`] only (emulated bf16 and f32 run on
/// dfdx's fast f32 kernels already). A model with any other layer does not implement it and
/// keeps the plain working copy ([`WorkingCopy`](super::WorkingCopy)).
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::{nn, precision::f16, step::HalfLayers};
/// type Master = (Linear<4, 8>, ReLU, Linear<8, 2>);
/// type Built = <Master as BuildOnDevice<Cpu, f32>>::Built;
/// let dev = Cpu::default();
/// let w: <Built as HalfLayers<f16>>::Working =
///     (dev.build_module::<nn::builders::Linear<4, 8>, f16>(), ReLU, dev.build_module::<nn::builders::Linear<8, 2>, f16>());
/// assert_eq!(w.2.weight.shape(), &(Const::<2>, Const::<8>));
/// ```
pub trait HalfLayers<H: Precision>: MasterModel
where
    Cpu: Device<H::Elem>,
{
    /// The working copy, made of mpx's layers, with the master's tensors in the same order.
    type Working: TensorCollection<H::Elem, Cpu> + BuildModule<Cpu, H::Elem> + Send + Sync + 'static;
}

/// dfdx's `Linear` to mpx's fused one, and the activations to themselves, for one precision.
macro_rules! layers {
    ($($h:ty),*) => {$(
        impl<const I: usize, const O: usize> HalfLayers<$h> for DfdxLinear<I, O, f32, Cpu> {
            type Working = crate::nn::Linear<I, O, <$h as Precision>::Elem, Cpu>;
        }
        activations!($h: ReLU, Tanh, Sigmoid, FastGeLU, AccurateGeLU);
    )*};
}

macro_rules! activations {
    ($h:ty: $($a:ident),*) => {$(
        impl HalfLayers<$h> for dfdx::nn::modules::$a {
            type Working = dfdx::nn::modules::$a;
        }
    )*};
}

layers!(f16, AMP<f16>);

/// Tuples map element by element.
macro_rules! tuple {
    ($($m:ident),+) => {
        impl<H: Precision, $($m: HalfLayers<H>),+> HalfLayers<H> for ($($m,)+)
        where
            Cpu: Device<H::Elem>,
            ($($m,)+): MasterModel,
            ($($m::Working,)+): TensorCollection<H::Elem, Cpu> + BuildModule<Cpu, H::Elem>,
        {
            type Working = ($($m::Working,)+);
        }
    };
}
tuple!(A);
tuple!(A, B);
tuple!(A, B, C);
tuple!(A, B, C, D);
tuple!(A, B, C, D, G);
tuple!(A, B, C, D, G, J);

/// The reused buffers of the cast: the master's values in visit order, rounded, and the
/// `(length, trainable)` of each master tensor.
pub(crate) struct MapScratch<E> {
    flat: Vec<f32>,
    half: Vec<E>,
    layout: Vec<(usize, bool)>,
}

impl<E> Default for MapScratch<E> {
    fn default() -> Self {
        Self {
            flat: Vec::new(),
            half: Vec::new(),
            layout: Vec::new(),
        }
    }
}

/// The mapped working copy of `master`, built and cast the first time (`half` is `None`), cast
/// in place after.
pub(crate) fn refresh<H, M>(
    master: &M,
    half: Option<M::Working>,
    scratch: &mut MapScratch<H::Elem>,
) -> Result<M::Working, StepError>
where
    H: Precision,
    M: HalfLayers<H>,
    Cpu: Device<H::Elem>,
{
    let dev = flatten::<H, M>(master, scratch)?;
    let mut half = match half {
        Some(half) => half,
        None => M::Working::try_build(&dev)?,
    };
    let mut fill = Fill::<H::Elem> {
        values: &scratch.half,
        layout: &scratch.layout,
        offset: 0,
        index: 0,
        mismatch: None,
    };
    <M::Working as TensorCollection<H::Elem, Cpu>>::iter_tensors(&mut RecursiveWalker {
        m: &mut half,
        f: &mut fill,
    })?;
    if let Some(e) = fill.mismatch {
        return Err(e);
    }
    if fill.index != scratch.layout.len() {
        return Err(count_mismatch(scratch.layout.len(), fill.index));
    }
    Ok(half)
}

/// Reads `master`'s tensors in visit order into `scratch.flat` and rounds them into
/// `scratch.half`; returns the master's device.
fn flatten<H, M>(master: &M, scratch: &mut MapScratch<H::Elem>) -> Result<Cpu, StepError>
where
    H: Precision,
    M: MasterModel,
    Cpu: Device<H::Elem>,
{
    scratch.layout.clear();
    let mut read = Flatten {
        flat: &mut scratch.flat,
        layout: &mut scratch.layout,
        offset: 0,
        dev: None,
    };
    M::iter_tensors(&mut RecursiveWalker {
        m: master,
        f: &mut read,
    })?;
    let (n, dev) = (read.offset, read.dev.take());
    scratch.flat.truncate(n);
    scratch.half.resize(n, H::Elem::default());
    H::round(&scratch.flat, &mut scratch.half);
    Ok(dev.unwrap_or_default())
}

struct Flatten<'a> {
    flat: &'a mut Vec<f32>,
    layout: &'a mut Vec<(usize, bool)>,
    offset: usize,
    dev: Option<Cpu>,
}

impl TensorVisitor<f32, Cpu> for Flatten<'_> {
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
        let end = self.offset + n;
        if self.flat.len() < end {
            self.flat.resize(end, 0.0);
        }
        t.copy_into(&mut self.flat[self.offset..end]);
        self.offset = end;
        self.layout.push((n, opts.do_gradient_update));
        if self.dev.is_none() {
            self.dev = Some(t.device().clone());
        }
        Ok(None)
    }
}

struct Fill<'a, E> {
    values: &'a [E],
    layout: &'a [(usize, bool)],
    offset: usize,
    index: usize,
    mismatch: Option<StepError>,
}

impl<E: dfdx::shapes::Dtype> TensorVisitor<E, Cpu> for Fill<'_, E>
where
    Cpu: Device<E>,
{
    type Viewer = ViewTensorMut;
    type Err = CpuError;
    type E2 = E;
    type D2 = Cpu;

    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, E, Cpu>,
        t: &mut Tensor<S, E, Cpu>,
    ) -> Result<Option<Tensor<S, E, Cpu>>, CpuError> {
        if self.mismatch.is_some() {
            return Ok(None);
        }
        let i = self.index;
        self.index += 1;
        let n = t.shape().num_elements();
        match self.layout.get(i) {
            Some(&(len, trainable)) if len == n && trainable == opts.do_gradient_update => {
                t.copy_from(&self.values[self.offset..self.offset + n]);
                self.offset += n;
            }
            Some(&(len, _)) if len != n => self.mismatch = Some(len_mismatch(i, len, n)),
            Some(_) => {
                self.mismatch = Some(StepError::WorkspaceMismatch {
                    expected: format!("tensor #{i} trained as in the master"),
                    found: "a tensor trained differently".into(),
                });
            }
            None => self.mismatch = Some(count_mismatch(self.layout.len(), i + 1)),
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dfdx::prelude::*;

    #[test]
    fn the_mapped_copy_holds_the_masters_values_rounded() {
        type Mlp = (Linear<3, 4>, ReLU, Linear<4, 2>, Tanh);
        let dev = Cpu::default();
        let master = dev.build_module::<Mlp, f32>();
        let mut scratch = MapScratch::default();
        let w = refresh::<f16, _>(&master, None, &mut scratch).unwrap();
        let round = |v: Vec<f32>| v.into_iter().map(f16::from_f32).collect::<Vec<_>>();
        assert_eq!(w.0.weight.as_vec(), round(master.0.weight.as_vec()));
        assert_eq!(w.0.bias.as_vec(), round(master.0.bias.as_vec()));
        assert_eq!(w.2.weight.as_vec(), round(master.2.weight.as_vec()));
        assert_eq!(w.2.bias.as_vec(), round(master.2.bias.as_vec()));
        // in place, after a change of the master
        let mut master2 = master.clone();
        master2.2.bias = dev.tensor([0.5, -0.25]);
        let w = refresh::<f16, _>(&master2, Some(w), &mut scratch).unwrap();
        assert_eq!(w.2.bias.as_vec(), round(vec![0.5, -0.25]));
    }
}
