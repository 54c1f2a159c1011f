//! A model's values in visit order: read them out, or write them into a model built anew (as a
//! restart loads a checkpoint into new tensors).

use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorMut, ViewTensorRef,
};
use dfdx::prelude::*;

/// Every float of `m`, in visit order (trainable and not), read back to the host from any device.
pub fn values<D: Device<f32>, M: TensorCollection<f32, D>>(m: &M) -> Vec<f32> {
    struct Read(Vec<f32>);
    impl<D: Device<f32>> TensorVisitor<f32, D> for Read {
        type Viewer = ViewTensorRef;
        type Err = D::Err;
        type E2 = f32;
        type D2 = D;
        fn visit<S: Shape>(
            &mut self,
            _: TensorOptions<S, f32, D>,
            t: &Tensor<S, f32, D>,
        ) -> Result<Option<Tensor<S, f32, D>>, D::Err> {
            self.0.extend(t.as_vec());
            Ok(None)
        }
    }
    let mut r = Read(Vec::new());
    M::iter_tensors(&mut RecursiveWalker { m, f: &mut r }).expect("reading a model cannot fail");
    r.0
}

/// Writes `from` (as [`values`] read it) into `to`'s tensors, in visit order.
pub fn load<M: TensorCollection<f32, Cpu>>(to: &mut M, from: &[f32]) {
    struct Write<'a>(&'a [f32], usize);
    impl TensorVisitor<f32, Cpu> for Write<'_> {
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
            t.copy_from(&self.0[self.1..self.1 + n]);
            self.1 += n;
            Ok(None)
        }
    }
    let mut w = Write(from, 0);
    M::iter_tensors(&mut RecursiveWalker { m: to, f: &mut w })
        .expect("writing a model cannot fail");
    assert_eq!(w.1, from.len(), "the values do not fill the model");
}

/// [`values`] as bit patterns, for bit-for-bit comparisons.
pub fn value_bits<D: Device<f32>, M: TensorCollection<f32, D>>(m: &M) -> Vec<u32> {
    super::bits::bits(&values(m))
}
