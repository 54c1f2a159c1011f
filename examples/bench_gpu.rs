//! The mixed step against the f32 step on one GPU (dfdx's `Cuda` device, feature `cuda`), on two
//! models: `bench_step`'s MLP (512-1024-1024-10, Adam, batch 256) and a dfdx transformer
//! classifier (embedding, dfdx's `TransformerEncoder`, mean pool, head), each step converted
//! with `#[mixed_step]` from the f32 step written beside it. Steps are timed to the device's
//! completion (`synchronize`), interleaved (each round runs one step of every configuration), and
//! the median over the rounds is reported with its ratio to f32. The last lines are JSON, one per
//! model, for `scripts/gpu-bundle.sh`'s report; `examples/gpu_peer.py` measures the same models
//! with PyTorch's autocast + `GradScaler` on the same GPU.
//!
//! Built here (no GPU) and run on a GPU machine: see `docs/gpu.md`.
//!
//! ```text
//! cargo run --release --features cuda --example bench_gpu -- --rounds 21
//! ```

#[path = "common/measure.rs"]
mod measure;
#[path = "common/tokens.rs"]
mod tokens;

use clap::Parser;
use dfdx::optim::{Adam, AdamConfig};
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::{AMP, f16};
use mpx::scaling::DynamicLossScale;
use mpx::step::GradScaler;

#[derive(Parser)]
struct Args {
    /// Interleaved rounds (the median is reported); at least 21.
    #[arg(long, default_value_t = 21)]
    rounds: usize,
    /// Only this model (`mlp` or `transformer`).
    #[arg(long)]
    only: Option<String>,
}

fn adam<M: dfdx::nn::tensor_collection::TensorCollection<f32, Cuda>>(
    m: &M,
    lr: f64,
) -> Adam<M, f32, Cuda> {
    Adam::new(
        m,
        AdamConfig {
            lr,
            ..Default::default()
        },
    )
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The GPU's name, from the driver's `nvidia-smi` (what the GPU machine has).
fn gpu_name() -> String {
    std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(|l| l.trim().to_string()))
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown GPU".into())
}

// ---- bench_step's MLP ----------------------------------------------------------------------------

mod mlp {
    use super::{AMP, Adam, DynamicLossScale, GradScaler, f16, mixed_step};
    use dfdx::prelude::*;

    pub const B: usize = 256;
    pub type Mlp = (
        Linear<512, 1024>,
        ReLU,
        Linear<1024, 1024>,
        ReLU,
        Linear<1024, 10>,
    );
    pub type Model = <Mlp as BuildOnDevice<Cuda, f32>>::Built;
    pub type X = Tensor<Rank2<B, 512>, f32, Cuda>;
    pub type Y = Tensor<Rank2<B, 10>, f32, Cuda>;

    /// The f32 dfdx step (gradients allocated once and reused, as a dfdx loop does).
    pub fn f32_step(
        model: &mut Model,
        opt: &mut Adam<Model, f32, Cuda>,
        grads: &mut Option<Gradients<f32, Cuda>>,
        x: &X,
        y: &Y,
    ) -> f32 {
        let g = grads.take().unwrap_or_else(|| model.alloc_grads());
        let out = model.forward(x.trace(g));
        let loss = cross_entropy_with_logits_loss(out, y.clone());
        let value = loss.array();
        let mut g = loss.backward();
        opt.update(model, &g).unwrap();
        model.zero_grads(&mut g);
        *grads = Some(g);
        value
    }

    /// The same step converted (stamped out for f16 and `AMP<f16>`; the body is `f32_step`'s).
    macro_rules! mixed {
        ($name:ident, $half:ty) => {
            #[mixed_step(scaling = scaler)]
            pub fn $name(
                model: &mut Model,
                opt: &mut Adam<Model, f32, Cuda>,
                grads: &mut Option<Gradients<f32, Cuda>>,
                x: &X,
                y: &Y,
                scaler: &mut GradScaler<$half, DynamicLossScale, Cuda>,
            ) -> f32 {
                let g = grads.take().unwrap_or_else(|| model.alloc_grads());
                let out = model.forward(x.trace(g));
                let loss = cross_entropy_with_logits_loss(out, y.clone());
                let value = loss.array();
                let mut g = loss.backward();
                opt.update(model, &g).unwrap();
                model.zero_grads(&mut g);
                *grads = Some(g);
                value
            }
        };
    }
    mixed!(f16_step, f16);
    mixed!(amp_step, AMP<f16>);

    pub fn data(dev: &Cuda) -> (X, Y) {
        let x = dev.tensor_from_vec(super::measure::uniform(B * 512).collect(), (Const, Const));
        let mut y = vec![0.0f32; B * 10];
        for r in 0..B {
            y[r * 10 + (r * 7) % 10] = 1.0;
        }
        (x, dev.tensor_from_vec(y, (Const, Const)))
    }
}

// ---- a dfdx transformer classifier ---------------------------------------------------------------

mod transformer {
    use super::{Adam, DynamicLossScale, GradScaler, f16, mixed_step};
    use dfdx::prelude::*;

    pub const BATCH: usize = 32;
    pub const SEQ: usize = 128;
    pub const VOCAB: usize = 1024;
    pub const DIM: usize = 512;
    pub const HEADS: usize = 8;
    pub const FF: usize = 2048;
    pub const LAYERS: usize = 4;
    pub const CLASSES: usize = 10;

    pub type Classifier = (
        Embedding<VOCAB, DIM>,
        TransformerEncoder<DIM, HEADS, FF, LAYERS>,
        Linear<DIM, CLASSES>,
    );
    pub type Model = <Classifier as BuildOnDevice<Cuda, f32>>::Built;
    pub type Tokens = Tensor<Rank2<BATCH, SEQ>, usize, Cuda>;
    pub type Labels = Tensor<Rank2<BATCH, CLASSES>, f32, Cuda>;

    /// One step, as a dfdx user writes it: embed, encode, mean over the sequence, classify.
    pub fn f32_step(
        model: &mut Model,
        opt: &mut Adam<Model, f32, Cuda>,
        x: &Tokens,
        y: &Labels,
    ) -> f32 {
        let grads = model.alloc_grads();
        let h = model.0.forward(x.clone().traced(grads));
        let h = model.1.forward(h);
        let pooled = h.mean::<_, Axis<1>>();
        let logits = model.2.forward(pooled);
        let loss = cross_entropy_with_logits_loss(logits, y.clone());
        let value = loss.array();
        let grads = loss.backward();
        opt.update(model, &grads).unwrap();
        value
    }

    /// The same step converted: the attribute and the scaler parameter.
    #[mixed_step(scaling = scaler)]
    pub fn f16_step(
        model: &mut Model,
        opt: &mut Adam<Model, f32, Cuda>,
        x: &Tokens,
        y: &Labels,
        scaler: &mut GradScaler<f16, DynamicLossScale, Cuda>,
    ) -> f32 {
        let grads = model.alloc_grads();
        let h = model.0.forward(x.clone().traced(grads));
        let h = model.1.forward(h);
        let pooled = h.mean::<_, Axis<1>>();
        let logits = model.2.forward(pooled);
        let loss = cross_entropy_with_logits_loss(logits, y.clone());
        let value = loss.array();
        let grads = loss.backward();
        opt.update(model, &grads).unwrap();
        value
    }

    pub fn data(dev: &Cuda) -> (Tokens, Labels) {
        super::tokens::batch::<BATCH, SEQ, VOCAB, CLASSES, _>(dev)
    }
}

fn run_mlp(dev: &Cuda, rounds: usize, gpu: &str) {
    use mlp::*;
    let init = dev.build_module::<Mlp, f32>();
    let (x, y) = data(dev);
    let (mut m32, mut m16, mut mamp) = (init.clone(), init.clone(), init);
    let (mut o32, mut o16, mut oamp) = (adam(&m32, 1e-4), adam(&m16, 1e-4), adam(&mamp, 1e-4));
    let (mut g32, mut g16, mut gamp) = (None, None, None);
    let mut s16 = GradScaler::<f16, DynamicLossScale, Cuda>::default();
    let mut samp = GradScaler::<AMP<f16>, DynamicLossScale, Cuda>::default();
    let (mut l32, mut l16, mut lamp) = (0.0, 0.0, 0.0);
    let times = measure::measure(
        rounds,
        &mut [
            &mut || {
                l32 = f32_step(&mut m32, &mut o32, &mut g32, &x, &y);
                dev.synchronize();
            },
            &mut || {
                l16 = f16_step(&mut m16, &mut o16, &mut g16, &x, &y, &mut s16);
                dev.synchronize();
            },
            &mut || {
                lamp = amp_step(&mut mamp, &mut oamp, &mut gamp, &x, &y, &mut samp);
                dev.synchronize();
            },
        ],
    );
    println!("MLP 512-1024-1024-10, Adam, batch {B}, {rounds} rounds, {gpu}");
    println!("  f32       {:8.3} ms  loss {l32:.4}", ms(times[0]));
    for (name, t, l, s) in [
        ("f16", times[1], l16, s16.last_step()),
        ("AMP<f16>", times[2], lamp, samp.last_step()),
    ] {
        println!(
            "  {name:<9} {:8.3} ms  loss {l:.4}  x{:.2} of f32  (last step: {})",
            ms(t),
            ms(t) / ms(times[0]),
            s.map_or("?", |r| r.precision.name())
        );
    }
    println!(
        "{{\"model\":\"mlp\",\"gpu\":\"{gpu}\",\"rounds\":{rounds},\"f32_ms\":{:.4},\"f16_ms\":{:.4},\"amp_f16_ms\":{:.4}}}",
        ms(times[0]),
        ms(times[1]),
        ms(times[2])
    );
}

fn run_transformer(dev: &Cuda, rounds: usize, gpu: &str) {
    use transformer::*;
    let init = dev.build_module::<Classifier, f32>();
    let (x, y) = data(dev);
    let (mut m32, mut m16) = (init.clone(), init);
    let (mut o32, mut o16) = (adam(&m32, 1e-4), adam(&m16, 1e-4));
    let mut s16 = GradScaler::<f16, DynamicLossScale, Cuda>::default();
    let (mut l32, mut l16) = (0.0, 0.0);
    let times = measure::measure(
        rounds,
        &mut [
            &mut || {
                l32 = f32_step(&mut m32, &mut o32, &x, &y);
                dev.synchronize();
            },
            &mut || {
                l16 = f16_step(&mut m16, &mut o16, &x, &y, &mut s16);
                dev.synchronize();
            },
        ],
    );
    println!(
        "dfdx transformer classifier (embedding {VOCAB}x{DIM}, {LAYERS} encoder blocks of {HEADS} heads, ff {FF}, batch {BATCH} x seq {SEQ}), Adam, {rounds} rounds, {gpu}"
    );
    println!("  f32       {:8.3} ms  loss {l32:.4}", ms(times[0]));
    println!(
        "  f16       {:8.3} ms  loss {l16:.4}  x{:.2} of f32  ({} steps, {} skipped)",
        ms(times[1]),
        ms(times[1]) / ms(times[0]),
        s16.applied_steps() + s16.skipped_steps(),
        s16.skipped_steps()
    );
    println!(
        "{{\"model\":\"transformer\",\"gpu\":\"{gpu}\",\"rounds\":{rounds},\"f32_ms\":{:.4},\"f16_ms\":{:.4}}}",
        ms(times[0]),
        ms(times[1])
    );
}

fn main() {
    let args = Args::parse();
    let rounds = args.rounds.max(21);
    let dev = Cuda::seed_from_u64(0);
    let gpu = gpu_name();
    let want = |m: &str| args.only.as_deref().is_none_or(|o| o == m);
    if want("mlp") {
        run_mlp(&dev, rounds, &gpu);
    }
    if want("transformer") {
        run_transformer(&dev, rounds, &gpu);
    }
}
