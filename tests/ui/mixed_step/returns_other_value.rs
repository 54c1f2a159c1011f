// The step returns its report; a value other than the loss binding cannot be carried over.
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::scaling::DynamicLossScale;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scale)]
fn step(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, scale: &mut DynamicLossScale) -> usize {
    let grads = model.alloc_grads();
    let out = model.forward(x.traced(grads));
    let loss = out.square().mean();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    1
}

fn main() {}
