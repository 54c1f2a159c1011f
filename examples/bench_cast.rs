//! Benchmark of casting a model to half precision: dfdx's element-wise `to_dtype` and mpx's
//! `cast_module` (slice conversions), to f16, to bf16 and back to f32, next to a memcpy of the
//! same f32 bytes, all measured in the same run.
//!
//! Run: `cargo run --release --example bench_cast` (optionally `-- --quick` for fewer rounds).
//!
//! Model: the MLP of DESIGN section 4 (512-1024-1024-10, about 1.6 M parameters). Each round runs
//! every operation once, interleaved; the table shows the median round.

use std::hint::black_box;

use dfdx::prelude::*;
use mpx::cast::cast_module;
use mpx::precision::{bf16, f16};

#[path = "common/measure.rs"]
mod measure;
use measure::measure;

type Mlp = (
    (Linear<512, 1024>, ReLU),
    (Linear<1024, 1024>, ReLU),
    Linear<1024, 10>,
);

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let rounds = if quick { 5 } else { 31 };
    let dev = Cpu::default();
    let master = dev.build_module::<Mlp, f32>();
    let params = master.num_trainable_params();
    let source_h = cast_module::<f16, f32, _>(&master);
    let src: Vec<f32> = vec![0.5; params];
    let mut dst: Vec<f32> = vec![0.0; params];

    let names = [
        "memcpy of the f32 bytes",
        "dfdx to_dtype::<f16> (element-wise)",
        "cast_module::<f16>",
        "cast_module::<bf16>",
        "cast_module::<f32> from f16",
    ];
    let times = measure(
        rounds,
        &mut [
            &mut || {
                dst.copy_from_slice(black_box(&src));
                black_box(&dst);
            },
            &mut || {
                black_box(master.to_dtype::<f16>());
            },
            &mut || {
                black_box(cast_module::<f16, f32, _>(&master));
            },
            &mut || {
                black_box(cast_module::<bf16, f32, _>(&master));
            },
            &mut || {
                black_box(cast_module::<f32, f16, _>(&source_h));
            },
        ],
    );

    println!("casting an MLP 512-1024-1024-10 ({params} parameters), median of {rounds} rounds");
    println!(
        "{:<46} {:>10} {:>12} {:>14}",
        "operation", "ms", "x memcpy", "x to_dtype"
    );
    for (name, t) in names.iter().zip(&times) {
        let ms = t.as_secs_f64() * 1e3;
        println!(
            "{:<46} {:>10.3} {:>12.2} {:>14.3}",
            name,
            ms,
            t.as_secs_f64() / times[0].as_secs_f64(),
            t.as_secs_f64() / times[1].as_secs_f64()
        );
    }
}
