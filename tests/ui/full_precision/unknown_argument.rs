// A typo in an argument name: the error lists the valid ones.
use dfdx::prelude::*;
use mpx::full_precision;
use mpx::precision::Precision;

type Ln<E> = dfdx::nn::modules::LayerNorm1D<4, E, Cpu>;

#[full_precision(param = ln)]
fn norm<H: Precision>(ln: &Ln<H::Elem>, x: Tensor<Rank1<4>, H::Elem, Cpu>) -> Tensor<Rank1<4>, H::Elem, Cpu>
where
    Cpu: Device<H::Elem>,
{
    ln.forward(x)
}

fn main() {}
