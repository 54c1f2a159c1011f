//! A scaler changes nothing of the process (no allocator setting), and a converted step faults
//! few pages in after its first steps: its working copy and its half gradients are allocated on
//! a device of the scaler's own whose cache takes them back, the fused ops pool their buffers.
//! Counted with the process's minor page faults (`/proc/self/stat`, Linux, glibc). This binary
//! has no test harness (`harness = false`): it runs on the main thread of a fresh process
//! (glibc's main arena, where a training loop runs), with nothing else beside it.

#![cfg_attr(
    not(all(target_os = "linux", target_env = "gnu")),
    allow(dead_code, unused_imports)
)]

use dfdx::optim::{Adam, AdamConfig};
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::{bf16, f16};
use mpx::step::GradScaler;

/// Outputs of 256 x 1024 values (1 MiB in f32, 512 KiB in f16): above glibc's first mmap
/// threshold, 128 KiB.
type Mlp = (
    Linear<512, 1024>,
    ReLU,
    Linear<1024, 1024>,
    ReLU,
    Linear<1024, 10>,
);
type Model = <Mlp as BuildOnDevice<Cpu, f32>>::Built;
type X = Tensor<Rank2<256, 512>, f32, Cpu>;
type Y = Tensor<Rank2<256, 10>, f32, Cpu>;

macro_rules! steps {
    ($($name:ident: $h:ty),*) => {$(
        #[mixed_step(scaling = scaler)]
        fn $name(
            model: &mut Model,
            opt: &mut Adam<Model, f32, Cpu>,
            grads: Gradients<f32, Cpu>,
            x: &X,
            y: &Y,
            scaler: &mut GradScaler<$h>,
        ) -> Gradients<f32, Cpu> {
            let out = model.forward(x.trace(grads));
            let mut grads = cross_entropy_with_logits_loss(out, y.clone()).backward();
            opt.update(model, &grads).unwrap();
            model.zero_grads(&mut grads);
            grads
        }
    )*};
}
steps!(step_f16: f16, step_bf16: bf16);

/// The process's minor page faults so far (field 10 of `/proc/self/stat`).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // fields after the command name, which is in parentheses and may hold spaces
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    rest.split(' ').nth(7).unwrap().parse().unwrap()
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn main() {
    println!("skipped: page faults are counted from /proc/self/stat, with glibc's malloc");
}

/// Faults per round of `n` rounds (after one unmeasured round) of allocating eight 1 MiB buffers,
/// writing them and freeing them all: what a step's output tensors do. glibc raises its mmap
/// threshold to 1 MiB at the first free, but then trims the heap's free top back to the system
/// whenever it passes twice that, so each round faults its pages in again, unless it was told
/// to keep more.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn churn(n: u64) -> u64 {
    let round = |i: u64| {
        let bufs: Vec<Vec<f32>> = (0..8)
            .map(|_| {
                #[allow(clippy::cast_precision_loss)]
                let v = vec![i as f32 + 1.0; 1 << 18];
                v
            })
            .collect();
        std::hint::black_box(&bufs);
    };
    round(0);
    let before = minor_faults();
    for i in 0..n {
        round(i);
    }
    (minor_faults() - before) / n
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn main() {
    // A fresh process: glibc gives such buffers back to the system each round, and a scaler
    // changes nothing of that (a library keeps no process-wide side effects).
    let fresh = churn(8);
    let s16 = GradScaler::<f16>::default();
    let after = churn(8);
    assert!(fresh >= 64, "{fresh} faults per round before any scaler");
    assert!(
        after + 16 >= fresh,
        "{after} faults per round after a scaler was made, {fresh} before: the scaler changed the allocator"
    );
    println!(
        "a scaler leaves the allocator as it is: ok ({fresh} faults per round of 8 MiB before, {after} after)"
    );

    let dev = Cpu::seed_from_u64(9);
    let x: X = dev.sample_normal();
    let y: Y = dev.sample_normal::<Rank2<256, 10>>().softmax::<Axis<1>>();
    let mut model = dev.build_module::<Mlp, f32>();
    let mut opt = Adam::new(&model, AdamConfig::default());
    let (mut s16, mut sbf) = (s16, GradScaler::<bf16>::default());
    // the gradients allocated once and reused, as a loop that cares about allocations does
    // (allocating model-sized gradients each step happens to keep freed memory in glibc too)
    let mut grads = Some(model.alloc_grads());
    let mut run = |n: usize, bf: bool| {
        for _ in 0..n {
            let g = grads.take().unwrap();
            grads = Some(if bf {
                step_bf16(&mut model, &mut opt, g, &x, &y, &mut sbf)
            } else {
                step_f16(&mut model, &mut opt, g, &x, &y, &mut s16)
            });
        }
    };
    let mut per_step = 0;
    for bf in [false, true] {
        run(3, bf);
        let before = minor_faults();
        run(10, bf);
        per_step = per_step.max((minor_faults() - before) / 10);
    }
    {
        let mut m32 = dev.build_module::<Mlp, f32>();
        let mut o32 = Adam::new(&m32, AdamConfig::default());
        let mut g = Some(m32.alloc_grads());
        let mut run32 = |n: usize| {
            for _ in 0..n {
                let out = m32.forward(x.trace(g.take().unwrap()));
                let mut gr = cross_entropy_with_logits_loss(out, y.clone()).backward();
                o32.update(&mut m32, &gr).unwrap();
                m32.zero_grads(&mut gr);
                g = Some(gr);
            }
        };
        run32(3);
        let before = minor_faults();
        run32(10);
        println!("f32 per step {}", (minor_faults() - before) / 10);
    }
    assert!(s16.last_step().unwrap().is_applied() && sbf.last_step().unwrap().is_applied());
    // each step's outputs alone span over 300 pages; a handful of faults per step is noise
    println!("per step {per_step}");
    println!("a mixed step faults no pages in after the first steps: ok ({per_step} per step)");
}
