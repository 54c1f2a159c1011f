// The update names a model whose forward pass did not run: the error is at `net` and names the
// model that did run.
use dfdx::optim::Sgd;
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::step::GradScaler;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;

#[mixed_step(scaling = scaler)]
fn step(model: &mut Model, net: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, x: Tensor<Rank2<3, 4>, f32, Cpu>, scaler: &mut GradScaler) {
    let grads = model.alloc_grads();
    let grads = model.forward(x.traced(grads)).square().mean().backward();
    opt.update(net, &grads).unwrap();
}

fn main() {}
