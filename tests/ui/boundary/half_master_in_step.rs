// A `#[mixed_step]` on a step whose model was built in f16: the master must be f32.
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::f16;
use mpx::scaling::DynamicLossScale;

type Half = dfdx::nn::modules::Linear<4, 2, f16, Cpu>;

#[mixed_step(scaling = scale, half = f16)]
fn step(model: &mut Half, opt: &mut Sgd<Half, f16, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, scale: &mut DynamicLossScale) {
    let grads = model.alloc_grads();
    let out = model.forward(x.traced(grads));
    let loss = out.square().mean();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
}

fn main() {}
