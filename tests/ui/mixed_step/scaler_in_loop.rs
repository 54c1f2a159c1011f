// A scaler declared inside the training loop starts over on every iteration.
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::step::GradScaler;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scaler)]
fn train(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, data: Vec<Tensor<Rank2<3, 4>, f32, Cpu>>) {
    let mut grads = model.alloc_grads();
    for x in data {
        let mut scaler: GradScaler = GradScaler::default();
        grads = model.forward(x.traced(grads)).square().mean().backward();
        opt.update(model, &grads).unwrap();
        model.zero_grads(&mut grads);
    }
}

fn main() {}
