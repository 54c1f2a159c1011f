//! The precision DSL end to end: `#[full_precision]` functions and methods.
//!
//! With an f32 working type (`H = f32`) an annotated function must give gradients bit-identical
//! to the same function without the attribute; with `H = f16` it must avoid the overflow a plain
//! f16 LayerNorm hits.

use dfdx::prelude::*;
use mpx::full_precision;
use mpx::precision::{Precision, bf16, f16, round_to_bf16};

type Ln<E> = dfdx::nn::modules::LayerNorm1D<8, E, Cpu>;
type X<E, T = NoneTape> = Tensor<Rank2<4, 8>, E, Cpu, T>;

mod common;
use common::bits::bits;

/// Rows with large values; row 0 sums past f16's max (65504).
fn big_rows() -> [[f32; 8]; 4] {
    [
        [30000.0, 30000.0, 30000.0, 30000.0, 1.0, 2.0, 3.0, 4.0],
        [0.5, -1.25, 2.0, 3.5, -0.75, 1.0, 0.25, -2.0],
        [100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0],
        [-3.0, 3.0, -3.0, 3.0, 1.5, -1.5, 0.0, 9.0],
    ]
}

fn weights(dev: &Cpu) -> X<f32> {
    let mut w = [[0.0f32; 8]; 4];
    for (i, row) in w.iter_mut().enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            *v = 0.1 + 0.05 * (i * 8 + j) as f32;
        }
    }
    dev.tensor(w)
}

fn layer_norm_module(dev: &Cpu) -> Ln<f32> {
    let mut ln = dev.build_module::<LayerNorm1D<8>, f32>();
    ln.gamma = dev.tensor([1.0, 0.5, 2.0, -1.0, 0.75, 1.5, 1.25, 0.25]);
    ln.beta = dev.tensor([0.1, -0.2, 0.3, 0.0, 0.5, -0.5, 1.0, 2.0]);
    ln
}

// ---- the functions under test, and their unannotated twins --------------------------------

/// LayerNorm (with gamma and beta) then softmax, in f32 whatever `H` is.
/// `X` is a type alias, which the attribute cannot see through: `inputs` names the argument.
#[full_precision(params = ln, inputs = x)]
fn norm_softmax<H: Precision, T: Tape<H::Elem, Cpu>>(
    ln: &Ln<H::Elem>,
    x: X<H::Elem, T>,
) -> X<H::Elem, T>
where
    Cpu: Device<H::Elem>,
{
    ln.forward(x).softmax::<Axis<1>>()
}

fn norm_softmax_plain<T: Tape<f32, Cpu>>(ln: &Ln<f32>, x: X<f32, T>) -> X<f32, T> {
    ln.forward(x).softmax::<Axis<1>>()
}

type V<E, T = NoneTape> = Tensor<Rank1<4>, E, Cpu, T>;

/// Several tensor arguments, one of them a tuple, and a plain argument captured as it is.
// The tuple of spelled-out tensor types is the form under test (an alias would need `inputs`).
#[allow(clippy::type_complexity)]
#[full_precision]
fn gated<H: Precision, T: Tape<H::Elem, Cpu>>(
    x: Tensor<Rank1<4>, H::Elem, Cpu, T>,
    (a, b): (
        Tensor<Rank1<4>, H::Elem, Cpu>,
        Tensor<Rank1<4>, H::Elem, Cpu>,
    ),
    scale: f32,
) -> Tensor<Rank1<4>, H::Elem, Cpu, T> {
    (x * a).exp() * b * scale
}

fn gated_plain<T: Tape<f32, Cpu>>(x: V<f32, T>, (a, b): (V<f32>, V<f32>), scale: f32) -> V<f32, T> {
    (x * a).exp() * b * scale
}

/// A block holding a half-precision LayerNorm; its `forward` runs the norm in f32.
struct Block<H: Precision>
where
    Cpu: Device<H::Elem>,
{
    ln: Ln<H::Elem>,
}

impl<H: Precision> Block<H>
where
    Cpu: Device<H::Elem>,
{
    #[full_precision(half = H, params = self.ln)]
    fn forward<T: Tape<H::Elem, Cpu>>(
        &self,
        x: Tensor<Rank2<4, 8>, H::Elem, Cpu, T>,
    ) -> Tensor<Rank2<4, 8>, H::Elem, Cpu, T> {
        self.ln.forward(x)
    }
}

// ---- tests ----------------------------------------------------------------------------------

#[test]
fn f32_working_type_gives_bit_identical_gradients() {
    let dev = Cpu::default();
    let ln = layer_norm_module(&dev);
    let x: X<f32> = dev.tensor(big_rows()).sqrt();
    let w = weights(&dev);

    let y = norm_softmax_plain(&ln, x.leaky_trace());
    let plain = (y * w.clone()).square().sum().backward();
    let y = norm_softmax::<f32, _>(&ln, x.leaky_trace());
    let annotated = (y * w.clone()).square().sum().backward();

    assert_eq!(
        bits(&plain.get(&x).as_vec()),
        bits(&annotated.get(&x).as_vec())
    );
    assert_eq!(
        bits(&plain.get(&ln.gamma).as_vec()),
        bits(&annotated.get(&ln.gamma).as_vec())
    );
    assert_eq!(
        bits(&plain.get(&ln.beta).as_vec()),
        bits(&annotated.get(&ln.beta).as_vec())
    );
    assert!(annotated.get(&ln.gamma).as_vec().iter().any(|g| *g != 0.0));
}

#[test]
fn several_arguments_and_tuples_are_bit_identical_with_f32() {
    let dev = Cpu::default();
    let x: V<f32> = dev.tensor([0.5, -1.0, 2.0, 0.25]);
    let a: V<f32> = dev.tensor([1.5, 0.5, -0.25, 3.0]);
    let b: V<f32> = dev.tensor([2.0, -1.0, 0.75, 0.1]);
    let c: V<f32> = dev.tensor([1.0, 2.0, 3.0, 4.0]);

    let y = gated_plain(x.leaky_trace(), (a.clone(), b.clone()), 0.3);
    let plain_y = y.retaped::<NoneTape>().as_vec();
    let plain = (y * c.clone()).sum().backward();
    let y = gated::<f32, _>(x.leaky_trace(), (a.clone(), b.clone()), 0.3);
    assert_eq!(bits(&plain_y), bits(&y.retaped::<NoneTape>().as_vec()));
    let annotated = (y * c.clone()).sum().backward();
    for t in [&x, &a, &b] {
        assert_eq!(
            bits(&plain.get(t).as_vec()),
            bits(&annotated.get(t).as_vec())
        );
    }
}

#[test]
fn layer_norm_overflows_in_f16_and_not_under_the_attribute() {
    let dev = Cpu::default();
    let ln16 = layer_norm_module(&dev).to_dtype::<f16>();
    let x16 = dev.tensor(big_rows()).to_dtype::<f16>();

    // Plain f16: row 0's sum passes 65504; its mean becomes inf and the row NaN.
    let plain = ln16.forward(x16.clone());
    assert!(plain.as_vec()[..8].iter().all(|v| v.is_nan()));

    // The same module through the attribute: finite, the f32 result rounded once to f16.
    let block = Block::<f16> { ln: ln16.clone() };
    let y = block.forward(x16.leaky_trace());
    let reference = ln16
        .to_dtype::<f32>()
        .forward(x16.clone().to_dtype::<f32>())
        .to_dtype::<f16>();
    assert_eq!(y.retaped::<NoneTape>().as_vec(), reference.as_vec());

    let g = (y * weights(&dev).to_dtype::<f16>()).sum().backward();
    for v in [
        g.get(&x16).as_vec(),
        g.get(&block.ln.gamma).as_vec(),
        g.get(&block.ln.beta).as_vec(),
    ] {
        assert!(v.iter().all(|v| v.is_finite()), "{v:?}");
    }
    assert!(
        g.get(&block.ln.beta)
            .as_vec()
            .iter()
            .any(|v| v.to_f32() != 0.0)
    );

    // And through a free function, generic over the half type.
    let y = norm_softmax::<f16, _>(&ln16, x16.clone());
    assert!(y.as_vec().iter().all(|v| v.is_finite()));
}

#[test]
fn bf16_output_is_rounded_to_bf16() {
    let dev = Cpu::default();
    let ln = layer_norm_module(&dev);
    let mut x: X<f32> = dev.tensor(big_rows());
    // Emulated bf16 stores f32 values that are bf16 values.
    let mut v = x.as_vec();
    round_to_bf16(&v.clone(), &mut v);
    x.copy_from(&v);

    let block = Block::<bf16> { ln: ln.clone() };
    let y = block.forward(x.clone());
    let exact = ln.forward(x).as_vec();
    let mut want = vec![0.0f32; exact.len()];
    round_to_bf16(&exact, &mut want);
    assert_eq!(bits(&y.as_vec()), bits(&want));
    assert_ne!(
        bits(&exact),
        bits(&want),
        "the rounding must be visible in this data"
    );
}

// ---- #[mixed_step] ---------------------------------------------------------------------------

mod step {
    use super::common::digits::{CLASSES, Digits, FEATURES};
    use dfdx::optim::{Adam, AdamConfig};
    use dfdx::prelude::*;
    use mpx::mixed_step;
    use mpx::scaling::DynamicLossScale;
    use mpx::step::{Batch, GradScaler, Mapped, Mixed};

    pub const BATCH: usize = 32;
    pub type Mlp = (Linear<FEATURES, 32>, ReLU, Linear<32, CLASSES>);
    pub type Model = <Mlp as BuildOnDevice<Cpu, f32>>::Built;
    pub type X = Tensor<Rank2<BATCH, FEATURES>, f32, Cpu>;
    pub type Y = Tensor<Rank2<BATCH, CLASSES>, f32, Cpu>;

    /// The f32 step as written for dfdx.
    pub fn f32_step(model: &mut Model, opt: &mut Adam<Model, f32, Cpu>, x: X, y: Y) -> f32 {
        let grads = model.alloc_grads();
        let logits = model.forward_mut(x.traced(grads));
        let loss = cross_entropy_with_logits_loss(logits, y);
        let loss_value = loss.array();
        let grads = loss.backward();
        opt.update(model, &grads).expect("update");
        loss_value
    }

    /// The same step, converted: the attribute and the scaler argument.
    #[mixed_step(scaling = scaler)]
    pub fn mixed(
        model: &mut Model,
        opt: &mut Adam<Model, f32, Cpu>,
        x: X,
        y: Y,
        scaler: &mut GradScaler,
    ) -> f32 {
        let grads = model.alloc_grads();
        let logits = model.forward_mut(x.traced(grads));
        let loss = cross_entropy_with_logits_loss(logits, y);
        let loss_value = loss.array();
        let grads = loss.backward();
        opt.update(model, &grads).expect("update");
        loss_value
    }

    /// The same step with its calls written by path (`Trait::method(receiver, ..)`), as generic
    /// code does to name a trait: the attribute reads them as the method calls they are.
    #[mixed_step(scaling = scaler)]
    pub fn by_path(
        model: &mut Model,
        opt: &mut Adam<Model, f32, Cpu>,
        x: X,
        y: Y,
        scaler: &mut GradScaler,
    ) -> f32 {
        let grads = model.alloc_grads();
        let logits = ModuleMut::forward_mut(model, x.traced(grads));
        let loss = cross_entropy_with_logits_loss(logits, y);
        let loss_value = loss.array();
        let grads = Backward::backward(loss);
        Optimizer::update(opt, model, &grads).expect("update");
        loss_value
    }

    /// The runtime calls the attribute stands for, written out (for this model of dfdx's
    /// `Linear` and `ReLU`, the working copy of mpx's layers: `Mixed::mapped`; the batch's
    /// gradient, which nothing reads, left out: `Batch`).
    pub fn by_hand(
        model: &mut Mixed<Model, Mapped>,
        opt: &mut Adam<Model, f32, Cpu>,
        x: X,
        y: Y,
        scaler: &mut GradScaler,
    ) -> f32 {
        let grads = model.alloc_grads();
        let logits = scaler
            .forward_mut(model, Batch(x.traced(grads)), |m, x| m.forward_mut(x))
            .expect("forward");
        let loss = cross_entropy_with_logits_loss(logits, y);
        let loss_value = loss.array();
        let grads = scaler.backward(loss).expect("backward");
        scaler.update(model, opt, &grads).expect("update");
        loss_value
    }

    pub fn batch(dev: &Cpu, d: &Digits, b: usize) -> (X, Y) {
        let x = dev.tensor_from_vec(
            d.train_x[b * BATCH * FEATURES..(b + 1) * BATCH * FEATURES].to_vec(),
            (Const::<BATCH>, Const::<FEATURES>),
        );
        let mut onehot = vec![0.0f32; BATCH * CLASSES];
        for (i, &c) in d.train_y[b * BATCH..(b + 1) * BATCH].iter().enumerate() {
            onehot[i * CLASSES + c] = 1.0;
        }
        (
            x,
            dev.tensor_from_vec(onehot, (Const::<BATCH>, Const::<CLASSES>)),
        )
    }

    pub fn accuracy(model: &Model, dev: &Cpu, d: &Digits) -> f32 {
        let mut correct = 0;
        for (i, &c) in d.test_y.iter().enumerate() {
            let x: Tensor<Rank1<FEATURES>, f32, Cpu> = dev.tensor_from_vec(
                d.test_x[i * FEATURES..(i + 1) * FEATURES].to_vec(),
                (Const::<FEATURES>,),
            );
            let logits = model.forward(x).as_vec();
            let best = (0..CLASSES)
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                .unwrap_or(0);
            correct += usize::from(best == c);
        }
        correct as f32 / d.test_len() as f32
    }

    pub fn scaler(initial: f32) -> GradScaler {
        GradScaler::new(
            DynamicLossScale::builder()
                .initial(initial)
                .period(10)
                .build()
                .expect("scale"),
        )
    }

    pub fn adam(model: &Model) -> Adam<Model, f32, Cpu> {
        Adam::new(
            model,
            AdamConfig {
                lr: 3e-3,
                ..Default::default()
            },
        )
    }
}

#[test]
fn mixed_step_is_exactly_the_runtime_calls_it_stands_for() {
    let dev = Cpu::default();
    let data = common::digits::Digits::load(0.2, 3);
    let mut a = dev.build_module::<step::Mlp, f32>();
    let mut b = mpx::step::Mixed::mapped(a.clone());
    let mut c = a.clone();
    let (mut oa, mut ob, mut oc) = (step::adam(&a), step::adam(&b), step::adam(&c));
    // A large initial scale: the first steps overflow in f16 and are skipped, then it recovers.
    let (mut sa, mut sb) = (step::scaler(2f32.powi(24)), step::scaler(2f32.powi(24)));
    let mut sc = step::scaler(2f32.powi(24));
    let mut skipped = 0;
    for i in 0..12 {
        let (x, y) = step::batch(&dev, &data, i);
        let before = common::params::value_bits(&a);
        let la = step::mixed(&mut a, &mut oa, x.clone(), y.clone(), &mut sa);
        let lb = step::by_hand(&mut b, &mut ob, x.clone(), y.clone(), &mut sb);
        let lc = step::by_path(&mut c, &mut oc, x, y, &mut sc);
        assert_eq!(la.to_bits(), lb.to_bits());
        assert_eq!(la.to_bits(), lc.to_bits());
        assert_eq!(sa.last_step(), sc.last_step());
        assert_eq!(
            common::params::value_bits(&a),
            common::params::value_bits(&c)
        );
        let (ra, rb) = (sa.last_step().unwrap(), sb.last_step().unwrap());
        assert_eq!(ra, rb);
        assert_eq!(ra.loss.to_bits(), la.to_bits());
        assert_eq!(ra.new_scale, sa.loss_scale());
        assert_eq!(
            common::params::value_bits(&a),
            common::params::value_bits(&*b)
        );
        if !ra.is_applied() {
            skipped += 1;
            assert_eq!(
                ra.outcome,
                mpx::step::UpdateOutcome::Skipped {
                    reason: mpx::step::SkipReason::GradsNotFinite,
                    consecutive: sa.consecutive_skips(),
                    total: skipped,
                }
            );
            assert_eq!(
                common::params::value_bits(&a),
                before,
                "a skipped step leaves the master untouched"
            );
            assert_eq!(ra.new_scale, ra.scale / 2.0);
        }
    }
    assert!(
        skipped >= 1,
        "2^24 must overflow f16 gradients at least once"
    );
    assert!(skipped < 12, "the scale must come down far enough to train");
    assert_eq!(sa.skipped_steps(), skipped);
}

#[test]
fn mixed_step_trains_digits_as_well_as_f32() {
    let dev = Cpu::default();
    let data = common::digits::Digits::load(0.2, 11);
    let mut m32 = dev.build_module::<step::Mlp, f32>();
    let mut m16 = m32.clone();
    let (mut o32, mut o16) = (step::adam(&m32), step::adam(&m16));
    let mut scale = step::scaler(65536.0);
    let batches = data.train_len() / step::BATCH;
    for _epoch in 0..3 {
        for b in 0..batches {
            let (x, y) = step::batch(&dev, &data, b);
            step::f32_step(&mut m32, &mut o32, x.clone(), y.clone());
            step::mixed(&mut m16, &mut o16, x, y, &mut scale);
        }
    }
    let (a32, a16) = (
        step::accuracy(&m32, &dev, &data),
        step::accuracy(&m16, &dev, &data),
    );
    assert!(a32 > 0.85, "f32 reference accuracy {a32}");
    assert!((a32 - a16).abs() < 0.03, "f32 {a32} vs mixed f16 {a16}");
}
