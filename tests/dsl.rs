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

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

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
