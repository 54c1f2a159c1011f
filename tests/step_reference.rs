//! The seed recipe's linear-layer step (flax.nnx, bf16 forward, f32 master, loss scaling, SGD),
//! reproduced with a dfdx `Linear` and an emulated-bf16 working copy (mpx's layer in bf16), for every case of
//! `tests/data/lossscale/nnx_step.json` (copied from the reference material).
//!
//! # Tolerances, from bf16's precision
//! bf16 keeps 8 significant bits: one rounding moves a value by at most 2^-9 relative (half an
//! ulp), an ulp is 2^-8 relative at most. Our path rounds at the same cast points as the
//! reference (parameters, inputs, model output, output gradient, parameter gradients) but
//! computes `pred - y` and the mean in f32 where the reference rounds them to bf16 too, so
//! individual values may land one bf16 ulp away. Hence:
//! - model output: within 1 bf16 ulp of the reference's bits;
//! - gradients: within 2 bf16 ulps of the largest gradient (`2^-7 * max|g|`, 0.78%);
//! - updated parameters `p - lr * g`: within `lr * 2^-7 * max|g|` of the reference (follows from
//!   the gradient bound), and within 1e-2 relative to the tensor's largest value. Not
//!   element-wise relative: the bias starts at 0, so its update is `-lr * g`, and the reference
//!   sums the bias gradient over the batch in bf16 (case 2 matches a sequential bf16 sum, case 3
//!   some other order), which leaves small, cancelling sums a few bf16 ulps from our f32 sum
//!   (seed 2, bias 1: 2544 in the reference, 2576 here, 2 ulps);
//! - losses: within 2^-7 relative (the reference's loss is itself a bf16 value, ±2^-9).

use dfdx::{optim::*, prelude::*};
use mpx::precision::{bf16, round_to_bf16};
use mpx::scaling::StaticLossScale;
use mpx::step::{GradScaler, Mixed};
use serde_json::Value;

const TOL_ULPS: f32 = 1.0 / 128.0; // 2^-7

fn load() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/lossscale/nnx_step.json"
    ))
    .expect("nnx_step.json is in tests/data/lossscale");
    serde_json::from_str(&text).expect("valid JSON")
}

/// An array field's values, read from its exact bits (f32, or bf16 widened to f32).
fn floats(v: &Value) -> Vec<f32> {
    let dtype = v["dtype"].as_str().unwrap();
    v["bits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            let b = u32::from_str_radix(b.as_str().unwrap(), 16).unwrap();
            match dtype {
                "float32" => f32::from_bits(b),
                "bfloat16" => f32::from_bits(b << 16),
                other => panic!("unexpected dtype {other}"),
            }
        })
        .collect()
}

fn bf16_round(v: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    round_to_bf16(v, &mut out);
    out
}

/// Distance in bf16 ulps at `want`'s magnitude.
fn bf16_ulp(want: f32) -> f32 {
    let e = want.abs().max(f32::MIN_POSITIVE).log2().floor();
    2f32.powf(e - 7.0)
}

fn run_case<const I: usize, const O: usize>(case: &Value) {
    let inputs = &case["inputs"];
    let n = inputs["n"].as_u64().unwrap() as usize;
    let lr = inputs["lr"].as_f64().unwrap() as f32;
    let scale = inputs["loss_scale"].as_f64().unwrap() as f32;
    let name = format!("seed {} (n {n}, {I}->{O}, scale {scale})", inputs["seed"]);
    assert_eq!(inputs["d_in"].as_u64(), Some(I as u64));
    assert_eq!(inputs["d_out"].as_u64(), Some(O as u64));

    let dev = Cpu::default();
    // nnx's kernel is (in, out); dfdx's Linear weight is (out, in).
    let kernel = floats(&case["initial_params"]["kernel"]);
    let mut weight = vec![0.0f32; I * O];
    for i in 0..I {
        for o in 0..O {
            weight[o * I + i] = kernel[i * O + o];
        }
    }
    let mut master = Mixed::mapped(dev.build_module::<Linear<I, O>, f32>());
    master.weight.copy_from(&weight);
    master
        .bias
        .copy_from(&floats(&case["initial_params"]["bias"]));

    // x and y are cast to bf16 (the batch's float leaves).
    let x = dev.tensor_from_vec(bf16_round(&floats(&case["x"])), (n, Const::<I>));
    let y = dev.tensor_from_vec(bf16_round(&floats(&case["y"])), (n, Const::<O>));

    let mut opt = Sgd::new(
        &*master,
        SgdConfig {
            lr: lr as f64,
            momentum: None,
            weight_decay: None,
        },
    );
    let mut scaler = GradScaler::<bf16, _>::new(StaticLossScale::new(scale).unwrap());
    let applied_scale = scaler.loss_scale();
    let out = scaler
        .forward(&master, x.clone().trace(master.alloc_grads()), |m, x| {
            m.forward(x)
        })
        .unwrap();
    let pred = out.retaped::<NoneTape>().as_vec();
    let loss = mse_loss(out, y.clone());
    let loss_value = loss.array();
    let grads = scaler.backward(loss).unwrap();

    // The forward pass: bf16 predictions within one bf16 ulp of the reference.
    let pred_ref = floats(&case["initial_pred_bf16"]);
    for (k, (a, b)) in pred.iter().zip(&pred_ref).enumerate() {
        assert!(
            (a - b).abs() <= bf16_ulp(*b),
            "{name}: prediction {k}: {a} vs {b}"
        );
    }
    let loss_ref = floats(&case["initial_loss_bf16"])[0];
    assert!(
        ((loss_value - loss_ref) / loss_ref).abs() <= TOL_ULPS,
        "{name}: loss {loss_value} vs {loss_ref}"
    );

    // Gradients, unscaled with the applied scale.
    assert_eq!(master.grads_finite(), Some(true), "{name}");
    assert_eq!(applied_scale, scale);
    let gw = grads.get(&master.weight).as_vec();
    let gb = grads.get(&master.bias).as_vec();
    let kernel_grads = floats(&case["grads"]["kernel"]);
    let bias_grads = floats(&case["grads"]["bias"]);
    let gmax = kernel_grads
        .iter()
        .chain(&bias_grads)
        .fold(0f32, |m, v| m.max(v.abs()));
    for i in 0..I {
        for o in 0..O {
            let (a, b) = (gw[o * I + i], kernel_grads[i * O + o]);
            assert!(
                (a - b).abs() <= TOL_ULPS * gmax,
                "{name}: kernel grad [{i},{o}]: {a} vs {b}"
            );
        }
    }
    for (o, (a, b)) in gb.iter().zip(&bias_grads).enumerate() {
        assert!(
            (a - b).abs() <= TOL_ULPS * gmax,
            "{name}: bias grad {o}: {a} vs {b}"
        );
    }

    let worst_grad = (0..I)
        .flat_map(|i| (0..O).map(move |o| (i, o)))
        .map(|(i, o)| (gw[o * I + i] - kernel_grads[i * O + o]).abs())
        .chain(gb.iter().zip(&bias_grads).map(|(a, b)| (a - b).abs()))
        .fold(0f32, f32::max);
    eprintln!(
        "{name}: worst gradient difference {:.3e} of max|g| (bound 2^-7)",
        worst_grad / gmax
    );

    // The SGD update of the f32 master.
    assert!(
        scaler
            .update(&mut master, &mut opt, &grads)
            .unwrap()
            .is_applied()
    );
    let w_new = master.weight.as_vec();
    let b_new = master.bias.as_vec();
    let kernel_new = floats(&case["updated_params"]["kernel"]);
    let bias_new = floats(&case["updated_params"]["bias"]);
    let ptol = lr * TOL_ULPS * gmax;
    let kmax = kernel_new.iter().fold(0f32, |m, v| m.max(v.abs()));
    let bmax = bias_new.iter().fold(0f32, |m, v| m.max(v.abs()));
    for i in 0..I {
        for o in 0..O {
            let (a, b) = (w_new[o * I + i], kernel_new[i * O + o]);
            assert!(
                (a - b).abs() <= ptol && (a - b).abs() <= 1e-2 * kmax,
                "{name}: updated kernel [{i},{o}]: {a} vs {b}"
            );
        }
    }
    for (o, (a, b)) in b_new.iter().zip(&bias_new).enumerate() {
        assert!(
            (a - b).abs() <= ptol && (a - b).abs() <= 1e-2 * bmax,
            "{name}: updated bias {o}: {a} vs {b}"
        );
    }

    // Final loss: the bf16 forward at the new parameters.
    let out = scaler
        .forward(&master, x.clone().trace(master.alloc_grads()), |m, x| {
            m.forward(x)
        })
        .unwrap();
    let final_loss = mse_loss(out, y.clone()).array();
    let final_ref = floats(&case["final_loss"])[0];
    eprintln!(
        "{name}: final loss {final_loss} vs {final_ref} (rel {:.2e})",
        ((final_loss - final_ref) / final_ref).abs()
    );
    assert!(
        ((final_loss - final_ref) / final_ref).abs() <= TOL_ULPS,
        "{name}: final loss {final_loss} vs {final_ref}"
    );
}

#[test]
fn nnx_linear_step_every_case_in_emulated_bf16() {
    let data = load();
    let cases = data["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 3);
    let mut ran = 0;
    for case in cases {
        let shape = (
            case["inputs"]["d_in"].as_u64().unwrap(),
            case["inputs"]["d_out"].as_u64().unwrap(),
        );
        match shape {
            (4, 2) => run_case::<4, 2>(case),
            (16, 3) => run_case::<16, 3>(case),
            other => panic!("no dfdx Linear instantiated for {other:?}"),
        }
        ran += 1;
    }
    assert_eq!(ran, cases.len());
}
