//! Training with MX weights on the real 8x8 digits (smartcore's embedded UCI optdigits): an MLP
//! whose Linear layers are converted to `MxLinear` (MXFP8 E4M3 weights, block 32, fake-quantized
//! in every forward, straight-through gradients into f32 master weights) lands within 2 points of
//! the same MLP trained in f32, from the same initial weights on the same batches. MXFP4's result
//! is printed beside them (`cargo test -p mpx --test mx_digits -- --nocapture`).

mod common;

use common::digits::{CLASSES, Digits, FEATURES};
use dfdx::nn::modules::Linear as LinearLayer;
use dfdx::{optim::*, prelude::*};
use mpx::mx::{MxConfig, MxLinear, Mxfp4Weights, Mxfp8Weights};
use mpx::nn::IntoLayers;

const BATCH: usize = 32;
const EPOCHS: usize = 20;
const HIDDEN: usize = 128;

type Mlp = (Linear<FEATURES, HIDDEN>, ReLU, Linear<HIDDEN, CLASSES>);
type F32Mlp = <Mlp as BuildOnDevice<Cpu, f32>>::Built;
type MxMlp<C> = (
    MxLinear<FEATURES, HIDDEN, C, f32, Cpu>,
    ReLU,
    MxLinear<HIDDEN, CLASSES, C, f32, Cpu>,
);
type X<T = NoneTape> = Tensor<Rank2<BATCH, FEATURES>, f32, Cpu, T>;
type Y<T = NoneTape> = Tensor<Rank2<BATCH, CLASSES>, f32, Cpu, T>;
type Traced = OwnedTape<f32, Cpu>;

/// The batches of one epoch, the last partial batch dropped.
fn epoch_batches(dev: &Cpu, d: &Digits, epoch: usize) -> Vec<(X, Y)> {
    d.epoch_order(epoch)
        .chunks_exact(BATCH)
        .map(|idx| d.train_batch(dev, idx))
        .collect()
}

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best
}

/// Trains `model` with Adam; returns its test accuracy in percent and its test logits.
fn train_and_test<M>(dev: &Cpu, d: &Digits, mut model: M) -> (f64, Vec<f32>)
where
    M: TensorCollection<f32, Cpu>
        + Module<X<Traced>, Output = Y<Traced>, Error = CpuError>
        + Module<X, Output = Y, Error = CpuError>,
{
    let mut opt = Adam::new(
        &model,
        AdamConfig {
            lr: 2e-3,
            ..Default::default()
        },
    );
    let mut grads = model.alloc_grads();
    for epoch in 0..EPOCHS {
        for (x, y) in epoch_batches(dev, d, epoch) {
            let logits = model.forward(x.traced(grads));
            let loss = cross_entropy_with_logits_loss(logits, y);
            grads = loss.backward();
            opt.update(&mut model, &grads)
                .expect("every parameter has a gradient");
            model.zero_grads(&mut grads);
        }
    }
    let n = d.test_len();
    let mut hits = 0;
    let mut all = Vec::with_capacity(n * CLASSES);
    for start in (0..n).step_by(BATCH) {
        // Pad the last batch with zeros; only real images count.
        let real = BATCH.min(n - start);
        let mut x = vec![0.0f32; BATCH * FEATURES];
        x[..real * FEATURES]
            .copy_from_slice(&d.test_x[start * FEATURES..(start + real) * FEATURES]);
        let logits = model
            .forward(dev.tensor_from_vec(x, (Const, Const)))
            .as_vec();
        hits += (0..real)
            .filter(|&r| argmax(&logits[r * CLASSES..(r + 1) * CLASSES]) == d.test_y[start + r])
            .count();
        all.extend_from_slice(&logits[..real * CLASSES]);
    }
    (100.0 * hits as f64 / n as f64, all)
}

fn mx_accuracy<C: MxConfig>(dev: &Cpu, d: &Digits, init: &F32Mlp) -> (f64, Vec<f32>) {
    let model: MxMlp<C> = init.clone().into_layers(C::default());
    train_and_test(dev, d, model)
}

#[test]
fn mxfp8_weights_train_within_two_points_of_f32() {
    let d = Digits::load(0.2, 7);
    let dev: Cpu = Cpu::seed_from_u64(11);
    let init = dev.build_module::<Mlp, f32>();

    let (f32_acc, f32_logits) = train_and_test(&dev, &d, init.clone());
    let (fp8_acc, fp8_logits) = mx_accuracy::<Mxfp8Weights>(&dev, &d, &init);
    let (fp4_acc, fp4_logits) = mx_accuracy::<Mxfp4Weights>(&dev, &d, &init);
    // the MX runs really ran with other weights (their logits differ from f32's)
    let max_diff = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    };
    let (d8, d4) = (
        max_diff(&f32_logits, &fp8_logits),
        max_diff(&f32_logits, &fp4_logits),
    );
    println!("largest test-logit difference from f32: MXFP8 {d8:.3}, MXFP4 {d4:.3}");
    assert!(d8 > 0.0 && d4 > d8);
    println!(
        "digits test accuracy ({} test images, {EPOCHS} epochs): f32 {f32_acc:.2}%, MXFP8 E4M3 weights {fp8_acc:.2}% ({:+.2}), MXFP4 E2M1 weights {fp4_acc:.2}% ({:+.2})",
        d.test_len(),
        fp8_acc - f32_acc,
        fp4_acc - f32_acc,
    );
    assert!(f32_acc > 90.0, "the f32 baseline learns: {f32_acc:.2}%");
    assert!(
        (fp8_acc - f32_acc).abs() <= 2.0,
        "MXFP8 {fp8_acc:.2}% vs f32 {f32_acc:.2}%"
    );
    // MXFP4 is reported, not held to the 2-point bound; it must still have learned.
    assert!(fp4_acc > 50.0, "MXFP4 {fp4_acc:.2}%");
}

#[test]
fn straight_through_gradients_reach_the_master_weights() {
    let dev: Cpu = Cpu::seed_from_u64(3);
    let init = dev.build_module::<Mlp, f32>();
    let mx: MxMlp<Mxfp8Weights> = init.clone().into_layers(Mxfp8Weights);
    let x: X = dev.sample_normal();
    // Through the same (fake-quantized) forward weights, the straight-through gradient of the
    // master weights equals the gradient a plain Linear gets at those quantized weights.
    let quantized = (
        LinearLayer {
            weight: mx.0.quantized_weight(),
            bias: mx.0.bias.clone(),
        },
        ReLU,
        LinearLayer {
            weight: mx.2.quantized_weight(),
            bias: mx.2.bias.clone(),
        },
    );
    let g_mx = mx.forward(x.leaky_trace()).square().sum().backward();
    let g_ref = quantized.forward(x.leaky_trace()).square().sum().backward();
    let (a, b) = (
        g_mx.get(&mx.0.weight).as_vec(),
        g_ref.get(&quantized.0.weight).as_vec(),
    );
    assert!(a.iter().any(|v| *v != 0.0));
    for (p, q) in a.iter().zip(&b) {
        assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
    }
    let (a, b) = (
        g_mx.get(&mx.2.bias).as_vec(),
        g_ref.get(&quantized.2.bias).as_vec(),
    );
    assert_eq!(a, b);
    // and the forward weight really is MXFP8: at most 2^3 mantissa steps, E4M3's grid
    let w = mx.0.weight_mx().expect("valid shape");
    assert_eq!(w.dequantize(), mx.0.quantized_weight().as_vec());
}

#[test]
fn mx_linear_quantizes_inputs_when_asked_for_every_input_rank() {
    use mpx::mx::{Mxfp8, quantize_dequantize};
    use mpx::nn::builders;
    let dev: Cpu = Cpu::seed_from_u64(5);
    let layer = dev.build_module::<builders::MxLinear<40, 3, Mxfp8>, f32>();
    let spec = Mxfp8::input_spec().expect("Mxfp8 quantizes inputs");
    let x: Tensor<Rank3<2, 2, 40>, f32, _> = dev.sample_normal();
    // reference: quantize the inputs (blocks of 32 along the 40 features: 32 + 8) and the weight
    // (blocks along its 40 inputs) with the plain codec, then a plain f32 linear layer
    let xq = dev.tensor_from_vec(
        quantize_dequantize(&x.as_vec(), &[2, 2, 40], &spec).unwrap(),
        (Const::<2>, Const::<2>, Const::<40>),
    );
    let wq = dev.tensor_from_vec(
        quantize_dequantize(&layer.weight.as_vec(), &[3, 40], &Mxfp8::weight_spec()).unwrap(),
        (Const::<3>, Const::<40>),
    );
    let plain = LinearLayer {
        weight: wq,
        bias: layer.bias.clone(),
    };
    assert_ne!(xq.as_vec(), x.as_vec());
    let want = plain.forward(xq.clone()).as_vec();
    assert_eq!(layer.forward(x.clone()).as_vec(), want);
    // rank 2 and rank 1 inputs give the same rows
    let x2: Tensor<Rank2<4, 40>, f32, _> = x.clone().reshape();
    assert_eq!(layer.forward(x2).as_vec(), want);
    let x1: Tensor<Rank1<40>, f32, _> = dev.tensor_from_vec(x.as_vec()[..40].to_vec(), (Const,));
    assert_eq!(layer.forward(x1).as_vec(), want[..3].to_vec());
    // weights-only configs leave the inputs alone
    assert_eq!(Mxfp8Weights::input_spec(), None);
}
