//! Train a small ViT on the real 8x8 handwritten digits (UCI optdigits, embedded in `smartcore`) in
//! f32 and in mixed precision (f16, emulated bf16) side by side, then compare test accuracy, step
//! time, peak heap and a measured memory breakdown, and draw the loss curves and the breakdown.
//!
//! ```text
//! cargo run --release --example vit                      # all precisions
//! cargo run --release --example vit -- --precision f16   # f32 | f16 | bf16 | all
//! cargo run --release --example vit -- --epochs 10 --lr 3e-3 --seed 0
//! ```
//!
//! It prints per-epoch loss, accuracy, loss scale and skipped steps, then a results table (test
//! accuracy, step time, peak heap; each half run must land within 1 point of f32, or the program
//! fails) and a measured memory table, and writes `target/plots/vit_loss.svg` (loss curves) and
//! `target/plots/vit_memory.svg` (memory breakdown).
//!
//! Every run starts from the same f32 weights and sees the same batches in the same order. The
//! mixed runs keep an f32 master and Adam on it, run forward and backward on a half working copy
//! (`mpx::step`), compute the loss in f32, and scale it with a dynamic loss scale.
//!
//! The model is [`DigitsVit`], an `mpx::nn::vit::Vit`: 16 patches of 2x2 pixels, width 32, two
//! `mpx::nn` encoder blocks (4 heads, feed-forward 64), mean pooling and a layer-norm + linear
//! head. In a half precision its layers run as fused ops on mpx's own GEMM: every linear layer
//! (projections, feed-forward, patch embedding, head) is one op with f32 sums rounded once to the
//! half type; all heads' `softmax(q·kᵀ/√d)·v` is one op with the scores and the softmax in f32;
//! each residual add is fused into the layer norm after it, whose statistics run in f32. In f32
//! they run dfdx's own ops. The mixed runs call `forward_in::<H, _>`, which names the
//! precision (emulated bf16's tensors are f32; inside a `GradScaler<bf16>` forward pass a plain
//! `forward` runs the layers in bf16 too, but the evaluation pass outside it needs `H` named).

#[path = "../tests/common/digits.rs"]
mod digits;
#[path = "../tests/common/heap.rs"]
mod heap;
#[path = "common/measure.rs"]
mod measure;
#[path = "common/plot.rs"]
mod plot;
#[path = "common/train.rs"]
mod train;

use std::error::Error;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use dfdx::{optim::*, prelude::*};
use mpx::cast::{Cast, cast_module, cast_to_half_precision};
use mpx::nn::{ForwardIn, MixedModule};
use mpx::precision::{HalfPrecision, Precision, bf16, f16};
use mpx::scaling::DynamicLossScale;
use mpx::step::{Batch, GradScaler, Kind, Mapped, Mixed, MixedDevice, UpdateOutcome, WorkingCopy};

use digits::{CLASSES, Digits, DigitsVit, FEATURES};
use train::{RunResult, bar, correct, epoch_batches, say, test_accuracy};

#[global_allocator]
static ALLOC: heap::Counting = heap::Counting;

const BATCH: usize = 32;

/// What [`DigitsVit`] is, for the printout.
const MODEL: &str = "16 patches of 2x2 pixels, width 32, 2 mpx::nn encoder blocks (4 heads, feed-forward 64; layer norms and attention softmax in f32), mean pool, layer norm + linear head";

type Master = DigitsVit<f32, Cpu>;
/// A batch of flattened 8x8 images (`DigitsVit` cuts them into patches itself).
type Images<E> = Tensor<Rank2<BATCH, FEATURES>, E, Cpu>;
type Labels = Tensor<Rank2<BATCH, CLASSES>, f32, Cpu>;
type Logits<E, T> = Tensor<Rank2<BATCH, CLASSES>, E, Cpu, T>;
/// One training batch: images, one-hot labels, classes.
type VitBatch = (Images<f32>, Labels, [usize; BATCH]);

/// The f32 master ViT, built on `dev` (its initialisation draws from `dev`'s seed).
fn build_vit(dev: &Cpu) -> Master {
    dev.build_module::<DigitsVit, f32>()
}

/// A batch of `BATCH` images (row-major f32 pixels) as a tensor.
fn image_tensor(dev: &Cpu, images: Vec<f32>) -> Images<f32> {
    dev.tensor_from_vec(images, (Const, Const))
}

/// Which runs to train.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Which {
    /// Plain f32 training.
    F32,
    /// Mixed precision, f16 working copy.
    F16,
    /// Mixed precision, emulated bf16 working copy (f32 storage, values rounded to bf16).
    Bf16,
    /// All three, side by side.
    All,
}

/// Train a ViT on the 8x8 digits in f32 and mixed precision.
#[derive(Debug, Parser)]
struct Args {
    /// Which precision to train in.
    #[arg(long, value_enum, default_value_t = Which::All)]
    precision: Which,
    /// Training epochs.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=1000))]
    epochs: u32,
    /// Adam's learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Seed of the initial weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// One epoch's batches.
fn vit_batches(dev: &Cpu, d: &Digits, epoch: usize) -> Vec<VitBatch> {
    epoch_batches::<BATCH>(dev, d, epoch)
}

/// How long and how fast every run trains.
#[derive(Debug, Clone, Copy)]
struct Plan {
    epochs: usize,
    lr: f64,
}

impl Plan {
    /// The learning rate of step `step` out of `total`: a cosine decay from `lr` to 0, so every
    /// run settles at the end instead of stopping mid-jump.
    fn lr_at(&self, step: usize, total: usize) -> f64 {
        let t = step as f64 / total.max(1) as f64;
        self.lr * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

fn adam(model: &Master, lr: f64) -> Adam<Master, f32, Cpu> {
    Adam::new(
        model,
        AdamConfig {
            lr,
            ..Default::default()
        },
    )
}

// ---- f32 ---------------------------------------------------------------------------------------

fn train_f32(dev: &Cpu, d: &Digits, init: &Master, plan: Plan) -> RunResult {
    let Plan { epochs, lr: _ } = plan;
    let mut model = init.clone();
    let mut opt = adam(&model, plan.lr);
    let total = epochs * (d.train_len() / BATCH);
    let pb = bar("f32", total);
    let baseline = heap::reset_peak();
    let mut grads = model.alloc_grads();
    let (mut busy, mut steps) = (Duration::ZERO, 0u32);
    let mut epoch_loss = Vec::with_capacity(epochs);
    for epoch in 0..epochs {
        let (mut loss_sum, mut hits) = (0.0f32, 0usize);
        let batches = vit_batches(dev, d, epoch);
        for (x, y, labels) in &batches {
            opt.cfg.lr = plan.lr_at(steps as usize, total);
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
    let test_acc = test_accuracy(d, BATCH, |px| {
        model.forward(image_tensor(dev, px)).array().to_vec()
    });
    RunResult {
        test_acc,
        step_time: busy / steps.max(1),
        peak_bytes,
        skipped: 0,
        epoch_loss,
    }
}

// ---- mixed -------------------------------------------------------------------------------------

/// The half precisions the mixed runs train in: f16 and emulated bf16. (What each run further
/// needs of the ViT's working copy is spelled out on [`train_mixed`].)
trait VitHalf: HalfPrecision
where
    Cpu: Device<Self::Elem>,
{
}

impl VitHalf for f16 {}
impl VitHalf for bf16 {}

/// The ViT's working copy in `H` (what [`Mapped`] builds from the master): a module from a
/// traced batch in `H` to traced logits in `H`.
trait VitStep<H: Precision>:
    Module<
        Tensor<Rank2<BATCH, FEATURES>, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
        Output = Logits<H::Elem, OwnedTape<H::Elem, Cpu>>,
    >
where
    Cpu: Device<H::Elem>,
{
}

impl<H: Precision, W> VitStep<H> for W
where
    Cpu: Device<H::Elem>,
    W: Module<
            Tensor<Rank2<BATCH, FEATURES>, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
            Output = Logits<H::Elem, OwnedTape<H::Elem, Cpu>>,
        >,
{
}

fn train_mixed<H>(
    name: &str,
    dev: &Cpu,
    d: &Digits,
    init: &Master,
    plan: Plan,
) -> Result<RunResult, Box<dyn Error>>
where
    H: VitHalf,
    Cpu: MixedDevice<H>,
    Mapped: Kind<H, Master, Cpu, Copy: VitStep<H>>,
    WorkingCopy<H, Master>: MixedModule<H, Images<H::Elem>, Output = Logits<H::Elem, NoneTape>>,
    Images<f32>: Cast<H, Output = Images<H::Elem>>,
{
    let Plan { epochs, lr: _ } = plan;
    let mut model = Mixed::mapped(init.clone());
    let mut opt = adam(&model, plan.lr);
    // Starts at jmp's suggested 2^15 and grows after 200 finite steps in a row.
    let mut scaler = GradScaler::<H, _>::new(
        DynamicLossScale::builder()
            .initial(2f32.powi(15))
            .period(200)
            .build()?,
    )
    .with_max_consecutive_skips(50);
    let mut grads = model.alloc_grads();
    let total = epochs * (d.train_len() / BATCH);
    let pb = bar(name, total);
    // The fused ops' buffers are kept from step to step for this run (and count toward its
    // peak); dropping `keep` at its end frees them.
    let keep = mpx::settings::KeepBuffers::new();
    let baseline = heap::reset_peak();
    let (mut busy, mut steps) = (Duration::ZERO, 0u32);
    let mut epoch_loss = Vec::with_capacity(epochs);
    for epoch in 0..epochs {
        let (mut loss_sum, mut hits, mut finite_steps) = (0.0f32, 0usize, 0usize);
        let (mut grew, mut backed_off, mut skipped) = (0, 0, 0);
        let scale_at_start = scaler.loss_scale();
        let batches = vit_batches(dev, d, epoch);
        for (x, y, labels) in &batches {
            opt.cfg.lr = plan.lr_at(steps as usize, total);
            let t = Instant::now();
            let applied = scaler.loss_scale();
            let out =
                scaler.forward(&model, Batch(x.clone().traced(grads)), |m, x| m.forward(x))?;
            let logits = out.retaped::<NoneTape>().array();
            let loss = cross_entropy_with_logits_loss(out, y.clone());
            let loss_value = loss.array();
            grads = scaler.backward(loss)?;
            let outcome = scaler.update(&mut model, &mut opt, &grads)?;
            model.zero_grads(&mut grads);
            let new = scaler.loss_scale();
            busy += t.elapsed();
            steps += 1;
            match outcome {
                UpdateOutcome::Applied => {
                    loss_sum += loss_value;
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
            pb.set_message(format!("scale {}", scaler.loss_scale()));
            pb.inc(1);
        }
        let mean_loss = if finite_steps > 0 {
            loss_sum / finite_steps as f32
        } else {
            f32::NAN
        };
        epoch_loss.push(mean_loss);
        say(
            &pb,
            format!(
                "{name:<5} epoch {:>2}: loss {mean_loss:.4}  train acc {:5.1}%  scale {} -> {} ({} up, {} down)  skipped {}",
                epoch + 1,
                100.0 * hits as f64 / (finite_steps.max(1) * BATCH) as f64,
                scale_at_start,
                scaler.loss_scale(),
                grew,
                backed_off,
                skipped,
            ),
        );
    }
    let peak_bytes = heap::peak() - baseline;
    drop(keep);
    pb.finish_and_clear();
    // Inference in the half precision too: a fresh cast of the trained master.
    let half = cast_module::<H, f32, _>(&*model);
    let test_acc = test_accuracy(d, BATCH, |px| {
        let out = half.forward_in::<H, _>(cast_to_half_precision::<H, _>(&image_tensor(dev, px)));
        widen_rows::<H>(&out)
    });
    Ok(RunResult {
        test_acc,
        step_time: busy / steps.max(1),
        peak_bytes,
        skipped: scaler.skipped_steps(),
        epoch_loss,
    })
}

/// Half logits as f32 rows (exact widening).
fn widen_rows<H: Precision>(out: &Logits<H::Elem, NoneTape>) -> Vec<[f32; CLASSES]>
where
    Cpu: Device<H::Elem>,
{
    let values = out.as_vec();
    let mut wide = vec![0.0f32; values.len()];
    H::widen(&values, &mut wide);
    wide.chunks_exact(CLASSES)
        .map(|r| std::array::from_fn(|i| r[i]))
        .collect()
}

// ---- step time -------------------------------------------------------------------------------

/// One f32 training step per call, from `init`, cycling through `batches`.
fn f32_stepper<'a>(init: &Master, lr: f64, batches: &'a [VitBatch]) -> impl FnMut() + 'a {
    let mut model = init.clone();
    let mut opt = adam(&model, lr);
    let mut grads = Some(model.alloc_grads());
    let mut i = 0;
    move || {
        let (x, y, _) = &batches[i % batches.len()];
        i += 1;
        let g = grads
            .take()
            .expect("gradients are put back after every step");
        let out = model.forward(x.clone().traced(g));
        let mut g = cross_entropy_with_logits_loss(out, y.clone()).backward();
        opt.update(&mut model, &g).expect("all parameters used");
        model.zero_grads(&mut g);
        grads = Some(g);
    }
}

/// One mixed training step in `H` per call (input cast, forward, backward, update), from `init`,
/// cycling through `batches`.
fn mixed_stepper<'a, H>(
    init: &Master,
    lr: f64,
    batches: &'a [VitBatch],
) -> Result<impl FnMut() + 'a, Box<dyn Error>>
where
    H: VitHalf,
    Cpu: MixedDevice<H>,
    Mapped: Kind<H, Master, Cpu, Copy: VitStep<H>>,
{
    let mut model = Mixed::mapped(init.clone());
    let mut opt = adam(&model, lr);
    let mut scaler =
        GradScaler::<H, _>::new(DynamicLossScale::builder().initial(2f32.powi(15)).build()?);
    let mut grads = Some(model.alloc_grads());
    let mut i = 0;
    Ok(move || {
        let (x, y, _) = &batches[i % batches.len()];
        i += 1;
        let g = grads
            .take()
            .expect("gradients are put back after every step");
        let out = scaler
            .forward(&model, Batch(x.clone().traced(g)), |m, x| m.forward(x))
            .expect("the working copy is built");
        let mut g = scaler
            .backward(cross_entropy_with_logits_loss(out, y.clone()))
            .expect("the loss scale is valid");
        scaler
            .update(&mut model, &mut opt, &g)
            .expect("the optimizer belongs to this master");
        model.zero_grads(&mut g);
        grads = Some(g);
    })
}

/// One training step of one run per call.
type Stepper<'a> = Box<dyn FnMut() + 'a>;

/// A stepper (see [`f32_stepper`], [`mixed_stepper`]) for each run in `names`.
fn steppers<'a>(
    names: &[&str],
    init: &Master,
    lr: f64,
    batches: &'a [VitBatch],
) -> Result<Vec<Stepper<'a>>, Box<dyn Error>> {
    let mut out: Vec<Stepper<'a>> = Vec::new();
    for name in names {
        out.push(match *name {
            "f32" => Box::new(f32_stepper(init, lr, batches)),
            "f16" => Box::new(mixed_stepper::<f16>(init, lr, batches)?),
            _ => Box::new(mixed_stepper::<bf16>(init, lr, batches)?),
        });
    }
    Ok(out)
}

/// Runs two steps of each run in `names` on throwaway copies, before anything is measured: the
/// one-time allocations of the process (thread pools, matmul scratch) then land outside every
/// run's peak heap, instead of in the first run's.
fn warm_up(names: &[&str], init: &Master, batches: &[VitBatch]) -> Result<(), Box<dyn Error>> {
    for mut step in steppers(names, init, 1e-3, batches)? {
        step();
        step();
    }
    Ok(())
}

/// Median time of one training step of each run in `names`, measured in interleaved rounds (one
/// step of each run per round) so that a busy neighbour slows every run alike.
fn step_times(
    names: &[&str],
    init: &Master,
    lr: f64,
    batches: &[VitBatch],
    rounds: usize,
) -> Result<Vec<Duration>, Box<dyn Error>> {
    let mut steps = steppers(names, init, lr, batches)?;
    let mut ops: Vec<&mut dyn FnMut()> = steps
        .iter_mut()
        .map(|s| s.as_mut() as &mut dyn FnMut())
        .collect();
    Ok(measure::measure(rounds, &mut ops))
}

// ---- memory ------------------------------------------------------------------------------------

/// Measured bytes of one precision's training state.
#[derive(Debug, Clone, Copy, Default)]
struct Memory {
    weights: usize,
    activations: usize,
    gradients: usize,
    master: usize,
    optimizer: usize,
}

impl Memory {
    fn parts(&self) -> [usize; 5] {
        [
            self.weights,
            self.activations,
            self.gradients,
            self.master,
            self.optimizer,
        ]
    }
}

const MEMORY_PARTS: [&str; 5] = [
    "weights",
    "activations",
    "gradients",
    "master copy",
    "optimizer state",
];

/// Heap bytes that `f` leaves allocated (what it returns, or what it stores in place).
fn retained<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = heap::current();
    let out = f();
    (out, heap::current().saturating_sub(before))
}

/// Adam's state for the f32 master: the heap its first update leaves behind (its two moment
/// buffers are allocated there). The same for every precision: the optimizer runs on the master.
fn adam_state_bytes(dev: &Cpu, x: &Images<f32>, y: &Labels) -> usize {
    let mut model = build_vit(dev);
    let mut opt = adam(&model, 1e-3);
    let out = model.forward(x.clone().traced(model.alloc_grads()));
    let grads = cross_entropy_with_logits_loss(out, y.clone()).backward();
    let ((), bytes) = retained(|| opt.update(&mut model, &grads).expect("all parameters used"));
    bytes
}

fn memory_f32(x: &Images<f32>, y: &Labels) -> Memory {
    let dev = Cpu::seed_from_u64(1);
    let (model, weights) = retained(|| build_vit(&dev));
    let (grads, gradients) = retained(|| model.alloc_grads());
    let (out, activations) = retained(|| model.forward(x.clone().traced(grads)));
    drop(out);
    Memory {
        weights,
        activations,
        gradients,
        master: 0,
        optimizer: adam_state_bytes(&dev, x, y),
    }
}

fn memory_mixed<H>(x: &Images<f32>, y: &Labels) -> Memory
where
    H: VitHalf,
    Cpu: Device<H::Elem>,
    WorkingCopy<H, Master>: TensorCollection<H::Elem, Cpu>
        + MixedModule<
            H,
            Tensor<Rank2<BATCH, FEATURES>, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
            Output = Logits<H::Elem, OwnedTape<H::Elem, Cpu>>,
        >,
    Images<f32>: Cast<H, Output = Images<H::Elem>>,
{
    let dev = Cpu::seed_from_u64(1);
    let (master, master_bytes) = retained(|| build_vit(&dev));
    let (working, weights) = retained(|| cast_module::<H, f32, _>(&master));
    // The scaler holds both: the working copy's gradients and the f32 master-shaped ones.
    let (half_grads, half_grad_bytes) = retained(|| working.alloc_grads());
    let (_master_grads, master_grad_bytes) = retained(|| master.alloc_grads());
    let xh = cast_to_half_precision::<H, _>(x);
    // No `KeepBuffers` lives here: the fused ops' buffers the tape keeps are allocated (and
    // counted) by this forward pass.
    let (out, activations) = retained(|| working.forward_in::<H, _>(xh.traced(half_grads)));
    drop(out);
    Memory {
        weights,
        activations,
        gradients: half_grad_bytes + master_grad_bytes,
        master: master_bytes,
        optimizer: adam_state_bytes(&dev, x, y),
    }
}

fn kib(bytes: usize) -> f64 {
    bytes as f64 / 1024.0
}

// ---- main --------------------------------------------------------------------------------------

fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    let epochs = args.epochs as usize;
    let plan = Plan {
        epochs,
        lr: args.lr,
    };
    let d = Digits::load(0.2, 7);
    println!(
        "digits: {} training and {} test images of 8x8 pixels, {CLASSES} classes",
        d.train_len(),
        d.test_len(),
    );
    let dev = Cpu::seed_from_u64(args.seed);
    let init = build_vit(&dev);
    let params = init.num_trainable_params();
    println!(
        "ViT: {MODEL}; {} parameters; batch {BATCH}, Adam lr {} with cosine decay to 0, {epochs} epochs, seed {}",
        params, args.lr, args.seed
    );

    let wanted = |w: Which| args.precision == w || args.precision == Which::All;
    let names: Vec<&str> = [
        (Which::F32, "f32"),
        (Which::F16, "f16"),
        (Which::Bf16, "bf16"),
    ]
    .into_iter()
    .filter(|(w, _)| wanted(*w))
    .map(|(_, n)| n)
    .collect();
    let timing_batches = vit_batches(&dev, &d, 0);
    warm_up(&names, &init, &timing_batches)?;
    let mut runs: Vec<(&str, RunResult)> = Vec::new();
    if wanted(Which::F32) {
        runs.push(("f32", train_f32(&dev, &d, &init, plan)));
    }
    if wanted(Which::F16) {
        runs.push(("f16", train_mixed::<f16>("f16", &dev, &d, &init, plan)?));
    }
    if wanted(Which::Bf16) {
        runs.push(("bf16", train_mixed::<bf16>("bf16", &dev, &d, &init, plan)?));
    }

    // ---- the results table
    const ROUNDS: usize = 30;
    let times = step_times(&names, &init, plan.lr, &timing_batches, ROUNDS)?;
    let f32_acc = runs
        .iter()
        .find(|(n, _)| *n == "f32")
        .map(|(_, r)| r.test_acc);
    let f32_time = names.iter().position(|n| *n == "f32").map(|i| times[i]);
    println!();
    println!(
        "| run  | test accuracy | vs f32 (points) | step time | step time vs f32 | peak heap during training | skipped steps |"
    );
    println!(
        "|------|---------------|-----------------|-----------|------------------|---------------------------|---------------|"
    );
    for ((name, r), time) in runs.iter().zip(&times) {
        let gap = f32_acc.map_or("-".to_string(), |a| format!("{:+.2}", r.test_acc - a));
        let ratio = f32_time.map_or("-".to_string(), |t| {
            format!("x{:.2}", time.as_secs_f64() / t.as_secs_f64())
        });
        println!(
            "| {name:<4} | {:>12.2}% | {gap:>15} | {:>6.2} ms | {ratio:>16} | {:>21.1} KiB | {:>13} |",
            r.test_acc,
            time.as_secs_f64() * 1e3,
            kib(r.peak_bytes),
            r.skipped
        );
    }
    println!(
        "\nstep time: median of {ROUNDS} interleaved rounds after training (one full step of each run per round, batch {BATCH}, input cast included); \
         peak heap: the most heap in use during the run's training, above what was in use when it started."
    );

    // ---- the memory table
    let (x, y, _) = vit_batches(&dev, &d, 0).swap_remove(0);
    let mut memory: Vec<(&str, Memory)> = Vec::new();
    for (name, _) in &runs {
        let m = match *name {
            "f32" => memory_f32(&x, &y),
            "f16" => memory_mixed::<f16>(&x, &y),
            _ => memory_mixed::<bf16>(&x, &y),
        };
        memory.push((name, m));
    }
    println!();
    println!(
        "| run  |      weights |  activations |    gradients |  master copy | optimizer state |        total |"
    );
    println!(
        "|------|--------------|--------------|--------------|--------------|-----------------|--------------|"
    );
    for (name, m) in &memory {
        let cells: Vec<String> = m
            .parts()
            .iter()
            .map(|&b| format!("{:>8.1} KiB", kib(b)))
            .collect();
        println!(
            "| {name:<4} | {} | {} | {} | {} | {:>15} | {:>8.1} KiB |",
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            cells[4],
            kib(m.parts().iter().sum())
        );
    }
    println!(
        "\nEach cell is measured with the counting allocator: the heap bytes an operation leaves allocated.\n\
         - weights: building the f32 model (f32), or casting the master to the working copy (f16, bf16);\n\
         - activations: one traced forward pass of a batch of {BATCH} (what its tape keeps for the backward pass, and the logits);\n\
         - gradients: allocating the gradients of the weights; for the mixed runs those of the working copy plus the f32 ones of the master, as a mixed step fills both;\n\
         - master copy: building the f32 master (the f32 run trains its weights directly: none);\n\
         - optimizer state: the heap Adam's first update leaves (its two f32 moments per master parameter).\n\
         For scale: {params} parameters are {:.1} KiB in f32 and {:.1} KiB in f16; the heap cells add per-tensor bookkeeping (shared buffers, the gradients' hash map).\n\
         Emulated bf16 stores its values in f32 (dfdx 0.13 has no bf16 dtype), so its tensors are as large as f32's; it keeps fewer of them than the f32 run only because mpx's fused half-precision ops save less for the backward pass than dfdx's ops. A native bf16 would halve its weights, activations and working-copy gradients as f16 does.",
        kib(params * 4),
        kib(params * 2),
    );

    // ---- pictures
    let dir = plot::plot_dir()?;
    let loss_path = dir.join("vit_loss.svg");
    let curves: Vec<(&str, &[f32])> = runs
        .iter()
        .map(|(n, r)| (*n, r.epoch_loss.as_slice()))
        .collect();
    plot::loss_curves(&loss_path, "ViT on 8x8 digits: training loss", &curves)?;
    let memory_path = dir.join("vit_memory.svg");
    let bars: Vec<(&str, Vec<f64>)> = memory
        .iter()
        .map(|(n, m)| (*n, m.parts().iter().map(|&b| kib(b)).collect()))
        .collect();
    plot::grouped_bars(
        &memory_path,
        "ViT training memory by component",
        "KiB",
        &MEMORY_PARTS,
        &bars,
    )?;
    println!("\nloss curves: {}", loss_path.display());
    println!("memory breakdown: {}", memory_path.display());

    // ---- each half run within 1 point of f32
    if let Some(a) = f32_acc {
        for (name, r) in runs.iter().filter(|(n, _)| *n != "f32") {
            let gap = (r.test_acc - a).abs();
            println!("{name} vs f32: {gap:.2} points apart (must be within 1)");
            if gap > 1.0 {
                return Err(format!(
                    "{name} is {gap:.2} points from f32 in test accuracy, more than 1"
                )
                .into());
            }
        }
    }
    Ok(())
}
