//! Loss scales against jmp 0.0.4 and mpx 0.1.8 reference data (`tests/data/lossscale/`, copied from
//! the project's shared reference), plus construction errors, serde checkpoints and properties.

use dfdx::prelude::*;
use half::{bf16, f16};
use mpx::finite::{all_finite_f16, all_finite_f32, unscale_into_checked};
use mpx::precision::AMP;
use mpx::scaling::{DynamicLossScale, LossScale, LossScaleError, NoOpLossScale, StaticLossScale};
use proptest::prelude::*;
use serde_json::Value;

const TRAJECTORIES: &str = include_str!("data/lossscale/dynamic_scale_trajectories.json");
const SCALE_UNSCALE: &str = include_str!("data/lossscale/scale_unscale.json");

fn json(text: &str) -> Value {
    serde_json::from_str(text).expect("reference JSON parses")
}

fn hex_u32(v: &Value) -> u32 {
    u32::from_str_radix(v.as_str().expect("hex string"), 16).expect("hex bits")
}

/// Builds the dynamic scale a trajectory case describes (jmp's constructor arguments).
fn build_from_config(cfg: &Value) -> DynamicLossScale {
    DynamicLossScale::builder()
        .initial(cfg["init"].as_f64().unwrap() as f32)
        .period(cfg["period"].as_u64().unwrap() as u32)
        .factor(cfg["factor"].as_f64().unwrap() as f32)
        .min_scale(cfg["min_scale"].as_f64().unwrap() as f32)
        .build()
        .expect("reference configs are valid")
}

/// Runs every case's finite/non-finite sequence and compares (scale bits, counter) after each adjust
/// with the named implementation's trajectory.
fn check_trajectories(impl_name: &str, make: impl Fn(&Value) -> DynamicLossScale) -> usize {
    let data = json(TRAJECTORIES);
    let cases = data["cases"].as_array().unwrap();
    for case in cases {
        let name = format!("{} / {}", case["config"]["name"], case["sequence_name"]);
        let traj = &case["trajectories"][impl_name];
        let bits = traj["scale_f32_bits"].as_array().unwrap();
        let counters = traj["counter"].as_array().unwrap();
        let flags = case["grads_finite"].as_array().unwrap();
        assert_eq!(flags.len(), bits.len(), "{name}");
        let mut s = make(&case["config"]);
        for (i, flag) in flags.iter().enumerate() {
            s.adjust(flag.as_bool().unwrap());
            assert_eq!(
                (s.loss_scale().to_bits(), s.counter()),
                (hex_u32(&bits[i]), counters[i].as_u64().unwrap() as u32),
                "{impl_name} {name}: step {i} (scale {})",
                s.loss_scale()
            );
        }
        if let Some(min_after) = traj["min_loss_scale_after_last_step"].as_f64() {
            assert_eq!(s.min_scale(), min_after as f32, "{name}: min kept");
        }
    }
    cases.len()
}

#[test]
fn every_jmp_eager_trajectory_bit_for_bit() {
    assert_eq!(check_trajectories("jmp_eager", build_from_config), 48);
}

#[test]
fn max_scale_65504_reproduces_every_mpx_eager_trajectory() {
    // None of the reference configs starts below min, so mpx's extra min clip never acts and
    // `.max_scale(65504)` is all that separates mpx from jmp.
    let n = check_trajectories("mpx_eager", |cfg| {
        let plain = build_from_config(cfg);
        DynamicLossScale::builder()
            .initial(plain.loss_scale())
            .period(plain.period())
            .factor(plain.factor())
            .min_scale(plain.min_scale())
            .max_scale(65504.0)
            .build()
            .unwrap()
    });
    assert_eq!(n, 48);
}

#[test]
fn mpx_differs_from_jmp_where_the_reference_says() {
    // Sanity check that the two reference trajectories are really different somewhere, so the
    // mpx test above exercises the max clip.
    let data = json(TRAJECTORIES);
    let differing = data["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| !c["first_step_differing_from_jmp_eager"]["mpx_eager"].is_null())
        .count();
    assert!(differing > 10, "{differing}");
}

// ---- scale / unscale against jmp --------------------------------------------------------

/// Decodes a reference array's bits into f32 values (f16 and bf16 widen exactly).
fn decode(arr: &Value) -> Vec<f32> {
    let dtype = arr["dtype"].as_str().unwrap();
    arr["bits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            let b = hex_u32(b);
            match dtype {
                "float32" => f32::from_bits(b),
                "float16" => f16::from_bits(b as u16).to_f32(),
                "bfloat16" => bf16::from_bits(b as u16).to_f32(),
                other => panic!("unexpected dtype {other}"),
            }
        })
        .collect()
}

fn expected_bits(arr: &Value) -> Vec<u32> {
    assert_eq!(
        arr["dtype"], "float32",
        "jmp with an f32 scale promotes to f32"
    );
    arr["bits"]
        .as_array()
        .unwrap()
        .iter()
        .map(hex_u32)
        .collect()
}

mod common;
use common::bits::bits;

/// Checks one reference entry (`jmp_static_f32` or `jmp_dynamic_f32` at one scale) with `s`.
fn check_scale_unscale<L: LossScale>(s: &L, case: &Value, entry: &Value, what: &str) {
    let dev: Cpu = Default::default();
    let input = &case["input"];
    let x = decode(input);
    let n = x.len();

    // scale: an f32 loss tensor times the f32 scale.
    let scaled = s.scale(dev.tensor_from_vec(x.clone(), (n,))).as_vec();
    assert_eq!(
        bits(&scaled),
        expected_bits(&entry["scaled"]),
        "{what}: scaled"
    );
    for (i, &v) in x.iter().enumerate() {
        assert_eq!(
            s.scale_value(v).to_bits(),
            scaled[i].to_bits(),
            "{what}: scale_value {i}"
        );
    }

    // unscale: the fused kernel straight from the stored dtype, and the scalar form.
    let mut unscaled = vec![0.0f32; n];
    let finite_in = match input["dtype"].as_str().unwrap() {
        "float16" => {
            let h: Vec<f16> = input["bits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| f16::from_bits(hex_u32(b) as u16))
                .collect();
            assert_eq!(all_finite_f16(&h), all_finite_f32(&x), "{what}");
            unscale_into_checked(&h, s.inv_loss_scale(), &mut unscaled).unwrap()
        }
        _ => unscale_into_checked(&x, s.inv_loss_scale(), &mut unscaled).unwrap(),
    };
    assert_eq!(
        bits(&unscaled),
        expected_bits(&entry["unscaled"]),
        "{what}: unscaled"
    );
    let scalar: Vec<f32> = x.iter().map(|&v| s.unscale_value(v)).collect();
    assert_eq!(bits(&scalar), bits(&unscaled), "{what}: unscale_value");

    // unscale of a tensor tree in the stored dtype (f16 tensors, or f32 tensors holding the bf16 or
    // f32 values), and the fused tree form.
    let tree_unscaled: Vec<f32> = match input["dtype"].as_str().unwrap() {
        "float16" => {
            let h: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
            let t = dev.tensor_from_vec(h, (n,));
            let (checked, finite) = s.unscale_checked(&t);
            assert_eq!(
                finite,
                all_finite_f32(&x),
                "{what}: unscale_checked finiteness"
            );
            assert_eq!(
                bits(&checked.as_vec()),
                bits(&s.unscale(&t).as_vec()),
                "{what}"
            );
            s.unscale(&t).as_vec()
        }
        _ => {
            let t = dev.tensor_from_vec(x.clone(), (n,));
            let (checked, finite) = s.unscale_checked(&(t.clone(),));
            assert_eq!(
                finite,
                all_finite_f32(&x),
                "{what}: unscale_checked finiteness"
            );
            assert_eq!(
                bits(&checked.0.as_vec()),
                bits(&s.unscale(&t).as_vec()),
                "{what}"
            );
            s.unscale(&t).as_vec()
        }
    };
    assert_eq!(
        bits(&tree_unscaled),
        expected_bits(&entry["unscaled"]),
        "{what}: unscale(tree)"
    );

    // roundtrip: unscale(scale(x)).
    let mut roundtrip = vec![0.0f32; n];
    let finite_scaled = unscale_into_checked(&scaled, s.inv_loss_scale(), &mut roundtrip).unwrap();
    assert_eq!(
        bits(&roundtrip),
        expected_bits(&entry["roundtrip"]),
        "{what}: roundtrip"
    );

    // all_finite of each stage (the fused kernel reports its source's finiteness).
    let af = &entry["all_finite"];
    assert_eq!(
        finite_in,
        af["input"].as_bool().unwrap(),
        "{what}: all_finite(input)"
    );
    assert_eq!(all_finite_f32(&x), af["input"].as_bool().unwrap(), "{what}");
    assert_eq!(
        finite_scaled,
        af["scaled"].as_bool().unwrap(),
        "{what}: all_finite(scaled)"
    );
    assert_eq!(
        all_finite_f32(&scaled),
        af["scaled"].as_bool().unwrap(),
        "{what}"
    );
    assert_eq!(
        all_finite_f32(&unscaled),
        af["unscaled"].as_bool().unwrap(),
        "{what}"
    );
    assert_eq!(
        all_finite_f32(&roundtrip),
        af["roundtrip"].as_bool().unwrap(),
        "{what}"
    );
}

#[test]
fn jmp_static_and_dynamic_f32_scale_unscale_cases() {
    let data = json(SCALE_UNSCALE);
    let mut checked = 0;
    let mut nonfinite_seen = 0;
    for case in data["cases"].as_array().unwrap() {
        for (key, by_impl) in case["by_scale"].as_object().unwrap() {
            let s: f32 = key.parse().expect("scale key");
            let what = format!("{} {} S={key}", case["dtype"], case["label"]);
            let st = StaticLossScale::new(s).unwrap();
            check_scale_unscale(
                &st,
                case,
                &by_impl["jmp_static_f32"],
                &format!("static {what}"),
            );
            // Below-min initial scales (S = 0.5) are allowed, as in jmp.
            let dy = DynamicLossScale::builder().initial(s).build().unwrap();
            check_scale_unscale(
                &dy,
                case,
                &by_impl["jmp_dynamic_f32"],
                &format!("dynamic {what}"),
            );
            checked += 2;
            if !by_impl["jmp_static_f32"]["all_finite"]["scaled"]
                .as_bool()
                .unwrap()
            {
                nonfinite_seen += 1;
            }
        }
    }
    // 9 inputs (f16/bf16/f32 x base/cast_overflow/with_nonfinite) x 8 scales x 2 impls.
    assert_eq!(checked, 9 * 8 * 2);
    assert!(nonfinite_seen > 0, "the data includes non-finite results");
}

#[test]
fn jmp_pytree_case_unscales_float_leaves_and_keeps_integers() {
    let data = json(SCALE_UNSCALE);
    let case = &data["pytree_case"];
    let dev: Cpu = Default::default();
    let input = &case["input"];
    let a: Vec<f16> = input["a_f16"]["bits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| f16::from_bits(hex_u32(b) as u16))
        .collect();
    let b: Vec<Vec<f32>> = input["b"].as_array().unwrap().iter().map(decode).collect();
    let c: Vec<i32> = input["c_i32"]["values"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap() as i32)
        .collect();
    let tree = (
        dev.tensor_from_vec(a, (3,)),
        b.iter()
            .map(|v| dev.tensor_from_vec(v.clone(), (2,)))
            .collect::<Vec<_>>(),
        dev.tensor_from_vec(c.clone(), (2,)),
    );
    let mut scales_seen = 0;
    for (key, by_impl) in case.as_object().unwrap() {
        let Some(sv) = key.strip_prefix("S=") else {
            continue;
        };
        let sv: f32 = sv.parse().unwrap();
        for impl_name in ["jmp_static_f32", "jmp_dynamic_f32"] {
            let entry = &by_impl[impl_name];
            let (ua, ub, uc) = if impl_name == "jmp_static_f32" {
                StaticLossScale::new(sv).unwrap().unscale(&tree)
            } else {
                DynamicLossScale::new(sv).unwrap().unscale(&tree)
            };
            let un = &entry["unscaled"];
            assert_eq!(
                bits(&ua.as_vec()),
                expected_bits(&un["a_f16"]),
                "{impl_name} {key} a"
            );
            for (i, t) in ub.iter().enumerate() {
                assert_eq!(
                    bits(&t.as_vec()),
                    expected_bits(&un["b"][i]),
                    "{impl_name} {key} b{i}"
                );
            }
            // Deviation from jmp (and mpx), which multiply integer leaves too (giving f32): only
            // float leaves are unscaled; integer tensors pass through bit-identical.
            assert_eq!(uc.as_vec(), c);
            assert_eq!(expected_bits(&un["c_i32"]).len(), 2);

            // all_finite of jmp's scaled tree, rebuilt from its bits.
            let sc = &entry["scaled"];
            let scaled_tree = (
                dev.tensor_from_vec(decode(&sc["a_f16"]), (3,)),
                vec![
                    dev.tensor_from_vec(decode(&sc["b"][0]), (2,)),
                    dev.tensor_from_vec(decode(&sc["b"][1]), (2,)),
                ],
                dev.tensor_from_vec(c.clone(), (2,)),
            );
            assert_eq!(
                mpx::finite::all_finite(&scaled_tree),
                entry["all_finite_scaled"].as_bool().unwrap()
            );
        }
        scales_seen += 1;
    }
    assert_eq!(scales_seen, 2);
}

#[test]
fn unscale_reaches_every_float_dtype_in_a_tree() {
    let dev: Cpu = Default::default();
    let h = |v: f32| f16::from_f32(v);
    let labels: Tensor<Rank1<2>, usize, _> = dev.tensor([5, 6]);
    let tree = (
        dev.tensor([h(512.0), h(-256.0)]),
        dev.tensor([AMP(h(1024.0)), AMP(h(65504.0))]),
        vec![dev.tensor([768.0f32, 1.0])],
        (labels, Some(128.0f32), Box::new(h(64.0))),
    );
    let s = DynamicLossScale::builder().initial(256.0).build().unwrap();
    let (a, b, c, (l, o, bx)) = s.unscale(&tree);
    assert_eq!(a.array(), [2.0f32, -1.0]);
    assert_eq!(b.array(), [4.0f32, 255.875]);
    assert_eq!(c[0].array(), [3.0f32, 1.0 / 256.0]);
    assert_eq!(l.array(), [5, 6]);
    assert_eq!((o, *bx), (Some(0.5f32), 0.25f32));
    let (_, finite) = s.unscale_checked(&tree);
    assert!(finite);
    let mut bad = tree.clone();
    bad.1 = dev.tensor([AMP(f16::NAN), AMP(h(1.0))]);
    let ((_, b, ..), finite) = s.unscale_checked(&bad);
    assert!(!finite);
    assert!(b.array()[0].is_nan());
    assert_eq!(b.array()[1], 1.0 / 256.0);
}

// ---- construction ----------------------------------------------------------------------

#[test]
fn construction_errors_name_the_bad_value() {
    let b = DynamicLossScale::builder;
    let cases: Vec<(
        Result<DynamicLossScale, LossScaleError>,
        LossScaleError,
        &str,
    )> = vec![
        (
            b().initial(f32::NAN).build(),
            LossScaleError::InvalidScale {
                name: "initial scale",
                value: f32::NAN,
            },
            "initial scale NaN",
        ),
        (
            b().initial(f32::INFINITY).build(),
            LossScaleError::InvalidScale {
                name: "initial scale",
                value: f32::INFINITY,
            },
            "initial scale inf",
        ),
        (
            b().initial(0.0).build(),
            LossScaleError::InvalidScale {
                name: "initial scale",
                value: 0.0,
            },
            "initial scale 0.0",
        ),
        (
            b().initial(-4.0).build(),
            LossScaleError::InvalidScale {
                name: "initial scale",
                value: -4.0,
            },
            "initial scale -4.0",
        ),
        (
            b().period(0).build(),
            LossScaleError::ZeroPeriod,
            "period 0",
        ),
        (
            b().factor(1.0).build(),
            LossScaleError::InvalidFactor(1.0),
            "factor 1.0",
        ),
        (
            b().factor(0.5).build(),
            LossScaleError::InvalidFactor(0.5),
            "factor 0.5",
        ),
        (
            b().factor(f32::INFINITY).build(),
            LossScaleError::InvalidFactor(f32::INFINITY),
            "factor inf",
        ),
        (
            b().min_scale(0.0).build(),
            LossScaleError::InvalidScale {
                name: "min scale",
                value: 0.0,
            },
            "min scale 0.0",
        ),
        (
            b().min_scale(-1.0).build(),
            LossScaleError::InvalidScale {
                name: "min scale",
                value: -1.0,
            },
            "min scale -1.0",
        ),
        (
            b().max_scale(f32::NEG_INFINITY).build(),
            LossScaleError::InvalidScale {
                name: "max scale",
                value: f32::NEG_INFINITY,
            },
            "max scale -inf",
        ),
        (
            b().min_scale(8.0).max_scale(4.0).build(),
            LossScaleError::MaxBelowMin { min: 8.0, max: 4.0 },
            "max scale 4.0",
        ),
    ];
    for (got, want, needle) in cases {
        let err = got.expect_err(needle);
        // NaN != NaN, so compare the message and the variant shape for NaN.
        assert_eq!(err.to_string(), want.to_string());
        let msg = err.to_string();
        assert!(msg.contains(needle), "{msg:?} should name {needle:?}");
        assert!(
            msg.contains("must") || msg.contains("at least"),
            "{msg:?} should say what is allowed"
        );
    }
    assert_eq!(
        StaticLossScale::new(-0.0).unwrap_err().to_string(),
        LossScaleError::InvalidScale {
            name: "static scale",
            value: -0.0
        }
        .to_string()
    );
    assert!(
        StaticLossScale::new(f32::NAN)
            .unwrap_err()
            .to_string()
            .contains("static scale NaN")
    );
}

#[test]
fn defaults_and_allowed_edge_values() {
    let d = DynamicLossScale::default();
    assert_eq!(
        (
            d.loss_scale(),
            d.period(),
            d.factor(),
            d.min_scale(),
            d.max_scale(),
            d.counter()
        ),
        (32768.0, 2000, 2.0, 1.0, None, 0)
    );
    assert_eq!(DynamicLossScale::builder().build().unwrap(), d);
    assert_eq!(DynamicLossScale::new(32768.0).unwrap(), d);
    // jmp allows an initial scale below min; it rises to min at the first backoff.
    let mut low = DynamicLossScale::builder()
        .initial(0.25)
        .min_scale(1.0)
        .build()
        .unwrap();
    low.adjust(true);
    assert_eq!(low.loss_scale(), 0.25);
    low.adjust(false);
    assert_eq!(low.loss_scale(), 1.0);
    // max == min is in order; period 1 grows on every finite step.
    let mut pinned = DynamicLossScale::builder()
        .initial(4.0)
        .period(1)
        .min_scale(4.0)
        .max_scale(4.0)
        .build();
    let p = pinned.as_mut().unwrap();
    p.adjust(true);
    p.adjust(false);
    assert_eq!((p.loss_scale(), p.counter()), (4.0, 0));
    let mut every = DynamicLossScale::builder()
        .initial(1.0)
        .period(1)
        .build()
        .unwrap();
    for _ in 0..3 {
        every.adjust(true);
        assert_eq!(every.counter(), 0);
    }
    assert_eq!(every.loss_scale(), 8.0);
}

#[test]
fn growth_stops_before_f32_overflow_and_max_clips() {
    let mut s = DynamicLossScale::builder()
        .initial(f32::MAX)
        .period(1)
        .build()
        .unwrap();
    s.adjust(true);
    assert_eq!(
        s.loss_scale(),
        f32::MAX,
        "growth to inf is refused, as jmp's first_finite"
    );
    let mut m = DynamicLossScale::builder()
        .initial(131072.0)
        .period(4)
        .max_scale(65504.0)
        .build();
    let m = m.as_mut().unwrap();
    m.adjust(true); // not a growth step, yet clipped (as mpx does on every adjust)
    assert_eq!((m.loss_scale(), m.counter()), (65504.0, 1));
}

// ---- serde -----------------------------------------------------------------------------

#[test]
fn serde_checkpoint_continues_every_trajectory_bit_for_bit() {
    let data = json(TRAJECTORIES);
    for case in data["cases"].as_array().unwrap() {
        let flags: Vec<bool> = case["grads_finite"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_bool().unwrap())
            .collect();
        let expected = &case["trajectories"]["jmp_eager"]["scale_f32_bits"];
        for cut in [1, flags.len() / 3, flags.len() / 2 + 1] {
            let mut straight = build_from_config(&case["config"]);
            let mut resumed = build_from_config(&case["config"]);
            for &f in &flags[..cut] {
                straight.adjust(f);
                resumed.adjust(f);
            }
            let text = serde_json::to_string(&resumed).unwrap();
            let mut resumed: DynamicLossScale = serde_json::from_str(&text).unwrap();
            assert_eq!(resumed, straight);
            for (i, &f) in flags.iter().enumerate().skip(cut) {
                straight.adjust(f);
                resumed.adjust(f);
                assert_eq!(
                    resumed.loss_scale().to_bits(),
                    straight.loss_scale().to_bits()
                );
                assert_eq!(resumed.counter(), straight.counter());
                assert_eq!(resumed.loss_scale().to_bits(), hex_u32(&expected[i]));
            }
        }
    }
}

#[test]
fn serde_keeps_min_and_max_and_validates_on_load() {
    // jmp's pytree round-trip resets a custom min to 1.0 (PR #44, unmerged); ours keeps it.
    let s = DynamicLossScale::builder()
        .initial(1.0)
        .period(4)
        .factor(3.0)
        .min_scale(0.03125)
        .max_scale(65504.0)
        .build()
        .unwrap();
    let v: Value = serde_json::to_value(&s).unwrap();
    assert_eq!(v["min_scale"], 0.03125);
    assert_eq!(v["max_scale"], 65504.0);
    let back: DynamicLossScale = serde_json::from_value(v.clone()).unwrap();
    assert_eq!(back.min_scale(), 0.03125);
    assert_eq!(back.max_scale(), Some(65504.0));

    let mut bad = v.clone();
    bad["period"] = 0.into();
    let err = serde_json::from_value::<DynamicLossScale>(bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("period 0"), "{err}");
    let mut bad = v.clone();
    bad["counter"] = 4.into();
    let err = serde_json::from_value::<DynamicLossScale>(bad)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("counter 4") && err.contains("period 4"),
        "{err}"
    );
    let mut bad = v;
    bad["loss_scale"] = (-1.0).into();
    let err = serde_json::from_value::<DynamicLossScale>(bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("loss scale -1.0"), "{err}");

    let st: StaticLossScale = serde_json::from_str(r#"{"loss_scale":256.0}"#).unwrap();
    assert_eq!(st.loss_scale(), 256.0);
    assert!(serde_json::from_str::<StaticLossScale>(r#"{"loss_scale":0.0}"#).is_err());
    let noop: NoOpLossScale =
        serde_json::from_str(&serde_json::to_string(&NoOpLossScale).unwrap()).unwrap();
    assert_eq!(noop, NoOpLossScale);
}

// ---- no-op and static ------------------------------------------------------------------

#[test]
fn noop_and_static_scales_never_move() {
    let dev: Cpu = Default::default();
    let mut noop = NoOpLossScale;
    let mut st = StaticLossScale::new(3.0).unwrap();
    for f in [true, false, true, true, false] {
        noop.adjust(f);
        st.adjust(f);
        assert_eq!(noop.loss_scale(), 1.0);
        assert_eq!(st.loss_scale(), 3.0);
    }
    let x = dev.tensor([0.1f32, -7.0, f32::NAN]);
    let same = noop.scale(x.clone()).as_vec();
    assert_eq!(bits(&same), bits(&x.as_vec()));
    assert_eq!(noop.inv_loss_scale(), 1.0);
    // 1/3 in f32, then a multiply: jmp's x * (1 / s), not a division.
    assert_eq!(st.inv_loss_scale(), 1.0f32 / 3.0);
    assert_eq!(
        st.unscale_value(3.0).to_bits(),
        (3.0f32 * (1.0f32 / 3.0)).to_bits()
    );
    assert_eq!(st.try_scale(dev.tensor([2.0f32])).unwrap().array(), [6.0]);
}

#[test]
fn scaling_the_loss_scales_the_gradients() {
    let dev: Cpu = Default::default();
    let w = dev.tensor([0.5f32, -1.0, 2.0]);
    let loss = (w.leaky_trace() * dev.tensor([1.0f32, 2.0, 3.0])).sum();
    let mut s = DynamicLossScale::builder().initial(1024.0).build().unwrap();
    let grads = s.scale(loss).backward();
    assert_eq!(grads.get(&w).array(), [1024.0, 2048.0, 3072.0]);
    s.adjust(true);
    let dyn_scale: &dyn LossScale = &s;
    assert_eq!(dyn_scale.loss_scale(), 1024.0);
}

// ---- properties ------------------------------------------------------------------------

/// A finite f32 with |x| in [2^-100, 2^101) or zero, so x * 2^k stays normal for k in -10..=20.
fn moderate_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        20 => (any::<bool>(), -100i32..=100, 0u32..(1 << 23)).prop_map(|(neg, e, m)| {
            let bits = (u32::from(neg) << 31) | (((e + 127) as u32) << 23) | m;
            f32::from_bits(bits)
        }),
    ]
}

proptest! {
    #[test]
    fn unscale_of_scale_is_identity_for_powers_of_two(
        k in -10i32..=20,
        xs in prop::collection::vec(moderate_f32(), 1..300), // dfdx 0.13: as_vec() of an empty tensor panics
    ) {
        let dev: Cpu = Default::default();
        let s = StaticLossScale::new(2f32.powi(k)).unwrap();
        let d = DynamicLossScale::builder().initial(2f32.powi(k)).build().unwrap();
        let n = xs.len();
        let scaled_t = s.scale(dev.tensor_from_vec(xs.clone(), (n,)));
        // The tree form: unscale(scale(x)) on the tensor itself.
        prop_assert_eq!(bits(&s.unscale(&scaled_t).as_vec()), bits(&xs));
        let (back_t, finite) = d.unscale_checked(&vec![scaled_t.clone()]);
        prop_assert!(finite);
        prop_assert_eq!(bits(&back_t[0].as_vec()), bits(&xs));
        let scaled = scaled_t.as_vec();
        let scaled_d = d.scale(dev.tensor_from_vec(xs.clone(), (n,))).as_vec();
        prop_assert_eq!(bits(&scaled), bits(&scaled_d));
        let mut back = vec![0.0f32; n];
        prop_assert!(unscale_into_checked(&scaled, s.inv_loss_scale(), &mut back).unwrap());
        prop_assert_eq!(bits(&back), bits(&xs));
        for (&x, &y) in xs.iter().zip(&scaled) {
            prop_assert_eq!(s.unscale_value(y).to_bits(), x.to_bits());
        }
    }

    #[test]
    fn dynamic_trajectory_invariants(
        period in 1u32..20,
        factor in prop_oneof![Just(2.0f32), Just(3.0), Just(1.5), Just(4.0), 1.01f32..10.0],
        min_exp in -20i32..5,
        initial in 0.001f32..1e6,
        flags in prop::collection::vec(any::<bool>(), 1..200),
    ) {
        let min = 2f32.powi(min_exp);
        let mut s = DynamicLossScale::builder()
            .initial(initial).period(period).factor(factor).min_scale(min).build().unwrap();
        let mut streak = 0u32;
        for f in flags {
            let before = s.loss_scale();
            s.adjust(f);
            let after = s.loss_scale();
            prop_assert!(s.counter() < period);
            prop_assert!(after.is_finite() && after > 0.0);
            if f {
                streak += 1;
                prop_assert_eq!(s.counter(), streak % period);
                if streak.is_multiple_of(period) {
                    prop_assert!(after >= before);
                } else {
                    prop_assert_eq!(after.to_bits(), before.to_bits());
                }
            } else {
                streak = 0;
                prop_assert_eq!(s.counter(), 0);
                prop_assert!(after >= min, "backoff fell below min: {} < {}", after, min);
                prop_assert!(after <= before || before < min);
            }
        }
    }
}
