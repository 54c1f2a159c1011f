// Converted: `ppo.rs` plus the attribute and the scaler parameter.
// dfdx 0.13.0 `examples/rl-ppo.rs`: the training loop of `main`, moved into a function (the one
// allowed extra line), returning the epoch losses instead of printing them.
use dfdx::{optim::Sgd, prelude::*};

use super::common::rl::{ACTION, BATCH, PolicyNetwork, STATE};

#[mpx::mixed_step(scaling = scaler)]
pub fn train(
    mut pi_net: &mut PolicyNetwork,
    target_pi_net: &mut PolicyNetwork,
    sgd: &mut Sgd<PolicyNetwork, f32, Cpu>,
    state: &Tensor<Rank2<BATCH, STATE>, f32, Cpu>,
    action: &Tensor<Rank1<BATCH>, usize, Cpu>,
    advantage: &Tensor<Rank1<BATCH>, f32, Cpu>,
    epochs: usize,
    scaler: &mut super::Scaler,
) -> Vec<f32> {
    let _ = ACTION;
    let mut grads = pi_net.alloc_grads();
    let mut losses = Vec::new();
    for _epoch in 0..epochs {
        let mut total_loss = 0f32;

        for _step in 0..20 {
            // old_log_prob_a = log(P(action | state, target_pi_net))
            let old_logits = target_pi_net.forward(state.clone());
            let old_log_prob_a = old_logits.log_softmax::<Axis<1>>().select(action.clone());

            // log_prob_a = log(P(action | state, pi_net))
            let logits = pi_net.forward(state.trace(grads));
            let log_prob_a = logits.log_softmax::<Axis<1>>().select(action.clone());

            // ratio = P(action | state, pi_net) / P(action | state, target_pi_net)
            // but compute in log space and then do .exp() to bring it back out of log space
            let ratio = (log_prob_a - old_log_prob_a).exp();

            // because we need to re-use `ratio` a 2nd time, we need to do some tape manipulation here.
            let surr1 = ratio.with_empty_tape() * advantage.clone();
            let surr2 = ratio.clamp(0.8, 1.2) * advantage.clone();

            let ppo_loss = -(surr2.minimum(surr1).mean());

            total_loss += ppo_loss.array();

            // run backprop
            grads = ppo_loss.backward();

            // update weights with optimizer
            sgd.update(&mut pi_net, &grads).expect("Unused params");
            pi_net.zero_grads(&mut grads);
        }
        target_pi_net.clone_from(pi_net);

        losses.push(total_loss / 20.0);
    }
    losses
}
