// dfdx 0.13.0 `examples/rl-dqn.rs`: the training loop of `main`, moved into a function (the one
// allowed extra line), returning the epoch losses instead of printing them.
use dfdx::{
    losses::huber_loss,
    optim::{Sgd, SgdConfig},
    prelude::*,
};

use super::common::rl::{ACTION, BATCH, QNetwork, STATE};

#[allow(clippy::too_many_arguments)]
pub fn train(
    mut q_net: &mut QNetwork,
    target_q_net: &mut QNetwork,
    sgd: &mut Sgd<QNetwork, f32, Cpu>,
    state: &Tensor<Rank2<BATCH, STATE>, f32, Cpu>,
    action: &Tensor<Rank1<BATCH>, usize, Cpu>,
    reward: &Tensor<Rank1<BATCH>, f32, Cpu>,
    done: &Tensor<Rank1<BATCH>, f32, Cpu>,
    next_state: &Tensor<Rank2<BATCH, STATE>, f32, Cpu>,
    epochs: usize,
) -> Vec<f32> {
    let _ = (ACTION, SgdConfig::default());
    let mut grads = q_net.alloc_grads();
    let mut losses = Vec::new();
    for _epoch in 0..epochs {
        let mut total_loss = 0f32;

        for _step in 0..20 {
            // forward through model, computing gradients
            let q_values = q_net.forward(state.trace(grads));
            let action_qs = q_values.select(action.clone());

            // targ_q = R + discount * max(Q(S'))
            // curr_q = Q(S)[A]
            // loss = huber(curr_q, targ_q, 1)
            let next_q_values = target_q_net.forward(next_state.clone());
            let max_next_q = next_q_values.max::<Rank1<BATCH>, _>();
            let target_q = (max_next_q * (-done.clone() + 1.0)) * 0.99 + reward.clone();

            let loss = huber_loss(action_qs, target_q, 1.0);
            total_loss += loss.array();

            // run backprop
            grads = loss.backward();

            // update weights with optimizer
            sgd.update(&mut q_net, &grads).expect("Unused params");
            q_net.zero_grads(&mut grads);
        }
        target_q_net.clone_from(q_net);

        losses.push(total_loss / 20.0);
    }
    losses
}
