//! Every supported path against an f64 reference, within the bounds stated in the crate docs.

use half::f16;

use super::path::detected_path;
use super::strided::Packing;
use super::threads::{available_threads, max_threads, with_threads};
use super::*;

/// Deterministic values in [-1, 1) (a small LCG), some exact zeros.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            if i % 17 == 0 {
                0.0
            } else {
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            }
        })
        .collect()
}

/// Element (i, j) of a view, as f64, as the kernel sees it (bf16 rounded).
fn at(m: &MatRef<'_>, i: usize, j: usize) -> f64 {
    let idx = i * m.row_stride() + j * m.col_stride();
    match m.values() {
        FloatSlice::F32(v) => f64::from(v[idx]),
        FloatSlice::F16(v) => v[idx].to_f64(),
        FloatSlice::Bf16(v) => half::bf16::from_f32(v[idx]).to_f64(),
    }
}

/// Checks `gemm_on(path, a, b)` against the f64 product, within `rel·S + abs` per element.
fn check(path: KernelPath, a: MatRef<'_>, b: MatRef<'_>, accumulate: bool) {
    let (m, n, k) = (a.rows(), b.cols(), a.cols());
    let init = values(m * n, 99);
    let mut c = if accumulate {
        init.clone()
    } else {
        vec![f32::NAN; m * n]
    };
    gemm_on(path, a, b, &mut c, accumulate).unwrap();
    let (rel, abs) = match (path, a.values(), b.values()) {
        (KernelPath::Avx512Fp16, FloatSlice::F16(_), FloatSlice::F16(_)) => fp16_error_bound(k),
        // the data holds no subnormals: c' = c, S' = S; + 1 for the accumulated C
        (KernelPath::Avx512Bf16, FloatSlice::Bf16(_), FloatSlice::Bf16(_)) => {
            let (rel, abs) = bf16_error_bound(k);
            (rel + f32_error_bound(1), abs)
        }
        _ => (f32_error_bound(k + 1), 0.0),
    };
    for i in 0..m {
        for j in 0..n {
            let (mut exact, mut s) = (0.0f64, 0.0f64);
            for p in 0..k {
                let prod = at(&a, i, p) * at(&b, p, j);
                exact += prod;
                s += prod.abs();
            }
            if accumulate {
                exact += f64::from(init[i * n + j]);
                s += f64::from(init[i * n + j]).abs();
            }
            let got = f64::from(c[i * n + j]);
            assert!(
                (got - exact).abs() <= rel * s + abs,
                "{path:?} ({m}x{k})·({k}x{n}) at ({i},{j}): {got} vs {exact}, bound {}",
                rel * s + abs
            );
        }
    }
}

/// The three products of a Linear layer on shapes with partial tiles and more than one k block.
fn linear_products(path: KernelPath, kind: &str) {
    let (bsz, i, o) = (37, 300, 70);
    let (x, w, dy) = (values(bsz * i, 1), values(o * i, 2), values(bsz * o, 3));
    let h = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
    let (xh, wh, dyh) = (h(&x), h(&w), h(&dy));
    let op = |v32: &'static str| -> (FloatSlice<'_>, FloatSlice<'_>, FloatSlice<'_>) {
        match v32 {
            "f32" => (
                FloatSlice::F32(&x),
                FloatSlice::F32(&w),
                FloatSlice::F32(&dy),
            ),
            "bf16" => (
                FloatSlice::Bf16(&x),
                FloatSlice::Bf16(&w),
                FloatSlice::Bf16(&dy),
            ),
            _ => (
                FloatSlice::F16(&xh),
                FloatSlice::F16(&wh),
                FloatSlice::F16(&dyh),
            ),
        }
    };
    let kind: &'static str = match kind {
        "f32" => "f32",
        "bf16" => "bf16",
        _ => "f16",
    };
    let (xo, wo, dyo) = op(kind);
    let (xm, wm, dym) = (
        MatRef::row_major(xo, bsz, i).unwrap(),
        MatRef::row_major(wo, o, i).unwrap(),
        MatRef::row_major(dyo, bsz, o).unwrap(),
    );
    check(path, xm, wm.t(), false); // forward X·Wᵀ
    check(path, dym, wm, true); // dX += dY·W
    check(path, dym.t(), xm, true); // dW += dYᵀ·X
}

#[test]
fn every_supported_path_meets_its_bound_on_f32_f16_bf16() {
    let supported = KernelPath::supported();
    assert!(supported.contains(&KernelPath::Portable));
    for path in supported {
        for kind in ["f32", "f16", "bf16"] {
            linear_products(path, kind);
        }
    }
}

#[test]
fn fp16_bound_is_about_260_times_the_f32_bound_and_holds_at_step_shapes() {
    let (rel, _) = fp16_error_bound(1024);
    let r = rel / f32_error_bound(1024);
    // γ(32, 2^-11) / γ(1024, 2^-24) = 2^13·32/1024 ≈ 256; the f16 FMA is much coarser per product
    assert!(r > 200.0 && r < 300.0, "{r}");
    if KernelPath::Avx512Fp16.is_supported() {
        let (a, b) = (values(64 * 1024, 5), values(1024 * 80, 6));
        let h = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
        let (ah, bh) = (h(&a), h(&b));
        check(
            KernelPath::Avx512Fp16,
            MatRef::row_major_f16(&ah, 64, 1024).unwrap(),
            MatRef::row_major_f16(&bh, 1024, 80).unwrap(),
            false,
        );
    }
}

#[test]
fn forcing_a_path_needs_the_cpu_features() {
    for path in KernelPath::ALL {
        let r = with_path(path, active_path);
        if path.is_supported() {
            assert_eq!(r, Ok(path));
        } else {
            assert!(matches!(r, Err(KernelError::Unsupported { .. })));
        }
    }
    assert_eq!(active_path(), detected_path());
}

/// With no path forced, f16 operands are summed in f32 on every CPU: the product of f16 values
/// is the product of the same values widened to f32, bit for bit (thin and ordinary shapes),
/// and products past f16's range (512 x 256 = 131072 > 65504) sum to their finite f32 value.
/// On a CPU with AVX512-FP16 the f16-summing path, forced, gives infinity there.
#[test]
fn f16_operands_sum_in_f32_unless_a_path_is_forced() {
    for (m, n, k) in [(4, 8, 3), (64, 80, 200), (33, 130, 70)] {
        let (a, b) = (values(m * k, 11), values(k * n, 12));
        let h = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
        let (ah, bh) = (h(&a), h(&b));
        let w = |v: &[f16]| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
        let (aw, bw) = (w(&ah), w(&bh));
        let product = |a: FloatSlice<'_>, b: FloatSlice<'_>| {
            let mut c = vec![0.0f32; m * n];
            let (a, b) = (MatRef::row_major(a, m, k), MatRef::row_major(b, k, n));
            gemm(a.unwrap(), b.unwrap(), &mut c, false).unwrap();
            c.into_iter().map(f32::to_bits).collect::<Vec<_>>()
        };
        let c16 = product(FloatSlice::F16(&ah), FloatSlice::F16(&bh));
        let c32 = product(FloatSlice::F32(&aw), FloatSlice::F32(&bw));
        assert_eq!(c16, c32, "{m} x {n} x {k}");
    }
    let (m, n, k) = (8, 64, 4);
    let a = vec![f16::from_f32(512.0); m * k];
    let b = vec![f16::from_f32(256.0); k * n];
    let run = |path: Option<KernelPath>| {
        let mut c = vec![0.0f32; m * n];
        let (a, b) = (
            MatRef::row_major_f16(&a, m, k).unwrap(),
            MatRef::row_major_f16(&b, k, n).unwrap(),
        );
        match path {
            Some(p) => with_path(p, || gemm(a, b, &mut c, false)).unwrap().unwrap(),
            None => gemm(a, b, &mut c, false).unwrap(),
        }
        c
    };
    assert!(run(None).iter().all(|&v| v == 4.0 * 131_072.0));
    if KernelPath::Avx512Fp16.is_supported() {
        assert!(
            run(Some(KernelPath::Avx512Fp16))
                .iter()
                .all(|v| v.is_infinite())
        );
    }
}

#[test]
fn shape_errors_are_reported() {
    let a = [0.0f32; 6];
    let mut c = [0.0f32; 4];
    let r = gemm(
        MatRef::row_major_f32(&a, 2, 3).unwrap(),
        MatRef::row_major_f32(&a, 2, 3).unwrap(),
        &mut c,
        false,
    );
    assert!(matches!(r, Err(KernelError::InnerMismatch { .. })));
    assert_eq!(
        MatRef::row_major_f32(&a[..5], 3, 2).unwrap_err(),
        KernelError::OperandTooShort {
            name: "operand",
            needed: 6,
            len: 5
        }
    );
    let r = gemm(
        MatRef::row_major_f32(&a, 2, 3).unwrap(),
        MatRef::row_major_f32(&a, 3, 2).unwrap(),
        &mut c[..3],
        false,
    );
    assert!(matches!(r, Err(KernelError::OutputLength { .. })));
}

/// Issue 18, defect 1: sizes that wrap around in `usize` must be refused, on every path, before
/// any kernel runs (before the fix, `m x n` wrapped to 0 and the GEMM wrote through a null-sized
/// C: SIGSEGV; a wrapping stride read far outside A on `Avx2Fma`, panicked elsewhere).
#[test]
fn wrapping_sizes_and_strides_are_errors_not_wild_accesses() {
    let one = [1.0f32; 2];
    // (1 << 63) x 1 with row stride 0: reaches one element; m x n = 2^64 wraps to 0 = c.len()
    let tall = MatRef::new(FloatSlice::F32(&one), 1 << 63, 1, 0, 1).unwrap();
    let b = MatRef::row_major_f32(&one, 1, 2).unwrap();
    for path in KernelPath::supported() {
        let mut c: [f32; 0] = [];
        assert_eq!(
            gemm_on(path, tall, b, &mut c, false),
            Err(KernelError::OutputLength {
                m: 1 << 63,
                n: 2,
                len: 0
            }),
            "{path:?}"
        );
    }
    // 3 rows 2^63 apart: the last row's offset 2^64 wraps to 0, inside a 1-element slice
    let e = MatRef::new(FloatSlice::F32(&one[..1]), 3, 1, 1 << 63, 1).unwrap_err();
    assert_eq!(
        e,
        KernelError::OperandOverflow {
            name: "operand",
            rows: 3,
            cols: 1,
            row_stride: 1 << 63,
            col_stride: 1
        }
    );
    // the same through the transpose and through a column stride
    assert!(MatRef::new(FloatSlice::F32(&one), 1, 3, 1, 1 << 63).is_err());
    assert!(MatRef::row_major_f32(&one, 1 << 62, 4).is_err());
    // the reach is exact: the last reachable element is allowed, one past it is not
    let v = [0.0f32; 8];
    assert!(MatRef::new(FloatSlice::F32(&v), 3, 2, 3, 1).is_ok()); // reaches 2·3 + 1·1 + 1 = 8
    assert_eq!(
        MatRef::new(FloatSlice::F32(&v[..7]), 3, 2, 3, 1).unwrap_err(),
        KernelError::OperandTooShort {
            name: "operand",
            needed: 8,
            len: 7
        }
    );
}

/// Issue 18, defect 6: an empty bias used to be reported as "acc has 6 values, expected 6".
#[test]
fn element_wise_errors_say_what_was_wrong() {
    let mut acc = [0.0f32; 6];
    let mut out = [0.0f32; 6];
    let e = bias_act_into(
        &mut acc,
        &[],
        Activation::Identity,
        FloatSliceMut::F32(&mut out),
    )
    .unwrap_err();
    assert_eq!(e, KernelError::EmptyRow { what: "bias" });
    assert!(e.to_string().contains("bias is empty"), "{e}");
    let e = bias_act_into(
        &mut acc,
        &[0.0; 4],
        Activation::ReLU,
        FloatSliceMut::F32(&mut out),
    )
    .unwrap_err();
    assert_eq!(
        e,
        KernelError::NotWholeRows {
            what: "acc",
            len: 6,
            row_len: 4,
            row_what: "bias"
        }
    );
    assert!(
        e.to_string()
            .contains("acc has 6 values, not a whole number of rows of 4"),
        "{e}"
    );
    let e = relu_mask_bias_grad_f32(&mut acc, None, &mut []).unwrap_err();
    assert_eq!(e, KernelError::EmptyRow { what: "bias_grad" });
    let mut dy = [f16::ZERO; 6];
    let e = relu_mask_bias_grad_f16(&mut dy, None, &mut [0.0; 5]).unwrap_err();
    assert!(matches!(
        e,
        KernelError::NotWholeRows {
            len: 6,
            row_len: 5,
            ..
        }
    ));
}

#[test]
fn epilogues_match_scalar_references() {
    let (rows, cols) = (5, 300);
    let acc0 = values(rows * cols, 7);
    let bias = values(cols, 8);
    for act in [Activation::Identity, Activation::ReLU] {
        let f = |z: f32| {
            if act == Activation::ReLU {
                z.max(0.0)
            } else {
                z
            }
        };
        let mut acc = acc0.clone();
        let mut out = vec![f16::ZERO; rows * cols];
        bias_act_into(&mut acc, &bias, act, FloatSliceMut::F16(&mut out)).unwrap();
        for (idx, o) in out.iter().enumerate() {
            assert_eq!(*o, f16::from_f32(f(acc0[idx] + bias[idx % cols])));
        }
    }
    // backward: mask from the output, column sums in f32
    let y: Vec<f16> = values(rows * cols, 9)
        .iter()
        .map(|&v| f16::from_f32(v.max(0.0)))
        .collect();
    let dy0: Vec<f16> = values(rows * cols, 10)
        .iter()
        .map(|&v| f16::from_f32(v))
        .collect();
    let mut dy = dy0.clone();
    let mut db = vec![0.5f32; cols];
    relu_mask_bias_grad_f16(&mut dy, Some(&ReluMask::from_f16(&y)), &mut db).unwrap();
    for (j, got) in db.iter().enumerate() {
        let mut s = 0.5f64;
        for r in 0..rows {
            let idx = r * cols + j;
            let want = if y[idx].to_f32() > 0.0 {
                dy0[idx]
            } else {
                f16::ZERO
            };
            assert_eq!(dy[idx].to_bits(), want.to_bits());
            s += want.to_f64();
        }
        assert!((f64::from(*got) - s).abs() <= 1e-6, "{j}");
    }
    assert!(relu_mask_bias_grad_f16(&mut dy, Some(&ReluMask::from_f16(&y[1..])), &mut db).is_err());
}

/// Runs `gemm_threads` on `threads` threads and returns the output's bits.
fn bits_on(path: KernelPath, a: MatRef<'_>, b: MatRef<'_>, threads: usize) -> Vec<u32> {
    let mut c = values(a.rows() * b.cols(), 21);
    driver::gemm_threads(path, a, b, &mut c, true, threads).unwrap();
    c.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn any_thread_count_gives_the_same_bits_as_one() {
    // (m, n, k, A stored transposed, B stored transposed): all above the split threshold, with
    // partial tiles, a split along rows only (n = 10) and along columns only (m = 10)
    let shapes = [
        (150, 300, 100, false, true),
        (10, 1100, 200, true, false),
        (260, 10, 900, false, false),
    ];
    for (m, n, k, at, bt) in shapes {
        assert!(m * n * k >= tile::PAR_MIN_WORK);
        let (a, b) = (values(m * k, 13), values(k * n, 14));
        let h = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
        let (ah, bh) = (h(&a), h(&b));
        let ops = [
            (FloatSlice::F32(&a), FloatSlice::F32(&b)),
            (FloatSlice::F16(&ah), FloatSlice::F16(&bh)),
            (FloatSlice::Bf16(&a), FloatSlice::Bf16(&b)),
        ];
        for (ao, bo) in ops {
            let am = if at {
                MatRef::row_major(ao, k, m).unwrap().t()
            } else {
                MatRef::row_major(ao, m, k).unwrap()
            };
            let bm = if bt {
                MatRef::row_major(bo, n, k).unwrap().t()
            } else {
                MatRef::row_major(bo, k, n).unwrap()
            };
            for path in KernelPath::supported() {
                let one = bits_on(path, am, bm, 1);
                for threads in 2..=4 {
                    assert_eq!(
                        one,
                        bits_on(path, am, bm, threads),
                        "{path:?} {m}x{n}x{k} on {threads} threads"
                    );
                }
            }
        }
        // and the split result is right (gemm_on uses every available thread)
        check(
            detected_path(),
            MatRef::row_major_f32(&a, m, k).unwrap(),
            MatRef::row_major_f32(&b, k, n).unwrap(),
            false,
        );
    }
}

#[test]
fn long_products_are_packed_in_groups_of_whole_k_blocks() {
    // the shapes the bit-for-bit tests use to cover more than one group
    // (2^20 values: 5 k blocks of 736 lines, 93 of 44)
    assert_eq!(driver::k_group(256, 32 + 704, 3200), 1280);
    // bf16: two values of k to an element, so half the lines count
    assert_eq!(driver::k_group(256, 88 / 2, 50_000), 23_808);
    // a short product in one group; a huge one still a whole k block at a time
    assert_eq!(driver::k_group(256, 1024 + 1024, 512), 512);
    assert_eq!(driver::k_group(256, 1024 + 1024, 1024), 512);
    assert_eq!(driver::k_group(256, 1024 + 1024, 100), 256);
    assert_eq!(driver::k_group(256, 1 << 20, 5000), 256);
}

#[test]
fn the_grid_covers_every_element_once_and_splits_large_products() {
    for (m, n) in [
        (1, 1),
        (10, 1100),
        (260, 10),
        (256, 1024),
        (1024, 512),
        (37, 70),
    ] {
        for (mr, nr) in [(6, 16), (8, 32), (8, 64), (4, 16)] {
            for threads in 1..=5 {
                let g = tile::Grid::new(m, n, mr, nr, threads);
                let mut seen = vec![0u8; m * n];
                for t in 0..g.blocks() {
                    let ((r0, r1), (c0, c1)) = g.block(t);
                    assert!(
                        r0 % mr == 0 && c0 % nr == 0,
                        "blocks start on tile boundaries"
                    );
                    for r in r0..r1 {
                        for c in c0..c1 {
                            seen[r * n + c] += 1;
                        }
                    }
                }
                assert!(seen.iter().all(|&s| s == 1), "{m}x{n} {mr}x{nr} {threads}");
                if threads == 1 {
                    assert_eq!(g.blocks(), 1);
                } else if m >= 16 * mr || n >= 16 * nr {
                    assert!(g.blocks() >= 2, "{m}x{n} {mr}x{nr} {threads}");
                }
            }
        }
    }
}

#[test]
fn thread_counts_are_validated_and_restored() {
    assert_eq!(with_threads(0, || ()), Err(KernelError::ZeroThreads));
    let before = max_threads();
    assert_eq!(
        with_threads(usize::MAX, max_threads),
        Ok(available_threads())
    );
    let nested = with_threads(1, || (max_threads(), with_threads(2, max_threads)));
    assert_eq!(nested, Ok((1, Ok(2.min(available_threads())))));
    assert_eq!(max_threads(), before);
}

#[test]
fn the_pool_runs_every_block_once_and_reports_panics() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let counts: Vec<AtomicUsize> = (0..50).map(|_| AtomicUsize::new(0)).collect();
    for extra in [0, 1, 3] {
        pool::for_each_block(counts.len(), extra, &|t| {
            counts[t].fetch_add(1, Ordering::Relaxed);
        });
    }
    assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 3));
    let r = std::panic::catch_unwind(|| {
        pool::for_each_block(20, 2, &|t| assert_ne!(t, 7, "block 7 fails"));
    });
    assert!(r.is_err());
    // the pool still works after a panic
    let sum = AtomicUsize::new(0);
    pool::for_each_block(10, 2, &|t| {
        sum.fetch_add(t, Ordering::Relaxed);
    });
    assert_eq!(sum.into_inner(), 45);
}

#[test]
fn relu_masks_match_a_scalar_reference_on_every_f16_and_special_f32() {
    let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let m = ReluMask::from_f16(&all);
    assert_eq!(m.len(), all.len());
    for (i, y) in all.iter().enumerate() {
        // positive and not NaN (+inf passes)
        assert_eq!(m.get(i), y.to_f32() > 0.0, "bits {:#06x}", y.to_bits());
    }
    let specials = [
        0.0f32,
        -0.0,
        1e-45,
        -1e-45,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        3.0,
    ];
    let y: Vec<f32> = (0..200).map(|i| specials[i % specials.len()]).collect();
    let m = ReluMask::from_f32(&y);
    // apply through the public pass, rows of 50 (word boundaries fall inside rows)
    let mut dy = vec![1.5f32; y.len()];
    let mut db = vec![0.0f32; 50];
    relu_mask_bias_grad_f32(&mut dy, Some(&m), &mut db).unwrap();
    for (i, (d, v)) in dy.iter().zip(&y).enumerate() {
        assert_eq!(m.get(i), *v > 0.0);
        assert_eq!(
            d.to_bits(),
            if *v > 0.0 { 1.5f32 } else { 0.0 }.to_bits(),
            "{i}"
        );
    }
}

/// `gemm_threads` under a forced packing policy, output bits (C starts at `init`, or is
/// overwritten when `init` is `None`).
fn bits_packed(
    packing: Packing,
    (a, b): (MatRef<'_>, MatRef<'_>),
    init: Option<&[f32]>,
    threads: usize,
) -> Vec<u32> {
    let mut c = init.map_or_else(|| vec![f32::NAN; a.rows() * b.cols()], <[f32]>::to_vec);
    strided::with_packing(packing, || {
        driver::gemm_threads(KernelPath::Avx2Fma, a, b, &mut c, init.is_some(), threads)
    })
    .unwrap();
    c.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn in_place_and_packed_operands_give_the_same_bits_within_the_bound() {
    if !KernelPath::Avx2Fma.is_supported() {
        return;
    }
    // (m, n, k): thin (n = 10, m = 10, k = 10), edge tiles both ways, more than one k block (k >
    // 256), a row block past mc = 72, column blocks past nc = 512, tiny attention-head products
    let shapes = [
        (32, 10, 128),
        (10, 128, 32),
        (32, 128, 10),
        (37, 70, 300),
        (80, 1100, 30),
        (6, 16, 1),
        (16, 8, 16),
        (1, 1, 5),
        (130, 33, 257),
    ];
    for (m, n, k) in shapes {
        let (av, bv) = (values(m * k, 31), values(k * n, 32));
        let init = values(m * n, 33);
        // A: k contiguous, rows contiguous, neither (a column-strided view); B: rows
        // contiguous (in place possible) or transposed (packed)
        let a_big = values(3 * m * k, 34);
        let a_views = [
            MatRef::row_major_f32(&av, m, k).unwrap(),
            MatRef::row_major_f32(&av, k, m).unwrap().t(),
            MatRef::new(FloatSlice::F32(&a_big), m, k, 3 * k, 3).unwrap(),
        ];
        let b_views = [
            MatRef::row_major_f32(&bv, k, n).unwrap(),
            MatRef::row_major_f32(&bv, n, k).unwrap().t(),
        ];
        for a in a_views {
            for b in b_views {
                for init in [None, Some(&init[..])] {
                    let want = bits_packed(Packing::Always, (a, b), init, 1);
                    for packing in [Packing::Auto, Packing::Never] {
                        for threads in [1, 3] {
                            assert_eq!(
                                want,
                                bits_packed(packing, (a, b), init, threads),
                                "{packing:?} {m}x{n}x{k} strides A {}/{} B {}/{} init {} on {threads}",
                                a.row_stride(),
                                a.col_stride(),
                                b.row_stride(),
                                b.col_stride(),
                                init.is_some()
                            );
                        }
                    }
                    strided::with_packing(Packing::Never, || {
                        check(KernelPath::Avx2Fma, a, b, init.is_some());
                    });
                }
            }
        }
    }
}

#[test]
fn overwriting_c_gives_plus_zero_as_zeroing_and_adding_does() {
    // every product is -0.0: their sum is -0.0, and 0.0 + -0.0 = +0.0 in C on every path
    let (m, n, k) = (13, 21, 7);
    let a = vec![0.0f32; m * k];
    let b = vec![-1.0f32; k * n];
    for path in KernelPath::supported() {
        let mut c = vec![f32::NAN; m * n];
        gemm_on(
            path,
            MatRef::row_major_f32(&a, m, k).unwrap(),
            MatRef::row_major_f32(&b, k, n).unwrap(),
            &mut c,
            false,
        )
        .unwrap();
        assert!(c.iter().all(|v| v.to_bits() == 0), "{path:?}");
    }
}

#[test]
fn packing_a_k_contiguous_operand_matches_the_definition() {
    // B stored transposed (k contiguous, as Wᵀ): full panels of 8, 16 or 32 columns (the kernels'
    // widths) take the AVX transpose, the last, partial one the generic loop; kc with and without
    // a remainder of 8. A with k contiguous (row-major) packs the same way.
    let (k, n) = (300, 75);
    let w = values(n * k, 41); // W: n x k row-major; B = Wᵀ, B(p, j) = w[j * k + p]
    let src = pack::Src {
        data: &w[..],
        rs: 1,
        cs: k,
    };
    let a = pack::Src {
        data: &w[..],
        rs: k,
        cs: 1,
    };
    for width in [8, 16, 32] {
        for (pc, kc) in [(0, 1), (3, 7), (8, 8), (5, 13), (0, 256), (44, 256)] {
            for (jc, nc) in [(0usize, 75usize), (16, 16), (3, 40), (0, 64)] {
                let mut got = vec![f32::NAN; nc.div_ceil(width) * width * kc];
                pack::pack_b(&mut got, src, (pc, kc), (jc, nc), width);
                let mut got_a = vec![f32::NAN; got.len()];
                pack::pack_a(&mut got_a, a, (jc, nc), (pc, kc), width);
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    got_a.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
                for (idx, v) in got.iter().enumerate() {
                    let (jp, p, j) = (idx / (width * kc), idx % (width * kc) / width, idx % width);
                    let col = jp * width + j;
                    let want = if col < nc {
                        w[(jc + col) * k + pc + p]
                    } else {
                        0.0
                    };
                    assert_eq!(
                        v.to_bits(),
                        want.to_bits(),
                        "width {width} kc {kc} nc {nc} at {idx}"
                    );
                }
            }
        }
    }
}

#[test]
fn f16_operands_pack_widened_in_one_pass_as_packed_then_widened() {
    // Random f16 bits: NaNs (signalling and quiet), infinities, subnormals and both zeros among
    // them. The definition: the f16 panel `pack_a` writes, each value widened on its own.
    let (k, lines) = (300, 75);
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let bits: Vec<u16> = (0..k * lines)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as u16
        })
        .collect();
    if !crate::convert::has_f16c() {
        println!("skipped: this CPU lacks F16C (the one-pass widening is not used here)");
    }
    let stored = [
        // k contiguous (X as A, Wᵀ as B): the one-pass transpose for full panels
        pack::Src {
            data: &bits[..],
            rs: k,
            cs: 1,
        },
        // lines contiguous: the f16 copy, then the widening pass
        pack::Src {
            data: &bits[..],
            rs: 1,
            cs: lines,
        },
    ];
    let (mr, nr) = (avx512::MR, avx512::NR);
    for src in stored {
        let bt = pack::Src {
            data: src.data,
            rs: src.cs,
            cs: src.rs,
        };
        for (pc, kc) in [(0, 1), (3, 7), (8, 8), (5, 13), (0, 256), (44, 256)] {
            for (l0, n) in [(0usize, 75usize), (16, 16), (3, 40), (0, 64), (8, 9)] {
                for (part, width) in [
                    (packs::Part::A((l0, n), (pc, kc)), mr),
                    (packs::Part::B((pc, kc), (l0, n)), nr),
                ] {
                    let len = n.div_ceil(width) * width * kc;
                    let mut got = vec![f32::NAN; len];
                    driver::pack_widened(&mut got, src, bt, part);
                    let mut want = vec![0u16; len];
                    pack::pack_a(&mut want, src, (l0, n), (pc, kc), width);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            f16::from_bits(*w).to_f32().to_bits(),
                            "{part:?} (rs {}, cs {}) at {i}",
                            src.rs,
                            src.cs
                        );
                    }
                }
            }
        }
    }
}

/// A scalar model of `vdpbf16ps` and of the AVX512-BF16 GEMM built on it, from the instruction's
/// definition (see [`bf16`](super::bf16)): independent of the kernel's code.
mod bf16_model {
    /// `x` with a subnormal value read as zero of the same sign.
    fn daz(x: f32) -> f32 {
        if x.is_subnormal() {
            f32::from_bits(x.to_bits() & 0x8000_0000)
        } else {
            x
        }
    }

    /// `fma(a, b, c)` rounded to nearest even, a result that is tiny after rounding to 24 bits
    /// with an unbounded exponent flushed to zero of its sign.
    fn fma_ftz(a: f32, b: f32, c: f32) -> f32 {
        let r = a.mul_add(b, c);
        let zero = f32::from_bits(r.to_bits() & 0x8000_0000);
        if r.is_subnormal() {
            return zero;
        }
        if r.abs() == f32::MIN_POSITIVE {
            // the exact sum p + c (p exact in f64: two 8-bit significands) as s + e (TwoSum); at
            // unbounded exponent it rounds below 2^-126 iff |p + c| < 2^-126 - 2^-151
            let (p, c) = (f64::from(a) * f64::from(b), f64::from(c));
            let s = p + c;
            let bb = s - p;
            let e = (p - (s - bb)) + (c - bb);
            let t = f64::from(f32::MIN_POSITIVE) - 2f64.powi(-151);
            if s.abs() < t || (s.abs() == t && e * s < 0.0) {
                return zero;
            }
        }
        r
    }

    fn bf(bits: u32) -> f32 {
        f32::from_bits(bits << 16)
    }

    /// One lane of `vdpbf16ps`: `acc` plus the products of the pairs `a` and `b` (low half in
    /// bits 0..16).
    pub(super) fn dp(acc: f32, a: u32, b: u32) -> f32 {
        let (a0, a1, b0, b1) = (bf(a & 0xffff), bf(a >> 16), bf(b & 0xffff), bf(b >> 16));
        // NaN priority: src1 low, src2 low, src1 high, src2 high, then the accumulator; quieted
        for x in [a0, b0, a1, b1, acc] {
            if x.is_nan() {
                return f32::from_bits(x.to_bits() | 0x0040_0000);
            }
        }
        let t = fma_ftz(daz(a1), daz(b1), daz(acc));
        let r = fma_ftz(daz(a0), daz(b0), t);
        if r.is_nan() {
            f32::from_bits(0xffc0_0000)
        } else {
            r
        }
    }

    /// `vaddps`'s `c + x` (MXCSR's defaults): a NaN operand is returned quieted, `c` first (Rust's
    /// `+` leaves the payload unspecified).
    fn add(c: f32, x: f32) -> f32 {
        match (c.is_nan(), x.is_nan()) {
            (true, _) => f32::from_bits(c.to_bits() | 0x0040_0000),
            (false, true) => f32::from_bits(x.to_bits() | 0x0040_0000),
            _ => c + x,
        }
    }

    /// `c + Σ_q dp(pairs)` as the micro-kernel computes one output: the sum from `+0.0`, then
    /// one f32 add.
    pub(super) fn tile_value(c: f32, a: &[u32], b: &[u32]) -> f32 {
        add(c, a.iter().zip(b).fold(0.0, |acc, (&x, &y)| dp(acc, x, y)))
    }
}

/// bf16 bit patterns with every kind of value: normals, subnormals, zeros, infinities, NaNs.
fn bf16_bits(n: usize, seed: u64) -> Vec<u32> {
    bf16_bits_with(n, seed, 10)
}

/// [`bf16_bits`] with one value in `one_in` drawn from the special values (the others: normals
/// across the range, subnormals, values near the smallest normal and near 1).
fn bf16_bits_with(n: usize, seed: u64, one_in: u64) -> Vec<u32> {
    const SPECIAL: [u32; 12] = [
        0x0000, 0x8000, 0x0001, 0x807f, 0x7f80, 0xff80, 0x7fc0, 0x7f81, 0x0080, 0x8080, 0x3f80,
        0x7f7f,
    ];
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let r = (s >> 16) as u32 & 0xffff;
            match s % 10 {
                0 if (s >> 50).is_multiple_of((one_in / 10).max(1)) => {
                    SPECIAL[(s >> 40) as usize % SPECIAL.len()]
                }
                1 => r & 0x807f,            // subnormal or zero
                2 => (r & 0x80ff) | 0x0080, // near the smallest normal
                3 => (r & 0x807f) | 0x3f00, // near 1: products that cancel
                _ => r & 0xbfff,            // finite (exponent below 128)
            }
        })
        .collect()
}

#[test]
fn bf16_pairs_round_every_value_as_the_scalar_definition() {
    // f32 patterns around every bf16 rounding case: bf16 patterns (specials, subnormals, NaNs
    // with payloads) with low halves that are ties, exact, or arbitrary
    let hi = bf16_bits(4096, 81);
    let lo = bf16_bits(4096, 82);
    let vals: Vec<f32> = hi
        .iter()
        .zip(&lo)
        .enumerate()
        .map(|(i, (&h, &l))| {
            let low = match i % 4 {
                0 => 0x8000,
                1 => 0,
                2 => 0x7fff,
                _ => l,
            };
            f32::from_bits((h << 16) | low)
        })
        .collect();
    for width in [8, 32, 6] {
        for kc in [1, 2, 7, 64] {
            for panel in vals.chunks_exact(width * kc).take(4) {
                let mut got = vec![u32::MAX; kc.div_ceil(2) * width];
                bf16::to_pairs(panel, kc, width, &mut got);
                for (idx, &w) in got.iter().enumerate() {
                    let (q, l) = (idx / width, idx % width);
                    let even = bf16::bf16_bits(panel[2 * q * width + l]);
                    let odd = if 2 * q + 1 < kc {
                        bf16::bf16_bits(panel[(2 * q + 1) * width + l])
                    } else {
                        0
                    };
                    assert_eq!(w, even | (odd << 16), "width {width} kc {kc} at {idx}");
                }
            }
        }
    }
}

#[test]
fn vdpbf16ps_matches_its_scalar_model_bit_for_bit() {
    if !KernelPath::Avx512Bf16.is_supported() {
        println!("skipped: this CPU lacks AVX512-BF16 (the path is not used here)");
        return;
    }
    let lanes = 16 * 40_000;
    let a = bf16_bits(2 * lanes, 61);
    let b = bf16_bits(2 * lanes, 62);
    // accumulators of every kind: subnormal, zero, the negated first product (exact
    // cancellation), near the smallest normal, any bits
    let acc: Vec<f32> = bf16_bits(lanes, 63)
        .iter()
        .zip(values(lanes, 64))
        .enumerate()
        .map(|(l, (&h, x))| match l % 4 {
            0 => -(f32::from_bits(a[2 * l] << 16) * f32::from_bits(b[2 * l] << 16)),
            1 => f32::from_bits(x.to_bits() & 0x807f_ffff),
            _ => f32::from_bits((h << 16) | (x.to_bits() & 0xffff)),
        })
        .collect();
    let pair = |v: &[u32], l: usize| v[2 * l] | (v[2 * l + 1] << 16);
    for chunk in 0..lanes / 16 {
        let l0 = chunk * 16;
        let acc16: [f32; 16] = acc[l0..l0 + 16].try_into().unwrap();
        let a16: [u32; 16] = std::array::from_fn(|l| pair(&a, l0 + l));
        let b16: [u32; 16] = std::array::from_fn(|l| pair(&b, l0 + l));
        // SAFETY: the CPU has AVX-512 F and AVX512-BF16 (checked above).
        let got = unsafe { super::bf16::dp_lanes(acc16, a16, b16) };
        for l in 0..16 {
            let want = bf16_model::dp(acc16[l], a16[l], b16[l]);
            assert_eq!(
                got[l].to_bits(),
                want.to_bits(),
                "acc {:#010x} a {:#010x} b {:#010x}: instruction {:#010x}, model {:#010x}",
                acc16[l].to_bits(),
                a16[l],
                b16[l],
                got[l].to_bits(),
                want.to_bits()
            );
        }
    }
}

#[test]
fn bf16_micro_kernel_matches_the_scalar_model_of_vdpbf16ps_bit_for_bit() {
    if !KernelPath::Avx512Bf16.is_supported() {
        println!("skipped: this CPU lacks AVX512-BF16 (the path is not used here)");
        return;
    }
    let (mr, nr) = (super::bf16::MR, super::bf16::NR);
    let mut lanes = 0;
    for (round, pairs) in [1usize, 2, 3, 7, 64, 128]
        .into_iter()
        .cycle()
        .take(600)
        .enumerate()
    {
        let seed = round as u64 * 3 + 1;
        let lo_hi =
            |v: Vec<u32>| -> Vec<u32> { v.chunks_exact(2).map(|p| p[0] | (p[1] << 16)).collect() };
        let a = lo_hi(bf16_bits(2 * pairs * mr, seed));
        let b = lo_hi(bf16_bits(2 * pairs * nr, seed + 1));
        // C: finite f32 values, subnormals among them, and some infinities / NaNs
        let c0: Vec<f32> = bf16_bits(mr * nr, seed + 2)
            .iter()
            .zip(values(mr * nr, seed + 3))
            .map(|(&h, x)| f32::from_bits((h << 16) | (x.to_bits() & 0xffff)))
            .collect();
        let mut c = c0.clone();
        // SAFETY: the CPU has AVX-512 F and AVX512-BF16 (checked above); `c` holds MR x NR
        // values at stride NR, owned here.
        unsafe { super::bf16::kernel(pairs, &a, &b, c.as_mut_ptr(), nr, false) };
        for i in 0..mr {
            for j in 0..nr {
                let ai: Vec<u32> = (0..pairs).map(|q| a[q * mr + i]).collect();
                let bj: Vec<u32> = (0..pairs).map(|q| b[q * nr + j]).collect();
                let want = bf16_model::tile_value(c0[i * nr + j], &ai, &bj);
                let got = c[i * nr + j];
                // a NaN's payload is not part of Rust's float semantics (an optimised build
                // of the model may quiet it differently): NaN must meet NaN, all else the bits
                let (g, w) = if got.is_nan() && want.is_nan() {
                    (0, 0)
                } else {
                    (got.to_bits(), want.to_bits())
                };
                assert_eq!(
                    g,
                    w,
                    "pairs {pairs} ({i},{j}): kernel {got:e} ({:#010x}), model {want:e} ({:#010x})",
                    got.to_bits(),
                    want.to_bits()
                );
                lanes += 1;
            }
        }
    }
    assert!(lanes > 100_000);
}

/// The AVX512-BF16 GEMM modelled from its definition: operands rounded to bf16 by
/// `precision::round_to_bf16` (the reference rounding, not the kernels' own), k blocks of 256
/// summed from `+0.0` by pairs (odd k padded with zeros) and added into `C` one block at a time.
fn bf16_gemm_model(a: &MatRef<'_>, b: &MatRef<'_>, c: &mut [f32], accumulate: bool) {
    let round = |m: &MatRef<'_>, i: usize, j: usize| -> u32 {
        let FloatSlice::Bf16(v) = m.values() else {
            unreachable!("bf16 operands")
        };
        let mut r = [0.0f32];
        crate::convert::round_to_bf16(&[v[i * m.row_stride() + j * m.col_stride()]], &mut r);
        r[0].to_bits() >> 16
    };
    let (m, n, k) = (a.rows(), b.cols(), a.cols());
    let kc = super::bf16::KC;
    for i in 0..m {
        for j in 0..n {
            let mut cij = if accumulate { c[i * n + j] } else { 0.0 };
            for pc in (0..k).step_by(kc) {
                let end = (pc + kc).min(k);
                let pair = |m: &MatRef<'_>, at: &dyn Fn(usize) -> (usize, usize), p: usize| {
                    let lo = round(m, at(p).0, at(p).1);
                    let hi = if p + 1 < end {
                        round(m, at(p + 1).0, at(p + 1).1)
                    } else {
                        0
                    };
                    lo | (hi << 16)
                };
                let ap: Vec<u32> = (pc..end)
                    .step_by(2)
                    .map(|p| pair(a, &|p| (i, p), p))
                    .collect();
                let bp: Vec<u32> = (pc..end)
                    .step_by(2)
                    .map(|p| pair(b, &|p| (p, j), p))
                    .collect();
                cij = bf16_model::tile_value(cij, &ap, &bp);
            }
            c[i * n + j] = cij;
        }
    }
}

#[test]
fn bf16_gemm_matches_the_scalar_model_bit_for_bit_and_f64_within_its_bound() {
    if !KernelPath::Avx512Bf16.is_supported() {
        println!("skipped: this CPU lacks AVX512-BF16 (the path is not used here)");
        return;
    }
    // f32 storage: bf16 values with random low halves, ties to even both ways among them,
    // subnormals, infinities and NaNs
    let f32s = |n: usize, seed: u64| -> Vec<f32> {
        bf16_bits_with(n, seed, 2000)
            .iter()
            .zip(values(n, seed + 7))
            .enumerate()
            .map(|(idx, (&h, x))| {
                let low = match idx % 5 {
                    0 => 0x8000, // a tie
                    1 => 0,      // exact
                    _ => x.to_bits() & 0xffff,
                };
                f32::from_bits((h << 16) | low)
            })
            .collect()
    };
    let (mut finite_seen, mut tiny_seen) = (0, 0);
    // (m, n, k): odd k, k past one block, edge tiles, a product split over threads
    for (m, n, k, threads) in [
        (8, 32, 2, 1),
        (9, 33, 5, 1),
        (37, 70, 300, 1),
        (16, 40, 513, 3),
        (150, 300, 100, 2),
        // packed in two groups of k blocks
        (24, 40, 50_000, 2),
    ] {
        let (av, bv) = (f32s(m * k, 51), f32s(k * n, 52));
        let init = values(m * n, 53);
        let a = MatRef::row_major(FloatSlice::Bf16(&av), m, k).unwrap();
        let b_store = f32s(k * n, 54);
        let bt = MatRef::row_major(FloatSlice::Bf16(&b_store), n, k)
            .unwrap()
            .t();
        for b in [MatRef::row_major(FloatSlice::Bf16(&bv), k, n).unwrap(), bt] {
            for accumulate in [false, true] {
                let mut want = init.clone();
                bf16_gemm_model(&a, &b, &mut want, accumulate);
                let mut got = if accumulate {
                    init.clone()
                } else {
                    vec![f32::NAN; m * n]
                };
                driver::gemm_threads(KernelPath::Avx512Bf16, a, b, &mut got, accumulate, threads)
                    .unwrap();
                // every bit, except a NaN's payload: edge tiles add into C with Rust's `+`,
                // which leaves it unspecified (the micro-kernel test above checks payloads)
                let bits = |v: &[f32]| {
                    v.iter()
                        .map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() })
                        .collect::<Vec<_>>()
                };
                assert_eq!(bits(&got), bits(&want), "{m}x{n}x{k} acc {accumulate}");
                let nan = got.iter().filter(|x| x.is_nan()).count();
                let tiny = want.iter().filter(|x| x.abs() < 1e-30).count();
                finite_seen += m * n - nan;
                tiny_seen += tiny;
            }
        }
    }
    // the data exercised the finite path, near-underflow results among them
    assert!(
        finite_seen > 20_000 && tiny_seen > 0,
        "{finite_seen} {tiny_seen}"
    );
    // on finite data without subnormals, within the stated bound of the f64 product
    linear_products(KernelPath::Avx512Bf16, "bf16");
}

#[test]
fn bf16_bound_is_the_f32_bound_with_a_rounding_per_block() {
    let (rel, abs) = bf16_error_bound(300);
    assert_eq!(rel, gamma(302, 2f64.powi(-24)));
    assert_eq!(abs, 600.0 * 2f64.powi(-126));
    assert!(rel > f32_error_bound(300));
}

/// The calibration may pick either FMA path: they must give the same bits on every operand type,
/// layout, accumulation and thread count, or the choice would change results.
#[test]
fn the_calibrated_candidates_compute_the_same_bits() {
    let candidates: Vec<KernelPath> = [KernelPath::Avx2Fma, KernelPath::Avx512]
        .into_iter()
        .filter(|p| p.is_supported())
        .collect();
    if candidates.len() < 2 {
        println!("skipped: a single FMA path on this CPU ({candidates:?}), nothing to choose");
        return;
    }
    for (m, n, k) in [
        (37, 70, 300),
        (32, 10, 128),
        (6, 16, 1),
        (130, 33, 600),
        (150, 300, 100),
        // packed in two groups of k blocks (the strided AVX2 path packs per block)
        (32, 700, 3200),
    ] {
        let (a, b) = (values(m * k, 71), values(k * n, 72));
        let h = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
        let (ah, bh) = (h(&a), h(&b));
        for (ao, bo) in [
            (FloatSlice::F32(&a), FloatSlice::F32(&b)),
            (FloatSlice::F16(&ah), FloatSlice::F16(&bh)),
            (FloatSlice::Bf16(&a), FloatSlice::Bf16(&b)),
        ] {
            let am = MatRef::row_major(ao, m, k).unwrap();
            for bm in [
                MatRef::row_major(bo, k, n).unwrap(),
                MatRef::row_major(bo, n, k).unwrap().t(),
            ] {
                for threads in [1, 3] {
                    let bits: Vec<Vec<u32>> = candidates
                        .iter()
                        .map(|&p| bits_on(p, am, bm, threads))
                        .collect();
                    assert_eq!(bits[0], bits[1], "{m}x{n}x{k} on {threads}");
                }
            }
        }
    }
}

#[test]
fn the_calibration_keeps_the_fastest_candidate_and_gemm_follows_it() {
    let c = calibration();
    assert!(c.chosen.is_supported());
    assert_eq!(detected_path(), c.chosen);
    for (chosen, nanos) in [(c.chosen, &c.nanos), (c.chosen_thin, &c.nanos_thin)] {
        let best = nanos.iter().min_by_key(|&&(_, ns)| ns).unwrap();
        assert_eq!(best.0, chosen, "{c:?}");
        assert!(nanos.iter().all(|&(p, _)| matches!(
            p,
            KernelPath::Avx2Fma | KernelPath::Avx512 | KernelPath::Portable
        )));
    }
    // gemm with no forced path: f32 on the chosen path (the thin one for n <= THIN), bf16 on
    // its own where it is preferred, f16 as f32
    let (m, n, k) = (20, 10, 50);
    let (a, b) = (values(m * k, 83), values(k * n, 84));
    let (am, bm) = (
        MatRef::row_major_f32(&a, m, k).unwrap(),
        MatRef::row_major_f32(&b, k, n).unwrap(),
    );
    let (mut got, mut expect) = (vec![0.0f32; m * n], vec![0.0f32; m * n]);
    gemm(am, bm, &mut got, false).unwrap();
    gemm_on(c.chosen_thin, am, bm, &mut expect, false).unwrap();
    assert_eq!(got, expect);
    let (m, n, k) = (20, 40, 50);
    let (a, b) = (values(m * k, 81), values(k * n, 82));
    let h = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
    let (ah, bh) = (h(&a), h(&b));
    for (ao, bo, want) in [
        (FloatSlice::F32(&a), FloatSlice::F32(&b), c.chosen),
        (
            FloatSlice::Bf16(&a),
            FloatSlice::Bf16(&b),
            if bf16_pairs_preferred() {
                KernelPath::Avx512Bf16
            } else {
                c.chosen
            },
        ),
        // f16 operands: widened and summed in f32 (never on the f16 FMA path unless forced)
        (FloatSlice::F16(&ah), FloatSlice::F16(&bh), c.chosen),
    ] {
        let (am, bm) = (
            MatRef::row_major(ao, m, k).unwrap(),
            MatRef::row_major(bo, k, n).unwrap(),
        );
        let mut got = vec![0.0f32; m * n];
        gemm(am, bm, &mut got, false).unwrap();
        let mut expect = vec![0.0f32; m * n];
        gemm_on(want, am, bm, &mut expect, false).unwrap();
        assert_eq!(got, expect, "{want:?}");
    }
}

#[test]
fn zero_where_clear_keeps_exactly_the_set_lanes_on_both_copies() {
    // lengths around the 64-value words, values of both signs, NaN and zeros in the outputs
    for n in [0, 1, 63, 64, 65, 130, 1000] {
        let y: Vec<f32> = values(n, 7)
            .iter()
            .enumerate()
            .map(|(i, v)| if i % 17 == 3 { f32::NAN } else { *v })
            .collect();
        let yh: Vec<f16> = y.iter().map(|v| f16::from_f32(*v)).collect();
        let dy: Vec<f32> = values(n, 8);
        let dyh: Vec<f16> = dy.iter().map(|v| f16::from_f32(*v)).collect();
        let (m, mh) = (ReluMask::from_f32(&y), ReluMask::from_f16(&yh));
        let mut got = dy.clone();
        m.zero_where_clear(FloatSliceMut::F32(&mut got)).unwrap();
        let mut goth = dyh.clone();
        mh.zero_where_clear(FloatSliceMut::F16(&mut goth)).unwrap();
        for i in 0..n {
            let want = if y[i] > 0.0 { dy[i] } else { 0.0 };
            assert_eq!(got[i].to_bits(), want.to_bits(), "f32 [{i}] of {n}");
            let wanth = if yh[i].to_f32() > 0.0 {
                dyh[i]
            } else {
                f16::ZERO
            };
            assert_eq!(goth[i].to_bits(), wanth.to_bits(), "f16 [{i}] of {n}");
        }
        // the baseline copy (what a CPU without AVX2 runs) gives the same bits
        let mut base = dy.clone();
        crate::Avx2Task::run(super::epilogue::ZeroWhereClear(&mut base, &m.bits));
        assert_eq!(base, got, "baseline copy, {n} values");
        assert!(
            m.zero_where_clear(FloatSliceMut::F32(&mut vec![0.0; n + 1]))
                .is_err()
        );
    }
}

/// The AVX2 path's blocking is sized to the caches (`caches.rs`): the sizing must never change a
/// bit. Shapes with partial tiles both ways, k past two k blocks (`kc = 256`), rows past Zen 3's
/// `mc = 252` and Zen 5's 510, columns past the tiny set's `nc = 16` and the fixed 512; both
/// layouts of each operand, overwriting and accumulating, one and three threads.
#[test]
fn the_avx2_blocking_sized_to_any_caches_gives_the_same_bits() {
    use super::{Caches, Sizing, with_blocking};
    if !KernelPath::Avx2Fma.is_supported() {
        return;
    }
    let sizings = [
        Sizing::Caches(Caches::ZEN3),
        Sizing::Caches(caches::ZEN5),
        Sizing::Caches(caches::SPR),
        Sizing::Caches(caches::TINY),
        Sizing::Caches(Caches::detected()),
    ];
    // the sizings differ where the shapes reach, and the kernel takes them
    assert_eq!(Sizing::Caches(caches::TINY).avx2_blocking(), (256, 6, 16));
    let t = with_blocking(Sizing::Caches(caches::TINY), avx2::tiles);
    assert_eq!((t.kc, t.mc, t.nc), (256, 6, 16));
    assert_ne!(
        Sizing::Caches(Caches::ZEN3).avx2_blocking(),
        Sizing::Caches(caches::ZEN5).avx2_blocking()
    );
    for (m, n, k) in [
        (37, 70, 600),
        (523, 35, 517),
        (13, 1100, 300),
        (259, 530, 777),
    ] {
        let (av, bv) = (values(m * k, 81), values(k * n, 82));
        let init = values(m * n, 83);
        let a_views = [
            MatRef::row_major_f32(&av, m, k).unwrap(),
            MatRef::row_major_f32(&av, k, m).unwrap().t(),
        ];
        let b_views = [
            MatRef::row_major_f32(&bv, k, n).unwrap(),
            MatRef::row_major_f32(&bv, n, k).unwrap().t(),
        ];
        for (a, b) in a_views.into_iter().zip(b_views) {
            for init in [None, Some(&init[..])] {
                for threads in [1, 3] {
                    let run = |sizing| {
                        with_blocking(sizing, || bits_packed(Packing::Auto, (a, b), init, threads))
                    };
                    let want = run(Sizing::Fixed);
                    for sizing in sizings {
                        assert!(
                            want == run(sizing),
                            "{sizing:?} {m}x{n}x{k} A {}/{} init {} on {threads}",
                            a.row_stride(),
                            a.col_stride(),
                            init.is_some()
                        );
                    }
                }
            }
        }
        // and the result is right
        with_blocking(Sizing::Caches(caches::TINY), || {
            check(
                KernelPath::Avx2Fma,
                MatRef::row_major_f32(&av, m, k).unwrap(),
                MatRef::row_major_f32(&bv, k, n).unwrap(),
                true,
            );
        });
    }
}

#[test]
fn tiny_products_give_the_bits_of_the_blocked_kernels() {
    // shapes at and below the tiny bound, the smallest (at most 256 multiply-adds, a 2-2-1 net's
    // among them) run one chain at a time: k past one k block (k = 300, 512) and two (600), thin,
    // square, every count of rows left over by the 4-row tiles and of columns by the
    // 8-column vectors, the 16-32-4 MLP's products, the bound itself; every operand layout, f32
    // and f16, overwriting (with -0.0 sums) and accumulating
    let shapes = [
        (1, 1, 1),
        (4, 2, 2),
        (4, 1, 2),
        (2, 4, 4),
        (3, 5, 2),
        (1, 1, 256),
        (16, 16, 1),
        (2, 2, 64),
        (1, 1, 300),
        (2, 1, 256),
        (1, 1, 512),
        (8, 8, 8),
        (3, 5, 7),
        (5, 17, 9),
        (6, 24, 33),
        (7, 33, 100),
        (3, 2, 600),
        (1, 40, 300),
        (32, 32, 16),
        (32, 4, 32),
        (4, 32, 32),
        (9, 9, 257),
        (32, 32, 32),
    ];
    for path in KernelPath::supported() {
        for (m, n, k) in shapes {
            assert!(m * n * k <= tiny::TINY_WORK);
            let (av, bv) = (values(m * k, 91), values(k * n, 92));
            let (ah, bh): (Vec<f16>, Vec<f16>) = (
                av.iter().copied().map(f16::from_f32).collect(),
                bv.iter().copied().map(f16::from_f32).collect(),
            );
            let views = |a: FloatSlice<'static>, b: FloatSlice<'static>| {
                [
                    (
                        MatRef::new(a, m, k, k, 1).unwrap(),
                        MatRef::new(b, k, n, n, 1).unwrap(),
                    ),
                    (
                        MatRef::new(a, k, m, m, 1).unwrap().t(),
                        MatRef::new(b, n, k, k, 1).unwrap().t(),
                    ),
                ]
            };
            // leaked: the views need 'static slices for the closure above (a test's few KiB)
            let (av, bv, ah, bh) = (
                av.leak() as &[f32],
                bv.leak() as &[f32],
                ah.leak() as &[f16],
                bh.leak() as &[f16],
            );
            let mut cases = Vec::new();
            cases.extend(views(FloatSlice::F32(av), FloatSlice::F32(bv)));
            cases.extend(views(FloatSlice::F16(ah), FloatSlice::F16(bh)));
            cases.extend(views(FloatSlice::F32(av), FloatSlice::F16(bh)));
            for (a, b) in cases {
                for init in [values(m * n, 93), vec![f32::NAN; m * n]] {
                    let accumulate = !init[0].is_nan();
                    let mut tiny_c = init.clone();
                    if !tiny::gemm(path, &a, &b, &mut tiny_c, accumulate) {
                        continue; // not an FMA-chain path for these operands
                    }
                    let mut blocked_c = init.clone();
                    driver::blocked(path, (a, b), (&mut blocked_c, accumulate), 1);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&tiny_c),
                        bits(&blocked_c),
                        "{path:?} {m}x{n}x{k} accumulate {accumulate}"
                    );
                }
            }
        }
        // the tiny path takes every product it can on an FMA path
        let ones = [1.0f32; 4];
        let one = MatRef::row_major_f32(&ones, 2, 2).unwrap();
        let mut c = [0.0f32; 4];
        assert_eq!(
            tiny::gemm(path, &one, &one, &mut c, false),
            path != KernelPath::Portable
        );
    }
}

/// A product with few columns runs as its transpose (`driver::transposed`) on the f32 FMA paths:
/// the same bits as the product run as written (`driver::blocked`), for f32 and f16 operands,
/// row-major and transposed views, overwriting and accumulating, on one thread and two.
#[test]
fn a_thin_product_run_as_its_transpose_has_the_same_bits() {
    for path in KernelPath::supported() {
        for &(m, n, k) in &[
            (64, 4, 256),
            (256, 4, 64),
            (100, 1, 37),
            (48, 2, 700),
            (33, 3, 5),
        ] {
            let (av, bv) = (values(m * k, 71), values(k * n, 72));
            let (ah, bh): (Vec<f16>, Vec<f16>) = (
                av.iter().copied().map(f16::from_f32).collect(),
                bv.iter().copied().map(f16::from_f32).collect(),
            );
            let pairs = [
                (FloatSlice::F32(&av), FloatSlice::F32(&bv)),
                (FloatSlice::F16(&ah), FloatSlice::F16(&bh)),
            ];
            for (a, b) in pairs {
                let views = [
                    (
                        MatRef::new(a, m, k, k, 1).unwrap(),
                        MatRef::new(b, k, n, n, 1).unwrap(),
                    ),
                    (
                        MatRef::new(a, k, m, m, 1).unwrap().t(),
                        MatRef::new(b, n, k, k, 1).unwrap().t(),
                    ),
                ];
                for (a, b) in views {
                    let flips = driver::transposes(path, &a, &b);
                    if matches!(path, KernelPath::Avx2Fma | KernelPath::Avx512) {
                        assert!(flips || n * 16 >= m, "{path:?} {m}x{n}x{k} not transposed");
                    }
                    for (init, accumulate) in
                        [(values(m * n, 73), true), (vec![f32::NAN; m * n], false)]
                    {
                        for threads in [1, 2] {
                            let mut ours = init.clone();
                            driver::gemm_threads(path, a, b, &mut ours, accumulate, threads)
                                .unwrap();
                            let mut written = init.clone();
                            driver::blocked(path, (a, b), (&mut written, accumulate), threads);
                            let bits =
                                |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(&ours),
                                bits(&written),
                                "{path:?} {m}x{n}x{k} accumulate {accumulate} threads {threads}"
                            );
                        }
                    }
                }
            }
        }
    }
}
