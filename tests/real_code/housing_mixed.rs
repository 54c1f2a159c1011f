// Converted: `housing.rs` plus the attribute and the scaler parameter of `learn_batch`.
// dfdx 0.13.0 `examples/13-housing-nn-in-struct.rs`: the `Predictor` struct as written (the
// device is `Cpu`, which `AutoDevice` is without the `cuda` feature). Its `learn_batch` is the
// step.
use dfdx::{
    nn::builders::*,
    optim::Adam,
    prelude::{Optimizer, mse_loss},
    shapes::{Const, HasShape},
    tensor::{AsArray, Cpu, Gradients, Tensor, Trace},
    tensor_ops::Backward,
};

use super::common::housing::{Mlp, MlpStructure};

pub struct Predictor {
    pub device: Cpu,
    pub model: Mlp,
    pub gradients: Gradients<f32, Cpu>,
    pub optimizer: Adam<Mlp, f32, Cpu>,
}

impl Predictor {
    pub fn new(seed: u64) -> Self {
        let device = Cpu::seed_from_u64(seed);
        let model = device.build_module::<MlpStructure, f32>();
        let gradients = model.alloc_grads();
        let optimizer: Adam<Mlp, f32, Cpu> = Adam::new(&model, Default::default());
        Self {
            device,
            model,
            gradients,
            optimizer,
        }
    }

    pub fn predict_batch(
        &self,
        input: Tensor<(usize, Const<2>), f32, Cpu>,
    ) -> Tensor<(usize, Const<1>), f32, Cpu> {
        self.model.forward(input)
    }

    #[mpx::mixed_step(scaling = scaler)]
    pub fn learn_batch(
        &mut self,
        input: Tensor<(usize, Const<2>), f32, Cpu>,
        expected_output: Tensor<(usize, Const<1>), f32, Cpu>,
        scaler: &mut super::Scaler,
    ) -> f32 {
        assert_eq!(input.shape().0, expected_output.shape().0);

        let predictions = self
            .model
            .forward_mut(input.traced(self.gradients.to_owned()));
        let loss = mse_loss(predictions, expected_output);

        let batch_loss = loss.array();

        self.gradients = loss.backward();
        self.optimizer
            .update(&mut self.model, &self.gradients)
            .unwrap();
        self.model.zero_grads(&mut self.gradients);
        batch_loss
    }
}
