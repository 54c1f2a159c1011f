//! The working copy made of mpx's layers (`HalfLayers`, `GradScaler::forward_mapped`): which
//! working copy `#[mixed_step]` picks for which model, the mapped forward pass and gradients
//! against the f32 step, and skipped steps.
//!
//! Tolerance: every value of a two-layer f16 forward pass is rounded a handful of times (the
//! input, the weights, the hidden layer, the output: each `2^-11` relative) with f32 sums in
//! between, so each result is within `2^-7` of the largest magnitude of the f32 result.

use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorRef,
};
use dfdx::optim::{Adam, AdamConfig};
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::f16;
use mpx::scaling::StaticLossScale;
use mpx::step::{GradScaler, StepError};

type Mlp = (Linear<12, 24>, ReLU, Linear<24, 5>, Tanh);
type Model = <Mlp as BuildOnDevice<Cpu, f32>>::Built;
type Normed = (Linear<12, 24>, LayerNorm1D<24>, Linear<24, 5>, Tanh);
type NormedModel = <Normed as BuildOnDevice<Cpu, f32>>::Built;
type X = Tensor<Rank2<7, 12>, f32, Cpu>;
type Y = Tensor<Rank2<7, 5>, f32, Cpu>;

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

/// `got` within `2^-7` of the largest magnitude of `want`, entry by entry.
fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(scale > 0.0, "{what}: all zero");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= scale / 128.0,
            "{what}[{i}]: {g} vs {w} (largest {scale})"
        );
    }
}

/// The gradients of every trainable tensor of `m`, in visit order.
fn grads_of<M: TensorCollection<f32, Cpu>>(m: &M, g: &Gradients<f32, Cpu>) -> Vec<f32> {
    struct Collect<'a>(Vec<f32>, &'a Gradients<f32, Cpu>);
    impl TensorVisitor<f32, Cpu> for Collect<'_> {
        type Viewer = ViewTensorRef;
        type Err = CpuError;
        type E2 = f32;
        type D2 = Cpu;
        fn visit<S: Shape>(
            &mut self,
            o: TensorOptions<S, f32, Cpu>,
            t: &Tensor<S, f32, Cpu>,
        ) -> Result<Option<Tensor<S, f32, Cpu>>, CpuError> {
            if o.do_gradient_update {
                self.0.extend(self.1.get(t).as_vec());
            }
            Ok(None)
        }
    }
    let mut c = Collect(Vec::new(), g);
    M::iter_tensors(&mut RecursiveWalker { m, f: &mut c }).unwrap();
    c.0
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
    let out16 = scaler
        .try_forward_mapped(&model, x.trace(model.alloc_grads()), |m, x| m.forward(x))
        .unwrap();
    assert_close("output", &out16.as_vec(), &want_out);
    let g16 = scaler.backward(mse_loss(out16, y));

    let (want, got) = (grads_of(&model, &g32), grads_of(&model, &g16));
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

#[test]
fn a_skipped_mapped_step_leaves_master_and_adam_untouched() {
    let dev = Cpu::seed_from_u64(5);
    let x: X = dev.sample_normal();
    let y: Y = dev.sample_normal();
    let mut bad = x.as_vec();
    bad[3] = f32::NAN;
    let bad: X = dev.tensor_from_vec(bad, (Const, Const));
    let run = |with_skip: bool| {
        let mut model = Cpu::seed_from_u64(6).build_module::<Mlp, f32>();
        let mut opt = Adam::new(&model, AdamConfig::default());
        let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(256.0).unwrap());
        let mut step = |model: &mut Model, x: &X| {
            let out =
                scaler.forward_mapped(&*model, x.trace(model.alloc_grads()), |m, x| m.forward(x));
            let grads = scaler.backward(mse_loss(out, y.clone()));
            scaler.update(model, &mut opt, &grads).unwrap()
        };
        assert!(step(&mut model, &x).is_applied());
        if with_skip {
            let before = params(&model);
            assert!(!step(&mut model, &bad).is_applied());
            assert_eq!(bits(&params(&model)), bits(&before));
        }
        // Adam's state too: the next applied step is the same as without the skip
        assert!(step(&mut model, &x).is_applied());
        params(&model)
    };
    assert_eq!(bits(&run(true)), bits(&run(false)));
}

#[test]
fn a_master_runs_through_one_kind_of_working_copy() {
    let dev = Cpu::default();
    let model = dev.build_module::<Mlp, f32>();
    let x: X = dev.sample_normal();
    let mut scaler = GradScaler::<f16>::default();
    let _ = scaler.forward(&model, x.leaky_trace(), |m, x| m.forward(x));
    let e = scaler
        .try_forward_mapped(&model, x.leaky_trace(), |m, x| m.forward(x))
        .unwrap_err();
    assert!(matches!(e, StepError::WorkspaceMismatch { .. }), "{e}");
    assert!(e.to_string().contains("working copy"), "{e}");
}

// ---- which working copy `#[mixed_step]` picks ---------------------------------------------------

#[mixed_step(scaling = scaler)]
fn train_mlp(
    model: &mut Model,
    opt: &mut Adam<Model, f32, Cpu>,
    x: &X,
    y: &Y,
    scaler: &mut GradScaler,
) {
    let grads = model.alloc_grads();
    let out = model.forward(x.trace(grads));
    let loss = mse_loss(out, y.clone());
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
}

#[mixed_step(scaling = scaler)]
fn train_normed(
    model: &mut NormedModel,
    opt: &mut Adam<NormedModel, f32, Cpu>,
    x: &X,
    y: &Y,
    scaler: &mut GradScaler,
) {
    let grads = model.alloc_grads();
    let out = model.forward(x.trace(grads));
    let loss = mse_loss(out, y.clone());
    let grads = loss.backward();
    opt.update(model, &grads).unwrap();
}

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
    assert_eq!(r.precision, "float16");

    // a LayerNorm1D does not map: the master's own layers in f16
    let mut normed = dev.build_module::<Normed, f32>();
    let mut opt = Adam::new(&normed, AdamConfig::default());
    let mut scaler = GradScaler::default();
    train_normed(&mut normed, &mut opt, &x, &y, &mut scaler);
    let r = scaler.last_step().unwrap();
    assert!(r.is_applied() && !r.mpx_layers, "{r:?}");
    assert_eq!(r.precision, "float16");

    // a model generic through the impl: f32 on the master
    let model = dev.build_module::<Mlp, f32>();
    let opt = Adam::new(&model, AdamConfig::default());
    let mut agent = Agent::<Mlp> { model, opt };
    let mut scaler = GradScaler::default();
    agent.train(&x, &y, &mut scaler);
    let r = scaler.last_step().unwrap();
    assert!(r.is_applied() && !r.mpx_layers, "{r:?}");
    assert_eq!(r.precision, "float32");
}
