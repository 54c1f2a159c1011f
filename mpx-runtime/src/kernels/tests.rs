//! Every supported path against an f64 reference, within the bounds stated in the module docs.

use half::f16;

use super::strided::Packing;
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
        Operand::F32(v) => f64::from(v[idx]),
        Operand::F16(v) => v[idx].to_f64(),
        Operand::Bf16(v) => half::bf16::from_f32(v[idx]).to_f64(),
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
    let native = path == KernelPath::Avx512Fp16
        && matches!((a.values(), b.values()), (Operand::F16(_), Operand::F16(_)));
    let (rel, abs) = if native {
        fp16_error_bound(k)
    } else {
        (f32_error_bound(k + 1), 0.0)
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
    let op = |v32: &'static str| -> (Operand<'_>, Operand<'_>, Operand<'_>) {
        match v32 {
            "f32" => (Operand::F32(&x), Operand::F32(&w), Operand::F32(&dy)),
            "bf16" => (Operand::Bf16(&x), Operand::Bf16(&w), Operand::Bf16(&dy)),
            _ => (Operand::F16(&xh), Operand::F16(&wh), Operand::F16(&dyh)),
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
    let tall = MatRef::new(Operand::F32(&one), 1 << 63, 1, 0, 1).unwrap();
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
    let e = MatRef::new(Operand::F32(&one[..1]), 3, 1, 1 << 63, 1).unwrap_err();
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
    assert!(MatRef::new(Operand::F32(&one), 1, 3, 1, 1 << 63).is_err());
    assert!(MatRef::row_major_f32(&one, 1 << 62, 4).is_err());
    // the reach is exact: the last reachable element is allowed, one past it is not
    let v = [0.0f32; 8];
    assert!(MatRef::new(Operand::F32(&v), 3, 2, 3, 1).is_ok()); // reaches 2·3 + 1·1 + 1 = 8
    assert_eq!(
        MatRef::new(Operand::F32(&v[..7]), 3, 2, 3, 1).unwrap_err(),
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
    let e = bias_act_into(&mut acc, &[], Activation::Identity, Dst::F32(&mut out)).unwrap_err();
    assert_eq!(e, KernelError::EmptyRow { what: "bias" });
    assert!(e.to_string().contains("bias is empty"), "{e}");
    let e = bias_act_into(&mut acc, &[0.0; 4], Activation::ReLU, Dst::F32(&mut out)).unwrap_err();
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
        bias_act_into(&mut acc, &bias, act, Dst::F16(&mut out)).unwrap();
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
        assert!(m * n * k >= driver::PAR_MIN_WORK);
        let (a, b) = (values(m * k, 13), values(k * n, 14));
        let h = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
        let (ah, bh) = (h(&a), h(&b));
        let ops = [
            (Operand::F32(&a), Operand::F32(&b)),
            (Operand::F16(&ah), Operand::F16(&bh)),
            (Operand::Bf16(&a), Operand::Bf16(&b)),
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
                let g = driver::Grid::new(m, n, mr, nr, threads);
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
            MatRef::new(Operand::F32(&a_big), m, k, 3 * k, 3).unwrap(),
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
    // B stored transposed (k contiguous, as Wᵀ): panels of 16 columns take the AVX transpose,
    // the last, partial one the generic loop; kc with and without a remainder of 8
    let (k, n) = (300, 45);
    let w = values(n * k, 41); // W: n x k row-major; B = Wᵀ, B(p, j) = w[j * k + p]
    let src = pack::Src {
        data: &w[..],
        rs: 1,
        cs: k,
    };
    for (pc, kc) in [(0, 1), (3, 7), (8, 8), (5, 13), (0, 256), (44, 256)] {
        for (jc, nc) in [(0usize, 45usize), (16, 16), (3, 40)] {
            let mut got = vec![f32::NAN; nc.div_ceil(16) * 16 * kc];
            pack::pack_b(&mut got, src, (pc, kc), (jc, nc), 16);
            for (idx, v) in got.iter().enumerate() {
                let (jp, p, j) = (idx / (16 * kc), idx % (16 * kc) / 16, idx % 16);
                let col = jp * 16 + j;
                let want = if col < nc {
                    w[(jc + col) * k + pc + p]
                } else {
                    0.0
                };
                assert_eq!(v.to_bits(), want.to_bits(), "kc {kc} nc {nc} at {idx}");
            }
        }
    }
}
