// A fit function that takes one step on the first batch before its loop (to check the set-up
// early, as users do before a long run), written the way dfdx users write one.
use dfdx::{optim::Adam, prelude::*};

use super::common::regress::Model;

pub fn fit(
    model: &mut Model,
    opt: &mut Adam<Model, f32, Cpu>,
    data: &[(Tensor<Rank2<32, 3>, f32, Cpu>, Tensor<Rank2<32, 1>, f32, Cpu>)],
) -> Vec<f32> {
    let mut grads = model.alloc_grads();
    let (x0, y0) = &data[0];
    let out = model.forward(x0.clone().traced(grads));
    let loss = mse_loss(out, y0.clone());
    let mut losses = vec![loss.array()];
    grads = loss.backward();
    opt.update(model, &grads).unwrap();
    model.zero_grads(&mut grads);

    for (x, y) in &data[1..] {
        let out = model.forward(x.clone().traced(grads));
        let loss = mse_loss(out, y.clone());
        losses.push(loss.array());
        grads = loss.backward();
        opt.update(model, &grads).unwrap();
        model.zero_grads(&mut grads);
    }
    losses
}
