//! Page faults per training step of mpx's fused layers (issue 17, item 3): bench_step's row f
//! (MLP 512-1024-1024-10 of `mpx::nn::{LinearReLU, Linear}`, batch 256, Adam, a
//! `GradScaler<f16>`), counted by the kernel for this process (minor faults, field 10 of
//! `/proc/self/stat`; Linux only) over the steps after a warm-up.
//!
//! ```text
//! cargo run --release --example bench_faults [-- STEPS]
//! ```
//!
//! A fault is the first touch of a fresh 4 KiB page: a step that allocates a large buffer anew
//! (and frees it after) pays one per page it writes.

use dfdx::{optim::*, prelude::*};
use mpx::nn;
use mpx::precision::f16;
use mpx::scaling::DynamicLossScale;
use mpx::step::GradScaler;

type Mlp = (
    nn::builders::LinearReLU<512, 1024>,
    nn::builders::LinearReLU<1024, 1024>,
    nn::builders::Linear<1024, 10>,
);
type Master = <Mlp as BuildOnDevice<Cpu, f32>>::Built;

const BATCH: usize = 256;
const WARM_UP: usize = 3;
/// Counted steps when no count is given.
const STEPS: usize = 30;

/// This process's minor page faults so far (`None` where `/proc` is not there).
fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    // field 10 (minflt) is the 8th after the command name
    rest.split_whitespace().nth(7)?.parse().ok()
}

fn main() {
    let steps: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(STEPS);
    let dev = Cpu::seed_from_u64(0);
    let mut model = dev.build_module::<Mlp, f32>();
    let mut opt: Adam<Master, f32, Cpu> = Adam::new(&model, AdamConfig::default());
    let scaling = DynamicLossScale::builder()
        .initial(65536.0)
        .build()
        .expect("a valid loss scale");
    let mut scaler = GradScaler::<f16, _>::new(scaling);
    let x: Tensor<Rank2<BATCH, 512>, f32, Cpu> = dev.sample_normal();
    let mut labels = vec![0.0f32; BATCH * 10];
    for r in 0..BATCH {
        labels[r * 10 + (r * 7) % 10] = 1.0;
    }
    let y: Tensor<Rank2<BATCH, 10>, f32, Cpu> = dev.tensor_from_vec(labels, (Const, Const));
    let mut grads = Some(model.alloc_grads());
    let mut step = || {
        let g = grads.take().expect("gradients present");
        let out = scaler.forward(&model, x.clone().traced(g), |m, x| m.forward(x));
        let mut g = scaler.backward(cross_entropy_with_logits_loss(out, y.clone()));
        scaler.update(&mut model, &mut opt, &g).expect("update");
        model.zero_grads(&mut g);
        grads = Some(g);
    };
    let start = minor_faults();
    for _ in 0..WARM_UP {
        step();
    }
    let Some(before) = minor_faults() else {
        println!("no /proc/self/stat: page faults not counted");
        return;
    };
    for _ in 0..steps {
        step();
    }
    let after = minor_faults().unwrap_or(before);
    if let Some(start) = start {
        println!(
            "warm-up: {} minor page faults in {WARM_UP} steps",
            before - start
        );
    }
    println!(
        "row f (MLP 512-1024-1024-10 of mpx's fused layers, batch {BATCH}, GradScaler<f16>): \
         {:.0} minor page faults per step ({steps} steps after {WARM_UP} warm-up steps)",
        (after - before) as f64 / steps as f64
    );
}
