//! `all_finite` over trees (tensors of every float dtype, `Vec`s, integer tensors, nested tuples,
//! `Option`, `Box`, maps) and the slice checks against the naive `is_finite` on random bit patterns.

use std::collections::BTreeMap;

use dfdx::prelude::*;
use half::f16;
use mpx::finite::{
    FiniteError, all_finite, all_finite_f16, all_finite_f32, all_finite_slice,
    unscale_in_place_checked, unscale_into_checked,
};
use mpx::precision::AMP;
use proptest::prelude::*;

/// The runtime's chunk length (4096, an implementation detail): the sizes below straddle its
/// boundaries, where a chunked check could miss a value.
const CHUNK: usize = 4096;

fn naive_f32(bits: &[u32]) -> bool {
    bits.iter().all(|&b| f32::from_bits(b).is_finite())
}

fn naive_f16(bits: &[u16]) -> bool {
    bits.iter().all(|&b| f16::from_bits(b).is_finite())
}

#[test]
fn mixed_tree_finite_and_each_leaf_can_spoil_it() {
    let dev: Cpu = Default::default();
    let labels: Tensor<Rank1<3>, usize, _> = dev.tensor([0, 4, 9]);
    let ids: Tensor<Rank1<2>, i32, _> = dev.tensor([-1, 7]);
    let big = vec![0.5f32; 3 * CHUNK + 5];
    let make =
        |w32: Vec<f32>, w16: Vec<f32>, amp: f32, v: Vec<f32>, opt: Option<f32>, boxed: f32| {
            let n32 = w32.len();
            let n16 = w16.len();
            let h: Vec<f16> = w16.iter().map(|&x| f16::from_f32(x)).collect();
            let mut map = BTreeMap::new();
            map.insert("bias", dev.tensor_from_vec(vec![boxed, 1.0], (2,)));
            (
                dev.tensor_from_vec(w32, (n32,)),
                (dev.tensor_from_vec(h, (n16,)), labels.clone()),
                vec![AMP(f16::from_f32(amp))],
                (v, (ids.clone(), opt.map(|x| dev.tensor([x, 2.0f32])))),
                Box::new(map),
            )
        };
    let tree = make(
        big.clone(),
        vec![1.0; 10],
        2.0,
        vec![3.0; 4],
        Some(4.0),
        5.0,
    );
    assert!(all_finite(&tree));
    // Extremes that are still finite: max, negative zero, subnormals.
    let edge = make(
        vec![f32::MAX, -0.0, f32::from_bits(1), f32::MIN],
        vec![65504.0, -65504.0, 5.96e-8],
        -65504.0,
        vec![f32::MIN_POSITIVE],
        None,
        -0.0,
    );
    assert!(all_finite(&edge));

    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for pos in [0, CHUNK - 1, CHUNK, 3 * CHUNK + 4] {
            let mut w = big.clone();
            w[pos] = bad;
            let t = make(w, vec![1.0; 10], 2.0, vec![3.0; 4], Some(4.0), 5.0);
            assert!(!all_finite(&t), "{bad} at f32 tensor position {pos}");
        }
        let cases = [
            make(big.clone(), vec![1.0, bad], 2.0, vec![3.0], Some(4.0), 5.0),
            make(big.clone(), vec![1.0], bad, vec![3.0], Some(4.0), 5.0),
            make(big.clone(), vec![1.0], 2.0, vec![3.0, bad], Some(4.0), 5.0),
            make(big.clone(), vec![1.0], 2.0, vec![3.0], Some(bad), 5.0),
            make(big.clone(), vec![1.0], 2.0, vec![3.0], Some(4.0), bad),
        ];
        for (i, t) in cases.iter().enumerate() {
            assert!(!all_finite(t), "{bad} in leaf group {i}");
        }
    }
    // 65520 is finite in f32 but rounds to inf in f16.
    let overflow = make(big, vec![65520.0], 2.0, vec![], None, 0.0);
    assert!(!all_finite(&overflow));
}

#[test]
fn trees_without_float_leaves_are_finite() {
    let dev: Cpu = Default::default();
    let labels: Tensor<Rank1<2>, usize, _> = dev.tensor([1, 2]);
    let flags: Tensor<Rank1<2>, bool, _> = dev.tensor([true, false]);
    assert!(all_finite(&()));
    assert!(all_finite(&Vec::<f32>::new()));
    assert!(all_finite(&Option::<Tensor<Rank1<2>, f32, Cpu>>::None));
    assert!(all_finite(&(labels, flags, 3u8, -5i64)));
    let empty: Tensor<(usize,), f32, Cpu> = dev.tensor_from_vec(vec![], (0,));
    assert!(all_finite(&empty));
    assert!(all_finite_f32(&[]) && all_finite_f16(&[]));
}

#[test]
fn strided_views_are_checked_in_full() {
    let dev: Cpu = Default::default();
    let mut v = vec![1.0f32; 6];
    v[5] = f32::NAN;
    let m: Tensor<Rank2<2, 3>, f32, _> = dev.tensor_from_vec(v, (Const, Const));
    let t = m.clone().permute::<Rank2<3, 2>, _>();
    assert!(!all_finite(&t));
    let b = dev.tensor([1.0f32, 2.0]).broadcast::<Rank2<4, 2>, _>();
    assert!(all_finite(&b));
}

#[test]
fn fused_unscale_matches_separate_passes() {
    let src: Vec<f16> = (0..(2 * CHUNK + 17))
        .map(|i| f16::from_f32((i as f32 - 3000.0) * 0.75))
        .collect();
    let inv = 1.0 / 1024.0;
    let mut fused = vec![0.0f32; src.len()];
    assert_eq!(
        unscale_into_checked(&src, inv, &mut fused),
        Ok(all_finite_f16(&src))
    );
    let separate: Vec<f32> = src.iter().map(|h| h.to_f32() * inv).collect();
    assert_eq!(fused, separate);

    let mut in_place: Vec<f32> = src.iter().map(|h| h.to_f32()).collect();
    assert!(unscale_in_place_checked(&mut in_place, inv));
    assert_eq!(in_place, separate);

    let mut with_inf = src.clone();
    with_inf[CHUNK + 3] = f16::NEG_INFINITY;
    assert_eq!(unscale_into_checked(&with_inf, inv, &mut fused), Ok(false));
    assert_eq!(fused[CHUNK + 3], f32::NEG_INFINITY);
    assert_eq!(
        fused[CHUNK + 4],
        separate[CHUNK + 4],
        "written in full past the bad value"
    );
}

#[test]
fn fused_unscale_rejects_mismatched_lengths() {
    let mut dst = [0.0f32; 3];
    let err = unscale_into_checked(&[1.0f32, 2.0], 0.5, &mut dst).unwrap_err();
    assert_eq!(err, FiniteError::LengthMismatch { src: 2, dst: 3 });
    let msg = err.to_string();
    assert!(
        msg.contains("2 elements") && msg.contains("3") && msg.contains("must be equal"),
        "{msg}"
    );
    assert_eq!(dst, [0.0; 3], "nothing written");
}

/// Bit patterns biased towards the interesting ones: exponent all ones (inf, NaN with any payload,
/// either sign), the largest finite values, subnormals and zeros.
fn f32_bits() -> impl Strategy<Value = u32> + Clone {
    prop_oneof![
        8 => any::<u32>().prop_map(|b| b & !0x7f80_0000 | 0x3f80_0000), // ordinary finite
        2 => any::<u32>(),
        1 => (any::<bool>(), 0u32..(1 << 23)).prop_map(|(s, m)| (u32::from(s) << 31) | 0x7f80_0000 | m),
        1 => (any::<bool>(), 0u32..(1 << 23)).prop_map(|(s, m)| (u32::from(s) << 31) | m),
        1 => prop_oneof![Just(0x7f7f_ffffu32), Just(0xff7f_ffff), Just(0x8000_0000)],
    ]
}

fn f16_bits() -> impl Strategy<Value = u16> + Clone {
    prop_oneof![
        8 => any::<u16>().prop_map(|b| b & !0x7c00 | 0x3c00),
        2 => any::<u16>(),
        1 => (any::<bool>(), 0u16..(1 << 10)).prop_map(|(s, m)| (u16::from(s) << 15) | 0x7c00 | m),
        1 => (any::<bool>(), 0u16..(1 << 10)).prop_map(|(s, m)| (u16::from(s) << 15) | m),
        1 => prop_oneof![Just(0x7bffu16), Just(0xfbff), Just(0x8000)],
    ]
}

/// Mostly-finite vectors up to three chunks long, with at most a few special values sprinkled in.
fn sparse_bits<T: Copy + std::fmt::Debug>(
    elem: impl Strategy<Value = T> + Clone,
    finite: T,
) -> impl Strategy<Value = Vec<T>> {
    (0usize..(3 * CHUNK + 9)).prop_flat_map(move |n| {
        prop::collection::vec((0..n.max(1), elem.clone()), 0..4).prop_map(move |specials| {
            let mut v = vec![finite; n];
            for (i, b) in specials {
                if i < n {
                    v[i] = b;
                }
            }
            v
        })
    })
}

proptest! {
    #[test]
    fn f32_check_equals_naive(bits in prop::collection::vec(f32_bits(), 0..600)) {
        let vals: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        prop_assert_eq!(all_finite_f32(&vals), naive_f32(&bits));
        prop_assert_eq!(all_finite_slice(&vals), naive_f32(&bits));
    }

    #[test]
    fn f16_check_equals_naive(bits in prop::collection::vec(f16_bits(), 0..600)) {
        let vals: Vec<f16> = bits.iter().map(|&b| f16::from_bits(b)).collect();
        prop_assert_eq!(all_finite_f16(&vals), naive_f16(&bits));
        let amp: Vec<AMP<f16>> = vals.iter().map(|&h| AMP(h)).collect();
        prop_assert_eq!(all_finite_slice(&amp), naive_f16(&bits));
    }

    #[test]
    fn long_f32_slices_across_chunks(bits in sparse_bits(f32_bits(), 0x3f80_0000u32)) {
        let vals: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let expected = naive_f32(&bits);
        prop_assert_eq!(all_finite_f32(&vals), expected);
        let dev: Cpu = Default::default();
        let n = vals.len();
        prop_assert_eq!(all_finite(&dev.tensor_from_vec(vals.clone(), (n,))), expected);
        let mut dst = vec![0.0f32; n];
        prop_assert_eq!(unscale_into_checked(&vals, 0.5, &mut dst), Ok(expected));
    }

    #[test]
    fn long_f16_slices_across_chunks(bits in sparse_bits(f16_bits(), 0x3c00u16)) {
        let vals: Vec<f16> = bits.iter().map(|&b| f16::from_bits(b)).collect();
        let expected = naive_f16(&bits);
        prop_assert_eq!(all_finite_f16(&vals), expected);
        let dev: Cpu = Default::default();
        let n = vals.len();
        prop_assert_eq!(all_finite(&dev.tensor_from_vec(vals.clone(), (n,))), expected);
        let mut dst = vec![0.0f32; n];
        prop_assert_eq!(unscale_into_checked(&vals, 2.0, &mut dst), Ok(expected));
    }
}
