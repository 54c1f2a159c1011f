//! Page faults per training step of mpx's fused layers (issue 17, item 3), counted by the kernel
//! for this process (minor faults, field 10 of `/proc/self/stat`; Linux only) over the steps
//! after a warm-up:
//! - bench_step's rows f and g: MLP 512-1024-1024-10 of `mpx::nn::{LinearReLU, Linear}`, batch
//!   256, in f16 and in emulated bf16;
//! - bench_step's rows a and e: the same MLP of dfdx's `Linear` and `ReLU`, on the working copy
//!   `#[mixed_step]` gives it (mpx's layers, `Mixed::mapped`), in f16 and bf16;
//! - the ViT of `examples/vit.rs` (`mpx::nn::vit::Vit`, 16 tokens of width 32, 2 encoder blocks)
//!   on random 8x8 images, batch 32, in f16.
//!
//! All train with Adam and a `GradScaler` (what `#[mixed_step]` expands to).
//!
//! ```text
//! cargo run --release --example bench_faults [-- STEPS] [--keep-buffers]
//! ```
//!
//! With `--keep-buffers` the run holds an `mpx::settings::KeepBuffers`, so the fused ops keep
//! their large buffers from step to step; without it (mpx's default) they free them.
//!
//! A fault is the first touch of a fresh 4 KiB page: a step that allocates a large buffer anew
//! (and frees it after) pays one per page it writes, unless the allocator kept the pages (or a
//! `KeepBuffers` keeps the fused ops' own buffers); the tensors a step hands to dfdx (a layer's output, the half
//! batch, the working copy) are dfdx's to free. glibc raises its mmap threshold by itself once a
//! large block is freed, so that malloc keeps such blocks for reuse;
//! `MALLOC_MMAP_THRESHOLD_=131072` fixes the threshold at glibc's starting value, which turns that
//! off and shows what a step allocates above it.

use dfdx::{optim::*, prelude::*};
use mpx::nn;
use mpx::precision::{Precision, bf16, f16};
use mpx::scaling::DynamicLossScale;
use mpx::step::{GradScaler, Mixed};

type Mlp = (
    nn::builders::LinearReLU<512, 1024>,
    nn::builders::LinearReLU<1024, 1024>,
    nn::builders::Linear<1024, 10>,
);
/// The same MLP of dfdx's layers.
type DfdxMlp = (
    Linear<512, 1024>,
    ReLU,
    Linear<1024, 1024>,
    ReLU,
    Linear<1024, 10>,
);
/// The ViT of `examples/vit.rs`: 8x8 images in 2x2 patches, width 32, 4 heads, feed-forward 64,
/// 2 blocks, 10 classes.
type Vit = nn::vit::Vit<64, 4, 16, 32, 4, 64, 2, 10>;

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

/// Faults per step of `step` over `steps` steps, after the warm-up.
fn per_step(steps: usize, mut step: impl FnMut()) -> Option<f64> {
    for _ in 0..WARM_UP {
        step();
    }
    let before = minor_faults()?;
    for _ in 0..steps {
        step();
    }
    Some((minor_faults()?.saturating_sub(before)) as f64 / steps as f64)
}

/// One-hot labels, class `(r * 7) % 10` for row `r`.
fn labels<const B: usize>(dev: &Cpu) -> Tensor<Rank2<B, 10>, f32, Cpu> {
    let mut y = vec![0.0f32; B * 10];
    for r in 0..B {
        y[r * 10 + (r * 7) % 10] = 1.0;
    }
    dev.tensor_from_vec(y, (Const, Const))
}

fn scaler<H: Precision>() -> GradScaler<H, DynamicLossScale>
where
    Cpu: mpx::step::MixedDevice<H>,
{
    let scaling = DynamicLossScale::builder()
        .initial(65536.0)
        .build()
        .expect("a valid loss scale");
    GradScaler::new(scaling)
}

/// The faults per step of training `$model` on `$x`, `$y` in `$h`, held as `Mixed::$kind`
/// (`new`: its own layers in `$h`; `mapped`: mpx's, for a model of dfdx's layers) (a macro: the
/// types differ).
macro_rules! train {
    ($steps:expr, $h:ty, $kind:ident, $model:expr, $x:expr, $y:expr) => {{
        let mut model = Mixed::$kind($model);
        let mut opt = Adam::new(&*model, AdamConfig::default());
        let mut scaler = scaler::<$h>();
        let (x, y) = ($x, $y);
        let mut grads = Some(model.alloc_grads());
        per_step($steps, || {
            let g = grads.take().expect("gradients present");
            let out = scaler
                .forward(&model, x.clone().traced(g), |m, x| m.forward(x))
                .expect("forward");
            let mut g = scaler
                .backward(cross_entropy_with_logits_loss(out, y.clone()))
                .expect("backward");
            scaler.update(&mut model, &mut opt, &g).expect("update");
            model.zero_grads(&mut g);
            grads = Some(g);
        })
    }};
}

fn main() {
    let steps: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(STEPS);
    let keep = std::env::args().any(|a| a == "--keep-buffers");
    let _keep = keep.then(mpx::settings::KeepBuffers::new);
    println!(
        "{}",
        if keep {
            "the fused ops' buffers kept from step to step (KeepBuffers)"
        } else {
            "no buffers kept (mpx's default)"
        }
    );
    let dev = Cpu::seed_from_u64(0);
    let report = |what: &str, faults: Option<f64>| match faults {
        Some(f) => println!(
            "{what}: {f:.0} minor page faults per step ({steps} steps after {WARM_UP} warm-up steps)"
        ),
        None => println!("{what}: no /proc/self/stat, page faults not counted"),
    };
    let x: Tensor<Rank2<256, 512>, f32, Cpu> = dev.sample_normal();
    let (mpx_mlp, dfdx_mlp) = (
        dev.build_module::<Mlp, f32>(),
        dev.build_module::<DfdxMlp, f32>(),
    );
    for (row, faults) in [
        (
            "row f (MLP 512-1024-1024-10 of mpx's fused layers, batch 256, GradScaler<f16>)",
            train!(
                steps,
                f16,
                mapped,
                mpx_mlp.clone(),
                x.clone(),
                labels::<256>(&dev)
            ),
        ),
        (
            "row g (the same, GradScaler<bf16>, emulated)",
            train!(steps, bf16, mapped, mpx_mlp, x.clone(), labels::<256>(&dev)),
        ),
        (
            "row a (the MLP of dfdx's layers on mpx's, Mixed::mapped, GradScaler<f16>)",
            train!(
                steps,
                f16,
                mapped,
                dfdx_mlp.clone(),
                x.clone(),
                labels::<256>(&dev)
            ),
        ),
        (
            "row e (the same, GradScaler<bf16>, emulated)",
            train!(steps, bf16, mapped, dfdx_mlp, x, labels::<256>(&dev)),
        ),
    ] {
        report(row, faults);
    }
    let images: Tensor<Rank2<32, 64>, f32, Cpu> = dev.sample_uniform();
    let vit = train!(
        steps,
        f16,
        mapped,
        dev.build_module::<Vit, f32>(),
        images,
        labels::<32>(&dev)
    );
    report(
        "ViT of examples/vit.rs (random 8x8 images, batch 32, GradScaler<f16>)",
        vit,
    );
}
