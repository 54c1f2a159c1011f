// The update written inside a macro's arguments: a macro's arguments are tokens, not code the step
// can rewrite, so the error is at the macro, with the way to write it.
use dfdx::{optim::*, prelude::*};
use mpx::mixed_step;
use mpx::step::GradScaler;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scaler)]
fn step(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, scaler: &mut GradScaler) {
    let grads = model.forward(x.traced(model.alloc_grads())).square().mean().backward();
    println!("{:?}", opt.update(model, &grads));
}

fn main() {}
