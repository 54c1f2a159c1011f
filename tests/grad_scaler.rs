//! `GradScaler` and `#[mixed_step]` on the shapes real training code has: gradient
//! accumulation, clipping, a penalty on the parameters, several heads, integer inputs,
//! `try_forward`, overflow and skipping.

use dfdx::optim::{Adam, AdamConfig, Sgd, SgdConfig};
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::f16;
use mpx::scaling::{DynamicLossScale, NoOpLossScale, StaticLossScale};
use mpx::step::{
    Batch, GradScaler, Mixed, SkipReason, StepError, UpdateOutcome, clip_grad_norm, grad_norm,
};

mod common;

use common::mlp::{Mlp, Model, X, Y, batch};
use common::params::value_bits;

// ---- gradient accumulation ------------------------------------------------------------------

/// PyTorch's accumulation recipe: several micro-batches, one update, clipped by global norm on
/// the unscaled gradients. Returns the gradient norm before clipping.
#[mixed_step(scaling = scaler)]
fn accumulate(
    model: &mut Model,
    opt: &mut Adam<Model, f32, Cpu>,
    micro: &[(X, Y)],
    scaler: &mut GradScaler,
) -> f32 {
    let mut grads = model.alloc_grads();
    for (x, y) in micro {
        let out = model.forward(x.trace(grads));
        let loss = cross_entropy_with_logits_loss(out, y.clone()) / micro.len() as f32;
        grads = loss.backward();
    }
    let norm = clip_grad_norm(model, &mut grads, 1.0).unwrap();
    opt.update(model, &grads).unwrap();
    norm
}

/// The same in f32, as written before the conversion.
fn accumulate_f32(model: &mut Model, opt: &mut Adam<Model, f32, Cpu>, micro: &[(X, Y)]) -> f32 {
    let mut grads = model.alloc_grads();
    for (x, y) in micro {
        let out = model.forward(x.trace(grads));
        let loss = cross_entropy_with_logits_loss(out, y.clone()) / micro.len() as f32;
        grads = loss.backward();
    }
    let norm = clip_grad_norm(model, &mut grads, 1.0).unwrap();
    opt.update(model, &grads).unwrap();
    norm
}

#[test]
fn accumulated_micro_batches_match_f32_and_an_overflow_anywhere_skips_the_whole_update() {
    let dev = Cpu::seed_from_u64(0);
    let init = dev.build_module::<Mlp, f32>();
    let micro: Vec<(X, Y)> = (0..4).map(|k| batch(&dev, k)).collect();
    let cfg = AdamConfig {
        lr: 1e-2,
        ..Default::default()
    };

    // Matches f32: the gradient norm (computed on the unscaled f16 gradients) and the weights.
    let (mut m32, mut m16) = (init.clone(), init.clone());
    let (mut o32, mut o16) = (Adam::new(&m32, cfg), Adam::new(&m16, cfg));
    let mut scaler = GradScaler::new(DynamicLossScale::default());
    for _ in 0..5 {
        let n32 = accumulate_f32(&mut m32, &mut o32, &micro);
        let n16 = accumulate(&mut m16, &mut o16, &micro, &mut scaler);
        // f16 rounds inputs, weights and gradients to 11 bits: 1% covers it.
        assert!((n32 - n16).abs() <= 0.01 * n32, "norm f32 {n32} f16 {n16}");
    }
    assert_eq!(scaler.applied_steps(), 5);
    let w32 = m32.2.weight.as_vec();
    let w16 = m16.2.weight.as_vec();
    for (a, b) in w32.iter().zip(&w16) {
        assert!((a - b).abs() <= 2e-3 + 1e-2 * a.abs(), "{a} vs {b}");
    }

    // A NaN in any one micro-batch: the accumulated update is skipped, and nothing reaches the
    // master or the optimizer state (checked by the next clean step, which must equal a clean
    // step on a copy that never saw the bad batch).
    for bad in 0..micro.len() {
        let mut poisoned = micro.clone();
        let mut xs = poisoned[bad].0.array();
        xs[2][1] = f32::NAN;
        poisoned[bad].0 = dev.tensor(xs);
        let (mut tested, mut reference) = (m16.clone(), m16.clone());
        let (mut ot, mut or) = (o16.clone(), o16.clone());
        let (mut st, mut sr) = (GradScaler::default(), GradScaler::default());
        let before = value_bits(&tested);
        let _ = accumulate(&mut tested, &mut ot, &poisoned, &mut st);
        let last = st.last_step().unwrap();
        assert_eq!(
            last.outcome,
            UpdateOutcome::Skipped {
                reason: SkipReason::GradsNotFinite,
                consecutive: 1,
                total: 1
            }
        );
        assert_eq!(
            value_bits(&tested),
            before,
            "micro-batch {bad}: the master moved"
        );
        let _ = accumulate(&mut tested, &mut ot, &micro, &mut st);
        let _ = accumulate(&mut reference, &mut or, &micro, &mut sr);
        assert_eq!(
            value_bits(&tested),
            value_bits(&reference),
            "micro-batch {bad}: optimizer state moved"
        );
    }
}

// ---- a penalty on the parameters -------------------------------------------------------------

type Lin = <Linear<4, 3> as BuildOnDevice<Cpu, f32>>::Built;

#[mixed_step(scaling = scaler)]
fn penalised_step(
    model: &mut Lin,
    opt: &mut Sgd<Lin, f32, Cpu>,
    x: &X3,
    y: &Y3,
    scaler: &mut GradScaler<f16, StaticLossScale>,
) {
    let grads = model.alloc_grads();
    let out = model.forward(x.trace(grads));
    let penalty = model.weight.retaped::<OwnedTape<f32, Cpu>>().square().sum() * 0.5;
    let loss = mse_loss(out, y.clone()) + penalty;
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
}

fn penalised_step_f32(model: &mut Lin, opt: &mut Sgd<Lin, f32, Cpu>, x: &X3, y: &Y3) {
    let grads = model.alloc_grads();
    let out = model.forward(x.trace(grads));
    let penalty = model.weight.retaped::<OwnedTape<f32, Cpu>>().square().sum() * 0.5;
    let loss = mse_loss(out, y.clone()) + penalty;
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
}

type X3 = Tensor<Rank2<8, 4>, f32, Cpu>;
type Y3 = Tensor<Rank2<8, 3>, f32, Cpu>;

fn norm2(w: &[f32]) -> f32 {
    w.iter().map(|v| v * v).sum()
}

#[test]
fn a_penalty_on_the_weights_reaches_the_master() {
    let dev = Cpu::seed_from_u64(4);
    let init = dev.build_module::<Linear<4, 3>, f32>();
    let (x, y) = batch(&dev, 1);
    let y = y * 0.0; // only the penalty and the bias pull: |W|^2 must shrink
    let cfg = SgdConfig {
        lr: 0.1,
        momentum: None,
        weight_decay: None,
    };
    let (mut a, mut b) = (init.clone(), init.clone());
    let (mut oa, mut ob) = (Sgd::new(&a, cfg), Sgd::new(&b, cfg));
    let mut scaler = GradScaler::new(StaticLossScale::new(1024.0).unwrap());
    for _ in 0..20 {
        penalised_step_f32(&mut a, &mut oa, &x, &y);
        penalised_step(&mut b, &mut ob, &x, &y, &mut scaler);
    }
    let (n0, n32, n16) = (
        norm2(&init.weight.as_vec()),
        norm2(&a.weight.as_vec()),
        norm2(&b.weight.as_vec()),
    );
    println!("|W|^2: start {n0}, f32 {n32}, mixed {n16}");
    assert!(n32 < 0.5 * n0, "{n0} -> {n32}");
    assert!(
        (n16 - n32).abs() <= 0.02 * n32 + 1e-4,
        "mixed {n16} vs f32 {n32}"
    );
}

// ---- several heads, integer inputs, try_forward ----------------------------------------------

type Heads = SplitInto<(Linear<4, 2>, Linear<4, 3>)>;
type HeadsModel = <(Linear<4, 4>, Tanh, Heads) as BuildOnDevice<Cpu, f32>>::Built;

#[mixed_step(scaling = scaler)]
fn two_heads(
    model: &mut HeadsModel,
    opt: &mut Sgd<HeadsModel, f32, Cpu>,
    x: &X,
    scaler: &mut GradScaler,
) -> Result<f32, StepError> {
    let grads = model.try_alloc_grads()?;
    let (a, b) = model.try_forward(x.trace(grads))?;
    let loss = a.square().mean() + b.abs().mean();
    let value = loss.array();
    let grads = loss.try_backward()?;
    opt.update(model, &grads)?;
    Ok(value)
}

fn two_heads_f32(model: &mut HeadsModel, opt: &mut Sgd<HeadsModel, f32, Cpu>, x: &X) -> f32 {
    let grads = model.alloc_grads();
    let (a, b) = model.forward(x.trace(grads));
    let loss = a.square().mean() + b.abs().mean();
    let value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    value
}

#[test]
fn a_tuple_output_backpropagates_both_heads_through_the_shared_trunk() {
    let dev = Cpu::seed_from_u64(5);
    let init = dev.build_module::<(Linear<4, 4>, Tanh, Heads), f32>();
    let (x, _) = batch(&dev, 2);
    let cfg = SgdConfig {
        lr: 0.05,
        momentum: None,
        weight_decay: None,
    };
    let (mut a, mut b) = (init.clone(), init.clone());
    let (mut oa, mut ob) = (Sgd::new(&a, cfg), Sgd::new(&b, cfg));
    let mut scaler = GradScaler::new(DynamicLossScale::default());
    let mut identity = GradScaler::<f32, _>::new(NoOpLossScale);
    let mut c = init.clone();
    let mut oc = Sgd::new(&c, cfg);
    for _ in 0..10 {
        let l32 = two_heads_f32(&mut a, &mut oa, &x);
        let l16 = two_heads(&mut b, &mut ob, &x, &mut scaler).unwrap();
        assert!((l32 - l16).abs() <= 0.01 * l32 + 1e-3, "{l32} vs {l16}");
        two_heads_identity(&mut c, &mut oc, &x, &mut identity).unwrap();
    }
    // With an f32 working copy the trunk's gradients (from both heads) are exactly dfdx's.
    assert_eq!(value_bits(&c), value_bits(&a));
    assert_ne!(value_bits(&a), value_bits(&init));
}

#[mixed_step(scaling = scaler)]
fn two_heads_identity(
    model: &mut HeadsModel,
    opt: &mut Sgd<HeadsModel, f32, Cpu>,
    x: &X,
    scaler: &mut GradScaler<f32, NoOpLossScale>,
) -> Result<f32, StepError> {
    let grads = model.try_alloc_grads()?;
    let (a, b) = model.try_forward(x.trace(grads))?;
    let loss = a.square().mean() + b.abs().mean();
    let value = loss.array();
    let grads = loss.try_backward()?;
    opt.update(model, &grads)?;
    Ok(value)
}

type Tokens = <(Embedding<10, 6>, Linear<6, 2>) as BuildOnDevice<Cpu, f32>>::Built;

#[mixed_step(scaling = scaler, half = f16)]
fn token_step(
    model: &mut Tokens,
    opt: &mut Sgd<Tokens, f32, Cpu>,
    ids: &Tensor<Rank1<5>, usize, Cpu>,
    target: &Tensor<Rank2<5, 2>, f32, Cpu>,
    scaler: &mut GradScaler,
) -> f32 {
    let grads = model.alloc_grads();
    let out = model.forward(ids.trace(grads));
    let loss = mse_loss(out, target.clone());
    let value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    value
}

#[test]
fn integer_token_ids_stay_integers_and_the_embedding_learns() {
    let dev = Cpu::seed_from_u64(6);
    let mut model = dev.build_module::<(Embedding<10, 6>, Linear<6, 2>), f32>();
    let mut opt = Sgd::new(
        &model,
        SgdConfig {
            lr: 0.1,
            momentum: None,
            weight_decay: None,
        },
    );
    let ids = dev.tensor([1usize, 3, 3, 7, 9]);
    let target = dev.tensor([
        [1.0f32, 0.0],
        [0.0, 1.0],
        [0.0, 1.0],
        [1.0, 1.0],
        [0.5, 0.5],
    ]);
    let row0 = model.0.weight.array()[0];
    let first = token_step(
        &mut model,
        &mut opt,
        &ids,
        &target,
        &mut GradScaler::default(),
    );
    let mut scaler = GradScaler::default();
    let mut last = first;
    for _ in 0..30 {
        last = token_step(&mut model, &mut opt, &ids, &target, &mut scaler);
    }
    assert!(last < 0.5 * first, "{first} -> {last}");
    // Unused token 0 gets no gradient; used token 1 moved.
    assert_eq!(model.0.weight.array()[0], row0);
    assert_eq!(scaler.skipped_steps(), 0);
}

// ---- overflow and skipping ---------------------------------------------------------------------

#[mixed_step(scaling = scaler)]
fn plain_step(
    model: &mut Model,
    opt: &mut Adam<Model, f32, Cpu>,
    x: &X,
    y: &Y,
    scaler: &mut GradScaler,
) -> f32 {
    let grads = model.alloc_grads();
    let out = model.forward(x.trace(grads));
    let loss = cross_entropy_with_logits_loss(out, y.clone());
    let value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    value
}

#[test]
fn an_overflowing_scale_backs_off_and_skipped_steps_never_touch_the_master() {
    let dev = Cpu::seed_from_u64(7);
    let mut model = dev.build_module::<Mlp, f32>();
    let mut opt = Adam::new(&model, Default::default());
    let (x, y) = batch(&dev, 0);
    // 2^40 overflows f16 at once (its max is 65504): the first steps are skipped.
    let mut scaler = GradScaler::new(
        DynamicLossScale::builder()
            .initial(2f32.powi(40))
            .period(1000)
            .build()
            .unwrap(),
    );
    let mut skipped = 0;
    for _ in 0..40 {
        let before = value_bits(&model);
        let scale = scaler.loss_scale();
        plain_step(&mut model, &mut opt, &x, &y, &mut scaler);
        let last = scaler.last_step().unwrap();
        assert_eq!(last.scale, scale);
        if last.is_applied() {
            assert_ne!(value_bits(&model), before);
        } else {
            skipped += 1;
            assert_eq!(value_bits(&model), before);
            assert_eq!(last.new_scale, scale / 2.0);
        }
    }
    assert!(skipped >= 10, "{skipped}");
    assert_eq!(scaler.skipped_steps(), skipped);
    assert_eq!(scaler.applied_steps(), 40 - skipped);
    // Backed off far enough, training proceeds: the scale left is below where it started.
    assert!(scaler.loss_scale() < 2f32.powi(40) && scaler.last_step().unwrap().is_applied());
}

#[test]
fn too_many_consecutive_skips_is_an_error_and_changes_nothing() {
    let dev = Cpu::seed_from_u64(8);
    let mut model = Mixed::new(dev.build_module::<Mlp, f32>());
    let mut opt = Adam::new(&*model, Default::default());
    let mut scaler = GradScaler::<f16, _>::new(NoOpLossScale).with_max_consecutive_skips(2);
    let mut grads = model.alloc_grads();
    let x: X = dev.tensor([[f32::INFINITY; 4]; 8]);
    let before = value_bits(&*model);
    for k in 1..=3u64 {
        let out = scaler
            .forward(&model, x.trace(grads), |m, x| m.forward(x))
            .unwrap();
        grads = scaler.backward(out.square().mean()).unwrap();
        let r = scaler.update(&mut model, &mut opt, &grads);
        if k <= 2 {
            assert!(
                matches!(r, Ok(UpdateOutcome::Skipped { consecutive, .. }) if consecutive == k)
            );
        } else {
            let e = r.unwrap_err();
            assert!(
                matches!(
                    e,
                    StepError::TooManySkips {
                        consecutive: 3,
                        limit: 2,
                        ..
                    }
                ),
                "{e}"
            );
            assert!(
                e.to_string()
                    .contains("3 consecutive steps were skipped (limit 2)")
            );
        }
        model.zero_grads(&mut grads);
    }
    assert_eq!(value_bits(&*model), before);
    assert_eq!(grad_norm(&*model, &mut grads).unwrap(), 0.0);
}

/// A step of two models, each with its own loss: `a`'s gradients overflow at every iteration
/// (its loss is scaled up by `1e4` on top of the loss scale), `b`'s never do.
#[mixed_step(scaling = scaler)]
fn one_stuck<L: mpx::scaling::LossScale>(
    a: &mut Model,
    b: &mut Model,
    (oa, ob): &mut (Sgd<Model, f32, Cpu>, Sgd<Model, f32, Cpu>),
    x: &X,
    scaler: &mut GradScaler<f16, L>,
) {
    let ga = (a.forward(x.trace(a.alloc_grads())) * 1e4)
        .square()
        .mean()
        .backward();
    oa.update(a, &ga).unwrap();
    let gb = b
        .forward(x.trace(b.alloc_grads()))
        .square()
        .mean()
        .backward();
    ob.update(b, &gb).unwrap();
}

/// One model skipped at every iteration while the other trains: its skips are counted in a row
/// (the other's applied updates do not start the count over), so a static scale that always
/// overflows it stops the run after 20 iterations (`ScaleStuck`, through the step's `unwrap`),
/// and a limit of 2 at its third (`TooManySkips`); it was never trained, the other was. Both ran
/// on for ever without a word.
#[test]
fn a_model_skipped_at_every_iteration_while_another_trains_stops_the_run() {
    let dev = Cpu::seed_from_u64(9);
    let (x, _) = batch(&dev, 0);
    for (limit, at, says) in [
        (
            None,
            20,
            "20 steps in a row were skipped and the loss scale (1024) could not back off",
        ),
        (Some(2), 3, "3 consecutive steps were skipped (limit 2)"),
    ] {
        let (mut a, mut b) = (
            dev.build_module::<Mlp, f32>(),
            dev.build_module::<Mlp, f32>(),
        );
        let (a0, b0) = (value_bits(&a), value_bits(&b));
        let mut opts = (
            Sgd::new(&a, Default::default()),
            Sgd::new(&b, Default::default()),
        );
        let mut scaler = GradScaler::new(StaticLossScale::new(1024.0).unwrap());
        if let Some(limit) = limit {
            scaler = scaler.with_max_consecutive_skips(limit);
        }
        let mut iterations = 0;
        let stop = loop {
            iterations += 1;
            assert!(iterations <= 100, "no error after 100 iterations");
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                one_stuck(&mut a, &mut b, &mut opts, &x, &mut scaler);
            }));
            if let Err(payload) = run {
                break payload.downcast::<String>().map(|s| *s).unwrap_or_default();
            }
        };
        assert!(stop.contains(says), "{stop}");
        assert_eq!(iterations, at);
        assert_eq!(value_bits(&a), a0, "the stuck model changed");
        assert_ne!(value_bits(&b), b0, "the other model did not train");
    }
}

// ---- batch norm ---------------------------------------------------------------------------------

type Bn = <(Linear<4, 4>, BatchNorm1D<4>, Linear<4, 3>) as BuildOnDevice<Cpu, f32>>::Built;

#[mixed_step(scaling = scaler)]
fn bn_step(
    model: &mut Bn,
    opt: &mut Sgd<Bn, f32, Cpu>,
    x: &X,
    y: &Y,
    scaler: &mut GradScaler<f32, NoOpLossScale>,
) {
    let grads = model.alloc_grads();
    let out = model.forward_mut(x.trace(grads));
    let grads = mse_loss(out, y.clone()).backward();
    opt.update(model, &grads).unwrap();
}

fn bn_step_f32(model: &mut Bn, opt: &mut Sgd<Bn, f32, Cpu>, x: &X, y: &Y) {
    let grads = model.alloc_grads();
    let out = model.forward_mut(x.trace(grads));
    let grads = mse_loss(out, y.clone()).backward();
    opt.update(model, &grads).unwrap();
}

#[test]
fn batch_norm_running_statistics_reach_the_master() {
    let dev = Cpu::seed_from_u64(9);
    let init = dev.build_module::<(Linear<4, 4>, BatchNorm1D<4>, Linear<4, 3>), f32>();
    let (x, y) = batch(&dev, 3);
    let cfg = SgdConfig::default();
    let (mut a, mut b) = (init.clone(), init.clone());
    let (mut oa, mut ob) = (Sgd::new(&a, cfg), Sgd::new(&b, cfg));
    let mut scaler = GradScaler::<f32, _>::new(NoOpLossScale);
    for _ in 0..3 {
        bn_step_f32(&mut a, &mut oa, &x, &y);
        bn_step(&mut b, &mut ob, &x, &y, &mut scaler);
    }
    assert_ne!(a.1.running_mean.as_vec(), init.1.running_mean.as_vec());
    assert_eq!(value_bits(&b), value_bits(&a));
}

type BnParts = (
    Sgd<<(Linear<4, 4>, BatchNorm1D<4>) as BuildOnDevice<Cpu, f32>>::Built, f32, Cpu>,
    Sgd<<Linear<4, 3> as BuildOnDevice<Cpu, f32>>::Built, f32, Cpu>,
);
type BnNested = <((Linear<4, 4>, BatchNorm1D<4>), Linear<4, 3>) as BuildOnDevice<Cpu, f32>>::Built;

/// Micro-batches accumulated into one update, each pass in training mode: a model updated whole,
/// and one updated part by part.
#[mixed_step(scaling = scaler)]
fn bn_accumulated(
    whole: &mut Bn,
    opt: &mut Sgd<Bn, f32, Cpu>,
    parted: &mut BnNested,
    (ot, oh): &mut BnParts,
    xs: &[X],
    scaler: &mut GradScaler,
) {
    let mut grads = whole.alloc_grads();
    for x in xs {
        grads = whole.forward_mut(x.trace(grads)).square().mean().backward();
    }
    opt.update(whole, &grads).unwrap();
    let mut grads = parted.alloc_grads();
    for x in xs {
        grads = parted
            .forward_mut(x.trace(grads))
            .square()
            .mean()
            .backward();
    }
    ot.update(&mut parted.0, &grads).unwrap();
    oh.update(&mut parted.1, &grads).unwrap();
}

fn bn_accumulated_f32(m: &mut Bn, opt: &mut Sgd<Bn, f32, Cpu>, xs: &[X]) {
    let mut grads = m.alloc_grads();
    for x in xs {
        grads = m.forward_mut(x.trace(grads)).square().mean().backward();
    }
    opt.update(m, &grads).unwrap();
}

/// Each micro-batch of an accumulation moves batch norm's running statistics on, as in f32:
/// the update writes what the last pass left, which started from what the one before left. Each
/// pass used to start from the master's statistics, so only the last micro-batch counted (the
/// statistics 15% off the f32 twin's, normwise, after three).
#[test]
fn accumulated_micro_batches_each_move_the_running_statistics_on() {
    let dev = Cpu::seed_from_u64(12);
    let init = dev.build_module::<(Linear<4, 4>, BatchNorm1D<4>, Linear<4, 3>), f32>();
    let xs: Vec<X> = (0..3)
        .map(|k| dev.sample_normal::<Rank2<8, 4>>() + k as f32)
        .collect();
    let (mut m32, mut whole) = (init.clone(), init.clone());
    let mut parted = dev.build_module::<((Linear<4, 4>, BatchNorm1D<4>), Linear<4, 3>), f32>();
    (parted.0.0, parted.0.1, parted.1) = (init.0.clone(), init.1.clone(), init.2.clone());
    let (mut o32, mut opt) = (
        Sgd::new(&m32, Default::default()),
        Sgd::new(&whole, Default::default()),
    );
    let mut parts = (
        Sgd::new(&parted.0, Default::default()),
        Sgd::new(&parted.1, Default::default()),
    );
    let mut scaler = GradScaler::default();
    bn_accumulated_f32(&mut m32, &mut o32, &xs);
    bn_accumulated(
        &mut whole,
        &mut opt,
        &mut parted,
        &mut parts,
        &xs,
        &mut scaler,
    );
    let want = [m32.1.running_mean.as_vec(), m32.1.running_var.as_vec()].concat();
    for (what, bn) in [("whole", &whole.1), ("parts", &parted.0.1)] {
        let got = [bn.running_mean.as_vec(), bn.running_var.as_vec()].concat();
        let err = common::compare::rel(&got, &want);
        assert!(
            err < 1e-2,
            "{what}: running statistics {err} from the f32 twin's"
        );
    }
    // statistics written into the master in place between two passes (a checkpoint) win over
    // what the pass before left, as in f32
    let mut mixed = Mixed::mapped(init.clone());
    let mut m32 = init.clone();
    let (mut o16, mut o32) = (
        Sgd::new(&*mixed, Default::default()),
        Sgd::new(&m32, Default::default()),
    );
    let (mut grads, mut g32) = (mixed.alloc_grads(), m32.alloc_grads());
    for (k, x) in xs.iter().enumerate() {
        if k == 2 {
            let restored: Vec<f32> = (0..4u8).map(f32::from).collect();
            mixed.1.running_mean.copy_from(&restored);
            m32.1.running_mean.copy_from(&restored);
        }
        let y = scaler
            .forward_mut(&mut mixed, x.trace(grads), |m, x| m.forward_mut(x))
            .unwrap();
        grads = scaler.backward(y.square().mean()).unwrap();
        g32 = m32.forward_mut(x.trace(g32)).square().mean().backward();
    }
    let outcome = scaler.update(&mut mixed, &mut o16, &grads).unwrap();
    assert!(outcome.is_applied());
    o32.update(&mut m32, &g32).unwrap();
    for (what, got, want) in [
        ("mean", &mixed.1.running_mean, &m32.1.running_mean),
        ("variance", &mixed.1.running_var, &m32.1.running_var),
    ] {
        let err = common::compare::rel(&got.as_vec(), &want.as_vec());
        assert!(
            err < 1e-2,
            "restored in place: running {what} {err} from f32's"
        );
    }
}

// ---- a forward staged over several calls ----------------------------------------------------

type Staged = <(Linear<4, 8>, Tanh, Linear<8, 3>) as BuildOnDevice<Cpu, f32>>::Built;

#[mixed_step(scaling = scaler)]
fn staged(
    model: &mut Staged,
    opt: &mut Sgd<Staged, f32, Cpu>,
    x: &X,
    y: &Y,
    scaler: &mut GradScaler<f16, NoOpLossScale>,
) -> f32 {
    let grads = model.alloc_grads();
    let h = model.0.forward(x.trace(grads));
    let h = h.tanh() * 2.0; // f32 glue between the stages
    let out = model.2.forward(h);
    let loss = mse_loss(out, y.clone());
    let value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    value
}

#[mixed_step(scaling = scaler)]
fn staged_identity(
    model: &mut Staged,
    opt: &mut Sgd<Staged, f32, Cpu>,
    x: &X,
    y: &Y,
    scaler: &mut GradScaler<f32, NoOpLossScale>,
) -> f32 {
    let grads = model.alloc_grads();
    let h = model.0.forward(x.trace(grads));
    let h = h.tanh() * 2.0;
    let out = model.2.forward(h);
    let loss = mse_loss(out, y.clone());
    let value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    value
}

fn staged_f32(model: &mut Staged, opt: &mut Sgd<Staged, f32, Cpu>, x: &X, y: &Y) -> f32 {
    let grads = model.alloc_grads();
    let h = model.0.forward(x.trace(grads));
    let h = h.tanh() * 2.0;
    let out = model.2.forward(h);
    let loss = mse_loss(out, y.clone());
    let value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    value
}

#[test]
fn a_staged_forward_chains_its_gradients_through_f32_glue() {
    let dev = Cpu::seed_from_u64(10);
    let init = dev.build_module::<(Linear<4, 8>, Tanh, Linear<8, 3>), f32>();
    let (x, y) = batch(&dev, 4);
    let cfg = SgdConfig {
        lr: 0.1,
        momentum: None,
        weight_decay: None,
    };
    let (mut a, mut b, mut c) = (init.clone(), init.clone(), init.clone());
    let (mut oa, mut ob, mut oc) = (Sgd::new(&a, cfg), Sgd::new(&b, cfg), Sgd::new(&c, cfg));
    let (mut sb, mut sc) = (
        GradScaler::new(NoOpLossScale),
        GradScaler::new(NoOpLossScale),
    );
    for _ in 0..10 {
        let l32 = staged_f32(&mut a, &mut oa, &x, &y);
        let l16 = staged(&mut b, &mut ob, &x, &y, &mut sb);
        assert!((l32 - l16).abs() <= 0.01 * l32 + 1e-3, "{l32} vs {l16}");
        staged_identity(&mut c, &mut oc, &x, &y, &mut sc);
    }
    // The first stage learned too (its gradient came through the second stage and the glue).
    assert_ne!(b.0.weight.as_vec(), init.0.weight.as_vec());
    assert_eq!(value_bits(&c), value_bits(&a));
}

// ---- a model built from mpx's own layers ---------------------------------------------------

type MpxMlp = (
    mpx::nn::builders::LinearReLU<4, 16>,
    mpx::nn::builders::Linear<16, 3>,
);
type MpxModel = <MpxMlp as BuildOnDevice<Cpu, f32>>::Built;

#[mixed_step(scaling = scaler)]
fn mpx_layers_step(
    model: &mut MpxModel,
    opt: &mut Adam<MpxModel, f32, Cpu>,
    x: &X,
    y: &Y,
    scaler: &mut GradScaler,
) -> f32 {
    let grads = model.alloc_grads();
    let out = model.forward(x.trace(grads));
    let loss = cross_entropy_with_logits_loss(out, y.clone());
    let value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    value
}

fn mpx_layers_f32(model: &mut MpxModel, opt: &mut Adam<MpxModel, f32, Cpu>, x: &X, y: &Y) -> f32 {
    let grads = model.alloc_grads();
    let out = model.forward(x.trace(grads));
    let loss = cross_entropy_with_logits_loss(out, y.clone());
    let value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    value
}

#[test]
fn a_model_of_mpx_layers_trains_through_the_attribute() {
    let dev = Cpu::seed_from_u64(11);
    let init = dev.build_module::<MpxMlp, f32>();
    let cfg = AdamConfig {
        lr: 1e-2,
        ..Default::default()
    };
    let (mut a, mut b) = (init.clone(), init.clone());
    let (mut oa, mut ob) = (Adam::new(&a, cfg), Adam::new(&b, cfg));
    let (x, y) = batch(&dev, 5);
    let mut scaler = GradScaler::default();
    let (mut l32, mut l16) = (Vec::new(), Vec::new());
    for _ in 0..30 {
        l32.push(mpx_layers_f32(&mut a, &mut oa, &x, &y));
        l16.push(mpx_layers_step(&mut b, &mut ob, &x, &y, &mut scaler));
    }
    let (a_last, b_last) = (l32[29], l16[29]);
    assert!(
        a_last < 0.9 * l32[0] && b_last < 0.9 * l16[0],
        "{l32:?} {l16:?}"
    );
    assert!(
        (a_last - b_last).abs() <= 0.02 * a_last + 1e-3,
        "f32 {a_last} vs f16 {b_last}"
    );
    assert_eq!(scaler.applied_steps() + scaler.skipped_steps(), 30);
}

/// One step of `model` on a batch traced by `trace`; returns the batch's gradient when the
/// gradients kept it.
fn traced_step(
    model: &mut MpxModel,
    x: &X,
    y: &Y,
    trace: impl FnOnce(&X, &MpxModel) -> Tensor<Rank2<8, 4>, f32, Cpu, OwnedTape<f32, Cpu>>,
    keeps_input: bool,
) -> Option<Vec<f32>> {
    let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(256.0).unwrap());
    let mut opt = Sgd::new(
        &*model,
        SgdConfig {
            lr: 0.1,
            momentum: None,
            weight_decay: None,
        },
    );
    let mut mixed = Mixed::new(model.clone());
    let input = trace(x, model);
    let out = if keeps_input {
        scaler.forward(&mixed, input, |m, x| m.forward(x))
    } else {
        scaler.forward(&mixed, Batch(input), |m, x| m.forward(x))
    }
    .unwrap();
    let grads = scaler
        .backward(cross_entropy_with_logits_loss(out, y.clone()))
        .unwrap();
    let gx = keeps_input.then(|| grads.get(x).as_vec());
    scaler.update(&mut mixed, &mut opt, &grads).unwrap();
    *model = mixed.into_inner();
    gx
}

#[test]
fn the_batchs_gradient_is_computed_where_it_can_be_read_and_the_master_learns_the_same_either_way()
{
    let dev = Cpu::seed_from_u64(12);
    let plain = dev.build_module::<Mlp, f32>();
    let init: MpxModel = ((plain.0.clone(), ReLU).into(), plain.2.clone().into());
    let (x, y) = batch(&dev, 1);
    // The reference: dfdx's f32 gradient of the same loss with respect to the batch.
    let out = plain.forward(x.leaky_trace());
    let g32 = cross_entropy_with_logits_loss(out, y.clone())
        .backward()
        .get(&x)
        .as_vec();
    let (mut kept, mut dropped) = (init.clone(), init.clone());
    // A leaky tape keeps every gradient: the batch's is computed, in f16, unscaled.
    let gx = traced_step(&mut kept, &x, &y, |x, _| x.leaky_trace(), true).unwrap();
    let top = g32.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(top > 0.0);
    for (a, b) in gx.iter().zip(&g32) {
        assert!((a - b).abs() <= 1e-2 * top, "{gx:?} vs {g32:?}");
    }
    // `alloc_grads` keeps only the model's: the batch's is left out, and the step is the same.
    traced_step(&mut dropped, &x, &y, |x, m| x.trace(m.alloc_grads()), false);
    assert_eq!(value_bits(&dropped), value_bits(&kept));
    assert_ne!(value_bits(&kept), value_bits(&init));
}
