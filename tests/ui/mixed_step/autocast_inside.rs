// `#[autocast]` under `#[mixed_step]` (the other order): the same error, from `#[mixed_step]`.
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::{autocast, mixed_step};
use mpx::step::GradScaler;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scaler)]
#[autocast]
fn step(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, scaler: &mut GradScaler) {
    let grads = model.forward(x.traced(model.alloc_grads())).log_softmax::<Axis<1>>().mean().backward();
    opt.update(model, &grads).unwrap();
}

fn main() {}
