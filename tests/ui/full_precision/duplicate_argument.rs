// The same argument twice, and a second mistake in the same attribute: both are reported.
use dfdx::prelude::*;
use mpx::full_precision;
use mpx::precision::{f16, bf16};

#[full_precision(half = f16, half = bf16, crate = mpx)]
fn exp(x: Tensor<Rank1<4>, f16, Cpu>) -> Tensor<Rank1<4>, f16, Cpu> {
    x.exp()
}

fn main() {}
