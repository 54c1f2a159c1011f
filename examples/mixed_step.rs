//! `#[mixed_step]` on an ordinary f32 dfdx training step: an MLP on the 8x8 digits, trained with
//! its forward pass in f16, the loss and its scaling in f32, and skip-on-overflow Adam updates of
//! the f32 master. `examples/mixed_step-expanded.rs` shows what the attribute generates.
//!
//! Run: `cargo run --example mixed_step`

#[path = "../tests/common/digits.rs"]
mod digits;

use dfdx::optim::{Adam, AdamConfig};
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::scaling::DynamicLossScale;

const BATCH: usize = 64;
type Mlp = (Linear<64, 32>, ReLU, Linear<32, 10>);
type Model = <Mlp as BuildOnDevice<Cpu, f32>>::Built;

/// The f32 step, as a dfdx user writes it; the attribute is the only change.
#[mixed_step(scaling = scaler, half = f16)]
fn train_step(
    model: &mut Model,
    opt: &mut Adam<Model, f32, Cpu>,
    x: Tensor<Rank2<BATCH, 64>, f32, Cpu>,
    y: Tensor<Rank2<BATCH, 10>, f32, Cpu>,
    scaler: &mut DynamicLossScale,
) -> f32 {
    let grads = model.alloc_grads();
    let logits = model.forward_mut(x.traced(grads));
    let loss = cross_entropy_with_logits_loss(logits, y);
    let loss_value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads)
        .expect("the optimizer update failed");
    loss_value
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let data = digits::Digits::load(0.2, 7);
    let dev = Cpu::default();
    let mut model = dev.build_module::<Mlp, f32>();
    let mut opt = Adam::new(
        &model,
        AdamConfig {
            lr: 3e-3,
            ..Default::default()
        },
    );
    let mut scaler = DynamicLossScale::builder()
        .initial(65536.0)
        .period(50)
        .build()?;

    let batches = data.train_len() / BATCH;
    for epoch in 0..5 {
        let (mut sum, mut skipped) = (0.0, 0);
        for b in 0..batches {
            let x = dev.tensor_from_vec(
                data.train_x[b * BATCH * 64..(b + 1) * BATCH * 64].to_vec(),
                (Const::<BATCH>, Const::<64>),
            );
            let mut onehot = vec![0.0f32; BATCH * 10];
            for (i, &c) in data.train_y[b * BATCH..(b + 1) * BATCH].iter().enumerate() {
                onehot[i * 10 + c] = 1.0;
            }
            let y = dev.tensor_from_vec(onehot, (Const::<BATCH>, Const::<10>));
            let report = train_step(&mut model, &mut opt, x, y, &mut scaler)?;
            if report.is_applied() {
                sum += report.loss;
            } else {
                skipped += 1;
            }
        }
        println!(
            "epoch {epoch}: mean loss {:.4}, skipped {skipped}/{batches}, loss scale {}",
            sum / (batches - skipped).max(1) as f32,
            scaler.loss_scale()
        );
    }

    let mut correct = 0;
    for (i, &c) in data.test_y.iter().enumerate() {
        let x: Tensor<Rank1<64>, f32, Cpu> =
            dev.tensor_from_vec(data.test_x[i * 64..(i + 1) * 64].to_vec(), (Const::<64>,));
        let logits = model.forward(x).as_vec();
        let best = (0..10)
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap_or(0);
        correct += usize::from(best == c);
    }
    println!(
        "test accuracy {:.3}",
        correct as f32 / data.test_len() as f32
    );
    Ok(())
}
