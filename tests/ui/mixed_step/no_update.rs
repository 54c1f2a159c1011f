// Gradients computed but never applied: the step needs the optimizer update (it finds the master
// model there, and makes it skip non-finite steps).
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::step::GradScaler;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scaler)]
fn step(model: &mut Model, x: Tensor<Rank2<3, 4>, f32, Cpu>, scaler: &mut GradScaler) -> Gradients<f32, Cpu> {
    let grads = model.alloc_grads();
    let out = model.forward(x.traced(grads));
    let loss = out.square().mean();
    loss.backward()
}

fn main() {}
