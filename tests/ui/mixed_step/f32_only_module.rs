// A model whose `Module` impl is written for f32 only cannot run in half precision: the step
// runs in f32, and the compiler says so at the forward pass, with the fix (a warning, made an
// error here with `deny`).
#![deny(deprecated)]
use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection, TensorOptions};
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::step::GradScaler;

struct Net<E: Dtype, D: Device<E>> {
    w: Tensor<Rank2<4, 2>, E, D>,
}

impl<E: Dtype, D: Device<E>> TensorCollection<E, D> for Net<E, D> {
    type To<E2: Dtype, D2: Device<E2>> = Net<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            Self::tensor("w", |s| &s.w, |s| &mut s.w, TensorOptions::reset_to_zeros()),
            |w| Net { w },
        )
    }
}

// written for f32 alone
impl<T: Tape<f32, Cpu>> Module<Tensor<Rank2<3, 4>, f32, Cpu, T>> for Net<f32, Cpu> {
    type Output = Tensor<Rank2<3, 2>, f32, Cpu, T>;
    type Error = CpuError;
    fn try_forward(&self, x: Tensor<Rank2<3, 4>, f32, Cpu, T>) -> Result<Self::Output, CpuError> {
        x.try_matmul(self.w.clone())
    }
}

type Model = Net<f32, Cpu>;

#[mixed_step(scaling = scaler)]
fn step(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, scaler: &mut GradScaler) {
    let grads = model.forward(x.traced(model.alloc_grads())).square().mean().backward();
    opt.update(model, &grads).unwrap();
}

fn main() {}
