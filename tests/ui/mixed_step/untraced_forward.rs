// The model's forward pass is not traced, so there is no graph to run in half precision.
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::step::GradScaler;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scaler)]
fn step(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, scaler: &mut GradScaler) {
    let out = model.forward(x);
    let grads = out.leaky_trace().square().mean().backward();
    opt.update(model, &grads).unwrap();
}

fn main() {}
