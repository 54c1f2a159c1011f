// `scaling` names a bare loss scale: the step needs the whole state (scale, working copy, counters).
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::scaling::DynamicLossScale;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scale, half = f16)]
fn step(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, scale: &mut DynamicLossScale) {
    let grads = model.alloc_grads();
    let grads = model.forward(x.traced(grads)).square().mean().backward();
    opt.update(model, &grads).unwrap();
}

fn main() {}
