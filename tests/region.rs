//! Full-precision regions (`mpx::region::FullPrecision`): gradients through the f32 bridge.
//!
//! With `H = f32` the bridge casts nothing, so its gradients must be bit-identical to the same
//! computation without a region: any difference is a bug in the bridge (lost or double-counted
//! contributions, wrong accumulation order). With `H = f16` the region must avoid the overflow a
//! plain f16 LayerNorm hits, and match the f32 computation to f16 accuracy.

use dfdx::prelude::*;
use mpx::precision::{bf16, f16, round_to_bf16};
use mpx::region::FullPrecision;

type Ln<E> = dfdx::nn::modules::LayerNorm1D<8, E, Cpu>;

mod common;
use common::bits::bits;

/// Input rows with large, mixed values; row 0 sums to 4 * 30000 > 65504.
fn big_rows() -> [[f32; 8]; 4] {
    [
        [30000.0, 30000.0, 30000.0, 30000.0, 1.0, 2.0, 3.0, 4.0],
        [0.5, -1.25, 2.0, 3.5, -0.75, 1.0, 0.25, -2.0],
        [100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0],
        [-3.0, 3.0, -3.0, 3.0, 1.5, -1.5, 0.0, 9.0],
    ]
}

/// A fixed non-uniform weighting of the output, so that every output element gets its own
/// gradient.
fn weights(dev: &Cpu) -> Tensor<Rank2<4, 8>, f32, Cpu> {
    let mut w = [[0.0f32; 8]; 4];
    for (i, row) in w.iter_mut().enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            *v = 0.1 + 0.05 * (i * 8 + j) as f32;
        }
    }
    dev.tensor(w)
}

fn ln_with_params(dev: &Cpu) -> Ln<f32> {
    let mut ln = dev.build_module::<LayerNorm1D<8>, f32>();
    ln.gamma = dev.tensor([1.0, 0.5, 2.0, -1.0, 0.75, 1.5, 1.25, 0.25]);
    ln.beta = dev.tensor([0.1, -0.2, 0.3, 0.0, 0.5, -0.5, 1.0, 2.0]);
    ln
}

#[test]
fn f32_region_layer_norm_with_params_and_residual_is_bit_identical() {
    let dev = Cpu::default();
    let ln = ln_with_params(&dev);
    let x: Tensor<Rank2<4, 8>, f32, Cpu> = dev.tensor(big_rows()).sqrt();
    let w = weights(&dev);

    // Plain f32: y = x + softmax(LN(x)) * w, loss = sum(y * y).
    let grads = Gradients::leaky();
    let h = ln.forward(x.trace(grads));
    let (h, tape) = h.split_tape();
    let y = h.clone().put_tape(tape).softmax::<Axis<1>>() * w.clone() + x.clone();
    let plain = (y.square() * w.clone()).sum().backward();

    // Same, with LN + softmax inside a region; x also feeds the residual outside it.
    let grads = Gradients::leaky();
    let xt = x.trace(grads);
    let r = FullPrecision::<f32>::run_with(&ln, xt, |ln, x| ln.forward(x).softmax::<Axis<1>>());
    let y = r * w.clone() + x.clone();
    let region = (y.square() * w.clone()).sum().backward();

    assert_eq!(
        bits(&plain.get(&x).as_vec()),
        bits(&region.get(&x).as_vec())
    );
    assert_eq!(
        bits(&plain.get(&ln.gamma).as_vec()),
        bits(&region.get(&ln.gamma).as_vec())
    );
    assert_eq!(
        bits(&plain.get(&ln.beta).as_vec()),
        bits(&region.get(&ln.beta).as_vec())
    );
    // The gradients are not trivially zero.
    assert!(region.get(&ln.gamma).as_vec().iter().any(|g| *g != 0.0));
}

#[test]
fn f32_region_with_two_inputs_and_existing_gradient_is_bit_identical() {
    let dev = Cpu::default();
    let a: Tensor<Rank1<6>, f32, Cpu> = dev.tensor([0.3, -1.7, 2.2, 0.9, -0.4, 5.5]);
    let b: Tensor<Rank1<6>, f32, Cpu> = dev.tensor([1.1, 0.2, -3.3, 0.7, 2.9, -0.6]);

    // Plain: loss = sum(exp(a) * b + a * a_detached)  (a also used after the region).
    let ta = a.leaky_trace();
    let (ta, tape) = ta.split_tape();
    let e = ta.clone().put_tape(tape).exp() * b.clone();
    let plain = (e.tanh() + ta.clone().leaky_traced() * b.clone()).sum();
    let plain = plain.backward();

    let ta = a.leaky_trace();
    let (ta, tape) = ta.split_tape();
    let e = FullPrecision::<f32>::run((ta.clone().put_tape(tape), b.clone()), |(a, b)| a.exp() * b);
    let region = (e.tanh() + ta.leaky_traced() * b.clone()).sum().backward();

    assert_eq!(
        bits(&plain.get(&a).as_vec()),
        bits(&region.get(&a).as_vec())
    );
}

#[test]
fn same_tensor_twice_shares_one_gradient_entry() {
    let dev = Cpu::default();
    let x: Tensor<Rank1<4>, f32, Cpu> = dev.tensor([1.0, -2.0, 3.0, 0.5]);
    // y = x * x through two inputs that are the same tensor: dy/dx = 2x, not x (or 4x).
    let y = FullPrecision::<f32>::run((x.leaky_trace(), x.clone()), |(a, b)| a * b);
    let g = y.sum().backward();
    assert_eq!(g.get(&x).array(), [2.0, -4.0, 6.0, 1.0]);
}

#[test]
fn f16_layer_norm_overflows_plain_and_stays_finite_in_region() {
    let dev = Cpu::default();
    let ln16 = ln_with_params(&dev).to_dtype::<f16>();
    let x16 = dev.tensor(big_rows()).to_dtype::<f16>();
    let w16 = weights(&dev).to_dtype::<f16>();
    // The f32 reference runs on exactly the values the f16 tensors hold.
    let ln32 = ln16.to_dtype::<f32>();
    let x32 = x16.clone().to_dtype::<f32>();
    let w32 = w16.clone().to_dtype::<f32>();

    // Plain f16: the mean of row 0 is sum * 1/8 with a sum past 65504 -> inf -> NaN.
    let plain = ln16.forward(x16.clone());
    assert!(plain.as_vec()[..8].iter().any(|v| v.is_nan()));

    // In a region: finite, and the f32 LayerNorm rounded once to f16.
    let grads = Gradients::leaky();
    let y = FullPrecision::<f16>::run_with(&ln16, x16.trace(grads), |ln, x| ln.forward(x));
    let reference = ln32.forward(x32.clone()).to_dtype::<f16>();
    assert_eq!(y.as_vec(), reference.as_vec());
    let g = (y * w16).sum().backward();

    // Gradients of the input and of gamma and beta: the f32 gradients, rounded once to f16.
    let grads = Gradients::leaky();
    let y32 = ln32.forward(x32.trace(grads));
    let g32 = (y32 * w32).sum().backward();
    let rounded = |v: Vec<f32>| v.into_iter().map(f16::from_f32).collect::<Vec<_>>();
    assert_eq!(g.get(&x16).as_vec(), rounded(g32.get(&x32).as_vec()));
    assert_eq!(
        g.get(&ln16.gamma).as_vec(),
        rounded(g32.get(&ln32.gamma).as_vec())
    );
    assert_eq!(
        g.get(&ln16.beta).as_vec(),
        rounded(g32.get(&ln32.beta).as_vec())
    );
    for t in [g.get(&x16).as_vec(), g.get(&ln16.gamma).as_vec()] {
        assert!(t.iter().all(|v| v.is_finite()), "{t:?}");
    }
}

#[test]
fn f16_softmax_region_matches_f32() {
    let dev = Cpu::default();
    let x16 = (dev.tensor(big_rows()) * 1e-3).to_dtype::<f16>();
    let w16 = weights(&dev).to_dtype::<f16>();
    let x32 = x16.clone().to_dtype::<f32>();
    let w32 = w16.clone().to_dtype::<f32>();

    let y = FullPrecision::<f16>::run(x16.leaky_trace(), |x| x.softmax::<Axis<1>>());
    let yv = y.as_vec();
    let g = (y * w16).sum().backward();

    let y32 = x32.leaky_trace().softmax::<Axis<1>>();
    let rounded = |v: Vec<f32>| v.into_iter().map(f16::from_f32).collect::<Vec<_>>();
    assert_eq!(yv, rounded(y32.retaped::<NoneTape>().as_vec()));
    let g32 = (y32 * w32).sum().backward();
    assert_eq!(g.get(&x16).as_vec(), rounded(g32.get(&x32).as_vec()));
}

#[test]
fn bf16_region_rounds_to_bf16_not_f16() {
    let dev = Cpu::default();
    // Emulated bf16: f32 storage. 70000 is past f16's max, finite in bf16.
    let x: Tensor<Rank1<3>, f32, Cpu> = dev.tensor([70000.0, 1.0 + 1.0 / 64.0, -3.0]);
    let y = FullPrecision::<bf16>::run(x.leaky_trace(), |x| x * 1.0078125);
    let exact = [
        70000.0 * 1.0078125,
        (1.0 + 1.0 / 64.0) * 1.0078125,
        -3.0 * 1.0078125,
    ];
    let mut rounded = [0.0f32; 3];
    round_to_bf16(&exact, &mut rounded);
    assert_eq!(y.array(), rounded);
    assert!(rounded[0].is_finite() && rounded[0] > 65504.0);

    // Gradients crossing back are rounded to bf16 too: d(sum(y * c))/dx = 1.0078125 * c.
    let c: Tensor<Rank1<3>, f32, Cpu> = dev.tensor([1.0, 3.0, 0.5]);
    let g = (y * c).sum().backward();
    let mut want = [0.0f32; 3];
    round_to_bf16(&[1.0078125, 3.0 * 1.0078125, 0.5 * 1.0078125], &mut want);
    assert_eq!(g.get(&x).array(), want);
}

#[test]
fn untraced_and_permuted_inputs() {
    let dev = Cpu::default();
    let x: Tensor<Rank2<2, 3>, f32, Cpu> = dev.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]);
    // No tape: just runs in f32.
    let y = FullPrecision::<f16>::run(x.clone().to_dtype::<f16>(), |x| x.exp());
    assert_eq!(y.array()[0][0], f16::from_f32(1.0f32.exp()));

    // A permuted (non-contiguous) input: gradients land on the right elements.
    let p = x.leaky_trace().permute::<Rank2<3, 2>, _>();
    let c: Tensor<Rank2<3, 2>, f32, Cpu> = dev.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]);
    let y = FullPrecision::<f32>::run(p, |p| p * 2.0);
    let g = (y * c).sum().backward();
    assert_eq!(g.get(&x).array(), [[2.0, 6.0, 10.0], [4.0, 8.0, 12.0]]);
}

/// A third-party collection whose `TensorCollection` impl builds nothing (returns `None`).
struct Unbuilt;

impl<E: Dtype, D: Device<E>> TensorCollection<E, D> for Unbuilt {
    type To<E2: Dtype, D2: Device<E2>> = Unbuilt;

    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        _visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        Ok(None)
    }
}

#[test]
fn a_collection_that_is_not_rebuilt_is_an_error_not_a_panic() {
    let dev = Cpu::default();
    let x: Tensor<Rank1<2>, f16, Cpu> = dev.tensor([1.0f32, 2.0]).to_dtype::<f16>();
    let err =
        FullPrecision::<f16>::try_run_with(&Unbuilt, x.leaky_trace(), |_, x| x.exp()).unwrap_err();
    assert!(
        matches!(err, mpx::region::RegionError::NotRebuilt),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("iter_tensors"), "{msg}");
}
