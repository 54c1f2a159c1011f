//! Casting trees: tensors, containers, modules (every scalar setting carried), the derive, and the laws
//! (integer leaves bit-identical, f16 -> f32 -> f16 identity, bf16 rounding = `half::bf16`).

use dfdx::prelude::*;
use mpx::cast::{
    Cast, FloatLeaves, FloatSliceMut, cast_module, cast_to_bf16, cast_to_f16, cast_to_f32,
    cast_to_full_precision, cast_to_half_precision,
};
use mpx::precision::{AMP, FloatSlice, f16};

type Mlp = (Linear<5, 7>, ReLU, Linear<7, 3>);

mod common;
use common::bits::f16_bits;

#[test]
fn f32_tensor_to_f16_matches_half_rounding_and_keeps_shape() {
    let dev = Cpu::default();
    let vals = [1.0f32, -2.5, 65504.0, 65520.0, 1e-8, 0.1, f32::NAN, -0.0];
    let x: Tensor<Rank2<2, 4>, f32, _> = dev.tensor([
        [vals[0], vals[1], vals[2], vals[3]],
        [vals[4], vals[5], vals[6], vals[7]],
    ]);
    let h: Tensor<Rank2<2, 4>, f16, _> = cast_to_f16(&x);
    assert_eq!(h.shape(), x.shape());
    let want: Vec<u16> = vals.iter().map(|v| f16::from_f32(*v).to_bits()).collect();
    assert_eq!(f16_bits(&h.as_vec()), want);
}

#[test]
fn integer_and_bool_tensors_and_plain_values_are_untouched() {
    let dev = Cpu::default();
    let labels: Tensor<Rank1<4>, usize, _> = dev.tensor([3, 1, 4, 1]);
    let mask: Tensor<Rank1<2>, bool, _> = dev.tensor([true, false]);
    let x64: Tensor<Rank1<2>, f64, _> = dev.tensor([0.1, 0.2]);
    let tree = (labels, mask, x64, 7i32, String::from("s"), 0.1f64);
    let out = cast_to_f16(&tree);
    assert_eq!(out.0.as_vec(), vec![3, 1, 4, 1]);
    assert_eq!(out.1.as_vec(), vec![true, false]);
    // f64 is left alone, as mpx does
    assert_eq!(out.2.as_vec(), vec![0.1, 0.2]);
    assert_eq!((out.3, out.4.as_str(), out.5), (7, "s", 0.1));
}

#[test]
fn containers_cast_their_float_leaves() {
    let tree = (
        vec![1.0f32 / 3.0, 2.0],
        Some(Box::new(0.1f32)),
        [0.2f32; 3],
        None::<f32>,
    );
    let h = cast_to_half_precision::<f16, _>(&tree);
    assert_eq!(h.0, vec![f16::from_f32(1.0 / 3.0), f16::from_f32(2.0)]);
    assert_eq!(h.1.as_deref(), Some(&f16::from_f32(0.1)));
    assert_eq!(h.2, [f16::from_f32(0.2); 3]);
    assert_eq!(h.3, None);
    let back = cast_to_full_precision(&h);
    assert_eq!(back.0[1], 2.0);
    let amp = cast_to_half_precision::<AMP<f16>, _>(&tree.0);
    assert_eq!(amp[0].0, f16::from_f32(1.0 / 3.0));
}

#[test]
fn bf16_cast_rounds_like_half_bf16_and_keeps_f32_storage() {
    let dev = Cpu::default();
    let vals = [
        1.0 + 1.0 / 512.0,
        1.0 + 3.0 / 512.0,
        1.234_567,
        -1e30,
        3.4e38,
        1e-40,
    ];
    let x: Tensor<Rank1<6>, f32, _> = dev.tensor(vals);
    let b: Tensor<Rank1<6>, f32, _> = cast_to_bf16(&x);
    let want: Vec<u32> = vals
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_f32().to_bits())
        .collect();
    let got: Vec<u32> = b.as_vec().iter().map(|v| v.to_bits()).collect();
    assert_eq!(got, want);
}

#[test]
fn module_cast_keeps_shapes_and_converts_values() {
    let dev = Cpu::default();
    let m = dev.build_module::<Mlp, f32>();
    let h = cast_module::<f16, f32, _>(&m);
    let w0 = m.0.weight.as_vec();
    let want: Vec<u16> = w0.iter().map(|v| f16::from_f32(*v).to_bits()).collect();
    assert_eq!(f16_bits(&h.0.weight.as_vec()), want);
    assert_eq!(h.2.bias.shape(), m.2.bias.shape());
    let want_b: Vec<u16> =
        m.2.bias
            .as_vec()
            .iter()
            .map(|v| f16::from_f32(*v).to_bits())
            .collect();
    assert_eq!(f16_bits(&h.2.bias.as_vec()), want_b);
}

/// Every setting a module lists as a scalar (dropout's `p`, a norm's `epsilon` and `momentum`)
/// reaches the cast as it is: dfdx's own `to_dtype` resets them to their defaults.
#[test]
fn a_module_cast_carries_every_scalar_setting() {
    type Net = (Linear<4, 4>, Dropout, BatchNorm1D<4>, LayerNorm1D<4>);
    let dev = Cpu::default();
    let mut m = dev.build_module::<Net, f32>();
    m.1.p = 0.2;
    m.2.epsilon = 1e-3;
    m.2.momentum = 0.7;
    m.3.epsilon = 1e-2;
    let h = cast_module::<f16, f32, _>(&m);
    assert_eq!(
        (h.1.p, h.2.epsilon, h.2.momentum, h.3.epsilon),
        (0.2, 1e-3, 0.7, 1e-2)
    );
    // dfdx's own cast does not carry them: what this one is for
    let d = m.to_dtype::<f16>();
    assert_eq!((d.1.p, d.2.momentum), (0.5, 0.1));
}

#[test]
fn float_leaves_visit_tensors_in_order_and_write_back() {
    let dev = Cpu::default();
    let a: Tensor<Rank1<2>, f32, _> = dev.tensor([1.0, 2.0]);
    let b: Tensor<Rank1<3>, f16, _> = dev.tensor([f16::ONE; 3]);
    let labels: Tensor<Rank1<2>, usize, _> = dev.tensor([1, 2]);
    let mut tree = (a, labels, b, vec![4.0f32]);
    let mut lens = Vec::new();
    assert!(tree.visit_floats(&mut |bits| {
        lens.push(match bits {
            FloatSlice::F32(v) | FloatSlice::Bf16(v) => (32, v.len()),
            FloatSlice::F16(v) => (16, v.len()),
        });
        true
    }));
    assert_eq!(lens, vec![(32, 2), (16, 3), (32, 1)]);
    tree.visit_floats_mut(&mut |s| match s {
        FloatSliceMut::F32(v) => v.iter_mut().for_each(|x| *x *= 2.0),
        FloatSliceMut::F16(v) => v
            .iter_mut()
            .for_each(|x| *x = f16::from_f32(x.to_f32() * 2.0)),
    });
    assert_eq!(tree.0.array(), [2.0, 4.0]);
    assert_eq!(tree.2.array(), [f16::from_f32(2.0); 3]);
    assert_eq!(tree.3, vec![8.0]);
    assert_eq!(tree.1.array(), [1, 2]);
    // early stop
    let mut calls = 0;
    assert!(!tree.visit_floats(&mut |_| {
        calls += 1;
        false
    }));
    assert_eq!(calls, 1);
}

#[test]
fn f16_to_f32_and_back_is_identity_for_every_finite_pattern() {
    let dev = Cpu::default();
    let all: Vec<f16> = (0..=u16::MAX)
        .map(f16::from_bits)
        .filter(|h| h.is_finite())
        .collect();
    let n = all.len();
    let t: Tensor<(usize,), f16, _> = dev.tensor_from_vec(all.clone(), (n,));
    let wide: Tensor<(usize,), f32, _> = cast_to_f32(&t);
    let back: Tensor<(usize,), f16, _> = <_ as Cast<f16>>::cast(&wide);
    assert_eq!(f16_bits(&back.as_vec()), f16_bits(&all));
}

// ---- #[derive(Cast)] --------------------------------------------------------------------------

/// A training batch: float inputs, integer labels, a Vec of float tensors and a skipped field.
#[derive(mpx::Cast, Clone, Debug)]
struct Batch<E: Dtype> {
    x: Tensor<Rank2<2, 3>, E, Cpu>,
    labels: Tensor<Rank1<2>, usize, Cpu>,
    extras: Vec<Tensor<Rank1<3>, E, Cpu>>,
    #[cast(skip)]
    note: String,
}

/// A model as a user writes it, dfdx modules inside.
#[derive(mpx::Cast)]
struct Net<E: Dtype> {
    l1: dfdx::nn::modules::Linear<3, 4, E, Cpu>,
    act: dfdx::nn::modules::ReLU,
    norm: dfdx::nn::modules::LayerNorm1D<4, E, Cpu>,
    l2: dfdx::nn::modules::Linear<4, 2, E, Cpu>,
    steps: u64,
}

/// A marker-only use of the dtype, plus two type parameters.
#[derive(mpx::Cast)]
#[cast(dtype = E)]
struct Tagged<E: Dtype, const N: usize, T: Clone> {
    w: [E; N],
    marker: std::marker::PhantomData<E>,
    #[cast(skip)]
    tag: T,
}

/// A tuple struct with no type parameter casts to itself.
#[derive(mpx::Cast)]
struct Labels(Tensor<Rank1<3>, i32, Cpu>, #[cast(skip)] f32);

#[test]
fn derived_batch_casts_float_fields_and_leaves_the_rest() {
    let dev = Cpu::default();
    let b = Batch::<f32> {
        x: dev.tensor([[0.1, 0.2, 0.3], [65520.0, -1.0, 1e-8]]),
        labels: dev.tensor([4, 9]),
        extras: vec![dev.tensor([1.0 / 3.0, 2.0, 3.0])],
        note: "batch 0".into(),
    };
    let h: Batch<f16> = cast_to_f16(&b);
    let want: Vec<u16> =
        b.x.as_vec()
            .iter()
            .map(|v| f16::from_f32(*v).to_bits())
            .collect();
    assert_eq!(f16_bits(&h.x.as_vec()), want);
    assert_eq!(h.labels.array(), [4, 9]);
    assert_eq!(h.extras[0].array()[0], f16::from_f32(1.0 / 3.0));
    assert_eq!(h.note, "batch 0");
    // emulated bf16: same type as the source, values rounded
    let r: Batch<f32> = cast_to_bf16(&b);
    assert_eq!(
        r.x.array()[0][0].to_bits(),
        half::bf16::from_f32(0.1).to_f32().to_bits()
    );
    // the derived FloatLeaves visits x and extras, not the labels
    let mut seen = Vec::new();
    h.visit_floats(&mut |bits| {
        seen.push(match bits {
            FloatSlice::F16(v) => v.len(),
            FloatSlice::F32(v) | FloatSlice::Bf16(v) => v.len() + 1000,
        });
        true
    });
    assert_eq!(seen, vec![6, 3]);
}

#[test]
fn derived_model_casts_dfdx_modules_keeping_scalars() {
    let dev = Cpu::default();
    let mut norm = dev.build_module::<dfdx::nn::builders::LayerNorm1D<4>, f32>();
    norm.epsilon = 1e-3;
    let net = Net::<f32> {
        l1: dev.build_module::<dfdx::nn::builders::Linear<3, 4>, f32>(),
        act: Default::default(),
        norm,
        l2: dev.build_module::<dfdx::nn::builders::Linear<4, 2>, f32>(),
        steps: 12,
    };
    let h: Net<f16> = cast_to_half_precision::<f16, _>(&net);
    assert_eq!(h.l2.bias.array()[1], f16::from_f32(net.l2.bias.array()[1]));
    assert_eq!(h.norm.epsilon, 1e-3);
    assert_eq!(h.steps, 12);
    let back: Net<f32> = cast_to_f32(&h);
    assert_eq!(
        back.l1.weight.array()[2][1],
        h.l1.weight.array()[2][1].to_f32()
    );
}

#[test]
fn derived_struct_with_dtype_attribute_and_phantom_marker() {
    let t = Tagged::<f32, 2, &str> {
        w: [0.1, 3.0],
        marker: std::marker::PhantomData,
        tag: "t",
    };
    let h: Tagged<f16, 2, &str> = cast_to_f16(&t);
    assert_eq!(h.w, [f16::from_f32(0.1), f16::from_f32(3.0)]);
    assert_eq!(h.tag, "t");
}

#[test]
fn derived_struct_without_dtype_casts_to_itself() {
    let dev = Cpu::default();
    let l = Labels(dev.tensor([1, -2, 3]), 0.1);
    let same: Labels = cast_to_f16(&l);
    assert_eq!(same.0.array(), [1, -2, 3]);
    assert_eq!(same.1, 0.1);
}

#[test]
fn batch_norm_running_stats_are_float_leaves_and_scalars_survive() {
    let dev = Cpu::default();
    let mut bn = dev.build_module::<dfdx::nn::builders::BatchNorm1D<3>, f32>();
    bn.running_mean = dev.tensor([0.1, 0.2, 0.3]);
    bn.momentum = 0.25;
    let h = cast_to_f16(&bn);
    assert_eq!(h.running_mean.array(), [0.1, 0.2, 0.3].map(f16::from_f32));
    assert_eq!(h.momentum, 0.25);
    let mut count = 0;
    h.visit_floats(&mut |_| {
        count += 1;
        true
    });
    assert_eq!(count, 4); // scale, bias, running_mean, running_var
}

// ---- reference data and laws ------------------------------------------------------------------

const PROBES: &str = include_str!("data/lossscale/semantics_probes.json");

/// `semantics_probes.casting.rounding_f32_to_*`: the probe records the rounded bits; its inputs
/// are mpx's constants around the f16 range (65504 = f16 max, 65520 = first value that rounds to
/// inf, 1e-8 below f16's smallest subnormal, 0.1, bf16's max 3.3895314e38), as SEMANTICS.md 1.2
/// describes.
const ROUNDING_INPUTS: [f32; 5] = [65504.0, 65520.0, 1e-8, 0.1, 3.389_531_4e38];

fn probe_bits(name: &str) -> Vec<u16> {
    let data: serde_json::Value = serde_json::from_str(PROBES).expect("valid JSON");
    data["casting"][name]["bits"]
        .as_array()
        .expect("bits array")
        .iter()
        .map(|b| u16::from_str_radix(b.as_str().expect("hex string"), 16).expect("hex"))
        .collect()
}

#[test]
fn rounding_probes_f32_to_f16_and_bf16() {
    let dev = Cpu::default();
    let x: Tensor<Rank1<5>, f32, _> = dev.tensor(ROUNDING_INPUTS);
    let h: Tensor<Rank1<5>, f16, _> = cast_to_f16(&x);
    assert_eq!(f16_bits(&h.as_vec()), probe_bits("rounding_f32_to_f16"));
    // emulated bf16 keeps f32 storage: its upper 16 bits are the bf16 pattern, the rest zero
    let b: Tensor<Rank1<5>, f32, _> = cast_to_bf16(&x);
    let upper: Vec<u16> = b
        .as_vec()
        .iter()
        .map(|v| (v.to_bits() >> 16) as u16)
        .collect();
    assert_eq!(upper, probe_bits("rounding_f32_to_bf16"));
    assert!(b.as_vec().iter().all(|v| v.to_bits() & 0xffff == 0));
}

mod laws {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn integer_tensors_are_bit_identical(v in proptest::collection::vec(any::<i64>(), 1..64),
                                             u in proptest::collection::vec(any::<u8>(), 1..64)) {
            let dev = Cpu::default();
            let a: Tensor<(usize,), i64, _> = dev.tensor_from_vec(v.clone(), (v.len(),));
            let b: Tensor<(usize,), u8, _> = dev.tensor_from_vec(u.clone(), (u.len(),));
            let (ha, hb) = cast_to_f16(&(a.clone(), b.clone()));
            prop_assert_eq!(ha.as_vec(), v.clone());
            prop_assert_eq!(hb.as_vec(), u.clone());
            let (ba, bb) = cast_to_bf16(&(a, b));
            prop_assert_eq!(ba.as_vec(), v);
            prop_assert_eq!(bb.as_vec(), u);
        }

        #[test]
        fn bf16_emulation_matches_half_bf16_bits(bits in proptest::collection::vec(any::<u32>(), 1..64)) {
            let dev = Cpu::default();
            let vals: Vec<f32> = bits.iter().map(|b| f32::from_bits(*b)).collect();
            let t: Tensor<(usize,), f32, _> = dev.tensor_from_vec(vals.clone(), (vals.len(),));
            let r: Tensor<(usize,), f32, _> = cast_to_bf16(&t);
            let want: Vec<u32> = vals
                .iter()
                .map(|v| (u32::from(half::bf16::from_f32(*v).to_bits())) << 16)
                .collect();
            let got: Vec<u32> = r.as_vec().iter().map(|v| v.to_bits()).collect();
            prop_assert_eq!(got, want);
        }

        #[test]
        fn f16_through_f32_and_back_is_identity(bits in proptest::collection::vec(any::<u16>(), 1..64)) {
            // finite and infinite patterns (NaN payloads are not required to survive)
            let vals: Vec<f16> = bits.iter().map(|b| f16::from_bits(*b)).filter(|h| !h.is_nan()).collect();
            prop_assume!(!vals.is_empty());
            let dev = Cpu::default();
            let t: Tensor<(usize,), f16, _> = dev.tensor_from_vec(vals.clone(), (vals.len(),));
            let wide: Tensor<(usize,), f32, _> = cast_to_f32(&t);
            let back: Tensor<(usize,), f16, _> = cast_to_f16(&wide);
            prop_assert_eq!(f16_bits(&back.as_vec()), f16_bits(&vals));
        }
    }
}
