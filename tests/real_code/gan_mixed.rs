// A GAN on 2-d points, written the way dfdx users write one (no GAN ships with dfdx 0.13): the
// discriminator's step and the generator's step in one loop, the generator trained through the
// discriminator's forward pass, each model with its own gradients and its own Adam.
use dfdx::{optim::Adam, prelude::*};

use super::common::gan::{Discriminator, Generator};

#[mpx::mixed_step(scaling = scaler)]
pub fn train(
    g: &mut Generator,
    d: &mut Discriminator,
    g_opt: &mut Adam<Generator, f32, Cpu>,
    d_opt: &mut Adam<Discriminator, f32, Cpu>,
    real: &[Tensor<Rank2<32, 2>, f32, Cpu>],
    noise: &[Tensor<Rank2<32, 4>, f32, Cpu>],
    scaler: &mut super::Scaler,
) -> Vec<(f32, f32)> {
    let dev: Cpu = Default::default();
    let mut d_grads = d.alloc_grads();
    let mut g_grads = g.alloc_grads();
    let mut losses = Vec::new();
    for (x, z) in real.iter().zip(noise.iter()) {
        // discriminator: real points are 1, generated ones 0
        let fake = g.forward(z.clone());
        let real_logits = d.forward(x.clone().traced(d_grads));
        let real_loss = binary_cross_entropy_with_logits_loss(real_logits, dev.ones());
        let mut d_loss = real_loss.array();
        d_grads = real_loss.backward();
        let fake_logits = d.forward(fake.traced(d_grads));
        let fake_loss = binary_cross_entropy_with_logits_loss(fake_logits, dev.zeros());
        d_loss += fake_loss.array();
        d_grads = fake_loss.backward();
        d_opt.update(d, &d_grads).unwrap();
        d.zero_grads(&mut d_grads);

        // generator: make the discriminator say 1
        let fake = g.forward(z.clone().traced(g_grads));
        let logits = d.forward(fake);
        let g_loss = binary_cross_entropy_with_logits_loss(logits, dev.ones());
        let g_value = g_loss.array();
        g_grads = g_loss.backward();
        g_opt.update(g, &g_grads).unwrap();
        g.zero_grads(&mut g_grads);

        losses.push((d_loss, g_value));
    }
    losses
}
