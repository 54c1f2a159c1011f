// The optimizer update of a mixed step takes the f32 master, never a half model.
use dfdx::optim::{Sgd, SgdConfig};
use dfdx::prelude::*;
use mpx::precision::f16;
use mpx::scaling::StaticLossScale;
use mpx::step::{GradScaler, filter_value_and_grad, optimizer_update};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Cpu::default();
    let master = dev.build_module::<Linear<4, 2>, f32>();
    let mut half = dev.build_module::<Linear<4, 2>, f16>();
    let mut opt = Sgd::new(&half, SgdConfig::default());
    let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(128.0)?);
    let x = dev.sample_normal::<Rank2<3, 4>>().to_dtype::<f16>();
    let grads = filter_value_and_grad(
        &master,
        &mut scaler,
        |m, t| m.forward(x.clone().put_tape(t)),
        |o| o.square().mean(),
    )?;
    optimizer_update(&mut half, &mut opt, &mut scaler, &grads)?;
    Ok(())
}
