// A layer with half parameters called inside the region, without `params`: the error names
// `params`.
use dfdx::prelude::*;
use mpx::full_precision;
use mpx::precision::f16;

struct Block {
    ln: dfdx::nn::modules::LayerNorm1D<4, f16, Cpu>,
}

impl Block {
    #[full_precision(half = f16)]
    fn norm(&self, x: Tensor<Rank1<4>, f16, Cpu>) -> Tensor<Rank1<4>, f16, Cpu> {
        self.ln.forward(x)
    }
}

fn main() {}
