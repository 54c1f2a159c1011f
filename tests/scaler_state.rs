//! The state object cannot go silently wrong: each test here failed before its fix (a second
//! model trained through a used scaler never moved; a second update of the same gradients
//! applied again; a batch whose gradients the step threw away still skipped the next one), and
//! a checkpointed scaler resumes bit for bit.

use dfdx::optim::{Sgd, SgdConfig};
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::{bf16, f16};
use mpx::scaling::{DynamicLossScale, StaticLossScale};
use mpx::step::{GradScaler, Mixed, ScalerState, SkipReason, StepError, UpdateOutcome};

mod common;
use common::mlp::{Mlp, Model, X, Y, batch};
use common::params::{load, value_bits, values};

fn sgd(m: &Model) -> Sgd<Model, f32, Cpu> {
    Sgd::new(
        m,
        SgdConfig {
            lr: 0.1,
            momentum: None,
            weight_decay: None,
        },
    )
}

/// One epoch, as a dfdx user writes it.
#[mixed_step(scaling = scaler)]
fn epoch(
    model: &mut Model,
    opt: &mut Sgd<Model, f32, Cpu>,
    data: &[(X, Y)],
    scaler: &mut GradScaler<f16, StaticLossScale>,
) {
    let mut grads = model.alloc_grads();
    for (x, y) in data {
        let out = model.forward(x.clone().traced(grads));
        let loss = cross_entropy_with_logits_loss(out, y.clone());
        grads = loss.backward();
        opt.update(model, &grads).unwrap();
        model.zero_grads(&mut grads);
    }
}

#[test]
fn a_second_model_through_a_used_scaler_trains_as_with_its_own() {
    let dev = Cpu::seed_from_u64(1);
    let data: Vec<(X, Y)> = (0..5).map(|k| batch(&dev, k)).collect();
    let scale = || StaticLossScale::new(1024.0).unwrap();
    let mut shared = GradScaler::<f16, _>::new(scale());
    // fold 1
    let mut a = dev.build_module::<Mlp, f32>();
    let mut oa = sgd(&a);
    epoch(&mut a, &mut oa, &data, &mut shared);
    // fold 2: a new model, the same scaler (declared once, outside the folds)
    let b0 = dev.build_module::<Mlp, f32>();
    let (mut b, mut b_alone) = (b0.clone(), b0.clone());
    let (mut ob, mut ob_alone) = (sgd(&b), sgd(&b_alone));
    epoch(&mut b, &mut ob, &data, &mut shared);
    epoch(
        &mut b_alone,
        &mut ob_alone,
        &data,
        &mut GradScaler::new(scale()),
    );
    assert_ne!(
        value_bits(&b),
        value_bits(&b0),
        "the second model did not train"
    );
    assert_eq!(value_bits(&b), value_bits(&b_alone));
    assert_eq!(shared.applied_steps(), 10);
}

#[test]
fn a_second_update_of_the_same_gradients_is_an_error_and_changes_nothing() {
    let dev = Cpu::seed_from_u64(2);
    let mut model = Mixed::new(dev.build_module::<Mlp, f32>());
    let mut opt = sgd(&model);
    let mut scaler = GradScaler::<f16>::default();
    let (x, y) = batch(&dev, 0);
    let out = scaler
        .forward(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x))
        .unwrap();
    let grads = scaler.backward(mse_loss(out, y)).unwrap();
    assert!(
        scaler
            .update(&mut model, &mut opt, &grads)
            .unwrap()
            .is_applied()
    );
    let once = value_bits(&*model);
    for _ in 0..2 {
        let err = scaler.update(&mut model, &mut opt, &grads).unwrap_err();
        assert!(matches!(err, StepError::NoBackward { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("each update needs its own backward pass")
        );
    }
    assert_eq!(value_bits(&*model), once);
    assert_eq!(scaler.applied_steps(), 1);
}

#[test]
fn an_update_of_a_model_no_forward_pass_ran_is_an_error() {
    let dev = Cpu::seed_from_u64(3);
    let model = Mixed::new(dev.build_module::<Mlp, f32>());
    // a clone of the model: its own master, whatever its tensors share with the original
    let mut other = model.clone();
    let mut opt = sgd(&other);
    let mut scaler = GradScaler::<f16>::default();
    let (x, y) = batch(&dev, 0);
    let out = scaler
        .forward(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x))
        .unwrap();
    let grads = scaler.backward(mse_loss(out, y)).unwrap();
    let before = value_bits(&*other);
    let err = scaler.update(&mut other, &mut opt, &grads).unwrap_err();
    assert!(matches!(err, StepError::UnknownMaster { .. }), "{err}");
    assert_eq!(value_bits(&*other), before);
}

/// The f32 idiom of skipping a bad batch by hand: zero the gradients and return.
#[mixed_step(scaling = scaler)]
fn guarded_step(
    model: &mut Model,
    opt: &mut Sgd<Model, f32, Cpu>,
    grads: Gradients<f32, Cpu>,
    x: X,
    y: Y,
    scaler: &mut GradScaler,
) -> (f32, Gradients<f32, Cpu>) {
    let out = model.forward(x.traced(grads));
    let loss = mse_loss(out, y);
    let l = loss.array();
    let mut grads = loss.backward();
    if !l.is_finite() {
        model.zero_grads(&mut grads);
        return (l, grads);
    }
    opt.update(model, &grads).unwrap();
    model.zero_grads(&mut grads);
    (l, grads)
}

#[test]
fn gradients_thrown_away_by_zero_grads_do_not_skip_the_next_batch() {
    let dev = Cpu::seed_from_u64(4);
    let mut model = dev.build_module::<Mlp, f32>();
    let mut opt = sgd(&model);
    let mut scaler = GradScaler::default();
    let grads = model.alloc_grads();
    let (x, y) = batch(&dev, 0);
    // a NaN target: the loss is NaN whatever the layers do with NaN (a ReLU maps it to 0, as
    // dfdx's f32 `ReLU` and mpx's fused one do)
    let mut bad = y.as_vec();
    bad[5] = f32::NAN;
    let bad = dev.tensor_from_vec(bad, *y.shape());
    let before = value_bits(&model);
    let (l, grads) = guarded_step(&mut model, &mut opt, grads, x.clone(), bad, &mut scaler);
    assert!(l.is_nan());
    assert_eq!(value_bits(&model), before);
    let (l, _) = guarded_step(&mut model, &mut opt, grads, x, y, &mut scaler);
    assert!(l.is_finite());
    assert_eq!(
        scaler.last_step().unwrap().outcome,
        UpdateOutcome::Applied,
        "the finite batch was judged on the thrown-away gradients"
    );
    assert_ne!(value_bits(&model), before);
}

#[test]
fn two_masters_each_skip_on_their_own_gradients_and_the_scale_moves_once() {
    let dev = Cpu::seed_from_u64(5);
    let mut actor = Mixed::new(dev.build_module::<Mlp, f32>());
    let mut critic = Mixed::new(dev.build_module::<Mlp, f32>());
    let (mut oa, mut oc) = (sgd(&actor), sgd(&critic));
    let mut scaler =
        GradScaler::<f16>::new(DynamicLossScale::builder().initial(1024.0).build().unwrap());
    let (x, y) = batch(&dev, 1);
    let bad: X = dev.tensor([[f32::INFINITY; 4]; 8]);
    let critic_before = value_bits(&*critic);
    let a = scaler
        .forward(&actor, x.trace(actor.alloc_grads()), |m, x| m.forward(x))
        .unwrap();
    let c = scaler
        .forward(&critic, bad.trace(critic.alloc_grads()), |m, x| {
            m.forward(x)
        })
        .unwrap();
    let ga = scaler.backward(mse_loss(a, y.clone())).unwrap();
    let gc = scaler.backward(mse_loss(c, y)).unwrap();
    assert!(
        scaler
            .update(&mut actor, &mut oa, &ga)
            .unwrap()
            .is_applied()
    );
    assert!(matches!(
        scaler.update(&mut critic, &mut oc, &gc).unwrap(),
        UpdateOutcome::Skipped {
            reason: SkipReason::GradsNotFinite,
            ..
        }
    ));
    assert_eq!(value_bits(&*critic), critic_before);
    // one iteration with a skip: the scale backs off once, not once per master
    assert_eq!(scaler.loss_scale(), 512.0);
}

#[test]
fn a_checkpoint_round_trips_and_bad_ones_are_rejected() {
    let scaler = GradScaler::<f16>::new(
        DynamicLossScale::builder()
            .initial(2048.0)
            .period(7)
            .build()
            .unwrap(),
    )
    .with_max_consecutive_skips(3);
    let json = serde_json::to_value(&scaler).unwrap();
    let back: GradScaler<f16> = serde_json::from_value(json.clone()).unwrap();
    assert_eq!(back.state_dict(), scaler.state_dict());
    assert_eq!(back.max_consecutive_skips(), Some(3));
    let reject = |edit: &dyn Fn(&mut serde_json::Value), why: &str| {
        let mut bad = json.clone();
        edit(&mut bad);
        let err = serde_json::from_value::<GradScaler<f16>>(bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains(why), "{err} (wanted {why})");
    };
    reject(&|v| v["surprise"] = 1.into(), "unknown field");
    reject(
        &|v| {
            v.as_object_mut().unwrap().remove("max_consecutive_skips");
        },
        "missing field",
    );
    reject(
        &|v| v["consecutive_skips"] = 5.into(),
        "more than skipped_steps",
    );
    reject(
        &|v| {
            v["skipped_steps"] = 9.into();
            v["consecutive_skips"] = 9.into();
        },
        "past max_consecutive_skips",
    );
    reject(&|v| v["loss_scale"]["scale"] = (-1.0).into(), "");
    // a checkpoint of another precision
    let err = serde_json::from_value::<GradScaler<bf16>>(json)
        .unwrap_err()
        .to_string();
    assert!(err.contains("runs in `bfloat16`"), "{err}");
    let state: ScalerState<DynamicLossScale> = scaler.state_dict();
    assert_eq!(state.precision, "float16");
}

#[test]
fn a_run_restored_from_a_checkpoint_continues_bit_for_bit() {
    let dev = Cpu::seed_from_u64(6);
    let data: Vec<(X, Y)> = (0..12).map(|k| batch(&dev, k)).collect();
    // starts past f16's range so the scale backs off, then grows every 3 finite steps
    let scaling = || {
        DynamicLossScale::builder()
            .initial(2f32.powi(30))
            .period(3)
            .build()
            .unwrap()
    };
    let init = dev.build_module::<Mlp, f32>();

    #[mixed_step(scaling = scaler)]
    fn steps(
        model: &mut Model,
        opt: &mut Sgd<Model, f32, Cpu>,
        data: &[(X, Y)],
        scaler: &mut GradScaler,
    ) -> Vec<f32> {
        let mut grads = model.alloc_grads();
        let mut scales = Vec::new();
        for (x, y) in data {
            let out = model.forward(x.clone().traced(grads));
            grads = mse_loss(out, y.clone()).backward();
            opt.update(model, &grads).unwrap();
            model.zero_grads(&mut grads);
            scales.push(scaler.loss_scale());
        }
        scales
    }

    let mut whole = init.clone();
    let mut opt = sgd(&whole);
    let mut s = GradScaler::new(scaling());
    let want_scales = steps(&mut whole, &mut opt, &data, &mut s);
    assert!(s.skipped_steps() > 0, "the run should show a back-off");

    let mut first = init.clone();
    let mut opt = sgd(&first);
    let mut s = GradScaler::new(scaling());
    let mut scales = steps(&mut first, &mut opt, &data[..6], &mut s);
    let saved_scaler = serde_json::to_string(&s).unwrap();
    let saved_model = values(&first);
    drop((first, s));

    // a new process: new tensors, a new optimizer (plain SGD keeps no state), the scaler read back
    let mut resumed = dev.build_module::<Mlp, f32>();
    load(&mut resumed, &saved_model);
    let mut opt = sgd(&resumed);
    let mut s: GradScaler = serde_json::from_str(&saved_scaler).unwrap();
    scales.extend(steps(&mut resumed, &mut opt, &data[6..], &mut s));
    assert_eq!(scales, want_scales);
    assert_eq!(value_bits(&resumed), value_bits(&whole));
}
