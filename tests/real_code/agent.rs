// An agent generic over its network architecture, written the way dfdx users write one: the
// struct and its `impl` are generic over `M: BuildOnDevice`, and the training method uses the
// bounds the `impl` declares.
use dfdx::{optim::Sgd, optim::SgdConfig, prelude::*};

type Batch = Tensor<Rank2<64, 4>, f32, Cpu, OwnedTape<f32, Cpu>>;
type Out = Tensor<Rank2<64, 2>, f32, Cpu, OwnedTape<f32, Cpu>>;

pub struct Agent<M: BuildOnDevice<Cpu, f32>> {
    pub model: M::Built,
    pub opt: Sgd<M::Built, f32, Cpu>,
}

impl<M: BuildOnDevice<Cpu, f32>> Agent<M>
where
    M::Built: Module<Batch, Output = Out, Error = CpuError>,
{
    pub fn new(dev: &Cpu) -> Self {
        let model = dev.build_module::<M, f32>();
        let opt = Sgd::new(
            &model,
            SgdConfig {
                lr: 5e-2,
                momentum: None,
                weight_decay: None,
            },
        );
        Self { model, opt }
    }

    pub fn train(
        &mut self,
        states: Tensor<Rank2<64, 4>, f32, Cpu>,
        targets: Tensor<Rank2<64, 2>, f32, Cpu>,
    ) -> f32 {
        let grads = self.model.alloc_grads();
        let predicted = self.model.forward(states.traced(grads));
        let loss = mse_loss(predicted, targets);
        let value = loss.array();
        let grads = loss.backward();
        self.opt.update(&mut self.model, &grads).unwrap();
        value
    }
}
