//! `examples/mixed_step.rs` with the attribute expanded by hand: exactly what
//! `#[mixed_step(scaling = scaler, half = f16)]` generates, kept compiling (pin-project's habit).
//! It trains and prints the same numbers as the annotated example.
//!
//! Run: `cargo run --example mixed_step-expanded`

#[path = "../tests/common/digits.rs"]
mod digits;

use dfdx::optim::{Adam, AdamConfig};
use dfdx::prelude::*;
use mpx::scaling::DynamicLossScale;

const BATCH: usize = 64;
type Mlp = (Linear<64, 32>, ReLU, Linear<32, 10>);
type Model = <Mlp as BuildOnDevice<Cpu, f32>>::Built;

/// What `#[mixed_step(scaling = scaler, half = f16)]` generates for the step in
/// `examples/mixed_step.rs` (formatted; the attribute writes `::mpx::__private::mpx_runtime`,
/// which is the `mpx` crate's runtime).
///
/// * the signature is kept, the return type becomes `Result<StepReport, StepError>`;
/// * `require_master` checks first that the model is the f32 master (a compile-time boundary);
/// * `let grads = model.alloc_grads();` is dropped (the workspace holds the gradients);
/// * the forward pass runs on the half working copy, its input cast by `cast_input` (which only
///   takes an f32 tensor: a compile-time boundary);
/// * the loss statements become the f32 loss closure; `loss.backward()` is done by
///   `filter_value_and_grad`, which scales the loss in f32, unscales and checks the gradients;
/// * `opt.update(model, &grads)` becomes `optimizer_update`, which skips non-finite steps;
/// * the trailing `loss_value` is replaced by the report, whose `loss` is the same value.
fn train_step(
    model: &mut Model,
    opt: &mut Adam<Model, f32, Cpu>,
    x: Tensor<Rank2<BATCH, 64>, f32, Cpu>,
    y: Tensor<Rank2<BATCH, 10>, f32, Cpu>,
    scaler: &mut DynamicLossScale,
) -> ::core::result::Result<
    ::mpx::__private::mpx_runtime::boundary::StepReport,
    ::mpx::__private::mpx_runtime::step::StepError,
> {
    let _ = ::mpx::__private::mpx_runtime::boundary::require_master(&*(model));
    let __mpx_input = x;
    let mut __mpx_ws_owned = ::mpx::__private::mpx_runtime::step::MixedWorkspace::<
        ::mpx::__private::mpx_runtime::precision::f16,
        _,
    >::new(&*(model))?;
    let __mpx_ws = &mut __mpx_ws_owned;
    let __mpx_grads = ::mpx::__private::mpx_runtime::step::filter_value_and_grad(
        &*(model),
        scaler,
        &mut *__mpx_ws,
        |__mpx_model, __mpx_tape| {
            __mpx_model.forward_mut(::mpx::__private::mpx_runtime::boundary::cast_input::<
                ::mpx::__private::mpx_runtime::precision::f16,
                _,
            >(&__mpx_input, __mpx_tape))
        },
        |logits| {
            let loss = cross_entropy_with_logits_loss(logits, y);
            let loss_value = loss.array();
            let _ = &loss_value;
            loss
        },
    )?;
    let __mpx_finite = __mpx_grads.grads_finite;
    let __mpx_outcome = ::mpx::__private::mpx_runtime::step::optimizer_update(
        model,
        opt,
        &__mpx_grads,
        __mpx_finite,
    )?;
    let __mpx_report = ::mpx::__private::mpx_runtime::boundary::StepReport {
        loss: __mpx_grads.loss,
        grads_finite: __mpx_finite,
        scale: __mpx_grads.applied_scale,
        new_scale: __mpx_grads.new_scale,
        outcome: __mpx_outcome,
    };
    ::core::result::Result::Ok(__mpx_report)
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
