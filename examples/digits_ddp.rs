//! Data-parallel mixed-precision training of the digits MLP over MPI (feature `mpi`): every rank
//! runs the `#[mixed_step]` of `examples/digits.rs`, unchanged, on its shard of each global batch;
//! the `GradScaler` carries a `Reducer` that averages the gradients across the ranks.
//!
//! ```text
//! cargo build --release --features mpi --example digits_ddp
//! mpirun -np 2 target/release/examples/digits_ddp                  # f32 all-reduce
//! mpirun -np 2 target/release/examples/digits_ddp --allreduce f16  # half the bytes
//! ```
//!
//! (As root, Open MPI wants `--allow-run-as-root`; with more ranks than cores, `--oversubscribe`.)
//!
//! The global batch is 48 images, split evenly over 1, 2, 3, 4, 6 or 8 ranks. Every rank also
//! trains the same model in one process on the whole global batch (the reference), under the
//! same load; rank 0 prints both runs' loss, test accuracy and time per step, and at the end one
//! line saying whether the ranks agree: masters bit for bit, the loss-scale trajectory and every
//! skip decision. It exits with an error when they do not.

#[path = "../tests/common/digits.rs"]
mod digits;
#[path = "common/train.rs"]
mod train;

use std::time::{Duration, Instant};

use clap::Parser;
use dfdx::{optim::*, prelude::*};
use digits::{CLASSES, Digits, FEATURES};
use mpx::cast::{cast_module, cast_to_half_precision};
use mpx::distributed::mpi::traits::Communicator;
use mpx::distributed::{AllReduceDtype, Reducer, mpi};
use mpx::precision::f16;
use mpx::scaling::DynamicLossScale;
use mpx::step::GradScaler;

const GLOBAL: usize = 48;
const HIDDEN: usize = 128;
/// mpx's fused MLP of `examples/digits.rs`.
type Model = <digits::FusedMlp<HIDDEN> as BuildOnDevice<Cpu, f32>>::Built;
type X<const B: usize> = Tensor<Rank2<B, FEATURES>, f32, Cpu>;
type Y<const B: usize> = Tensor<Rank2<B, CLASSES>, f32, Cpu>;

#[derive(Parser)]
#[command(about = "Data-parallel mixed-precision training of the digits MLP over MPI")]
struct Args {
    /// The type the gradients travel in: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    allreduce: String,
    /// Epochs.
    #[arg(long, default_value_t = 20)]
    epochs: usize,
    /// The initial loss scale (2^24 overflows f16 at first, on purpose).
    #[arg(long, default_value_t = 16_777_216.0)]
    initial_scale: f32,
}

/// The digits example's step: ordinary dfdx code, the attribute and the scaler added. The scaler
/// decides whether it is also data-parallel.
#[mpx::mixed_step(scaling = scaler)]
fn step<const B: usize>(
    model: &mut Model,
    opt: &mut Adam<Model, f32, Cpu>,
    grads: Gradients<f32, Cpu>,
    x: &X<B>,
    y: &Y<B>,
    scaler: &mut GradScaler<f16>,
) -> (f32, Gradients<f32, Cpu>) {
    let out = model.forward(x.clone().traced(grads));
    let loss = cross_entropy_with_logits_loss(out, y.clone());
    let loss_value = loss.array();
    let mut grads = loss.backward();
    opt.update(model, &grads).expect("all parameters used");
    model.zero_grads(&mut grads);
    (loss_value, grads)
}

/// What a run reports.
struct Run {
    model: Model,
    /// Mean loss of the last epoch's applied steps (over all ranks).
    loss: f32,
    test_acc: f64,
    step_time: Duration,
    reduce_time: Duration,
    skipped: u64,
    steps: u64,
    scale: f32,
    /// The loss scale after each step, and whether each step was applied.
    trajectory: Vec<u64>,
    decisions: Vec<u64>,
}

/// Trains from `init` on rows `first..first + B` of every global batch, with `scaler` (with or
/// without a reducer). `stats` averages the per-rank epoch losses (a plain f32 reducer; `None` for
/// the single-process run). Rank 0 prints each epoch when `print`.
fn train<const B: usize>(
    d: &Digits,
    init: &Model,
    first: usize,
    mut scaler: GradScaler<f16>,
    mut stats: Option<&mut Reducer>,
    epochs: usize,
    print: bool,
) -> Result<Run, Box<dyn std::error::Error>> {
    let dev = Cpu::default();
    let mut model = init.clone();
    let mut opt = Adam::new(
        &model,
        AdamConfig {
            lr: 1e-3,
            ..Default::default()
        },
    );
    let mut grads = model.alloc_grads();
    let (mut times, mut reduce_times) = (vec![], vec![]);
    let (mut trajectory, mut decisions) = (vec![], vec![]);
    let mut loss = f32::NAN;
    for epoch in 0..epochs {
        let order = d.epoch_order(epoch);
        let (mut sum, mut applied) = (0.0f32, 0.0f32);
        for global in order.chunks_exact(GLOBAL) {
            let (x, y) = d.train_batch::<B>(&dev, &global[first..first + B]);
            let t = Instant::now();
            let (l, g) = step(&mut model, &mut opt, grads, &x, &y, &mut scaler);
            times.push(t.elapsed());
            grads = g;
            if let Some(r) = scaler.reducer() {
                reduce_times.push(r.last_reduction().time);
            }
            let ok = scaler.last_step().is_some_and(|s| s.is_applied());
            if ok {
                sum += l;
                applied += 1.0;
            }
            decisions.push(u64::from(ok));
            trajectory.push(u64::from(scaler.loss_scale().to_bits()));
        }
        let mut mean = [sum, applied];
        if let Some(r) = stats.as_deref_mut() {
            // sums over the ranks' shards: the mean of the ranks' means (equal shards)
            r.all_reduce_mean(&mut mean, 1.0)?;
        }
        loss = mean[0] / mean[1].max(1.0);
        if print {
            println!(
                "  epoch {:>2}: loss {loss:.4}  loss scale {:>8}  skipped so far {}",
                epoch + 1,
                scaler.loss_scale(),
                scaler.skipped_steps()
            );
        }
    }
    let half = cast_module::<f16, f32, _>(&model);
    let test_acc = train::test_accuracy(d, 32, |px| {
        let x: X<32> = dev.tensor_from_vec(px, (Const, Const));
        half.forward(cast_to_half_precision::<f16, _>(&x))
            .to_dtype::<f32>()
            .array()
            .to_vec()
    });
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v.get(v.len() / 2).copied().unwrap_or_default()
    };
    Ok(Run {
        model,
        loss,
        test_acc,
        step_time: median(times),
        reduce_time: median(reduce_times),
        skipped: scaler.skipped_steps(),
        steps: scaler.applied_steps() + scaler.skipped_steps(),
        scale: scaler.loss_scale(),
        trajectory,
        decisions,
    })
}

fn scaler(initial: f32) -> Result<GradScaler<f16>, Box<dyn std::error::Error>> {
    // 2^24 by default, too high for f16 on purpose, as in `digits`: the first steps overflow and
    // are skipped, on every rank alike
    let scaling = DynamicLossScale::builder()
        .initial(initial)
        .period(400)
        .build()?;
    Ok(GradScaler::<f16>::new(scaling).with_max_consecutive_skips(50))
}

fn max_abs_diff(a: &Model, b: &Model) -> f32 {
    let flat = |m: &Model| {
        let mut v = vec![];
        v.extend(m.0.weight.as_vec());
        v.extend(m.0.bias.as_vec());
        v.extend(m.1.weight.as_vec());
        v.extend(m.1.bias.as_vec());
        v.extend(m.2.weight.as_vec());
        v.extend(m.2.bias.as_vec());
        v
    };
    flat(a)
        .iter()
        .zip(&flat(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn run<const B: usize>(
    world: &impl Communicator,
    args: &Args,
) -> Result<bool, Box<dyn std::error::Error>> {
    let dtype = match args.allreduce.as_str() {
        "f32" => AllReduceDtype::F32,
        "f16" => AllReduceDtype::F16,
        "bf16" => AllReduceDtype::Bf16,
        other => return Err(format!("--allreduce {other}: expected f32, f16 or bf16").into()),
    };
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let lead = rank == 0;
    let d = Digits::load(0.2, 7);
    let mut stats = Reducer::new(world);
    // every rank draws its own weights; rank 0's are broadcast, as DDP does
    let mut init = Cpu::seed_from_u64(rank as u64).build_module::<digits::FusedMlp<HIDDEN>, f32>();
    stats.broadcast_model(&mut init, 0)?;
    if lead {
        println!(
            "digits_ddp: {size} rank(s) x {B} images (global batch {GLOBAL}), {} all-reduce, mixed f16 steps (#[mixed_step]), Adam, {} epochs, {} training and {} test images",
            dtype.name(),
            args.epochs,
            d.train_len(),
            d.test_len()
        );
        println!("one process on the global batch of {GLOBAL} (the reference, on every rank):");
    }
    let single = train::<GLOBAL>(
        &d,
        &init,
        0,
        scaler(args.initial_scale)?,
        None,
        args.epochs,
        lead,
    )?;
    if lead {
        println!("{size} rank(s), {B} images each:");
    }
    let reducer = Reducer::new(world).with_dtype(dtype);
    let ddp = train::<B>(
        &d,
        &init,
        rank * B,
        scaler(args.initial_scale)?.with_reducer(reducer),
        Some(&mut stats),
        args.epochs,
        lead,
    )?;
    // the one question: do the ranks agree?
    let masters = stats.models_agree(&ddp.model)?;
    let scales = stats.values_agree(&ddp.trajectory)?;
    let skips = stats.values_agree(&ddp.decisions)?;
    let agree = masters && scales && skips;
    if lead {
        let share = ddp.reduce_time.as_secs_f64() / ddp.step_time.as_secs_f64();
        println!();
        println!(
            "| run | last-epoch loss | test accuracy | time per step | all-reduce | skipped steps |"
        );
        println!("|---|---|---|---|---|---|");
        println!(
            "| {size} rank(s) x {B}, {} all-reduce | {:.4} | {:.2}% | {:.3} ms | {:.3} ms ({:.0}% of the step) | {} of {} |",
            dtype.name(),
            ddp.loss,
            ddp.test_acc,
            ddp.step_time.as_secs_f64() * 1e3,
            ddp.reduce_time.as_secs_f64() * 1e3,
            share * 100.0,
            ddp.skipped,
            ddp.steps
        );
        println!(
            "| 1 process x {GLOBAL} | {:.4} | {:.2}% | {:.3} ms | - | {} of {} |",
            single.loss,
            single.test_acc,
            single.step_time.as_secs_f64() * 1e3,
            single.skipped,
            single.steps
        );
        println!(
            "\nmedian times per step; {size} rank(s) and the reference share the machine's cores alike.\nmax |master({size} ranks) - master(1 process)| = {:.2e}, loss scale {} vs {}: each rank's loss is its shard's mean, so its scaled half gradients are {size}x the global batch's and overflow f16 at other steps; and Adam turns rounding differences into whole steps of lr over {} steps (tests/distributed.rs checks the agreement with SGD, where it is 1e-4 or better)",
            max_abs_diff(&ddp.model, &single.model),
            ddp.scale,
            single.scale,
            ddp.steps
        );
        println!(
            "ranks agree: {} (masters {}, loss-scale trajectory {}, skip decisions {}: {} skipped of {} on each of {size} rank(s))",
            if agree { "yes" } else { "NO" },
            if masters { "bit-identical" } else { "DIFFER" },
            if scales { "identical" } else { "DIFFERS" },
            if skips { "identical" } else { "DIFFER" },
            ddp.skipped,
            ddp.steps
        );
    }
    Ok(agree)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let universe = mpi::initialize().ok_or("MPI was initialised already")?;
    mpx::settings::set_max_threads(1);
    let world = universe.world();
    let agree = match world.size() {
        1 => run::<GLOBAL>(&world, &args)?,
        2 => run::<{ GLOBAL / 2 }>(&world, &args)?,
        3 => run::<{ GLOBAL / 3 }>(&world, &args)?,
        4 => run::<{ GLOBAL / 4 }>(&world, &args)?,
        6 => run::<{ GLOBAL / 6 }>(&world, &args)?,
        8 => run::<{ GLOBAL / 8 }>(&world, &args)?,
        n => {
            return Err(format!(
                "{n} ranks: the global batch of {GLOBAL} splits over 1, 2, 3, 4, 6 or 8"
            )
            .into());
        }
    };
    if agree {
        Ok(())
    } else {
        Err("the ranks disagree".into())
    }
}
