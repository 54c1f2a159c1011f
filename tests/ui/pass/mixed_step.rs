// Every accepted form of `#[mixed_step]`, one step each.
use dfdx::optim::{Adam, AdamConfig, Sgd, SgdConfig};
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::AMP;
use mpx::precision::f16;
use mpx::scaling::{DynamicLossScale, NoOpLossScale, StaticLossScale};
use mpx::step::MixedWorkspace;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;
type X = Tensor<Rank2<3, 4>, f32, Cpu>;

// The default half type (f16); the step returned its loss value.
#[mixed_step(scaling = scale)]
fn f16_step(model: &mut Model, opt: &mut Adam<Model, f32, Cpu>, x: X, scale: &mut DynamicLossScale) -> f32 {
    let grads = model.alloc_grads();
    let out = model.forward(x.traced(grads));
    let loss = out.square().mean();
    let value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    value
}

// AMP<f16> with a workspace kept by the caller; `forward_mut`, `try_backward()?`, `?` on the update.
#[mixed_step(scaling = scale, half = amp_f16, workspace = ws)]
fn amp_step(
    model: &mut Model,
    opt: &mut Sgd<Model, f32, Cpu>,
    x: X,
    scale: &mut StaticLossScale,
    ws: &mut MixedWorkspace<AMP<f16>, Model>,
) -> Result<(), Box<dyn std::error::Error>> {
    let grads = model.alloc_grads();
    let out = model.forward_mut(x.traced(grads));
    let loss = out.square().mean();
    let grads = loss.try_backward()?;
    opt.update(model, &grads)?;
    Ok(())
}

// Emulated bf16 in a method: fields as model, optimizer and scale; the facade path given.
struct Trainer {
    model: Model,
    opt: Sgd<Model, f32, Cpu>,
    scale: NoOpLossScale,
    steps: usize,
}

impl Trainer {
    #[mixed_step(scaling = &mut self.scale, half = bf16, crate = "::mpx")]
    fn step(&mut self, x: X) {
        let grads = self.model.alloc_grads();
        let out = self.model.forward(x.traced(grads));
        let loss = out.square().mean();
        let grads = loss.backward();
        let _ = self.opt.update(&mut self.model, &grads);
        self.steps += 1;
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Cpu::default();
    let x: X = dev.tensor([[1.0, 2.0, 3.0, 4.0]; 3]);
    let mut model = dev.build_module::<Linear<4, 2>, f32>();
    let mut adam = Adam::new(&model, AdamConfig::default());
    let mut scale = DynamicLossScale::new(1024.0)?;
    let report = f16_step(&mut model, &mut adam, x.clone(), &mut scale)?;
    assert!(report.is_applied() && report.loss.is_finite() && report.scale == 1024.0);

    let mut sgd = Sgd::new(&model, SgdConfig::default());
    let mut ws = MixedWorkspace::<AMP<f16>, _>::new(&model)?;
    let report = amp_step(&mut model, &mut sgd, x.clone(), &mut StaticLossScale::new(8.0)?, &mut ws)?;
    assert!(report.grads_finite && ws.applied_steps() == 1);

    let opt = Sgd::new(&model, SgdConfig::default());
    let mut t = Trainer { model, opt, scale: NoOpLossScale, steps: 0 };
    let report = t.step(x)?;
    assert!(report.is_applied() && t.steps == 1 && report.scale == 1.0);
    Ok(())
}
