//! Timing helpers for the benchmark examples: interleaved rounds and medians, so a noisy
//! neighbour slows every measured operation alike.
#![allow(dead_code)]

use std::time::{Duration, Instant};

/// Median of the per-round durations.
pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Runs each closure once per round, interleaved, for `rounds` rounds (after one warm-up round),
/// and returns the median duration of each.
///
/// In every round each closure first runs once untimed, then once timed: a closure that follows
/// another finds the allocator in the other's state (glibc has given the other's freed large
/// blocks back to the system, and the next call faults its pages in again), which a loop that
/// runs one kind of step never sees. The settling call measures each closure in its own steady
/// state.
pub fn measure(rounds: usize, ops: &mut [&mut dyn FnMut()]) -> Vec<Duration> {
    for op in ops.iter_mut() {
        op();
    }
    let mut times = vec![Vec::with_capacity(rounds); ops.len()];
    for _ in 0..rounds {
        for (i, op) in ops.iter_mut().enumerate() {
            op();
            let t = Instant::now();
            op();
            times[i].push(t.elapsed());
        }
    }
    times.into_iter().map(median).collect()
}

/// The CPU's model name, from `/proc/cpuinfo` (benchmarks name the CPU they ran on).
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// Gigabytes per second for `bytes` moved in `d`.
pub fn gbs(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// `n` deterministic pseudo-random values, uniform in [-0.5, 0.5] (xorshift32): the same data on
/// every machine and every run.
pub fn uniform(n: usize) -> impl Iterator<Item = f32> {
    let mut x = 0x2545_f491u32;
    (0..n).map(move |_| {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x as f32 / u32::MAX as f32 - 0.5
    })
}

/// Runs `f` with mpx's GEMM forced onto its AVX2 + FMA path when `avx2` (the instructions of a
/// CPU without AVX-512; dfdx's kernels and mpx's element-wise passes keep this CPU's own), else on
/// the path this CPU chose.
pub fn on_path<R>(avx2: bool, f: impl FnOnce() -> R) -> R {
    if avx2 {
        use mpx::__bench::{KernelPath, with_path};
        with_path(KernelPath::Avx2Fma, f).expect("this CPU has AVX2 and FMA")
    } else {
        f()
    }
}
