// Nothing to cast: the function takes no tensor.
use dfdx::prelude::*;
use mpx::full_precision;
use mpx::precision::Precision;

#[full_precision]
fn zeros<H: Precision>(dev: &Cpu) -> Tensor<Rank1<4>, H::Elem, Cpu> {
    dev.zeros()
}

fn main() {}
