// Every accepted form of `#[full_precision]`, run once in f16.
use dfdx::prelude::*;
use mpx::full_precision;
use mpx::precision::{HalfPrecision, Precision, f16};

type Ln<E> = dfdx::nn::modules::LayerNorm1D<4, E, Cpu>;
type V<E, T = NoneTape> = Tensor<Rank1<4>, E, Cpu, T>;

// A free function generic over the half type, one tensor argument.
#[full_precision]
fn softmax<H: HalfPrecision, T: Tape<H::Elem, Cpu>>(x: Tensor<Rank1<4>, H::Elem, Cpu, T>) -> Tensor<Rank1<4>, H::Elem, Cpu, T> {
    x.softmax()
}

// Several tensor arguments, one a tuple, beside a plain argument; the bound in a where clause.
#[full_precision]
fn mix<P, T: Tape<P::Elem, Cpu>>(
    x: Tensor<Rank1<4>, P::Elem, Cpu, T>,
    (a, b): (Tensor<Rank1<4>, P::Elem, Cpu>, Tensor<Rank1<4>, P::Elem, Cpu>),
    k: f32,
) -> Tensor<Rank1<4>, P::Elem, Cpu, T>
where
    P: Precision,
{
    x * a + b * k
}

// A module argument whose parameters run in f32, and a concrete half type.
#[full_precision(half = f16, params = ln)]
fn norm(ln: &Ln<f16>, x: Tensor<Rank1<4>, f16, Cpu>) -> Tensor<Rank1<4>, f16, Cpu> {
    ln.forward(x)
}

// A type alias named with `inputs`, and the facade's path given with `crate`.
#[full_precision(inputs = x, crate = "::mpx")]
fn square<H: Precision>(x: V<H::Elem>) -> V<H::Elem> {
    x.square()
}

// A method whose half type belongs to the impl, with a field as the parameters.
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
    fn forward<T: Tape<H::Elem, Cpu>>(&self, x: Tensor<Rank1<4>, H::Elem, Cpu, T>) -> Tensor<Rank1<4>, H::Elem, Cpu, T> {
        self.ln.forward(x)
    }
}

fn main() {
    let dev = Cpu::default();
    let x: V<f16> = dev.tensor([40000.0f32, 40000.0, 1.0, 2.0]).to_dtype::<f16>();
    let ln = dev.build_module::<LayerNorm1D<4>, f16>();
    let block = Block::<f16> { ln: ln.clone() };
    let outs = [
        softmax::<f16, _>(x.clone()),
        mix::<f16, _>(x.clone(), (x.clone(), x.clone()), 0.5),
        norm(&ln, x.clone()),
        square::<f16>(x.clone()),
        block.forward(x.clone()),
    ];
    // 40000^2 overflows f16 and must come back as inf, not NaN; the norm stays finite.
    assert!(outs[2].as_vec().iter().all(|v| v.is_finite()));
    assert!(outs[3].as_vec()[0].is_infinite());
    assert!(outs[4].as_vec().iter().all(|v| v.is_finite()));
    let g = block.forward(x.leaky_trace()).sum().backward();
    assert!(g.get(&block.ln.gamma).as_vec().iter().all(|v| v.is_finite()));
    let _ = outs;
}
