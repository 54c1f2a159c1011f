//! Benchmark of casting a model to half precision: dfdx's element-wise `to_dtype`, mpx's
//! `cast_module` (fresh module, slice conversions) and `cast_module_into` (rewrites the working
//! copy in place, no new buffers), both directions, next to a memcpy of the same f32 bytes, all
//! measured in the same run.
//!
//! Run: `cargo run --release --example bench_cast` (optionally `-- --quick` for fewer rounds).
//!
//! Model: the MLP of DESIGN section 4 (512-1024-1024-10, about 1.6 M parameters). Each round runs
//! every operation once, interleaved; the table shows the median round.

use std::hint::black_box;

use dfdx::prelude::*;
use mpx::cast::{CastScratch, cast_module, cast_module_into};
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
    let mut work = cast_module::<f16, f32, _>(&master);
    let mut work_bf16 = cast_module::<bf16, f32, _>(&master);
    let mut wide = dev.build_module::<Mlp, f32>();
    let source_h = cast_module::<f16, f32, _>(&master);
    let (mut s1, mut s2, mut s3) = (CastScratch::new(), CastScratch::new(), CastScratch::new());
    let src: Vec<f32> = vec![0.5; params];
    let mut dst: Vec<f32> = vec![0.0; params];

    let names = [
        "memcpy of the f32 bytes",
        "dfdx to_dtype::<f16> (element-wise)",
        "cast_module::<f16> (fresh module)",
        "cast_module_into::<f16> (in place)",
        "cast_module_into::<bf16> (in place, emulated)",
        "cast_module_into::<f32> from f16 (in place)",
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
                cast_module_into::<f16, f32, _>(&master, &mut work, &mut s1).expect("same model");
                black_box(&work);
            },
            &mut || {
                cast_module_into::<bf16, f32, _>(&master, &mut work_bf16, &mut s2)
                    .expect("same model");
                black_box(&work_bf16);
            },
            &mut || {
                cast_module_into::<f32, f16, _>(&source_h, &mut wide, &mut s3).expect("same model");
                black_box(&wide);
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
