// The scaler taken by value (what rustc's help suggests for a moved scaler): every call would
// train with a fresh copy, and the caller's scaler would never change.
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::step::GradScaler;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scaler)]
fn step(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, mut scaler: GradScaler) {
    let grads = model.alloc_grads();
    let grads = model.forward(x.traced(grads)).square().mean().backward();
    opt.update(model, &grads).unwrap();
}

fn main() {}
