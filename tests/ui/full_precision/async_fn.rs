// An `async fn` cannot become a region (and the item is still emitted: `main` compiles).
use dfdx::prelude::*;
use mpx::full_precision;
use mpx::precision::Precision;

#[full_precision]
async fn softmax<H: Precision>(x: Tensor<Rank1<4>, H::Elem, Cpu>) -> Tensor<Rank1<4>, H::Elem, Cpu> {
    x.softmax()
}

fn main() {}
