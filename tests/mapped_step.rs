//! The working copy made of mpx's layers (`HalfLayers`, `Mixed::mapped`): which
//! working copy `#[mixed_step]` picks for which model, the mapped forward pass and gradients
//! against the f32 step, and skipped steps.
//!
//! Tolerance: every value of a two-layer f16 forward pass is rounded a handful of times (the
//! input, the weights, the hidden layer, the output: each `2^-11` relative) with f32 sums in
//! between, so each result is within `2^-7` of the largest magnitude of the f32 result.

use dfdx::optim::{Adam, AdamConfig};
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::{AMP, DType, Precision, bf16, f16};
use mpx::scaling::StaticLossScale;
use mpx::step::{GradScaler, Mapped, Mixed};

mod common;
use common::bits::bits;
use common::compare::rel;
use common::grads::param_grads;
use common::params::values as params;

type Mlp = (Linear<12, 24>, ReLU, Linear<24, 5>, Tanh);
type Model = <Mlp as BuildOnDevice<Cpu, f32>>::Built;
type Normed = (Linear<12, 24>, LayerNorm1D<24>, Linear<24, 5>, Tanh);
type NormedModel = <Normed as BuildOnDevice<Cpu, f32>>::Built;
/// A module of the user's own (mpx cannot know its forward pass, so the model does not map).
#[derive(Clone, Debug)]
struct Gate<E: Dtype, D: Device<E>> {
    w: Tensor<Rank1<12>, E, D>,
}

impl<E: Dtype, D: Device<E>> TensorCollection<E, D> for Gate<E, D> {
    type To<E2: Dtype, D2: Device<E2>> = Gate<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            Self::tensor("w", |s| &s.w, |s| &mut s.w, TensorOptions::reset_to_ones()),
            |w| Gate { w },
        )
    }
}

impl<E: Dtype, D: Device<E>, T: Tape<E, D>> Module<Tensor<Rank2<7, 12>, E, D, T>> for Gate<E, D> {
    type Output = Tensor<Rank2<7, 12>, E, D, T>;
    type Error = D::Err;
    fn try_forward(&self, x: Tensor<Rank2<7, 12>, E, D, T>) -> Result<Self::Output, D::Err> {
        x.try_mul(self.w.clone().try_broadcast()?)
    }
}

type Gated = (
    Gate<f32, Cpu>,
    <(Linear<12, 24>, ReLU, Linear<24, 5>, Tanh) as BuildOnDevice<Cpu, f32>>::Built,
);
type X = Tensor<Rank2<7, 12>, f32, Cpu>;
type Y = Tensor<Rank2<7, 5>, f32, Cpu>;

/// `got` within `2^-7` of the largest magnitude of `want`, entry by entry.
fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_close_to(what, got, want, 128.0);
}

/// `got` within `1 / parts` of the largest magnitude of `want`, entry by entry.
fn assert_close_to(what: &str, got: &[f32], want: &[f32], parts: f32) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(scale > 0.0, "{what}: all zero");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= scale / parts,
            "{what}[{i}]: {g} vs {w} (largest {scale})"
        );
    }
}

#[test]
fn the_mapped_forward_and_gradients_match_the_f32_step() {
    let dev = Cpu::seed_from_u64(3);
    let model = dev.build_module::<Mlp, f32>();
    let x: X = dev.sample_normal();
    let y: Y = dev.sample_normal();

    let out32 = model.forward(x.trace(model.alloc_grads()));
    let want_out = out32.as_vec();
    let g32 = mse_loss(out32, y.clone()).backward();

    let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(1024.0).unwrap());
    let mapped = Mixed::mapped(model.clone());
    let out16 = scaler
        .forward(&mapped, x.trace(model.alloc_grads()), |m, x| m.forward(x))
        .unwrap();
    assert_close("output", &out16.as_vec(), &want_out);
    let g16 = scaler.backward(mse_loss(out16, y)).unwrap();

    let (want, got) = (
        param_grads(&model, &g32).concat(),
        param_grads(&model, &g16).concat(),
    );
    // weight then bias of each layer, as the master visits them
    let sizes = [24 * 12, 24, 5 * 24, 5];
    let mut at = 0;
    for (k, n) in sizes.into_iter().enumerate() {
        assert_close(
            &format!("gradient {k}"),
            &got[at..at + n],
            &want[at..at + n],
        );
        at += n;
    }
    assert_eq!(at, want.len());
}

/// The traced input of the mapped forward passes, in `H`.
type HalfIn<H> =
    Tensor<Rank2<7, 12>, <H as Precision>::Elem, Cpu, OwnedTape<<H as Precision>::Elem, Cpu>>;

/// `M`'s mapped forward pass in `H` (`forward_mut`: batch norm and dropout in training mode) and
/// its gradients within `2^-7` (f16) or `2^-5` (emulated bf16, whose unit roundoff `2^-8` is 8
/// times f16's) of the largest f32 value, and its batch-norm statistics (written back on the
/// applied update) too.
fn mapped_matches_f32<H, M>(what: &str, set: impl Fn(&mut M::Built))
where
    H: Precision,
    Cpu: mpx::step::MixedDevice<H>,
    M: BuildOnDevice<Cpu, f32>,
    M::Built: mpx::step::HalfLayers<H>
        + ModuleMut<
            Tensor<Rank2<7, 12>, f32, Cpu, OwnedTape<f32, Cpu>>,
            Output = Tensor<Rank2<7, 5>, f32, Cpu, OwnedTape<f32, Cpu>>,
        > + Clone
        + Send
        + Sync
        + 'static,
    <M::Built as mpx::step::HalfLayers<H>>::Working:
        ModuleMut<HalfIn<H>, Output = Tensor<Rank2<7, 5>, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>>,
    Tensor<Rank2<7, 12>, f32, Cpu, OwnedTape<f32, Cpu>>: mpx::step::HalfInput<H, Half = HalfIn<H>>,
    Tensor<Rank2<7, 5>, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>:
        mpx::step::HalfOutput<H, Full = Tensor<Rank2<7, 5>, f32, Cpu, OwnedTape<f32, Cpu>>>,
{
    let what = format!("{what} in {}", H::DTYPE.name());
    let parts = if H::DTYPE == DType::BFloat16 {
        32.0
    } else {
        128.0
    };
    let dev = Cpu::seed_from_u64(11);
    let mut model = dev.build_module::<M, f32>();
    set(&mut model);
    let x: X = dev.sample_normal();
    let y: Y = dev.sample_normal();

    let mut model32 = model.clone();
    let out32 = model32.forward_mut(x.trace(model32.alloc_grads()));
    let want_out = out32.as_vec();
    let g32 = mse_loss(out32, y.clone()).backward();

    let mut scaler = GradScaler::<H, _>::new(StaticLossScale::new(1024.0).unwrap());
    let mut model = Mixed::mapped(model);
    let grads = model.alloc_grads();
    let out16 = scaler
        .forward_mut(&mut model, x.trace(grads), |m, x| m.forward_mut(x))
        .unwrap();
    assert_close_to(
        &format!("{what}: output"),
        &out16.as_vec(),
        &want_out,
        parts,
    );
    let g16 = scaler.backward(mse_loss(out16, y)).unwrap();
    assert_close_to(
        &format!("{what}: gradients"),
        &param_grads(&*model, &g16).concat(),
        &param_grads(&*model, &g32).concat(),
        parts,
    );
    // one SGD step each: every tensor (batch-norm statistics included, which the mapped
    // forward pass updated in its working copy) as the f32 step left it
    let mut opt = dfdx::optim::Sgd::new(&*model, dfdx::optim::SgdConfig::default());
    assert!(
        scaler
            .update(&mut model, &mut opt, &g16)
            .unwrap()
            .is_applied()
    );
    assert!(scaler.last_step().unwrap().mpx_layers, "{what}");
    let mut opt32 = dfdx::optim::Sgd::new(&model32, dfdx::optim::SgdConfig::default());
    opt32.update(&mut model32, &g32).unwrap();
    assert_close_to(
        &format!("{what}: after the update"),
        &params(&*model),
        &params(&model32),
        parts,
    );
}

/// Each of dfdx's layers without an mpx counterpart, and each container, in a mapped working
/// copy: the same forward pass and gradients as the f32 step, to f16 accuracy.
#[test]
fn each_mapped_module_matches_the_f32_step() {
    macro_rules! each {
        ($($h:ty),*) => {$(
        mapped_matches_f32::<$h, (Linear<12, 24>, BatchNorm1D<24>, ReLU, Linear<24, 5>)>(
            "batch norm",
            |_| {},
        );
        mapped_matches_f32::<$h, (Linear<12, 24>, ReLU, Dropout, Linear<24, 5>)>("dropout", |m| {
            m.2.p = 0.0
        });
        mapped_matches_f32::<$h, (
            Linear<12, 24>,
            Sigmoid,
            DropoutOneIn<1000000>,
            Linear<24, 5>,
        )>("dropout one in", |_| {});
        mapped_matches_f32::<$h, GeneralizedResidual<(Linear<12, 5>, Tanh), Linear<12, 5>>>(
            "generalized residual",
            |_| {},
        );
        mapped_matches_f32::<$h, (Linear<12, 24>, Residual<(Linear<24, 24>, Tanh)>, Linear<24, 5>)>(
            "residual",
            |_| {},
        );
        mapped_matches_f32::<$h, (
            SplitInto<(Linear<12, 5>, Linear<12, 5>)>,
            AddInto<(Tanh, Sigmoid)>,
        )>("split into, add into", |_| {});
        mapped_matches_f32::<$h, (Linear<12, 24>, ReLU, Linear<24, 24>, ReLU, Linear<24, 5>)>(
            "linear and relu fused",
            |_| {},
        );
        mapped_matches_f32::<$h, (Linear<12, 24>, Softmax, Linear<24, 5>, LogSoftmax)>(
            "softmax, log-softmax in f32",
            |_| {},
        );
        mapped_matches_f32::<$h, (Linear<12, 24>, Tanh, Exp, Linear<24, 5>, Sigmoid, Ln)>(
            "exp, ln in f32",
            |_| {},
        );
        mapped_matches_f32::<$h, (UnbiasedLinear<12, 24>, LeakyReLU<f32>, Linear<24, 5>)>(
            "unbiased linear, leaky relu",
            |m| m.1 = LeakyReLU(0.2),
        );
        mapped_matches_f32::<$h, (Linear<12, 24>, PReLU, Linear<24, 5>, PReLU1D<Const<5>>)>(
            "prelu, prelu1d",
            |m| {
                m.1.a.copy_from(&[0.1]);
                m.3.a.copy_from(&[0.3, -0.2, 0.05, 0.5, 1.5]);
            },
        );
        #[allow(deprecated)]
        mapped_matches_f32::<$h, (Linear<12, 24>, GeLU, Linear<24, 5>)>("gelu", |_| {});
        mapped_matches_f32::<$h, (
            (Linear<12, 24>, FastGeLU, Linear<24, 24>, AccurateGeLU),
            (Linear<24, 24>, Sin, Cos, Abs, Square),
            Linear<24, 5>,
        )>("element-wise functions in f32", |_| {});
        // image-shaped layers between two linear layers: 7 images of 2 x 3 x 4
        mapped_matches_f32::<$h, (
            (Linear<12, 24>, Reshape<Rank4<7, 2, 3, 4>>),
            (BatchNorm2D<2>, Bias2D<2>, Upscale2D<6, 8>),
            AvgPoolGlobal,
            Linear<2, 5>,
        )>("reshape, batch norm 2d, bias 2d, upscale, average pool", |m| {
            m.1.1.bias.copy_from(&[0.25, -0.5]);
        });
        mapped_matches_f32::<$h, (
            (Linear<12, 24>, Reshape<Rank4<7, 2, 3, 4>>),
            MaxPoolGlobal,
            Linear<2, 5>,
        )>("max pool", |_| {});
        mapped_matches_f32::<$h, (
            (Linear<12, 24>, Reshape<Rank4<7, 2, 3, 4>>),
            MinPoolGlobal,
            Linear<2, 5>,
        )>("min pool", |_| {});
        )*};
    }
    each!(f16, AMP<f16>, bf16);
}

/// A token model (an embedding table with repeated tokens, then a linear head) on mpx's layers in
/// each precision: the output, the table's and the head's gradients within `2^-7` (emulated
/// bf16: `2^-5`) of the largest f32 value, and the tables after one SGD step each.
#[test]
fn a_mapped_embedding_matches_the_f32_step() {
    type Tok = (Embedding<10, 6>, Linear<6, 3>);
    macro_rules! each {
        ($($h:ty: $parts:expr),*) => {$({
            let dev = Cpu::seed_from_u64(5);
            let model = dev.build_module::<Tok, f32>();
            let ids: Tensor<Rank1<8>, usize, Cpu> = dev.tensor([1, 3, 3, 0, 9, 3, 1, 7]);
            let y: Tensor<Rank2<8, 3>, f32, Cpu> = dev.sample_normal();
            let mut model32 = model.clone();
            let out32 = model32.forward(ids.clone().traced(model32.alloc_grads()));
            let want_out = out32.as_vec();
            let g32 = mse_loss(out32, y.clone()).backward();

            let what = <$h as Precision>::DTYPE.name();
            let mut scaler = GradScaler::<$h, _>::new(StaticLossScale::new(1024.0).unwrap());
            let mut model = Mixed::mapped(model);
            let out = scaler
                .forward(&model, ids.traced(model.alloc_grads()), |m, x| m.forward(x))
                .unwrap();
            assert_close_to(&format!("{what}: output"), &out.as_vec(), &want_out, $parts);
            let g = scaler.backward(mse_loss(out, y)).unwrap();
            let (got, want) = (param_grads(&*model, &g), param_grads(&model32, &g32));
            // the table's gradient: tokens 3 and 1 repeat, and 2, 4, 5, 6, 8 get none
            assert_close_to(&format!("{what}: table gradient"), &got[0], &want[0], $parts);
            assert_close_to(&format!("{what}: head gradients"), &got[1..].concat(), &want[1..].concat(), $parts);
            let mut opt = dfdx::optim::Sgd::new(&*model, dfdx::optim::SgdConfig::default());
            assert!(scaler.update(&mut model, &mut opt, &g).unwrap().is_applied());
            assert!(scaler.last_step().unwrap().mpx_layers, "{what}");
            let mut opt32 = dfdx::optim::Sgd::new(&model32, dfdx::optim::SgdConfig::default());
            opt32.update(&mut model32, &g32).unwrap();
            assert_close_to(&format!("{what}: after the update"), &params(&*model), &params(&model32), $parts);
        })*};
    }
    each!(f16: 128.0, AMP<f16>: 128.0, bf16: 32.0);
}

/// dfdx's encoder-decoder `Transformer` (so its decoder blocks) on mpx's layers: the output and
/// every gradient within `2^-7` of the largest f32 value.
#[test]
fn a_dfdx_transformer_with_its_decoder_maps_and_matches_the_f32_step() {
    type Seq2Seq = dfdx::nn::modules::Transformer<8, 2, 1, 2, 16, f32, Cpu>;
    let dev = Cpu::seed_from_u64(21);
    let mut model: Seq2Seq = dev.build_module::<builders::Transformer<8, 2, 1, 2, 16>, f32>();
    // distinct values everywhere, so that a swapped norm or projection cannot hide
    let n = params(&model).len();
    #[allow(clippy::cast_precision_loss)]
    let scrambled: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.618_034).sin() * 0.5)
        .collect();
    common::params::load(&mut model, &scrambled);
    let src: Tensor<Rank3<2, 5, 8>, f32, Cpu> = dev.sample_normal();
    let tgt: Tensor<Rank3<2, 3, 8>, f32, Cpu> = dev.sample_normal();
    let y: Tensor<Rank3<2, 3, 8>, f32, Cpu> = dev.sample_normal();

    let out32 = model.forward((src.trace(model.alloc_grads()), tgt.clone()));
    let want_out = out32.as_vec();
    let g32 = mse_loss(out32, y.clone()).backward();

    // f16 within 2^-7 of the largest f32 value, emulated bf16 (8 times f16's unit roundoff)
    // within 2^-5
    macro_rules! mapped {
        ($h:ty, $parts:expr) => {{
            let mut scaler = GradScaler::<$h, _>::new(StaticLossScale::new(1024.0).unwrap());
            let mapped = Mixed::mapped(model.clone());
            let out = scaler
                .forward(
                    &mapped,
                    (src.trace(model.alloc_grads()), tgt.clone()),
                    |m, x| m.forward(x),
                )
                .unwrap();
            let what = <$h as Precision>::DTYPE.name();
            assert_close_to(
                &format!("transformer output, {what}"),
                &out.as_vec(),
                &want_out,
                $parts,
            );
            let g = scaler.backward(mse_loss(out, y.clone())).unwrap();
            assert_close_to(
                &format!("transformer gradients, {what}"),
                &param_grads(&model, &g).concat(),
                &param_grads(&model, &g32).concat(),
                $parts,
            );
        }};
    }
    mapped!(f16, 128.0);
    mapped!(bf16, 32.0);
}

#[test]
fn a_skipped_mapped_step_leaves_master_and_adam_untouched() {
    let dev = Cpu::seed_from_u64(5);
    let x: X = dev.sample_normal();
    let y: Y = dev.sample_normal();
    let mut bad = x.as_vec();
    bad[3] = f32::NAN;
    let bad: X = dev.tensor_from_vec(bad, (Const, Const));
    let run = |with_skip: bool| {
        let mut model = Mixed::mapped(Cpu::seed_from_u64(6).build_module::<Mlp, f32>());
        let mut opt = Adam::new(&*model, AdamConfig::default());
        let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(256.0).unwrap());
        let mut step = |model: &mut Mixed<Model, Mapped>, x: &X| {
            let out = scaler
                .forward(&*model, x.trace(model.alloc_grads()), |m, x| m.forward(x))
                .unwrap();
            let grads = scaler.backward(mse_loss(out, y.clone())).unwrap();
            scaler.update(model, &mut opt, &grads).unwrap()
        };
        assert!(step(&mut model, &x).is_applied());
        if with_skip {
            let before = params(&*model);
            assert!(!step(&mut model, &bad).is_applied());
            assert_eq!(bits(&params(&*model)), bits(&before));
        }
        // Adam's state too: the next applied step is the same as without the skip
        assert!(step(&mut model, &x).is_applied());
        params(&*model)
    };
    assert_eq!(bits(&run(true)), bits(&run(false)));
}

// ---- which working copy `#[mixed_step]` picks ---------------------------------------------------

/// The same plain dfdx step, with `#[mixed_step]`, for each concrete model type: the autoref
/// ladder picks the working copy from the type.
macro_rules! concrete_steps {
    ($($name:ident: $model:ty $(=> $h:ty)?),+ $(,)?) => {$(
        // a model with a module of the user's own runs on its own layers in f16: the compiler
        // says so (a warning), which this test silences
        #[allow(deprecated)]
        #[mixed_step(scaling = scaler)]
        fn $name(
            model: &mut $model,
            opt: &mut Adam<$model, f32, Cpu>,
            x: &X,
            y: &Y,
            scaler: &mut GradScaler$(<$h>)?,
        ) {
            let grads = model.alloc_grads();
            let out = model.forward(x.trace(grads));
            let loss = mse_loss(out, y.clone());
            let grads = loss.backward();
            opt.update(model, &grads).unwrap();
        }
    )+};
}
concrete_steps!(
    train_mlp: Model,
    train_normed: NormedModel,
    train_gated: Gated,
    train_mlp_bf16: Model => bf16,
);

struct Agent<M: BuildOnDevice<Cpu, f32>> {
    model: M::Built,
    opt: Adam<M::Built, f32, Cpu>,
}

impl<M: BuildOnDevice<Cpu, f32>> Agent<M>
where
    M::Built: Module<
            Tensor<Rank2<7, 12>, f32, Cpu, OwnedTape<f32, Cpu>>,
            Output = Tensor<Rank2<7, 5>, f32, Cpu, OwnedTape<f32, Cpu>>,
        >,
{
    #[mixed_step(scaling = scaler)]
    #[allow(deprecated)] // the f32 fallback, on purpose
    fn train(&mut self, x: &X, y: &Y, scaler: &mut GradScaler) {
        let grads = self.model.alloc_grads();
        let out = self.model.forward(x.trace(grads));
        let loss = mse_loss(out, y.clone());
        let grads = loss.backward();
        self.opt.update(&mut self.model, &grads).unwrap();
    }
}

#[test]
fn mixed_step_picks_mpx_layers_then_the_half_copy_then_f32() {
    let dev = Cpu::seed_from_u64(1);
    let x: X = dev.sample_normal();
    let y: Y = dev.sample_normal();

    // dfdx's Linear, activations and a tuple: mpx's layers
    let mut mlp = dev.build_module::<Mlp, f32>();
    let mut opt = Adam::new(&mlp, AdamConfig::default());
    let mut scaler = GradScaler::default();
    train_mlp(&mut mlp, &mut opt, &x, &y, &mut scaler);
    let r = scaler.last_step().unwrap();
    assert!(r.is_applied() && r.mpx_layers, "{r:?}");
    assert_eq!(r.precision, DType::Float16);

    // and in emulated bf16
    let mut mlp = dev.build_module::<Mlp, f32>();
    let mut opt = Adam::new(&mlp, AdamConfig::default());
    let mut scaler = GradScaler::<bf16>::default();
    train_mlp_bf16(&mut mlp, &mut opt, &x, &y, &mut scaler);
    let r = scaler.last_step().unwrap();
    assert!(r.is_applied() && r.mpx_layers, "{r:?}");
    assert_eq!(r.precision, DType::BFloat16);

    // a LayerNorm1D maps to mpx's
    let mut normed = dev.build_module::<Normed, f32>();
    let mut opt = Adam::new(&normed, AdamConfig::default());
    let mut scaler = GradScaler::default();
    train_normed(&mut normed, &mut opt, &x, &y, &mut scaler);
    let r = scaler.last_step().unwrap();
    assert!(r.is_applied() && r.mpx_layers, "{r:?}");
    assert_eq!(r.precision, DType::Float16);

    // a module of the user's own does not map: the master's own layers in f16
    let mut gated: Gated = (Gate { w: dev.ones() }, dev.build_module::<Mlp, f32>());
    let mut opt = Adam::new(&gated, AdamConfig::default());
    let mut scaler = GradScaler::default();
    train_gated(&mut gated, &mut opt, &x, &y, &mut scaler);
    let r = scaler.last_step().unwrap();
    assert!(r.is_applied() && !r.mpx_layers, "{r:?}");
    assert_eq!(r.precision, DType::Float16);

    // a model generic through the impl: f32 on the master
    let model = dev.build_module::<Mlp, f32>();
    let opt = Adam::new(&model, AdamConfig::default());
    let mut agent = Agent::<Mlp> { model, opt };
    let mut scaler = GradScaler::default();
    agent.train(&x, &y, &mut scaler);
    let r = scaler.last_step().unwrap();
    assert!(r.is_applied() && !r.mpx_layers, "{r:?}");
    assert_eq!(r.precision, DType::Float32);
}

// ---- a dfdx transformer classifier on mpx's layers ----------------------------------------------
//
// Embedding, one dfdx encoder block and a `Linear` head, as the bench (`bench_transformer`) and
// dfdx users write it. The mapped working copy runs the block on mpx's mixed-ready layers (layer
// norms and softmax in f32, matmuls with f32 sums on mpx's GEMM, outputs rounded to f16).
//
// Gradient bound, as `tests/nn_attention.rs` counts it (normwise relative error below `n·u`,
// `u = 2^-11`, with the parameters f16 values to start with): the encoder block's `n = 32`, the
// head `Linear` (output, input and weight gradients: 3), the mean over the sequence (its f16 sum
// of `TS` terms: 6), the embedding's gather and its scatter-added gradient (a few repeats of a
// token per batch: 3), and the output rounding and the loss gradient's rounding to f16 (2),
// rounded up: `n = 48`.
//
// Loss after a few Adam steps: Adam moves every parameter by about `lr` per step whatever the
// gradient's size, so where a gradient is rounding noise (the key bias's is exactly zero) the f16
// run takes steps the f32 run does not; those do not change the loss (softmax ignores a constant
// per query). The rest differs by the gradients' `48·u` relative error times `lr` per step; after
// `STEPS` steps each loss is within 1% of the f32 run's.

const TB: usize = 4;
const TS: usize = 6;
const TV: usize = 16;
const TM: usize = 16;
const TC: usize = 3;
const STEPS: usize = 5;
type Tiny = (
    Embedding<TV, TM>,
    TransformerEncoder<TM, 4, 32, 1>,
    Linear<TM, TC>,
);
type TinyModel = <Tiny as BuildOnDevice<Cpu, f32>>::Built;
type Tokens = Tensor<Rank2<TB, TS>, usize, Cpu>;
type Labels = Tensor<Rank2<TB, TC>, f32, Cpu>;

fn tiny_f32_step(
    model: &mut TinyModel,
    opt: &mut Adam<TinyModel, f32, Cpu>,
    x: Tokens,
    y: Labels,
) -> f32 {
    let grads = model.alloc_grads();
    let h = model.0.forward(x.traced(grads));
    let h = model.1.forward(h);
    let logits = model.2.forward(h.mean::<_, Axis<1>>());
    let loss = cross_entropy_with_logits_loss(logits, y);
    let value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    value
}

#[mixed_step(scaling = scaler)]
fn tiny_f16_step(
    model: &mut TinyModel,
    opt: &mut Adam<TinyModel, f32, Cpu>,
    x: Tokens,
    y: Labels,
    scaler: &mut GradScaler,
) -> f32 {
    let grads = model.alloc_grads();
    let h = model.0.forward(x.traced(grads));
    let h = model.1.forward(h);
    let logits = model.2.forward(h.mean::<_, Axis<1>>());
    let loss = cross_entropy_with_logits_loss(logits, y);
    let value = loss.array();
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
    value
}

/// A master with f16 values, tokens and one-hot labels.
fn tiny_setup() -> (TinyModel, Tokens, Labels) {
    let dev = Cpu::seed_from_u64(21);
    let model = dev.build_module::<Tiny, f32>();
    let model = model.to_dtype::<f16>().to_dtype::<f32>();
    let ids: Vec<usize> = (0..TB * TS).map(|i| (i * 7 + 3) % TV).collect();
    let x: Tokens = dev.tensor_from_vec(ids, (Const, Const));
    let mut onehot = vec![0.0f32; TB * TC];
    for i in 0..TB {
        onehot[i * TC + i % TC] = 1.0;
    }
    let y: Labels = dev.tensor_from_vec(onehot, (Const, Const));
    (model, x, y)
}

#[test]
fn a_dfdx_transformer_classifier_trains_on_mpx_layers_as_in_f32() {
    let (init, x, y) = tiny_setup();
    let adam = |m: &TinyModel| {
        Adam::new(
            m,
            AdamConfig {
                lr: 1e-2,
                ..Default::default()
            },
        )
    };
    let (mut m32, mut m16) = (init.clone(), init);
    let (mut o32, mut o16) = (adam(&m32), adam(&m16));
    let mut scaler = GradScaler::default();
    let mut worst = 0.0f32;
    for step in 0..STEPS {
        let l32 = tiny_f32_step(&mut m32, &mut o32, x.clone(), y.clone());
        let l16 = tiny_f16_step(&mut m16, &mut o16, x.clone(), y.clone(), &mut scaler);
        let r = scaler.last_step().unwrap();
        assert!(r.is_applied() && r.mpx_layers, "step {step}: {r:?}");
        assert_eq!(r.precision, DType::Float16);
        assert!(
            (l16 - l32).abs() <= 0.01 * l32.abs(),
            "step {step}: loss {l16} in f16 vs {l32} in f32"
        );
        worst = worst.max((l16 - l32).abs() / l32.abs());
    }
    eprintln!("worst relative loss difference {worst} (tolerance 0.01)");
}

#[test]
fn a_dfdx_transformer_classifiers_mapped_gradients_are_within_the_bound() {
    const U16: f64 = 1.0 / 2048.0;
    let (model, x, y) = tiny_setup();
    let logits32 = {
        let h = model.0.forward(x.clone().traced(model.alloc_grads()));
        let h = model.1.forward(h);
        model.2.forward(h.mean::<_, Axis<1>>())
    };
    let g32 = cross_entropy_with_logits_loss(logits32, y.clone()).backward();

    let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(1024.0).unwrap());
    let mapped = Mixed::mapped(model.clone());
    let logits16 = scaler
        .forward(&mapped, x.traced(model.alloc_grads()), |m, x| {
            let h = m.0.forward(x);
            let h = m.1.forward(h);
            m.2.forward(h.mean::<_, Axis<1>>())
        })
        .unwrap();
    let g16 = scaler
        .backward(cross_entropy_with_logits_loss(logits16, y))
        .unwrap();
    assert!(scaler.last_step().is_none());

    // visit order: embedding, then the block (w_q, w_k, w_v, w_o: weight and bias each; norm1;
    // ff's two Linears; norm2), then the head; each tensor's gradient compared on its own
    let sizes = [
        TV * TM,
        TM * TM,
        TM,
        TM * TM,
        TM,
        TM * TM,
        TM,
        TM * TM,
        TM,
        TM,
        TM,
        32 * TM,
        32,
        TM * 32,
        TM,
        TM,
        TM,
        TC * TM,
        TC,
    ];
    let (want, got) = (
        param_grads(&model, &g32).concat(),
        param_grads(&model, &g16).concat(),
    );
    assert_eq!(sizes.iter().sum::<usize>(), want.len());
    let mut at = 0;
    let mut worst = 0.0f64;
    for (k, n) in sizes.into_iter().enumerate() {
        let (a, b) = (&got[at..at + n], &want[at..at + n]);
        at += n;
        assert!(a.iter().all(|v| v.is_finite()), "gradient {k}: not finite");
        if k == 4 {
            continue; // the key bias: exactly zero in exact arithmetic, rounding noise only
        }
        let e = rel(a, b);
        assert!(e < 48.0 * U16, "gradient {k}: relative error {e}");
        worst = worst.max(e);
    }
    eprintln!(
        "worst relative gradient error {worst} (bound {})",
        48.0 * U16
    );
}

/// In emulated bf16 the mapped working copy is mpx's layers of f32 elements wrapped in
/// `InBf16`, which runs them in bf16: a `Linear`'s output holds bf16 values. The layer inside the
/// wrapper, and the same layer outside a step, run in f32.
#[test]
fn emulated_bf16_runs_the_mapped_layers_in_bf16() {
    let dev = Cpu::seed_from_u64(5);
    let model = Mixed::mapped(dev.build_module::<(Linear<12, 24>, ReLU, Linear<24, 5>), f32>());
    let x: X = dev.sample_normal();
    let is_bf16 = |v: &[f32]| v.iter().all(|x| x.to_bits() & 0xffff == 0);
    let mut scaler = GradScaler::<bf16, _>::new(StaticLossScale::new(1.0).unwrap());
    let (mut wrapped, mut inner) = (vec![], vec![]);
    let out = scaler
        .forward(&model, x.trace(model.alloc_grads()), |m, x| {
            let xv = x.retaped::<NoneTape>();
            wrapped = m.0.forward(xv.clone()).as_vec();
            inner = m.0.0.forward(xv).as_vec();
            m.forward(x)
        })
        .unwrap();
    assert!(out.as_vec().iter().all(|v| v.is_finite()));
    assert!(is_bf16(&wrapped), "the working copy runs the layer in bf16");
    assert!(
        !is_bf16(&inner),
        "the layer of f32 elements inside it runs in f32"
    );
    let layer = dev.build_module::<mpx::nn::builders::Linear<12, 24>, f32>();
    assert!(!is_bf16(&layer.forward(x).as_vec()));
}

// ---- the working copy's kept buffers --------------------------------------------------------

/// A model whose weights are large enough (from 64 KiB in f16) for the scaler to keep their
/// working-copy tensors from one pass to the next.
type Wide = (Linear<256, 256>, ReLU, Linear<256, 4>);
type WideModel = <Wide as BuildOnDevice<Cpu, f32>>::Built;
type WideX = Tensor<Rank2<8, 256>, f32, Cpu>;
type WideY = Tensor<Rank2<8, 4>, f32, Cpu>;

/// Three Adam steps of `Mixed::$kind(init)`, with one scaler for all (`shared`) or a fresh one
/// for each: the master's values after them (a macro: rustc rejects a generic
/// `K: Kind<H, (A, B, C), Cpu>` bound with a tuple model, see `tests/step.rs`).
macro_rules! wide_steps {
    ($kind:ident, $init:expr, $x:expr, $y:expr, $shared:expr) => {{
        let mut master = Mixed::$kind($init);
        let new_scaler = || GradScaler::<f16, _>::new(StaticLossScale::new(1024.0).unwrap());
        let mut opt = Adam::new(&*master, AdamConfig::default());
        let mut scaler = new_scaler();
        for _ in 0..3 {
            if !$shared {
                scaler = new_scaler();
            }
            let out = scaler
                .forward(&master, $x.trace(master.alloc_grads()), |m, x| m.forward(x))
                .unwrap();
            let grads = scaler.backward(mse_loss(out, $y.clone())).unwrap();
            assert!(
                scaler
                    .update(&mut master, &mut opt, &grads)
                    .unwrap()
                    .is_applied()
            );
        }
        params(&*master)
    }};
}

/// The gradient of an input `x1` after a pass on `Mixed::$kind(init)` as it is, then (`second`)
/// a pass on the master with its first weight doubled, before one backward pass of both losses;
/// a whole step first, so that the scaler keeps the working copy's tensors.
macro_rules! first_input_grad {
    ($kind:ident, $init:expr, $second:expr) => {{
        let dev = Cpu::seed_from_u64(41);
        let (x1, x2): (WideX, WideX) = (dev.sample_normal(), dev.sample_normal());
        let y: WideY = dev.sample_normal();
        let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(1024.0).unwrap());
        let mut master = Mixed::$kind($init);
        let out = scaler
            .forward(&master, x2.leaky_trace(), |m, x| m.forward(x))
            .unwrap();
        drop(scaler.backward(mse_loss(out, y.clone())).unwrap());
        let out1 = scaler
            .forward(&master, x1.leaky_trace(), |m, x| m.forward(x))
            .unwrap();
        let mut loss = mse_loss(out1, y.clone());
        if $second {
            master.0.weight = master.0.weight.clone() * 2.0;
            let out2 = scaler
                .forward(&master, x2.leaky_trace(), |m, x| m.forward(x))
                .unwrap();
            loss = loss + mse_loss(out2, y.clone());
        }
        let grads = scaler.backward(loss).unwrap();
        grads.get(&x1).as_vec()
    }};
}

/// The scaler keeps a large working-copy tensor from one pass to the next and writes the next
/// pass's values into it in place: that changes no result. Steps with one scaler leave the
/// master bit for bit where steps with a fresh scaler each leave it, and a second pass before
/// the first one's backward pass (the master changed in between) does not write the buffers the
/// first pass still holds: the first input's gradient is the same, bit for bit, as without the
/// second pass. Both kinds of working copy.
#[test]
fn kept_working_copy_buffers_change_no_result() {
    let dev = Cpu::seed_from_u64(40);
    let init: WideModel = dev.build_module::<Wide, f32>();
    let x: WideX = dev.sample_normal();
    let y: WideY = dev.sample_normal();
    assert_eq!(
        bits(&wide_steps!(mapped, init.clone(), x, y, true)),
        bits(&wide_steps!(mapped, init.clone(), x, y, false)),
        "mapped: one scaler against a fresh one per step"
    );
    assert_eq!(
        bits(&wide_steps!(new, init.clone(), x, y, true)),
        bits(&wide_steps!(new, init.clone(), x, y, false)),
        "plain: one scaler against a fresh one per step"
    );
    assert_eq!(
        bits(&first_input_grad!(mapped, init.clone(), false)),
        bits(&first_input_grad!(mapped, init.clone(), true)),
        "mapped: the first pass's input gradient"
    );
    assert_eq!(
        bits(&first_input_grad!(new, init.clone(), false)),
        bits(&first_input_grad!(new, init.clone(), true)),
        "plain: the first pass's input gradient"
    );
    // the test can tell: a first pass on the doubled weight gives another gradient
    let mut doubled = init.clone();
    doubled.0.weight = doubled.0.weight.clone() * 2.0;
    assert_ne!(
        bits(&first_input_grad!(mapped, doubled, false)),
        bits(&first_input_grad!(mapped, init, false))
    );
}
