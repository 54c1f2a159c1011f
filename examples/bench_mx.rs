//! Benchmark of MX quantization (`mpx::mx`): quantize (f32 -> packed MX) and dequantize (packed
//! MX -> f32) for MXFP8 E4M3 and MXFP4 E2M1 at block size 32, against a memcpy of the same f32
//! bytes, all measured in the same run.
//!
//! Run: `cargo run --release --example bench_mx` (optionally `-- --quick` for fewer repeats).
//!
//! Rates count f32 elements (M elements/s) and the f32 bytes on the wide side (GB/s = 4 bytes
//! per element / time), so a row reads directly against the memcpy of the same bytes. Quantize
//! writes into an existing tensor (`MxTensor::requantize`) and dequantize into an existing buffer
//! (`MxTensor::dequantize_into`), like the memcpy into an existing buffer. Each row's operations
//! run interleaved, round after round, and the table shows the median round.

use std::hint::black_box;
use std::time::Duration;

use mpx::mx::{MxFormat, MxSpec, MxTensor, quantize_dequantize_into};

#[path = "common/measure.rs"]
mod measure;
use measure::measure;

/// Deterministic test data: normal-ish values over a few binades, like weights or activations.
fn data(n: usize) -> Vec<f32> {
    measure::uniform(n).map(|u| u * u * u * 8.0).collect()
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let shapes = [(1024usize, 768usize), (4096, 4096)];
    let formats = [MxFormat::Fp8E4M3, MxFormat::Fp4E2M1];

    println!(
        "MX quantize / dequantize, block size 32, vs memcpy (copy_from_slice) of the f32 bytes"
    );
    println!(
        "{threads} threads available; 'fused q+dq' = quantize_dequantize_into (one pass, no packing)"
    );
    println!(
        "{:<10} {:<11} {:<11} {:>7} | {:>9} {:>10} {:>8} | {:>9}",
        "shape", "format", "op", "threads", "ms", "M elem/s", "GB/s", "vs memcpy"
    );
    println!("{}", "-".repeat(90));
    for &(r, c) in &shapes {
        let n = r * c;
        let x = data(n);
        let bytes = n * 4;
        let rounds = match (n > 4 << 20, quick) {
            (true, true) => 5,
            (true, false) => 15,
            (false, true) => 20,
            (false, false) => 60,
        };
        let mut copy = vec![0.0f32; n];
        let mut out = vec![0.0f32; n];
        for &format in &formats {
            let spec = MxSpec::new(format);
            let mut t = MxTensor::quantize(&x, &[r, c], &spec).expect("valid shape");
            let t_ref = t.clone();
            let mut ops: Vec<(&str, usize)> = vec![("memcpy", 1)];
            let times = {
                let mut memcpy = || copy.copy_from_slice(black_box(&x));
                let mut q1 = || t.requantize(black_box(&x), 1).expect("same shape");
                let tq = t_ref.clone();
                let mut d1 = || {
                    tq.dequantize_into(black_box(&mut out), 1)
                        .expect("same length")
                };
                let mut fused_out = vec![0.0f32; n];
                let mut fused = || {
                    quantize_dequantize_into(black_box(&x), &[r, c], &spec, &mut fused_out)
                        .expect("shape");
                };
                ops.extend([("quantize", 1), ("dequantize", 1), ("fused q+dq", 1)]);
                measure(rounds, &mut [&mut memcpy, &mut q1, &mut d1, &mut fused])
            };
            assert_eq!(t, t_ref, "requantize reproduces the tensor");
            let times_mt = {
                let mut memcpy = || copy.copy_from_slice(black_box(&x));
                let mut qn = || t.requantize(black_box(&x), threads).expect("same shape");
                let tq = t_ref.clone();
                let mut dn = || {
                    tq.dequantize_into(black_box(&mut out), threads)
                        .expect("length")
                };
                measure(rounds, &mut [&mut memcpy, &mut qn, &mut dn])
            };
            assert_eq!(t, t_ref, "threaded quantize reproduces the tensor");
            assert_eq!(
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                t_ref
                    .dequantize()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            );
            ops.extend([("quantize", threads), ("dequantize", threads)]);
            let all: Vec<Duration> = times.iter().chain(&times_mt[1..]).copied().collect();
            let memcpy = times[0].min(times_mt[0]);
            for (i, (&(op, th), d)) in ops.iter().zip(&all).enumerate() {
                if i == 0 && format != formats[0] {
                    continue; // one memcpy row per shape
                }
                let d = if i == 0 { memcpy } else { *d };
                let s = d.as_secs_f64();
                let fname = if i == 0 {
                    "-".to_string()
                } else {
                    format.name()
                };
                println!(
                    "{:<10} {:<11} {:<11} {:>7} | {:>9.3} {:>10.0} {:>8.2} | {:>8.0}%",
                    format!("{r}x{c}"),
                    fname,
                    op,
                    th,
                    s * 1e3,
                    n as f64 / s / 1e6,
                    bytes as f64 / s / 1e9,
                    100.0 * memcpy.as_secs_f64() / s
                );
            }
        }
    }
    println!();
    println!("'vs memcpy' = memcpy time / op time (100% = as fast as copying the f32 data once).");
}
