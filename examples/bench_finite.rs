//! Benchmark of the bit-level finiteness checks (`mpx::finite`) against a memcpy of the same bytes
//! and against the naive `iter().all(|x| x.is_finite())`, all measured in the same run; plus the
//! fused unscale-and-check against separate passes.
//!
//! Run: `cargo run --release --example bench_finite` (optionally `-- --quick` for fewer repeats).
//!
//! Rates are bytes of the checked slice per second. A memcpy reads and writes those bytes, a check
//! only reads them. Each row's operations run interleaved, round after round, and the table shows
//! the median round, so background load hits them alike.

use std::hint::black_box;
use std::time::Duration;

use dfdx::prelude::*;
use half::f16;
use mpx::finite::{all_finite, all_finite_f16, all_finite_f32, unscale_into_checked};

#[path = "common/measure.rs"]
mod measure;
use measure::{gbs, measure};

/// Deterministic finite test data (no NaN/inf, so every check scans the whole slice).
fn data(n: usize) -> Vec<f32> {
    measure::uniform(n).map(|u| u * 1000.0).collect()
}

fn rounds_for(bytes: usize, quick: bool) -> usize {
    let base = if bytes > 16 << 20 { 15 } else { 60 };
    if quick { base / 3 } else { base }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let sizes = [1usize << 20, 16 << 20];

    println!(
        "all_finite vs memcpy (copy_from_slice) vs naive iter().all(is_finite); all data finite"
    );
    println!(
        "{:<5} {:>10} {:>8} | {:>11} {:>13} {:>11} | {:>9} {:>9}",
        "dtype",
        "elements",
        "MB",
        "memcpy GB/s",
        "all_finite GB/s",
        "naive GB/s",
        "vs memcpy",
        "vs naive"
    );
    for &n in &sizes {
        // f32
        let src = data(n);
        let mut dst = vec![0.0f32; n];
        let bytes = n * 4;
        let r = rounds_for(bytes, quick);
        let t = measure(
            r,
            &mut [
                &mut || dst.copy_from_slice(black_box(&src)),
                &mut || assert!(black_box(all_finite_f32(black_box(&src)))),
                &mut || assert!(black_box(black_box(&src).iter().all(|x| x.is_finite()))),
            ],
        );
        row("f32", n, bytes, &t);
        black_box(&dst);

        // f16
        let mut src16 = vec![f16::ZERO; n];
        src16
            .iter_mut()
            .zip(&src)
            .for_each(|(h, &x)| *h = f16::from_f32(x));
        let mut dst16 = vec![f16::ZERO; n];
        let bytes = n * 2;
        let r = rounds_for(bytes, quick);
        let t = measure(
            r,
            &mut [
                &mut || dst16.copy_from_slice(black_box(&src16)),
                &mut || assert!(black_box(all_finite_f16(black_box(&src16)))),
                &mut || assert!(black_box(black_box(&src16).iter().all(|x| x.is_finite()))),
            ],
        );
        row("f16", n, bytes, &t);
        black_box(&dst16);
    }

    println!();
    println!(
        "fused unscale_into_checked (one pass) vs separate passes (all_finite, widen/copy, multiply)"
    );
    println!(
        "{:<5} {:>10} | {:>10} {:>12} | {:>8}",
        "src", "elements", "fused ms", "separate ms", "speedup"
    );
    let inv = 1.0f32 / 1024.0;
    for &n in &sizes {
        let src = data(n);
        let mut src16 = vec![f16::ZERO; n];
        src16
            .iter_mut()
            .zip(&src)
            .for_each(|(h, &x)| *h = f16::from_f32(x));
        let mut dst = vec![0.0f32; n];
        let mut dst2 = vec![0.0f32; n];
        let r = rounds_for(n * 4, quick);
        let t = measure(
            r,
            &mut [
                &mut || assert!(unscale_into_checked(black_box(&src16), inv, &mut dst).unwrap()),
                &mut || {
                    assert!(all_finite_f16(black_box(&src16)));
                    half::slice::HalfFloatSliceExt::convert_to_f32_slice(&src16[..], &mut dst2);
                    dst2.iter_mut().for_each(|x| *x *= inv);
                },
            ],
        );
        assert_eq!(dst, dst2, "fused and separate agree");
        fused_row("f16", n, &t);
        let t = measure(
            r,
            &mut [
                &mut || assert!(unscale_into_checked(black_box(&src), inv, &mut dst).unwrap()),
                &mut || {
                    assert!(all_finite_f32(black_box(&src)));
                    dst2.copy_from_slice(&src);
                    dst2.iter_mut().for_each(|x| *x *= inv);
                },
            ],
        );
        assert_eq!(dst, dst2, "fused and separate agree");
        fused_row("f32", n, &t);
    }

    println!();
    println!(
        "all_finite on a dfdx tensor tree (dfdx 0.13 lends no storage slice: copy out + check)"
    );
    println!(
        "{:<5} {:>10} | {:>15} {:>17} | {:>9}",
        "dtype", "elements", "slice GB/s", "tensor tree GB/s", "ratio"
    );
    let dev: Cpu = Default::default();
    for &n in &sizes {
        let src = data(n);
        let t32 = dev.tensor_from_vec(src.clone(), (n,));
        let r = rounds_for(n * 4, quick);
        let t = measure(
            r,
            &mut [
                &mut || assert!(all_finite_f32(black_box(&src))),
                &mut || assert!(all_finite(black_box(&(t32.clone(),)))),
            ],
        );
        let (a, b) = (gbs(n * 4, t[0]), gbs(n * 4, t[1]));
        println!(
            "{:<5} {:>10} | {:>15.1} {:>17.1} | {:>8.2}x",
            "f32",
            n,
            a,
            b,
            b / a
        );
    }
}

fn row(dtype: &str, n: usize, bytes: usize, t: &[Duration]) {
    let (copy, check, naive) = (gbs(bytes, t[0]), gbs(bytes, t[1]), gbs(bytes, t[2]));
    println!(
        "{:<5} {:>10} {:>8.1} | {:>11.1} {:>15.1} {:>11.1} | {:>8.0}% {:>8.1}x",
        dtype,
        n,
        bytes as f64 / 1e6,
        copy,
        check,
        naive,
        100.0 * check / copy,
        check / naive
    );
}

fn fused_row(src: &str, n: usize, t: &[Duration]) {
    let (f, s) = (t[0].as_secs_f64() * 1e3, t[1].as_secs_f64() * 1e3);
    println!(
        "{:<5} {:>10} | {:>10.3} {:>12.3} | {:>7.2}x",
        src,
        n,
        f,
        s,
        s / f
    );
}
