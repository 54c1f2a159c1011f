//! Policies: every `jmp.get_policy` probe in `semantics_probes.json` (copied from the reference),
//! our deliberate deviations as explicit expectations, Display round trips, typed policies, and
//! the jmp casting probe for `Policy<f32, f16, bf16>`.

use std::any::{Any, TypeId};

use dfdx::prelude::*;
use mpx::policy::{Policy, PolicyError, PolicySpec};
use mpx::precision::DType;
use mpx::precision::{AMP, bf16, f16};

const PROBES: &str = include_str!("data/lossscale/semantics_probes.json");

fn probes() -> serde_json::Value {
    serde_json::from_str(PROBES).expect("semantics_probes.json is valid JSON")
}

fn dtype_named(name: &str) -> DType {
    match name {
        "float16" => DType::Float16,
        "bfloat16" => DType::BFloat16,
        "float32" => DType::Float32,
        "float64" => DType::Float64,
        other => panic!("unexpected dtype {other} in the probe data"),
    }
}

/// The policy string inside `jmp.get_policy('...')`.
fn policy_arg(call: &str) -> &str {
    call.strip_prefix("jmp.get_policy('")
        .and_then(|s| s.strip_suffix("')"))
        .unwrap_or_else(|| panic!("unexpected probe call {call}"))
}

/// Where we deliberately differ from jmp 0.0.4 (issue: "where jmp is sloppy we are strict").
enum Deviation {
    /// jmp accepts (last key wins); we reject the repeated key.
    DuplicateRejected,
    /// jmp rejects the key `' c'`; we trim spaces and accept, with these precisions.
    SpacesAccepted(PolicySpec),
}

fn deviation(policy: &str) -> Option<Deviation> {
    match policy {
        "c=f16,c=bf16" => Some(Deviation::DuplicateRejected),
        "p=f32, c=f16" => Some(Deviation::SpacesAccepted(PolicySpec::new(
            DType::Float32,
            DType::Float16,
            DType::Float16,
        ))),
        _ => None,
    }
}

#[test]
fn every_jmp_get_policy_probe_parses_as_jmp_or_as_documented() {
    let data = probes();
    let cases = data["jmp_get_policy"].as_array().expect("probe list");
    let (mut accepted, mut rejected, mut deviations) = (0, 0, 0);
    for case in cases {
        let policy = policy_arg(case["call"].as_str().expect("call string"));
        let ours = PolicySpec::parse(policy);
        match deviation(policy) {
            Some(Deviation::DuplicateRejected) => {
                assert!(case.get("result").is_some(), "jmp accepted {policy:?}");
                assert_eq!(
                    ours,
                    Err(PolicyError::DuplicateKey {
                        key: "compute",
                        policy: policy.into()
                    })
                );
                deviations += 1;
            }
            Some(Deviation::SpacesAccepted(spec)) => {
                assert!(case.get("error").is_some(), "jmp rejected {policy:?}");
                assert_eq!(ours, Ok(spec));
                deviations += 1;
            }
            None => match (case.get("result"), case.get("error")) {
                (Some(r), None) => {
                    let spec = ours.unwrap_or_else(|e| panic!("{policy:?} rejected: {e}"));
                    let want = PolicySpec::new(
                        dtype_named(r["param"].as_str().unwrap()),
                        dtype_named(r["compute"].as_str().unwrap()),
                        dtype_named(r["output"].as_str().unwrap()),
                    );
                    assert_eq!(spec, want, "{policy:?}");
                    assert_eq!(spec.to_string(), r["str"].as_str().unwrap(), "{policy:?}");
                    accepted += 1;
                }
                (None, Some(_)) => {
                    assert!(ours.is_err(), "{policy:?} must be rejected, got {ours:?}");
                    rejected += 1;
                }
                _ => panic!("probe without result or error: {case}"),
            },
        }
    }
    assert_eq!((accepted, rejected, deviations), (21, 15, 2));
}

#[test]
fn errors_name_the_valid_choices() {
    let e = PolicySpec::parse("p=f32,x=f16").unwrap_err();
    assert_eq!(
        e.to_string(),
        "unknown key `x` in policy `p=f32,x=f16`; expected one of p, params, c, compute, o, output"
    );
    let e = PolicySpec::parse("fp16").unwrap_err();
    assert_eq!(
        e.to_string(),
        "unknown dtype `fp16`; expected one of full, f32, float32, half, f16, float16, bf16, bfloat16, f64, float64"
    );
    let e = PolicySpec::parse("p=F32").unwrap_err();
    assert!(matches!(e, PolicyError::UnknownDType { ref value, .. } if value == "F32"));
    let e = PolicySpec::parse("mixed_float16").unwrap_err();
    assert_eq!(
        e.to_string(),
        "`mixed_float16` is a Keras policy name, not a jmp policy string; use `PolicySpec::mixed_float16()` or the string `p=f32,c=f16,o=f32`"
    );
    assert!(matches!(
        PolicySpec::parse("p=f32,c=mixed_bfloat16"),
        Err(PolicyError::KerasName { .. })
    ));
    for bad in ["p=f32,,c=f16", "p=f32=c", "p=f32;c=f16"] {
        assert!(
            matches!(
                PolicySpec::parse(bad),
                Err(PolicyError::MalformedPart { .. })
            ),
            "{bad}"
        );
    }
    assert!(matches!(
        PolicySpec::parse("o=f16,output=bf16"),
        Err(PolicyError::DuplicateKey { key: "output", .. })
    ));
}

#[test]
fn display_round_trips_for_every_policy() {
    let all = [
        DType::Float16,
        DType::BFloat16,
        DType::Float32,
        DType::Float64,
    ];
    for p in all {
        for c in all {
            for o in all {
                let spec = PolicySpec::new(p, c, o);
                let text = spec.to_string();
                assert_eq!(text.parse::<PolicySpec>(), Ok(spec), "{text}");
            }
        }
    }
    // spaces are tolerated everywhere
    assert_eq!(
        " params = float32 , compute = half ".parse::<PolicySpec>(),
        Ok(PolicySpec::new(
            DType::Float32,
            DType::Float16,
            DType::Float16
        ))
    );
}

#[test]
fn presets_and_typed_policies() {
    assert_eq!(Policy::float32().to_string(), "p=full,c=full,o=full");
    assert_eq!(Policy::mixed_float16().spec(), PolicySpec::mixed_float16());
    assert_eq!(
        Policy::mixed_bfloat16().spec(),
        PolicySpec::mixed_bfloat16()
    );
    assert_eq!(PolicySpec::float32(), "full".parse().unwrap());
    let p: Policy<f32, f16, f32> = "params=float32,compute=float16,output=float32"
        .parse()
        .unwrap();
    assert_eq!(p, Policy::mixed_float16());
    // AMP<f16> is f16 in policy strings
    assert!(
        "p=f32,c=half,o=f32"
            .parse::<Policy<f32, AMP<f16>, f32>>()
            .is_ok()
    );
    match "p=f32,c=bf16".parse::<Policy<f32, f16, f32>>() {
        Err(PolicyError::Mismatch { expected, found }) => {
            assert_eq!(expected, PolicySpec::mixed_float16());
            assert_eq!(found.to_string(), "p=full,c=bf16,o=bf16");
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
    // f64 parses as a spec but no typed policy holds it
    assert!("f64".parse::<Policy<f32, f32, f32>>().is_err());
    let q: Policy<f32, f16, bf16> = Policy::mixed_float16().with_output::<bf16>();
    assert_eq!(q.to_string(), "p=full,c=f16,o=bf16");
}

/// The dtype name jmp would print for one of our leaves (bf16 is emulated: f32 storage, checked
/// by value separately).
fn kind_of(leaf: &dyn Any) -> &'static str {
    type T<E> = Tensor<Rank1<3>, E, Cpu>;
    let id = leaf.type_id();
    [
        (TypeId::of::<T<f32>>(), "float32"),
        (TypeId::of::<T<f16>>(), "float16"),
        (TypeId::of::<T<f64>>(), "float64"),
        (TypeId::of::<T<i32>>(), "int32"),
        (TypeId::of::<T<i64>>(), "int64"),
        (TypeId::of::<T<bool>>(), "bool"),
        (TypeId::of::<f64>(), "float"),
        (TypeId::of::<i64>(), "int"),
        (TypeId::of::<String>(), "str"),
        (TypeId::of::<Option<u8>>(), "None"),
    ]
    .into_iter()
    .find(|(t, _)| *t == id)
    .map_or("unknown", |(_, n)| n)
}

type Rest = (f64, i64, String, Option<u8>);

/// The leaves of a cast probe tree, named as in the probe's `input`.
fn leaves_of<A: Any, B: Any, C: Any, D: Any, E: Any, F: Any>(
    t: &(A, B, C, D, E, F, Rest),
) -> [(&'static str, &dyn Any); 10] {
    [
        ("jax_f32", &t.0),
        ("jax_f16", &t.1),
        ("np_f64", &t.2),
        ("jax_i32", &t.3),
        ("np_i64", &t.4),
        ("jax_bool", &t.5),
        ("py_float", &t.6.0),
        ("py_int", &t.6.1),
        ("string", &t.6.2),
        ("none", &t.6.3),
    ]
}

#[test]
fn policy_casts_follow_the_jmp_probe_with_mpx_leaf_rule() {
    let data = probes();
    let casting = &data["casting"];
    let dev = Cpu::default();
    let vals = [0.1f32, 1.0 + 3.0 / 256.0, 65520.0];
    let f32s: Tensor<Rank1<3>, f32, _> = dev.tensor(vals);
    let tree = (
        f32s.clone(),                                  // jax_f32 / np_f32
        dev.tensor(vals.map(f16::from_f32)),           // jax_f16
        dev.tensor([0.1f64, 0.2, 0.3]),                // np_f64
        dev.tensor([1i32, 2, 3]),                      // jax_i32
        dev.tensor([1i64, 2, 3]),                      // np_i64
        dev.tensor([true, false, true]),               // jax_bool
        (1.5f64, 3i64, String::from("s"), None::<u8>), // py_float, py_int, string, none
    );
    let policy: Policy<f32, f16, bf16> = Policy::new();
    let p = policy.cast_to_param(&tree);
    let c = policy.cast_to_compute(&tree);
    let o = policy.cast_to_output(&tree);
    let probe = |method: &str, key: &str| -> String {
        let k = format!("jmp_policy(p=f32,c=f16,o=bf16).{method}");
        let entry = &casting[k.as_str()][key];
        entry["dtype"]
            .as_str()
            .or(entry["kind"]
                .as_str()
                .filter(|k| *k != "jax.Array" && *k != "numpy.ndarray"))
            .expect("dtype or kind")
            .to_string()
    };
    let sets = [
        ("cast_to_param", leaves_of(&p)),
        ("cast_to_compute", leaves_of(&c)),
        ("cast_to_output", leaves_of(&o)),
    ];
    for (method, leaves) in sets {
        for (key, leaf) in leaves {
            let want = probe(method, key);
            let got = kind_of(leaf);
            if key == "np_f64" {
                // Deliberate: jmp casts f64 arrays, mpx (whose leaf rule we follow) does not.
                assert_eq!(
                    want,
                    if method == "cast_to_param" {
                        "float32"
                    } else if method == "cast_to_compute" {
                        "float16"
                    } else {
                        "bfloat16"
                    }
                );
                assert_eq!(got, "float64", "{method} {key}");
            } else if want == "bfloat16" {
                // emulated bf16: f32 storage holding bf16 values
                assert_eq!(got, "float32", "{method} {key}");
            } else {
                assert_eq!(got, want, "{method} {key}");
            }
        }
    }
    // values: compute rounds to f16, output to bf16, param widens exactly
    assert_eq!(c.0.array(), vals.map(f16::from_f32));
    assert_eq!(
        o.0.array().map(f32::to_bits),
        vals.map(|v| half::bf16::from_f32(v).to_f32().to_bits())
    );
    assert_eq!(p.1.array(), vals.map(|v| f16::from_f32(v).to_f32()));
    assert_eq!(o.2.array(), [0.1, 0.2, 0.3]);
}

#[test]
fn only_ascii_spaces_are_trimmed() {
    assert_eq!(
        PolicySpec::parse("  p = f32 ,  c=f16 "),
        Ok(PolicySpec::new(
            DType::Float32,
            DType::Float16,
            DType::Float16
        ))
    );
    assert_eq!(
        PolicySpec::parse(" half "),
        Ok(PolicySpec::new(
            DType::Float16,
            DType::Float16,
            DType::Float16
        ))
    );
    // Tabs, newlines and other Unicode whitespace are not spaces.
    for bad in [
        "\tf32",
        "f32\n",
        "\u{3000}f32",
        "p=f32,\u{a0}c=f16",
        "p=f32,c=f16\u{2003}",
    ] {
        let err = PolicySpec::parse(bad).unwrap_err();
        assert!(
            matches!(
                err,
                PolicyError::UnknownDType { .. } | PolicyError::UnknownKey { .. }
            ),
            "{bad:?}: {err:?}"
        );
    }
}

#[test]
fn errors_quote_huge_input_once_and_truncated() {
    let huge = "q".repeat(10_000_000);
    let msg = PolicySpec::parse(&huge).unwrap_err().to_string();
    assert!(msg.len() < 300, "{} bytes", msg.len());
    assert_eq!(msg.matches('q').count(), 64, "{msg}");
    assert!(msg.contains(&format!("`{}…`", "q".repeat(64))), "{msg}");
    assert!(msg.contains("expected one of"), "{msg}");

    let key = format!("p=f32,{huge}=f16");
    let msg = PolicySpec::parse(&key).unwrap_err().to_string();
    assert!(msg.len() < 400, "{} bytes", msg.len());
    let dtype = format!("p={huge}");
    let msg = PolicySpec::parse(&dtype).unwrap_err().to_string();
    assert!(msg.len() < 400, "{} bytes", msg.len());
    let part = format!("p=f32,{huge}");
    let msg = PolicySpec::parse(&part).unwrap_err().to_string();
    assert!(msg.len() < 400, "{} bytes", msg.len());
    let dup = format!("c=f16,c=f16,{huge}");
    let msg = PolicySpec::parse(&dup).unwrap_err().to_string();
    assert!(msg.len() < 400, "{} bytes", msg.len());
    // Multi-byte characters are cut on a character boundary.
    let wide = "é".repeat(100);
    let msg = PolicySpec::parse(&wide).unwrap_err().to_string();
    assert_eq!(msg.matches('é').count(), 64, "{msg}");
    // Short input is quoted whole, once.
    let msg = PolicySpec::parse("p=f32,c=fp16").unwrap_err().to_string();
    assert_eq!(
        msg,
        "unknown dtype `fp16` in policy `p=f32,c=fp16`; expected one of full, f32, float32, half, f16, float16, bf16, bfloat16, f64, float64"
    );
}
