//! A converted step keeps its working copy and gradient buffers across calls: after the first
//! step, no step allocates anything near the size of the working copy. Measured with a counting
//! allocator (this test binary's global allocator; counts are per thread).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use dfdx::optim::{Sgd, SgdConfig};
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::step::GradScaler;

struct Counting;

thread_local! {
    static BYTES: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; only adds a thread-local byte count.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = BYTES.try_with(|b| b.set(b.get() + layout.size()));
        // SAFETY: the caller's layout is passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn allocated() -> usize {
    BYTES.with(Cell::get)
}

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
    grads: &mut Gradients<f32, Cpu>,
    x: &X,
    scaler: &mut GradScaler,
) {
    let out = model.forward(x.trace(grads.clone()));
    *grads = out.square().mean().backward();
    opt.update(model, grads).unwrap();
    model.zero_grads(grads);
}

#[test]
fn a_converted_step_allocates_no_new_working_copy_per_call() {
    let dev = Cpu::seed_from_u64(0);
    let mut model = dev.build_module::<Mlp, f32>();
    let mut opt = Sgd::new(&model, SgdConfig::default());
    let mut grads = model.alloc_grads();
    let x: X = dev.sample_normal();
    let mut scaler = GradScaler::default();
    // The f16 working copy: 2 bytes per parameter; its gradient buffers as much again.
    let params = 256 * 256 * 2 + 256 * 4 + 256 * 2 + 4;
    let working_copy_bytes = 2 * params;

    let before = allocated();
    step(&mut model, &mut opt, &mut grads, &x, &mut scaler);
    let first = allocated() - before;
    assert!(
        first >= 2 * working_copy_bytes,
        "the first step builds the buffers: {first} bytes"
    );

    for i in 0..5 {
        let before = allocated();
        step(&mut model, &mut opt, &mut grads, &x, &mut scaler);
        let later = allocated() - before;
        println!(
            "step {}: {later} bytes allocated (working copy: {working_copy_bytes})",
            i + 2
        );
        assert!(
            later < working_copy_bytes / 4,
            "step {}: {later} bytes allocated; the working copy is {working_copy_bytes}",
            i + 2
        );
    }
    assert_eq!(scaler.applied_steps(), 6);
}
