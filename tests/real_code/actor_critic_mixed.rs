// An advantage actor-critic update, written the way dfdx users write one (dfdx 0.13's rl-ppo and
// rl-dqn train one network each): the agent holds an actor and a critic, each with its own
// optimizer, and one method updates both from a batch of transitions.
use dfdx::{optim::Adam, prelude::*};

use super::common::rl::{Actor, Critic};

pub struct Agent {
    pub actor: Actor,
    pub critic: Critic,
    pub actor_opt: Adam<Actor, f32, Cpu>,
    pub critic_opt: Adam<Critic, f32, Cpu>,
}

impl Agent {
    #[mpx::mixed_step(scaling = scaler)]
    pub fn update(
        &mut self,
        states: Tensor<Rank2<64, 4>, f32, Cpu>,
        actions: Tensor<Rank1<64>, usize, Cpu>,
        returns: Tensor<Rank1<64>, f32, Cpu>,
        scaler: &mut super::Scaler,
    ) -> (f32, f32) {
        let actor_grads = self.actor.alloc_grads();
        let critic_grads = self.critic.alloc_grads();

        let values = self.critic.forward(states.clone().traced(critic_grads));
        let values = values.reshape::<Rank1<64>>();
        let advantage = returns.clone() - values.retaped::<NoneTape>();
        let critic_loss = mse_loss(values, returns);

        let logits = self.actor.forward(states.traced(actor_grads));
        let log_probs = logits.log_softmax::<Axis<1>>().select(actions);
        let actor_loss = -(log_probs * advantage).mean();

        let (actor_value, critic_value) = (actor_loss.array(), critic_loss.array());
        let critic_grads = critic_loss.backward();
        let actor_grads = actor_loss.backward();
        self.critic_opt
            .update(&mut self.critic, &critic_grads)
            .expect("unused params");
        self.actor_opt
            .update(&mut self.actor, &actor_grads)
            .expect("unused params");
        (actor_value, critic_value)
    }
}
