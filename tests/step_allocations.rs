//! A converted step keeps its working copy and gradient buffers across calls: after the first
//! step, no step allocates anything near the size of the working copy, once the program holds an
//! `mpx::settings::KeepBuffers` for the fused layers' own work buffers. Without one, mpx keeps
//! nothing: those buffers are allocated by every step. Measured with a counting allocator (this
//! test binary's global allocator; counts are per thread).

use dfdx::optim::{Sgd, SgdConfig};
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::step::GradScaler;

mod common;
use common::heap;

#[global_allocator]
static ALLOC: heap::Counting = heap::Counting;

type Mlp = (
    Linear<256, 256>,
    ReLU,
    Linear<256, 256>,
    ReLU,
    Linear<256, 4>,
);
type Model = <Mlp as BuildOnDevice<Cpu, f32>>::Built;
type X = Tensor<Rank2<2, 256>, f32, Cpu>;

#[mixed_step(scaling = scaler)]
fn step(
    model: &mut Model,
    opt: &mut Sgd<Model, f32, Cpu>,
    grads: Gradients<f32, Cpu>,
    x: &X,
    scaler: &mut GradScaler,
) -> Gradients<f32, Cpu> {
    let out = model.forward(x.trace(grads));
    let mut grads = out.square().mean().backward();
    opt.update(model, &grads).unwrap();
    model.zero_grads(&mut grads);
    grads
}

/// The same step in f32, as written before the conversion.
fn step_f32(
    model: &mut Model,
    opt: &mut Sgd<Model, f32, Cpu>,
    grads: Gradients<f32, Cpu>,
    x: &X,
) -> Gradients<f32, Cpu> {
    let out = model.forward(x.trace(grads));
    let mut grads = out.square().mean().backward();
    opt.update(model, &grads).unwrap();
    model.zero_grads(&mut grads);
    grads
}

/// Bytes allocated by each of `n` calls of `f` after a first, warming call.
fn per_call(n: usize, mut f: impl FnMut()) -> (usize, Vec<usize>) {
    let before = heap::allocated_here();
    f();
    let first = heap::allocated_here() - before;
    let later = (0..n)
        .map(|_| {
            let before = heap::allocated_here();
            f();
            heap::allocated_here() - before
        })
        .collect();
    (first, later)
}

/// The tests of this binary run one at a time: one of them reads the process's heap in use.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn a_converted_step_allocates_no_new_working_copy_per_call() {
    let _serial = serial();
    let dev = Cpu::seed_from_u64(0);
    let init = dev.build_module::<Mlp, f32>();
    let x: X = dev.sample_normal();
    // The f16 working copy: 2 bytes per parameter.
    let params = 256 * 256 * 2 + 256 * 4 + 256 * 2 + 4;
    let working_copy_bytes = 2 * params;

    let mut model = init.clone();
    let mut opt = Sgd::new(&model, SgdConfig::default());
    let mut grads = Some(model.alloc_grads());
    let (_, plain) = per_call(5, || {
        grads = Some(step_f32(&mut model, &mut opt, grads.take().unwrap(), &x));
    });

    // the mixed step, 6 calls; `keep`: with the layers' buffers kept
    let mixed_calls = |keep: bool| {
        let keep = keep.then(mpx::settings::KeepBuffers::new);
        let mut model = init.clone();
        let mut opt = Sgd::new(&model, SgdConfig::default());
        let mut grads = Some(model.alloc_grads());
        let mut scaler = GradScaler::default();
        let (first, later) = per_call(5, || {
            grads = Some(step(
                &mut model,
                &mut opt,
                grads.take().unwrap(),
                &x,
                &mut scaler,
            ));
        });
        drop(keep);
        assert_eq!(scaler.applied_steps() + scaler.skipped_steps(), 6);
        // the step ran on the working copy of mpx's layers (`HalfLayers`), whose cast is measured
        assert!(scaler.last_step().unwrap().mpx_layers);
        (first, later)
    };
    let (_, unkept) = mixed_calls(false);
    let (first, mixed) = mixed_calls(true);
    // Nothing kept by default: every step allocates the fused layers' large buffers, at least the
    // f32 weight gradient of each 256x256 layer.
    let weight_grads = 2 * 256 * 256 * 4;
    for (u, m) in unkept.iter().zip(&mixed) {
        assert!(
            *u >= m + weight_grads,
            "without KeepBuffers a step allocated {u} bytes, with it {m}"
        );
    }
    println!(
        "bytes allocated per step: f32 {plain:?}, mixed {mixed:?} (first {first}); working copy {working_copy_bytes}"
    );
    assert!(
        first >= working_copy_bytes,
        "the first step builds the working copy: {first} bytes"
    );
    for (p, m) in plain.iter().zip(&mixed) {
        // Beyond what the f32 step itself allocates, a mixed step allocates far less than a
        // working copy: its casts, gradients and buffers are reused.
        assert!(
            *m <= p + working_copy_bytes / 4,
            "mixed step allocated {m} bytes, the f32 step {p}; the working copy is {working_copy_bytes}"
        );
    }
}

/// A scaler keeps its working copy's large tensors and their gradients' buffers from step to
/// step; dropped, it frees them: steps of a model with a scaler of their own, the model and the
/// scaler then dropped, leave the process's heap in use where it was.
#[test]
fn a_dropped_scaler_frees_what_it_kept() {
    let _serial = serial();
    let dev = Cpu::seed_from_u64(1);
    let init = dev.build_module::<Mlp, f32>();
    let x: X = dev.sample_normal();
    let run = || {
        let mut model = init.clone();
        let mut opt = Sgd::new(&model, SgdConfig::default());
        let mut grads = model.alloc_grads();
        let mut scaler = GradScaler::default();
        for _ in 0..3 {
            grads = step(&mut model, &mut opt, grads, &x, &mut scaler);
        }
        assert_eq!(scaler.applied_steps(), 3);
    };
    // the first run grows what lives as long as the process (the GEMM's packing buffers)
    run();
    let before = heap::current();
    run();
    let after = heap::current();
    // one 256 x 256 layer's f16 working copy is 128 KiB
    assert!(
        after <= before + (16 << 10),
        "the heap in use grew by {} bytes over a run with a scaler of its own",
        after.saturating_sub(before)
    );
}
