//! What trains is the user's model: each forward pass's working copy is the master as it is
//! then, with every setting it holds; layers called one by one compute what the user's code
//! says; clones, evaluation passes and thrown-away gradients behave as in f32; values nobody
//! checked before are errors. Each test failed before the change that made it pass.
//!
//! Tolerance: a few layers in f16 round every value a handful of times (`2^-11` relative each)
//! with f32 sums in between: results within `2^-7` of the largest magnitude of the f32 result,
//! parameters after a few SGD steps within 1% (normwise) of the f32 twin's.

use dfdx::nn::modules::{BatchNorm1D, Dropout, LayerNorm1D};
use dfdx::nn::tensor_collection::{ModuleVisitor, ScalarOptions, TensorCollection, TensorOptions};
use dfdx::{optim::*, prelude::*};
use mpx::mixed_step;
use mpx::precision::{DType, f16};
use mpx::scaling::{DynamicLossScale, StaticLossScale};
use mpx::step::{
    GradScaler, Mapped, Mixed, MixedPart, Plain, ScalerState, StepError, clip_grad_norm,
};

mod common;
use common::compare::rel;
use common::params::{load, value_bits, values};

// ---- a module of the user's own, with settings that are not tensors ----------------------------

/// A user's module: a weight of its own, dfdx's layer norm, batch norm and dropout, a head,
/// and a temperature (an `f32` field, registered with dfdx as a scalar). The derive and the
/// attribute on its `Module` impls give its working copy mpx's layers.
#[derive(Debug, Clone, mpx::HalfLayers)]
struct Net<E: Dtype, D: Device<E>> {
    w1: Tensor<Rank2<4, 8>, E, D>,
    ln: LayerNorm1D<8, E, D>,
    bn: BatchNorm1D<8, E, D>,
    drop: Dropout,
    w2: Tensor<Rank2<8, 3>, E, D>,
    temp: f32,
}

impl<E: Dtype, D: Device<E>> TensorCollection<E, D> for Net<E, D> {
    type To<E2: Dtype, D2: Device<E2>> = Net<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            (
                Self::tensor(
                    "w1",
                    |s| &s.w1,
                    |s| &mut s.w1,
                    TensorOptions::reset_to_ones(),
                ),
                Self::module("ln", |s| &s.ln, |s| &mut s.ln),
                Self::module("bn", |s| &s.bn, |s| &mut s.bn),
                Self::module("drop", |s| &s.drop, |s| &mut s.drop),
                Self::tensor(
                    "w2",
                    |s| &s.w2,
                    |s| &mut s.w2,
                    TensorOptions::reset_to_ones(),
                ),
                Self::scalar(
                    "temp",
                    |s| &s.temp,
                    |s| &mut s.temp,
                    ScalarOptions::from_default(1.0),
                ),
            ),
            |(w1, ln, bn, drop, w2, temp)| Net {
                w1,
                ln,
                bn,
                drop,
                w2,
                temp,
            },
        )
    }
}

/// Training: batch norm on the batch's statistics (and updating its running ones), dropout on.
#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> ModuleMut<Tensor<Rank2<6, 4>, E, D, OwnedTape<E, D>>> for Net<E, D> {
    type Output = Tensor<Rank2<6, 3>, E, D, OwnedTape<E, D>>;
    type Error = D::Err;
    fn try_forward_mut(
        &mut self,
        x: Tensor<Rank2<6, 4>, E, D, OwnedTape<E, D>>,
    ) -> Result<Self::Output, D::Err> {
        let h = self.ln.try_forward(x.try_matmul(self.w1.clone())?)?;
        let h = self.drop.try_forward_mut(self.bn.try_forward_mut(h)?)?;
        let t = E::from_f32(1.0 / self.temp).expect("a finite temperature");
        h.try_matmul(self.w2.clone())?.try_mul(t)
    }
}

/// Evaluation: running statistics, no dropout.
#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> Module<Tensor<Rank2<6, 4>, E, D>> for Net<E, D> {
    type Output = Tensor<Rank2<6, 3>, E, D>;
    type Error = D::Err;
    fn try_forward(&self, x: Tensor<Rank2<6, 4>, E, D>) -> Result<Self::Output, D::Err> {
        let h = self
            .bn
            .try_forward(self.ln.try_forward(x.try_matmul(self.w1.clone())?)?)?;
        let t = E::from_f32(1.0 / self.temp).expect("a finite temperature");
        self.drop
            .try_forward(h)?
            .try_matmul(self.w2.clone())?
            .try_mul(t)
    }
}

type NetF32 = Net<f32, Cpu>;
type X6 = Tensor<Rank2<6, 4>, f32, Cpu>;
type Y6 = Tensor<Rank2<6, 3>, f32, Cpu>;

/// A `Net` with its settings away from dfdx's defaults (or at them, with `defaults`).
fn net(dev: &Cpu, p: f32, defaults: bool) -> NetF32 {
    let mut n = Net::<f32, Cpu> {
        w1: dev.sample_normal() * 0.5,
        ln: BuildModule::build(dev),
        bn: BuildModule::build(dev),
        drop: Dropout { p },
        w2: dev.sample_normal() * 0.35,
        temp: 1.0,
    };
    if !defaults {
        n.ln.epsilon = 0.5;
        n.bn.epsilon = 0.25;
        n.bn.momentum = 0.4;
        n.temp = 4.0;
    }
    n
}

fn batch(k: u64) -> (X6, Y6) {
    let dev = Cpu::seed_from_u64(100 + k);
    let x: X6 = dev.sample_normal();
    let y: Y6 = dev.sample_normal::<Rank2<6, 3>>().softmax::<Axis<1>>();
    (x, y)
}

#[mixed_step(scaling = scaler)]
fn net_step(
    model: &mut NetF32,
    opt: &mut Sgd<NetF32, f32, Cpu>,
    x: &X6,
    y: &Y6,
    scaler: &mut GradScaler,
) {
    let out = model.forward_mut(x.trace(model.alloc_grads()));
    let grads = cross_entropy_with_logits_loss(out, y.clone()).backward();
    opt.update(model, &grads).unwrap();
}

fn net_step_f32(model: &mut NetF32, opt: &mut Sgd<NetF32, f32, Cpu>, x: &X6, y: &Y6) {
    let out = model.forward_mut(x.trace(model.alloc_grads()));
    let grads = cross_entropy_with_logits_loss(out, y.clone()).backward();
    opt.update(model, &grads).unwrap();
}

fn sgd(m: &NetF32) -> Sgd<NetF32, f32, Cpu> {
    Sgd::new(
        m,
        SgdConfig {
            lr: 0.1,
            ..Default::default()
        },
    )
}

/// Five steps of `init` in f32 and through `#[mixed_step]`: (f32 values, mixed values).
fn five_steps(init: &NetF32) -> (Vec<f32>, Vec<f32>, GradScaler) {
    let (mut a, mut b) = (init.clone(), init.clone());
    let (mut oa, mut ob) = (sgd(&a), sgd(&b));
    let mut scaler = GradScaler::default();
    for k in 0..5 {
        let (x, y) = batch(k);
        net_step_f32(&mut a, &mut oa, &x, &y);
        net_step(&mut b, &mut ob, &x, &y, &mut scaler);
    }
    (values(&a), values(&b), scaler)
}

#[test]
fn a_users_module_keeps_its_settings_in_the_working_copy_and_sees_a_change_at_once() {
    let dev = Cpu::seed_from_u64(1);
    let mut model = Mixed::new(net(&dev, 0.2, false));
    let mut scaler = GradScaler::<f16>::default();
    let (x, _) = batch(0);
    let mut seen = None;
    scaler
        .forward(&model, x.clone(), |m, x| {
            seen = Some((m.drop.p, m.ln.epsilon, m.bn.epsilon, m.bn.momentum, m.temp));
            m.forward(x)
        })
        .unwrap();
    assert_eq!(seen, Some((0.2, 0.5, 0.25, 0.4, 4.0)));
    // a schedule changes the master's settings between two passes: the next pass has them
    model.drop.p = 0.35;
    model.temp = 2.0;
    scaler
        .forward(&model, x.clone(), |m, x| {
            seen = Some((m.drop.p, m.ln.epsilon, m.bn.epsilon, m.bn.momentum, m.temp));
            m.forward(x)
        })
        .unwrap();
    assert_eq!(seen, Some((0.35, 0.5, 0.25, 0.4, 2.0)));
    // the same settings in the working copy of mpx's layers (`#[derive(HalfLayers)]`)
    let mapped = Mixed::mapped(model.into_inner());
    scaler
        .forward(&mapped, x, |m, x| {
            seen = Some((m.drop.p, m.ln.epsilon, m.bn.epsilon, m.bn.momentum, m.temp));
            m.forward(x)
        })
        .unwrap();
    assert_eq!(seen, Some((0.35, 0.5, 0.25, 0.4, 2.0)));
}

#[test]
fn a_users_module_with_its_own_settings_trains_like_its_f32_twin() {
    // dropout off: the f32 and the half pass draw their masks in different types
    let dev = Cpu::seed_from_u64(2);
    let (f32_run, mixed, scaler) = five_steps(&net(&dev, 0.0, false));
    let last = scaler.last_step().unwrap();
    assert_eq!(
        last.precision,
        DType::Float16,
        "the step ran in {}",
        last.precision
    );
    assert_eq!(scaler.applied_steps(), 5);
    let err = rel(&mixed, &f32_run);
    println!("mixed vs f32 after 5 steps: {err:e}");
    assert!(err < 1e-2, "mixed vs f32 after 5 steps: {err:e}");
    // the settings matter: the same model at dfdx's defaults ends far from the twin
    let dev = Cpu::seed_from_u64(2);
    let (defaults, _, _) = five_steps(&net(&dev, 0.0, true));
    let apart = rel(&defaults, &f32_run);
    println!("defaults vs f32: {apart:e}");
    assert!(
        apart > 10.0 * err,
        "the settings moved the result by {apart:e} only (mixed error {err:e})"
    );
}

// ---- fusion is invisible ---------------------------------------------------------------------

type Mlp = (Linear<12, 24>, ReLU, Linear<24, 5>, Tanh);
type Normed = (
    Linear<12, 24>,
    dfdx::nn::builders::LayerNorm1D<24>,
    Linear<24, 5>,
    Tanh,
);
type Gated = (
    Linear<12, 24>,
    Sigmoid,
    Residual<(Linear<24, 24>, ReLU)>,
    Linear<24, 5>,
);

/// A literal in the element type a closure body computes in.
trait Lit {
    fn lit(v: f32) -> Self;
}
impl Lit for f32 {
    fn lit(v: f32) -> Self {
        v
    }
}
impl Lit for f16 {
    fn lit(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// `got` within `2^-7` of the largest magnitude of `want`, entry by entry.
fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-3);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= scale / 128.0,
            "{what}[{i}]: {g} vs {w} (scale {scale})"
        );
    }
}

/// Layer by layer with ops between them, mapped onto mpx's layers, against the same code in
/// f32: output and gradients.
macro_rules! one_by_one {
    ($arch:ty, $seed:expr, |$m:ident, $x:ident, $half:ident| $body:expr) => {{
        let dev = Cpu::seed_from_u64($seed);
        let init = dev.build_module::<$arch, f32>();
        let x: Tensor<Rank2<7, 12>, f32, Cpu> = dev.sample_normal();
        // f32
        let $m = &init;
        let $x = x.trace(init.alloc_grads());
        type $half = f32;
        let out: Tensor<Rank2<7, 5>, f32, Cpu, _> = $body;
        let want = out.retaped::<NoneTape>().as_vec();
        let g32 = out.sum().backward();
        // mixed, on the mapped working copy
        let model = Mixed::mapped(init.clone());
        // a scale whose gradients stay inside f16's range
        let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(64.0).unwrap());
        let out = scaler
            .forward(&model, x.trace(model.alloc_grads()), |$m, $x| {
                type $half = f16;
                $body
            })
            .unwrap();
        let got = out.retaped::<NoneTape>().as_vec();
        let gh = scaler.backward(out.sum()).unwrap();
        (
            got,
            want,
            common::grads::param_grads(&*model, &gh).concat(),
            common::grads::param_grads(&init, &g32).concat(),
        )
    }};
}

#[test]
fn layers_called_one_by_one_compute_what_the_users_code_says() {
    // `relu(l0(x) + 0.5)`: a ReLU fused into the linear layer before it would give
    // `relu(relu(l0(x)) + 0.5)`, 0.5 wherever l0(x) < 0
    let (got, want, gh, g32) = one_by_one!(Mlp, 3, |m, x, T| {
        let h = m.0.forward(x) + T::lit(0.5);
        m.3.forward(m.2.forward(m.1.forward(h) * T::lit(2.0)))
    });
    assert_close("Mlp output", &got, &want);
    assert_close("Mlp gradients", &gh, &g32);
    // the linear layer's output read before its ReLU, negative values and all
    let (got, want, gh, g32) = one_by_one!(Mlp, 4, |m, x, _T| {
        let (z, tape) = m.0.forward(x).split_tape();
        let skip = z.clone().negate();
        m.3.forward(m.2.forward(m.1.forward(z.put_tape(tape)) + skip))
    });
    assert_close("Mlp pre-activation output", &got, &want);
    assert_close("Mlp pre-activation gradients", &gh, &g32);
    // a layer norm between the linear layers, with an op in between
    let (got, want, gh, g32) = one_by_one!(Normed, 5, |m, x, T| {
        let h = m.1.forward(m.0.forward(x) * T::lit(3.0));
        m.3.forward(m.2.forward(h))
    });
    assert_close("Normed output", &got, &want);
    assert_close("Normed gradients", &gh, &g32);
    // a sigmoid read before and after, a residual block and the layers inside it
    let (got, want, gh, g32) = one_by_one!(Gated, 6, |m, x, T| {
        let (z, tape) = m.0.forward(x).split_tape();
        let s = m.1.forward(z.clone().put_tape(tape)) - z * T::lit(0.25);
        let r = m.2.forward(s);
        let (r, tape) = r.split_tape();
        let inner = m.2.0.1.forward(m.2.0.0.forward(r.clone().put_tape(tape)));
        m.3.forward(inner + r)
    });
    assert_close("Gated output", &got, &want);
    assert_close("Gated gradients", &gh, &g32);
}

// ---- clones and evaluation -------------------------------------------------------------------

type Q = (Linear<4, 16>, ReLU, Linear<16, 2>);
type QNet = <Q as BuildOnDevice<Cpu, f32>>::Built;
type X8 = Tensor<Rank2<8, 4>, f32, Cpu>;

/// A DQN step: the target network (a clone of the online one) gives the targets without a
/// tape, the online network trains on them.
fn dqn_targets(target: &QNet, x: &X8, r: f32) -> Tensor<Rank2<8, 2>, f32, Cpu> {
    target.forward(x.clone()) + r
}

#[test]
fn a_target_network_cloned_from_the_master_stays_put_and_the_online_one_trains_like_f32() {
    let dev = Cpu::seed_from_u64(6);
    let init = dev.build_module::<Q, f32>();
    // f32
    let (mut online32, target32) = (init.clone(), init.clone());
    let mut opt32 = Sgd::new(&online32, SgdConfig::default());
    // mixed: one scaler, the online model and a clone of it as the target
    let mut online = Mixed::mapped(init.clone());
    let target = online.clone();
    let mut opt = Sgd::new(&*online, SgdConfig::default());
    let mut scaler = GradScaler::<f16>::default();
    let target_before = values(&*target);
    for k in 0..4 {
        let x: X8 = Cpu::seed_from_u64(k).sample_normal();
        let want = dqn_targets(&target32, &x, 1.0);
        let q = online32.forward(x.trace(online32.alloc_grads()));
        let g = mse_loss(q, want).backward();
        opt32.update(&mut online32, &g).unwrap();

        let half_targets = scaler
            .forward(&target, x.clone(), |m, x| m.forward(x))
            .unwrap()
            + 1.0;
        let q = scaler
            .forward(&online, x.trace(online.alloc_grads()), |m, x| m.forward(x))
            .unwrap();
        let g = scaler.backward(mse_loss(q, half_targets)).unwrap();
        assert!(
            scaler
                .update(&mut online, &mut opt, &g)
                .unwrap()
                .is_applied()
        );
    }
    assert_eq!(values(&*target), target_before, "the target network moved");
    let err = rel(&values(&*online), &values(&online32));
    assert!(err < 1e-2, "online network vs f32: {err:e}");
    assert!(
        values(&*online) != target_before,
        "the online network did not train"
    );
}

#[test]
fn an_evaluation_pass_then_an_in_place_change_of_the_master_is_seen_by_the_next_pass() {
    let dev = Cpu::seed_from_u64(7);
    let mut model = Mixed::mapped(dev.build_module::<Q, f32>());
    let mut scaler = GradScaler::<f16>::default();
    let x: X8 = dev.sample_normal();
    let before = scaler
        .forward(&model, x.clone(), |m, x| m.forward(x))
        .unwrap();
    // a restored checkpoint, written into the master's tensors in place
    let halved: Vec<f32> = values(&*model).iter().map(|v| v * 0.5).collect();
    load(&mut *model, &halved);
    let after = scaler
        .forward(&model, x.clone(), |m, x| m.forward(x))
        .unwrap();
    let want = model.forward(x).as_vec();
    assert_close("after the change", &after.as_vec(), &want);
    assert!(
        rel(&before.as_vec(), &want) > 0.1,
        "the change did not change the output"
    );
}

#[test]
fn two_clones_forward_both_backward_both_update_both() {
    let dev = Cpu::seed_from_u64(8);
    let init = dev.build_module::<Q, f32>();
    let mut a = Mixed::mapped(init.clone());
    let mut b = a.clone();
    let (mut oa, mut ob) = (
        Sgd::new(&*a, SgdConfig::default()),
        Sgd::new(&*b, SgdConfig::default()),
    );
    let mut scaler = GradScaler::<f16>::default();
    let (mut a32, mut b32) = (init.clone(), init);
    let (mut oa32, mut ob32) = (
        Sgd::new(&a32, SgdConfig::default()),
        Sgd::new(&b32, SgdConfig::default()),
    );
    for k in 0..3 {
        let xa: X8 = Cpu::seed_from_u64(10 + k).sample_normal();
        let xb: X8 = Cpu::seed_from_u64(20 + k).sample_normal();
        let ya = scaler
            .forward(&a, xa.trace(a.alloc_grads()), |m, x| m.forward(x))
            .unwrap();
        let yb = scaler
            .forward(&b, xb.trace(b.alloc_grads()), |m, x| m.forward(x))
            .unwrap();
        let ga = scaler.backward(ya.square().mean()).unwrap();
        let gb = scaler.backward(yb.square().mean()).unwrap();
        assert!(scaler.update(&mut a, &mut oa, &ga).unwrap().is_applied());
        assert!(scaler.update(&mut b, &mut ob, &gb).unwrap().is_applied());
        for (m, o, x) in [(&mut a32, &mut oa32, &xa), (&mut b32, &mut ob32, &xb)] {
            let g = m
                .forward(x.trace(m.alloc_grads()))
                .square()
                .mean()
                .backward();
            o.update(m, &g).unwrap();
        }
    }
    assert_eq!(scaler.applied_steps(), 6);
    assert!(rel(&values(&*a), &values(&a32)) < 1e-2);
    assert!(rel(&values(&*b), &values(&b32)) < 1e-2);
    assert!(values(&*a) != values(&*b), "the clones trained alike");
}

// ---- gradients thrown away -------------------------------------------------------------------

type Lin = <Linear<4, 2> as BuildOnDevice<Cpu, f32>>::Built;
type X3 = Tensor<Rank2<3, 4>, f32, Cpu>;

/// The f32 idiom: fresh gradients every step, and a return before the update when the loss is
/// not finite.
#[mixed_step(scaling = scaler)]
fn guarded(model: &mut Lin, opt: &mut Sgd<Lin, f32, Cpu>, x: &X3, scaler: &mut GradScaler) -> bool {
    let loss = model.forward(x.trace(model.alloc_grads())).square().mean();
    let value = loss.array();
    let grads = loss.backward();
    if !value.is_finite() {
        return false;
    }
    opt.update(model, &grads).unwrap();
    true
}

#[test]
fn fresh_gradients_each_step_and_an_early_return_do_not_skip_the_next_batch() {
    let dev = Cpu::seed_from_u64(9);
    let mut model = dev.build_module::<Linear<4, 2>, f32>();
    let mut opt = Sgd::new(&model, SgdConfig::default());
    let mut scaler = GradScaler::default();
    let mut bad: X3 = dev.sample_normal();
    let mut v = bad.as_vec();
    v[3] = f32::NAN;
    bad.copy_from(&v);
    assert!(!guarded(&mut model, &mut opt, &bad, &mut scaler));
    let before = values(&model);
    let good: X3 = dev.sample_normal();
    assert!(guarded(&mut model, &mut opt, &good, &mut scaler));
    assert!(
        scaler.last_step().unwrap().is_applied(),
        "the finite batch after the early return was skipped"
    );
    assert!(values(&model) != before);
}

// ---- values nobody checked -------------------------------------------------------------------

#[test]
fn a_static_scale_that_overflows_every_step_is_an_error_not_a_run_that_trains_nothing() {
    let dev = Cpu::seed_from_u64(11);
    let mut model = Mixed::mapped(dev.build_module::<Linear<4, 2>, f32>());
    let mut opt = Sgd::new(&*model, SgdConfig::default());
    // every scaled gradient is far beyond f16's 65504
    let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(2f32.powi(40)).unwrap());
    let x: X3 = dev.sample_normal();
    let mut stuck = None;
    for k in 0..30 {
        let y = scaler
            .forward(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x))
            .unwrap();
        let g = scaler.backward(y.square().mean()).unwrap();
        match scaler.update(&mut model, &mut opt, &g) {
            Ok(outcome) => assert!(!outcome.is_applied(), "step {k} applied"),
            Err(e) => {
                stuck = Some((k, e));
                break;
            }
        }
    }
    let (k, e) = stuck.expect("30 skips in a row at a fixed scale, and no error");
    assert!(matches!(e, StepError::ScaleStuck { .. }), "{e}");
    assert_eq!(k, 19, "the error came at skip {}", k + 1);
    let text = e.to_string();
    assert!(text.contains("20"), "{text}");
}

#[test]
fn clipping_with_a_max_that_is_not_a_norm_is_an_error() {
    let dev = Cpu::default();
    let model = dev.build_module::<Linear<4, 2>, f32>();
    let x: X3 = dev.sample_normal();
    let mut g = model.forward(x.trace(model.alloc_grads())).sum().backward();
    let before = common::grads::param_grads(&model, &g).concat();
    for max in [-1.0, f32::NAN, f32::INFINITY] {
        match clip_grad_norm(&model, &mut g, max) {
            Err(e @ StepError::InvalidClip { .. }) => {
                assert!(e.to_string().contains("max"), "{e}");
            }
            other => panic!("clip_grad_norm(max = {max}) gave {other:?}"),
        }
    }
    assert_eq!(common::grads::param_grads(&model, &g).concat(), before);
    assert!(clip_grad_norm(&model, &mut g, 0.0).is_ok());
}

#[test]
fn a_checkpoint_whose_counters_have_no_room_left_is_rejected() {
    let mut scaler = GradScaler::<f16>::default();
    for (applied, skipped) in [
        (u64::MAX, 0),
        (0, u64::MAX),
        (u64::MAX / 2 + 1, u64::MAX / 2 + 1),
    ] {
        let mut state: ScalerState<DynamicLossScale> = scaler.state_dict();
        state.applied_steps = applied;
        state.skipped_steps = skipped;
        let err = scaler.load_state_dict(state).unwrap_err();
        assert!(err.to_string().contains("no room"), "{err}");
    }
    assert_eq!(scaler.applied_steps(), 0);
}

// ---- `?` into the user's own error type ------------------------------------------------------

/// A user's error type that converts from dfdx's errors only.
#[derive(Debug)]
#[allow(dead_code)] // its causes are the user's to read
enum TrainError {
    Device(CpuError),
    Update(OptimizerUpdateError<CpuError>),
}

impl From<CpuError> for TrainError {
    fn from(e: CpuError) -> Self {
        TrainError::Device(e)
    }
}

impl From<OptimizerUpdateError<CpuError>> for TrainError {
    fn from(e: OptimizerUpdateError<CpuError>) -> Self {
        TrainError::Update(e)
    }
}

/// Every `?` of the f32 step still compiles after the conversion.
#[mixed_step(scaling = scaler)]
fn fallible(
    model: &mut Lin,
    opt: &mut Sgd<Lin, f32, Cpu>,
    x: &X3,
    scaler: &mut GradScaler,
) -> Result<f32, TrainError> {
    let loss = model
        .try_forward(x.trace(model.alloc_grads()))?
        .try_square()?
        .try_mean()?;
    let value = loss.array();
    let mut grads = loss.try_backward()?;
    opt.update(model, &grads)?;
    model.try_zero_grads(&mut grads)?;
    Ok(value)
}

fn fallible_f32(model: &mut Lin, opt: &mut Sgd<Lin, f32, Cpu>, x: &X3) -> Result<f32, TrainError> {
    let loss = model
        .try_forward(x.trace(model.alloc_grads()))?
        .try_square()?
        .try_mean()?;
    let value = loss.array();
    let mut grads = loss.try_backward()?;
    opt.update(model, &grads)?;
    model.try_zero_grads(&mut grads)?;
    Ok(value)
}

#[test]
fn question_marks_into_the_users_error_type_compile_and_train_as_in_f32() {
    let dev = Cpu::seed_from_u64(12);
    let init = dev.build_module::<Linear<4, 2>, f32>();
    let (mut a, mut b) = (init.clone(), init);
    let (mut oa, mut ob) = (
        Sgd::new(&a, SgdConfig::default()),
        Sgd::new(&b, SgdConfig::default()),
    );
    let mut scaler = GradScaler::default();
    for k in 0..4 {
        let x: X3 = Cpu::seed_from_u64(30 + k).sample_normal();
        let l32 = fallible_f32(&mut a, &mut oa, &x).unwrap();
        let l16 = fallible(&mut b, &mut ob, &x, &mut scaler).unwrap();
        assert!(
            (l16 - l32).abs() <= 1e-2 * l32.abs() + 1e-3,
            "{l16} vs {l32}"
        );
    }
    assert_eq!(scaler.applied_steps(), 4);
    assert!(rel(&values(&b), &values(&a)) < 1e-2);
}

// ---- an ensemble: one scaler per model, indexed ------------------------------------------------

struct Ensemble {
    models: Vec<Lin>,
    opts: Vec<Sgd<Lin, f32, Cpu>>,
    scalers: Vec<GradScaler>,
}

impl Ensemble {
    #[mixed_step(scaling = self.scalers[i])]
    fn train(&mut self, x: &X3) {
        for i in 0..self.models.len() {
            let grads = self.models[i]
                .forward(x.trace(self.models[i].alloc_grads()))
                .square()
                .mean()
                .backward();
            self.opts[i].update(&mut self.models[i], &grads).unwrap();
        }
    }
}

#[test]
fn an_ensemble_indexes_its_models_optimizers_and_scalers() {
    let dev = Cpu::seed_from_u64(13);
    let models: Vec<Lin> = (0..3)
        .map(|_| dev.build_module::<Linear<4, 2>, f32>())
        .collect();
    let twins = models.clone();
    let opts = models
        .iter()
        .map(|m| Sgd::new(m, SgdConfig::default()))
        .collect();
    let scalers = (0..3).map(|_| GradScaler::default()).collect();
    let mut e = Ensemble {
        models,
        opts,
        scalers,
    };
    let x: X3 = dev.sample_normal();
    for _ in 0..3 {
        e.train(&x);
    }
    for (i, (m, mut twin)) in e.models.iter().zip(twins).enumerate() {
        let s = &e.scalers[i];
        assert_eq!(s.applied_steps(), 3, "model {i}");
        assert_eq!(s.last_step().unwrap().precision, DType::Float16);
        let mut opt = Sgd::new(&twin, SgdConfig::default());
        for _ in 0..3 {
            let g = twin
                .forward(x.trace(twin.alloc_grads()))
                .square()
                .mean()
                .backward();
            opt.update(&mut twin, &g).unwrap();
        }
        assert!(rel(&values(m), &values(&twin)) < 1e-2, "model {i}");
    }
}

// ---- a struct whose methods destructure it exhaustively ----------------------------------------

/// A learner whose methods name every field (`let Self { .. } = self` without `..`): a new field
/// would break them, so the scaler rides with the optimizer ([`mpx::step::WithScaler`]); only
/// the field's type and its initialisation differ from the f32 learner, and the step names the
/// binding its destructuring gives the optimizer.
struct Learner {
    model: Lin,
    opt: mpx::step::WithScaler<Sgd<Lin, f32, Cpu>>,
    steps: usize,
}

impl Learner {
    fn new(model: Lin) -> Self {
        let opt = mpx::step::WithScaler::new(Sgd::new(&model, SgdConfig::default()));
        Self {
            model,
            opt,
            steps: 0,
        }
    }

    #[mixed_step(scaling = opt)]
    fn learn(&mut self, x: &X3) -> f32 {
        let Self { model, opt, steps } = self;
        let loss = model.forward(x.trace(model.alloc_grads())).square().mean();
        let value = loss.array();
        let grads = loss.backward();
        opt.update(model, &grads).unwrap();
        *steps += 1;
        value
    }

    fn lr(&mut self, lr: f64) {
        let Self {
            model: _,
            opt,
            steps: _,
        } = self;
        opt.cfg.lr = lr;
    }
}

#[test]
fn a_learner_that_names_every_field_keeps_its_scaler_in_the_optimizer() {
    let dev = Cpu::seed_from_u64(14);
    let init = dev.build_module::<Linear<4, 2>, f32>();
    let mut learner = Learner::new(init.clone());
    learner.lr(0.05);
    let (mut twin, x): (Lin, X3) = (init, dev.sample_normal());
    let mut opt = Sgd::new(
        &twin,
        SgdConfig {
            lr: 0.05,
            ..Default::default()
        },
    );
    for _ in 0..3 {
        learner.learn(&x);
        let g = twin
            .forward(x.trace(twin.alloc_grads()))
            .square()
            .mean()
            .backward();
        opt.update(&mut twin, &g).unwrap();
    }
    let s = learner.opt.scaler();
    assert_eq!((s.applied_steps(), learner.steps), (3, 3));
    assert_eq!(s.last_step().unwrap().precision, DType::Float16);
    assert!(rel(&values(&learner.model), &values(&twin)) < 1e-2);
}

// ---- a boxed model ------------------------------------------------------------------------------

/// An agent that keeps its model in a `Box` and its gradients between steps, and updates the
/// model through `&mut *self.model` (the forward pass reaches it by auto-deref).
struct BoxedAgent {
    model: Box<Lin>,
    opt: Sgd<Lin, f32, Cpu>,
    grads: Option<Gradients<f32, Cpu>>,
    scaler: GradScaler,
}

impl BoxedAgent {
    #[mixed_step(scaling = self.scaler)]
    fn learn(&mut self, x: &X3) -> f32 {
        let grads = self
            .grads
            .take()
            .unwrap_or_else(|| self.model.alloc_grads());
        let loss = self.model.forward(x.trace(grads)).square().mean();
        let value = loss.array();
        let mut grads = loss.backward();
        self.opt.update(&mut *self.model, &grads).unwrap();
        self.model.zero_grads(&mut grads);
        self.grads = Some(grads);
        value
    }
}

#[test]
fn a_boxed_model_updated_through_a_deref_trains_like_its_f32_twin() {
    let dev = Cpu::seed_from_u64(16);
    let init: Lin = dev.build_module::<Linear<4, 2>, f32>();
    let x: X3 = dev.sample_normal();
    let mut agent = BoxedAgent {
        opt: Sgd::new(&init, SgdConfig::default()),
        model: Box::new(init.clone()),
        grads: None,
        scaler: GradScaler::default(),
    };
    let mut twin = init;
    let mut opt = Sgd::new(&twin, SgdConfig::default());
    for _ in 0..3 {
        agent.learn(&x);
        let g = twin
            .forward(x.trace(twin.alloc_grads()))
            .square()
            .mean()
            .backward();
        opt.update(&mut twin, &g).unwrap();
    }
    let last = agent.scaler.last_step().unwrap();
    assert!(last.is_applied() && last.mpx_layers && last.precision == DType::Float16);
    assert_eq!(agent.scaler.applied_steps(), 3);
    assert!(rel(&values(&*agent.model), &values(&twin)) < 1e-2);
}

// ---- a step generic over its model, bounded to run mpx's layers ------------------------------

/// dfdx's generic-train-loop shape, with the model bounded `HalfLayers<f16>`: the step runs the
/// model's mapped working copy (mpx's layers), whatever model it is called with.
#[mixed_step(scaling = scaler)]
fn generic_step<M, E: Dtype, D: Device<E>>(
    model: &mut M,
    opt: &mut Sgd<M, E, D>,
    x: Tensor<Rank2<3, 4>, E, D>,
    scaler: &mut GradScaler,
) where
    M: Module<
            Tensor<Rank2<3, 4>, E, D, OwnedTape<E, D>>,
            Output = Tensor<Rank2<3, 2>, E, D, OwnedTape<E, D>>,
            Error = D::Err,
        > + TensorCollection<E, D>
        + mpx::step::HalfLayers<f16>,
{
    let grads = model
        .forward(x.trace(model.alloc_grads()))
        .square()
        .mean()
        .backward();
    opt.update(model, &grads).unwrap();
}

#[test]
fn a_step_generic_over_its_model_bounded_half_layers_runs_mpxs_layers() {
    let dev = Cpu::seed_from_u64(15);
    let mut model = dev.build_module::<(Linear<4, 8>, ReLU, Linear<8, 2>), f32>();
    let mut opt = Sgd::new(&model, SgdConfig::default());
    let mut scaler = GradScaler::default();
    let before = values(&model);
    generic_step(&mut model, &mut opt, dev.sample_normal(), &mut scaler);
    let last = scaler.last_step().unwrap();
    assert!(last.is_applied() && last.mpx_layers && last.precision == DType::Float16);
    assert!(values(&model) != before);
}

// ---- element-wise ops of a user's own module ---------------------------------------------------

/// A user's gated cell with a residual, written with dfdx's element-wise ops between its
/// layers: `+` and `-` of tensors, `try_mul` of two tensors and of a tensor and a scalar, next to
/// index arithmetic and an array length. In the working copy the ops of two f16 tensors run as
/// mpx's vector ops (dfdx's f16 bits), everything else as written.
#[derive(Debug, Clone, mpx::HalfLayers)]
struct Cell<E: Dtype, D: Device<E>> {
    wx: dfdx::nn::modules::Linear<3, 5, E, D>,
    wh: dfdx::nn::modules::Linear<5, 5, E, D>,
    out: dfdx::nn::modules::Linear<5, 2, E, D>,
}

impl<E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform, D: Device<E>>
    TensorCollection<E, D> for Cell<E, D>
{
    type To<E2: Dtype, D2: Device<E2>> = Cell<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            (
                Self::module("wx", |s| &s.wx, |s| &mut s.wx),
                Self::module("wh", |s| &s.wh, |s| &mut s.wh),
                Self::module("out", |s| &s.out, |s| &mut s.out),
            ),
            |(wx, wh, out)| Cell { wx, wh, out },
        )
    }
}

type Seq3 = Tensor<Rank2<4, 3>, f32, Cpu>;

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>, T: Tape<E, D>>
    Module<(Tensor<Rank2<4, 3>, E, D, T>, Tensor<Rank2<4, 3>, E, D>)> for Cell<E, D>
{
    type Output = Tensor<Rank2<4, 2>, E, D, T>;
    type Error = D::Err;
    fn try_forward(
        &self,
        (x0, x1): (Tensor<Rank2<4, 3>, E, D, T>, Tensor<Rank2<4, 3>, E, D>),
    ) -> Result<Self::Output, D::Err> {
        // index arithmetic and a const length stay as written, and so do a helper's methods of
        // dfdx's names taking `&self` (called by path, as docs/dsl.md says)
        let gain = Gain(2);
        let repeats = [0u8; 2 * 2].len() - Gain::try_mul(&gain, 1) - Gain::try_mul(&gain, 0) - 1;
        let (h, tape) = self.wx.try_forward(x0)?.try_tanh()?.split_tape();
        let gate = self.wx.try_forward(x1)?.try_sigmoid()?;
        let mut y = self.wh.try_forward(h.clone().put_tape(tape))? + h.clone();
        for _ in 0..repeats {
            y = y - gate.clone();
            y = y.try_mul(gate.clone())?;
        }
        let half = E::from_f32(0.5).expect("0.5 in every element type");
        self.out.try_forward(y.try_mul(half)? * h)
    }
}

/// A helper of the user's own with a method named as dfdx's tensor op, taking `&self`.
struct Gain(usize);

impl Gain {
    fn try_mul(&self, x: usize) -> usize {
        self.0 * x
    }
}

type CellF32 = Cell<f32, Cpu>;

#[mixed_step(scaling = scaler)]
fn cell_step(
    model: &mut CellF32,
    opt: &mut Sgd<CellF32, f32, Cpu>,
    xs: &(Seq3, Seq3),
    y: &Tensor<Rank2<4, 2>, f32, Cpu>,
    scaler: &mut GradScaler,
) -> f32 {
    let out = model.forward((xs.0.trace(model.alloc_grads()), xs.1.clone()));
    let loss = mse_loss(out, y.clone());
    let v = loss.array();
    // the gradients written inline in the update (a temporary the expansion must keep alive)
    opt.update(model, &loss.backward()).unwrap();
    v
}

fn cell_step_f32(
    model: &mut CellF32,
    opt: &mut Sgd<CellF32, f32, Cpu>,
    xs: &(Seq3, Seq3),
    y: &Tensor<Rank2<4, 2>, f32, Cpu>,
) -> f32 {
    let out = model.forward((xs.0.trace(model.alloc_grads()), xs.1.clone()));
    let loss = mse_loss(out, y.clone());
    let v = loss.array();
    opt.update(model, &loss.backward()).unwrap();
    v
}

#[test]
fn a_users_cell_with_element_wise_ops_trains_like_its_f32_twin_on_mpxs_layers() {
    let dev = Cpu::seed_from_u64(11);
    let init = Cell::<f32, Cpu> {
        wx: BuildModule::build(&dev),
        wh: BuildModule::build(&dev),
        out: BuildModule::build(&dev),
    };
    let (mut a, mut b) = (init.clone(), init);
    let config = SgdConfig {
        lr: 0.2,
        ..Default::default()
    };
    let (mut oa, mut ob) = (Sgd::new(&a, config), Sgd::new(&b, config));
    let mut scaler = GradScaler::default();
    let (mut first, mut last) = (None, (0.0, 0.0));
    for k in 0..8 {
        let dev = Cpu::seed_from_u64(200 + k);
        let xs: (Seq3, Seq3) = (dev.sample_normal(), dev.sample_normal());
        let y = dev.sample_normal::<Rank2<4, 2>>() * 0.3;
        last = (
            cell_step_f32(&mut a, &mut oa, &xs, &y),
            cell_step(&mut b, &mut ob, &xs, &y, &mut scaler),
        );
        first.get_or_insert(last);
    }
    let report = scaler.last_step().unwrap();
    assert!(report.mpx_layers, "the cell ran on mpx's layers");
    assert_eq!(report.precision, DType::Float16);
    assert_eq!(scaler.applied_steps() + scaler.skipped_steps(), 8);
    assert!(
        scaler.applied_steps() >= 7,
        "{} steps applied",
        scaler.applied_steps()
    );
    let (f, m) = last;
    println!("cell losses: first {first:?}, last f32 {f} mixed {m}");
    assert!(
        (f - m).abs() <= 1e-2 * f.abs().max(1e-3),
        "f32 {f} mixed {m}"
    );
    let err = rel(&values(&b), &values(&a));
    assert!(err < 1e-2, "mixed vs f32 parameters after 8 steps: {err:e}");
    // and training moved them: the twin tolerance is not met by standing still
    let first = first.unwrap().0;
    assert!(f < first, "the f32 loss went from {first} to {f}");
}

// ---- the twins' ops on every shape of code ---------------------------------------------------

/// A user's module whose forward code mixes the ops `#[half_forward]` dispatches with everything
/// around them: a broadcast bias (a non-contiguous operand), a scalar of the element type,
/// negation, a closure, an iterator's sum, a tape split and put back, the square of a value
/// taken twice. Each precision's twin compiles it as written and trains like the f32 step.
#[derive(Clone, mpx::HalfLayers)]
pub struct Mixer<E: Dtype, D: Device<E>> {
    w: Tensor<Rank2<4, 4>, E, D>,
    b: Tensor<Rank1<4>, E, D>,
    l: dfdx::nn::modules::Linear<4, 4, E, D>,
}

impl<E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform, D: Device<E>>
    TensorCollection<E, D> for Mixer<E, D>
{
    type To<E2: Dtype, D2: Device<E2>> = Mixer<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            (
                Self::tensor("w", |s| &s.w, |s| &mut s.w, TensorOptions::reset_to_ones()),
                Self::tensor("b", |s| &s.b, |s| &mut s.b, TensorOptions::reset_to_zeros()),
                Self::module("l", |s| &s.l, |s| &mut s.l),
            ),
            |(w, b, l)| Mixer { w, b, l },
        )
    }
}

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>, T: Tape<E, D>> Module<Tensor<Rank2<3, 4>, E, D, T>> for Mixer<E, D> {
    type Output = Tensor<Rank2<3, 4>, E, D, T>;
    type Error = D::Err;
    fn try_forward(&self, x: Tensor<Rank2<3, 4>, E, D, T>) -> Result<Self::Output, D::Err> {
        // a transposed weight and a broadcast bias (non-contiguous, untraced rhs), scalar ops,
        // negation, element-wise methods, closures, iterators
        let y = x.try_matmul(self.w.clone().permute())? + self.b.clone().broadcast();
        let half = E::from_f32(0.5).unwrap();
        let y = y * half;
        let y = -y;
        let y = (y / E::from_f32(0.8).unwrap()).try_add(half)? - half;
        let y = y.try_div(E::from_f32(1.25).unwrap())?;
        // element-wise methods of a tensor (mpx's layers) and of a number (as written)
        let y = y.try_abs()?.square() * E::from_f32(0.25f32.sqrt().tanh()).unwrap();
        // a quotient of two tensors (the divisor untraced)
        let (y, tape) = y.split_tape();
        let d = y.clone().square() + E::from_f32(1.0).unwrap();
        let y = y.put_tape(tape) / d;
        let f = |t: Tensor<Rank2<3, 4>, E, D, T>| t.try_mul(half);
        let y = f(y)?;
        let n: usize = (0..3).map(|i| i * 2 + 1).sum();
        let mut y = y;
        for _ in 0..(n - 8) {
            y = y.try_sub(
                self.l
                    .try_forward(self.b.clone().broadcast::<Rank2<3, 4>, _>())?,
            )?;
        }
        let (y, tape) = y.split_tape();
        let z = y.clone() * y.clone();
        let y = y.put_tape(tape) + z;
        self.l.try_forward(y)
    }
}

type MixerF32 = Mixer<f32, Cpu>;
type MixerSgd = Sgd<MixerF32, f32, Cpu>;
type X34 = Tensor<Rank2<3, 4>, f32, Cpu>;

/// One step, written once: in f32 as `$f32`, and through `#[mixed_step]` in each precision.
macro_rules! mixer_steps {
    ($f32:ident, $($mixed:ident: $h:ty),* => |$model:ident, $opt:ident, $x:ident| $body:block) => {
        fn $f32($model: &mut MixerF32, $opt: &mut MixerSgd, $x: &X34) -> f32 $body
        $(
            #[mixed_step(scaling = scaler)]
            fn $mixed(
                $model: &mut MixerF32,
                $opt: &mut MixerSgd,
                $x: &X34,
                scaler: &mut GradScaler<$h>,
            ) -> f32 $body
        )*
    };
}

mixer_steps!(mixer_step_f32,
    mixer_step_f16: f16,
    mixer_step_bf16: mpx::precision::bf16,
    mixer_step_amp: mpx::precision::AMP<f16>
    => |model, opt, x| {
        let y = model.forward(x.trace(model.alloc_grads()));
        let loss = y.square().mean();
        let v = loss.array();
        opt.update(model, &loss.backward()).unwrap();
        v
    }
);

/// Five steps of the f32 step and of `mixed` from one start: each mixed loss within `tol`
/// (relative) of the f32 one.
fn mixer_tracks_f32(mixed: &mut dyn FnMut(&mut MixerF32, &mut MixerSgd, &X34) -> f32, tol: f32) {
    let dev = Cpu::seed_from_u64(3);
    let m: MixerF32 = Mixer {
        w: dev.sample_normal() * 0.3,
        b: dev.sample_normal() * 0.1,
        l: BuildModule::build(&dev),
    };
    let start = m.clone();
    let (mut a, mut b) = (m.clone(), m);
    let (mut oa, mut ob) = (
        Sgd::new(&a, Default::default()),
        Sgd::new(&b, Default::default()),
    );
    for k in 0..5 {
        let x: X34 = Cpu::seed_from_u64(k).sample_normal();
        let (f, h) = (
            mixer_step_f32(&mut a, &mut oa, &x),
            mixed(&mut b, &mut ob, &x),
        );
        assert!((f - h).abs() < tol * f.abs().max(1e-2), "f32 {f} mixed {h}");
    }
    // every tensor trained as in f32 (the loss alone would hide one that did not move: the
    // transposed weight and the broadcast bias reach the add as copies under new ids)
    for (what, m32, mixed, init) in [
        ("w", a.w.as_vec(), b.w.as_vec(), start.w.as_vec()),
        ("b", a.b.as_vec(), b.b.as_vec(), start.b.as_vec()),
        (
            "l.weight",
            a.l.weight.as_vec(),
            b.l.weight.as_vec(),
            start.l.weight.as_vec(),
        ),
    ] {
        let moved = m32
            .iter()
            .zip(&init)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0, f32::max);
        let off = m32
            .iter()
            .zip(&mixed)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0, f32::max);
        assert!(moved > 1e-4, "{what}: the f32 steps moved it by {moved}");
        assert!(
            off < 0.1 * moved,
            "{what}: mixed {off} from f32, which moved {moved}"
        );
    }
}

/// `f16`: the ops of half tensors on mpx's kernels, everything else as written.
#[test]
fn a_module_with_broadcasts_scalars_closures_and_a_split_tape_trains_like_f32() {
    let mut s = GradScaler::<f16>::default();
    mixer_tracks_f32(&mut |m, o, x| mixer_step_f16(m, o, x, &mut s), 2e-2);
    assert!(s.last_step().unwrap().mpx_layers);
}

/// `bf16` and `AMP<f16>`: every op as written (dfdx's), the same code compiling in each twin.
#[test]
fn the_same_module_trains_like_f32_in_bf16_and_amp_f16_too() {
    let mut s = GradScaler::<mpx::precision::bf16>::default();
    mixer_tracks_f32(&mut |m, o, x| mixer_step_bf16(m, o, x, &mut s), 5e-2);
    let mut s = GradScaler::<mpx::precision::AMP<f16>>::default();
    mixer_tracks_f32(&mut |m, o, x| mixer_step_amp(m, o, x, &mut s), 2e-2);
}

// ---- the float32 list's tensor methods in f32 --------------------------------------------------

/// A user's module whose forward code takes a softmax and a log-softmax as tensor methods (an
/// attention's weights, a policy's log-probabilities): in its working copy they run in f32 on
/// the f16 values and are rounded once, as dfdx's `Softmax` and `LogSoftmax` layers do in a
/// mapped working copy (autocast's float32 list).
#[derive(Clone, mpx::HalfLayers)]
pub struct Probs<E: Dtype, D: Device<E>> {
    g: Tensor<Rank1<16>, E, D>,
}

impl<E: Dtype, D: Device<E>> TensorCollection<E, D> for Probs<E, D> {
    type To<E2: Dtype, D2: Device<E2>> = Probs<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            Self::tensor("g", |s| &s.g, |s| &mut s.g, TensorOptions::reset_to_ones()),
            |g| Probs { g },
        )
    }
}

type X8x16<E, D, T> = Tensor<Rank2<8, 16>, E, D, T>;

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>, T: Tape<E, D>> Module<X8x16<E, D, T>> for Probs<E, D> {
    type Output = (X8x16<E, D, T>, X8x16<E, D, T>);
    type Error = D::Err;
    fn try_forward(&self, x: X8x16<E, D, T>) -> Result<Self::Output, D::Err> {
        // the gain is all ones: `x * g` is `x`
        let z = x.try_mul(self.g.clone().try_broadcast()?)?;
        let (z, tape) = z.split_tape();
        let p = z.clone().put_tape(tape).softmax::<Axis<1>>();
        let q = z.try_log_softmax::<Axis<1>>()?;
        Ok((p, q.retaped()))
    }
}

#[test]
fn a_users_softmax_and_log_softmax_run_in_f32_in_the_working_copy() {
    let dev = Cpu::seed_from_u64(5);
    let model = Mixed::mapped(Probs::<f32, Cpu> { g: dev.ones() });
    let x: Tensor<Rank2<8, 16>, f32, Cpu> = (dev.sample_normal::<Rank2<8, 16>>() * 4.0).retaped();
    let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(1.0).unwrap());
    let (p, q) = scaler
        .forward(&model, x.clone(), |m, x| m.forward(x))
        .unwrap();
    // the f16 input's softmax and log-softmax in f32, rounded to f16 once
    let xh = x.to_dtype::<f16>();
    let x32 = xh.clone().to_dtype::<f32>();
    let once = |t: Tensor<Rank2<8, 16>, f32, Cpu>| t.to_dtype::<f16>().to_dtype::<f32>().as_vec();
    let want_p = once(x32.clone().softmax::<Axis<1>>());
    let want_q = once(x32.log_softmax::<Axis<1>>());
    assert_eq!(p.as_vec(), want_p);
    assert_eq!(q.as_vec(), want_q);
    // dfdx's own in f16 rounds every step of the softmax: not these values
    let f16_p = xh.clone().softmax::<Axis<1>>().to_dtype::<f32>().as_vec();
    let f16_q = xh.log_softmax::<Axis<1>>().to_dtype::<f32>().as_vec();
    assert_ne!(f16_p, want_p);
    assert_ne!(f16_q, want_q);
}

// ---- a layer's fields read by the module's own code --------------------------------------------

/// A user's module that ties its output projection to a layer's weight (`self.lin.weight`, a
/// field of dfdx's `UnbiasedLinear`): its working copy's layer (mpx's `UnbiasedLinear`) has the
/// same field, and the weight's gradient from both uses reaches the master.
#[derive(Clone, mpx::HalfLayers)]
pub struct Tied<E: Dtype, D: Device<E>> {
    lin: dfdx::nn::modules::UnbiasedLinear<4, 6, E, D>,
}

impl<E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform, D: Device<E>>
    TensorCollection<E, D> for Tied<E, D>
{
    type To<E2: Dtype, D2: Device<E2>> = Tied<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(Self::module("lin", |s| &s.lin, |s| &mut s.lin), |lin| {
            Tied { lin }
        })
    }
}

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>, T: Tape<E, D>> Module<Tensor<Rank2<3, 4>, E, D, T>> for Tied<E, D> {
    type Output = Tensor<Rank2<3, 4>, E, D, T>;
    type Error = D::Err;
    fn try_forward(&self, x: Tensor<Rank2<3, 4>, E, D, T>) -> Result<Self::Output, D::Err> {
        let h = self.lin.try_forward(x)?;
        h.try_matmul(self.lin.weight.clone())
    }
}

#[test]
fn a_module_reading_a_layers_weight_field_trains_like_its_f32_twin() {
    let dev = Cpu::seed_from_u64(13);
    let init = Tied::<f32, Cpu>::build(&dev);
    let x: Tensor<Rank2<3, 4>, f32, Cpu> = dev.sample_normal();
    let y: Tensor<Rank2<3, 4>, f32, Cpu> = dev.sample_normal();
    // f32
    let mut m32 = init.clone();
    let g32 = mse_loss(m32.forward(x.trace(m32.alloc_grads())), y.clone()).backward();
    let mut sgd32 = Sgd::new(&m32, SgdConfig::default());
    sgd32.update(&mut m32, &g32).unwrap();
    // mixed, on mpx's layers
    let mut model = Mixed::mapped(init);
    let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(256.0).unwrap());
    let out = scaler
        .forward(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x))
        .unwrap();
    let g16 = scaler.backward(mse_loss(out, y)).unwrap();
    let mut sgd = Sgd::new(&*model, SgdConfig::default());
    assert!(
        scaler
            .update(&mut model, &mut sgd, &g16)
            .unwrap()
            .is_applied()
    );
    assert!(scaler.last_step().unwrap().mpx_layers);
    assert_close(
        "the weight after one step",
        &model.lin.weight.as_vec(),
        &m32.lin.weight.as_vec(),
    );
    // the weight moved: both uses' gradients reached it
    assert_ne!(
        model.lin.weight.as_vec(),
        Tied::<f32, Cpu>::build(&Cpu::seed_from_u64(13))
            .lin
            .weight
            .as_vec()
    );
}

// ---- time steps as an array or a `Vec` ----------------------------------------------------------

/// A user's recurrent module unrolled over its time steps, taken as an array (and giving one
/// output per step) or as a `Vec` (a sequence of any length): both enter and leave the half
/// region element by element.
#[derive(Clone, mpx::HalfLayers)]
pub struct Unrolled<E: Dtype, D: Device<E>> {
    w: dfdx::nn::modules::Linear<2, 4, E, D>,
    u: dfdx::nn::modules::Linear<4, 4, E, D>,
    head: dfdx::nn::modules::Linear<4, 2, E, D>,
}

impl<E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform, D: Device<E>>
    TensorCollection<E, D> for Unrolled<E, D>
{
    type To<E2: Dtype, D2: Device<E2>> = Unrolled<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            (
                Self::module("w", |s| &s.w, |s| &mut s.w),
                Self::module("u", |s| &s.u, |s| &mut s.u),
                Self::module("head", |s| &s.head, |s| &mut s.head),
            ),
            |(w, u, head)| Unrolled { w, u, head },
        )
    }
}

type Step<E, D, T> = Tensor<Rank2<5, 2>, E, D, T>;

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>, T: Tape<E, D> + Merge<T>> Module<[Step<E, D, T>; 3]>
    for Unrolled<E, D>
{
    type Output = [Step<E, D, T>; 2];
    type Error = D::Err;
    fn try_forward(&self, [a, b, c]: [Step<E, D, T>; 3]) -> Result<Self::Output, D::Err> {
        let h1 = self.w.try_forward(a)?.try_tanh()?;
        let h2 = self
            .w
            .try_forward(b)?
            .try_add(self.u.try_forward(h1)?)?
            .try_tanh()?;
        let y2 = self.head.try_forward(h2.with_empty_tape())?;
        let h3 = self
            .w
            .try_forward(c)?
            .try_add(self.u.try_forward(h2)?)?
            .try_tanh()?;
        Ok([y2, self.head.try_forward(h3)?])
    }
}

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>, T: Tape<E, D> + Merge<T>> Module<Vec<Step<E, D, T>>>
    for Unrolled<E, D>
{
    type Output = Step<E, D, T>;
    type Error = D::Err;
    fn try_forward(&self, xs: Vec<Step<E, D, T>>) -> Result<Self::Output, D::Err> {
        let mut xs = xs.into_iter();
        let first = xs.next().expect("a sequence of at least one step");
        let mut h = self.w.try_forward(first)?.try_tanh()?;
        for x in xs {
            h = self
                .w
                .try_forward(x)?
                .try_add(self.u.try_forward(h)?)?
                .try_tanh()?;
        }
        self.head.try_forward(h)
    }
}

type Steps = [Step<f32, Cpu, NoneTape>; 3];

/// Two updates: one on both outputs of the array form, one on the `Vec` form's output, its
/// input written as `vec![..]` (whose traced element `#[mixed_step]` reads inside the macro).
fn unrolled_f32(
    m: &mut Unrolled<f32, Cpu>,
    opt: &mut Sgd<Unrolled<f32, Cpu>, f32, Cpu>,
    [a, b, c]: Steps,
    y: &Step<f32, Cpu, NoneTape>,
) {
    let [y2, y3] = m.forward([a.trace(m.alloc_grads()), b.retaped(), c.retaped()]);
    let grads = (mse_loss(y2, y.clone()) + mse_loss(y3, y.clone())).backward();
    opt.update(m, &grads).unwrap();
    let out = m.forward(vec![a.trace(m.alloc_grads()), b.retaped(), c.retaped()]);
    let grads = mse_loss(out, y.clone()).backward();
    opt.update(m, &grads).unwrap();
}

// `(a + b).backward()` converts without a lint: the rewritten call binds the loss without the
// parentheses
#[mixed_step(scaling = scaler)]
#[deny(unused_parens)]
fn unrolled_mixed(
    m: &mut Unrolled<f32, Cpu>,
    opt: &mut Sgd<Unrolled<f32, Cpu>, f32, Cpu>,
    [a, b, c]: Steps,
    y: &Step<f32, Cpu, NoneTape>,
    scaler: &mut GradScaler,
) {
    let [y2, y3] = m.forward([a.trace(m.alloc_grads()), b.retaped(), c.retaped()]);
    let grads = (mse_loss(y2, y.clone()) + mse_loss(y3, y.clone())).backward();
    opt.update(m, &grads).unwrap();
    let out = m.forward(vec![a.trace(m.alloc_grads()), b.retaped(), c.retaped()]);
    let grads = mse_loss(out, y.clone()).backward();
    opt.update(m, &grads).unwrap();
}

#[test]
fn time_steps_as_an_array_or_a_vec_train_like_the_f32_twin() {
    let dev = Cpu::seed_from_u64(14);
    let init = Unrolled {
        w: dev.build_module::<Linear<2, 4>, f32>(),
        u: dev.build_module::<Linear<4, 4>, f32>(),
        head: dev.build_module::<Linear<4, 2>, f32>(),
    };
    let xs: Steps = std::array::from_fn(|_| dev.sample_normal());
    let y: Step<f32, Cpu, NoneTape> = dev.sample_normal();
    let (mut m32, mut m16) = (init.clone(), init.clone());
    let cfg = SgdConfig {
        lr: 0.1,
        ..Default::default()
    };
    let (mut o32, mut o16) = (Sgd::new(&m32, cfg), Sgd::new(&m16, cfg));
    let mut scaler = GradScaler::default();
    for _ in 0..5 {
        unrolled_f32(&mut m32, &mut o32, xs.clone(), &y);
        unrolled_mixed(&mut m16, &mut o16, xs.clone(), &y, &mut scaler);
    }
    let step = scaler.last_step().unwrap();
    assert_eq!((step.precision, step.mpx_layers), (DType::Float16, true));
    assert_eq!(scaler.applied_steps(), 10);
    let err = rel(&values(&m16), &values(&m32));
    assert!(err < 1e-2, "parameters {err} from the f32 twin's");
    assert!(
        rel(&values(&m16), &values(&init)) > 0.05,
        "the parameters barely moved"
    );
}

// ---- an optimizer for each part of one model ------------------------------------------------------

type Trunk = (Linear<4, 16>, Tanh);
type Head = Linear<16, 3>;
type Parted = <(Trunk, Head) as BuildOnDevice<Cpu, f32>>::Built;
type TrunkM = <Trunk as BuildOnDevice<Cpu, f32>>::Built;
type HeadM = <Head as BuildOnDevice<Cpu, f32>>::Built;
type PartOpts = (Adam<TrunkM, f32, Cpu>, Sgd<HeadM, f32, Cpu>);

/// The whole model's forward pass, then an update of each part with its own optimizer (a trunk
/// on Adam, a head on SGD).
fn parts_f32(m: &mut Parted, (ot, oh): &mut PartOpts, x: &X8, y: &Y8x3) {
    let grads = mse_loss(m.forward(x.trace(m.alloc_grads())), y.clone()).backward();
    ot.update(&mut m.0, &grads).unwrap();
    oh.update(&mut m.1, &grads).unwrap();
}

#[mixed_step(scaling = scaler)]
fn parts_mixed(m: &mut Parted, (ot, oh): &mut PartOpts, x: &X8, y: &Y8x3, scaler: &mut GradScaler) {
    let grads = mse_loss(m.forward(x.trace(m.alloc_grads())), y.clone()).backward();
    ot.update(&mut m.0, &grads).unwrap();
    oh.update(&mut m.1, &grads).unwrap();
}

/// The same with the trunk frozen: the head's optimizer alone.
fn head_f32(m: &mut Parted, (_, oh): &mut PartOpts, x: &X8, y: &Y8x3) {
    let grads = mse_loss(m.forward(x.trace(m.alloc_grads())), y.clone()).backward();
    oh.update(&mut m.1, &grads).unwrap();
}

#[mixed_step(scaling = scaler)]
fn head_mixed(m: &mut Parted, (_, oh): &mut PartOpts, x: &X8, y: &Y8x3, scaler: &mut GradScaler) {
    let grads = mse_loss(m.forward(x.trace(m.alloc_grads())), y.clone()).backward();
    oh.update(&mut m.1, &grads).unwrap();
}

/// The runtime calls `parts_mixed` stands for, written out.
fn parts_by_hand(
    m: &mut Parted,
    (ot, oh): &mut PartOpts,
    x: &X8,
    y: &Y8x3,
    (trunk, head): &(MixedPart, MixedPart),
    scaler: &mut GradScaler,
) {
    let parts = vec![trunk.of(&m.0).unwrap(), head.of(&m.1).unwrap()];
    let out = scaler
        .forward_parts(&*m, Mapped, parts, x.trace(m.alloc_grads()), |w, x| {
            w.forward(x)
        })
        .unwrap();
    let grads = scaler.backward(mse_loss(out, y.clone())).unwrap();
    scaler.update_part(trunk, &mut m.0, ot, &grads).unwrap();
    scaler.update_part(head, &mut m.1, oh, &grads).unwrap();
}

type Y8x3 = Tensor<Rank2<8, 3>, f32, Cpu>;
type PartsF32 = fn(&mut Parted, &mut PartOpts, &X8, &Y8x3);
type PartsMixed = fn(&mut Parted, &mut PartOpts, &X8, &Y8x3, &mut GradScaler);

fn part_opts(m: &Parted) -> PartOpts {
    let sgd = SgdConfig {
        lr: 0.05,
        ..Default::default()
    };
    (Adam::new(&m.0, Default::default()), Sgd::new(&m.1, sgd))
}

#[test]
fn an_optimizer_for_each_part_trains_like_the_f32_twin_and_skips_each_part() {
    let dev = Cpu::seed_from_u64(15);
    let init = dev.build_module::<(Trunk, Head), f32>();
    let x: X8 = dev.sample_normal();
    let y: Y8x3 = dev.sample_normal();
    let steps: [(PartsF32, PartsMixed, u64); 2] =
        [(parts_f32, parts_mixed, 2), (head_f32, head_mixed, 1)];
    for (f32_step, mixed_step, parts) in steps {
        let (mut m32, mut m16) = (init.clone(), init.clone());
        let (mut o32, mut o16) = (part_opts(&m32), part_opts(&m16));
        // a scale that overflows f16 at first: the first steps are skipped, then it comes down
        let new_scaler = || {
            GradScaler::new(
                DynamicLossScale::builder()
                    .initial(2f32.powi(24))
                    .build()
                    .unwrap(),
            )
        };
        let mut scaler = new_scaler();
        // the same by hand, for the two parts
        let (mut by_hand, mut oh) = (init.clone(), part_opts(&init));
        let (mut sh, states) = (new_scaler(), (MixedPart::new(), MixedPart::new()));
        let mut updates = 0;
        for _ in 0..40 {
            let before = values(&m16);
            let scale = scaler.loss_scale();
            mixed_step(&mut m16, &mut o16, &x, &y, &mut scaler);
            if parts == 2 {
                parts_by_hand(&mut by_hand, &mut oh, &x, &y, &states, &mut sh);
                assert_eq!(value_bits(&by_hand), value_bits(&m16));
                assert_eq!(sh.last_step(), scaler.last_step());
            }
            let step = scaler.last_step().unwrap();
            assert_eq!((step.precision, step.mpx_layers), (DType::Float16, true));
            if step.is_applied() {
                f32_step(&mut m32, &mut o32, &x, &y);
                updates += 1;
            } else {
                assert_eq!(values(&m16), before, "a skipped step moved a part");
                // one iteration, one back-off, however many parts it updates
                assert_eq!(scaler.loss_scale(), scale / 2.0);
            }
        }
        assert!(scaler.skipped_steps() >= parts, "2^24 must overflow f16");
        assert_eq!(scaler.applied_steps(), updates * parts);
        assert!(updates >= 20, "{updates} applied steps");
        let err = rel(&values(&m16), &values(&m32));
        assert!(
            err < 1e-2,
            "parameters {err} from the f32 twin's ({parts} parts)"
        );
        if parts == 1 {
            assert_eq!(values(&m16.0), values(&init.0), "the frozen trunk moved");
        }
    }
}

type NormedTrunk = (Linear<4, 8>, dfdx::nn::builders::BatchNorm1D<8>);
type NormedParted = <(NormedTrunk, Linear<8, 3>) as BuildOnDevice<Cpu, f32>>::Built;

type NormedSgd = (
    Sgd<<NormedTrunk as BuildOnDevice<Cpu, f32>>::Built, f32, Cpu>,
    Sgd<<Linear<8, 3> as BuildOnDevice<Cpu, f32>>::Built, f32, Cpu>,
);

/// The whole model's training-mode forward pass (its batch norm's running statistics change),
/// then an update of each part.
fn normed_parts_f32(m: &mut NormedParted, (ot, oh): &mut NormedSgd, x: &X8) {
    let grads = m
        .forward_mut(x.trace(m.alloc_grads()))
        .square()
        .mean()
        .backward();
    ot.update(&mut m.0, &grads).unwrap();
    oh.update(&mut m.1, &grads).unwrap();
}

#[mixed_step(scaling = scaler)]
fn normed_parts(m: &mut NormedParted, (ot, oh): &mut NormedSgd, x: &X8, scaler: &mut GradScaler) {
    let grads = m
        .forward_mut(x.trace(m.alloc_grads()))
        .square()
        .mean()
        .backward();
    ot.update(&mut m.0, &grads).unwrap();
    oh.update(&mut m.1, &grads).unwrap();
}

/// The same with the trunk frozen: the head's optimizer alone.
#[mixed_step(scaling = scaler)]
fn normed_head(m: &mut NormedParted, (_, oh): &mut NormedSgd, x: &X8, scaler: &mut GradScaler) {
    let grads = m
        .forward_mut(x.trace(m.alloc_grads()))
        .square()
        .mean()
        .backward();
    oh.update(&mut m.1, &grads).unwrap();
}

/// Batch-norm statistics a forward pass of the whole model changed reach the part that holds
/// them, at its applied update: the trunk's running mean and variance train like the f32
/// twin's. Statistics in no part the step updates (the trunk frozen, run in training mode) are
/// an error that says so, not statistics left behind.
#[test]
fn batch_norm_statistics_reach_the_part_that_holds_them() {
    let dev = Cpu::seed_from_u64(16);
    let init = dev.build_module::<(NormedTrunk, Linear<8, 3>), f32>();
    let opts = |m: &NormedParted| -> NormedSgd {
        let cfg = SgdConfig {
            lr: 0.05,
            ..Default::default()
        };
        (Sgd::new(&m.0, cfg), Sgd::new(&m.1, cfg))
    };
    let (mut m32, mut m16) = (init.clone(), init.clone());
    let (mut o32, mut o16) = (opts(&m32), opts(&m16));
    let mut scaler = GradScaler::default();
    for k in 0..5 {
        let x: X8 = dev.sample_normal::<Rank2<8, 4>>() + k as f32;
        normed_parts_f32(&mut m32, &mut o32, &x);
        normed_parts(&mut m16, &mut o16, &x, &mut scaler);
    }
    assert_eq!(scaler.applied_steps(), 10);
    let (bn16, bn32, bn0) = (&m16.0.1, &m32.0.1, &init.0.1);
    for (what, got, want, before) in [
        (
            "running mean",
            bn16.running_mean.as_vec(),
            bn32.running_mean.as_vec(),
            bn0.running_mean.as_vec(),
        ),
        (
            "running var",
            bn16.running_var.as_vec(),
            bn32.running_var.as_vec(),
            bn0.running_var.as_vec(),
        ),
    ] {
        assert!(rel(&got, &before) > 0.1, "the {what} barely moved");
        let err = rel(&got, &want);
        assert!(err < 1e-2, "{what} {err} from the f32 twin's");
    }
    let err = rel(&values(&m16), &values(&m32));
    assert!(err < 1e-2, "parameters {err} from the f32 twin's");
    // the trunk frozen
    let mut m = init.clone();
    let mut o = opts(&m);
    let x: X8 = dev.sample_normal();
    let frozen = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        normed_head(&mut m, &mut o, &x, &mut GradScaler::default());
    }));
    let said = frozen
        .expect_err("statistics of a frozen trunk were left behind")
        .downcast::<String>()
        .map(|s| *s)
        .unwrap_or_default();
    assert!(
        said.contains("changed batch-norm statistics in no part the step updates"),
        "{said}"
    );
    assert_eq!(value_bits(&m), value_bits(&init));
}

/// By hand, on either working copy (the model's own layers in f16, or mpx's): a non-finite
/// gradient skips every part it reaches, and a part of another model is an error, not a part
/// judged on nothing.
#[test]
fn parts_by_hand_skip_on_their_own_gradients_and_must_be_the_model_s() {
    let dev = Cpu::seed_from_u64(17);
    let init = dev.build_module::<(Trunk, Head), f32>();
    let mut bad = [[0.5f32; 4]; 8];
    bad[3][1] = f32::NAN;
    let x: X8 = dev.tensor(bad);
    for mapped in [false, true] {
        let mut m = init.clone();
        let (mut ot, mut oh) = part_opts(&m);
        let (trunk, head) = (MixedPart::new(), MixedPart::new());
        let mut scaler = GradScaler::<f16>::default();
        let parts = vec![trunk.of(&m.0).unwrap(), head.of(&m.1).unwrap()];
        let xt = x.trace(m.alloc_grads());
        let out = if mapped {
            scaler.forward_parts(&m, Mapped, parts, xt, |w, x| w.forward(x))
        } else {
            scaler.forward_parts(&m, Plain, parts, xt, |w, x| w.forward(x))
        }
        .unwrap();
        let grads = scaler.backward(out.square().mean()).unwrap();
        for outcome in [
            scaler
                .update_part(&trunk, &mut m.0, &mut ot, &grads)
                .unwrap(),
            scaler
                .update_part(&head, &mut m.1, &mut oh, &grads)
                .unwrap(),
        ] {
            assert!(!outcome.is_applied(), "mapped {mapped}: {outcome:?}");
        }
        assert_eq!(value_bits(&m), value_bits(&init));
        // a part of another model
        let other = init.clone();
        let err = scaler
            .forward_parts(
                &m,
                Mapped,
                vec![head.of(&other.1).unwrap()],
                x.trace(m.alloc_grads()),
                |w, x| w.forward(x),
            )
            .unwrap_err();
        assert!(matches!(err, StepError::NotAPart { .. }), "{err}");
    }
}

/// Parts by hand that could leave a tensor unjudged are errors: two parts that share a tensor (a
/// part given twice, a field and a field of it: the shared tensor would be judged for one
/// update only), and an update through the state of another part (the part it names was not
/// judged for it), even one of the same type in another model.
#[test]
fn parts_by_hand_that_share_a_tensor_or_swap_their_states_are_errors() {
    let dev = Cpu::seed_from_u64(18);
    let init = dev.build_module::<(Trunk, Head), f32>();
    let x: X8 = dev.sample_normal();
    let mut m = init.clone();
    let (mut ot, mut oh) = part_opts(&m);
    let (trunk, head, inner) = (MixedPart::new(), MixedPart::new(), MixedPart::new());
    let mut scaler = GradScaler::<f16>::default();
    for parts in [
        vec![trunk.of(&m.0).unwrap(), inner.of(&m.0.0).unwrap()],
        vec![head.of(&m.1).unwrap(), inner.of(&m.1).unwrap()],
    ] {
        let err = scaler
            .forward_parts(&m, Mapped, parts, x.trace(m.alloc_grads()), |w, x| {
                w.forward(x)
            })
            .unwrap_err();
        assert!(matches!(err, StepError::PartsOverlap { .. }), "{err}");
    }
    // the trunk frozen, the head a part; its state then names the trunk, or another model's head
    let mut other = init.clone();
    let parts = vec![head.of(&m.1).unwrap()];
    let out = scaler
        .forward_parts(&m, Mapped, parts, x.trace(m.alloc_grads()), |w, x| {
            w.forward(x)
        })
        .unwrap();
    let grads = scaler.backward(out.square().mean()).unwrap();
    let err = scaler
        .update_part(&head, &mut m.0, &mut ot, &grads)
        .unwrap_err();
    assert!(matches!(err, StepError::OtherPart { .. }), "{err}");
    let err = scaler
        .update_part(&head, &mut other.1, &mut oh, &grads)
        .unwrap_err();
    assert!(matches!(err, StepError::OtherPart { .. }), "{err}");
    assert_eq!(value_bits(&m), value_bits(&init));
    assert_eq!(value_bits(&other), value_bits(&init));
    // the part it was made of is updated
    let outcome = scaler
        .update_part(&head, &mut m.1, &mut oh, &grads)
        .unwrap();
    assert!(outcome.is_applied(), "{outcome:?}");
    assert_ne!(value_bits(&m.1), value_bits(&init.1));
}

// ---- helper methods of the module's own, a tuple struct, a tuple output ------------------------

/// A variational autoencoder as users write one: a tuple struct whose forward pass calls a
/// helper method (`encode`, in an inherent impl that also carries `#[half_forward]`) and returns
/// the reconstruction with the log-variance, the reparameterisation's `exp` in f32. Its noise is
/// an operand whose element type the code leaves to inference: in the twin of emulated bf16
/// (f32 storage) the operators' dispatch settled it as f16, a compile error; `E::ONE`,
/// `E::from_f64` and `E::to_f32`, and a number's `sqrt` and `recip` through the impl's bound
/// `E: num_traits::Float`, were compile errors in every twin.
#[derive(Clone, mpx::HalfLayers)]
struct Vae<E: Dtype, D: Device<E>>(
    dfdx::nn::modules::Linear<4, 8, E, D>,
    dfdx::nn::modules::Linear<8, 2, E, D>,
    dfdx::nn::modules::Linear<8, 2, E, D>,
    dfdx::nn::modules::Linear<2, 4, E, D>,
);

impl<E, D: Device<E>> TensorCollection<E, D> for Vae<E, D>
where
    E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform,
{
    type To<E2: Dtype, D2: Device<E2>> = Vae<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            (
                Self::module("0", |s| &s.0, |s| &mut s.0),
                Self::module("1", |s| &s.1, |s| &mut s.1),
                Self::module("2", |s| &s.2, |s| &mut s.2),
                Self::module("3", |s| &s.3, |s| &mut s.3),
            ),
            |(a, b, c, d)| Vae(a, b, c, d),
        )
    }
}

type Z<E, D> = Tensor<Rank2<6, 2>, E, D, OwnedTape<E, D>>;

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> Vae<E, D> {
    /// A constructor in the same impl (no twin: it builds the master's layers).
    fn new(
        enc: dfdx::nn::modules::Linear<4, 8, E, D>,
        mu: dfdx::nn::modules::Linear<8, 2, E, D>,
        logvar: dfdx::nn::modules::Linear<8, 2, E, D>,
        dec: dfdx::nn::modules::Linear<2, 4, E, D>,
    ) -> Self {
        Self(enc, mu, logvar, dec)
    }

    /// The mean and the log-variance of `x`'s code.
    fn encode(&self, x: Tensor<Rank2<6, 4>, E, D, OwnedTape<E, D>>) -> (Z<E, D>, Z<E, D>) {
        let (h, tape) = self.0.forward(x).tanh().split_tape();
        (
            self.1.forward(h.clone().put_tape(tape)),
            self.2.forward(h.retaped()),
        )
    }
}

#[mpx::half_forward]
impl<E, D: Device<E>> Module<Tensor<Rank2<6, 4>, E, D, OwnedTape<E, D>>> for Vae<E, D>
where
    E: Dtype + num_traits::Float,
{
    type Output = (Tensor<Rank2<6, 4>, E, D, OwnedTape<E, D>>, Z<E, D>);
    type Error = D::Err;
    fn try_forward(
        &self,
        x: Tensor<Rank2<6, 4>, E, D, OwnedTape<E, D>>,
    ) -> Result<Self::Output, D::Err> {
        // a fixed draw of the noise, so that both runs see the same
        // (its element type left to inference, from the binding's; `E`'s items by their traits)
        // 0.3, through the methods `num_traits::Float` (a bound of the impl) brings to a number
        let unit = E::from_usize(4).unwrap().sqrt().recip() * E::from_f32(2.0).unwrap();
        let eps: Tensor<Rank2<6, 2>, E, D> = x.device().ones() * (unit * E::from_f64(0.3).unwrap());
        let half = E::from_f32(E::to_f32(&E::ONE).unwrap() / 2.0).unwrap() + E::default();
        let (mu, logvar) = self.encode(x);
        let (lv, tape) = logvar.split_tape();
        let std = (lv.clone().put_tape(tape) * half).exp();
        Ok((self.3.forward(mu + std * eps), lv.retaped()))
    }
}

type VaeF32 = Vae<f32, Cpu>;

/// One step, written once: in f32 as `$f32`, and through `#[mixed_step]` (f16) as `$mixed`.
macro_rules! twin_steps {
    ($f32:ident, $mixed:ident, ($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        fn $f32($($arg: $ty),*) $(-> $ret)? $body
        #[mixed_step(scaling = scaler)]
        fn $mixed($($arg: $ty,)* scaler: &mut GradScaler) $(-> $ret)? $body
    };
}

/// The parameters of a mixed run within 1% (normwise) of the f32 twin's, which moved ten times
/// further from the start than that.
fn trained_like_f32(mixed: &[f32], f32: &[f32], init: &[f32]) {
    let err = rel(mixed, f32);
    assert!(err < 1e-2, "mixed vs f32: {err:e}");
    assert!(rel(mixed, init) > 10.0 * err, "the model trained");
}

/// What a step of a twin returns: its loss (compared), or nothing.
trait Compared: std::fmt::Debug {
    /// Whether the mixed step's `self` is the f32 twin's `want` within 1%.
    fn close_to(&self, want: &Self) -> bool;
}
impl Compared for f32 {
    fn close_to(&self, want: &f32) -> bool {
        (self - want).abs() <= 1e-2 * want.abs()
    }
}
impl Compared for () {
    fn close_to(&self, _: &()) -> bool {
        true
    }
}

/// Runs `steps` steps of a twin, `step(k, scaler)` returning the f32 step's result and the mixed
/// step's: every mixed step ran on mpx's layers in f16, its loss (where the steps return one)
/// within 1% of the f32 twin's.
fn in_lock_step<T: Compared>(
    steps: u64,
    scaler: &mut GradScaler,
    mut step: impl FnMut(u64, &mut GradScaler) -> (T, T),
) {
    for k in 0..steps {
        let (want, got) = step(k, scaler);
        assert!(got.close_to(&want), "step {k}: {got:?} against {want:?}");
        let last = scaler.last_step().unwrap();
        assert!(last.mpx_layers, "step {k} ran on dfdx's layers");
        assert_eq!(last.precision, DType::Float16);
    }
}

twin_steps!(vae_step_f32, vae_step, (m: &mut VaeF32, opt: &mut Adam<VaeF32, f32, Cpu>, x: &X6) -> f32 {
    let (rec, logvar) = m.forward(x.trace(m.alloc_grads()));
    let loss = mse_loss(rec, x.clone()) + logvar.square().mean() * 0.1;
    let v = loss.array();
    let grads = loss.backward();
    opt.update(m, &grads).unwrap();
    v
});

#[test]
fn a_module_whose_forward_calls_its_own_helper_methods_runs_on_mpx_layers() {
    let dev = Cpu::seed_from_u64(5);
    let init = Vae::<f32, Cpu>::new(
        BuildModule::build(&dev),
        BuildModule::build(&dev),
        BuildModule::build(&dev),
        BuildModule::build(&dev),
    );
    let (mut a, mut b) = (init.clone(), init.clone());
    let (mut oa, mut ob) = (
        Adam::new(&a, Default::default()),
        Adam::new(&b, Default::default()),
    );
    let mut scaler = GradScaler::default();
    in_lock_step(5, &mut scaler, |k, s| {
        let (x, _) = batch(k);
        (
            vae_step_f32(&mut a, &mut oa, &x),
            vae_step(&mut b, &mut ob, &x, s),
        )
    });
    assert_eq!(scaler.applied_steps(), 5);
    trained_like_f32(&values(&b), &values(&a), &values(&init));
}

// ---- tensors of other element types in a module of the user's own --------------------------------

/// A module of the user's own with an index table and a mask among its fields (`usize` and
/// `bool` tensors): carried into the working copy as they are. The derive took every `Tensor`
/// field for one of the element type, a compile error.
#[derive(Clone, mpx::HalfLayers)]
struct Permuted<E: Dtype, D: Device<E>> {
    l: dfdx::nn::modules::Linear<4, 3, E, D>,
    rows: Tensor<Rank1<6>, usize, D>,
    keep: Tensor<Rank2<6, 3>, bool, D>,
}

impl<E, D: Device<E>> TensorCollection<E, D> for Permuted<E, D>
where
    E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform,
{
    type To<E2: Dtype, D2: Device<E2>> = Permuted<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(Self::module("l", |s| &s.l, |s| &mut s.l), |_| {
            unreachable!("the tests build it by hand")
        })
    }
}

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> Module<Tensor<Rank2<6, 4>, E, D, OwnedTape<E, D>>> for Permuted<E, D> {
    type Output = Tensor<Rank2<6, 3>, E, D, OwnedTape<E, D>>;
    type Error = D::Err;
    fn try_forward(
        &self,
        x: Tensor<Rank2<6, 4>, E, D, OwnedTape<E, D>>,
    ) -> Result<Self::Output, D::Err> {
        let y: Tensor<Rank2<6, 3>, E, D, OwnedTape<E, D>> =
            self.l.try_forward(x)?.try_gather(self.rows.clone())?;
        let zeros: Tensor<Rank2<6, 3>, E, D> = y.device().zeros();
        self.keep.clone().try_choose(y, zeros)
    }
}

type PermutedF32 = Permuted<f32, Cpu>;

twin_steps!(permuted_step_f32, permuted_step, (m: &mut PermutedF32, opt: &mut Sgd<PermutedF32, f32, Cpu>, x: &X6, y: &Y6) {
    let loss = mse_loss(m.forward(x.trace(m.alloc_grads())), y.clone());
    opt.update(m, &loss.backward()).unwrap();
});

#[test]
fn index_and_mask_tensors_of_a_users_module_are_carried_as_they_are() {
    let dev = Cpu::seed_from_u64(6);
    let init = Permuted::<f32, Cpu> {
        l: BuildModule::build(&dev),
        rows: dev.tensor([5, 0, 4, 1, 3, 2]),
        keep: dev.tensor([[true, false, true]; 6]),
    };
    let (mut a, mut b) = (init.clone(), init.clone());
    let cfg = SgdConfig {
        lr: 0.1,
        ..Default::default()
    };
    let (mut oa, mut ob) = (Sgd::new(&a, cfg), Sgd::new(&b, cfg));
    let mut scaler = GradScaler::default();
    in_lock_step(5, &mut scaler, |k, s| {
        let (x, y) = batch(k);
        (
            permuted_step_f32(&mut a, &mut oa, &x, &y),
            permuted_step(&mut b, &mut ob, &x, &y, s),
        )
    });
    trained_like_f32(&values(&b), &values(&a), &values(&init));
    // the mask's column left out gets no gradient: its weights stay as they were
    assert_eq!(b.l.weight.as_vec()[4..8], init.l.weight.as_vec()[4..8]);
}

// ---- a field the forward pass assigns to -----------------------------------------------------------

/// A module of the user's own that keeps a running average of its output in a tensor its walk
/// does not train (`#[half_layers(state)]`), assigned in `forward_mut`: the step writes it back,
/// as batch norm's statistics.
#[derive(Clone, mpx::HalfLayers)]
struct Averaged<E: Dtype, D: Device<E>> {
    l: dfdx::nn::modules::Linear<4, 3, E, D>,
    #[half_layers(state)]
    avg: Tensor<Rank1<3>, E, D>,
}

impl<E, D: Device<E>> TensorCollection<E, D> for Averaged<E, D>
where
    E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform,
{
    type To<E2: Dtype, D2: Device<E2>> = Averaged<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            (
                Self::module("l", |s| &s.l, |s| &mut s.l),
                Self::tensor(
                    "avg",
                    |s| &s.avg,
                    |s| &mut s.avg,
                    TensorOptions::detached(|t| {
                        t.try_fill_with_zeros()?;
                        Ok(())
                    }),
                ),
            ),
            |(l, avg)| Averaged { l, avg },
        )
    }
}

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> ModuleMut<Tensor<Rank2<6, 4>, E, D, OwnedTape<E, D>>>
    for Averaged<E, D>
{
    type Output = Tensor<Rank2<6, 3>, E, D, OwnedTape<E, D>>;
    type Error = D::Err;
    fn try_forward_mut(
        &mut self,
        x: Tensor<Rank2<6, 4>, E, D, OwnedTape<E, D>>,
    ) -> Result<Self::Output, D::Err> {
        let (y, tape) = self.l.try_forward(x)?.split_tape();
        let (keep, add) = (E::from_f32(0.9).unwrap(), E::from_f32(0.1).unwrap());
        self.avg = self.avg.clone() * keep + y.clone().mean::<Rank1<3>, _>() * add;
        Ok(y.put_tape(tape))
    }
}

type AveragedF32 = Averaged<f32, Cpu>;

twin_steps!(averaged_step_f32, averaged_step, (m: &mut AveragedF32, opt: &mut Sgd<AveragedF32, f32, Cpu>, x: &X6) {
    let loss = m.forward_mut(x.trace(m.alloc_grads())).square().mean();
    opt.update(m, &loss.backward()).unwrap();
});

#[test]
fn a_state_tensor_the_forward_pass_assigns_reaches_the_module() {
    let dev = Cpu::seed_from_u64(7);
    let init = Averaged::<f32, Cpu> {
        l: BuildModule::build(&dev),
        avg: dev.zeros(),
    };
    let (mut a, mut b) = (init.clone(), init.clone());
    let (mut oa, mut ob) = (
        Sgd::new(&a, Default::default()),
        Sgd::new(&b, Default::default()),
    );
    let mut scaler = GradScaler::default();
    in_lock_step(3, &mut scaler, |k, s| {
        let (x, _) = batch(k);
        (
            averaged_step_f32(&mut a, &mut oa, &x),
            averaged_step(&mut b, &mut ob, &x, s),
        )
    });
    let (want, got) = (a.avg.as_vec(), b.avg.as_vec());
    assert!(
        want.iter().any(|v| v.abs() > 1e-3),
        "the average moved: {want:?}"
    );
    let err = rel(&got, &want);
    assert!(
        err < 1e-2,
        "running average, mixed {got:?} against f32 {want:?}: {err:e}"
    );
}

// ---- what a forward pass changes outside the tensors ----------------------------------------------

/// A module of the user's own whose `forward_mut` keeps state outside its tensors: a call
/// counter, a history (`Vec::push`), a temperature annealed in a helper method, which scales the
/// output, and a phase of a type of the user's own (`#[half_layers(keep)]`: no layer). Each pass
/// runs on a working copy; what it
/// changed in those fields comes back to the module, as f32 leaves it there (they stayed as
/// built: 0, empty, 1.0, the warm-up), whether the step calls the model or the module as a field
/// of it. Its layers are a tuple, which the derive takes for layers though it is no named type.
#[derive(Clone, Debug, mpx::HalfLayers)]
struct Counted<E: Dtype, D: Device<E>> {
    l: (dfdx::nn::modules::Linear<4, 3, E, D>, ReLU),
    calls: usize,
    history: Vec<f32>,
    temp: f32,
    #[half_layers(keep)]
    phase: Phase,
}

/// A type of the user's own in a module: carried into the working copy as it is.
#[derive(Clone, Debug, PartialEq)]
enum Phase {
    WarmUp(usize),
    Train,
}

impl<E, D: Device<E>> TensorCollection<E, D> for Counted<E, D>
where
    E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform,
{
    type To<E2: Dtype, D2: Device<E2>> = Counted<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(Self::module("l", |s| &s.l, |s| &mut s.l), |l| Counted {
            l,
            calls: 0,
            history: Vec::new(),
            temp: 1.0,
            phase: Phase::WarmUp(2),
        })
    }
}

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> Counted<E, D> {
    fn anneal(&mut self) {
        self.temp *= 0.5;
        self.history.push(self.temp);
    }
}

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> ModuleMut<Tensor<Rank2<6, 4>, E, D, OwnedTape<E, D>>>
    for Counted<E, D>
{
    type Output = Tensor<Rank2<6, 3>, E, D, OwnedTape<E, D>>;
    type Error = D::Err;
    fn try_forward_mut(
        &mut self,
        x: Tensor<Rank2<6, 4>, E, D, OwnedTape<E, D>>,
    ) -> Result<Self::Output, D::Err> {
        self.calls += 1;
        self.anneal();
        if let Phase::WarmUp(left) = &mut self.phase {
            *left -= 1;
            if *left == 0 {
                self.phase = Phase::Train;
            }
        }
        Ok(self.l.try_forward(x)? * E::from_f32(1.0 + self.temp).unwrap())
    }
}

/// In a tuple, as a model of dfdx's layers holds a module of the user's own.
type CountedModel = (Counted<f32, Cpu>, Tanh);

twin_steps!(counted_step_f32, counted_step, (m: &mut CountedModel, opt: &mut Sgd<CountedModel, f32, Cpu>, x: &X6) -> f32 {
    let loss = m.forward_mut(x.trace(m.alloc_grads())).square().mean();
    let v = loss.array();
    opt.update(m, &loss.backward()).unwrap();
    v
});

// the module called as a field of the model (`m.0.forward_mut(..)`), the rest of the model after
twin_steps!(counted_field_step_f32, counted_field_step, (m: &mut CountedModel, opt: &mut Sgd<CountedModel, f32, Cpu>, x: &X6) -> f32 {
    let loss = m.0.forward_mut(x.trace(m.alloc_grads())).tanh().square().mean();
    let v = loss.array();
    opt.update(m, &loss.backward()).unwrap();
    v
});

#[test]
fn what_a_forward_pass_changes_outside_the_tensors_reaches_the_module() {
    let dev = Cpu::seed_from_u64(8);
    let init: CountedModel = (
        Counted {
            l: (BuildModule::build(&dev), ReLU),
            calls: 0,
            history: Vec::new(),
            temp: 1.0,
            phase: Phase::WarmUp(2),
        },
        Tanh,
    );
    let (mut a, mut b) = (init.clone(), init.clone());
    let (mut oa, mut ob) = (
        Sgd::new(&a, Default::default()),
        Sgd::new(&b, Default::default()),
    );
    let mut scaler = GradScaler::default();
    // the temperature scales the output: a pass that saw it reset would differ
    in_lock_step(4, &mut scaler, |k, s| {
        let (x, _) = batch(k);
        if k < 3 {
            (
                counted_step_f32(&mut a, &mut oa, &x),
                counted_step(&mut b, &mut ob, &x, s),
            )
        } else {
            (
                counted_field_step_f32(&mut a, &mut oa, &x),
                counted_field_step(&mut b, &mut ob, &x, s),
            )
        }
    });
    assert_eq!(a.0.calls, 4);
    assert_eq!(b.0.calls, a.0.calls);
    assert_eq!(b.0.history, a.0.history);
    assert_eq!(b.0.temp, a.0.temp);
    assert_eq!((&a.0.phase, &b.0.phase), (&Phase::Train, &Phase::Train));
    trained_like_f32(&values(&b), &values(&a), &values(&init));

    // the runtime API's `forward_mut` takes the same back
    let mut model = Mixed::mapped(init.0.clone());
    let (x, _) = batch(3);
    let grads = model.alloc_grads();
    let y = scaler
        .forward_mut(&mut model, x.trace(grads), |m, x| m.forward_mut(x))
        .unwrap();
    drop(scaler.backward(y.square().mean()).unwrap());
    assert_eq!(
        (model.calls, model.temp, &model.phase),
        (1, 0.5, &Phase::WarmUp(1))
    );
    assert_eq!(model.history, [0.5]);
}

// ---- a transformer block by hand ------------------------------------------------------------------

/// A transformer block of the user's own: dfdx's attention and layer norms, residuals written
/// out, the feed-forward part in a helper method, the impl bounded `E: num_traits::Float` as
/// dfdx's attention needs.
#[derive(Clone, mpx::HalfLayers)]
struct Block<E: Dtype, D: Device<E>> {
    attn: dfdx::nn::modules::MultiHeadAttention<16, 2, 16, 16, E, D>,
    ln1: LayerNorm1D<16, E, D>,
    ff1: dfdx::nn::modules::Linear<16, 32, E, D>,
    ff2: dfdx::nn::modules::Linear<32, 16, E, D>,
    ln2: LayerNorm1D<16, E, D>,
}

impl<E, D: Device<E>> TensorCollection<E, D> for Block<E, D>
where
    E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform,
{
    type To<E2: Dtype, D2: Device<E2>> = Block<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            (
                Self::module("attn", |s| &s.attn, |s| &mut s.attn),
                Self::module("ln1", |s| &s.ln1, |s| &mut s.ln1),
                Self::module("ff1", |s| &s.ff1, |s| &mut s.ff1),
                Self::module("ff2", |s| &s.ff2, |s| &mut s.ff2),
                Self::module("ln2", |s| &s.ln2, |s| &mut s.ln2),
            ),
            |(attn, ln1, ff1, ff2, ln2)| Block {
                attn,
                ln1,
                ff1,
                ff2,
                ln2,
            },
        )
    }
}

type Tokens<E, D, T> = Tensor<Rank3<4, 8, 16>, E, D, T>;

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> Block<E, D> {
    fn feed_forward(&self, x: Tokens<E, D, OwnedTape<E, D>>) -> Tokens<E, D, OwnedTape<E, D>> {
        self.ff2.forward(self.ff1.forward(x).relu())
    }
}

#[mpx::half_forward]
impl<E, D: Device<E>> Module<Tokens<E, D, OwnedTape<E, D>>> for Block<E, D>
where
    E: Dtype + num_traits::Float,
{
    type Output = Tokens<E, D, OwnedTape<E, D>>;
    type Error = D::Err;
    fn try_forward(&self, x: Tokens<E, D, OwnedTape<E, D>>) -> Result<Self::Output, D::Err> {
        let (x, tape) = x.split_tape();
        let a = self.attn.try_forward(x.clone().put_tape(tape))?;
        let x = self.ln1.try_forward(a + x)?;
        let (x, tape) = x.split_tape();
        let f = self.feed_forward(x.clone().put_tape(tape));
        self.ln2.try_forward(f + x)
    }
}

type BlockF32 = Block<f32, Cpu>;
type Tok = Tokens<f32, Cpu, NoneTape>;

twin_steps!(block_step_f32, block_step, (m: &mut BlockF32, opt: &mut Adam<BlockF32, f32, Cpu>, x: &Tok, y: &Tok) -> f32 {
    let loss = mse_loss(m.forward(x.trace(m.alloc_grads())), y.clone());
    let v = loss.array();
    opt.update(m, &loss.backward()).unwrap();
    v
});

#[test]
fn a_transformer_block_of_the_users_own_trains_like_its_f32_twin() {
    let dev = Cpu::seed_from_u64(8);
    let init = Block::<f32, Cpu> {
        attn: BuildModule::build(&dev),
        ln1: BuildModule::build(&dev),
        ff1: BuildModule::build(&dev),
        ff2: BuildModule::build(&dev),
        ln2: BuildModule::build(&dev),
    };
    let (mut a, mut b) = (init.clone(), init.clone());
    let (mut oa, mut ob) = (
        Adam::new(&a, Default::default()),
        Adam::new(&b, Default::default()),
    );
    let mut scaler = GradScaler::default();
    in_lock_step(5, &mut scaler, |_, s| {
        let x: Tok = dev.sample_normal();
        let y: Tok = dev.sample_normal();
        (
            block_step_f32(&mut a, &mut oa, &x, &y),
            block_step(&mut b, &mut ob, &x, &y, s),
        )
    });
    trained_like_f32(&values(&b), &values(&a), &values(&init));
}
