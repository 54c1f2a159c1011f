//! What `#[mixed_step]` generates for `examples/mixed_step.rs`, written out by hand and compiled
//! (pin-project's habit): the three role calls go through the `GradScaler`; every other line of
//! the loop is the user's; `require_master` checks at compile time that `model` is the f32
//! master. `mpx-macros/src/expanded_examples.rs` checks that this file is still what the
//! attribute generates. Generated code names the runtime as `::mpx::__private::mpx_runtime`.
//!
//! Run: `cargo run --example mixed_step-expanded` (prints the same as `mixed_step`)

#[path = "../tests/common/digits.rs"]
mod digits;

use dfdx::optim::{Adam, AdamConfig};
use dfdx::prelude::*;
use mpx::scaling::DynamicLossScale;
use mpx::step::GradScaler;

const BATCH: usize = 64;
type Mlp = (Linear<64, 32>, ReLU, Linear<32, 10>);
type Model = <Mlp as BuildOnDevice<Cpu, f32>>::Built;
type Batch = (
    Tensor<Rank2<BATCH, 64>, f32, Cpu>,
    Tensor<Rank2<BATCH, 10>, f32, Cpu>,
);

/// `#[mixed_step(scaling = scaler)]` on the epoch loop, expanded.
#[rustfmt::skip] // kept as the macro writes it (a test compares the two)
fn train_epoch(
    model: &mut Model,
    opt: &mut Adam<Model, f32, Cpu>,
    batches: &[Batch],
    scaler: &mut GradScaler,
) -> f32 {
    let mut grads = model.alloc_grads();
    let mut total_epoch_loss = 0.0;
    for (img, lbl) in batches {
        let logits = {
            let __mpx_input = img.trace(grads);
            let _ = ::mpx::__private::mpx_runtime::boundary::require_master({
                use ::mpx::__private::mpx_runtime::step::__macro_support::ByMut as _;
                &*(model).__mpx_by_mut()
            });
            ::mpx::__private::mpx_runtime::step::scaler_of::<_, _>({
                use ::mpx::__private::mpx_runtime::step::__macro_support::ByMut as _;
                (scaler).__mpx_by_mut()
            })
            .forward(
                {
                    use ::mpx::__private::mpx_runtime::step::__macro_support::ByMut as _;
                    &*(model).__mpx_by_mut()
                },
                __mpx_input,
                |__mpx_working, __mpx_x| __mpx_working.forward_mut(__mpx_x),
            )
        };
        let loss = cross_entropy_with_logits_loss(logits, lbl.clone());
        total_epoch_loss += loss.array();
        grads = {
            let __mpx_loss = loss;
            ::mpx::__private::mpx_runtime::step::scaler_of::<_, _>({
                use ::mpx::__private::mpx_runtime::step::__macro_support::ByMut as _;
                (scaler).__mpx_by_mut()
            })
            .backward_with(__mpx_loss, |__mpx_loss| __mpx_loss.backward())
        };
        {
            let __mpx_grads = ::mpx::__private::mpx_runtime::step::__macro_support::shared(&grads);
            ::mpx::__private::mpx_runtime::step::scaler_of::<_, _>({
                use ::mpx::__private::mpx_runtime::step::__macro_support::ByMut as _;
                (scaler).__mpx_by_mut()
            })
            .update_with(model, |__mpx_master| (opt).update(__mpx_master, __mpx_grads))
        }
        .unwrap();
        model.zero_grads(&mut grads);
    }
    total_epoch_loss / batches.len() as f32
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
    let mut scaler = GradScaler::new(
        DynamicLossScale::builder()
            .initial(65536.0)
            .period(50)
            .build()?,
    );

    let batches: Vec<Batch> = (0..data.train_len() / BATCH)
        .map(|b| {
            let x = dev.tensor_from_vec(
                data.train_x[b * BATCH * 64..(b + 1) * BATCH * 64].to_vec(),
                (Const::<BATCH>, Const::<64>),
            );
            let mut onehot = vec![0.0f32; BATCH * 10];
            for (i, &c) in data.train_y[b * BATCH..(b + 1) * BATCH].iter().enumerate() {
                onehot[i * 10 + c] = 1.0;
            }
            (
                x,
                dev.tensor_from_vec(onehot, (Const::<BATCH>, Const::<10>)),
            )
        })
        .collect();
    for epoch in 0..5 {
        let skipped_before = scaler.skipped_steps();
        let loss = train_epoch(&mut model, &mut opt, &batches, &mut scaler);
        println!(
            "epoch {epoch}: mean loss {loss:.4}, skipped {}/{}, loss scale {}",
            scaler.skipped_steps() - skipped_before,
            batches.len(),
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
