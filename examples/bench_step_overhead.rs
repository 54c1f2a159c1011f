//! The fixed cost of a mixed step (issue 32, item 2): tiny models, where the step's own machinery
//! (building the working copy, the region's bridges, the verdict) is most of the time, against
//! dfdx's f32 step on the same model and batch. Each model is written as dfdx users write it and
//! converted with `#[mixed_step]` alone; every pair runs in interleaved rounds (one step of each
//! per round) and the table shows the median of each and their ratio.
//!
//! ```text
//! cargo run --release --example bench_step_overhead [-- ROUNDS] [--avx2]
//! ```
//!
//! `--avx2` forces mpx's GEMM onto its AVX2 + FMA path, the instructions of a CPU without AVX-512
//! (dfdx's f32 step and mpx's element-wise passes keep this CPU's own).
//!
//! Models: a 2-2-1 XOR net (batch 4), a 16-32-4 MLP (batch 32), a 64-128-128-8 policy (batch 64,
//! the sizes RL loops use), each with Adam.
//!
//! `--profile xor|mlp|policy [f32|mixed]` runs one model's pair (or one step of it alone) many
//! times, untimed, for a profiler; `valgrind --tool=callgrind` on each step alone counts what
//! the mixed step adds (`docs/benchmarks.md`).

use std::time::Duration;

use dfdx::{optim::*, prelude::*};
use mpx::mixed_step;
use mpx::step::GradScaler;

#[path = "common/measure.rs"]
mod measure;

/// One model, its batch and the step in both forms (a macro: every model has its own types).
macro_rules! model {
    ($name:ident, $arch:ty, $b:expr, $i:expr, $o:expr) => {
        mod $name {
            use super::*;
            pub type Model = <$arch as BuildOnDevice<Cpu, f32>>::Built;
            pub type X = Tensor<Rank2<$b, $i>, f32, Cpu>;
            pub type Y = Tensor<Rank2<$b, $o>, f32, Cpu>;

            pub fn f32_step(
                model: &mut Model,
                opt: &mut Adam<Model, f32, Cpu>,
                grads: Gradients<f32, Cpu>,
                x: &X,
                y: &Y,
            ) -> Gradients<f32, Cpu> {
                let out = model.forward(x.trace(grads));
                let mut grads = mse_loss(out, y.clone()).backward();
                opt.update(model, &grads).unwrap();
                model.zero_grads(&mut grads);
                grads
            }

            #[mixed_step(scaling = scaler)]
            pub fn mixed_step(
                model: &mut Model,
                opt: &mut Adam<Model, f32, Cpu>,
                grads: Gradients<f32, Cpu>,
                x: &X,
                y: &Y,
                scaler: &mut GradScaler,
            ) -> Gradients<f32, Cpu> {
                let out = model.forward(x.trace(grads));
                let mut grads = mse_loss(out, y.clone()).backward();
                opt.update(model, &grads).unwrap();
                model.zero_grads(&mut grads);
                grads
            }

            /// (f32 step, mixed step) medians over `rounds` interleaved rounds; with `only`
            /// (0: the f32 step, 1: the mixed step), that step alone `rounds` times, untimed (for
            /// a profiler or an instruction count).
            pub fn run(rounds: usize, only: Option<usize>) -> (Duration, Duration) {
                let dev = Cpu::seed_from_u64(0);
                let init = dev.build_module::<$arch, f32>();
                let x: X = dev.sample_normal();
                let y: Y = dev.sample_normal();
                let (mut a, mut b) = (init.clone(), init);
                let (mut oa, mut ob) = (
                    Adam::new(&a, Default::default()),
                    Adam::new(&b, Default::default()),
                );
                let (mut ga, mut gb) = (Some(a.alloc_grads()), Some(b.alloc_grads()));
                let mut scaler = GradScaler::default();
                let mut ops: [&mut dyn FnMut(); 2] = [
                    &mut || ga = Some(f32_step(&mut a, &mut oa, ga.take().unwrap(), &x, &y)),
                    &mut || {
                        gb = Some(mixed_step(
                            &mut b,
                            &mut ob,
                            gb.take().unwrap(),
                            &x,
                            &y,
                            &mut scaler,
                        ))
                    },
                ];
                let t = match only {
                    Some(i) => {
                        (0..rounds).for_each(|_| ops[i]());
                        vec![Duration::ZERO; 2]
                    }
                    None => measure::measure(rounds, &mut ops),
                };
                if only != Some(0) {
                    assert!(scaler.last_step().is_some_and(|s| s.mpx_layers));
                }
                (t[0], t[1])
            }
        }
    };
}

model!(xor, (Linear<2, 2>, Tanh, Linear<2, 1>), 4, 2, 1);
model!(mlp, (Linear<16, 32>, ReLU, Linear<32, 4>), 32, 16, 4);
model!(
    policy,
    (
        Linear<64, 128>,
        ReLU,
        Linear<128, 128>,
        ReLU,
        Linear<128, 8>
    ),
    64,
    64,
    8
);

fn main() {
    // `--profile xor|mlp|policy [f32|mixed]`: one pair (or one step of it) for a profiler, many
    // rounds
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--profile") {
        let only = match args.get(i + 2).map(String::as_str) {
            Some("f32") => Some(0),
            Some("mixed") => Some(1),
            _ => None,
        };
        match args.get(i + 1).map(String::as_str) {
            Some("mlp") => drop(mlp::run(100_000, only)),
            Some("policy") => drop(policy::run(10_000, only)),
            _ => drop(xor::run(200_000, only)),
        }
        return;
    }
    let rounds: usize = args
        .iter()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2001);
    measure::on_path(args.iter().any(|a| a == "--avx2"), || table(rounds));
}

/// Runs every model for `rounds` rounds and prints the table.
fn table(rounds: usize) {
    let cpu = measure::cpu_name();
    let path = mpx::__bench::active_path();
    println!(
        "mixed f16 step (`#[mixed_step]`, mapped) vs dfdx's f32 step, median of {rounds} interleaved rounds, mpx's GEMM on {path:?}, {cpu}"
    );
    println!("| model | batch | f32 step | mixed step | mixed / f32 |");
    println!("|---|---|---|---|---|");
    for (name, batch, (f, m)) in [
        ("2-2-1 (Tanh)", 4, xor::run(rounds, None)),
        ("16-32-4 (ReLU)", 32, mlp::run(rounds, None)),
        ("64-128-128-8 (ReLU)", 64, policy::run(rounds, None)),
    ] {
        println!(
            "| {name} | {batch} | {:.1} µs | {:.1} µs | {:.2} |",
            f.as_secs_f64() * 1e6,
            m.as_secs_f64() * 1e6,
            m.as_secs_f64() / f.as_secs_f64()
        );
    }
}
