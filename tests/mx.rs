//! MX formats against the reference data in `tests/data/mx/` (copied from the project's shared
//! reference: `elements.json` from ml_dtypes 0.6.0, `blocks.json` from the reference quantizer
//! `mx_ref.py` with pychop 0.6.2 and microxcaling results beside it; see `SEMANTICS.md` there),
//! plus errors, packing, statistics and property tests.

use mpx::mx::{
    E8M0, MxError, MxFormat, MxSpec, MxTensor, Rounding, SpecialValues, compare_formats,
    format_table, quantize_dequantize,
};
use proptest::prelude::*;
use serde_json::Value;

const ELEMENTS: &str = include_str!("data/mx/elements.json");
const BLOCKS: &str = include_str!("data/mx/blocks.json");

fn json(text: &str) -> Value {
    serde_json::from_str(text).expect("reference JSON parses")
}

fn hex_u32(v: &Value) -> u32 {
    let s = v.as_str().expect("hex string");
    u32::from_str_radix(s.trim_start_matches("0x"), 16).expect("hex bits")
}

mod common;
use common::bits::bits;

fn u8s(v: &Value) -> Vec<u8> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_u64().unwrap() as u8)
        .collect()
}

fn usizes(v: &Value) -> Vec<usize> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_u64().unwrap() as usize)
        .collect()
}

fn f32s_from_hex(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| f32::from_bits(hex_u32(h)))
        .collect()
}

/// The element formats of elements.json, by key.
fn element_format(key: &str) -> Option<MxFormat> {
    Some(match key {
        "fp8_e4m3" => MxFormat::Fp8E4M3,
        "fp8_e5m2" => MxFormat::Fp8E5M2,
        "fp6_e3m2" => MxFormat::Fp6E3M2,
        "fp6_e2m3" => MxFormat::Fp6E2M3,
        "fp4_e2m1" => MxFormat::Fp4E2M1,
        "int8" => MxFormat::Int8,
        _ => return None,
    })
}

/// The format a blocks.json case describes.
fn block_format(f: &Value) -> MxFormat {
    match f["name"].as_str().unwrap() {
        "mxfp8_e4m3" => MxFormat::Fp8E4M3,
        "mxfp8_e5m2" => MxFormat::Fp8E5M2,
        "mxfp6_e3m2" => MxFormat::Fp6E3M2,
        "mxfp6_e2m3" => MxFormat::Fp6E2M3,
        "mxfp4_e2m1" => MxFormat::Fp4E2M1,
        "mxint8" => MxFormat::Int8,
        name => {
            assert!(name.starts_with("custom_"), "unknown format {name}");
            assert_eq!(f["special_values"], "finite_only");
            MxFormat::custom_float(
                f["exp_bits"].as_u64().unwrap() as u32,
                f["man_bits"].as_u64().unwrap() as u32,
            )
            .unwrap()
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Element codecs
// ---------------------------------------------------------------------------------------------

#[test]
fn element_constants_match_reference() {
    let data = json(ELEMENTS);
    let mut checked = 0;
    for (key, f) in data["formats"].as_object().unwrap() {
        let Some(format) = element_format(key) else {
            continue;
        };
        assert_eq!(
            format.bits(),
            f["total_bits"].as_u64().unwrap() as u32,
            "{key}"
        );
        assert_eq!(
            format.exp_bits(),
            f["exp_bits"].as_u64().unwrap() as u32,
            "{key}"
        );
        assert_eq!(
            format.man_bits(),
            f["man_bits"].as_u64().unwrap() as u32,
            "{key}"
        );
        assert_eq!(format.bias(), f["bias"].as_i64().map(|b| b as i32), "{key}");
        assert_eq!(
            format.max_normal() as f64,
            f["max_normal"].as_f64().unwrap(),
            "{key}"
        );
        assert_eq!(
            format.min_normal() as f64,
            f["min_normal"].as_f64().unwrap(),
            "{key}"
        );
        assert_eq!(
            format.min_subnormal() as f64,
            f["min_subnormal"].as_f64().unwrap(),
            "{key}"
        );
        assert_eq!(format.emax() as i64, f["emax"].as_i64().unwrap(), "{key}");
        assert_eq!(format.emin().map(i64::from), f["emin"].as_i64(), "{key}");
        let special = match f["special_values"].as_str().unwrap() {
            "ieee" => SpecialValues::Ieee,
            "fn_nan_only" => SpecialValues::NanOnly,
            "finite_only" => SpecialValues::FiniteOnly,
            _ => SpecialValues::Int,
        };
        assert_eq!(format.special_values(), special, "{key}");
        checked += 1;
    }
    assert_eq!(checked, 6);
}

#[test]
fn element_decode_tables_match_bit_for_bit() {
    let data = json(ELEMENTS);
    let mut checked = 0;
    for (key, f) in data["formats"].as_object().unwrap() {
        let Some(format) = element_format(key) else {
            continue;
        };
        let table = format.decode_table();
        let reference = f["decode_table"].as_array().unwrap();
        assert_eq!(table.len(), reference.len(), "{key}");
        for entry in reference {
            let code = entry["code"].as_u64().unwrap() as usize;
            assert_eq!(
                table[code].to_bits(),
                hex_u32(&entry["f32"]),
                "{key} code {code:#04x}: {}",
                table[code]
            );
            assert_eq!(format.decode(code as u8).to_bits(), hex_u32(&entry["f32"]));
            checked += 1;
        }
    }
    assert_eq!(checked, 256 + 256 + 64 + 64 + 16 + 256);
}

#[test]
fn element_sat_encodings_match_bit_for_bit() {
    let data = json(ELEMENTS);
    let mut checked = 0;
    for (key, f) in data["formats"].as_object().unwrap() {
        let Some(format) = element_format(key) else {
            continue;
        };
        for case in f["cases"].as_array().unwrap() {
            let x = f32::from_bits(hex_u32(&case["x_f32"]));
            let got = format.encode(x);
            let sat = &case["sat"];
            if sat.is_null() {
                assert_eq!(got, None, "{key} x={x:e}: the format has no NaN code");
            } else {
                let code = sat["code"].as_u64().unwrap() as u8;
                assert_eq!(got, Some(code), "{key} x={x:e} ({})", case["x_f32"]);
                assert_eq!(
                    format.decode(code).to_bits(),
                    hex_u32(&sat["f32"]),
                    "{key} x={x:e}: decoded value"
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 5 * 2002 + 2006);
}

#[test]
fn e8m0_decode_table_and_plain_cast_match() {
    let data = json(ELEMENTS);
    let e = &data["formats"]["e8m0"];
    let table = E8M0::decode_table();
    for entry in e["decode_table"].as_array().unwrap() {
        let code = entry["code"].as_u64().unwrap() as usize;
        assert_eq!(
            table[code].to_bits(),
            hex_u32(&entry["f32"]),
            "E8M0 code {code}"
        );
    }
    let cases = e["cases"].as_array().unwrap();
    for case in cases {
        let x = f32::from_bits(hex_u32(&case["x_f32"]));
        let code = case["ml"]["code"].as_u64().unwrap() as u8;
        assert_eq!(
            E8M0::from_f32(x).to_bits(),
            code,
            "E8M0 cast of {x:e} ({})",
            case["x_f32"]
        );
    }
    assert_eq!(cases.len(), 274);
}

#[test]
fn e8m0_exponents() {
    assert_eq!(E8M0::from_exponent(0), Some(E8M0::ONE));
    assert_eq!(E8M0::from_exponent(127), Some(E8M0::MAX));
    assert_eq!(E8M0::from_exponent(128), None);
    assert_eq!(E8M0::from_exponent(-128), None);
    assert_eq!(E8M0::MIN.to_f32().to_bits(), 0x0040_0000);
    assert_eq!(E8M0::NAN.exponent(), None);
    assert_eq!(E8M0::from_bits(0x80).to_string(), "2^1");
}

#[test]
fn ties_away_rounds_halves_up_in_magnitude() {
    // FP4: 2.5 lies between 2 and 3; 0.25 between 0 and 0.5 (subnormal path); INT8: 1/128.
    let away = Rounding::NearestAway;
    assert_eq!(MxFormat::Fp4E2M1.encode_with(2.5, away), Some(0x5));
    assert_eq!(MxFormat::Fp4E2M1.encode(2.5), Some(0x4));
    assert_eq!(MxFormat::Fp4E2M1.encode_with(-0.25, away), Some(0x9));
    assert_eq!(MxFormat::Fp4E2M1.encode(-0.25), Some(0x8)); // -0
    assert_eq!(MxFormat::Int8.encode_with(1.0 / 128.0, away), Some(1));
    assert_eq!(MxFormat::Int8.encode(1.0 / 128.0), Some(0));
    assert_eq!(MxFormat::Int8.encode_with(-3.0 / 128.0, away), Some(0xFE));
    assert_eq!(MxFormat::Int8.encode(-3.0 / 128.0), Some(0xFE));
}

// ---------------------------------------------------------------------------------------------
// Block quantization
// ---------------------------------------------------------------------------------------------

struct BlockCase {
    id: String,
    spec: MxSpec,
    shape: Vec<usize>,
    input: Vec<f32>,
    case: Value,
}

fn block_cases() -> Vec<BlockCase> {
    let data = json(BLOCKS);
    data["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert_eq!(c["axis"], -1);
            let spec = MxSpec::new(block_format(&c["format"]))
                .with_block_size(c["block_size"].as_u64().unwrap() as usize)
                .unwrap();
            BlockCase {
                id: c["id"].as_str().unwrap().to_string(),
                spec,
                shape: usizes(&c["shape"]),
                input: f32s_from_hex(&c["input_f32"]),
                case: c.clone(),
            }
        })
        .collect()
}

#[test]
fn blocks_match_reference_bit_for_bit() {
    let cases = block_cases();
    assert_eq!(cases.len(), 39);
    for BlockCase {
        id,
        spec,
        shape,
        input,
        case,
    } in &cases
    {
        let t = MxTensor::quantize(input, shape, spec).unwrap();
        let scale_shape = usizes(&case["scale_shape"]);
        assert_eq!(
            t.num_blocks(),
            scale_shape.iter().product::<usize>(),
            "{id}"
        );
        assert_eq!(
            t.scale_codes(),
            &u8s(&case["scale_e8m0"])[..],
            "{id}: scale codes"
        );
        assert_eq!(
            t.element_codes(),
            u8s(&case["elements"]),
            "{id}: element codes"
        );
        let want: Vec<u32> = case["dequant_f32"]
            .as_array()
            .unwrap()
            .iter()
            .map(hex_u32)
            .collect();
        assert_eq!(bits(&t.dequantize()), want, "{id}: dequantized bits");
        let fused = quantize_dequantize(input, shape, spec).unwrap();
        assert_eq!(bits(&fused), want, "{id}: quantize_dequantize bits");
        let exps: Vec<Option<i32>> = case["scale_exponent"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_i64().map(|e| e as i32))
            .collect();
        let ours: Vec<Option<i32>> = t
            .scale_codes()
            .iter()
            .map(|&c| E8M0::from_bits(c).exponent())
            .collect();
        assert_eq!(ours, exps, "{id}: shared exponents");
        // every thread count gives the same tensor
        assert_eq!(
            MxTensor::quantize_threads(input, shape, spec, 2).unwrap(),
            t,
            "{id}"
        );
    }
}

#[test]
fn ties_away_matches_microxcaling() {
    let mut checked = 0;
    for c in block_cases() {
        let mxc = &c.case["microxcaling"];
        if mxc.is_null() {
            continue;
        }
        let spec = c.spec.with_rounding(Rounding::NearestAway);
        let ours = quantize_dequantize(&c.input, &c.shape, &spec).unwrap();
        let theirs = f32s_from_hex(&mxc["dequant_f32"]);
        // microxcaling's C++ kernel returns +0 where the reference keeps -0 (listed per case).
        let signed_zero = usizes(&mxc["signed_zero_diff_indices"]);
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            if signed_zero.contains(&i) {
                assert!(*a == 0.0 && *b == 0.0, "{} [{i}]: {a} vs {b}", c.id);
            } else {
                assert_eq!(a.to_bits(), b.to_bits(), "{} [{i}]: {a:e} vs {b:e}", c.id);
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 37);
}

#[test]
fn differs_from_pychop_exactly_where_documented() {
    let mut checked = 0;
    for c in block_cases() {
        let py = &c.case["pychop"];
        if py.is_null() {
            continue;
        }
        let ours = quantize_dequantize(&c.input, &c.shape, &c.spec).unwrap();
        let theirs = f32s_from_hex(&py["dequant_f32"]);
        let value_diff = usizes(&py["value_diff_indices"]);
        let zero_diff = usizes(&py["signed_zero_diff_indices"]);
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            let same_value = a == b || (a.is_nan() && b.is_nan());
            assert_eq!(
                !same_value,
                value_diff.contains(&i),
                "{} [{i}]: {a:e} vs pychop {b:e}",
                c.id
            );
            let sign_only = same_value && a.to_bits() != b.to_bits() && *a == 0.0;
            assert_eq!(
                sign_only,
                zero_diff.contains(&i),
                "{} [{i}]: sign of zero",
                c.id
            );
        }
        checked += 1;
    }
    assert!(checked >= 38, "{checked}");
}

#[test]
fn blocks_never_cross_rows() {
    // 2 rows of 3 with block 2: blocks [0,1] [2] | [3,4] [5]; pychop would block the flat array.
    let spec = MxSpec::new(MxFormat::Fp8E4M3).with_block_size(2).unwrap();
    let x = [1.0, 2.0, 1000.0, 1.0, 2.0, 0.001];
    let t = MxTensor::quantize(&x, &[2, 3], &spec).unwrap();
    assert_eq!(t.num_blocks(), 4);
    assert_eq!(
        t.scale_values(),
        vec![2f32.powi(-7), 2f32.powi(1), 2f32.powi(-7), 2f32.powi(-18)]
    );
    // 1000 = 1.95 * 2^9 alone in its block: q = 500 saturates to 448 (the floor rule's cost)
    assert_eq!(
        t.dequantize(),
        vec![1.0, 2.0, 896.0, 1.0, 2.0, 0.0009765625]
    );
}

#[test]
fn scalar_and_empty_shapes() {
    let spec = MxSpec::new(MxFormat::Fp4E2M1);
    let t = MxTensor::quantize(&[3.0], &[], &spec).unwrap();
    assert_eq!((t.num_blocks(), t.dequantize()), (1, vec![3.0]));
    let t = MxTensor::quantize(&[], &[4, 0], &spec).unwrap();
    assert_eq!((t.num_blocks(), t.len()), (0, 0));
    let t = MxTensor::quantize(&[], &[0, 5], &spec).unwrap();
    assert!(t.is_empty());
    assert_eq!(MxTensor::from_bytes(&t.to_bytes()).unwrap(), t);
}

#[test]
fn narrow_scale_saturation_and_nan() {
    // E4M0 scale: bias 7, exponents -7..=7, code 15 = NaN.
    let spec = MxSpec::new(MxFormat::Fp8E4M3)
        .with_block_size(1)
        .unwrap()
        .with_scale_exp_bits(4)
        .unwrap();
    let x = [1.0, 1e-9, 65536.0, 2f32.powi(16)];
    let t = MxTensor::quantize(&x, &[4], &spec).unwrap();
    // 1.0: 0 - 8 = -8 -> clamps to -7; 1e-9 clamps to -7 and underflows to 0;
    // 2^16: 16 - 8 = 8 > 7 -> NaN block
    assert_eq!(t.scale_codes(), &[0, 0, 15, 15]);
    let y = t.dequantize();
    assert_eq!(&y[..2], &[1.0, 0.0]);
    assert!(y[2].is_nan() && y[3].is_nan());
    assert_eq!(t.nan_blocks(), 2);
}

// ---------------------------------------------------------------------------------------------
// Statistics and tables
// ---------------------------------------------------------------------------------------------

#[test]
fn statistics_match_reference_dequantization() {
    for c in block_cases() {
        let t = MxTensor::quantize(&c.input, &c.shape, &c.spec).unwrap();
        let s = t.statistics(&c.input).unwrap();
        // expected error from the reference's dequantized values, not from our own output
        let reference = f32s_from_hex(&c.case["dequant_f32"]);
        let (mut sq, mut max, mut n) = (0.0f64, 0.0f64, 0usize);
        for (x, y) in c.input.iter().zip(&reference) {
            if !y.is_nan() {
                let e = f64::from(*x) - f64::from(*y);
                sq += e * e;
                max = max.max(e.abs());
                n += 1;
            }
        }
        let mse = if n == 0 { 0.0 } else { sq / n as f64 };
        assert_eq!(s.mse, mse, "{}", c.id);
        assert_eq!(s.max_abs_error, max, "{}", c.id);
        let nan_blocks = u8s(&c.case["scale_e8m0"])
            .iter()
            .filter(|&&v| v == 255)
            .count();
        assert_eq!(s.nan_blocks, nan_blocks, "{}", c.id);
        let elem_bits = c.spec.format().storage_bits() as usize;
        let bytes = s.blocks + (s.elements * elem_bits).div_ceil(8);
        assert_eq!(
            s.bits_per_element,
            bytes as f64 * 8.0 / s.elements as f64,
            "{}",
            c.id
        );
        assert_eq!(s.compression_vs_f32, 32.0 / s.bits_per_element);
        assert_eq!(s.compression_vs_f16, 16.0 / s.bits_per_element);
    }
}

#[test]
fn bits_per_element_of_the_ocp_formats() {
    let x = vec![0.5f32; 32 * 64];
    for (format, bits) in [
        (MxFormat::Fp8E4M3, 8.25),
        (MxFormat::Fp6E2M3, 6.25),
        (MxFormat::Fp4E2M1, 4.25),
        (MxFormat::Int8, 8.25),
    ] {
        let t = MxTensor::quantize(&x, &[64, 32], &MxSpec::new(format)).unwrap();
        let s = t.statistics(&x).unwrap();
        assert_eq!(s.bits_per_element, bits, "{format}");
        assert_eq!(t.storage_bytes() * 8, (bits * 2048.0) as usize);
        assert_eq!(s.mse, 0.0);
    }
    // custom formats take the next storage width: 3 bits -> 4, 5 -> 6, 7 -> 8
    assert_eq!(MxFormat::custom_int(3).unwrap().storage_bits(), 4);
    assert_eq!(MxFormat::custom_float(2, 2).unwrap().storage_bits(), 6);
    assert_eq!(MxFormat::custom_float(4, 2).unwrap().storage_bits(), 8);
}

#[test]
fn statistics_reject_wrong_original() {
    let t = MxTensor::quantize(&[1.0, 2.0], &[2], &MxSpec::new(MxFormat::Int8)).unwrap();
    assert_eq!(
        t.statistics(&[1.0]).unwrap_err(),
        MxError::OriginalLength {
            expected: 2,
            found: 1
        }
    );
}

fn assert_aligned(text: &str) {
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() >= 3, "{text}");
    let w = lines[0].chars().count();
    for l in &lines {
        assert_eq!(l.chars().count(), w, "ragged line {l:?} in\n{text}");
    }
}

#[test]
fn comparison_and_format_tables_print_aligned() {
    let x: Vec<f32> = (0..512)
        .map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0)
        .collect();
    let specs: Vec<MxSpec> = MxFormat::OCP.iter().map(|&f| MxSpec::new(f)).collect();
    let cmp = compare_formats(&x, &[16, 32], &specs).unwrap();
    assert_eq!(cmp.rows.len(), 6);
    for (row, spec) in cmp.rows.iter().zip(&specs) {
        let direct = MxTensor::quantize(&x, &[16, 32], spec)
            .unwrap()
            .statistics(&x)
            .unwrap();
        assert_eq!(row, &direct);
    }
    // more element bits, less error (same data, same block size)
    let mse = |f: MxFormat| cmp.rows.iter().find(|r| r.spec.format() == f).unwrap().mse;
    assert!(mse(MxFormat::Fp8E4M3) < mse(MxFormat::Fp6E3M2));
    assert!(mse(MxFormat::Fp6E3M2) < mse(MxFormat::Fp4E2M1));
    let text = cmp.to_string();
    assert_aligned(&text);
    assert!(
        text.contains("MXFP4 E2M1") && text.contains("4.250"),
        "{text}"
    );

    let mut formats = MxFormat::OCP.to_vec();
    formats.push(MxFormat::custom_float(4, 3).unwrap());
    formats.push(MxFormat::custom_int(4).unwrap());
    let text = format_table(&formats).to_string();
    assert_aligned(&text);
    let row = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .unwrap()
            .to_string()
    };
    assert!(row("MXFP8 E4M3").contains("448") && row("MXFP8 E4M3").contains("NanOnly"));
    assert!(row("MXFP8 E5M2").contains("57344") && row("MXFP8 E5M2").contains("Ieee"));
    assert!(row("E4M3 (custom)").contains("480"));
    assert!(row("INT4 (custom)").contains("1.75"));
    assert!(
        compare_formats(&x, &[3], &specs)
            .unwrap_err()
            .to_string()
            .contains("512")
    );
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

#[test]
fn invalid_formats_and_specs_say_what_is_allowed() {
    let e = MxFormat::custom_float(0, 0).unwrap_err();
    assert!(matches!(e, MxError::TooFewBits { min: 2, .. }), "{e:?}");
    assert!(e.to_string().contains("E0M0"), "{e}");
    // pychop's rule: no exponent bits is an integer; (0, 7) has MXINT8's values
    let int8 = MxFormat::custom_float(0, 7).unwrap();
    assert_eq!(int8, MxFormat::custom_int(8).unwrap());
    assert_eq!(int8.decode_table(), MxFormat::Int8.decode_table());
    assert!(matches!(
        MxFormat::custom_float(0, 8).unwrap_err(),
        MxError::TooManyBits { bits: 9, .. }
    ));
    let e = MxFormat::custom_int(0).unwrap_err();
    assert!(matches!(e, MxError::TooFewBits { min: 2, .. }), "{e:?}");
    assert!(e.to_string().contains("2..=8"), "{e}");
    let e = MxFormat::custom_float(5, 3).unwrap_err();
    assert!(matches!(e, MxError::TooManyBits { bits: 9, .. }), "{e:?}");
    assert!(e.to_string().contains("at most 8"), "{e}");
    assert!(matches!(
        MxFormat::custom_int(9).unwrap_err(),
        MxError::TooManyBits { bits: 9, .. }
    ));
    assert!(MxFormat::custom_float(u32::MAX, u32::MAX).is_err());
    let spec = MxSpec::new(MxFormat::Fp8E4M3);
    assert_eq!(spec.with_block_size(0).unwrap_err(), MxError::ZeroBlockSize);
    assert_eq!(
        spec.with_scale_exp_bits(0).unwrap_err(),
        MxError::ScaleExpBits(0)
    );
    assert_eq!(
        spec.with_scale_exp_bits(9).unwrap_err(),
        MxError::ScaleExpBits(9)
    );
    assert!(
        spec.with_scale_exp_bits(0)
            .unwrap_err()
            .to_string()
            .contains("1 <= k <= 8")
    );
}

#[test]
fn shape_mismatches_are_errors() {
    let spec = MxSpec::new(MxFormat::Fp4E2M1);
    let e = MxTensor::quantize(&[1.0; 5], &[2, 3], &spec).unwrap_err();
    assert_eq!(
        e,
        MxError::ShapeMismatch {
            shape: vec![2, 3],
            expected: 6,
            found: 5
        }
    );
    assert_eq!(
        quantize_dequantize(&[1.0; 5], &[usize::MAX, 2], &spec).unwrap_err(),
        MxError::ShapeOverflow(vec![usize::MAX, 2])
    );
    let mut t = MxTensor::quantize(&[1.0; 6], &[2, 3], &spec).unwrap();
    assert!(t.requantize(&[1.0; 7], 1).is_err());
    assert!(t.dequantize_into(&mut [0.0; 5], 1).is_err());
    assert!(MxTensor::from_codes(&[2, 3], &spec, vec![127; 2], &[0; 5]).is_err());
    assert!(MxTensor::from_codes(&[2, 3], &spec, vec![127; 3], &[0; 6]).is_err());
    let e = MxTensor::from_codes(&[2, 3], &spec, vec![127; 2], &[0, 0, 16, 0, 0, 0]).unwrap_err();
    assert!(
        matches!(
            e,
            MxError::CodeOutOfRange {
                what: "element",
                index: 2,
                ..
            }
        ),
        "{e:?}"
    );
    let narrow = spec.with_scale_exp_bits(4).unwrap();
    let e = MxTensor::from_codes(&[2], &narrow, vec![16], &[0, 0]).unwrap_err();
    assert!(
        matches!(e, MxError::CodeOutOfRange { what: "scale", .. }),
        "{e:?}"
    );
}

#[test]
fn corrupt_bytes_are_errors() {
    let spec = MxSpec::new(MxFormat::Fp6E3M2).with_block_size(5).unwrap();
    let x: Vec<f32> = (0..21).map(|i| i as f32 - 10.0).collect();
    let t = MxTensor::quantize(&x, &[3, 7], &spec).unwrap();
    let bytes = t.to_bytes();
    assert_eq!(MxTensor::from_bytes(&bytes).unwrap(), t);
    // 24-byte header + 2 dims + 6 scales + ceil(21 * 6 / 8) = 16 element bytes
    assert_eq!(bytes.len(), 24 + 16 + 6 + 16);
    for cut in 0..bytes.len() {
        assert!(
            MxTensor::from_bytes(&bytes[..cut]).is_err(),
            "truncated at {cut}"
        );
    }
    let mut long = bytes.clone();
    long.push(0);
    assert!(matches!(
        MxTensor::from_bytes(&long),
        Err(MxError::Length { .. })
    ));
    let corrupt = |at: usize, v: u8| {
        let mut b = bytes.clone();
        b[at] = v;
        MxTensor::from_bytes(&b)
    };
    assert!(matches!(corrupt(0, b'X'), Err(MxError::BadHeader(_))));
    assert!(matches!(corrupt(4, 9), Err(MxError::BadHeader(_)))); // format kind
    assert!(matches!(corrupt(7, 2), Err(MxError::BadHeader(_)))); // rounding
    assert_eq!(corrupt(8, 0).unwrap_err(), MxError::ScaleExpBits(0));
    assert_eq!(corrupt(8, 9).unwrap_err(), MxError::ScaleExpBits(9));
    let mut b = bytes.clone();
    b[12..20].copy_from_slice(&0u64.to_le_bytes());
    assert_eq!(
        MxTensor::from_bytes(&b).unwrap_err(),
        MxError::ZeroBlockSize
    );
    let mut b = bytes.clone();
    b[20..24].copy_from_slice(&u32::MAX.to_le_bytes()); // absurd number of dimensions
    assert!(matches!(
        MxTensor::from_bytes(&b),
        Err(MxError::Length { .. })
    ));
    let mut b = bytes.clone();
    b[24..32].copy_from_slice(&u64::MAX.to_le_bytes()); // element count overflows
    assert!(matches!(
        MxTensor::from_bytes(&b),
        Err(MxError::ShapeOverflow(_))
    ));
    let mut b = bytes.clone();
    b[24..32].copy_from_slice(&4u64.to_le_bytes()); // a wrong shape: wrong length
    assert!(matches!(
        MxTensor::from_bytes(&b),
        Err(MxError::Length { .. })
    ));
    // a custom INT3 stored in 4 bits: a code of 8 does not fit 3 bits
    let int3 = MxSpec::new(MxFormat::custom_int(3).unwrap());
    let mut b = MxTensor::quantize(&[0.5, 1.0], &[2], &int3)
        .unwrap()
        .to_bytes();
    let last = b.len() - 1;
    b[last] = 0x8;
    assert!(matches!(
        MxTensor::from_bytes(&b),
        Err(MxError::CodeOutOfRange { .. })
    ));
    // padding bits after the last element must be zero
    let mut b = MxTensor::quantize(&[0.5], &[1], &MxSpec::new(MxFormat::Fp4E2M1))
        .unwrap()
        .to_bytes();
    let last = b.len() - 1;
    b[last] |= 0x10;
    assert!(matches!(
        MxTensor::from_bytes(&b),
        Err(MxError::BadHeader(_))
    ));
}

#[test]
fn only_canonical_encodings_are_read() {
    // Each of these is a byte that `to_bytes` never writes.
    let t = MxTensor::quantize(&[1.0, -2.0], &[2], &MxSpec::new(MxFormat::Fp8E4M3)).unwrap();
    let bytes = t.to_bytes();
    let corrupt = |at: usize, v: u8| {
        let mut b = bytes.clone();
        b[at] = v;
        MxTensor::from_bytes(&b)
    };
    for at in [9, 10, 11] {
        let err = corrupt(at, 1).unwrap_err();
        assert!(
            matches!(&err, MxError::BadHeader(m) if m.contains("reserved")),
            "byte {at}: {err}"
        );
    }
    for at in [5, 6] {
        let err = corrupt(at, 3).unwrap_err();
        assert!(matches!(err, MxError::BadHeader(_)), "byte {at}: {err}");
    }
    // A custom E0M3 float header would read back as a custom INT4: not what to_bytes writes.
    let int4 = MxSpec::new(MxFormat::custom_int(4).unwrap());
    let mut b = MxTensor::quantize(&[0.5, 1.0], &[2], &int4)
        .unwrap()
        .to_bytes();
    assert_eq!(&b[4..7], &[7, 4, 0]);
    b[4..7].copy_from_slice(&[6, 0, 3]);
    let err = MxTensor::from_bytes(&b).unwrap_err();
    assert!(matches!(err, MxError::BadHeader(_)), "{err}");
    // A custom INT4 with a non-zero unused field.
    b[4..7].copy_from_slice(&[7, 4, 1]);
    assert!(matches!(
        MxTensor::from_bytes(&b),
        Err(MxError::BadHeader(_))
    ));
    b[4..7].copy_from_slice(&[7, 4, 0]);
    assert!(MxTensor::from_bytes(&b).is_ok());
}

#[test]
fn huge_thread_counts_give_the_same_tensor() {
    // One element per row: this once spawned a thread per row (capped now at rows and cores).
    let x: Vec<f32> = (0..200_000).map(|i| (i % 97) as f32 - 48.0).collect();
    let spec = MxSpec::new(MxFormat::Fp4E2M1);
    let one = MxTensor::quantize(&x, &[200_000, 1], &spec).unwrap();
    let many = MxTensor::quantize_threads(&x, &[200_000, 1], &spec, usize::MAX).unwrap();
    assert_eq!(many, one);
    let mut out = vec![0.0; x.len()];
    many.dequantize_into(&mut out, usize::MAX).unwrap();
    assert_eq!(bits(&out), bits(&one.dequantize()));
}

/// A small tensor and spec, so that every byte of the encoding can be mutated in each case.
fn small_encoding() -> impl Strategy<Value = Vec<u8>> {
    (1usize..3, 1usize..12, any_spec()).prop_flat_map(|(rows, cols, spec)| {
        prop::collection::vec(any_value(), rows * cols).prop_map(move |x| {
            MxTensor::quantize(&x, &[rows, cols], &spec)
                .unwrap()
                .to_bytes()
        })
    })
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

fn any_format() -> impl Strategy<Value = MxFormat> {
    prop_oneof![
        Just(MxFormat::Fp8E4M3),
        Just(MxFormat::Fp8E5M2),
        Just(MxFormat::Fp6E3M2),
        Just(MxFormat::Fp6E2M3),
        Just(MxFormat::Fp4E2M1),
        Just(MxFormat::Int8),
        (1u32..=7)
            .prop_flat_map(|e| (Just(e), 0..=(7 - e)))
            .prop_map(|(e, m)| MxFormat::custom_float(e, m).unwrap()),
        (2u32..=8).prop_map(|b| MxFormat::custom_int(b).unwrap()),
    ]
}

fn any_spec() -> impl Strategy<Value = MxSpec> {
    (any_format(), 1usize..=40, any::<bool>(), 3u32..=8).prop_map(|(f, k, away, sbits)| {
        let r = if away {
            Rounding::NearestAway
        } else {
            Rounding::NearestEven
        };
        MxSpec::new(f)
            .with_block_size(k)
            .unwrap()
            .with_rounding(r)
            .with_scale_exp_bits(sbits)
            .unwrap()
    })
}

/// Values over f32's whole range, with zeros, subnormals and the odd NaN/Inf.
fn any_value() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -1e3f32..1e3,
        4 => any::<u32>().prop_map(f32::from_bits).prop_filter("finite", |v| v.is_finite()),
        2 => Just(0.0f32),
        1 => Just(-0.0f32),
        1 => (1u32..0x0080_0000).prop_map(f32::from_bits),
        1 => prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)],
    ]
}

fn any_tensor() -> impl Strategy<Value = (Vec<usize>, Vec<f32>)> {
    (1usize..4, 1usize..70).prop_flat_map(|(rows, cols)| {
        (
            Just(vec![rows, cols]),
            prop::collection::vec(any_value(), rows * cols),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn quantization_is_idempotent((shape, x) in any_tensor(), spec in any_spec()) {
        let t = MxTensor::quantize(&x, &shape, &spec).unwrap();
        let y = t.dequantize();
        let t2 = MxTensor::quantize(&y, &shape, &spec).unwrap();
        prop_assert_eq!(&t2, &t);
        prop_assert_eq!(bits(&t2.dequantize()), bits(&y));
        prop_assert_eq!(bits(&quantize_dequantize(&y, &shape, &spec).unwrap()), bits(&y));
    }

    #[test]
    fn values_stay_within_their_block_range((shape, x) in any_tensor(), spec in any_spec()) {
        let t = MxTensor::quantize(&x, &shape, &spec).unwrap();
        let y = t.dequantize();
        let scales = t.scale_values();
        let (cols, k) = (shape[1], spec.block_size());
        let per_row = cols.div_ceil(k);
        let max = spec.format().max_normal();
        for (i, v) in y.iter().enumerate() {
            let s = scales[(i / cols) * per_row + (i % cols) / k];
            if s.is_nan() {
                prop_assert!(v.is_nan());
            } else {
                prop_assert!(v.abs() <= max * s, "{} > {} * {}", v, max, s);
                prop_assert!(v.is_finite());
            }
        }
        // the non-NaN blocks are exactly those without NaN or Inf
        for (b, s) in scales.iter().enumerate() {
            let (r, c) = (b / per_row, (b % per_row) * k);
            let blk = &x[r * cols + c..r * cols + (c + k).min(cols)];
            let finite = blk.iter().all(|v| v.is_finite());
            if !finite {
                prop_assert!(s.is_nan());
            }
            // with E8M0 no finite f32 block overflows the scale; narrower scales may
            if spec.scale_exp_bits() == 8 {
                prop_assert_eq!(s.is_nan(), !finite);
            }
        }
    }

    #[test]
    fn bytes_round_trip((shape, x) in any_tensor(), spec in any_spec(), threads in 1usize..4) {
        let t = MxTensor::quantize_threads(&x, &shape, &spec, threads).unwrap();
        prop_assert_eq!(&MxTensor::from_bytes(&t.to_bytes()).unwrap(), &t);
        prop_assert_eq!(&MxTensor::quantize(&x, &shape, &spec).unwrap(), &t);
        let rebuilt = MxTensor::from_codes(&shape, &spec, t.scale_codes().to_vec(), &t.element_codes()).unwrap();
        prop_assert_eq!(&rebuilt, &t);
        let mut out = vec![0.0; x.len()];
        t.dequantize_into(&mut out, threads).unwrap();
        prop_assert_eq!(bits(&out), bits(&t.dequantize()));
    }

    #[test]
    fn a_single_byte_mutation_round_trips_or_is_an_error(
        bytes in small_encoding(),
        values in prop::collection::vec(any::<u8>(), 200),
    ) {
        // Every position of the encoding, each with a different new byte.
        for (at, &v) in values.iter().enumerate().take(bytes.len()) {
            let mut b = bytes.clone();
            b[at] = if v == bytes[at] { v ^ 0x01 } else { v };
            if let Ok(t) = MxTensor::from_bytes(&b) {
                prop_assert_eq!(&t.to_bytes(), &b, "byte {} set to {:#04x} was accepted", at, b[at]);
            }
        }
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..80)) {
        let _ = MxTensor::from_bytes(&bytes);
        let mut with_magic = b"MXT1".to_vec();
        with_magic.extend_from_slice(&bytes);
        let _ = MxTensor::from_bytes(&with_magic);
    }
}
