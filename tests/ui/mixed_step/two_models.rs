// One step, two optimizers on two models: a scaler serves one master model.
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::step::GradScaler;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scaler)]
fn step(a: &mut Model, b: &mut Model, oa: &mut Sgd<Model, f32, Cpu>, ob: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, scaler: &mut GradScaler) {
    let grads = a.alloc_grads();
    let grads = a.forward(x.traced(grads)).square().mean().backward();
    oa.update(a, &grads).unwrap();
    ob.update(b, &grads).unwrap();
}

fn main() {}
