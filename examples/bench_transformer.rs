//! A dfdx transformer classifier (embedding, dfdx's `TransformerEncoder`, mean pool, head), written
//! as dfdx users write it, trained in f32 and converted with `#[mixed_step]`: the step time of the
//! mixed f16 / bf16 steps against the f32 step, measured interleaved (issue 17's "converting never
//! slows training" figure for a model built from dfdx's own layers).
//!
//! Run: `cargo run --release --example bench_transformer [-- --rounds 21] [--keep-buffers]`
//! (`--keep-buffers`: the whole run holds an `mpx::settings::KeepBuffers`, so mpx's layers keep
//! their large buffers from step to step instead of allocating them again; `--avx2`: mpx's GEMM
//! forced to its AVX2 + FMA path, the instructions of a CPU without AVX-512 such as a Zen 3,
//! while mpx's element-wise passes and dfdx's own f32 kernels keep what this CPU has).

#[path = "common/measure.rs"]
mod measure;
#[path = "common/tokens.rs"]
mod tokens;

use clap::Parser;
use dfdx::optim::{Adam, AdamConfig};
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::{bf16, f16};
use mpx::step::GradScaler;

const BATCH: usize = 16;
const SEQ: usize = 32;
const VOCAB: usize = 64;
const CLASSES: usize = 4;
const DIM: usize = 64;

type Classifier = (
    Embedding<VOCAB, DIM>,
    TransformerEncoder<DIM, 4, 128, 2>,
    Linear<DIM, CLASSES>,
);
type Model = <Classifier as BuildOnDevice<Cpu, f32>>::Built;
type Tokens = Tensor<Rank2<BATCH, SEQ>, usize, Cpu>;
type Labels = Tensor<Rank2<BATCH, CLASSES>, f32, Cpu>;

/// One step, as a dfdx user writes it: embed, encode, mean over the sequence, classify.
fn f32_step(model: &mut Model, opt: &mut Adam<Model, f32, Cpu>, x: Tokens, y: Labels) -> f32 {
    let grads = model.alloc_grads();
    let h = model.0.forward(x.traced(grads));
    let h = model.1.forward(h);
    let pooled = h.mean::<_, Axis<1>>();
    let logits = model.2.forward(pooled);
    let loss = cross_entropy_with_logits_loss(logits, y);
    let value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    value
}

/// The same step converted: the attribute and the scaler parameter (stamped out for f16 and
/// emulated bf16; the body is `f32_step`'s).
macro_rules! mixed {
    ($name:ident, $half:ty) => {
        #[mixed_step(scaling = scaler)]
        fn $name(
            model: &mut Model,
            opt: &mut Adam<Model, f32, Cpu>,
            x: Tokens,
            y: Labels,
            scaler: &mut GradScaler<$half>,
        ) -> f32 {
            let grads = model.alloc_grads();
            let h = model.0.forward(x.traced(grads));
            let h = model.1.forward(h);
            let pooled = h.mean::<_, Axis<1>>();
            let logits = model.2.forward(pooled);
            let loss = cross_entropy_with_logits_loss(logits, y);
            let value = loss.array();
            let grads = loss.backward();
            opt.update(model, &grads).unwrap();
            value
        }
    };
}
mixed!(f16_step, f16);
mixed!(bf16_step, bf16);

#[derive(Parser)]
struct Args {
    /// Interleaved rounds (the median is reported).
    #[arg(long, default_value_t = 21)]
    rounds: usize,
    /// Hold a `KeepBuffers` for the whole run.
    #[arg(long)]
    keep_buffers: bool,
    /// Force mpx's GEMM to its AVX2 + FMA path.
    #[arg(long)]
    avx2: bool,
}

fn main() {
    let args = Args::parse();
    measure::on_path(args.avx2, || run(&args));
}

fn run(args: &Args) {
    let _keep = args.keep_buffers.then(mpx::settings::KeepBuffers::new);
    let dev = Cpu::seed_from_u64(0);
    let init = dev.build_module::<Classifier, f32>();
    let (tokens, labels): (Tokens, Labels) = tokens::batch::<BATCH, SEQ, VOCAB, CLASSES, _>(&dev);
    let adam = |m: &Model| {
        Adam::new(
            m,
            AdamConfig {
                lr: 1e-3,
                ..Default::default()
            },
        )
    };
    let (mut m32, mut m16, mut mbf) = (init.clone(), init.clone(), init.clone());
    let (mut o32, mut o16, mut obf) = (adam(&m32), adam(&m16), adam(&mbf));
    let mut s16 = GradScaler::<f16>::default();
    let mut sbf = GradScaler::<bf16>::default();
    let (mut l32, mut l16, mut lbf) = (0.0, 0.0, 0.0);
    let times = measure::measure(
        args.rounds,
        &mut [
            &mut || l32 = f32_step(&mut m32, &mut o32, tokens.clone(), labels.clone()),
            &mut || l16 = f16_step(&mut m16, &mut o16, tokens.clone(), labels.clone(), &mut s16),
            &mut || lbf = bf16_step(&mut mbf, &mut obf, tokens.clone(), labels.clone(), &mut sbf),
        ],
    );
    let cpu = measure::cpu_name();
    println!(
        "dfdx transformer classifier (embedding {VOCAB}x{DIM}, 2 encoder blocks of 4 heads, ff 128, batch {BATCH} x seq {SEQ}), {} rounds, {}, mpx's GEMM on {:?}, {cpu}",
        args.rounds,
        if args.keep_buffers {
            "buffers kept (KeepBuffers)"
        } else {
            "no buffers kept (default)"
        },
        mpx::__bench::active_path()
    );
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    println!("f32  step {:8.3} ms  loss {l32:.4}", ms(times[0]));
    println!(
        "f16  step {:8.3} ms  loss {l16:.4}  x{:.2} of f32  ({} of its steps ran in {})",
        ms(times[1]),
        ms(times[1]) / ms(times[0]),
        s16.applied_steps() + s16.skipped_steps(),
        s16.last_step()
            .map_or("?".to_string(), |r| r.precision.to_string())
    );
    println!(
        "bf16 step {:8.3} ms  loss {lbf:.4}  x{:.2} of f32  ({} ran in {})",
        ms(times[2]),
        ms(times[2]) / ms(times[0]),
        sbf.applied_steps() + sbf.skipped_steps(),
        sbf.last_step()
            .map_or("?".to_string(), |r| r.precision.to_string())
    );
}
