//! Real dfdx training loops, converted to mixed precision with the attribute alone.
//!
//! `tests/real_code/<name>.rs` is a training loop kept as its author wrote it, in f32: five
//! of dfdx 0.13.0's own examples (`06-mnist`, `rl-dqn`, `rl-ppo`, `13-housing-nn-in-struct`,
//! `generic-train-loop`; synthetic data in place of downloads; a loop of `main` moved into a
//! function keeps every line, `opt.update(&mut model, &grads)` included, and only gains the
//! signature around it), and six written the way dfdx users write the shapes those examples
//! lack: a GAN (two models, the generator trained through the discriminator), an actor-critic
//! (two models updated in one method), an agent generic through its `impl`, a step behind a
//! trait method, a generic step traced with `retaped::<OwnedTape<_, _>>()` that returns the
//! input's gradient, and a fit function with a step before its loop.
//! `tests/real_code/<name>_mixed.rs` is the same file converted: `#[mpx::mixed_step(scaling =
//! scaler)]` and one scaler declaration (a parameter, a local before the loop, or, for the
//! trait method, a field with its initialisation). The tests check
//! - that the conversion adds exactly those lines and changes nothing else;
//! - that the mixed f16 run trains from the same initial model and data to within a stated
//!   tolerance of the f32 run's losses, its forward passes in f16 (the agent generic through its
//!   `impl` runs in f32, and says so);
//! - that with an f32 working copy and scale 1 the converted loop gives parameters bit-identical
//!   to the original's (the loops whose model is not generic; the GAN's accumulated gradients
//!   are summed in another order, and are compared to a bound).

// The loops are other people's code, kept as written (one has 8 parameters once the scaler is
// added; `&mut model` on a `&mut` binding is their line, and plain Rust reborrows it), and the
// harness passes them around as closures.
#![allow(
    clippy::too_many_arguments,
    clippy::type_complexity,
    clippy::needless_borrow
)]

use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorRef,
};
use dfdx::optim::{Adam, Momentum, Sgd, SgdConfig};
use dfdx::prelude::*;
use mpx::precision::f16;
use mpx::scaling::{DynamicLossScale, NoOpLossScale};
use mpx::step::GradScaler;

#[path = "real_code/common.rs"]
pub mod common;

/// The loops as written, in f32.
#[allow(dead_code)] // the loops' own types keep items these tests do not call
mod original {
    pub use super::common;
    pub mod mnist {
        include!("real_code/mnist.rs");
    }
    pub mod dqn {
        include!("real_code/dqn.rs");
    }
    pub mod ppo {
        include!("real_code/ppo.rs");
    }
    pub mod housing {
        include!("real_code/housing.rs");
    }
    pub mod generic {
        include!("real_code/generic.rs");
    }
    pub mod gan {
        include!("real_code/gan.rs");
    }
    pub mod actor_critic {
        include!("real_code/actor_critic.rs");
    }
    pub mod agent {
        include!("real_code/agent.rs");
    }
    pub mod trait_step {
        include!("real_code/trait_step.rs");
    }
    pub mod retaped {
        include!("real_code/retaped.rs");
    }
    pub mod warmup {
        include!("real_code/warmup.rs");
    }
}

/// The converted loops, with an f16 working copy and a dynamic loss scale.
#[allow(dead_code)] // the loops' own types keep items these tests do not call
mod half {
    pub use super::common;
    pub type Scaler = mpx::step::GradScaler<mpx::precision::f16>;
    pub mod mnist {
        include!("real_code/mnist_mixed.rs");
    }
    pub mod dqn {
        include!("real_code/dqn_mixed.rs");
    }
    pub mod ppo {
        include!("real_code/ppo_mixed.rs");
    }
    pub mod housing {
        include!("real_code/housing_mixed.rs");
    }
    // generic over its model: runs on the model's own layers in f16, and the compiler says so
    // at its forward pass (a warning: `tests/ui`)
    #[allow(deprecated)]
    pub mod generic {
        include!("real_code/generic_mixed.rs");
    }
    pub mod gan {
        include!("real_code/gan_mixed.rs");
    }
    pub mod actor_critic {
        include!("real_code/actor_critic_mixed.rs");
    }
    // runs in f32, and the compiler says so at its forward pass (a warning: `tests/ui`)
    #[allow(deprecated)]
    pub mod agent {
        include!("real_code/agent_mixed.rs");
    }
    pub mod trait_step {
        include!("real_code/trait_step_mixed.rs");
    }
    // as `generic`
    #[allow(deprecated)]
    pub mod retaped {
        include!("real_code/retaped_mixed.rs");
    }
    pub mod warmup {
        include!("real_code/warmup_mixed.rs");
    }
}

/// The same converted loops with an f32 working copy and no scaling: the machinery alone.
#[allow(dead_code)] // the loops' own types keep items these tests do not call
mod identity {
    pub use super::common;
    pub type Scaler = mpx::step::GradScaler<f32, mpx::scaling::NoOpLossScale>;
    pub mod mnist {
        include!("real_code/mnist_mixed.rs");
    }
    pub mod dqn {
        include!("real_code/dqn_mixed.rs");
    }
    pub mod ppo {
        include!("real_code/ppo_mixed.rs");
    }
    pub mod housing {
        include!("real_code/housing_mixed.rs");
    }
    pub mod gan {
        include!("real_code/gan_mixed.rs");
    }
    pub mod actor_critic {
        include!("real_code/actor_critic_mixed.rs");
    }
    // runs in f32, and the compiler says so at its forward pass (a warning: `tests/ui`)
    #[allow(deprecated)]
    pub mod agent {
        include!("real_code/agent_mixed.rs");
    }
    pub mod trait_step {
        include!("real_code/trait_step_mixed.rs");
    }
    pub mod warmup {
        include!("real_code/warmup_mixed.rs");
    }
}

// ---- the conversions are the attribute and the scaler alone --------------------------------

/// Code lines (comments and blank lines left out) of `mixed` that are not in `original`, and of
/// `original` that are not in `mixed`, by a longest-common-subsequence diff.
fn changed_lines(original: &str, mixed: &str) -> (Vec<String>, Vec<String>) {
    let code = |s: &str| -> Vec<String> {
        s.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with("//"))
            .map(String::from)
            .collect()
    };
    let (a, b) = (code(original), code(mixed));
    let mut lcs = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut removed, mut added) = (0, 0, vec![], vec![]);
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            i += 1;
            j += 1;
        } else if j < b.len() && (i == a.len() || lcs[i][j + 1] >= lcs[i + 1][j]) {
            added.push(b[j].clone());
            j += 1;
        } else {
            removed.push(a[i].clone());
            i += 1;
        }
    }
    (added, removed)
}

#[test]
fn each_conversion_is_the_attribute_and_the_scaler_parameter() {
    let pairs = [
        (
            include_str!("real_code/mnist.rs"),
            include_str!("real_code/mnist_mixed.rs"),
        ),
        (
            include_str!("real_code/dqn.rs"),
            include_str!("real_code/dqn_mixed.rs"),
        ),
        (
            include_str!("real_code/ppo.rs"),
            include_str!("real_code/ppo_mixed.rs"),
        ),
        (
            include_str!("real_code/housing.rs"),
            include_str!("real_code/housing_mixed.rs"),
        ),
        (
            include_str!("real_code/generic.rs"),
            include_str!("real_code/generic_mixed.rs"),
        ),
    ];
    let with_parameter = [
        include_str!("real_code/gan.rs"),
        include_str!("real_code/gan_mixed.rs"),
        include_str!("real_code/actor_critic.rs"),
        include_str!("real_code/actor_critic_mixed.rs"),
        include_str!("real_code/agent.rs"),
        include_str!("real_code/agent_mixed.rs"),
        include_str!("real_code/retaped.rs"),
        include_str!("real_code/retaped_mixed.rs"),
    ];
    let pairs = pairs
        .into_iter()
        .chain(with_parameter.chunks(2).map(|p| (p[0], p[1])));
    for (original, mixed) in pairs {
        let (added, removed) = changed_lines(original, mixed);
        assert!(removed.is_empty(), "the conversion removed {removed:?}");
        assert_eq!(added.len(), 2, "{added:?}");
        assert_eq!(added[0], "#[mpx::mixed_step(scaling = scaler)]");
        assert_eq!(added[1], "scaler: &mut super::Scaler,");
    }
    // A local scaler declared before a step and a loop of them.
    let (added, removed) = changed_lines(
        include_str!("real_code/warmup.rs"),
        include_str!("real_code/warmup_mixed.rs"),
    );
    assert!(removed.is_empty(), "{removed:?}");
    assert_eq!(
        added,
        [
            "#[mpx::mixed_step(scaling = scaler)]",
            "let mut scaler = super::Scaler::default();"
        ]
    );
    // A trait method, whose signature is fixed: the field form, three lines.
    let (added, removed) = changed_lines(
        include_str!("real_code/trait_step.rs"),
        include_str!("real_code/trait_step_mixed.rs"),
    );
    assert!(removed.is_empty(), "{removed:?}");
    assert_eq!(
        added,
        [
            "scaler: super::Scaler,",
            "scaler: Default::default(),",
            "#[mpx::mixed_step(scaling = self.scaler)]"
        ]
    );
    // The diff itself notices a changed line.
    let (added, removed) = changed_lines("a\nb\nc\n", "a\nB\nc\n// note\n");
    assert_eq!(
        (added, removed),
        (vec!["B".to_string()], vec!["b".to_string()])
    );
}

// ---- helpers ---------------------------------------------------------------------------------

/// Every float of a model, in visit order.
fn params<M: TensorCollection<f32, Cpu>>(m: &M) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl TensorVisitor<f32, Cpu> for Collect {
        type Viewer = ViewTensorRef;
        type Err = CpuError;
        type E2 = f32;
        type D2 = Cpu;
        fn visit<S: Shape>(
            &mut self,
            _: TensorOptions<S, f32, Cpu>,
            t: &Tensor<S, f32, Cpu>,
        ) -> Result<Option<Tensor<S, f32, Cpu>>, CpuError> {
            self.0.extend(t.as_vec());
            Ok(None)
        }
    }
    let mut c = Collect(Vec::new());
    M::iter_tensors(&mut RecursiveWalker { m, f: &mut c }).unwrap();
    c.0
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `|mixed - f32| <= rel * |f32| + abs` for the last loss, and every loss finite.
fn assert_close(name: &str, f32_losses: &[f32], mixed: &[f32], rel: f32, abs: f32, falls: bool) {
    println!("{name}: f32 losses {f32_losses:?}\n{name}: f16 losses {mixed:?}");
    assert!(mixed.iter().all(|l| l.is_finite()), "{name}: {mixed:?}");
    let (a, b) = (*f32_losses.last().unwrap(), *mixed.last().unwrap());
    assert!(
        (a - b).abs() <= rel * a.abs() + abs,
        "{name}: final loss f16 {b} vs f32 {a} (tolerance {rel} x + {abs})"
    );
    if falls {
        // Training happened: the loss went down in both runs.
        assert!(
            a < f32_losses[0] && b < mixed[0],
            "{name}: {f32_losses:?} {mixed:?}"
        );
    }
}

// Tolerances: an f16 step rounds weights, activations and gradients to 11 significant bits
// (relative error 2^-11 ~ 5e-4 per value); over a few dozen steps of a small network these
// errors move the loss by well under 5%. We allow 5% of the f32 loss plus 0.01.
const REL: f32 = 0.05;
const ABS: f32 = 0.01;

// ---- the loops -------------------------------------------------------------------------------

#[test]
fn mnist_loop_converts_trains_and_is_exact_with_an_f32_working_copy() {
    let data = common::mnist::MnistTrainSet::new(256);
    let dev = Cpu::seed_from_u64(6);
    let init = dev.build_module::<common::mnist::MlpStructure, f32>();
    let run = |f: &dyn Fn(
        &mut common::mnist::Mlp,
        &mut Adam<common::mnist::Mlp, f32, Cpu>,
    ) -> Vec<f32>| {
        let mut model = init.clone();
        let mut opt = Adam::new(&model, Default::default());
        let losses = f(&mut model, &mut opt);
        (losses, params(&model))
    };
    let (l32, p32) = run(&|m, o| original::mnist::train(m, o, &data, 2));
    let mut scaler = GradScaler::<f16>::new(DynamicLossScale::default());
    let (l16, _) = run(&|m, o| {
        let mut s = GradScaler::<f16>::new(DynamicLossScale::default());
        let l = half::mnist::train(m, o, &data, 2, &mut s);
        assert_eq!(s.applied_steps() + s.skipped_steps(), 16);
        l
    });
    assert_close("mnist", &l32, &l16, REL, ABS, true);
    let (lid, pid) = run(&|m, o| {
        identity::mnist::train(
            m,
            o,
            &data,
            2,
            &mut GradScaler::<f32, _>::new(NoOpLossScale),
        )
    });
    assert_eq!(bits(&lid), bits(&l32));
    assert_eq!(bits(&pid), bits(&p32));
    // The state reports what the last step did.
    let _ = half::mnist::train(
        &mut init.clone(),
        &mut Adam::new(&init, Default::default()),
        &data,
        1,
        &mut scaler,
    );
    let last = scaler.last_step().unwrap();
    assert!(last.loss.is_finite() && last.scale > 0.0);
    assert_eq!(scaler.applied_steps() + scaler.skipped_steps(), 8);
}

struct RlData {
    state: Tensor<Rank2<64, 4>, f32, Cpu>,
    action: Tensor<Rank1<64>, usize, Cpu>,
    reward: Tensor<Rank1<64>, f32, Cpu>,
    done: Tensor<Rank1<64>, f32, Cpu>,
    next_state: Tensor<Rank2<64, 4>, f32, Cpu>,
}

fn rl_data(dev: &Cpu) -> RlData {
    let mut rng = common::Lcg::new(7);
    let rows = |rng: &mut common::Lcg| -> [[f32; 4]; 64] { std::array::from_fn(|_| rng.normals()) };
    RlData {
        state: dev.tensor(rows(&mut rng)),
        action: dev.tensor(std::array::from_fn::<usize, 64, _>(|i| (i + 1) % 2)),
        reward: dev.tensor(rng.normals::<64>()),
        done: dev.zeros(),
        next_state: dev.tensor(rows(&mut rng)),
    }
}

fn sgd_config() -> SgdConfig {
    SgdConfig {
        lr: 1e-1,
        momentum: Some(Momentum::Nesterov(0.9)),
        weight_decay: None,
    }
}

#[test]
fn dqn_loop_converts_trains_and_is_exact_with_an_f32_working_copy() {
    let dev = Cpu::seed_from_u64(1);
    let d = rl_data(&dev);
    let init = dev.build_module::<common::rl::QNetworkStructure, f32>();
    type Q = common::rl::QNetwork;
    let run = |f: &dyn Fn(&mut Q, &mut Q, &mut Sgd<Q, f32, Cpu>) -> Vec<f32>| {
        let (mut q, mut target) = (init.clone(), init.clone());
        let mut sgd = Sgd::new(&q, sgd_config());
        let l = f(&mut q, &mut target, &mut sgd);
        (l, params(&q))
    };
    let (l32, p32) = run(&|q, t, o| {
        original::dqn::train(
            q,
            t,
            o,
            &d.state,
            &d.action,
            &d.reward,
            &d.done,
            &d.next_state,
            3,
        )
    });
    let (l16, _) = run(&|q, t, o| {
        let mut s = GradScaler::<f16>::default();
        half::dqn::train(
            q,
            t,
            o,
            &d.state,
            &d.action,
            &d.reward,
            &d.done,
            &d.next_state,
            3,
            &mut s,
        )
    });
    // A Q-learning loss chases a moving target (the target network is refreshed every epoch): it
    // need not fall; every epoch's loss must match f32's.
    for e in 1..=l32.len() {
        assert_close("dqn", &l32[..e], &l16[..e], REL, ABS, false);
    }
    let (lid, pid) = run(&|q, t, o| {
        let mut s = GradScaler::<f32, _>::new(NoOpLossScale);
        identity::dqn::train(
            q,
            t,
            o,
            &d.state,
            &d.action,
            &d.reward,
            &d.done,
            &d.next_state,
            3,
            &mut s,
        )
    });
    assert_eq!(bits(&lid), bits(&l32));
    assert_eq!(bits(&pid), bits(&p32));
}

#[test]
fn ppo_loop_converts_trains_and_is_exact_with_an_f32_working_copy() {
    let dev = Cpu::seed_from_u64(2);
    let d = rl_data(&dev);
    let advantage = d.reward.clone();
    let init = dev.build_module::<common::rl::QNetworkStructure, f32>();
    type P = common::rl::PolicyNetwork;
    let run = |f: &dyn Fn(&mut P, &mut P, &mut Sgd<P, f32, Cpu>) -> Vec<f32>| {
        let (mut pi, mut target) = (init.clone(), init.clone());
        let mut sgd = Sgd::new(&pi, sgd_config());
        let l = f(&mut pi, &mut target, &mut sgd);
        (l, params(&pi))
    };
    let (l32, p32) =
        run(&|p, t, o| original::ppo::train(p, t, o, &d.state, &d.action, &advantage, 3));
    let (l16, _) = run(&|p, t, o| {
        half::ppo::train(
            p,
            t,
            o,
            &d.state,
            &d.action,
            &advantage,
            3,
            &mut GradScaler::default(),
        )
    });
    // PPO's loss is a (negative) surrogate, not bounded below by 0: compare absolutely.
    println!("ppo: f32 {l32:?}\nppo: f16 {l16:?}");
    assert!(l16.iter().all(|l| l.is_finite()));
    let (a, b) = (*l32.last().unwrap(), *l16.last().unwrap());
    assert!(
        (a - b).abs() <= REL * a.abs() + ABS,
        "ppo: f16 {b} vs f32 {a}"
    );
    let (lid, pid) = run(&|p, t, o| {
        let mut s = GradScaler::<f32, _>::new(NoOpLossScale);
        identity::ppo::train(p, t, o, &d.state, &d.action, &advantage, 3, &mut s)
    });
    assert_eq!(bits(&lid), bits(&l32));
    assert_eq!(bits(&pid), bits(&p32));
}

/// The example's data set: points in [-2, 2]^2, class 1 outside the unit circle.
fn housing_batches(
    n_batches: usize,
) -> Vec<(
    Tensor<(usize, Const<2>), f32, Cpu>,
    Tensor<(usize, Const<1>), f32, Cpu>,
)> {
    let dev = Cpu::default();
    let mut rng = common::Lcg::new(13);
    (0..n_batches)
        .map(|_| {
            let mut x = Vec::new();
            let mut y = Vec::new();
            for _ in 0..32 {
                let (a, b) = (rng.uniform() * 4.0 - 2.0, rng.uniform() * 4.0 - 2.0);
                x.extend([a, b]);
                y.push(if (a * a + b * b).sqrt() > 1.0 {
                    1.0
                } else {
                    0.0
                });
            }
            (
                dev.tensor_from_vec(x, (32usize, Const::<2>)),
                dev.tensor_from_vec(y, (32usize, Const::<1>)),
            )
        })
        .collect()
}

#[test]
fn housing_struct_method_converts_trains_and_is_exact_with_an_f32_working_copy() {
    let batches = housing_batches(16);
    let epochs = |learn: &mut dyn FnMut(
        Tensor<(usize, Const<2>), f32, Cpu>,
        Tensor<(usize, Const<1>), f32, Cpu>,
    ) -> f32| {
        (0..4)
            .map(|_| {
                batches
                    .iter()
                    .map(|(x, y)| learn(x.clone(), y.clone()))
                    .sum::<f32>()
                    / 16.0
            })
            .collect::<Vec<f32>>()
    };
    let mut p32 = original::housing::Predictor::new(3);
    let l32 = epochs(&mut |x, y| p32.learn_batch(x, y));
    let mut p16 = half::housing::Predictor::new(3);
    let mut s16 = GradScaler::<f16>::default();
    let l16 = epochs(&mut |x, y| p16.learn_batch(x, y, &mut s16));
    assert_close("housing", &l32, &l16, REL, ABS, true);
    assert_eq!(s16.applied_steps() + s16.skipped_steps(), 64);
    let mut pid = identity::housing::Predictor::new(3);
    let mut sid = GradScaler::<f32, _>::new(NoOpLossScale);
    let lid = epochs(&mut |x, y| pid.learn_batch(x, y, &mut sid));
    assert_eq!(bits(&lid), bits(&l32));
    assert_eq!(bits(&params(&pid.model)), bits(&params(&p32.model)));
    // The evaluation path (an untraced forward of the master) still runs in f32.
    let (x, _) = batches[0].clone();
    assert_eq!(p16.predict_batch(x.clone()).as_vec().len(), 32);
}

/// The data of `generic-train-loop.rs`'s `main`: 100 batches of 5 normal samples, label [0, 1].
fn generic_data(
    seed: u64,
) -> Vec<(
    Tensor<Rank2<5, 10>, f32, Cpu>,
    Tensor<Rank2<5, 2>, f32, Cpu>,
)> {
    let dev = Cpu::default();
    let mut rng = common::Lcg::new(seed);
    (0..100)
        .map(|_| {
            let x: [[f32; 10]; 5] = std::array::from_fn(|_| rng.normals());
            (dev.tensor(x), dev.tensor([[0.0, 1.0]; 5]))
        })
        .collect()
}

#[test]
fn generic_loop_converts_and_trains_like_f32() {
    type M = <Linear<10, 2> as BuildOnDevice<Cpu, f32>>::Built;
    let dev = Cpu::seed_from_u64(12);
    let init: M = dev.build_module::<Linear<10, 2>, f32>();
    let data = generic_data(5);
    let eval = |m: &M| -> f32 {
        data.iter()
            .map(|(x, y)| cross_entropy_with_logits_loss(m.forward(x.clone()), y.clone()).array())
            .sum::<f32>()
            / data.len() as f32
    };
    let (mut a, mut b) = (init.clone(), init.clone());
    let (mut oa, mut ob) = (
        Sgd::new(&a, Default::default()),
        Sgd::new(&b, Default::default()),
    );
    original::generic::classification_train(
        &mut a,
        &mut oa,
        cross_entropy_with_logits_loss,
        data.clone().into_iter(),
        1,
    )
    .unwrap();
    let mut s16 = GradScaler::<f16>::default();
    half::generic::classification_train(
        &mut b,
        &mut ob,
        cross_entropy_with_logits_loss,
        data.clone().into_iter(),
        1,
        &mut s16,
    )
    .unwrap();
    let (l0, l32, l16) = (eval(&init), eval(&a), eval(&b));
    println!("generic: loss before {l0}, after f32 {l32}, after f16 {l16}");
    assert!(l32 < 0.5 * l0, "{l0} -> {l32}");
    assert!(
        (l16 - l32).abs() <= REL * l32 + ABS,
        "f16 {l16} vs f32 {l32}"
    );
    assert_eq!(s16.applied_steps() + s16.skipped_steps(), 100);
    // The step was specialised (E = f32, D = Cpu) and its model bounds extended by the macro;
    // the model's weights moved in both runs.
    assert_ne!(bits(&params(&b)), bits(&params(&init)));
}

// ---- round 2: several models, any step shape -----------------------------------------------

/// Every step of `s` ran its forward passes in f16 on the half working copy.
fn assert_ran_in_f16<L: mpx::scaling::LossScale>(s: &GradScaler<f16, L>) {
    assert_eq!(
        s.last_step().expect("a step ran").precision,
        mpx::precision::DType::Float16
    );
}

fn gan_data() -> (
    Vec<Tensor<Rank2<32, 2>, f32, Cpu>>,
    Vec<Tensor<Rank2<32, 4>, f32, Cpu>>,
) {
    let dev = Cpu::default();
    let mut rng = common::Lcg::new(21);
    (0..40)
        .map(|_| {
            // real points: a ring of radius 2 around (1, -1)
            let real: [[f32; 2]; 32] = std::array::from_fn(|_| {
                let a = rng.uniform() * std::f32::consts::TAU;
                [1.0 + 2.0 * a.cos(), -1.0 + 2.0 * a.sin()]
            });
            let noise: [[f32; 4]; 32] = std::array::from_fn(|_| rng.normals());
            (dev.tensor(real), dev.tensor(noise))
        })
        .unzip()
}

#[test]
fn gan_two_models_one_scaler_trains_and_is_exact_with_an_f32_working_copy() {
    use common::gan::{Discriminator, DiscriminatorStructure, Generator, GeneratorStructure};
    let (real, noise) = gan_data();
    let dev = Cpu::seed_from_u64(3);
    let (g0, d0) = (
        dev.build_module::<GeneratorStructure, f32>(),
        dev.build_module::<DiscriminatorStructure, f32>(),
    );
    type Run<'a> = &'a dyn Fn(
        &mut Generator,
        &mut Discriminator,
        &mut Adam<Generator, f32, Cpu>,
        &mut Adam<Discriminator, f32, Cpu>,
    ) -> Vec<(f32, f32)>;
    let run = |f: Run<'_>| {
        let (mut g, mut d) = (g0.clone(), d0.clone());
        let mut go = Adam::new(&g, Default::default());
        let mut do_ = Adam::new(&d, Default::default());
        let l = f(&mut g, &mut d, &mut go, &mut do_);
        (l, params(&g), params(&d))
    };
    let (l32, g32, d32) = run(&|g, d, go, do_| original::gan::train(g, d, go, do_, &real, &noise));
    let (l16, _, _) = run(&|g, d, go, do_| {
        // grows by 2 after every 5 finite iterations: once per iteration, not per update
        let mut s = GradScaler::<f16>::new(
            DynamicLossScale::builder()
                .initial(4.0)
                .period(5)
                .build()
                .unwrap(),
        );
        let l = half::gan::train(g, d, go, do_, &real, &noise, &mut s);
        assert_eq!((s.applied_steps(), s.skipped_steps()), (80, 0));
        assert_eq!(s.loss_scale(), 4.0 * 2f32.powi(8));
        assert_ran_in_f16(&s);
        l
    });
    let (d32l, g32l): (Vec<f32>, Vec<f32>) = l32.iter().copied().unzip();
    let (d16l, g16l): (Vec<f32>, Vec<f32>) = l16.iter().copied().unzip();
    assert_close("gan discriminator", &d32l, &d16l, REL, ABS, false);
    assert_close("gan generator", &g32l, &g16l, REL, ABS, false);
    let (lid, gid, did) = run(&|g, d, go, do_| {
        let mut s = GradScaler::<f32, _>::new(NoOpLossScale);
        identity::gan::train(g, d, go, do_, &real, &noise, &mut s)
    });
    // The discriminator's gradients accumulate over two backward passes (real, then fake). In
    // f32, dfdx's weight-gradient GEMM adds the first pass's sum inside its dot products; the
    // working copy's gradients are summed apart and added after, so the two sums round in
    // another order: within a few ulps, not bit for bit (the other loops accumulate nothing and
    // are compared bit for bit). Bound: 2^-16 of the largest magnitude, about 500 f32 roundings.
    let flat = |v: &[(f32, f32)]| v.iter().flat_map(|&(a, b)| [a, b]).collect::<Vec<_>>();
    assert_rounding_apart("gan losses", &flat(&lid), &flat(&l32));
    assert_rounding_apart("generator", &gid, &g32);
    assert_rounding_apart("discriminator", &did, &d32);
    assert_ne!(bits(&g32), bits(&params(&g0)));
}

/// Every `got[i]` within 2^-16 of the largest `|want|` of `want[i]`: apart by summation order
/// alone, nowhere near f16's 2^-11.
fn assert_rounding_apart(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}");
    let scale = want.iter().fold(0.0f32, |m, w| m.max(w.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.is_finite() && (g - w).abs() <= scale * 2f32.powi(-16),
            "{name}[{i}]: {g} vs {w} (scale {scale})"
        );
    }
}

#[test]
fn actor_critic_two_models_in_one_method_trains_and_is_exact_with_an_f32_working_copy() {
    use common::rl::{ActorStructure, CriticStructure};
    let dev = Cpu::seed_from_u64(4);
    let d = rl_data(&dev);
    let (a0, c0) = (
        dev.build_module::<ActorStructure, f32>(),
        dev.build_module::<CriticStructure, f32>(),
    );
    macro_rules! agent {
        ($m:ident) => {
            $m::actor_critic::Agent {
                actor: a0.clone(),
                critic: c0.clone(),
                actor_opt: Adam::new(&a0, Default::default()),
                critic_opt: Adam::new(&c0, Default::default()),
            }
        };
    }
    let mut a32 = agent!(original);
    let l32: Vec<(f32, f32)> = (0..20)
        .map(|_| a32.update(d.state.clone(), d.action.clone(), d.reward.clone()))
        .collect();
    let mut a16 = agent!(half);
    let mut s16 = GradScaler::<f16>::default();
    let l16: Vec<(f32, f32)> = (0..20)
        .map(|_| {
            a16.update(
                d.state.clone(),
                d.action.clone(),
                d.reward.clone(),
                &mut s16,
            )
        })
        .collect();
    assert_eq!(s16.applied_steps() + s16.skipped_steps(), 40);
    assert_ran_in_f16(&s16);
    let (c32, c16): (Vec<f32>, Vec<f32>) = (
        l32.iter().map(|l| l.1).collect(),
        l16.iter().map(|l| l.1).collect(),
    );
    assert_close("critic", &c32, &c16, REL, ABS, true);
    // the actor's loss is a surrogate around 0: compare absolutely
    let (a, b) = (l32.last().unwrap().0, l16.last().unwrap().0);
    assert!(
        (a - b).abs() <= REL * a.abs() + ABS,
        "actor: f16 {b} vs f32 {a}"
    );
    let mut aid = agent!(identity);
    let mut sid = GradScaler::<f32, _>::new(NoOpLossScale);
    for (i, want) in l32.iter().enumerate() {
        let got = aid.update(
            d.state.clone(),
            d.action.clone(),
            d.reward.clone(),
            &mut sid,
        );
        assert_eq!(
            (got.0.to_bits(), got.1.to_bits()),
            (want.0.to_bits(), want.1.to_bits()),
            "update {i}"
        );
    }
    assert_eq!(bits(&params(&aid.actor)), bits(&params(&a32.actor)));
    assert_eq!(bits(&params(&aid.critic)), bits(&params(&a32.critic)));
}

/// Batches of a smooth regression target, for the regressor loops.
fn regress_data(
    n: usize,
) -> Vec<(
    Tensor<Rank2<32, 3>, f32, Cpu>,
    Tensor<Rank2<32, 1>, f32, Cpu>,
)> {
    let dev = Cpu::default();
    let mut rng = common::Lcg::new(31);
    (0..n)
        .map(|_| {
            let x: [[f32; 3]; 32] = std::array::from_fn(|_| rng.normals());
            let y: [[f32; 1]; 32] =
                std::array::from_fn(|i| [x[i][0].sin() + 0.5 * x[i][1] * x[i][2]]);
            (dev.tensor(x), dev.tensor(y))
        })
        .collect()
}

#[test]
fn agent_generic_through_its_impl_converts_and_runs_in_f32_saying_so() {
    use common::rl::CriticStructure;
    type Arch = (Linear<4, 16>, ReLU, Linear<16, 2>);
    let _ = std::marker::PhantomData::<CriticStructure>;
    let dev = Cpu::seed_from_u64(8);
    let d = rl_data(&dev);
    let targets: Tensor<Rank2<64, 2>, f32, Cpu> = dev.sample_normal();
    let mut a32 = original::agent::Agent::<Arch>::new(&Cpu::seed_from_u64(9));
    let mut a16 = half::agent::Agent::<Arch>::new(&Cpu::seed_from_u64(9));
    let mut s16 = GradScaler::<f16>::default();
    let mut l32 = Vec::new();
    let mut l16 = Vec::new();
    for _ in 0..30 {
        l32.push(a32.train(d.state.clone(), targets.clone()));
        l16.push(a16.train(d.state.clone(), targets.clone(), &mut s16));
    }
    assert_close("agent", &l32, &l16, REL, ABS, true);
    assert_eq!(s16.applied_steps(), 30);
    // The attribute on the method cannot see the `impl`'s `M`, so the half working copy's
    // forward pass cannot be type-checked: the step ran on the f32 master, with the scaler's
    // skip logic, and says so.
    assert_eq!(
        s16.last_step().unwrap().precision,
        mpx::precision::DType::Float32
    );
    assert_eq!(bits(&l16), bits(&l32));
    assert_eq!(bits(&params(&a16.model)), bits(&params(&a32.model)));
}

#[test]
fn trait_method_step_with_a_field_scaler_trains_and_is_exact_with_an_f32_working_copy() {
    use original::trait_step::Learner as _;
    let data = regress_data(24);
    let init = Cpu::seed_from_u64(10).build_module::<common::regress::Structure, f32>();
    let mut r32 = original::trait_step::Regressor::new(&init);
    let l32: Vec<f32> = data
        .iter()
        .map(|(x, y)| r32.learn(x.clone(), y.clone()))
        .collect();
    {
        use half::trait_step::Learner as _;
        let mut r16 = half::trait_step::Regressor::new(&init);
        let l16: Vec<f32> = data
            .iter()
            .map(|(x, y)| r16.learn(x.clone(), y.clone()))
            .collect();
        assert_close("trait step", &l32, &l16, REL, ABS, true);
    }
    use identity::trait_step::Learner as _;
    let mut rid = identity::trait_step::Regressor::new(&init);
    let lid: Vec<f32> = data
        .iter()
        .map(|(x, y)| rid.learn(x.clone(), y.clone()))
        .collect();
    assert_eq!(bits(&lid), bits(&l32));
    assert_eq!(bits(&params(&rid.model)), bits(&params(&r32.model)));
}

#[test]
fn retaped_generic_step_converts_trains_and_returns_the_input_gradient() {
    type Arch = (Linear<6, 16>, Tanh, Linear<16, 3>);
    let dev = Cpu::seed_from_u64(11);
    let init = dev.build_module::<Arch, f32>();
    let mut rng = common::Lcg::new(5);
    let batch: Tensor<Rank2<16, 6>, f32, Cpu> = dev.tensor(std::array::from_fn(|_| rng.normals()));
    let target: Tensor<Rank2<16, 3>, f32, Cpu> = dev.tensor(std::array::from_fn(|_| rng.normals()));
    let (mut m32, mut m16) = (init.clone(), init.clone());
    let mut o32 = Sgd::new(&m32, sgd_config());
    let mut o16 = Sgd::new(&m16, sgd_config());
    let mut s16 = GradScaler::<f16>::default();
    let (mut l32, mut l16) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        let (a, sa) =
            original::retaped::saliency_step(&mut m32, &mut o32, batch.clone(), target.clone());
        let (b, sb) = half::retaped::saliency_step(
            &mut m16,
            &mut o16,
            batch.clone(),
            target.clone(),
            &mut s16,
        );
        l32.push(a);
        l16.push(b);
        // The input's gradient came back through the half region, in f32: within f16's
        // rounding of a small network's gradient.
        let (sa, sb) = (sa.as_vec(), sb.as_vec());
        let norm = sa.iter().map(|v| v * v).sum::<f32>().sqrt();
        let diff = sa
            .iter()
            .zip(&sb)
            .map(|(x, y)| (x - y) * (x - y))
            .sum::<f32>()
            .sqrt();
        assert!(
            norm > 0.0 && diff <= 0.02 * norm + 1e-6,
            "saliency off by {diff} of {norm}"
        );
    }
    assert_close("retaped", &l32, &l16, REL, ABS, true);
    assert_ran_in_f16(&s16);
}

#[test]
fn a_step_before_the_loop_with_a_local_scaler_converts_and_is_exact_with_an_f32_working_copy() {
    let data = regress_data(20);
    let init = Cpu::seed_from_u64(12).build_module::<common::regress::Structure, f32>();
    let run = |f: &dyn Fn(
        &mut common::regress::Model,
        &mut Adam<common::regress::Model, f32, Cpu>,
    ) -> Vec<f32>| {
        let mut m = init.clone();
        let mut o = Adam::new(&m, Default::default());
        let l = f(&mut m, &mut o);
        (l, params(&m))
    };
    let (l32, p32) = run(&|m, o| original::warmup::fit(m, o, &data));
    let (l16, p16) = run(&|m, o| half::warmup::fit(m, o, &data));
    assert_close("warmup", &l32, &l16, REL, ABS, true);
    assert_ne!(bits(&p16), bits(&p32));
    let (lid, pid) = run(&|m, o| identity::warmup::fit(m, o, &data));
    assert_eq!(bits(&lid), bits(&l32));
    assert_eq!(bits(&pid), bits(&p32));
}
