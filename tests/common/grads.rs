//! Every trainable tensor's gradient of a module, widened to f32: shared by the `mpx::nn` tests.

use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorRef,
};
use dfdx::prelude::*;
use mpx::precision::Precision;

/// Every trainable tensor's gradient, widened to f32, in the module's visit order.
struct GradsOf<'a, E: Dtype> {
    grads: &'a Gradients<E, Cpu>,
    out: Vec<Vec<f32>>,
}

impl<E: Precision<Elem = E> + Dtype> TensorVisitor<E, Cpu> for GradsOf<'_, E>
where
    Cpu: Device<E>,
{
    type Viewer = ViewTensorRef;
    type Err = CpuError;
    type E2 = E;
    type D2 = Cpu;
    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, E, Cpu>,
        t: &Tensor<S, E, Cpu>,
    ) -> Result<Option<Tensor<S, E, Cpu>>, CpuError> {
        if opts.do_gradient_update {
            let g = self.grads.get(t).as_vec();
            let mut v = vec![0.0f32; g.len()];
            E::widen(&g, &mut v);
            self.out.push(v);
        }
        Ok(None)
    }
}

pub fn param_grads<E: Precision<Elem = E> + Dtype, M: TensorCollection<E, Cpu>>(
    m: &M,
    grads: &Gradients<E, Cpu>,
) -> Vec<Vec<f32>>
where
    Cpu: Device<E>,
{
    let mut v = GradsOf {
        grads,
        out: Vec::new(),
    };
    M::iter_tensors(&mut RecursiveWalker { m, f: &mut v }).expect("walk");
    v.out
}
