//! The mixed-precision step: mixed gradients, skip-on-overflow updates, non-parameter state, bad
//! input. Each check compares against a plain f32 dfdx computation or against exact arithmetic.

use dfdx::{optim::*, prelude::*};
use mpx::precision::{AMP, bf16, f16};
use mpx::scaling::{DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale};
use mpx::step::{GradScaler, Mixed, SkipReason, StepError, UpdateOutcome};
use proptest::prelude::*;

mod common;
use common::params::value_bits;

type Mlp = (Linear<8, 16>, ReLU, Linear<16, 4>);
type MlpF32 = <Mlp as BuildOnDevice<Cpu, f32>>::Built;

/// Every gradient of a model's trainable tensors, as bits, in walk order.
fn grad_bits(m: &MlpF32, g: &Gradients<f32, Cpu>) -> Vec<u32> {
    common::bits::bits(&common::grads::param_grads(m, g).concat())
}

/// JAX mpx's `filter_value_and_grad(func, scaling)(model, batch)`, written with the scaler's two
/// calls: the batch `$x` (f32) through `$master`'s forward pass, `$loss` on its f32 output;
/// returns `(loss, gradients, grads_finite, applied scale)`.
macro_rules! value_and_grad {
    // `mut`: a pass that may change the model (`forward_mut`)
    (mut $scaler:expr, $master:expr, $($rest:tt)*) => {
        value_and_grad!(@forward_mut &mut $master; $scaler, $master, $($rest)*)
    };
    ($scaler:expr, $master:expr, $($rest:tt)*) => {
        value_and_grad!(@forward &$master; $scaler, $master, $($rest)*)
    };
    (@$method:ident $borrow:expr; $scaler:expr, $master:expr, $x:expr, |$m:ident, $xx:ident| $fwd:expr, |$o:ident| $loss:expr) => {{
        let applied = $scaler.loss_scale();
        let grads = $master.alloc_grads();
        let $o = $scaler
            .$method($borrow, $x.trace(grads), |$m, $xx| $fwd)
            .unwrap();
        let loss = $loss;
        let value = loss.array();
        let grads = $scaler.backward(loss).unwrap();
        (value, grads, $master.grads_finite().unwrap(), applied)
    }};
}

fn batch(dev: &Cpu) -> (Tensor<Rank2<5, 8>, f32, Cpu>, Tensor<Rank2<5, 4>, f32, Cpu>) {
    let x = dev.sample_normal();
    let y = dev.sample_normal::<Rank2<5, 4>>().softmax::<Axis<1>>();
    (x, y)
}

/// With an f32 working copy and scale 1 the machinery adds no rounding: gradients and the
/// parameters after three Adam steps equal plain dfdx bit for bit.
#[test]
fn f32_working_copy_with_scale_one_is_bit_identical_to_plain_f32() {
    let dev = Cpu::seed_from_u64(1);
    let mut master = Mixed::new(dev.build_module::<Mlp, f32>());
    let mut plain = master.clone().into_inner();
    let cfg = AdamConfig {
        lr: 1e-2,
        ..Default::default()
    };
    let mut opt = Adam::new(&*master, cfg);
    let mut opt_plain = Adam::new(&plain, cfg);
    let mut scaler = GradScaler::<f32, _>::new(StaticLossScale::new(1.0).unwrap());
    let mut plain_grads = plain.alloc_grads();
    for step in 0..3 {
        let (x, y) = batch(&dev);
        let out = plain.forward(x.clone().traced(plain_grads));
        plain_grads = cross_entropy_with_logits_loss(out, y.clone()).backward();
        let plain_loss = cross_entropy_with_logits_loss(plain.forward(x.clone()), y.clone());

        let (loss, grads, finite, _) =
            value_and_grad!(scaler, master, x.clone(), |m, x| m.forward(x), |out| {
                cross_entropy_with_logits_loss(out, y.clone())
            });
        assert!(finite, "step {step}");
        assert_eq!(
            loss.to_bits(),
            plain_loss.array().to_bits(),
            "loss, step {step}"
        );
        assert_eq!(
            grad_bits(&master, &grads),
            grad_bits(&plain, &plain_grads),
            "gradients, step {step}"
        );
        let outcome = scaler.update(&mut master, &mut opt, &grads).unwrap();
        assert_eq!(outcome, UpdateOutcome::Applied);
        opt_plain.update(&mut plain, &plain_grads).unwrap();
        plain.zero_grads(&mut plain_grads);
        assert_eq!(
            value_bits(&*master),
            value_bits(&plain),
            "parameters after step {step}"
        );
    }
}

/// Gradients around 1e-8 vanish in f16 (its smallest subnormal is 2^-24 = 6e-8); a scale of
/// 2^16 brings them back within 1e-3 relative of f32.
#[test]
fn tiny_gradients_vanish_in_f16_and_come_back_with_scale_2_pow_16() {
    let dev = Cpu::seed_from_u64(2);
    let master = Mixed::new(dev.build_module::<Linear<4, 3>, f32>());
    // Inputs exactly representable in f16, so only the gradient path rounds.
    let x32 = dev.tensor([[0.75f32, -1.25, 2.5, 0.3125]]);
    let tiny = |out: Tensor<Rank2<1, 3>, f32, Cpu, OwnedTape<f32, Cpu>>| out.sum() * 1e-8;

    // f32 reference: plain dfdx.
    let reference = tiny(master.forward(x32.leaky_trace())).backward();
    let w_ref = reference.get(&master.weight).as_vec();
    let b_ref = reference.get(&master.bias).as_vec();
    assert!(w_ref.iter().all(|v| v.abs() > 2e-9 && v.abs() < 3e-8));

    let mut unscaled_scaler = GradScaler::<f16, _>::new(NoOpLossScale);
    let (_, unscaled, finite, _) = value_and_grad!(
        unscaled_scaler,
        master,
        x32.clone(),
        |m, x| m.forward(x),
        |o| tiny(o)
    );
    assert!(finite);
    let w0 = unscaled.get(&master.weight).as_vec();
    let b0 = unscaled.get(&master.bias).as_vec();
    assert!(w0.iter().chain(&b0).all(|&v| v == 0.0), "{w0:?} {b0:?}");

    let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(65536.0).unwrap());
    let (_, scaled, finite, applied) =
        value_and_grad!(scaler, master, x32.clone(), |m, x| m.forward(x), |o| tiny(
            o
        ));
    assert!(finite);
    assert_eq!(applied, 65536.0);
    let w = scaled.get(&master.weight).as_vec();
    let b = scaled.get(&master.bias).as_vec();
    for (got, want) in w.iter().zip(&w_ref).chain(b.iter().zip(&b_ref)) {
        assert!(
            ((got - want) / want).abs() <= 1e-3,
            "got {got:e}, f32 gives {want:e}"
        );
    }
}

/// Starting at 2^30 the scaled output gradient overflows f16: the first steps are skipped with
/// the master unchanged while the scale halves each time; once it fits, training proceeds.
#[test]
fn start_at_two_pow_30_skips_and_halves_until_the_scale_fits() {
    let dev = Cpu::seed_from_u64(3);
    let mut master = Mixed::new(dev.build_module::<Mlp, f32>());
    let initial = value_bits(&*master);
    let mut opt = Sgd::new(
        &*master,
        SgdConfig {
            lr: 0.1,
            momentum: None,
            weight_decay: None,
        },
    );
    let mut scaler = GradScaler::<f16, _>::new(
        DynamicLossScale::builder()
            .initial(2f32.powi(30))
            .period(1000)
            .build()
            .unwrap(),
    );
    let (x, y) = batch(&dev);
    let mut skipped = 0u64;
    let mut losses = vec![];
    for step in 0..60 {
        let (loss, grads, finite, applied) =
            value_and_grad!(scaler, master, x.clone(), |m, x| m.forward(x), |o| {
                cross_entropy_with_logits_loss(o, y.clone())
            });
        assert_eq!(applied, scaler.loss_scale(), "step {step}");
        let outcome = scaler.update(&mut master, &mut opt, &grads).unwrap();
        // the scale is adjusted by the update: the report holds the one applied and the next
        let report = scaler.last_step().unwrap();
        assert_eq!(
            (report.scale, report.grads_finite, report.outcome),
            (applied, finite, outcome),
            "step {step}"
        );
        let new = report.new_scale;
        assert_eq!(new, scaler.loss_scale(), "step {step}");
        if step == skipped as usize && !finite {
            skipped += 1;
            assert_eq!(new, applied / 2.0, "step {step}: the scale halves");
            assert_eq!(
                value_bits(&*master),
                initial,
                "step {step}: master unchanged"
            );
            assert_eq!(
                outcome,
                UpdateOutcome::Skipped {
                    reason: SkipReason::GradsNotFinite,
                    consecutive: skipped,
                    total: skipped
                }
            );
        } else {
            assert!(finite, "step {step}: no overflow once the scale fits");
            assert_eq!(outcome, UpdateOutcome::Applied);
            assert_eq!(new, applied, "no growth within the period");
            losses.push(loss);
        }
    }
    // 2^30 times an O(0.1) output gradient is far above 65504: several skips, then the scale fits.
    assert!(skipped >= 10, "only {skipped} skips");
    assert_eq!(scaler.loss_scale(), 2f32.powi(30 - skipped as i32));
    assert_eq!(
        (scaler.skipped_steps(), scaler.applied_steps()),
        (skipped, 60 - skipped)
    );
    assert_ne!(value_bits(&*master), initial);
    // Soft targets: the loss is bounded below by their entropy, so "proceeds" means it falls.
    assert!(
        losses.windows(2).all(|w| w[1] < w[0]),
        "training proceeds: {losses:?}"
    );
}

/// A batch containing NaN is a skipped step, counted and reported; nothing is lost, and the
/// next good batch trains normally. The optional limit turns a run of skips into an error that
/// names the count and the scale.
#[test]
fn nan_batch_is_a_counted_skip_and_the_limit_is_an_error() {
    let dev = Cpu::seed_from_u64(4);
    let mut master = Mixed::new(dev.build_module::<Mlp, f32>());
    let mut opt = Adam::new(&*master, AdamConfig::default());
    let mut scaler =
        GradScaler::<f16, _>::new(DynamicLossScale::builder().initial(1024.0).build().unwrap())
            .with_max_consecutive_skips(2);
    let (x, y) = batch(&dev);
    let mut bad = x.as_vec();
    bad[7] = f32::NAN;
    let bad = dev.tensor_from_vec(bad, (Const::<5>, Const::<8>));
    let good = x.clone();
    let initial = value_bits(&*master);

    let mut run = |input: &Tensor<Rank2<5, 8>, f32, Cpu>,
                   master: &mut Mixed<MlpF32>|
     -> (Result<UpdateOutcome, StepError>, f32) {
        let (loss, grads, _, _) =
            value_and_grad!(scaler, *master, input.clone(), |m, x| m.forward(x), |o| {
                cross_entropy_with_logits_loss(o, y.clone())
            });
        (scaler.update(master, &mut opt, &grads), loss)
    };

    for k in 1..=2u64 {
        let (outcome, loss) = run(&bad, &mut master);
        assert!(loss.is_nan());
        assert_eq!(
            outcome.unwrap(),
            UpdateOutcome::Skipped {
                reason: SkipReason::GradsNotFinite,
                consecutive: k,
                total: k
            }
        );
        assert_eq!(value_bits(&*master), initial);
    }
    let (third, _) = run(&bad, &mut master);
    match third {
        Err(e @ StepError::TooManySkips { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("3 consecutive steps"), "{msg}");
            assert!(msg.contains("limit 2"), "{msg}");
            assert!(msg.contains("loss scale is now 128"), "{msg}");
        }
        other => panic!("expected TooManySkips, got {other:?}"),
    }
    assert_eq!(
        value_bits(&*master),
        initial,
        "an error changes nothing either"
    );
    let (ok, loss) = run(&good, &mut master);
    assert_eq!(ok.unwrap(), UpdateOutcome::Applied);
    assert!(loss.is_finite());
    assert_ne!(value_bits(&*master), initial);
    assert_eq!(
        (
            scaler.skipped_steps(),
            scaler.consecutive_skips(),
            scaler.applied_steps()
        ),
        (3, 0, 1)
    );
}

/// An infinite loss with finite gradients (the loss closure returns inf) is skipped too.
#[test]
fn infinite_loss_is_skipped() {
    let dev = Cpu::seed_from_u64(5);
    let mut master = Mixed::new(dev.build_module::<Linear<2, 1>, f32>());
    let before = master.weight.as_vec();
    let mut opt = Sgd::new(&*master, Default::default());
    let mut scaler = GradScaler::<f16, _>::new(NoOpLossScale);
    let x = dev.tensor([[1.0f32, 2.0]]);
    let (loss, grads, finite, _) = value_and_grad!(
        scaler,
        master,
        x.clone(),
        |m, x| m.forward(x),
        // d/dout of (out * 0 + inf) is 0: finite gradients, infinite loss.
        |o| (o * 0.0).sum() + f32::INFINITY
    );
    assert!(finite && !loss.is_finite());
    let outcome = scaler.update(&mut master, &mut opt, &grads).unwrap();
    assert!(matches!(
        outcome,
        UpdateOutcome::Skipped {
            reason: SkipReason::LossNotFinite,
            ..
        }
    ));
    assert_eq!(master.weight.as_vec(), before);
}

/// A scale that is not finite and positive is a `Result` error, not a panic.
#[test]
fn invalid_scale_is_an_error() {
    struct Broken(f32);
    impl LossScale for Broken {
        fn loss_scale(&self) -> f32 {
            self.0
        }
        fn adjust(&mut self, _: bool) {}
    }
    let dev = Cpu::default();
    let master = Mixed::new(dev.build_module::<Linear<2, 1>, f32>());
    let x = dev.tensor([[1.0f32, 2.0]]);
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let mut scaler = GradScaler::<f16, _>::new(Broken(bad));
        let r = scaler.forward(&master, x.clone().trace(master.alloc_grads()), |m, x| {
            m.forward(x)
        });
        match r {
            Err(e @ StepError::InvalidScale { .. }) => {
                assert!(e.to_string().contains("finite and greater than 0"))
            }
            Err(e) => panic!("{bad}: unexpected error {e}"),
            Ok(_) => panic!("{bad}: accepted"),
        }
    }
}

/// An update of a master whose forward pass never ran through the scaler is an error naming
/// the cause, not a panic; so are gradients computed for one master and applied to another that
/// did run (the optimizer finds none of its own tensors in them).
#[test]
fn gradients_of_another_master_are_an_error() {
    let dev = Cpu::default();
    let a = Mixed::new(dev.build_module::<Linear<2, 1>, f32>());
    let mut b = Mixed::new(dev.build_module::<Linear<2, 1>, f32>());
    let b_before = b.weight.as_vec();
    let mut opt = Sgd::new(&*b, Default::default());
    let mut scaler = GradScaler::<f16, _>::new(NoOpLossScale);
    let x = dev.tensor([[1.0f32, 2.0]]);
    let (_, g, _, _) = value_and_grad!(scaler, a, x.clone(), |m, x| m.forward(x), |o| o.sum());
    match scaler.update(&mut b, &mut opt, &g) {
        Err(e @ StepError::UnknownMaster { .. }) => {
            assert!(e.to_string().contains("no forward pass"), "{e}");
        }
        other => panic!("expected an unknown-master error, got {other:?}"),
    }
    // `b` runs its own step, but is handed `a`'s gradients.
    let _ = value_and_grad!(scaler, b, x.clone(), |m, x| m.forward(x), |o| o.sum());
    match scaler.update(&mut b, &mut opt, &g) {
        Err(e @ StepError::Optimizer(_)) => {
            assert!(e.to_string().contains("unused"), "{e}");
        }
        other => panic!("expected an optimizer error, got {other:?}"),
    }
    assert_eq!(b.weight.as_vec(), b_before);
}

/// Batch-norm running statistics that the half forward pass updates reach the master after a
/// finite step (within f16 rounding of the f32 statistics), and stay put after a skipped one.
#[test]
fn batch_norm_running_statistics_reach_the_master() {
    type Bn = (Linear<4, 6>, BatchNorm1D<6>, ReLU, Linear<6, 2>);
    let dev = Cpu::seed_from_u64(6);
    let mut master = Mixed::new(dev.build_module::<Bn, f32>());
    let mut reference = master.clone().into_inner();
    let mut opt = Sgd::new(&*master, Default::default());
    let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(256.0).unwrap());
    let x: Tensor<Rank2<8, 4>, f32, Cpu> = dev.sample_normal::<Rank2<8, 4>>() * 2.0 + 1.0;
    let (_, g, finite, _) = value_and_grad!(
        mut scaler,
        master,
        x.clone(),
        |m, x| m.forward_mut(x),
        |o| o.square().mean()
    );
    assert!(finite);
    scaler.update(&mut master, &mut opt, &g).unwrap();
    let _ = reference.forward_mut(x.leaky_trace());
    let (mean, var) = (
        master.1.running_mean.as_vec(),
        master.1.running_var.as_vec(),
    );
    let (mean_ref, var_ref) = (
        reference.1.running_mean.as_vec(),
        reference.1.running_var.as_vec(),
    );
    assert!(mean_ref.iter().any(|&m| m.abs() > 1e-2), "statistics moved");
    for (got, want) in mean.iter().zip(&mean_ref).chain(var.iter().zip(&var_ref)) {
        assert!(
            (got - want).abs() <= 2e-3 * want.abs().max(1.0),
            "{got} vs {want}"
        );
    }

    // A NaN batch: skipped, and the (NaN) statistics of the working copy are not copied back.
    let mut bad = x.as_vec();
    bad[0] = f32::NAN;
    let bad = dev.tensor_from_vec(bad, (Const::<8>, Const::<4>));
    let (_, g, _, _) = value_and_grad!(
        mut scaler,
        master,
        bad.clone(),
        |m, x| m.forward_mut(x),
        |o| o.square().mean()
    );
    assert!(
        !scaler
            .update(&mut master, &mut opt, &g)
            .unwrap()
            .is_applied()
    );
    assert_eq!(master.1.running_mean.as_vec(), mean);
    assert_eq!(master.1.running_var.as_vec(), var);
}

/// Trains the MLP in `$h` on a working copy made with `Mixed::$kind` (see the test below; a
/// macro: rustc 1.95 rejects a generic `K: Kind<H, (A, B, C), Cpu>` bound with a tuple model).
macro_rules! train_in {
    ($h:ty, $kind:ident, $tolerance:expr) => {{
        type H = $h;
        let tolerance: f32 = $tolerance;

        let dev = Cpu::seed_from_u64(7);
        let mut master = Mixed::$kind(dev.build_module::<Mlp, f32>());
        let (x, y) = batch(&dev);
        let reference =
            cross_entropy_with_logits_loss(master.forward(x.leaky_trace()), y.clone()).backward();
        let mut opt = Sgd::new(&*master, Default::default());
        let mut scaler =
            GradScaler::<H, _>::new(DynamicLossScale::builder().initial(4096.0).build().unwrap());
        let mut losses = vec![];
        for step in 0..20 {
            let (loss, grads, finite, _) =
                value_and_grad!(scaler, master, x.clone(), |m, x| m.forward(x), |o| {
                    cross_entropy_with_logits_loss(o, y.clone())
                });
            assert!(finite);
            if step == 0 {
                let got = grads.get(&master.0.weight).as_vec();
                let want = reference.get(&master.0.weight).as_vec();
                let max = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (a, b) in got.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= tolerance * max,
                        "{} {a} vs {b}",
                        <H as mpx::precision::Precision>::DTYPE
                    );
                }
            }
            losses.push(loss);
            scaler.update(&mut master, &mut opt, &grads).unwrap();
        }
        assert!(
            losses[19] < losses[0],
            "{} {losses:?}",
            <H as mpx::precision::Precision>::DTYPE
        );
    }};
}

/// AMP<f16> and emulated bf16 working copies train the same model: finite gradients close to
/// f32's and a falling loss.
#[test]
fn amp_and_emulated_bf16_working_copies_train() {
    // f16 keeps 11 significant bits, bf16 8: a few roundings along the path, relative to the
    // largest gradient.
    // (emulated bf16 runs mpx's layers: dfdx's compute in f32)
    train_in!(AMP<f16>, new, 4e-3);
    train_in!(bf16, mapped, 3e-2);
}

// ---- property test: injected inf/NaN never changes master or optimizer state ---------------

#[derive(Debug, Clone, Copy)]
enum Opt {
    Sgd,
    Adam,
    RmsProp,
}

fn any_opt() -> impl Strategy<Value = Opt> {
    prop_oneof![Just(Opt::Sgd), Just(Opt::Adam), Just(Opt::RmsProp)]
}

fn bad_value() -> impl Strategy<Value = f32> {
    prop_oneof![
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        Just(-f32::NAN)
    ]
}

/// Runs `warmup` finite steps, one step whose output gradient carries `bad` at `pos`, then a
/// finite step on both the model and a twin copied before the bad step. Master bits must be
/// unchanged by the bad step, and the twin (same optimizer state as before the bad step) must
/// end bit-identical: so the skipped step touched no optimizer state (Adam's count, moments,
/// momentum buffers).
fn check_injection<O: Optimizer<MlpF32, Cpu, f32> + Clone>(
    mut opt: O,
    seed: u64,
    warmup: usize,
    pos: usize,
    bad: f32,
    scale: f32,
) -> Result<(), TestCaseError> {
    let dev = Cpu::seed_from_u64(seed);
    let mut master = Mixed::new(dev.build_module::<Mlp, f32>());
    let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(scale).unwrap());
    let (x, y) = batch(&dev);
    let mut step = |master: &mut Mixed<MlpF32>, opt: &mut O, inject: Option<(usize, f32)>| {
        let mut w = vec![1.0f32; 20];
        if let Some((p, v)) = inject {
            w[p] = v;
        }
        let w = dev.tensor_from_vec(w, (Const::<5>, Const::<4>));
        let (_, grads, _, _) =
            value_and_grad!(scaler, *master, x.clone(), |m, x| m.forward(x), |o| {
                cross_entropy_with_logits_loss(o * w, y.clone())
            });
        let outcome = scaler.update(master, opt, &grads).unwrap();
        // The finite step's gradients, for the twin.
        (outcome, grads)
    };
    for _ in 0..warmup {
        prop_assert!(step(&mut master, &mut opt, None).0.is_applied());
    }
    let mut twin = master.clone().into_inner();
    let mut twin_opt = opt.clone();
    let before = value_bits(&*master);
    let (outcome, _) = step(&mut master, &mut opt, Some((pos, bad)));
    prop_assert!(!outcome.is_applied(), "{outcome:?}");
    prop_assert_eq!(value_bits(&*master), before.clone());
    let (outcome, grads) = step(&mut master, &mut opt, None);
    prop_assert!(outcome.is_applied());
    twin_opt.update(&mut twin, &grads).unwrap();
    prop_assert_ne!(value_bits(&*master), before);
    prop_assert_eq!(value_bits(&*master), value_bits(&twin));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn injected_non_finite_gradients_never_change_master_or_optimizer_state(
        which in any_opt(),
        seed in 0u64..1000,
        warmup in 0usize..3,
        pos in 0usize..20,
        bad in bad_value(),
        scale_exp in 0i32..12,
    ) {
        let scale = 2f32.powi(scale_exp);
        let dev = Cpu::default();
        let shape_model = dev.build_module::<Mlp, f32>();
        match which {
            Opt::Sgd => check_injection(
                Sgd::new(&shape_model, SgdConfig { lr: 0.05, momentum: Some(Momentum::Nesterov(0.9)), weight_decay: None }),
                seed, warmup, pos, bad, scale)?,
            Opt::Adam => check_injection(Adam::new(&shape_model, AdamConfig::default()), seed, warmup, pos, bad, scale)?,
            Opt::RmsProp => check_injection(
                RMSprop::new(&shape_model, RMSpropConfig { momentum: Some(0.5), centered: true, ..Default::default() }),
                seed, warmup, pos, bad, scale)?,
        }
    }
}
