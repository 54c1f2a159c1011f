// A borrowed tensor cannot be split off its tape and cast.
use dfdx::prelude::*;
use mpx::full_precision;
use mpx::precision::Precision;

#[full_precision]
fn norm<H: Precision>(x: &Tensor<Rank1<4>, H::Elem, Cpu>) -> Tensor<Rank1<4>, H::Elem, Cpu> {
    x.clone().normalize(1e-5)
}

fn main() {}
