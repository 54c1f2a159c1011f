//! `examples/autocast.rs` with the attribute expanded by hand: exactly what `#[autocast]`
//! generates for its layer and its loss (formatted; the attribute writes
//! `::mpx::__private::mpx_runtime`, which is the `mpx` crate's runtime), kept compiling. It prints
//! the same numbers as the annotated example.
//!
//! What the attribute did:
//! * `x.try_normalize::<Axis<1>>(1e-5)?` became `FullPrecision::<H>::try_run(x, |x| x.normalize(..))?`:
//!   a `try_` form becomes `try_run` (same `Result`), the operation inside is the plain form;
//! * `scores.try_softmax::<Axis<1>>()?` likewise;
//! * the projections, the permute and the matmuls are untouched: they run in `H`;
//! * `mse_loss(y, target)` became one region over `(y, target)`; inside, the target's f32 copy
//!   drops its tape (`retaped()`), as dfdx's losses take an untaped target.
//!
//! Run: `cargo run --example autocast-expanded`

use dfdx::prelude::*;
use mpx::cast::cast_tree;
use mpx::precision::{Precision, f16};

const SEQ: usize = 4;
const DIM: usize = 8;
type Act<E, T = NoneTape> = Tensor<Rank2<SEQ, DIM>, E, Cpu, T>;
type Proj<E> = dfdx::nn::modules::Linear<DIM, DIM, E, Cpu>;

/// Self-attention over `SEQ` tokens, each row normalised first (no learned gain), in precision
/// `H` (its tensors are `H::Elem`).
struct Attention<H: Precision>
where
    Cpu: Device<H::Elem>,
{
    q: Proj<H::Elem>,
    k: Proj<H::Elem>,
    v: Proj<H::Elem>,
}

/// What `#[autocast(half = H)]` generates for `try_forward`.
impl<H: Precision, T: Tape<H::Elem, Cpu>> Module<Act<H::Elem, T>> for Attention<H>
where
    Cpu: Device<H::Elem>,
{
    type Output = Act<H::Elem, T>;
    type Error = CpuError;

    #[rustfmt::skip] // kept as the macro writes it (a test compares the two)
    fn try_forward(&self, x: Act<H::Elem, T>) -> Result<Act<H::Elem, T>, CpuError> {
        let h = ::mpx::__private::mpx_runtime::region::FullPrecision::<H>::try_run(
            x, |__mpx_x0| __mpx_x0.normalize::<Axis<1>>(1e-5))?;
        let q = self.q.try_forward(h.retaped::<T>())?;
        let k = self.k.try_forward(h.retaped::<T>())?;
        let v = self.v.try_forward(h)?;
        let scores = q.try_matmul(k.try_permute()?)?;
        let weights = ::mpx::__private::mpx_runtime::region::FullPrecision::<H>::try_run(
            scores, |__mpx_x0| __mpx_x0.softmax::<Axis<1>>())?;
        weights.try_matmul(v)
    }
}

/// What `#[autocast]` generates for the loss.
#[rustfmt::skip] // kept as the macro writes it (a test compares the two)
fn loss<H: Precision, T: Tape<H::Elem, Cpu>>(
    y: Act<H::Elem, T>,
    target: Act<H::Elem>,
) -> Tensor<Rank0, H::Elem, Cpu, T> {
    ::mpx::__private::mpx_runtime::region::FullPrecision::<H>::run(
        (y, target,), |(__mpx_x0, __mpx_x1,)| mse_loss(__mpx_x0, __mpx_x1.retaped()))
}

/// Input rows: row 0 sums to about 4 * 30000 > 65504.
fn input(dev: &Cpu) -> Act<f32> {
    let mut x = [[0.0f32; DIM]; SEQ];
    for (i, row) in x.iter_mut().enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            let wave = ((i * DIM + j) as f32 * 0.9).sin();
            *v = if i == 0 && j < 4 {
                30000.0 + 100.0 * wave
            } else {
                wave
            };
        }
    }
    dev.tensor(x)
}

/// A tensor's values as f32.
fn f32s<E: Dtype>(v: Vec<E>) -> Vec<f32> {
    v.into_iter()
        .map(|x| x.to_f32().unwrap_or(f32::NAN))
        .collect()
}

/// Output, loss and the gradient of the input, as f32, for precision `H`.
fn forward<H: Precision>(layer: &Attention<H>, x: &Act<f32>) -> (Vec<f32>, f32, Vec<f32>)
where
    Cpu: Device<H::Elem>,
{
    let x: Act<H::Elem> = cast_tree::<H, _>(x);
    let target: Act<H::Elem> = x.device().zeros();
    let y = layer.forward(x.leaky_trace());
    let out = f32s(y.retaped::<NoneTape>().as_vec());
    let l = loss::<H, _>(y, target);
    let l_value = f32s(vec![l.retaped::<NoneTape>().array()])[0];
    let g = l.backward();
    (out, l_value, f32s(g.get(&x).as_vec()))
}

fn main() {
    let dev = Cpu::seed_from_u64(0);
    let layer32 = Attention::<f32> {
        q: dev.build_module::<Linear<DIM, DIM>, f32>(),
        k: dev.build_module::<Linear<DIM, DIM>, f32>(),
        v: dev.build_module::<Linear<DIM, DIM>, f32>(),
    };
    let layer16 = Attention::<f16> {
        q: cast_tree::<f16, _>(&layer32.q),
        k: cast_tree::<f16, _>(&layer32.k),
        v: cast_tree::<f16, _>(&layer32.v),
    };
    let x = input(&dev);

    let (y32, l32, g32) = forward::<f32>(&layer32, &x);
    let (y16, l16, g16) = forward::<f16>(&layer16, &x);
    let max_diff = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0f32, f32::max)
    };
    let finite = |v: &[f32]| v.iter().all(|x| x.is_finite());
    println!("precision  loss        output finite  input grad finite");
    println!(
        "f32        {l32:<11.6} {:<14} {}",
        finite(&y32),
        finite(&g32)
    );
    println!(
        "f16        {l16:<11.6} {:<14} {}",
        finite(&y16),
        finite(&g16)
    );
    println!(
        "f16 vs f32: max |output diff| {:.2e}, max |grad diff| {:.2e}",
        max_diff(&y16, &y32),
        max_diff(&g16, &g32)
    );

    // The same normalisation without a region, in f16: the row mean overflows.
    let plain = cast_tree::<f16, _>(&x).normalize::<Axis<1>>(1e-5);
    let plain = cast_tree::<f32, _>(&plain).as_vec();
    println!(
        "f16 normalize without #[autocast]: {} of {} values finite",
        plain.iter().filter(|v| v.is_finite()).count(),
        plain.len()
    );
}
