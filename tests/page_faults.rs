//! Making a scaler changes nothing of the process's allocator (a library keeps no process-wide
//! side effects; an earlier scaler raised glibc's malloc thresholds): large buffers freed after
//! it are still given back to the system, so writing them again faults their pages in as it did
//! before. Counted with the process's minor page faults (`/proc/self/stat`, Linux, glibc). How
//! many pages a step faults in depends on the state glibc's own adaptive thresholds are in (a
//! plain dfdx f32 step here faults 0 or about 1950 per step from one run to the next); it is
//! measured by `examples/bench_faults.rs`, not asserted. This binary
//! has no test harness (`harness = false`): it runs on the main thread of a fresh process
//! (glibc's main arena, where a training loop runs), with nothing else beside it.

#![cfg_attr(
    not(all(target_os = "linux", target_env = "gnu")),
    allow(dead_code, unused_imports)
)]

use mpx::precision::f16;
use mpx::step::GradScaler;

/// The process's minor page faults so far (field 10 of `/proc/self/stat`).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // fields after the command name, which is in parentheses and may hold spaces
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    rest.split(' ').nth(7).unwrap().parse().unwrap()
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn main() {
    println!("skipped: page faults are counted from /proc/self/stat, with glibc's malloc");
}

/// Faults per round of `n` rounds (after one unmeasured round) of allocating eight 1 MiB buffers,
/// writing them and freeing them all: what a step's output tensors do. glibc raises its mmap
/// threshold to 1 MiB at the first free, but then trims the heap's free top back to the system
/// whenever it passes twice that, so each round faults its pages in again, unless it was told
/// to keep more.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn churn(n: u64) -> u64 {
    let round = |i: u64| {
        let bufs: Vec<Vec<f32>> = (0..8)
            .map(|_| {
                #[allow(clippy::cast_precision_loss)]
                let v = vec![i as f32 + 1.0; 1 << 18];
                v
            })
            .collect();
        std::hint::black_box(&bufs);
    };
    round(0);
    let before = minor_faults();
    for i in 0..n {
        round(i);
    }
    (minor_faults() - before) / n
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn main() {
    // A fresh process: glibc gives such buffers back to the system each round, and a scaler
    // changes nothing of that (a library keeps no process-wide side effects).
    let fresh = churn(8);
    let scaler = GradScaler::<f16>::default();
    let after = churn(8);
    drop(scaler);
    assert!(fresh >= 64, "{fresh} faults per round before any scaler");
    assert!(
        after + 16 >= fresh,
        "{after} faults per round after a scaler was made, {fresh} before: the scaler changed the allocator"
    );
    println!(
        "a scaler leaves the allocator as it is: ok ({fresh} faults per round of 8 MiB before, {after} after)"
    );
}
