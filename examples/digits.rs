//! Train an MLP on the real 8x8 handwritten digits (UCI optdigits, embedded in `smartcore`), in f32
//! and in mixed f16 side by side, and compare test accuracy, step time and peak memory.
//!
//! ```text
//! cargo run --release --example digits
//! ```
//!
//! The training step is ordinary dfdx code ([`step_f32`]). The mixed run is the same code with one
//! attribute, `#[mpx::mixed_step(scaling = scaler)]`, and one more parameter, the
//! [`GradScaler`] ([`step_mixed`]): it keeps the f32 master, runs forward and backward in f16,
//! computes the loss in f32, scales it with a dynamic loss scale that starts deliberately too high
//! (2^24: the scaled gradient of the logits, up to 2^24 / 32, is past f16's 65504) so that the
//! first steps overflow f16, are skipped and the scale backs off, and skips the update whenever
//! the gradients are not finite.
//!
//! Three runs start from the same weights and see the same batches in the same order:
//! - `f32`: dfdx's `Linear` + `ReLU` layers, the plain step;
//! - `f32, mpx layers`: the same parameters in mpx's fused layers (`mpx::nn::LinearReLU`,
//!   `mpx::nn::Linear`), the plain step (what the layers alone change);
//! - `mixed f16`: mpx's fused layers, the mixed step.
//!
//! The loss curves go to `target/plots/digits_loss.svg`.

#[path = "../tests/common/digits.rs"]
mod digits;

use std::time::{Duration, Instant};

use dfdx::{optim::*, prelude::*};
use digits::{CLASSES, Digits, FEATURES};
use mpx::cast::{cast_module, cast_to_half_precision};
use mpx::precision::f16;
use mpx::scaling::DynamicLossScale;
use mpx::step::GradScaler;

#[path = "../tests/common/heap.rs"]
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
/// The same MLP in mpx's fused layers: one op per `Linear` + `ReLU` pair.
type FusedMaster = <digits::FusedMlp<HIDDEN> as BuildOnDevice<Cpu, f32>>::Built;
type X = Tensor<Rank2<BATCH, FEATURES>, f32, Cpu>;
type Y = Tensor<Rank2<BATCH, CLASSES>, f32, Cpu>;
type Logits = [[f32; CLASSES]; BATCH];

/// The dfdx model's parameters in mpx's fused layers (the same values).
fn fused(m: &Master) -> FusedMaster {
    (
        (m.0.clone(), ReLU).into(),
        (m.2.clone(), ReLU).into(),
        m.4.clone().into(),
    )
}

/// One epoch's batches (the same for every run).
fn epoch_batches(dev: &Cpu, d: &Digits, epoch: usize) -> Vec<train::Batch<BATCH>> {
    train::epoch_batches::<BATCH>(dev, d, epoch)
}

/// Test accuracy in percent. `logits_of` maps a batch of test images to logits.
fn test_accuracy(d: &Digits, logits_of: impl Fn(X) -> Logits) -> f64 {
    let dev = Cpu::default();
    train::test_accuracy(d, BATCH, |px| {
        logits_of(dev.tensor_from_vec(px, (Const, Const))).to_vec()
    })
}

// ---- the training step -------------------------------------------------------------------------

/// One training step, as dfdx code is written: forward on the traced batch, cross-entropy,
/// backward, Adam, gradients zeroed for the next step. Returns the loss, the logits and the
/// gradients to reuse.
fn step_f32<M>(
    model: &mut M,
    opt: &mut Adam<M, f32, Cpu>,
    grads: Gradients<f32, Cpu>,
    x: &X,
    y: &Y,
) -> (f32, Logits, Gradients<f32, Cpu>)
where
    M: TensorCollection<f32, Cpu>
        + Module<
            Tensor<Rank2<BATCH, FEATURES>, f32, Cpu, OwnedTape<f32, Cpu>>,
            Output = Tensor<Rank2<BATCH, CLASSES>, f32, Cpu, OwnedTape<f32, Cpu>>,
        >,
{
    let out = model.forward(x.clone().traced(grads));
    let logits = out.retaped::<NoneTape>().array();
    let loss = cross_entropy_with_logits_loss(out, y.clone());
    let loss_value = loss.array();
    let mut grads = loss.backward();
    opt.update(model, &grads).expect("all parameters used");
    model.zero_grads(&mut grads);
    (loss_value, logits, grads)
}

/// The same step in mixed f16: the body of [`step_f32`] unchanged, the attribute and the scaler
/// added.
#[mpx::mixed_step(scaling = scaler)]
fn step_mixed(
    model: &mut FusedMaster,
    opt: &mut Adam<FusedMaster, f32, Cpu>,
    grads: Gradients<f32, Cpu>,
    x: &X,
    y: &Y,
    scaler: &mut GradScaler<f16>,
) -> (f32, Logits, Gradients<f32, Cpu>) {
    let out = model.forward(x.clone().traced(grads));
    let logits = out.retaped::<NoneTape>().array();
    let loss = cross_entropy_with_logits_loss(out, y.clone());
    let loss_value = loss.array();
    let mut grads = loss.backward();
    opt.update(model, &grads).expect("all parameters used");
    model.zero_grads(&mut grads);
    (loss_value, logits, grads)
}

fn adam<M: TensorCollection<f32, Cpu>>(model: &M) -> Adam<M, f32, Cpu> {
    Adam::new(
        model,
        AdamConfig {
            lr: 1e-3,
            ..Default::default()
        },
    )
}

/// What a run's step reports: its loss and logits, and whether the update was applied.
struct Stepped {
    loss: f32,
    logits: Logits,
    applied: bool,
}

/// Trains `EPOCHS` epochs with `step` and returns the epoch losses and the peak heap. `describe`
/// adds to each epoch's line (the loss scale of a mixed run).
fn train_run(
    name: &str,
    dev: &Cpu,
    d: &Digits,
    mut step: impl FnMut(&X, &Y) -> Stepped,
    describe: &mut dyn FnMut() -> String,
) -> (Vec<f32>, usize) {
    let pb = bar(name, EPOCHS * (d.train_len() / BATCH));
    let baseline = heap::reset_peak();
    let mut epoch_loss = Vec::with_capacity(EPOCHS);
    for epoch in 0..EPOCHS {
        let (mut loss_sum, mut hits, mut applied, mut skipped) = (0.0f32, 0usize, 0usize, 0usize);
        for (x, y, labels) in &epoch_batches(dev, d, epoch) {
            let s = step(x, y);
            if s.applied {
                loss_sum += s.loss;
                applied += 1;
                hits += correct(&s.logits, labels);
            } else {
                skipped += 1;
            }
            pb.inc(1);
        }
        let loss = loss_sum / applied.max(1) as f32;
        epoch_loss.push(if applied > 0 { loss } else { f32::NAN });
        let acc = 100.0 * hits as f64 / (applied.max(1) * BATCH) as f64;
        let skips = if skipped > 0 {
            format!("  skipped {skipped}")
        } else {
            String::new()
        };
        say(
            &pb,
            format!(
                "{name:<16} epoch {:>2}: loss {loss:.4}  train acc {acc:5.1}%{}{skips}",
                epoch + 1,
                describe()
            ),
        );
    }
    let peak = heap::peak() - baseline;
    pb.finish_and_clear();
    (epoch_loss, peak)
}

/// What a training run reports before its step time is measured (interleaved, after training).
struct Trained {
    test_acc: f64,
    peak_bytes: usize,
    skipped: u64,
    epoch_loss: Vec<f32>,
}

impl Trained {
    fn timed(self, step_time: Duration) -> RunResult {
        RunResult {
            test_acc: self.test_acc,
            step_time,
            peak_bytes: self.peak_bytes,
            skipped: self.skipped,
            epoch_loss: self.epoch_loss,
        }
    }
}

// ---- the runs ----------------------------------------------------------------------------------

/// The plain f32 step on `init` (dfdx's layers or mpx's fused layers).
fn train_f32<M>(name: &str, dev: &Cpu, d: &Digits, init: &M) -> Trained
where
    M: Clone
        + TensorCollection<f32, Cpu>
        + Module<
            Tensor<Rank2<BATCH, FEATURES>, f32, Cpu, OwnedTape<f32, Cpu>>,
            Output = Tensor<Rank2<BATCH, CLASSES>, f32, Cpu, OwnedTape<f32, Cpu>>,
        > + Module<X, Output = Tensor<Rank2<BATCH, CLASSES>, f32, Cpu>>,
{
    let mut model = init.clone();
    let mut opt = adam(&model);
    let mut grads = Some(model.alloc_grads());
    let (epoch_loss, peak_bytes) = train_run(
        name,
        dev,
        d,
        |x, y| {
            let g = grads
                .take()
                .expect("gradients are handed back by every step");
            let (loss, logits, g) = step_f32(&mut model, &mut opt, g, x, y);
            grads = Some(g);
            Stepped {
                loss,
                logits,
                applied: true,
            }
        },
        &mut String::new,
    );
    let test_acc = test_accuracy(d, |x| model.forward(x).array());
    Trained {
        test_acc,
        peak_bytes,
        skipped: 0,
        epoch_loss,
    }
}

/// The mixed f16 step on mpx's fused layers.
fn train_mixed(
    dev: &Cpu,
    d: &Digits,
    init: &FusedMaster,
) -> Result<Trained, Box<dyn std::error::Error>> {
    let mut model = init.clone();
    let mut opt = adam(&model);
    let mut grads = Some(model.alloc_grads());
    let scaling = DynamicLossScale::builder()
        .initial(2f32.powi(24))
        .period(400)
        .build()?;
    let mut scaler = GradScaler::<f16>::new(scaling).with_max_consecutive_skips(50);
    let mut scale_at_epoch_start = scaler.loss_scale();
    let scale_line = std::cell::Cell::new(0.0f32);
    let (epoch_loss, peak_bytes) = train_run(
        "mixed f16",
        dev,
        d,
        |x, y| {
            let g = grads
                .take()
                .expect("gradients are handed back by every step");
            let (loss, logits, g) = step_mixed(&mut model, &mut opt, g, x, y, &mut scaler);
            grads = Some(g);
            scale_line.set(scaler.loss_scale());
            let applied = scaler.last_step().is_some_and(|r| r.is_applied());
            Stepped {
                loss,
                logits,
                applied,
            }
        },
        &mut || {
            let now = scale_line.get();
            let line = format!("  scale {scale_at_epoch_start} -> {now}");
            scale_at_epoch_start = now;
            line
        },
    );
    // Inference in half precision too: a fresh f16 cast of the trained master.
    let half = cast_module::<f16, f32, _>(&model);
    let test_acc = test_accuracy(d, |x| {
        half.forward(cast_to_half_precision::<f16, _>(&x))
            .to_dtype::<f32>()
            .array()
    });
    Ok(Trained {
        test_acc,
        peak_bytes,
        skipped: scaler.skipped_steps(),
        epoch_loss,
    })
}

/// Rounds of the step-time measurement.
const ROUNDS: usize = 60;

/// The step time of each run (f32, f32 on mpx's layers, mixed f16), measured after training on
/// fresh copies from `init`: `ROUNDS` rounds, each one step of every run on the same batch, in
/// turn, so that a busy neighbour slows all three alike. Returns the medians.
fn interleaved_step_times(
    dev: &Cpu,
    d: &Digits,
    init: &Master,
) -> Result<[Duration; 3], Box<dyn std::error::Error>> {
    let batches = epoch_batches(dev, d, EPOCHS);
    let (mut m32, mut mf, mut mm) = (init.clone(), fused(init), fused(init));
    let (mut o32, mut of, mut om) = (adam(&m32), adam(&mf), adam(&mm));
    let (mut g32, mut gf, mut gm) = (
        Some(m32.alloc_grads()),
        Some(mf.alloc_grads()),
        Some(mm.alloc_grads()),
    );
    let mut scaler = GradScaler::<f16>::new(DynamicLossScale::builder().build()?);
    let mut times: [Vec<Duration>; 3] = Default::default();
    for round in 0..ROUNDS + 5 {
        let (x, y, _) = &batches[round % batches.len()];
        let mut timed = |k: usize, step: &mut dyn FnMut()| {
            let t = Instant::now();
            step();
            // the first rounds warm caches and buffers up
            if round >= 5 {
                times[k].push(t.elapsed());
            }
        };
        timed(0, &mut || {
            let g = g32.take().expect("gradients are handed back");
            g32 = Some(step_f32(&mut m32, &mut o32, g, x, y).2);
        });
        timed(1, &mut || {
            let g = gf.take().expect("gradients are handed back");
            gf = Some(step_f32(&mut mf, &mut of, g, x, y).2);
        });
        timed(2, &mut || {
            let g = gm.take().expect("gradients are handed back");
            gm = Some(step_mixed(&mut mm, &mut om, g, x, y, &mut scaler).2);
        });
    }
    Ok(times.map(|mut t| {
        t.sort();
        t[t.len() / 2]
    }))
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
    let f32_run = train_f32("f32", &dev, &d, &init);
    let f32_fused = train_f32("f32, mpx layers", &dev, &d, &fused(&init));
    let mixed = train_mixed(&dev, &d, &fused(&init))?;
    let [t32, tf, tm] = interleaved_step_times(&dev, &d, &init)?;
    let (f32_run, f32_fused, mixed) = (f32_run.timed(t32), f32_fused.timed(tf), mixed.timed(tm));

    println!();
    println!(
        "| run             | test accuracy | step time | peak heap during training | skipped steps |"
    );
    println!(
        "|-----------------|---------------|-----------|---------------------------|---------------|"
    );
    for (name, r) in [
        ("f32", &f32_run),
        ("f32, mpx layers", &f32_fused),
        ("mixed f16", &mixed),
    ] {
        println!(
            "| {name:<15} | {:>12.2}% | {:>6.3} ms | {:>21.1} KiB | {:>13} |",
            r.test_acc,
            r.step_time.as_secs_f64() * 1e3,
            r.peak_bytes as f64 / 1024.0,
            r.skipped
        );
    }
    println!(
        "\nstep time: median of {ROUNDS} interleaved rounds after training (one step of each run per round on fresh copies, batch {BATCH}); peak heap: the most heap in use during the run's training, above what was in use when it started"
    );
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
            ("f32, mpx layers", &f32_fused.epoch_loss),
            ("mixed f16", &mixed.epoch_loss),
        ],
    )?;
    println!("loss curves: {}", loss_path.display());
    if gap > 1.0 {
        return Err(format!("mixed precision is {gap:.2} points from f32, more than 1").into());
    }
    Ok(())
}
