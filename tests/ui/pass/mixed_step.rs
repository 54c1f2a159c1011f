// Accepted forms of `#[mixed_step]`, each run once.
use dfdx::optim::{Adam, AdamConfig, Sgd, SgdConfig};
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::{AMP, bf16, f16};
use mpx::scaling::{DynamicLossScale, NoOpLossScale, StaticLossScale};
use mpx::step::GradScaler;

type Model = dfdx::nn::modules::Linear<4, 2, f32, Cpu>;
type X = Tensor<Rank2<3, 4>, f32, Cpu>;

// The scaler's own precision (f16 by default); the step returns its loss value, as before.
#[mixed_step(scaling = scaler)]
fn f16_step(model: &mut Model, opt: &mut Adam<Model, f32, Cpu>, x: X, scaler: &mut GradScaler) -> f32 {
    let grads = model.alloc_grads();
    let out = model.forward(x.traced(grads));
    let loss = out.square().mean();
    let value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    value
}

// AMP<f16>: `forward_mut`, `try_backward()?`, `?` on the update, a `Result` kept as it was.
#[mixed_step(scaling = scaler, half = AMP<f16>)]
fn amp_step(
    model: &mut Model,
    opt: &mut Sgd<Model, f32, Cpu>,
    x: X,
    scaler: &mut GradScaler<AMP<f16>, StaticLossScale>,
) -> Result<(), Box<dyn std::error::Error>> {
    let grads = model.alloc_grads();
    let out = model.forward_mut(x.traced(grads));
    let loss = out.square().mean();
    let grads = loss.try_backward()?;
    opt.update(model, &grads)?;
    Ok(())
}

// A loop with a local scaler declared before it.
#[mixed_step(scaling = scaler)]
fn train(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, data: &[X]) -> u64 {
    let mut scaler = GradScaler::<f16>::new(DynamicLossScale::default());
    let mut grads = model.alloc_grads();
    for x in data {
        grads = model.forward(x.trace(grads)).square().mean().backward();
        opt.update(model, &grads).unwrap();
        model.zero_grads(&mut grads);
    }
    scaler.applied_steps() + scaler.skipped_steps()
}

// Emulated bf16 in a method: model, optimizer, gradients and scaler are fields; the facade path.
struct Trainer {
    model: Model,
    opt: Sgd<Model, f32, Cpu>,
    grads: Gradients<f32, Cpu>,
    scaler: GradScaler<bf16, NoOpLossScale>,
}

impl Trainer {
    #[mixed_step(scaling = self.scaler, half = bf16, crate = "::mpx")]
    fn step(&mut self, x: X) {
        let out = self.model.forward(x.traced(self.grads.clone()));
        self.grads = out.square().mean().backward();
        let _ = self.opt.update(&mut self.model, &self.grads);
        self.model.zero_grads(&mut self.grads);
    }
}

// PyTorch's first line, `GradScaler::default()`, as a local before the loop; a scaler behind a
// lock; two models and two optimizers under one scaler.
#[mixed_step(scaling = shared.lock().unwrap())]
fn two_models(
    a: &mut Model,
    b: &mut Model,
    oa: &mut Sgd<Model, f32, Cpu>,
    ob: &mut Sgd<Model, f32, Cpu>,
    data: &[X],
    shared: &std::sync::Mutex<GradScaler>,
) -> u64 {
    let mut grads_a = a.alloc_grads();
    let mut grads_b = b.alloc_grads();
    for x in data {
        grads_a = a.forward(x.trace(grads_a)).square().mean().backward();
        oa.update(a, &grads_a).unwrap();
        a.zero_grads(&mut grads_a);
        grads_b = b.forward(x.trace(grads_b)).square().mean().backward();
        ob.update(b, &grads_b).unwrap();
        b.zero_grads(&mut grads_b);
    }
    let s = shared.lock().unwrap();
    s.applied_steps() + s.skipped_steps()
}

#[mixed_step(scaling = scaler)]
fn default_scaler(model: &mut Model, opt: &mut Sgd<Model, f32, Cpu>, data: &[X]) -> f32 {
    let mut scaler = GradScaler::default();
    let mut grads = model.alloc_grads();
    for x in data {
        grads = model.forward(x.trace(grads)).square().mean().backward();
        opt.update(model, &grads).unwrap();
        model.zero_grads(&mut grads);
    }
    scaler.loss_scale()
}

fn main() {
    let dev = Cpu::default();
    let x: X = dev.tensor([[1.0, 2.0, 3.0, 4.0]; 3]);
    let mut model = dev.build_module::<Linear<4, 2>, f32>();
    let mut adam = Adam::new(&model, AdamConfig::default());
    let mut scaler = GradScaler::new(DynamicLossScale::builder().initial(1024.0).build().unwrap());
    let loss = f16_step(&mut model, &mut adam, x.clone(), &mut scaler);
    let report = scaler.last_step().unwrap();
    assert!(report.is_applied() && report.loss == loss && report.scale == 1024.0);

    let mut sgd = Sgd::new(&model, SgdConfig::default());
    let mut amp = GradScaler::new(StaticLossScale::new(8.0).unwrap());
    amp_step(&mut model, &mut sgd, x.clone(), &mut amp).unwrap();
    assert!(amp.last_step().unwrap().grads_finite && amp.applied_steps() == 1);

    assert_eq!(train(&mut model, &mut sgd, &[x.clone(), x.clone()]), 2);

    let opt = Sgd::new(&model, SgdConfig::default());
    let grads = model.alloc_grads();
    let mut t = Trainer { model, opt, grads, scaler: GradScaler::new(NoOpLossScale) };
    t.step(x.clone());
    assert_eq!(t.scaler.applied_steps(), 1);
    let (mut a, mut b) = (t.model.clone(), dev.build_module::<Linear<4, 2>, f32>());
    let (mut oa, mut ob) = (Sgd::new(&a, SgdConfig::default()), Sgd::new(&b, SgdConfig::default()));
    let shared = std::sync::Mutex::new(GradScaler::default());
    assert_eq!(two_models(&mut a, &mut b, &mut oa, &mut ob, &[x.clone(), x.clone()], &shared), 4);
    assert!(default_scaler(&mut a, &mut oa, &[x.clone()]) > 1.0);
}
