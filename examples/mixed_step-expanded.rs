//! What `#[mixed_step]` generates for `examples/mixed_step.rs`, written out by hand and compiled
//! (pin-project's habit): the three role calls go through the `GradScaler`; every other line of
//! the loop is the user's; `require_master` checks at compile time that `model` is the f32
//! master. `mpx-macros/src/expanded_examples.rs` checks that this file is still what the
//! attribute generates. Generated code names the runtime as `::mpx::__private::mpx_runtime`.
//!
//! Run: `cargo run --example mixed_step-expanded` (prints the same as `mixed_step`)

// `(&mut &mut forward(..)).__mpx_forward(..)` borrows on purpose: method probing finds the
// working copy of mpx's layers (`ViaMapped`, on `&mut Forward`) first, the master's own layers
// in half (`ViaHalf`, on `&mut &mut Forward`) next, and the f32 fallback (`ViaFull`, on
// `Forward`, which warns) last.
#![allow(clippy::needless_borrow, clippy::mut_mut)]

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
    // The generated calls are trait methods (so they auto-ref and auto-deref as the user's own
    // calls do), imported once at the top of the body.
    #[allow(unused_imports)]
    use ::mpx::__private::mpx_runtime::__private::{
        ByMut as _, Master as _, ViaFull as _, ViaHalf as _, ViaHalfNative as _, ViaMapped as _,
        ViaRejected as _,
    };
    // The state of the step's masters (the verdict of each one's last backward pass), for
    // this call.
    let __mpx_masters = ::mpx::__private::mpx_runtime::__private::Masters::new();
    let mut grads = model.alloc_grads();
    let mut total_epoch_loss = 0.0;
    for (img, lbl) in batches {
        // forward: on a half working copy of `model` built for this pass (or, where its bounds
        // cannot be checked, in f32 on `model` itself, with a warning), the f32 batch in, the
        // f32 logits out; the batch's own gradient is never read (`grads` come from
        // `alloc_grads` and backward passes), so it is passed as a `Batch`
        let logits = {
            let __mpx_input = ::mpx::__private::mpx_runtime::step::Batch(img.trace(grads));
            let _ = ::mpx::__private::mpx_runtime::boundary::require_master((model).__mpx_master());
            (&mut &mut ::mpx::__private::mpx_runtime::__private::forward::<
                _, _, _, _, _,
                ::mpx::__private::mpx_runtime::__private::call::ForwardMut,
                ::mpx::__private::mpx_runtime::__private::fallback::Warn
            >(
                ::mpx::__private::mpx_runtime::__private::scaler_of::<_, _>((scaler).__mpx_by_mut()),
                &__mpx_masters,
                (model).__mpx_master_mut(),
                __mpx_input,
            ))
            .__mpx_forward(|__mpx_working, __mpx_x| __mpx_working.forward_mut(__mpx_x))
        };
        let loss = cross_entropy_with_logits_loss(logits, lbl.clone());
        total_epoch_loss += loss.array();
        // backward: the half gradients come back unscaled into the f32 ones, then checked
        grads = {
            let __mpx_loss = loss;
            ::mpx::__private::mpx_runtime::__private::backward(
                ::mpx::__private::mpx_runtime::__private::scaler_of::<_, _>((scaler).__mpx_by_mut()),
                __mpx_loss,
                |__mpx_loss| __mpx_loss.backward()
            )
        };
        // update: the step's own `opt.update(model, &grads)`, run only on a finite verdict; the
        // whole has the type that call has
        {
            // the gradients argument in a `let` of its own (an inline `&loss.backward()` lives
            // through the call)
            let __mpx_grads_arg = &grads;
            let __mpx_grads = ::mpx::__private::mpx_runtime::__private::shared(__mpx_grads_arg);
            // this update's site (its own static): the scale is adjusted once per iteration,
            // read off the sites that update
            static __MPX_SITE: u8 = 0;
            let __mpx_begun = ::mpx::__private::mpx_runtime::__private::begin_update(
                ::mpx::__private::mpx_runtime::__private::scaler_of::<_, _>((scaler).__mpx_by_mut()),
                &__mpx_masters,
                (model).__mpx_master_mut(),
                &__MPX_SITE
            );
            match __mpx_begun {
                ::core::result::Result::Ok(__mpx_verdict) => {
                    let __mpx_ran = if __mpx_verdict.applies() {
                        ::core::option::Option::Some((opt).update(model, __mpx_grads))
                    } else {
                        ::core::option::Option::None
                    };
                    ::mpx::__private::mpx_runtime::__private::end_update(
                        ::mpx::__private::mpx_runtime::__private::scaler_of::<_, _>((scaler).__mpx_by_mut()),
                        __mpx_verdict,
                        __mpx_ran
                    )
                }
                ::core::result::Result::Err(__mpx_e) => {
                    ::core::result::Result::Err(::core::convert::From::from(__mpx_e))
                }
            }
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
