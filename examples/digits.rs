//! Train an MLP on the real 8x8 handwritten digits (UCI optdigits, embedded in `smartcore`), in f32
//! and in mixed f16 side by side, and compare test accuracy, step time and peak memory.
//!
//! ```text
//! cargo run --release --example digits
//! ```
//!
//! Both runs start from the same weights and see the same batches in the same order. The mixed run
//! keeps an f32 master, runs forward and backward in f16 on a working copy, computes the loss in
//! f32, and scales it with a dynamic loss scale that starts deliberately too high (2^20), so
//! the first steps overflow f16, are skipped, and the scale backs off.
//!
//! The loss curves of both runs go to `target/plots/digits_loss.svg`.

#[path = "../tests/common/digits.rs"]
mod digits;

use std::time::{Duration, Instant};

use dfdx::{optim::*, prelude::*};
use digits::{CLASSES, Digits, FEATURES};
use mpx::cast::{cast_module, cast_to_half_precision};
use mpx::precision::f16;
use mpx::scaling::DynamicLossScale;
use mpx::step::{MixedWorkspace, UpdateOutcome, filter_value_and_grad_with_aux, optimizer_update};

#[path = "common/heap.rs"]
mod heap;
#[path = "common/plot.rs"]
mod plot;
#[path = "common/train.rs"]
mod train;

use train::{RunResult, bar, correct, say};

#[global_allocator]
static ALLOC: heap::Counting = heap::Counting;

// ---- model and data ----------------------------------------------------------------------------

const BATCH: usize = 32;
const EPOCHS: usize = 30;
const HIDDEN: usize = 128;
type Mlp = (
    Linear<FEATURES, HIDDEN>,
    ReLU,
    Linear<HIDDEN, HIDDEN>,
    ReLU,
    Linear<HIDDEN, CLASSES>,
);
type Master = <Mlp as BuildOnDevice<Cpu, f32>>::Built;
type X = Tensor<Rank2<BATCH, FEATURES>, f32, Cpu>;

/// One epoch's batches (the same for both runs).
fn epoch_batches(dev: &Cpu, d: &Digits, epoch: usize) -> Vec<train::Batch<BATCH>> {
    train::epoch_batches::<BATCH>(dev, d, epoch)
}

/// Test accuracy in percent. `logits_of` maps a batch of test images to logits.
fn test_accuracy(d: &Digits, logits_of: impl Fn(X) -> [[f32; CLASSES]; BATCH]) -> f64 {
    let dev = Cpu::default();
    train::test_accuracy(d, BATCH, |px| {
        logits_of(dev.tensor_from_vec(px, (Const, Const))).to_vec()
    })
}

// ---- f32 ---------------------------------------------------------------------------------------

fn train_f32(dev: &Cpu, d: &Digits, init: &Master) -> RunResult {
    let mut model = init.clone();
    let mut opt = Adam::new(
        &model,
        AdamConfig {
            lr: 1e-3,
            ..Default::default()
        },
    );
    let batches_per_epoch = d.train_len() / BATCH;
    let pb = bar("f32", EPOCHS * batches_per_epoch);
    let baseline = heap::reset_peak();
    let mut grads = model.alloc_grads();
    let mut busy = Duration::ZERO;
    let mut steps = 0u32;
    let mut epoch_loss = Vec::with_capacity(EPOCHS);
    for epoch in 0..EPOCHS {
        let (mut loss_sum, mut hits) = (0.0f32, 0usize);
        let batches = epoch_batches(dev, d, epoch);
        for (x, y, labels) in &batches {
            let t = Instant::now();
            let out = model.forward(x.clone().traced(grads));
            let logits = out.retaped::<NoneTape>().array();
            let loss = cross_entropy_with_logits_loss(out, y.clone());
            loss_sum += loss.array();
            grads = loss.backward();
            opt.update(&mut model, &grads).expect("all parameters used");
            model.zero_grads(&mut grads);
            busy += t.elapsed();
            steps += 1;
            hits += correct(&logits, labels);
            pb.inc(1);
        }
        let n = batches.len();
        epoch_loss.push(loss_sum / n as f32);
        say(
            &pb,
            format!(
                "f32   epoch {:>2}: loss {:.4}  train acc {:5.1}%",
                epoch + 1,
                loss_sum / n as f32,
                100.0 * hits as f64 / (n * BATCH) as f64
            ),
        );
    }
    let peak_bytes = heap::peak() - baseline;
    pb.finish_and_clear();
    let test_acc = test_accuracy(d, |x| model.forward(x).array());
    RunResult {
        test_acc,
        step_time: busy / steps,
        peak_bytes,
        skipped: 0,
        epoch_loss,
    }
}

// ---- mixed f16 ---------------------------------------------------------------------------------

fn train_mixed(
    dev: &Cpu,
    d: &Digits,
    init: &Master,
) -> Result<RunResult, Box<dyn std::error::Error>> {
    let mut master = init.clone();
    let mut opt = Adam::new(
        &master,
        AdamConfig {
            lr: 1e-3,
            ..Default::default()
        },
    );
    let mut scaling = DynamicLossScale::builder()
        .initial(2f32.powi(20))
        .period(400)
        .build()?;
    let batches_per_epoch = d.train_len() / BATCH;
    let pb = bar("mixed f16", EPOCHS * batches_per_epoch);
    let baseline = heap::reset_peak();
    let mut ws = MixedWorkspace::<f16, _>::new(&master)?.with_max_consecutive_skips(50);
    let mut busy = Duration::ZERO;
    let mut steps = 0u32;
    let mut epoch_loss = Vec::with_capacity(EPOCHS);
    for epoch in 0..EPOCHS {
        let (mut loss_sum, mut hits, mut finite_steps) = (0.0f32, 0usize, 0usize);
        let (mut grew, mut backed_off, mut skipped) = (0, 0, 0);
        let scale_at_start = scaling.loss_scale();
        let batches = epoch_batches(dev, d, epoch);
        for (x, y, labels) in &batches {
            let t = Instant::now();
            let xh = cast_to_half_precision::<f16, _>(x);
            let (g, logits) = filter_value_and_grad_with_aux(
                &master,
                &mut scaling,
                &mut ws,
                |m, tape| m.forward(xh.put_tape(tape)),
                |out| {
                    let logits = out.retaped::<NoneTape>().array();
                    (cross_entropy_with_logits_loss(out, y.clone()), logits)
                },
            )?;
            let (loss, applied, new, finite) =
                (g.loss, g.applied_scale, g.new_scale, g.grads_finite);
            let outcome = optimizer_update(&mut master, &mut opt, &g, finite)?;
            busy += t.elapsed();
            steps += 1;
            match outcome {
                UpdateOutcome::Applied => {
                    loss_sum += loss;
                    finite_steps += 1;
                    hits += correct(&logits, labels);
                }
                UpdateOutcome::Skipped { .. } => skipped += 1,
            }
            if new > applied {
                grew += 1;
            } else if new < applied {
                backed_off += 1;
            }
            pb.set_message(format!("scale {}", scaling.loss_scale()));
            pb.inc(1);
        }
        epoch_loss.push(if finite_steps > 0 {
            loss_sum / finite_steps as f32
        } else {
            f32::NAN
        });
        say(
            &pb,
            format!(
                "mixed epoch {:>2}: loss {:.4}  train acc {:5.1}%  scale {} -> {} ({} up, {} down)  skipped {}",
                epoch + 1,
                loss_sum / finite_steps.max(1) as f32,
                100.0 * hits as f64 / (finite_steps.max(1) * BATCH) as f64,
                scale_at_start,
                scaling.loss_scale(),
                grew,
                backed_off,
                skipped,
            ),
        );
    }
    let peak_bytes = heap::peak() - baseline;
    pb.finish_and_clear();
    // Inference in half precision too: a fresh f16 cast of the trained master.
    let half = cast_module::<f16, f32, _>(&master);
    let test_acc = test_accuracy(d, |x| {
        half.forward(cast_to_half_precision::<f16, _>(&x))
            .to_dtype::<f32>()
            .array()
    });
    Ok(RunResult {
        test_acc,
        step_time: busy / steps,
        peak_bytes,
        skipped: ws.skipped_steps(),
        epoch_loss,
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let d = Digits::load(0.2, 7);
    println!(
        "digits: {} training and {} test images of 8x8 pixels, {} classes; MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, batch {BATCH}, Adam, {EPOCHS} epochs",
        d.train_len(),
        d.test_len(),
        CLASSES
    );
    let dev = Cpu::seed_from_u64(0);
    let init = dev.build_module::<Mlp, f32>();
    let f32_run = train_f32(&dev, &d, &init);
    let mixed = train_mixed(&dev, &d, &init)?;

    println!();
    println!(
        "| run       | test accuracy | step time | peak heap during training | skipped steps |"
    );
    println!(
        "|-----------|---------------|-----------|---------------------------|---------------|"
    );
    for (name, r) in [("f32", &f32_run), ("mixed f16", &mixed)] {
        println!(
            "| {name:<9} | {:>12.2}% | {:>6.3} ms | {:>21.1} KiB | {:>13} |",
            r.test_acc,
            r.step_time.as_secs_f64() * 1e3,
            r.peak_bytes as f64 / 1024.0,
            r.skipped
        );
    }
    let gap = (mixed.test_acc - f32_run.test_acc).abs();
    println!(
        "\nmixed f16 vs f32: {gap:.2} points apart (must be within 1), step time x{:.2}, peak heap x{:.2}",
        mixed.step_time.as_secs_f64() / f32_run.step_time.as_secs_f64(),
        mixed.peak_bytes as f64 / f32_run.peak_bytes as f64
    );
    let loss_path = plot::plot_dir()?.join("digits_loss.svg");
    plot::loss_curves(
        &loss_path,
        "MLP on 8x8 digits: training loss",
        &[
            ("f32", &f32_run.epoch_loss),
            ("mixed f16", &mixed.epoch_loss),
        ],
    )?;
    println!("loss curves: {}", loss_path.display());
    if gap > 1.0 {
        return Err(format!("mixed precision is {gap:.2} points from f32, more than 1").into());
    }
    Ok(())
}
