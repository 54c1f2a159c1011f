//! Benchmark of mpx's GEMM kernels on the 9 matmuls of one training step of MLP 512-1024-1024-10 at
//! batch 256 (per layer: forward `X·Wᵀ`, backward `dY·W` and `dYᵀ·X`), next to the peak FMA
//! throughput of each path measured in this program, and dfdx 0.13's own matmul.
//!
//! ```text
//! cargo run --release --example bench_kernels
//! ```
//!
//! mpx's GEMM uses all hardware threads by default; each configuration here is forced with
//! `with_threads` (1 thread for every path; all threads for the default choice, each f32
//! candidate of the calibration and the bf16 path). dfdx 0.13's CPU matmul uses all cores
//! through rayon. Peaks are per thread. Times are medians of 11 runs of all 9 products; rounds of
//! the configurations are interleaved. Then: small products (one thread) on the default choice
//! and each candidate; and the persistent helper pool against `std::thread::scope` (the layers'
//! kept buffers and their page faults are `examples/bench_faults`'s); and the AVX2 path's blocking,
//! fixed against sized to this CPU's caches and to Zen 3's (alone: `-- blocking`). The kernels are
//! reached through `mpx::__bench`, hooks that are not a public API.

use std::time::Instant;

use dfdx::prelude::*;
use mpx::__bench::{
    Caches, FloatSlice, KernelPath, MatRef, Sizing, available_threads, bf16_pairs_preferred,
    calibration, gemm, gemm_on, peak_fma_flops, use_scoped_threads, with_blocking, with_threads,
};
use mpx::precision::f16;

/// (batch, inputs, outputs) of the MLP's three layers.
const LAYERS: [(usize, usize, usize); 3] = [(256, 512, 1024), (256, 1024, 1024), (256, 1024, 10)];

/// The 9 products as (m, n, k, name).
fn shapes() -> Vec<(usize, usize, usize, String)> {
    let mut v = vec![];
    for (l, &(b, i, o)) in LAYERS.iter().enumerate() {
        v.push((b, o, i, format!("L{} X·Wᵀ", l + 1)));
        v.push((b, i, o, format!("L{} dY·W", l + 1)));
        v.push((o, i, b, format!("L{} dYᵀ·X", l + 1)));
    }
    v
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

/// Operands of one product in one dtype, laid out as the layer holds them.
struct Case {
    a32: Vec<f32>,
    b32: Vec<f32>,
    a16: Vec<f16>,
    b16: Vec<f16>,
    c: Vec<f32>,
    m: usize,
    n: usize,
    k: usize,
    /// B is stored transposed (the weight in `X·Wᵀ`), A is stored transposed (`dYᵀ` in `dYᵀ·X`).
    bt: bool,
    at: bool,
}

impl Case {
    fn new(idx: usize, m: usize, n: usize, k: usize) -> Self {
        Self::with_layout(idx, (m, n, k), idx % 3 == 2, idx.is_multiple_of(3))
    }
    fn with_layout(idx: usize, (m, n, k): (usize, usize, usize), at: bool, bt: bool) -> Self {
        let (a32, b32) = (
            values(m * k, idx as u32 * 2 + 1),
            values(k * n, idx as u32 * 2 + 2),
        );
        let h = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
        Case {
            a16: h(&a32),
            b16: h(&b32),
            a32,
            b32,
            c: vec![0.0; m * n],
            m,
            n,
            k,
            bt,
            at,
        }
    }
    /// One product on `path`, or on the path chosen for the operands when `None` (what `gemm`
    /// does for a layer), into the case's own output.
    fn run(&mut self, path: Option<KernelPath>, dtype: &str) {
        let mut c = std::mem::take(&mut self.c);
        self.run_into(path, dtype, &mut c);
        self.c = c;
    }

    /// [`Case::run`] into `c` (`m x n` values).
    fn run_into(&self, path: Option<KernelPath>, dtype: &str, c: &mut [f32]) {
        let (av, bv) = match dtype {
            "f32" => (FloatSlice::F32(&self.a32), FloatSlice::F32(&self.b32)),
            "bf16" => (FloatSlice::Bf16(&self.a32), FloatSlice::Bf16(&self.b32)),
            _ => (FloatSlice::F16(&self.a16), FloatSlice::F16(&self.b16)),
        };
        let a = if self.at {
            MatRef::row_major(av, self.k, self.m)
                .expect("shape fits")
                .t()
        } else {
            MatRef::row_major(av, self.m, self.k).expect("shape fits")
        };
        let b = if self.bt {
            MatRef::row_major(bv, self.n, self.k)
                .expect("shape fits")
                .t()
        } else {
            MatRef::row_major(bv, self.k, self.n).expect("shape fits")
        };
        match path {
            Some(path) => gemm_on(path, a, b, c, false),
            None => gemm(a, b, c, false),
        }
        .expect("shapes fit");
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let shapes = shapes();
    let flops: Vec<f64> = shapes
        .iter()
        .map(|&(m, n, k, _)| 2.0 * (m * n * k) as f64)
        .collect();
    let total_flop: f64 = flops.iter().sum();
    let mut cases: Vec<Case> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(m, n, k, _))| Case::new(i, m, n, k))
        .collect();
    if std::env::args().any(|a| a == "blocking") {
        avx2_blocking(&mut cases, &flops);
        return;
    }

    // peaks
    println!("Peak FMA throughput, one thread (tight loop of 12 independent FMA chains):\n");
    println!("| path | instruction | GFLOP/s |");
    println!("|---|---|---|");
    let mut peaks = std::collections::HashMap::new();
    for path in KernelPath::supported() {
        let iters = 20_000_000;
        peak_fma_flops(path, iters / 10).expect("supported");
        let t = Instant::now();
        let f = peak_fma_flops(path, iters).expect("supported");
        let g = f as f64 / t.elapsed().as_secs_f64() / 1e9;
        let ins = match path {
            KernelPath::Avx512Fp16 => "f16 vfmadd231ph zmm",
            KernelPath::Avx512Bf16 => "bf16 pairs vdpbf16ps zmm (2 multiply-adds per f32 lane)",
            KernelPath::Avx512 => "f32 vfmadd231ps zmm",
            KernelPath::Avx2Fma => "f32 vfmadd231ps ymm",
            KernelPath::Portable => {
                "f32 multiply + add in plain Rust (not vectorised: no true peak)"
            }
        };
        println!("| {path:?} | {ins} | {g:.0} |");
        peaks.insert(path, g);
    }
    let missing: Vec<_> = KernelPath::ALL
        .iter()
        .filter(|p| !p.is_supported())
        .collect();
    if !missing.is_empty() {
        println!("\nNot supported by this CPU (not measured): {missing:?}");
    }

    // the calibration's choice among the same-bits paths
    let cal = calibration();
    let fmt = |v: &[(KernelPath, u64)]| {
        v.iter()
            .map(|(p, ns)| format!("{p:?} {:.0} µs", *ns as f64 / 1e3))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "\nCalibration (first use, one thread, best of 5 rounds): ordinary products: chosen {:?} ({}); thin products (m or n <= 16): chosen {:?} ({})",
        cal.chosen,
        fmt(&cal.nanos),
        cal.chosen_thin,
        fmt(&cal.nanos_thin)
    );

    // configurations: (path, dtype, threads); `None`: the default choice (`gemm`)
    let mut configs: Vec<(Option<KernelPath>, &str, usize)> = vec![];
    for path in KernelPath::supported() {
        for dtype in ["f32", "f16", "bf16"] {
            configs.push((Some(path), dtype, 1));
        }
    }
    // all threads: the default choice, then every f32 FMA candidate it was chosen from, and the
    // bf16 path
    let all = available_threads();
    for dtype in ["f32", "f16", "bf16"] {
        configs.push((None, dtype, all));
    }
    for &(path, _) in &cal.nanos {
        configs.push((Some(path), "f32", all));
        configs.push((Some(path), "bf16", all));
    }
    if KernelPath::Avx512Bf16.is_supported() {
        configs.push((Some(KernelPath::Avx512Bf16), "bf16", all));
    }
    // dfdx reference tensors
    let dev = Cpu::default();
    let dfdx_case = |c: &Case| {
        let a = dev.tensor_from_vec(c.a32.clone(), (c.m, c.k));
        let b = dev.tensor_from_vec(c.b32.clone(), (c.k, c.n));
        (
            a.clone(),
            b.clone(),
            a.to_dtype::<f16>(),
            b.to_dtype::<f16>(),
        )
    };
    let dfdx_t: Vec<_> = cases.iter().map(dfdx_case).collect();

    let rounds = 11;
    let mut times: Vec<Vec<Vec<f64>>> = vec![vec![vec![]; shapes.len()]; configs.len() + 2];
    for round in 0..rounds + 1 {
        for (ci, &(path, dtype, threads)) in configs.iter().enumerate() {
            for (si, case) in cases.iter_mut().enumerate() {
                let t = Instant::now();
                with_threads(threads, || case.run(path, dtype)).expect("threads >= 1");
                if round > 0 {
                    times[ci][si].push(t.elapsed().as_secs_f64());
                }
            }
        }
        for (si, (a, b, a16, b16)) in dfdx_t.iter().enumerate() {
            let t = Instant::now();
            std::hint::black_box(a.clone().matmul(b.clone()));
            if round > 0 {
                times[configs.len()][si].push(t.elapsed().as_secs_f64());
            }
            let t = Instant::now();
            std::hint::black_box(a16.clone().matmul(b16.clone()));
            if round > 0 {
                times[configs.len() + 1][si].push(t.elapsed().as_secs_f64());
            }
        }
    }

    println!(
        "\nGEMM over the 9 products of one step ({:.2} GFLOP), GFLOP/s per product and in total:\n",
        total_flop / 1e9
    );
    let head: Vec<&str> = shapes.iter().map(|s| s.3.as_str()).collect();
    println!(
        "| kernel | operands | {} | total ms | total GFLOP/s | % of path peak |",
        head.join(" | ")
    );
    println!("|---|---|{}---|---|---|", "---|".repeat(shapes.len()));
    let row = |name: String, dtype: &str, t: &[Vec<f64>], peak: Option<f64>| {
        let med: Vec<f64> = t.iter().map(|v| median(v.clone())).collect();
        let per: Vec<String> = med
            .iter()
            .zip(&flops)
            .map(|(s, f)| format!("{:.0}", f / s / 1e9))
            .collect();
        let total: f64 = med.iter().sum();
        let g = total_flop / total / 1e9;
        let pct = peak.map_or("-".to_string(), |p| format!("{:.0}%", 100.0 * g / p));
        println!(
            "| {name} | {dtype} | {} | {:.2} | {g:.0} | {pct} |",
            per.join(" | "),
            total * 1e3
        );
    };
    for (ci, &(path, dtype, th)) in configs.iter().enumerate() {
        let resolved = path.unwrap_or(match dtype {
            "bf16" if bf16_pairs_preferred() => KernelPath::Avx512Bf16,
            _ => cal.chosen,
        });
        let peak_of = match (resolved, dtype) {
            (KernelPath::Portable, _) => None,
            (KernelPath::Avx512Fp16, "f16") | (KernelPath::Avx512Bf16, "bf16") => {
                peaks.get(&resolved).copied()
            }
            (KernelPath::Avx512Fp16 | KernelPath::Avx512Bf16, _) => {
                peaks.get(&KernelPath::Avx512).copied()
            }
            _ => peaks.get(&resolved).copied(),
        };
        let how = match (resolved, dtype) {
            (KernelPath::Avx512Fp16, "f16") => "f16 FMA",
            (KernelPath::Avx512Bf16, "bf16") => "bf16 pairs, vdpbf16ps",
            (_, "f16") => "widened to f32",
            (_, "bf16") => "rounded to bf16, f32 FMA",
            _ => "f32 FMA",
        };
        let name = match path {
            Some(p) => format!("mpx {p:?} ({how}), {th} thread(s)"),
            None => format!("mpx default = {resolved:?} ({how}), {th} thread(s)"),
        };
        let peak_of = peak_of.map(|p| p * th as f64);
        row(name, dtype, &times[ci], peak_of);
    }
    // the best f32 peak of this CPU
    let peak1 = KernelPath::supported()
        .into_iter()
        .find(|p| *p != KernelPath::Avx512Fp16 && *p != KernelPath::Portable)
        .and_then(|p| peaks.get(&p).copied())
        .map(|p| p * rayon_threads() as f64);
    row(
        format!("dfdx 0.13 matmul, rayon ({} threads)", rayon_threads()),
        "f32",
        &times[configs.len()],
        peak1,
    );
    row(
        format!("dfdx 0.13 matmul, rayon ({} threads)", rayon_threads()),
        "f16",
        &times[configs.len() + 1],
        peak1,
    );
    small_products();
    pool_against_scope(&mut cases);
    avx2_blocking(&mut cases, &flops);
    println!(
        "\n% of path peak: against the path's per-thread FMA peak above times the threads used (f16 operands on Avx512Fp16: the f16 FMA peak; dfdx: the best f32 SIMD peak). The portable loop is no true peak (it is not vectorised), so the portable rows show none."
    );
}

/// The threads dfdx's rayon pool uses: all hardware threads.
fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Small products, one thread: the digits example's MLP (batch 32, 64-128-128-10: forward `X·Wᵀ`,
/// `dY·W`, `dYᵀ·X`) and the ViT example's attention head and token-wise Linear products.
/// Microseconds per call (median of 11 interleaved rounds of 200 calls each).
fn small_products() {
    // (m, n, k, A stored transposed, B stored transposed, name)
    let shapes: [(usize, usize, usize, bool, bool, &str); 12] = [
        (32, 128, 64, false, true, "digits L1 X·Wᵀ"),
        (128, 64, 32, true, false, "digits L1 dYᵀ·X"),
        (32, 128, 128, false, true, "digits L2 X·Wᵀ"),
        (32, 128, 128, false, false, "digits L2 dY·W"),
        (128, 128, 32, true, false, "digits L2 dYᵀ·X"),
        (32, 10, 128, false, true, "digits L3 X·Wᵀ"),
        (32, 128, 10, false, false, "digits L3 dY·W"),
        (10, 128, 32, true, false, "digits L3 dYᵀ·X"),
        (16, 16, 8, false, true, "ViT head Q·Kᵀ"),
        (16, 8, 16, false, false, "ViT head P·V"),
        (512, 32, 32, false, true, "ViT 512x32 X·Wᵀ"),
        (512, 64, 32, false, true, "ViT 512x64 X·Wᵀ"),
    ];
    let mut cases: Vec<Case> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(m, n, k, at, bt, _))| Case::with_layout(i + 100, (m, n, k), at, bt))
        .collect();
    let dev = Cpu::default();
    let dfdx_t: Vec<_> = cases
        .iter()
        .map(|c| {
            (
                dev.tensor_from_vec(c.a32.clone(), (c.m, c.k)),
                dev.tensor_from_vec(c.b32.clone(), (c.k, c.n)),
            )
        })
        .collect();
    // columns: (label, path or None for the default choice, dtype)
    let cal = calibration();
    let mut cols: Vec<(String, Option<KernelPath>, &str)> = vec![(
        format!(
            "default f32 ({:?}, thin: {:?})",
            cal.chosen, cal.chosen_thin
        ),
        None,
        "f32",
    )];
    for &(p, _) in &cal.nanos {
        cols.push((format!("{p:?} f32"), Some(p), "f32"));
    }
    cols.push(("default f16".to_string(), None, "f16"));
    cols.push((
        format!("{:?} bf16 (emulated)", cal.chosen),
        Some(cal.chosen),
        "bf16",
    ));
    if KernelPath::Avx512Bf16.is_supported() {
        cols.push((
            "Avx512Bf16 bf16".to_string(),
            Some(KernelPath::Avx512Bf16),
            "bf16",
        ));
    }
    let (rounds, reps) = (11, 200);
    // [column][shape] -> seconds per call; the last column: dfdx f32
    let mut times = vec![vec![vec![]; shapes.len()]; cols.len() + 1];
    for round in 0..=rounds {
        for (si, case) in cases.iter_mut().enumerate() {
            for (ci, (_, path, dtype)) in cols.iter().enumerate() {
                let t = Instant::now();
                with_threads(1, || {
                    for _ in 0..reps {
                        case.run(*path, dtype);
                    }
                })
                .expect("threads >= 1");
                if round > 0 {
                    times[ci][si].push(t.elapsed().as_secs_f64() / reps as f64);
                }
            }
            let (a, b) = &dfdx_t[si];
            let t = Instant::now();
            for _ in 0..reps {
                std::hint::black_box(a.clone().matmul(b.clone()));
            }
            if round > 0 {
                times[cols.len()][si].push(t.elapsed().as_secs_f64() / reps as f64);
            }
        }
    }
    println!("\nSmall products, µs per call (mpx on 1 thread, dfdx on its rayon pool):\n");
    let head: Vec<&str> = cols.iter().map(|c| c.0.as_str()).collect();
    println!("| product | m x n x k | {} | dfdx f32 |", head.join(" | "));
    println!("|---|---|{}---|", "---|".repeat(cols.len()));
    let mut sums = vec![0.0f64; cols.len() + 1];
    for (si, &(m, n, k, _, _, name)) in shapes.iter().enumerate() {
        let med: Vec<f64> = (0..=cols.len())
            .map(|ci| median(times[ci][si].clone()))
            .collect();
        sums.iter_mut().zip(&med).for_each(|(s, t)| *s += t);
        let cells: Vec<String> = med.iter().map(|t| format!("{:.2}", t * 1e6)).collect();
        println!("| {name} | {m}x{n}x{k} | {} |", cells.join(" | "));
    }
    let cells: Vec<String> = sums.iter().map(|t| format!("{:.2}", t * 1e6)).collect();
    println!("| all | | {} |", cells.join(" | "));
}

/// The 9 products on all threads, split by the persistent pool or by `std::thread::scope`
/// (interleaved rounds, medians): which one the GEMM should keep.
fn pool_against_scope(cases: &mut [Case]) {
    let all = available_threads();
    let (rounds, reps) = (21, 3);
    let mut times = [vec![], vec![]];
    for round in 0..=rounds {
        for (ki, scoped) in [false, true].into_iter().enumerate() {
            use_scoped_threads(scoped);
            let t = Instant::now();
            for _ in 0..reps {
                for case in cases.iter_mut() {
                    with_threads(all, || case.run(None, "f32")).expect("threads >= 1");
                }
            }
            if round > 0 {
                times[ki].push(t.elapsed().as_secs_f64() / reps as f64);
            }
        }
    }
    use_scoped_threads(false);
    let [pool, scope] = times.map(|v| {
        let mut v = v;
        v.sort_by(f64::total_cmp);
        (v[v.len() / 4], v[v.len() / 2], v[3 * v.len() / 4])
    });
    println!(
        "\nHelper threads on the 9 products (f32, default path, {all} threads), ms per step, median (quartiles) of {rounds} interleaved rounds:\n"
    );
    println!("| threads | median ms | quartiles ms |");
    println!("|---|---|---|");
    for (name, (q1, q2, q3)) in [("persistent pool", pool), ("std::thread::scope", scope)] {
        println!(
            "| {name} | {:.2} | {:.2}-{:.2} |",
            q2 * 1e3,
            q1 * 1e3,
            q3 * 1e3
        );
    }
    println!("| scope / pool | {:.3} | |", scope.1 / pool.1);
}

/// The 9 products (f32) on the forced AVX2 path: its fixed blocking of before against blocking
/// sized to this CPU's caches and to Zen 3's (`mpx_kernels`' `caches.rs`), on one thread and on
/// all, in interleaved rounds (medians per product, summed), with the AVX2 FMA peak measured in
/// the same rounds (a busy neighbour slows both alike).
fn avx2_blocking(cases: &mut [Case], flops: &[f64]) {
    if !KernelPath::Avx2Fma.is_supported() {
        println!("\nAVX2 blocking: no AVX2+FMA on this CPU, not measured");
        return;
    }
    let mut peaks = vec![];
    let here = Caches::detected();
    let sizings = [
        ("fixed", Sizing::Fixed),
        ("this CPU's caches", Sizing::Caches(here)),
        ("Zen 3's caches", Sizing::Caches(Caches::ZEN3)),
    ];
    let mut threads = vec![1, available_threads()];
    threads.dedup();
    let configs: Vec<_> = threads
        .iter()
        .flat_map(|&th| sizings.iter().map(move |&s| (th, s)))
        .collect();
    let rounds = 31;
    let mut times = vec![vec![vec![]; cases.len()]; configs.len()];
    for round in 0..=rounds {
        let t = Instant::now();
        let f = peak_fma_flops(KernelPath::Avx2Fma, 4_000_000).expect("supported");
        if round > 0 {
            peaks.push(f as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        for (ci, &(th, (_, sizing))) in configs.iter().enumerate() {
            for (si, case) in cases.iter_mut().enumerate() {
                let t = Instant::now();
                with_blocking(sizing, || {
                    with_threads(th, || case.run(Some(KernelPath::Avx2Fma), "f32"))
                })
                .expect("threads >= 1");
                if round > 0 {
                    times[ci][si].push(t.elapsed().as_secs_f64());
                }
            }
        }
    }
    let peak = median(peaks);
    let kib = |b: usize| b >> 10;
    println!(
        "\nAVX2 blocking (forced Avx2Fma, f32, the 9 products; medians of {rounds} interleaved rounds). This CPU: L1d {} KiB, L2 {} KiB, L3 {} KiB over {} core(s); Zen 3: L1d 32 KiB, L2 512 KiB, L3 32 MiB over 8 cores. AVX2 FMA peak {peak:.0} GFLOP/s per thread (median over the rounds).\n",
        kib(here.l1d),
        kib(here.l2),
        here.l3.map_or(0, kib),
        here.l3_cores
    );
    println!("| blocking | kc x mc x nc | threads | ms per step | GFLOP/s | % of AVX2 peak |");
    println!("|---|---|---|---|---|---|");
    let total_flop: f64 = flops.iter().sum();
    for (ci, &(th, (name, sizing))) in configs.iter().enumerate() {
        let total: f64 = times[ci].iter().map(|v| median(v.clone())).sum();
        let g = total_flop / total / 1e9;
        let (kc, mc, nc) = sizing.avx2_blocking();
        println!(
            "| {name} | {kc} x {mc} x {nc} | {th} | {:.2} | {g:.0} | {:.0}% |",
            total * 1e3,
            100.0 * g / (peak * th as f64)
        );
    }
}
