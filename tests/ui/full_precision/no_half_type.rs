// Generic over a dfdx dtype instead of an mpx precision: the half type cannot be told.
use dfdx::prelude::*;
use mpx::full_precision;

#[full_precision]
fn norm<E: Dtype>(x: Tensor<Rank1<4>, E, Cpu>) -> Tensor<Rank1<4>, E, Cpu> {
    x.normalize(1e-5)
}

fn main() {}
