// A module of the user's own without `#[derive(HalfLayers)]`: the step runs it on dfdx's f16
// layers, slower than f32 on the CPU, and the compiler says so at the forward pass, with the two
// lines to add (a warning, made an error here with `deny`).
#![deny(deprecated)]
use dfdx::nn::modules::Linear;
use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection};
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::step::GradScaler;

struct Net<E: Dtype, D: Device<E>> {
    l1: Linear<4, 2, E, D>,
}

impl<E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform, D: Device<E>> TensorCollection<E, D> for Net<E, D> {
    type To<E2: Dtype, D2: Device<E2>> = Net<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(visitor: &mut V) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(Self::module("l1", |s| &s.l1, |s| &mut s.l1), |l1| Net { l1 })
    }
}

impl<E: Dtype, D: Device<E>, T: Tape<E, D>> Module<Tensor<Rank2<3, 4>, E, D, T>> for Net<E, D> {
    type Output = Tensor<Rank2<3, 2>, E, D, T>;
    type Error = D::Err;
    fn try_forward(&self, x: Tensor<Rank2<3, 4>, E, D, T>) -> Result<Self::Output, D::Err> {
        self.l1.try_forward(x)
    }
}

type Model = Net<f32, Cpu>;

#[mixed_step(scaling = scaler)]
fn step(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, scaler: &mut GradScaler) {
    let grads = model.forward(x.traced(model.alloc_grads())).square().mean().backward();
    opt.update(model, &grads).unwrap();
}

fn main() {}
