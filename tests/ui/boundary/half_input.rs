// The batch of a mixed step is f32 (the step rounds it to the half type itself); a batch already
// in f16 is refused, at the batch.
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::f16;
use mpx::step::GradScaler;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scaler)]
fn step(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f16, Cpu>, scaler: &mut GradScaler) {
    let grads = model.alloc_grads();
    let out = model.forward(x.traced(grads.clone()));
    let grads = out.square().mean().backward();
    opt.update(model, &grads).unwrap();
}

fn main() {}
