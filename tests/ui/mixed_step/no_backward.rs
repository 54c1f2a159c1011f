// An evaluation function is not a training step: there is no loss to scale.
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::scaling::DynamicLossScale;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scale, half = bf16)]
fn step(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, scale: &mut DynamicLossScale) {
    let grads = model.alloc_grads();
    let out = model.forward(x.traced(grads));
    let loss = out.square().mean::<Rank0, _>();
    println!("{}", loss.array());
    let _ = opt;
}

fn main() {}
