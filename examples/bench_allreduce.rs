//! The gradient all-reduce in f32 (MPI's `MPI_Allreduce`) against f16 and bf16 (mpx's ring over
//! MPI point-to-point messages), on whatever transport `mpirun` picks (on one machine: shared
//! memory, loopback): bytes, time, and the share of a training step.
//!
//! ```text
//! cargo build --release --features mpi --example bench_allreduce
//! mpirun -np 2 target/release/examples/bench_allreduce
//! ```
//!
//! Part 1 times [`Reducer::all_reduce_mean`] alone on buffers from the digits MLP's 26k
//! gradients to 16M (a 64 MiB f32 model); the dtypes alternate round by round, each round starts
//! at a barrier, and rank 0 reports the median and the fastest round (on a shared machine the
//! fastest is the one a busy neighbour disturbed least). Part 2 times the digits MLP's data-parallel
//! `#[mixed_step]` (48 images split over the ranks, Adam) with each wire type, and the share of
//! the step its all-reduce takes.

#[path = "../tests/common/digits.rs"]
mod digits;

use std::time::{Duration, Instant};

use dfdx::{optim::*, prelude::*};
use digits::{CLASSES, Digits, FEATURES};
use mpx::distributed::mpi::traits::{Communicator, CommunicatorCollectives};
use mpx::distributed::{AllReduceDtype, Reducer, mpi};
use mpx::precision::f16;
use mpx::scaling::DynamicLossScale;
use mpx::step::GradScaler;

const DTYPES: [AllReduceDtype; 3] = [
    AllReduceDtype::F32,
    AllReduceDtype::F16,
    AllReduceDtype::Bf16,
];

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn fastest(v: &[Duration]) -> Duration {
    v.iter().copied().min().unwrap_or_default()
}

fn buffers(
    world: &impl CommunicatorCollectives,
    rank: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let size = world.size() as usize;
    let mut reducers: Vec<Reducer> = DTYPES
        .iter()
        .map(|&d| Reducer::new(world).with_dtype(d))
        .collect();
    if rank == 0 {
        println!("## the all-reduce alone ({size} ranks)\n");
        println!(
            "| elements | wire | payload per rank | sent per rank (ring) | median time | fastest | payload / median | median vs f32 | fastest vs f32 |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
    }
    for n in [26_122usize, 262_144, 1 << 20, 1 << 22, 1 << 24] {
        let rounds = if n >= 1 << 22 { 20 } else { 100 };
        // gradient-like values, different on each rank
        let src: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 + rank * 104_729) % 2001) as f32 * 1e-6 - 1e-3)
            .collect();
        let mut data = src.clone();
        let mut times = vec![Vec::with_capacity(rounds); DTYPES.len()];
        for round in 0..=rounds {
            for (k, r) in reducers.iter_mut().enumerate() {
                data.copy_from_slice(&src);
                world.barrier();
                let t = Instant::now();
                let finite = r.all_reduce_mean(&mut data, 65536.0)?;
                let dt = t.elapsed();
                if !finite {
                    return Err("a finite buffer came back non-finite".into());
                }
                if round > 0 {
                    times[k].push(dt);
                }
            }
        }
        if rank == 0 {
            let f32_median = median(times[0].clone()).as_secs_f64();
            let f32_fastest = fastest(&times[0]).as_secs_f64();
            for (k, d) in DTYPES.iter().enumerate() {
                let t = median(times[k].clone()).as_secs_f64();
                let best = fastest(&times[k]).as_secs_f64();
                let payload = n * d.bytes();
                let sent = 2 * (size - 1) * payload / size;
                println!(
                    "| {n} | {} | {:.2} MiB | {:.2} MiB | {:.3} ms | {:.3} ms | {:.2} GB/s | x{:.2} | x{:.2} |",
                    d.name(),
                    payload as f64 / (1 << 20) as f64,
                    sent as f64 / (1 << 20) as f64,
                    t * 1e3,
                    best * 1e3,
                    payload as f64 / t / 1e9,
                    t / f32_median,
                    best / f32_fastest
                );
            }
        }
    }
    Ok(())
}

const GLOBAL: usize = 48;
const HIDDEN: usize = 128;
type Model = <digits::FusedMlp<HIDDEN> as BuildOnDevice<Cpu, f32>>::Built;

#[mpx::mixed_step(scaling = scaler)]
fn step<const B: usize>(
    model: &mut Model,
    opt: &mut Adam<Model, f32, Cpu>,
    grads: Gradients<f32, Cpu>,
    x: &Tensor<Rank2<B, FEATURES>, f32, Cpu>,
    y: &Tensor<Rank2<B, CLASSES>, f32, Cpu>,
    scaler: &mut GradScaler<f16>,
) -> Gradients<f32, Cpu> {
    let out = model.forward(x.clone().traced(grads));
    let loss = cross_entropy_with_logits_loss(out, y.clone());
    let mut grads = loss.backward();
    opt.update(model, &grads).expect("all parameters used");
    model.zero_grads(&mut grads);
    grads
}

fn steps<const B: usize>(
    world: &impl CommunicatorCollectives,
    rank: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    const ROUNDS: usize = 300;
    let size = world.size() as usize;
    let d = Digits::load(0.2, 7);
    let dev = Cpu::default();
    let init = Cpu::seed_from_u64(0).build_module::<digits::FusedMlp<HIDDEN>, f32>();
    let order = d.epoch_order(0);
    let batches: Vec<_> = order
        .chunks_exact(GLOBAL)
        .map(|g| d.train_batch::<B>(&dev, &g[rank * B..(rank + 1) * B]))
        .collect();
    let mut runs: Vec<_> = DTYPES
        .iter()
        .map(|&dt| {
            let scaler = GradScaler::<f16>::new(DynamicLossScale::default())
                .with_reducer(Reducer::new(world).with_dtype(dt));
            let m = init.clone();
            let opt = Adam::new(&m, AdamConfig::default());
            let g = m.alloc_grads();
            (scaler, m, opt, Some(g))
        })
        .collect();
    let mut times = vec![(vec![], vec![]); DTYPES.len()];
    for round in 0..ROUNDS + 10 {
        let (x, y) = &batches[round % batches.len()];
        for (k, (scaler, m, opt, g)) in runs.iter_mut().enumerate() {
            world.barrier();
            let t = Instant::now();
            *g = Some(step(
                m,
                opt,
                g.take().ok_or("gradients handed back")?,
                x,
                y,
                scaler,
            ));
            let dt = t.elapsed();
            if round >= 10 {
                times[k].0.push(dt);
                times[k]
                    .1
                    .push(scaler.reducer().ok_or("a reducer")?.last_reduction().time);
            }
        }
    }
    if rank == 0 {
        let grads = runs[0]
            .0
            .reducer()
            .ok_or("a reducer")?
            .last_reduction()
            .elements;
        println!(
            "\n## the digits MLP's data-parallel step ({size} ranks x {B} images, {grads} gradients, Adam, mixed f16)\n"
        );
        println!(
            "| wire | payload per rank | median step | median all-reduce | share of the step |"
        );
        println!("|---|---|---|---|---|");
        for (k, d) in DTYPES.iter().enumerate() {
            let (s, r) = (median(times[k].0.clone()), median(times[k].1.clone()));
            println!(
                "| {} | {:.1} KiB | {:.3} ms | {:.3} ms | {:.0}% |",
                d.name(),
                (grads * d.bytes()) as f64 / 1024.0,
                s.as_secs_f64() * 1e3,
                r.as_secs_f64() * 1e3,
                100.0 * r.as_secs_f64() / s.as_secs_f64()
            );
        }
        println!(
            "\nmedians of {ROUNDS} rounds (the three wire types alternate; each step starts at a barrier); the all-reduce includes the header that agrees on finiteness and layout"
        );
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let universe = mpi::initialize().ok_or("MPI was initialised already")?;
    mpx::settings::set_max_threads(1);
    let world = universe.world();
    let rank = world.rank() as usize;
    buffers(&world, rank)?;
    match world.size() {
        1 => steps::<GLOBAL>(&world, rank),
        2 => steps::<{ GLOBAL / 2 }>(&world, rank),
        3 => steps::<{ GLOBAL / 3 }>(&world, rank),
        4 => steps::<{ GLOBAL / 4 }>(&world, rank),
        n => Err(format!("{n} ranks: run with 1 to 4").into()),
    }
}
