//! mpx::nn's fused half-precision ops (attention core, projections and feed-forward layers on
//! mpx's GEMM, layer norm with its residual add) against the f32 layers (= dfdx's, bit for bit)
//! run on the same values.
//!
//! Each test rounds the inputs and parameters to f16 first, so the f16 run and the f32 reference
//! start from identical numbers; the difference is then only the rounding of intermediate results
//! to the half format. Bound: with `u` the unit roundoff of the half format (f16 `2^-11`, bf16
//! `2^-8`) and at most `n` results rounded along any path from an input to the output and back to
//! a gradient, each normwise relative error stays below `n·u` (first order). Counted per layer:
//! - layer norm: output (1), input and parameter gradients (1 each, plus the incoming one): n = 4;
//! - attention: q, k, v projections, weights, tokens, output projection forward (6) and as many
//!   backward, plus the incoming gradient: n = 16;
//! - encoder block: attention (16) + layer norm (4) + two feed-forward layers (2 + 2) + layer
//!   norm (4), rounded up: n = 32.
//!
//! A wrong index, transpose or missing term in a fused op gives errors of order 1, far above these.

use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::prelude::*;
use mpx::nn::{self, ForwardIn};
use mpx::precision::{Precision, bf16, f16};

mod common;
use common::compare::rel;
use common::grads::param_grads;

fn widen<E: Precision<Elem = E> + Dtype>(v: &[E]) -> Vec<f32> {
    let mut out = vec![0.0f32; v.len()];
    E::widen(v, &mut out);
    out
}

const U16: f64 = 1.0 / 2048.0;
const UBF16: f64 = 1.0 / 256.0;

const B: usize = 3;
const S: usize = 5;
const M: usize = 16;
type Seq<E> = Tensor<Rank3<B, S, M>, E, Cpu>;

/// An f32 tensor whose values are f16 values.
fn f16_values<Sh: Shape>(t: Tensor<Sh, f32, Cpu>) -> Tensor<Sh, f32, Cpu> {
    t.to_dtype::<f16>().to_dtype::<f32>()
}

/// Output and gradients (input first, then the parameters) of `sum(layer(x) * w)` for the f32
/// layer `m32`, its f16 cast, and the f32 layer run in emulated bf16: `[f32, f16, bf16]`.
fn three_runs<L32, L16>(m32: &L32, m16: &L16, x: &Seq<f32>, w: &Seq<f32>) -> [Vec<Vec<f32>>; 3]
where
    L32: TensorCollection<f32, Cpu>
        + nn::MixedModule<
            f32,
            Tensor<Rank3<B, S, M>, f32, Cpu, OwnedTape<f32, Cpu>>,
            Output = Tensor<Rank3<B, S, M>, f32, Cpu, OwnedTape<f32, Cpu>>,
        > + nn::MixedModule<
            bf16,
            Tensor<Rank3<B, S, M>, f32, Cpu, OwnedTape<f32, Cpu>>,
            Output = Tensor<Rank3<B, S, M>, f32, Cpu, OwnedTape<f32, Cpu>>,
        >,
    L16: TensorCollection<f16, Cpu>
        + nn::MixedModule<
            f16,
            Tensor<Rank3<B, S, M>, f16, Cpu, OwnedTape<f16, Cpu>>,
            Output = Tensor<Rank3<B, S, M>, f16, Cpu, OwnedTape<f16, Cpu>>,
        >,
{
    let run32 = |bf: bool| {
        let y = if bf {
            m32.forward_in::<bf16, _>(x.leaky_trace())
        } else {
            m32.forward_in::<f32, _>(x.leaky_trace())
        };
        let out = y.retaped::<NoneTape>().as_vec();
        let g = (y * w.clone()).sum().backward();
        let mut all = vec![out, g.get(x).as_vec()];
        all.extend(param_grads(m32, &g));
        all
    };
    let x16 = x.clone().to_dtype::<f16>();
    let y16 = m16.forward_in::<f16, _>(x16.leaky_trace());
    let out16 = widen(&y16.retaped::<NoneTape>().as_vec());
    let g16 = (y16 * w.clone().to_dtype::<f16>()).sum().backward();
    let mut all16 = vec![out16, widen(&g16.get(&x16).as_vec())];
    all16.extend(param_grads(m16, &g16));
    [run32(false), all16, run32(true)]
}

/// Asserts every tensor of `got` is within `tol` of `want` (normwise), skipping the indices in
/// `skip` (whose exact value is zero: rounding noise only), and returns the largest error.
fn check(name: &str, got: &[Vec<f32>], want: &[Vec<f32>], tol: f64, skip: &[usize]) -> f64 {
    assert_eq!(got.len(), want.len());
    let mut worst = 0.0f64;
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(a.iter().all(|v| v.is_finite()), "{name} #{i}: not finite");
        if skip.contains(&i) {
            continue;
        }
        let e = rel(a, b);
        assert!(e < tol, "{name} #{i}: relative error {e} vs bound {tol}");
        worst = worst.max(e);
    }
    worst
}

#[test]
fn fused_layer_norm_matches_f32_in_f16_and_bf16() {
    let dev = Cpu::seed_from_u64(3);
    let mut ln32 = dev.build_module::<nn::LayerNorm1D<M>, f32>();
    ln32.gamma = f16_values(dev.sample_normal::<Rank1<M>>() + 1.0);
    ln32.beta = f16_values(dev.sample_normal::<Rank1<M>>());
    let ln16 = ln32.clone().to_dtype::<f16>();
    let x: Seq<f32> = f16_values(dev.sample_normal::<Rank3<B, S, M>>() * 3.0 + 1.0);
    let w: Seq<f32> = f16_values(dev.sample_normal());
    let [r32, r16, rbf] = three_runs(&ln32, &ln16, &x, &w);
    assert_eq!(r32.len(), 4, "output, input, gamma and beta gradients");
    check("f16 layer norm", &r16, &r32, 4.0 * U16, &[]);
    check("bf16 layer norm", &rbf, &r32, 4.0 * UBF16, &[]);
    // Each output is rounded once: elementwise within half an f16 ulp of the f32 result.
    for (a, b) in r16[0].iter().zip(&r32[0]) {
        assert!((a - b).abs() <= b.abs() * U16 as f32 + 3e-8, "{a} vs {b}");
    }
}

#[test]
fn fused_layer_norm_stays_finite_past_f16_max_row_sums() {
    let dev = Cpu::seed_from_u64(4);
    let ln32 = dev.build_module::<nn::LayerNorm1D<M>, f32>();
    let ln16 = ln32.clone().to_dtype::<f16>();
    // Rows near 30000 each: their sums (about 480000) pass 65504.
    let x: Seq<f32> = f16_values(dev.sample_normal::<Rank3<B, S, M>>() * 100.0 + 30000.0);
    let w: Seq<f32> = f16_values(dev.sample_normal());
    let [r32, r16, _] = three_runs(&ln32, &ln16, &x, &w);
    // The inputs are f16 values, so both runs normalize the same numbers (their f32 statistics
    // are exact to ~2^-24 · 30000 / 100 relative): the bound stays the layer norm's 4·u.
    check("f16 layer norm, large rows", &r16, &r32, 4.0 * U16, &[]);
}

#[test]
fn fused_attention_matches_f32_in_f16_and_bf16() {
    let dev = Cpu::seed_from_u64(5);
    let m32 = dev.build_module::<nn::MultiHeadAttention<M, 4>, f32>();
    let m32 = m32.to_dtype::<f16>().to_dtype::<f32>();
    let m16 = m32.clone().to_dtype::<f16>();
    let x: Seq<f32> = f16_values(dev.sample_normal::<Rank3<B, S, M>>() * 2.0);
    let w: Seq<f32> = f16_values(dev.sample_normal());
    let [r32, r16, rbf] = three_runs(&m32, &m16, &x, &w);
    assert_eq!(r32.len(), 2 + 8, "output, input and 8 parameter gradients");
    // #5 is the key bias's gradient (index 3 among the parameters): the softmax cancels it, its
    // exact value is 0 and both runs hold rounding noise; it must stay small next to the key
    // weights' gradient instead.
    let e16 = check("f16 attention", &r16, &r32, 16.0 * U16, &[5]);
    let ebf = check("bf16 attention", &rbf, &r32, 16.0 * UBF16, &[5]);
    for run in [&r16, &rbf] {
        let scale = r32[4].iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(
            run[5].iter().all(|v| v.abs() <= 1e-2 * scale),
            "key bias gradient"
        );
    }
    // Rounding, not agreement by construction: the half runs differ from f32.
    assert!(e16 > 0.0 && ebf > 0.0);
}

#[test]
fn fused_cross_attention_with_other_lengths_matches_f32() {
    const S2: usize = 7;
    let dev = Cpu::seed_from_u64(6);
    let m32 = dev.build_module::<nn::MultiHeadAttention<M, 2, 8, 12>, f32>();
    let m32 = m32.to_dtype::<f16>().to_dtype::<f32>();
    let m16 = m32.clone().to_dtype::<f16>();
    let q: Seq<f32> = f16_values(dev.sample_normal());
    let kv: Tensor<Rank3<B, S2, M>, f32, Cpu> = f16_values(dev.sample_normal());
    let w: Seq<f32> = f16_values(dev.sample_normal());
    let y32 = m32.forward_in::<f32, _>((q.leaky_trace(), kv.clone(), kv.clone()));
    let out32 = y32.retaped::<NoneTape>().as_vec();
    let g32 = (y32 * w.clone()).sum().backward();
    let (q16, kv16) = (q.clone().to_dtype::<f16>(), kv.clone().to_dtype::<f16>());
    let y16 = m16.forward_in::<f16, _>((q16.leaky_trace(), kv16.clone(), kv16));
    let out16 = widen(&y16.retaped::<NoneTape>().as_vec());
    let g16 = (y16 * w.to_dtype::<f16>()).sum().backward();
    let want: Vec<Vec<f32>> = [out32, g32.get(&q).as_vec()]
        .into_iter()
        .chain(param_grads(&m32, &g32))
        .collect();
    let got: Vec<Vec<f32>> = [out16, widen(&g16.get(&q16).as_vec())]
        .into_iter()
        .chain(param_grads(&m16, &g16))
        .collect();
    check("f16 cross-attention", &got, &want, 16.0 * U16, &[5]);
}

#[test]
fn fused_encoder_block_matches_f32_in_f16_and_bf16() {
    let dev = Cpu::seed_from_u64(7);
    let b32 = dev.build_module::<nn::TransformerEncoderBlock<M, 4, 32>, f32>();
    let b32 = b32.to_dtype::<f16>().to_dtype::<f32>();
    let b16 = b32.clone().to_dtype::<f16>();
    let x: Seq<f32> = f16_values(dev.sample_normal());
    let w: Seq<f32> = f16_values(dev.sample_normal());
    let [r32, r16, rbf] = three_runs(&b32, &b16, &x, &w);
    assert_eq!(r32.len(), 2 + 16);
    check("f16 encoder block", &r16, &r32, 32.0 * U16, &[5]);
    check("bf16 encoder block", &rbf, &r32, 32.0 * UBF16, &[5]);
}

/// The ViT's patch embedding and classification head run their linear layers as fused ops in a
/// half precision. Against the f32 layers on the same values: the patch embedding rounds its
/// output once and its gradients once each (n = 2, plus the incoming gradient: 3); the head's
/// layer norm region and linear layer add 4 + 2 (n = 8, rounded up).
#[test]
fn fused_patch_embedding_and_head_match_f32_in_f16_and_bf16() {
    use mpx::nn::vit::{ClassificationHead, PatchEmbedding};
    type Patch<E> = PatchEmbedding<64, 4, 16, M, E, Cpu>;
    type Head<E> = ClassificationHead<M, 10, E, Cpu>;
    let dev = Cpu::seed_from_u64(5);
    let p32 = dev.build_module::<Patch<f32>, f32>();
    let p32 = p32.to_dtype::<f16>().to_dtype::<f32>();
    let h32 = dev.build_module::<Head<f32>, f32>();
    let h32 = h32.to_dtype::<f16>().to_dtype::<f32>();
    let (p16, h16) = (p32.clone().to_dtype::<f16>(), h32.clone().to_dtype::<f16>());
    let images: Tensor<Rank2<B, 64>, f32, Cpu> = f16_values(dev.sample_normal());
    let w: Tensor<Rank2<B, 10>, f32, Cpu> = f16_values(dev.sample_normal());

    // Output, the images' gradient, then the patch embedding's and the head's parameters.
    let run32 = |bf: bool| {
        let t = if bf {
            let e = p32.forward_in::<bf16, _>(images.leaky_trace());
            h32.forward_in::<bf16, _>(e)
        } else {
            h32.forward_in::<f32, _>(p32.forward_in::<f32, _>(images.leaky_trace()))
        };
        let out = t.retaped::<NoneTape>().as_vec();
        let g = (t * w.clone()).sum().backward();
        let mut all = vec![out, g.get(&images).as_vec()];
        all.extend(param_grads(&p32, &g));
        all.extend(param_grads(&h32, &g));
        all
    };
    let x16 = images.clone().to_dtype::<f16>();
    let t16 = h16.forward_in::<f16, _>(p16.forward_in::<f16, _>(x16.leaky_trace()));
    let out16 = widen(&t16.retaped::<NoneTape>().as_vec());
    let g16 = (t16 * w.clone().to_dtype::<f16>()).sum().backward();
    let mut r16 = vec![out16, widen(&g16.get(&x16).as_vec())];
    r16.extend(param_grads(&p16, &g16));
    r16.extend(param_grads(&h16, &g16));
    let (r32, rbf) = (run32(false), run32(true));
    assert_eq!(r32.len(), 2 + 2 + 4);
    check("f16 patch + head", &r16, &r32, 8.0 * U16, &[]);
    check("bf16 patch + head", &rbf, &r32, 8.0 * UBF16, &[]);
}

/// Whether every value is a bf16 value (its low 16 bits zero).
fn all_bf16(v: &[f32]) -> bool {
    v.iter().all(|x| x.to_bits() & 0xffff == 0)
}

/// Emulated bf16 stores f32, so only the precision says that the fused linear layers' outputs and
/// gradients are rounded: in an encoder block and in the ViT's patch embedding and head run with
/// `forward_in::<bf16, _>`, the output, the input's gradient and every parameter's gradient hold
/// bf16 values (the inputs and parameters themselves are arbitrary f32 values), and the same
/// layers in f32 do not (the key bias's gradient aside: it is exactly zero, see above).
#[test]
fn emulated_bf16_outputs_and_gradients_are_bf16_values() {
    use mpx::nn::vit::{ClassificationHead, PatchEmbedding};
    let dev = Cpu::seed_from_u64(11);
    let block = dev.build_module::<nn::TransformerEncoderBlock<M, 4, 32>, f32>();
    let x: Seq<f32> = dev.sample_normal();
    for bf in [true, false] {
        let y = if bf {
            block.forward_in::<bf16, _>(x.leaky_trace())
        } else {
            block.forward_in::<f32, _>(x.leaky_trace())
        };
        let out = y.retaped::<NoneTape>().as_vec();
        let g = (y * x.clone()).sum().backward();
        let mut all = vec![out, g.get(&x).as_vec()];
        all.extend(param_grads(&block, &g));
        assert_eq!(all.len(), 2 + 16);
        for (i, v) in all.iter().enumerate() {
            assert_eq!(
                all_bf16(v),
                bf || i == 5,
                "encoder block, bf16 = {bf}, #{i}"
            );
        }
    }

    let patch = dev.build_module::<PatchEmbedding<64, 4, 16, M, f32, Cpu>, f32>();
    let head = dev.build_module::<ClassificationHead<M, 10, f32, Cpu>, f32>();
    let images: Tensor<Rank2<B, 64>, f32, Cpu> = dev.sample_normal();
    let w: Tensor<Rank2<B, 10>, f32, Cpu> = dev.sample_normal();
    let t = head.forward_in::<bf16, _>(patch.forward_in::<bf16, _>(images.leaky_trace()));
    let out = t.retaped::<NoneTape>().as_vec();
    let g = (t * w).sum().backward();
    let mut all = vec![out, g.get(&images).as_vec()];
    all.extend(param_grads(&patch, &g));
    all.extend(param_grads(&head, &g));
    assert_eq!(all.len(), 2 + 2 + 4);
    for (i, v) in all.iter().enumerate() {
        assert!(all_bf16(v), "patch + head, #{i}");
    }
}

/// Attention over an empty sequence (no queries or no keys) is an error in every precision, not a
/// panic inside the fused op.
#[test]
fn attention_on_an_empty_sequence_is_an_error() {
    let dev = Cpu::seed_from_u64(12);
    let m32 = dev.build_module::<nn::MultiHeadAttention<M, 4>, f32>();
    let m16 = m32.clone().to_dtype::<f16>();
    let empty: Tensor<(Const<2>, usize, Const<M>), f32, Cpu> = dev.zeros_like(&(Const, 0, Const));
    let three: Tensor<(Const<2>, usize, Const<M>), f32, Cpu> = dev.ones_like(&(Const, 3, Const));
    for (q, kv) in [(&empty, &empty), (&three, &empty), (&empty, &three)] {
        let (q16, kv16) = (q.clone().to_dtype::<f16>(), kv.clone().to_dtype::<f16>());
        let r16 = m16.try_forward_in::<f16, _>((q16.leaky_trace(), kv16.clone(), kv16));
        assert!(r16.is_err(), "f16, q {:?}, kv {:?}", q.shape(), kv.shape());
        let rbf = m32.try_forward_in::<bf16, _>((q.leaky_trace(), kv.clone(), kv.clone()));
        assert!(rbf.is_err(), "bf16");
        let r32 = m32.try_forward_in::<f32, _>((q.leaky_trace(), kv.clone(), kv.clone()));
        assert!(r32.is_err(), "f32");
    }
    // Self-attention on an unbatched empty sequence as well.
    let x: Tensor<(usize, Const<M>), f16, Cpu> = dev.zeros_like(&(0, Const));
    assert!(m16.try_forward(x).is_err());
}

/// The fused ops take their buffers from a pool kept across steps, holding whatever the last user
/// left. A forward and backward of an encoder block gives the same bits again after other runs
/// (other shapes, other values, NaN written through every buffer they used) went through the pool.
#[test]
fn fused_ops_give_the_same_bits_when_their_buffers_are_reused() {
    let dev = Cpu::seed_from_u64(13);
    let block = dev.build_module::<nn::TransformerEncoderBlock<M, 4, 32>, f16>();
    let x: Seq<f32> = dev.sample_normal();
    let x = x.to_dtype::<f16>();
    let run = || {
        let y = block.forward_in::<f16, _>(x.leaky_trace());
        let out = y.retaped::<NoneTape>().as_vec();
        let g = (y * x.clone()).sum().backward();
        let mut all = vec![widen(&out), widen(&g.get(&x).as_vec())];
        all.extend(param_grads(&block, &g));
        all.into_iter()
            .map(|v| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    };
    let first = run();
    // Other runs through the same ops: a longer sequence, and a NaN input (NaN everywhere).
    let other = dev.build_module::<nn::TransformerEncoderBlock<M, 4, 32>, f16>();
    let long: Tensor<Rank3<2, 9, M>, f32, Cpu> = dev.sample_normal();
    let long = long.to_dtype::<f16>();
    let _ = (other.forward_in::<f16, _>(long.leaky_trace()))
        .sum()
        .backward();
    let nan: Tensor<Rank3<B, S, M>, f16, Cpu> = dev.zeros() + f16::NAN;
    let _ = (other.forward_in::<f16, _>(nan.leaky_trace()))
        .sum()
        .backward();
    assert_eq!(run(), first);
}

/// Inside a `GradScaler<f16>` forward pass, the encoder block's dense layers (the attention's
/// four projections, the two feed-forward layers) run on the fused `nn::Linear` op and write their
/// weight and bias gradients in f32 straight into the master's: times the scale, such a gradient
/// is not an f16 value in general. The layer norms' parameters take the half-gradient path (f16
/// gradients at the scale, moved to the master afterwards): times the scale, theirs are f16
/// values. Both agree with the same f16 graph's gradients outside a scaler (f16 parameters,
/// input and output seed) within the encoder block's bound, `32·u`.
#[test]
fn encoder_block_dense_layers_take_the_direct_path_in_a_grad_scaler() {
    use mpx::scaling::StaticLossScale;
    use mpx::step::GradScaler;
    const SCALE: f32 = 1024.0;
    let dev = Cpu::seed_from_u64(14);
    let master = dev.build_module::<nn::TransformerEncoderBlock<M, 4, 32>, f32>();
    let master = master.to_dtype::<f16>().to_dtype::<f32>();
    let x: Seq<f32> = f16_values(dev.sample_normal());
    let w: Seq<f32> = f16_values(dev.sample_normal());
    let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(SCALE).expect("a valid scale"));
    let mapped = mpx::step::Mixed::mapped(master.clone());
    let out = scaler
        .forward(&mapped, x.clone().traced(master.alloc_grads()), |m, x| {
            m.forward(x)
        })
        .unwrap();
    let g = scaler.backward((out * w.clone()).sum()).unwrap();
    let got = param_grads(&master, &g);
    // the reference: the f16 graph without a scaler
    let m16 = master.clone().to_dtype::<f16>();
    let y16 = m16.forward(x.to_dtype::<f16>().leaky_trace());
    let want = param_grads(&m16, &(y16 * w.to_dtype::<f16>()).sum().backward());
    // visit order: w_q, w_k, w_v, w_o (weight, bias each), norm1 (gamma, beta),
    // ff.0.0 (weight, bias), ff.0.2 (weight, bias), norm2 (gamma, beta)
    let direct: Vec<usize> = (0..8).chain(10..14).collect();
    let is_f16_at_scale = |v: &[f32]| {
        v.iter()
            .all(|g| f16::from_f32(g * SCALE).to_f32() == g * SCALE)
    };
    assert_eq!(got.len(), 16);
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        if i == 3 {
            continue; // the key bias: exactly zero, rounding noise only (see above)
        }
        let e = rel(a, b);
        assert!(e < 32.0 * U16, "#{i}: relative error {e}");
        if direct.contains(&i) {
            assert!(!is_f16_at_scale(a), "#{i}: went through f16");
        } else {
            assert!(is_f16_at_scale(a), "#{i}: expected the half path");
        }
    }
}
