// An optimizer for a model's part and another for a part of that part: the inner update is an
// error at its model's tokens (each tensor's gradients are judged for one update).
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::step::GradScaler;

type Trunk = (dfdx::nn::modules::Linear<4, 8, f32, Cpu>, Tanh);
type Model = (Trunk, dfdx::nn::modules::Linear<8, 2, f32, Cpu>);

#[mixed_step(scaling = scaler)]
fn step(
    model: &mut Model,
    trunk_opt: &mut Sgd<Trunk, f32, Cpu>,
    first_opt: &mut Sgd<dfdx::nn::modules::Linear<4, 8, f32, Cpu>, f32, Cpu>,
    x: Tensor<Rank2<3, 4>, f32, Cpu>,
    scaler: &mut GradScaler,
) {
    let grads = model.forward(x.traced(model.alloc_grads())).square().mean().backward();
    trunk_opt.update(&mut model.0, &grads).unwrap();
    first_opt.update(&mut model.0 .0, &grads).unwrap();
}

fn main() {}
