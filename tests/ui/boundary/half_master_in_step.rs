// A `#[mixed_step]` whose model was built in f16: the master must be f32 (optimizers never run on
// half weights).
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::f16;
use mpx::step::GradScaler;

type Half = dfdx::nn::modules::Linear<4, 2, f16, Cpu>;

#[mixed_step(scaling = scaler)]
fn step(model: &mut Half, opt: &mut Sgd<Half, f16, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, scaler: &mut GradScaler) {
    let grads = model.alloc_grads();
    let grads = model.forward(x.traced(grads)).square().mean().backward();
    opt.update(model, &grads).unwrap();
}

fn main() {}
