// A forward pass and an update but no backward pass: nothing to scale and unscale.
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::step::GradScaler;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scaler)]
fn step(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, scaler: &mut GradScaler) {
    let grads = model.alloc_grads();
    let _out = model.forward(x.traced(grads.clone()));
    opt.update(model, &grads).unwrap();
}

fn main() {}
