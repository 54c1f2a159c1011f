// `scaling` is required: the step must be told which loss scale to apply and adjust.
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(half = f16)]
fn step(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>) {
    let grads = model.alloc_grads();
    let out = model.forward(x.traced(grads));
    let loss = out.square().mean();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
}

fn main() {}
