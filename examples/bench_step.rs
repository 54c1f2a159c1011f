//! Benchmark of the mixed-precision step (issue 3's table, and issue 10's rows f-i): MLP
//! 512-1024-1024-10, Adam, batch 256 for time, batch 4096 for memory. Every ratio is measured in
//! this one run. Rows f-i build the same MLP (same initial weights) from mpx's fused layers
//! (`mpx::nn::LinearReLU`, `mpx::nn::Linear`) instead of dfdx's `Linear` + `ReLU`. Every mixed
//! row runs on the one engine, a `GradScaler` driven by its methods (what `#[mixed_step]` expands
//! to), with the gradients allocated once and reused across steps as a plain dfdx loop does.
//! Row a runs the dfdx MLP as `#[mixed_step]` does, on the working copy made of mpx's fused
//! layers (`Mixed::mapped`), as do rows c, c' (memory), d (`AMP<f16>`) and e (emulated bf16:
//! mpx's f32 layers running in bf16); row a0 on dfdx's own layers in f16 (`Mixed::new`, the
//! working copy before the mapping).
//!
//! ```text
//! cargo run --release --example bench_step
//! ```
//!
//! With `--serve` it is a step server for `shared/peer/lockstep.py` (the protocol of the JAX mpx
//! and PyTorch step servers): it reads lines `<config> <n>`, runs n steps of that configuration at
//! batch 256 and answers the n step times in ms on one line. Configurations: `f32` (dfdx's f32
//! step), `f16` (row f: mpx's fused layers, `GradScaler<f16>`), `bf16` (row g, emulated bf16),
//! `dfdx-f16` (row a: dfdx's layers as `#[mixed_step]` runs them, on mpx's layers in the working
//! copy). `--serve --avx2` forces mpx's GEMM onto its AVX2 + FMA path, the instructions of a CPU
//! without AVX-512 (its element-wise passes keep this CPU's own); `--serve --keep-buffers` holds
//! an `mpx::settings::KeepBuffers` for the whole run.
//!
//! Step times are medians over interleaved rounds (each configuration runs a few steps per round,
//! rounds alternate), so a noisy neighbour slows all configurations alike; each round starts
//! with two untimed steps, so each configuration is timed in its own steady state. Peak heap comes from a
//! counting global allocator: "step" is the peak during one step above the heap in use just
//! before it (model, optimizer state, reused buffers and the batch already resident); "process"
//! is the absolute peak of the process during that step.

use std::time::{Duration, Instant};

use dfdx::{optim::*, prelude::*};
use mpx::__bench::{active_path, max_threads, with_threads};
use mpx::boundary::MasterModel;
use mpx::nn;
use mpx::precision::{AMP, Precision, bf16, f16};
use mpx::scaling::{DynamicLossScale, LossScale, StaticLossScale};
use mpx::step::{Batch, GradScaler, Kind, Mapped, Mixed, MixedDevice, Plain};

#[path = "../tests/common/heap.rs"]
mod heap;
#[path = "common/measure.rs"]
mod measure;

#[global_allocator]
static ALLOC: heap::Counting = heap::Counting;

/// Heap use of one step: (above the heap just before it, absolute process peak).
#[derive(Clone, Copy)]
struct Peak {
    step: usize,
    process: usize,
}

fn measure_peak(f: impl FnOnce()) -> Peak {
    let before = heap::reset_peak();
    f();
    let peak = heap::peak();
    Peak {
        step: peak - before,
        process: peak,
    }
}

// ---- model -------------------------------------------------------------------------------------

type Mlp = (
    Linear<512, 1024>,
    ReLU,
    Linear<1024, 1024>,
    ReLU,
    Linear<1024, 10>,
);
type Master = <Mlp as BuildOnDevice<Cpu, f32>>::Built;

/// The same MLP from mpx's fused layers.
type MpxMlp = (
    nn::builders::LinearReLU<512, 1024>,
    nn::builders::LinearReLU<1024, 1024>,
    nn::builders::Linear<1024, 10>,
);
type MpxMaster = <MpxMlp as BuildOnDevice<Cpu, f32>>::Built;

/// The dfdx model's parameters in mpx's layers (same initial weights).
fn to_mpx(m: &Master) -> MpxMaster {
    (
        (m.0.clone(), ReLU).into(),
        (m.2.clone(), ReLU).into(),
        m.4.clone().into(),
    )
}

fn adam<M: dfdx::nn::tensor_collection::TensorCollection<f32, Cpu>>(m: &M) -> Adam<M, f32, Cpu> {
    Adam::new(
        m,
        AdamConfig {
            lr: 1e-4,
            ..Default::default()
        },
    )
}

fn data<const B: usize>(
    dev: &Cpu,
) -> (
    Tensor<Rank2<B, 512>, f32, Cpu>,
    Tensor<Rank2<B, 10>, f32, Cpu>,
) {
    let x = dev.sample_normal();
    let mut y = vec![0.0f32; B * 10];
    for r in 0..B {
        y[r * 10 + (r * 7) % 10] = 1.0;
    }
    (x, dev.tensor_from_vec(y, (Const, Const)))
}

/// A plain dfdx f32 training loop (gradients reused through `alloc_grads`/`zero_grads`).
struct F32Loop<const B: usize, M = Master> {
    model: M,
    opt: Adam<M, f32, Cpu>,
    grads: Option<Gradients<f32, Cpu>>,
    x: Tensor<Rank2<B, 512>, f32, Cpu>,
    y: Tensor<Rank2<B, 10>, f32, Cpu>,
}

impl<const B: usize, M> F32Loop<B, M>
where
    M: dfdx::nn::tensor_collection::TensorCollection<f32, Cpu>
        + Clone
        + Module<
            Tensor<Rank2<B, 512>, f32, Cpu, OwnedTape<f32, Cpu>>,
            Output = Tensor<Rank2<B, 10>, f32, Cpu, OwnedTape<f32, Cpu>>,
        >,
{
    fn new(dev: &Cpu, init: &M) -> Self {
        let model = init.clone();
        let (x, y) = data::<B>(dev);
        Self {
            opt: adam(&model),
            grads: Some(model.alloc_grads()),
            model,
            x,
            y,
        }
    }
    /// One step; returns (forward, loss + backward, optimizer incl. zeroing) times.
    fn step(&mut self) -> (Duration, Duration, Duration) {
        let t0 = Instant::now();
        let grads = self.grads.take().expect("gradients present");
        let out = self.model.forward(self.x.trace(grads));
        let t1 = Instant::now();
        let mut grads = cross_entropy_with_logits_loss(out, self.y.clone()).backward();
        let t2 = Instant::now();
        self.opt.update(&mut self.model, &grads).expect("update");
        self.model.zero_grads(&mut grads);
        self.grads = Some(grads);
        (t1 - t0, t2 - t1, t2.elapsed())
    }
}

/// The mixed loop with working-copy precision `H`, as `#[mixed_step]` runs it: a
/// [`GradScaler`] around the plain dfdx step, the model held as a [`Mixed`] of kind `K` ([`Plain`]:
/// its own layers in `H`; [`Mapped`]: mpx's layers, whose fused linear layers write their weight
/// gradients straight into the master's). The gradients are allocated once and reused; the
/// batch is rounded to `H` inside the scaler's forward pass, and its own gradient, which nothing
/// reads, left out ([`Batch`]).
struct Scaled<H: Precision, L: LossScale, const B: usize, M = MpxMaster, K = Mapped>
where
    Cpu: MixedDevice<H>,
{
    model: Mixed<M, K>,
    opt: Adam<M, f32, Cpu>,
    scaler: GradScaler<H, L>,
    grads: Option<Gradients<f32, Cpu>>,
    x: Tensor<Rank2<B, 512>, f32, Cpu>,
    y: Tensor<Rank2<B, 10>, f32, Cpu>,
}

impl<H: Precision, L: LossScale, const B: usize, M, K> Scaled<H, L, B, M, K>
where
    M: MasterModel + Clone,
    Cpu: MixedDevice<H>,
    K: Kind<H, M, Cpu> + Default,
    K::Copy: Module<
            Tensor<Rank2<B, 512>, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
            Output = Tensor<Rank2<B, 10>, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
        >,
{
    fn new(dev: &Cpu, init: &M, scaling: L) -> Self {
        let model = Mixed::with(init.clone(), K::default());
        let (x, y) = data::<B>(dev);
        Self {
            opt: adam(&model),
            scaler: GradScaler::new(scaling),
            grads: Some(model.alloc_grads()),
            model,
            x,
            y,
        }
    }

    /// One step; returns (forward, loss + backward, optimizer incl. zeroing) times, each timed
    /// from outside the scaler's call: the forward includes the master and batch casts, the
    /// backward the unscaling, the finiteness check and the gradients' move into the master's.
    fn step(&mut self) -> (Duration, Duration, Duration) {
        let t0 = Instant::now();
        let grads = self.grads.take().expect("gradients present");
        let out = self
            .scaler
            .forward(&self.model, Batch(self.x.trace(grads)), |m, x| m.forward(x))
            .expect("forward");
        let t1 = Instant::now();
        let mut grads = self
            .scaler
            .backward(cross_entropy_with_logits_loss(out, self.y.clone()))
            .expect("backward");
        let t2 = Instant::now();
        self.scaler
            .update(&mut self.model, &mut self.opt, &grads)
            .expect("update");
        self.model.zero_grads(&mut grads);
        self.grads = Some(grads);
        (t1 - t0, t2 - t1, t2.elapsed())
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Untimed steps at the start of each configuration's round.
const SETTLE: usize = 2;

#[derive(Default)]
struct Acc {
    total: Vec<f64>,
    fwd: Vec<f64>,
    bwd: Vec<f64>,
    fwd_bwd: Vec<f64>,
    opt: Vec<f64>,
}

impl Acc {
    /// A step's (forward, loss + backward, optimizer) times.
    fn step(&mut self, (fwd, bwd, opt): (Duration, Duration, Duration)) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        self.total.push(ms(fwd + bwd + opt));
        self.fwd.push(ms(fwd));
        self.bwd.push(ms(bwd));
        self.fwd_bwd.push(ms(fwd + bwd));
        self.opt.push(ms(opt));
    }
    /// Runs `step` `SETTLE + n` times, recording the last `n` when `keep` (the rounds after the
    /// warm-up).
    fn run(
        &mut self,
        n: usize,
        keep: bool,
        mut step: impl FnMut() -> (Duration, Duration, Duration),
    ) {
        // Two untimed steps first: a row that follows another finds the allocator in the
        // other's state (glibc has given its freed large blocks back, and the first steps fault
        // their pages in again), which a loop of one kind of step never sees.
        for i in 0..n + SETTLE {
            let r = step();
            if keep && i >= SETTLE {
                self.step(r);
            }
        }
    }
    fn med(v: &mut [f64]) -> f64 {
        if v.is_empty() { 0.0 } else { median(v) }
    }
}

/// The `--serve` mode: a step server speaking `shared/peer`'s protocol.
fn serve(dev: &Cpu, init: &Master, dynamic: impl Fn() -> DynamicLossScale) {
    use std::io::{BufRead, Write};
    const B: usize = 256;
    let init_mpx = to_mpx(init);
    let mut f32_step = F32Loop::<B>::new(dev, init);
    let mut f16_step = Scaled::<f16, _, B>::new(dev, &init_mpx, dynamic());
    let mut bf16_step = Scaled::<bf16, _, B>::new(dev, &init_mpx, dynamic());
    let mut dfdx_f16_step = Scaled::<f16, _, B, Master>::new(dev, init, dynamic());
    println!(
        "ready mpx-rs bench_step: MLP 512-1024-1024-10, Adam, batch {B}; f32 f16 bf16 dfdx-f16; kernel path {:?}",
        active_path()
    );
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let mut words = line.split_whitespace();
        let (Some(cfg), Some(n)) = (
            words.next(),
            words.next().and_then(|n| n.parse::<usize>().ok()),
        ) else {
            eprintln!("expected `<config> <n>`, got {line:?}");
            break;
        };
        let mut times = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            match cfg {
                "f32" => drop(f32_step.step()),
                "f16" => drop(f16_step.step()),
                "bf16" => drop(bf16_step.step()),
                "dfdx-f16" => drop(dfdx_f16_step.step()),
                other => {
                    eprintln!("unknown configuration {other:?}; expected f32, f16, bf16, dfdx-f16");
                    return;
                }
            }
            times.push(format!("{:.3}", t.elapsed().as_secs_f64() * 1e3));
        }
        println!("{}", times.join(" "));
        let _ = std::io::stdout().flush();
    }
}

fn main() {
    let dev = Cpu::seed_from_u64(0);
    let init = dev.build_module::<Mlp, f32>();
    let dynamic = || {
        DynamicLossScale::builder()
            .initial(32768.0)
            .build()
            .expect("valid")
    };
    if std::env::args().any(|a| a == "--serve") {
        let _keep = std::env::args()
            .any(|a| a == "--keep-buffers")
            .then(mpx::settings::KeepBuffers::new);
        measure::on_path(std::env::args().any(|a| a == "--avx2"), || {
            serve(&dev, &init, dynamic);
        });
        return;
    }

    // ---- memory, batch 4096 (first, so nothing else is resident) ----
    const BIG: usize = 4096;
    let mem_f32 = {
        let mut p = F32Loop::<BIG>::new(&dev, &init);
        p.step(); // Adam's moments are allocated on the first update
        measure_peak(|| {
            p.step();
        })
    };
    let mem_f16 = {
        let mut m = Scaled::<f16, _, BIG, Master>::new(&dev, &init, dynamic());
        m.step();
        measure_peak(|| {
            m.step();
        })
    };
    let init_mpx = to_mpx(&init);
    let mem_f16_mpx = {
        let mut m = Scaled::<f16, _, BIG>::new(&dev, &init_mpx, dynamic());
        m.step();
        measure_peak(|| {
            m.step();
        })
    };

    // dfdx alone, no mixed machinery: forward + backward of an f16 model on an f16 batch, and of
    // the f32 model, above the heap before the pass (gradients reused, batch resident).
    let (mem_dfdx_f16, mem_dfdx_f32) = {
        let m32 = init.clone();
        let m16 = mpx::cast::cast_module::<f16, f32, _>(&init);
        let (x, y) = data::<BIG>(&dev);
        let x16 = x.clone().to_dtype::<f16>();
        let y16 = y.clone().to_dtype::<f16>();
        let mut g16 = Some(m16.alloc_grads());
        let mut g32 = Some(m32.alloc_grads());
        let mut pass16 = || {
            let g = g16.take().unwrap();
            let out = m16.forward(x16.clone().traced(g));
            let mut g = cross_entropy_with_logits_loss(out, y16.clone()).backward();
            m16.zero_grads(&mut g);
            g16 = Some(g);
        };
        pass16();
        let p16 = measure_peak(&mut pass16);
        let mut pass32 = || {
            let g = g32.take().unwrap();
            let out = m32.forward(x.clone().traced(g));
            let mut g = cross_entropy_with_logits_loss(out, y.clone()).backward();
            m32.zero_grads(&mut g);
            g32 = Some(g);
        };
        pass32();
        let p32 = measure_peak(&mut pass32);
        (p16, p32)
    };

    // ---- time, batch 256 ----
    const B: usize = 256;
    let mut plain = F32Loop::<B>::new(&dev, &init);
    let mut machinery =
        Scaled::<f32, _, B, Master, Plain>::new(&dev, &init, StaticLossScale::new(1.0).unwrap());
    let mut half = Scaled::<f16, _, B, Master, Plain>::new(&dev, &init, dynamic());
    let mut mapped = Scaled::<f16, _, B, Master>::new(&dev, &init, dynamic());
    let mut amp = Scaled::<AMP<f16>, _, B, Master>::new(&dev, &init, dynamic());
    let mut bf = Scaled::<bf16, _, B, Master>::new(&dev, &init, dynamic());
    let mut mpx_half = Scaled::<f16, _, B>::new(&dev, &init_mpx, dynamic());
    let mut mpx_bf = Scaled::<bf16, _, B>::new(&dev, &init_mpx, dynamic());
    let mut mpx_plain = F32Loop::<B, MpxMaster>::new(&dev, &init_mpx);
    let (mut a_plain, mut a_mach, mut a_half, mut a_amp, mut a_bf, mut a_mapped): (
        Acc,
        Acc,
        Acc,
        Acc,
        Acc,
        Acc,
    ) = Default::default();
    let mut mpx_half1 = Scaled::<f16, _, B>::new(&dev, &init_mpx, dynamic());
    let (mut a_mpx_half, mut a_mpx_bf, mut a_mpx_plain, mut a_mpx_half1): (Acc, Acc, Acc, Acc) =
        Default::default();
    let (warmup, rounds, per_round) = (2, 7, 3);
    for round in 0..warmup + rounds {
        let keep = round >= warmup;
        a_plain.run(per_round, keep, || plain.step());
        a_mach.run(per_round, keep, || machinery.step());
        a_half.run(per_round, keep, || half.step());
        a_mapped.run(per_round, keep, || mapped.step());
        a_amp.run(per_round, keep, || amp.step());
        a_bf.run(per_round, keep, || bf.step());
        a_mpx_half.run(per_round, keep, || mpx_half.step());
        a_mpx_bf.run(per_round, keep, || mpx_bf.step());
        a_mpx_plain.run(per_round, keep, || mpx_plain.step());
        with_threads(1, || {
            a_mpx_half1.run(per_round, keep, || mpx_half1.step());
        })
        .expect("1 thread is valid");
    }

    let t_plain = Acc::med(&mut a_plain.total);
    let t_mach = Acc::med(&mut a_mach.total);
    let t_half = Acc::med(&mut a_half.total);
    let t_mapped = Acc::med(&mut a_mapped.total);
    let t_amp = Acc::med(&mut a_amp.total);
    let t_bf = Acc::med(&mut a_bf.total);
    let t_mpx_half = Acc::med(&mut a_mpx_half.total);
    let t_mpx_bf = Acc::med(&mut a_mpx_bf.total);
    let t_mpx_plain = Acc::med(&mut a_mpx_plain.total);
    let t_mpx_half1 = Acc::med(&mut a_mpx_half1.total);
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);

    println!(
        "MLP 512-1024-1024-10, Adam, batch {B} (time: median of {} steps each, interleaved), batch {BIG} (memory)\n",
        rounds * per_round
    );
    println!("| row | what is measured | target | measured |");
    println!("|---|---|---|---|");
    println!(
        "| a | mixed f16 step time / f32 step time (`#[mixed_step]`'s choice: dfdx's `Linear`s as mpx's, `Mixed::mapped`) | <= 0.8 | {:.2} ({t_mapped:.1} ms / {t_plain:.1} ms) |",
        t_mapped / t_plain
    );
    println!(
        "| a0 | same, on dfdx's own layers in f16 (`GradScaler::forward`) | - | {:.2} ({t_half:.1} ms / {t_plain:.1} ms) |",
        t_half / t_plain
    );
    println!(
        "| b | machinery overhead: mixed step, f32 working copy, scale 1 / plain f32 step | <= 1.05 | {:.3} ({t_mach:.1} ms / {t_plain:.1} ms) |",
        t_mach / t_plain
    );
    println!(
        "| c | peak heap of a mixed f16 step at batch {BIG} (row a's) / f32 (above the heap before the step) | <= 0.55 | {:.2} ({:.1} MiB / {:.1} MiB) |",
        mem_f16.step as f64 / mem_f32.step as f64,
        mib(mem_f16.step),
        mib(mem_f32.step)
    );
    println!(
        "| c' | same, absolute process peak (model, Adam state, workspace, batch included) | - | {:.2} ({:.1} MiB / {:.1} MiB) |",
        mem_f16.process as f64 / mem_f32.process as f64,
        mib(mem_f16.process),
        mib(mem_f32.process)
    );
    println!(
        "| c'' | dfdx alone: f16 forward+backward / f32 forward+backward at batch {BIG} (no master, no casts) | - | {:.2} ({:.1} MiB / {:.1} MiB) |",
        mem_dfdx_f16.step as f64 / mem_dfdx_f32.step as f64,
        mib(mem_dfdx_f16.step),
        mib(mem_dfdx_f32.step)
    );
    println!(
        "| d | AMP<f16> step time (as row a) / f32 step time | - | {:.2} ({t_amp:.1} ms) |",
        t_amp / t_plain
    );
    println!(
        "| e | emulated bf16 step time (as row a) / f32 step time | - | {:.2} ({t_bf:.1} ms) |",
        t_bf / t_plain
    );
    println!(
        "| f | mixed f16 step, MLP of mpx's fused layers / dfdx f32 step | <= 0.6 | {:.2} ({t_mpx_half:.1} ms / {t_plain:.1} ms) |",
        t_mpx_half / t_plain
    );
    println!(
        "| f2 | row f with mpx's GEMM on one thread (`with_threads(1)`) / dfdx f32 step | - | {:.2} ({t_mpx_half1:.1} ms) |",
        t_mpx_half1 / t_plain
    );
    println!(
        "| g | same, emulated bf16 / dfdx f32 step | <= 0.45 with AVX512-BF16, else about row f | {:.2} ({t_mpx_bf:.1} ms) |",
        t_mpx_bf / t_plain
    );
    println!(
        "| h | mpx's fused layers in f32, plain loop / dfdx f32 step | report | {:.2} ({t_mpx_plain:.1} ms) |",
        t_mpx_plain / t_plain
    );
    println!(
        "| i | peak heap of row f's step at batch {BIG} / dfdx f32 step (above the heap before the step) | <= 0.55 | {:.2} ({:.1} MiB / {:.1} MiB) |",
        mem_f16_mpx.step as f64 / mem_f32.step as f64,
        mib(mem_f16_mpx.step),
        mib(mem_f32.step)
    );
    println!(
        "| i' | same, absolute process peak | - | {:.2} ({:.1} MiB / {:.1} MiB) |",
        mem_f16_mpx.process as f64 / mem_f32.process as f64,
        mib(mem_f16_mpx.process),
        mib(mem_f32.process)
    );
    println!(
        "\nKernel path of mpx's layers: {:?}; GEMM threads: {} (row f2: 1); dfdx's matmul: rayon, all cores",
        active_path(),
        max_threads()
    );

    println!("\nBreakdown (median ms per step, each phase timed around its call):\n");
    println!("| step | forward | loss+backward | optimizer | total |");
    println!("|---|---|---|---|---|");
    // a mixed step casts the master and the batch inside its forward, and unscales, checks and
    // moves the working copy's gradients into the master's inside its backward
    let cell = |v: &mut Vec<f64>| {
        if v.is_empty() {
            "-".to_string()
        } else {
            format!("{:.2}", median(v))
        }
    };
    let row = |name: &str, a: &mut Acc, total: f64| {
        println!(
            "| {name} | {} | {} | {} | {:.2} |",
            cell(&mut a.fwd),
            cell(&mut a.bwd),
            cell(&mut a.opt),
            total
        );
    };
    row("plain f32 (dfdx)", &mut a_plain, t_plain);
    row("mixed, f32 copy, scale 1", &mut a_mach, t_mach);
    row(
        "a: mixed f16, mapped to mpx layers",
        &mut a_mapped,
        t_mapped,
    );
    row("a0: mixed f16, dfdx layers", &mut a_half, t_half);
    row("d: mixed AMP<f16>, mapped to mpx layers", &mut a_amp, t_amp);
    row(
        "e: mixed emulated bf16, mapped to mpx layers",
        &mut a_bf,
        t_bf,
    );
    row("f: mixed f16, mpx layers", &mut a_mpx_half, t_mpx_half);
    row(
        "g: mixed emulated bf16, mpx layers",
        &mut a_mpx_bf,
        t_mpx_bf,
    );
    row("h: plain f32, mpx layers", &mut a_mpx_plain, t_mpx_plain);
    let fb = Acc::med(&mut a_mpx_half.fwd_bwd);
    println!(
        "\nRow f's forward+backward: {fb:.2} ms (a `GradScaler` step: the master cast and the batch rounding are inside it; its layers write their weight gradients straight into the master's, so there is no transfer); optimizer: {:.2} ms. The GEMM's share: `bench_kernels` times the step's 9 products alone.",
        Acc::med(&mut a_mpx_half.opt)
    );
    println!(
        "\nloss scale after the run: f16 {}, AMP<f16> {}, bf16 {}; skipped steps: f16 {}, AMP<f16> {}, bf16 {}",
        half.scaler.loss_scale(),
        amp.scaler.loss_scale(),
        bf.scaler.loss_scale(),
        half.scaler.skipped_steps(),
        amp.scaler.skipped_steps(),
        bf.scaler.skipped_steps()
    );
}
