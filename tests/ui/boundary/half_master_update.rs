// The optimizer update of a mixed step takes the f32 master, never a half model.
use dfdx::optim::{Sgd, SgdConfig};
use dfdx::prelude::*;
use mpx::precision::f16;
use mpx::scaling::StaticLossScale;
use mpx::step::{GradScaler, Mixed};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Cpu::default();
    let master = Mixed::new(dev.build_module::<Linear<4, 2>, f32>());
    let mut half = Mixed::new(dev.build_module::<Linear<4, 2>, f16>());
    let mut opt = Sgd::new(&*half, SgdConfig::default());
    let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(128.0)?);
    let x: Tensor<Rank2<3, 4>, f32, _> = dev.sample_normal();
    let y = scaler.forward(&master, x.trace(master.alloc_grads()), |m, x| m.forward(x))?;
    let grads = scaler.backward(y.square().mean())?;
    scaler.update(&mut half, &mut opt, &grads)?;
    Ok(())
}
