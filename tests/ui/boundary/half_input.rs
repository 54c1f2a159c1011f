// The batch of a mixed step is f32 (the step casts it); a batch already in f16 is refused.
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::f16;
use mpx::scaling::DynamicLossScale;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scale, half = f16)]
fn step(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f16, Cpu>, scale: &mut DynamicLossScale) {
    let grads = model.alloc_grads();
    let out = model.forward(x.traced(grads));
    let loss = out.square().mean();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
}

fn main() {}
