//! `mpx::nn`: the mixed-ready layers against dfdx's.
//!
//! * f32: bit for bit equal to dfdx's layers, forward and every parameter and input gradient
//!   (an f32 region changes nothing by design, and the layers keep dfdx's operation order).
//! * f16 on rows whose sums pass 65504: dfdx's encoder gives NaN/inf, ours stays finite and its
//!   gradients match the f32 computation within a bound derived from f16's precision.
//! * A small ViT trains a few steps in f16 through the runtime's mixed step.

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::prelude::*;
use mpx::nn::{self, IntoLayers, Mpx};

// ---- helpers --------------------------------------------------------------------------------

mod common;
use common::bits::bits;
use common::grads::param_grads;

/// Forward with a traced input, loss `sum(y * w)`: returns the output and the gradients.
fn run<M, S: Shape>(
    m: &M,
    x: &Tensor<S, f32, Cpu>,
    w: &Tensor<S, f32, Cpu>,
) -> (Vec<f32>, Gradients<f32, Cpu>)
where
    M: Module<
            Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
            Output = Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
        >,
{
    let y = m.forward(x.leaky_trace());
    let out = y.retaped::<NoneTape>().as_vec();
    let g = (y * w.clone()).sum().backward();
    (out, g)
}

/// Asserts that two models with the same tensors (one converted from the other) give the same
/// output and gradients, bit for bit. `ids` is either model: they share tensor ids.
fn assert_bit_identical<A, B, S: Shape, M: TensorCollection<f32, Cpu>>(
    ours: &A,
    theirs: &B,
    ids: &M,
    x: &Tensor<S, f32, Cpu>,
    w: &Tensor<S, f32, Cpu>,
) where
    A: Module<
            Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
            Output = Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
        >,
    B: Module<
            Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
            Output = Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
        >,
{
    let (y0, g0) = run(theirs, x, w);
    let (y1, g1) = run(ours, x, w);
    assert_eq!(bits(&y0), bits(&y1), "forward differs");
    assert_eq!(
        bits(&g0.get(x).as_vec()),
        bits(&g1.get(x).as_vec()),
        "input gradient differs"
    );
    let (p0, p1) = (param_grads(ids, &g0), param_grads(ids, &g1));
    assert!(!p0.is_empty());
    for (i, (a, b)) in p0.iter().zip(&p1).enumerate() {
        assert_eq!(bits(a), bits(b), "gradient of parameter #{i} differs");
    }
    // Not trivially zero.
    assert!(p1.iter().flatten().any(|g| *g != 0.0));
}

// ---- f32: bit for bit ----------------------------------------------------------------------

#[test]
fn f32_layer_norm_is_bit_identical_to_dfdx() {
    let dev = Cpu::seed_from_u64(1);
    let mut theirs = dev.build_module::<builders::LayerNorm1D<8>, f32>();
    theirs.gamma = dev.sample_normal();
    theirs.beta = dev.sample_normal();
    let ours: nn::LayerNorm1D<8> = theirs.clone().into_layers(Mpx);
    let x1: Tensor<Rank1<8>, f32, Cpu> = dev.sample_normal();
    assert_bit_identical(&ours, &theirs, &theirs, &x1, &dev.sample_normal());
    let x2: Tensor<Rank2<3, 8>, f32, Cpu> = dev.sample_normal() * 40.0;
    assert_bit_identical(&ours, &theirs, &theirs, &x2, &dev.sample_normal());
    let x3: Tensor<Rank3<2, 3, 8>, f32, Cpu> = dev.sample_normal();
    assert_bit_identical(&ours, &theirs, &theirs, &x3, &dev.sample_normal());
}

#[test]
fn f32_attention_is_bit_identical_to_dfdx() {
    let dev = Cpu::seed_from_u64(2);
    let theirs = dev.build_module::<builders::MultiHeadAttention<8, 2>, f32>();
    let ours: nn::MultiHeadAttention<8, 2> = theirs.clone().into();
    let x2: Tensor<Rank2<5, 8>, f32, Cpu> = dev.sample_normal();
    assert_bit_identical(&ours, &theirs, &theirs, &x2, &dev.sample_normal());
    let x3: Tensor<Rank3<3, 5, 8>, f32, Cpu> = dev.sample_normal() * 3.0;
    assert_bit_identical(&ours, &theirs, &theirs, &x3, &dev.sample_normal());

    // Cross-attention with different key and value sizes: (q, k, v).
    let theirs = dev.build_module::<builders::MultiHeadAttention<8, 2, 6, 4>, f32>();
    let ours: nn::MultiHeadAttention<8, 2, 6, 4> = theirs.clone().into();
    let q: Tensor<Rank3<2, 3, 8>, f32, Cpu> = dev.sample_normal();
    let k: Tensor<Rank3<2, 5, 8>, f32, Cpu> = dev.sample_normal();
    let v: Tensor<Rank3<2, 5, 8>, f32, Cpu> = dev.sample_normal();
    let w: Tensor<Rank3<2, 3, 8>, f32, Cpu> = dev.sample_normal();
    let y0 = theirs.forward((q.leaky_trace(), k.clone(), v.clone()));
    let y1 = ours.forward((q.leaky_trace(), k.clone(), v.clone()));
    assert_eq!(bits(&y0.as_vec()), bits(&y1.as_vec()));
    let (g0, g1) = ((y0 * w.clone()).sum().backward(), (y1 * w).sum().backward());
    assert_eq!(bits(&g0.get(&q).as_vec()), bits(&g1.get(&q).as_vec()));
    for (a, b) in param_grads(&theirs, &g0)
        .iter()
        .zip(&param_grads(&theirs, &g1))
    {
        assert_eq!(bits(a), bits(b));
    }
}

#[test]
fn f32_encoder_block_and_encoder_are_bit_identical_to_dfdx() {
    let dev = Cpu::seed_from_u64(3);
    let theirs = dev.build_module::<builders::TransformerEncoderBlock<8, 2, 16>, f32>();
    let ours: nn::TransformerEncoderBlock<8, 2, 16> = theirs.clone().into();
    let x3: Tensor<Rank3<2, 5, 8>, f32, Cpu> = dev.sample_normal();
    assert_bit_identical(&ours, &theirs, &theirs, &x3, &dev.sample_normal());
    let x2: Tensor<Rank2<5, 8>, f32, Cpu> = dev.sample_normal();
    assert_bit_identical(&ours, &theirs, &theirs, &x2, &dev.sample_normal());

    let theirs = dev.build_module::<builders::TransformerEncoder<8, 2, 16, 3>, f32>();
    let ours: nn::TransformerEncoder<8, 2, 16, 3> = theirs.clone().into_layers(Mpx);
    let x3: Tensor<Rank3<2, 5, 8>, f32, Cpu> = dev.sample_normal() * 10.0;
    assert_bit_identical(&ours, &theirs, &theirs, &x3, &dev.sample_normal());
}

// ---- the runtime's mixed step, in every precision -------------------------------------------

mod vit_step {
    use super::common::digits::{CLASSES, Digits, FEATURES};
    use dfdx::optim::{Adam, AdamConfig};
    use dfdx::prelude::*;
    use mpx::nn::vit::Vit;
    use mpx::precision::f16;
    use mpx::scaling::{DynamicLossScale, StaticLossScale};
    use mpx::step::{GradScaler, Kind, Mixed, MixedDevice};

    pub const BATCH: usize = 32;
    /// 8x8 digits in 4x4 patches: 4 tokens of 16 pixels, width 16, 2 heads, 2 blocks.
    pub type Model = Vit<FEATURES, 16, 4, 16, 2, 32, 2, CLASSES>;
    pub type X<E = f32> = Tensor<Rank2<BATCH, FEATURES>, E, Cpu>;
    pub type Y = Tensor<Rank2<BATCH, CLASSES>, f32, Cpu>;

    /// One mixed gradient computation in precision `H` from `master`: the loss and the f32
    /// master gradients in visit order (all of them finite, or `None`).
    /// (`K`: the working copy, the model's own layers in `H` where dfdx stores `H`, mpx's
    /// layers in emulated bf16.)
    pub fn gradients<H: mpx::precision::Precision, K>(
        master: &Model,
        x: &X,
        y: &Y,
    ) -> (f32, Option<Vec<f32>>)
    where
        Cpu: MixedDevice<H>,
        K: Kind<H, Model, Cpu> + Default,
        K::Copy: Module<
                Tensor<Rank2<BATCH, FEATURES>, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
                Output = Tensor<Rank2<BATCH, CLASSES>, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
            >,
    {
        let mut scaler = GradScaler::<H, _>::new(StaticLossScale::new(1024.0).expect("scale"));
        let mixed = Mixed::with(master.clone(), K::default());
        let logits = scaler
            .forward(&mixed, x.clone().trace(master.alloc_grads()), |m, x| {
                m.forward(x)
            })
            .expect("step");
        let loss = cross_entropy_with_logits_loss(logits, y.clone());
        let value = loss.array();
        let grads = scaler.backward(loss).expect("step");
        let finite = mixed.grads_finite() == Some(true) && value.is_finite();
        let grads = super::param_grads::<f32, Model>(master, &grads).concat();
        (value, finite.then_some(grads))
    }

    pub fn data(dev: &Cpu) -> (Digits, X, Y) {
        let digits = Digits::load(0.2, 7);
        let idx: Vec<usize> = digits.epoch_order(0)[..BATCH].to_vec();
        let (x, y) = digits.train_batch::<BATCH>(dev, &idx);
        (digits, x, y)
    }

    pub fn adam(m: &Model) -> Adam<Model, f32, Cpu> {
        Adam::new(
            m,
            AdamConfig {
                lr: 1e-2,
                ..Default::default()
            },
        )
    }

    pub fn scaler(initial: f32) -> GradScaler<f16, DynamicLossScale> {
        GradScaler::new(
            DynamicLossScale::builder()
                .initial(initial)
                .period(10)
                .build()
                .expect("scale"),
        )
    }

    pub fn scale_of(s: &GradScaler<f16, DynamicLossScale>) -> f32 {
        s.loss_scale()
    }

    pub fn update(
        master: &mut Mixed<Model>,
        opt: &mut Adam<Model, f32, Cpu>,
        scaler: &mut GradScaler<f16, DynamicLossScale>,
        grads: &Gradients<f32, Cpu>,
    ) -> mpx::step::UpdateOutcome {
        scaler.update(master, opt, grads).expect("update")
    }
}

/// Cosine of the angle between two gradient vectors.
fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn vit_mixed_gradients_in_f16_amp_bf16_match_f32() {
    use mpx::precision::{AMP, bf16, f16};
    use mpx::step::{Mapped, Plain};
    use vit_step::{Model, data, gradients};
    let dev = Cpu::seed_from_u64(11);
    let master = dev.build_module::<Model, f32>();
    let (_, x, y) = data(&dev);

    let (loss32, g32) = gradients::<f32, Plain>(&master, &x, &y);
    let g32 = g32.expect("finite f32 gradients");
    // The f32 working copy through the mixed step is plain dfdx training on our layers: the
    // same as a direct f32 forward/backward.
    let logits = master.forward(x.leaky_trace());
    let direct = cross_entropy_with_logits_loss(logits, y.clone());
    assert_eq!(loss32.to_bits(), direct.array().to_bits());
    let direct = param_grads(&master, &direct.backward()).concat();
    assert_eq!(bits(&g32), bits(&direct));

    // Half precisions: the same step within their precision. Loss: relative error of a few
    // units of the format's rounding (f16: 2^-11, bf16: 2^-8) times the depth; gradients: the
    // direction kept (cosine), since small entries carry large relative errors.
    for (name, (loss, g), rel, cos) in [
        ("f16", gradients::<f16, Plain>(&master, &x, &y), 1e-2, 0.999),
        (
            "AMP<f16>",
            gradients::<AMP<f16>, Plain>(&master, &x, &y),
            1e-2,
            0.999,
        ),
        (
            "bf16",
            gradients::<bf16, Mapped>(&master, &x, &y),
            5e-2,
            0.99,
        ),
    ] {
        let g = g.unwrap_or_else(|| panic!("{name}: non-finite gradients"));
        assert!(
            ((loss - loss32) / loss32).abs() < rel,
            "{name}: loss {loss} vs f32 {loss32}"
        );
        let c = cosine(&g, &g32);
        assert!(c > cos, "{name}: gradient cosine {c}");
        assert_ne!(
            bits(&g),
            bits(&g32),
            "{name}: the half path must differ from f32"
        );
    }
}

#[test]
fn small_vit_trains_in_f16_with_skipped_steps_counted() {
    use common::params::values;
    use mpx::step::Mixed;
    use vit_step::{BATCH, Model, adam, scale_of, scaler, update};
    let dev = Cpu::seed_from_u64(5);
    let (digits, _, _) = vit_step::data(&dev);
    let mut master = Mixed::new(dev.build_module::<Model, f32>());
    let mut opt = adam(&master);
    // 2^24 is far too large for f16 gradients: the first steps overflow and are skipped, the
    // scale halves each time until the gradients fit.
    let mut scaler = scaler(16_777_216.0);
    let order = digits.epoch_order(0);
    let steps = 60;
    let mut losses = Vec::new();
    let mut skipped_seen = 0;
    for s in 0..steps {
        let idx = &order[(s * BATCH) % (order.len() - BATCH)..][..BATCH];
        let (x, y) = digits.train_batch::<BATCH>(&dev, idx);
        let before = scale_of(&scaler);
        let logits = scaler
            .forward(&master, x.trace(master.alloc_grads()), |m, x| m.forward(x))
            .expect("forward");
        let loss = cross_entropy_with_logits_loss(logits, y);
        let value = loss.array();
        let grads = scaler.backward(loss).expect("grads");
        let finite = master.grads_finite() == Some(true) && value.is_finite();
        let loss = value;
        let outcome = update(&mut master, &mut opt, &mut scaler, &grads);
        assert_eq!(outcome.is_applied(), finite);
        if finite {
            losses.push(loss);
        } else {
            skipped_seen += 1;
            assert_eq!(scale_of(&scaler), before / 2.0, "a skip halves the scale");
        }
        assert!(values(&*master).iter().all(|v| v.is_finite()), "step {s}");
    }
    assert!(
        skipped_seen >= 1,
        "the initial scale must overflow at least once"
    );
    assert_eq!(scaler.skipped_steps(), skipped_seen);
    assert_eq!(
        scaler.applied_steps() + scaler.skipped_steps(),
        steps as u64
    );
    let first: f32 = losses[..5].iter().sum::<f32>() / 5.0;
    let last: f32 = losses[losses.len() - 5..].iter().sum::<f32>() / 5.0;
    assert!(last < 0.8 * first, "loss {first} -> {last}");
}

// ---- f16 stability: rows past 65504 ---------------------------------------------------------

mod overflow {
    use dfdx::prelude::*;
    use mpx::precision::f16;

    pub const B: usize = 2;
    pub const S: usize = 4;
    pub const M: usize = 32;
    pub type Enc<E> = dfdx::nn::modules::TransformerEncoder<M, 4, 64, 2, E, Cpu>;
    pub type Seq<E> = Tensor<Rank3<B, S, M>, E, Cpu>;

    /// Rounds an f32 tensor to f16 values and back: the f32 reference then runs on exactly the
    /// values the f16 run holds.
    pub fn f16_values<Sh: Shape>(t: Tensor<Sh, f32, Cpu>) -> Tensor<Sh, f32, Cpu> {
        t.to_dtype::<f16>().to_dtype::<f32>()
    }

    /// An encoder whose residual stream carries values near 2400 (row sums near 77000, past
    /// f16's 65504): attention queries and keys scaled by 2^-6 keep the attention scores
    /// moderate, as a trained network with large residual activations has them.
    pub fn model(dev: &Cpu) -> Enc<f32> {
        let mut enc =
            dev.build_module::<dfdx::nn::builders::TransformerEncoder<M, 4, 64, 2>, f32>();
        for block in enc.modules.iter_mut() {
            let a = &mut block.self_attn;
            a.w_q.weight = a.w_q.weight.clone() * (1.0 / 64.0);
            a.w_k.weight = a.w_k.weight.clone() * (1.0 / 64.0);
            // Feed-forward pre-activations kept away from zero (bias +-1, weights / 8), so that
            // no ReLU sits on the edge where f16 rounding could flip it: half the units pass,
            // half are gated off, in both runs alike.
            let ff = &mut block.ff.0.0;
            ff.weight = ff.weight.clone() * 0.125;
            let signs: Vec<f32> = (0..64)
                .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
                .collect();
            ff.bias = dev.tensor_from_vec(signs, (Const,));
        }
        // Every parameter an f16 value, so the f16 and f32 runs start from the same numbers.
        enc.to_dtype::<f16>().to_dtype::<f32>()
    }

    pub fn input(dev: &Cpu) -> Seq<f32> {
        let z: Seq<f32> = dev.sample_normal();
        f16_values(z * 1000.0 + 2600.0)
    }
}

#[test]
fn f16_overflow_input_breaks_dfdx_and_not_mpx() {
    use mpx::precision::f16;
    use overflow::{B, M, S, f16_values, input, model};
    let dev = Cpu::seed_from_u64(
        std::env::var("MPX_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(21),
    );
    let theirs32 = model(&dev);
    let x = input(&dev);
    let w: Tensor<Rank3<B, S, M>, f32, Cpu> = f16_values(dev.sample_normal());
    let row_sums = x.clone().sum::<Rank2<B, S>, _>().as_vec();
    assert!(row_sums.iter().all(|s| *s > 65504.0), "{row_sums:?}");

    // dfdx in f16: the layer norm's row sum overflows.
    let theirs16 = theirs32.clone().to_dtype::<f16>();
    let y = theirs16.forward(x.clone().to_dtype::<f16>());
    assert!(
        y.as_vec().iter().any(|v| !v.is_finite()),
        "dfdx f16 should overflow"
    );

    // mpx in f16: finite, forward and gradients.
    let ours16: nn::TransformerEncoder<M, 4, 64, 2, f16> = theirs16.into_layers(Mpx);
    let x16 = x.clone().to_dtype::<f16>();
    let y16 = ours16.forward(x16.leaky_trace());
    let out16: Vec<f32> = y16.as_vec().into_iter().map(f32::from).collect();
    assert!(out16.iter().all(|v| v.is_finite()));
    let g16 = (y16 * w.clone().to_dtype::<f16>()).sum().backward();

    // The f32 reference: our layers in f32 (= dfdx's, bit for bit) on the same values.
    let ours32: nn::TransformerEncoder<M, 4, 64, 2> = theirs32.into_layers(Mpx);
    let y32 = ours32.forward(x.leaky_trace());
    let out32 = y32.retaped::<NoneTape>().as_vec();
    let g32 = (y32 * w).sum().backward();

    // The tolerance, from f16's precision. Round to nearest gives each f16 result a relative
    // error of at most u = 2^-11. Along the longest path from the input to the loss and back
    // to a parameter there are at most n = 64 results rounded to f16 (per block and pass:
    // projection matmul and bias add, scores matmul, softmax region output, weights x values,
    // output projection and bias, residual add, layer-norm region output, two feed-forward
    // matmuls with their bias adds, residual add, layer-norm region output: 15, times 2 blocks,
    // times forward and backward, rounded up). To first order the errors add, so a quantity of
    // unit scale is off by at most n * u. The layer norms scale errors up: an absolute error
    // e in a row of the residual stream becomes e / sigma after normalizing, while it was
    // u * max|h| in size; hence the factor kappa = max|h| / sigma, measured here on the rows
    // that enter the first block's layer norm (the largest ones). Normwise relative errors of
    // the output and of every gradient tensor must stay under n * u * kappa.
    let h = ours32.modules[0].self_attn.forward(x.clone()) + x.clone();
    let kappa = h
        .as_vec()
        .chunks(M)
        .map(|row| {
            let mean = row.iter().sum::<f32>() / M as f32;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / M as f32;
            row.iter().fold(0.0f32, |m, v| m.max(v.abs())) / var.sqrt()
        })
        .fold(0.0f32, f32::max) as f64;
    let tol = 64.0 * 2f64.powi(-11) * kappa;
    assert!(tol < 0.25, "the bound must say something: kappa = {kappa}");

    // The bound is first order: it holds while no ReLU switches between the runs. A feed-forward
    // pre-activation closer to zero than the error band may take either sign in f16, and one
    // switched unit moves its gradients by O(1). The model keeps every pre-activation of both
    // blocks outside the band (in f32, relative to their RMS); checked here.
    let mut h = x.clone();
    for block in &ours32.modules {
        let h1 = block
            .norm1
            .forward(block.self_attn.forward(h.clone()) + h.clone());
        let z = block.ff.0.0.forward(h1.clone()).as_vec();
        let rms = (z.iter().map(|v| v * v).sum::<f32>() / z.len() as f32).sqrt();
        let nearest = z.iter().fold(f32::INFINITY, |m, v| m.min(v.abs()));
        assert!(
            f64::from(nearest) > tol * f64::from(rms),
            "a ReLU input {nearest} lies within the error band {tol} x RMS {rms}: pick another seed"
        );
        h = block.forward(h);
    }

    let rel = |a: &[f32], b: &[f32]| {
        let d: f64 = a
            .iter()
            .zip(b)
            .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
            .sum();
        let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (d / n).sqrt()
    };
    assert!(
        rel(&out16, &out32) < tol,
        "output: {} vs {tol}",
        rel(&out16, &out32)
    );
    let gx: Vec<f32> = g16.get(&x16).as_vec().into_iter().map(f32::from).collect();
    let ex = rel(&gx, &g32.get(&x).as_vec());
    assert!(ex < tol, "input gradient: {ex} vs {tol}");

    let p16 = param_grads(&ours16, &g16);
    let p32 = param_grads(&ours32, &g32);
    assert_eq!(p16.len(), 32);
    for (i, (a, b)) in p16.iter().zip(&p32).enumerate() {
        assert!(a.iter().all(|v| v.is_finite()), "parameter #{i}");
        // #3 and #19 are the key projections' biases: they add q.b_k to every score of a row,
        // which the softmax cancels, so their exact gradient is 0 and both runs hold rounding
        // noise. They must be negligible next to the key weights' gradient instead.
        if i % 16 == 3 {
            let scale: f32 = p32[i - 1].iter().map(|v| v.abs()).fold(0.0, f32::max);
            assert!(
                a.iter().chain(b).all(|v| v.abs() <= tol as f32 * scale),
                "#{i}"
            );
            continue;
        }
        let e = rel(a, b);
        assert!(
            e < tol,
            "gradient of parameter #{i}: relative error {e} vs {tol}"
        );
    }
}

#[test]
fn class_token_prepends_and_gets_the_first_positions_gradient() {
    use mpx::nn::vit::{ClassToken, ClassificationHead, PatchEmbedding, PositionEmbedding};
    use mpx::precision::f16;
    let dev = Cpu::seed_from_u64(9);
    let mut cls = dev.build_module::<ClassToken<4>, f32>();
    assert_eq!(cls.token.array(), [0.0; 4], "initialised to zeros");
    cls.token = dev.sample_normal();
    let x: Tensor<Rank3<2, 3, 4>, f32, Cpu> = dev.sample_normal();
    let w: Tensor<(Const<2>, usize, Const<4>), f32, Cpu> =
        dev.sample_normal_like(&(Const, 4, Const));
    let y = cls.forward(x.leaky_trace());
    let (yv, xv, tv, wv) = (y.as_vec(), x.as_vec(), cls.token.as_vec(), w.as_vec());
    let g = (y * w).sum().backward();
    let (gx, gt) = (g.get(&x).as_vec(), g.get(&cls.token).as_vec());
    for b in 0..2 {
        // Output: the token, then the sequence.
        assert_eq!(yv[b * 16..b * 16 + 4], tv[..]);
        assert_eq!(yv[b * 16 + 4..b * 16 + 16], xv[b * 12..b * 12 + 12]);
        // The sequence's gradient: the weights at positions 1..
        assert_eq!(gx[b * 12..b * 12 + 12], wv[b * 16 + 4..b * 16 + 16]);
    }
    // The token's gradient: position 0's weights summed over the batch.
    let want: Vec<f32> = (0..4).map(|j| wv[j] + wv[16 + j]).collect();
    assert_eq!(gt, want);

    // A class-token ViT forward in f16: 4 patches + the token = 5 positions.
    let embed = dev.build_module::<PatchEmbedding<64, 16, 4, 8>, f16>();
    let cls = dev.build_module::<ClassToken<8>, f16>();
    let pos = dev.build_module::<PositionEmbedding<5, 8>, f16>();
    let enc = dev.build_module::<nn::TransformerEncoder<8, 2, 16, 1>, f16>();
    let head = dev.build_module::<ClassificationHead<8, 3>, f16>();
    let images: Tensor<Rank2<2, 64>, f32, Cpu> = dev.sample_uniform();
    let t = embed.forward(images.to_dtype::<f16>().leaky_trace());
    let t = enc.forward(pos.forward(cls.forward(t)));
    let logits = head.forward(ClassToken::<8, f16>::try_take(t).expect("take"));
    assert!(logits.as_vec().iter().all(|v| v.is_finite()));
    let g = logits.sum().backward();
    assert!(g.get(&cls.token).as_vec().iter().any(|v| v.to_f32() != 0.0));
    assert!(g.get(&pos.pos).as_vec().iter().all(|v| v.is_finite()));
}

#[test]
fn vit_is_a_castable_tree_with_float_leaves() {
    use common::digits::DigitsVit;
    use mpx::cast::{cast_module, cast_tree};
    use mpx::finite::all_finite;
    use mpx::precision::f16;
    let dev = Cpu::seed_from_u64(4);
    let vit = dev.build_module::<DigitsVit, f32>();
    // Field-by-field `Cast` agrees with the TensorCollection cast the mixed step uses.
    let a: DigitsVit<f16> = cast_tree::<f16, _>(&vit);
    let b: DigitsVit<f16> = cast_module::<f16, f32, _>(&vit);
    let x: Tensor<Rank2<3, 64>, f32, Cpu> = dev.sample_uniform();
    let x = x.to_dtype::<f16>();
    assert_eq!(a.forward(x.clone()).as_vec(), b.forward(x).as_vec());
    assert_eq!(
        a.encoder.modules[1].norm1.epsilon,
        vit.encoder.modules[1].norm1.epsilon
    );
    // `FloatLeaves` reaches every tensor: a NaN anywhere is seen.
    assert!(all_finite(&a));
    let mut bad = vit.clone();
    let mut v = bad.head.norm.beta.as_vec();
    v[3] = f32::NAN;
    bad.head.norm.beta.copy_from(&v);
    assert!(all_finite(&vit) && !all_finite(&bad));
}
