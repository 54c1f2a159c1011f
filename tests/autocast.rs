//! `#[autocast]` end to end: an attention-like forward function whose row statistics overflow f16.
//!
//! * In f16 the plain function gives NaN or inf; the annotated one (its `normalize` and `softmax`
//!   in f32 regions, its matmuls in f16) gives finite outputs and gradients, close to f32.
//! * With `H = f32` the annotated function is bit-identical to the plain one, forward and
//!   gradients: the regions change nothing but the precision.

use dfdx::prelude::*;
use mpx::autocast;
use mpx::precision::{Precision, f16};

type Act<E, T = NoneTape> = Tensor<Rank2<4, 8>, E, Cpu, T>;

/// Attention with normalised scores (QK-norm): each row of `q k^T` is normalised, then
/// softmaxed, then weights the values.
#[autocast]
fn attention<H: Precision, T: Tape<H::Elem, Cpu>>(
    q: Act<H::Elem, T>,
    k: Act<H::Elem>,
    v: Act<H::Elem>,
) -> Act<H::Elem, T>
where
    Cpu: Device<H::Elem>,
{
    let scores: Tensor<Rank2<4, 4>, H::Elem, Cpu, T> = q.matmul(k.permute());
    let weights = scores.normalize::<Axis<1>>(1e-5).softmax::<Axis<1>>();
    weights.matmul(v)
}

/// The same function without the attribute: everything runs in the tensors' own type.
fn attention_plain<E: Dtype, T: Tape<E, Cpu>>(q: Act<E, T>, k: Act<E>, v: Act<E>) -> Act<E, T>
where
    Cpu: Device<E>,
{
    let scores: Tensor<Rank2<4, 4>, E, Cpu, T> = q.matmul(k.permute());
    let weights = scores.normalize::<Axis<1>>(1e-5).softmax::<Axis<1>>();
    weights.matmul(v)
}

/// Query, key and value rows. Query row 0 is about 60 and key row j about 20 + 13.5 j, so row 0 of
/// `q k^T` runs from about 10000 to 29000: every entry fits in f16, but the row's sum (the
/// normaliser's mean) and its squares pass f16's max, 65504.
fn qkv() -> [[[f32; 8]; 4]; 3] {
    let mut out = [[[0.0f32; 8]; 4]; 3];
    for (m, mat) in out.iter_mut().enumerate() {
        for (i, row) in mat.iter_mut().enumerate() {
            for (j, x) in row.iter_mut().enumerate() {
                let wave = ((m * 32 + i * 8 + j) as f32 * 0.7).sin();
                *x = match (m, i) {
                    (0, 0) => 60.0 + 2.0 * wave,
                    (0, _) => 1.0 + wave,
                    (1, j) => 20.0 + 13.5 * j as f32 + 2.0 * wave,
                    _ => wave,
                };
            }
        }
    }
    out
}

/// A fixed, non-uniform weighting of the output, so that each output element gets its own
/// gradient.
fn output_weights() -> [[f32; 8]; 4] {
    let mut w = [[0.0f32; 8]; 4];
    for (i, row) in w.iter_mut().enumerate() {
        for (j, x) in row.iter_mut().enumerate() {
            *x = 0.5 + 0.125 * ((i * 8 + j) % 5) as f32;
        }
    }
    w
}

/// Output and gradients of `(y * c).sum()` with respect to q, k, v, read as f32.
struct Run {
    y: Vec<f32>,
    grads: [Vec<f32>; 3],
}

fn as_f32<E: Dtype>(v: Vec<E>) -> Vec<f32> {
    v.into_iter()
        .map(|x| x.to_f32().unwrap_or(f32::NAN))
        .collect()
}

/// Runs `f` in element type `E` and reads the output and the gradients back as f32.
fn run<E: Dtype>(
    f: impl FnOnce(Act<E, OwnedTape<E, Cpu>>, Act<E>, Act<E>) -> Act<E, OwnedTape<E, Cpu>>,
) -> Run
where
    Cpu: Device<E>,
{
    let dev = Cpu::default();
    let [q, k, v] = qkv().map(|m| dev.tensor(m).to_dtype::<E>());
    let c: Act<E> = dev.tensor(output_weights()).to_dtype::<E>();
    let y = f(q.leaky_trace(), k.clone(), v.clone());
    let out = y.retaped::<NoneTape>().as_vec();
    let g = (y * c).sum().backward();
    Run {
        y: as_f32(out),
        grads: [
            as_f32(g.get(&q).as_vec()),
            as_f32(g.get(&k).as_vec()),
            as_f32(g.get(&v).as_vec()),
        ],
    }
}

mod common;
use common::bits::bits;

fn all_finite(v: &[f32]) -> bool {
    v.iter().all(|x| x.is_finite())
}

#[test]
fn the_inputs_overflow_f16_only_in_the_statistics() {
    // The scores themselves fit in f16; their row sum does not.
    let [q, k, _] = qkv();
    let row0: Vec<f32> = (0..4)
        .map(|j| (0..8).map(|d| q[0][d] * k[j][d]).sum())
        .collect();
    assert!(row0.iter().all(|s| s.abs() < 65504.0), "{row0:?}");
    assert!(row0.iter().sum::<f32>() > 65504.0, "{row0:?}");
}

#[test]
fn plain_f16_overflows_and_autocast_f16_stays_finite() {
    let plain = run::<f16>(attention_plain);
    let bad = plain.y.iter().chain(plain.grads.iter().flatten());
    assert!(
        bad.clone().any(|x| !x.is_finite()),
        "plain f16 should overflow"
    );

    let auto = run::<f16>(attention::<f16, _>);
    assert!(all_finite(&auto.y), "{:?}", auto.y);
    for g in &auto.grads {
        assert!(all_finite(g), "{g:?}");
    }
}

/// A bound on how far f16 moves each output row from f32, derived from f16's unit roundoff
/// u = 2^-11 (the matmuls run in f16 whatever the regions do):
/// * a score s = sum_d q_d k_d is off by at most d_s = 11 u sum_d |q_d k_d| (q and k rounded:
///   2u per product; 8 additions, each rounded: 8u; the result rounded: u);
/// * normalising by the row's standard deviation sigma turns that into at most 2 d_s / sigma on
///   each normalised score (its own error plus the mean's);
/// * softmax moves each weight by a factor within exp(+-2 dz), so the weighted sum of values
///   moves by at most (exp(2 dz) - 1) max|v|, plus a few roundings of the weights and the
///   output (4u max|v|).
fn f16_row_bounds() -> [f32; 4] {
    let [q, k, v] = qkv();
    let u = 2.0f32.powi(-11);
    let vmax = v.iter().flatten().fold(0.0f32, |m, x| m.max(x.abs()));
    let mut out = [0.0f32; 4];
    for (i, b) in out.iter_mut().enumerate() {
        let s: Vec<f32> = (0..4)
            .map(|j| (0..8).map(|d| q[i][d] * k[j][d]).sum())
            .collect();
        let ds = (0..4)
            .map(|j| 11.0 * u * (0..8).map(|d| (q[i][d] * k[j][d]).abs()).sum::<f32>())
            .fold(0.0f32, f32::max);
        let mean = s.iter().sum::<f32>() / 4.0;
        let sigma = (s.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / 4.0).sqrt();
        let dz = 2.0 * ds / sigma;
        *b = ((2.0 * dz).exp() - 1.0) * vmax + 4.0 * u * vmax;
    }
    out
}

#[test]
fn autocast_f16_is_close_to_f32() {
    let auto = run::<f16>(attention::<f16, _>);
    let reference = run::<f32>(attention_plain);
    let bounds = f16_row_bounds();
    // The overflowing row is the least precise (its scores are large), but bounded.
    assert!(bounds.iter().all(|b| *b < 0.1), "{bounds:?}");
    for (i, bound) in bounds.iter().enumerate() {
        let (a, r) = (&auto.y[i * 8..][..8], &reference.y[i * 8..][..8]);
        let worst = a
            .iter()
            .zip(r)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(worst <= *bound, "row {i}: {worst} > {bound}\n{a:?}\n{r:?}");
    }
    // Each gradient is a sum of products of two forward quantities (a softmax weight and a
    // normalised score or value), each off by the relative amount bounded above (bounds are for
    // values of size 1): twice the largest bound, relative to the largest gradient, plus f16's
    // subnormal spacing (2^-24) for the 8 terms of the tiniest gradients (q's and k's are
    // ~1e-4: the scores are divided by a spread of thousands).
    let rel = 2.0 * bounds.iter().fold(0.0f32, |m, b| m.max(*b));
    for (a, r) in auto.grads.iter().zip(&reference.grads) {
        let scale = r.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let worst = a
            .iter()
            .zip(r)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        let bound = rel * scale + 8.0 * 2.0f32.powi(-24);
        assert!(
            scale > 0.0 && worst <= bound,
            "{worst} > {bound}\n{a:?}\n{r:?}"
        );
    }
}

#[test]
fn autocast_f32_is_bit_identical_to_the_plain_function() {
    let auto = run::<f32>(attention::<f32, _>);
    let plain = run::<f32>(attention_plain);
    assert!(all_finite(&plain.y));
    assert_eq!(bits(&auto.y), bits(&plain.y));
    for (a, p) in auto.grads.iter().zip(&plain.grads) {
        assert!(p.iter().any(|x| *x != 0.0));
        assert_eq!(bits(a), bits(p));
    }
}

/// Log-sum-exp of each row, written by hand: the chain `exp().sum().ln()` is one region, and the
/// shape of `sum` is inferred from the annotation, as without the attribute.
#[autocast]
fn row_logsumexp<H: Precision, T: Tape<H::Elem, Cpu>>(
    x: Act<H::Elem, T>,
) -> Tensor<Rank1<4>, H::Elem, Cpu, T> {
    let lse: Tensor<Rank1<4>, H::Elem, Cpu, T> = x.exp().sum().ln();
    lse
}

#[test]
fn a_chain_of_operations_runs_in_f32_without_rounding_between() {
    let dev = Cpu::default();
    // exp(12) = 162755 > 65504: the plain f16 chain overflows at `exp`.
    let rows: [[f32; 8]; 4] =
        std::array::from_fn(|i| std::array::from_fn(|j| 12.0 - 0.25 * i as f32 + 0.125 * j as f32));
    let x16: Act<f16> = dev.tensor(rows).to_dtype::<f16>();
    let plain = x16.clone().exp().sum::<Rank1<4>, _>().ln();
    assert!(plain.as_vec().iter().all(|v| v.is_infinite()));

    let lse = row_logsumexp::<f16, _>(x16.leaky_trace());
    // Reference: f64 log-sum-exp of the f16 inputs (exactly representable: multiples of 2^-3).
    // The result (about 14.6, where f16's ulp is 2^-7) is rounded once to f16: half an ulp, plus
    // f32's own rounding inside the region (about 2^-20): allow one ulp, 2^-7.
    for (i, got) in lse.as_vec().iter().enumerate() {
        let exact = rows[i].iter().map(|v| (*v as f64).exp()).sum::<f64>().ln();
        assert!(
            (got.to_f32() as f64 - exact).abs() <= 2f64.powi(-7),
            "row {i}: {got} vs {exact}"
        );
    }
    // Gradients: softmax of each row, finite and summing to 1 per row up to the rounding of its 8
    // values (each below 1) to f16: 8 * 2^-11.
    let g = lse.sum().backward();
    let gx = g.get(&x16).as_vec();
    for row in gx.chunks(8) {
        let s: f32 = row.iter().map(|v| v.to_f32()).sum();
        assert!(
            row.iter().all(|v| v.is_finite()) && (s - 1.0).abs() < 8.0 * 2f32.powi(-11),
            "{row:?}"
        );
    }

    // f32: bit-identical to the chain without the attribute.
    let x32: Act<f32> = dev.tensor(rows);
    let auto = row_logsumexp::<f32, _>(x32.leaky_trace());
    let plain = x32.leaky_trace().exp().sum::<Rank1<4>, _>().ln();
    assert_eq!(bits(&auto.as_vec()), bits(&plain.as_vec()));
    let ga = auto.sum().backward();
    let gp = plain.sum().backward();
    assert_eq!(bits(&ga.get(&x32).as_vec()), bits(&gp.get(&x32).as_vec()));
}

/// The same log-sum-exp with dfdx's free functions: `ln(..)` and `exp(..)` run in f32 as the
/// method forms do.
#[autocast]
fn row_logsumexp_free<H: Precision, T: Tape<H::Elem, Cpu>>(
    x: Act<H::Elem, T>,
) -> Tensor<Rank1<4>, H::Elem, Cpu, T> {
    let lse: Tensor<Rank1<4>, H::Elem, Cpu, T> = ln(exp(x).sum());
    lse
}

#[test]
fn free_functions_of_the_table_run_in_f32_as_their_methods_do() {
    let dev = Cpu::default();
    let rows: [[f32; 8]; 4] =
        std::array::from_fn(|i| std::array::from_fn(|j| 12.0 - 0.25 * i as f32 + 0.125 * j as f32));
    let x16: Act<f16> = dev.tensor(rows).to_dtype::<f16>();
    let plain = ln(exp(x16.clone()).sum::<Rank1<4>, _>());
    assert!(plain.as_vec().iter().all(|v| v.is_infinite()));
    let free = row_logsumexp_free::<f16, _>(x16.clone());
    let method = row_logsumexp::<f16, _>(x16);
    assert!(
        free.as_vec().iter().all(|v| v.is_finite()),
        "{:?}",
        free.as_vec()
    );
    assert_eq!(free.as_vec(), method.as_vec());
}
