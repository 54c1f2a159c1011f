// A training step behind a trait of the author's own, whose signature is fixed (so it cannot take
// one more parameter), written the way dfdx users write one: the learner keeps its model,
// optimizer and gradients in fields.
use dfdx::{optim::Adam, prelude::*};

use super::common::regress::Model;

pub trait Learner {
    fn learn(&mut self, x: Tensor<Rank2<32, 3>, f32, Cpu>, y: Tensor<Rank2<32, 1>, f32, Cpu>) -> f32;
}

pub struct Regressor {
    pub model: Model,
    opt: Adam<Model, f32, Cpu>,
    grads: Gradients<f32, Cpu>,
    scaler: super::Scaler,
}

impl Regressor {
    pub fn new(init: &Model) -> Self {
        let model = init.clone();
        let grads = model.alloc_grads();
        Self {
            opt: Adam::new(&model, Default::default()),
            model,
            grads,
            scaler: Default::default(),
        }
    }
}

impl Learner for Regressor {
    #[mpx::mixed_step(scaling = self.scaler)]
    fn learn(&mut self, x: Tensor<Rank2<32, 3>, f32, Cpu>, y: Tensor<Rank2<32, 1>, f32, Cpu>) -> f32 {
        let predicted = self.model.forward(x.trace(self.grads.clone()));
        let loss = huber_loss(predicted, y, 1.0);
        let value = loss.array();
        self.grads = loss.backward();
        self.opt.update(&mut self.model, &self.grads).unwrap();
        self.model.zero_grads(&mut self.grads);
        value
    }
}
