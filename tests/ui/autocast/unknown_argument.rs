// `skips` for `skip`: unknown arguments are named with the valid ones.
use dfdx::prelude::*;
use mpx::autocast;
use mpx::precision::Precision;

#[autocast(skips = sum)]
fn probs<H: Precision, T: Tape<H::Elem, Cpu>>(
    x: Tensor<Rank2<2, 4>, H::Elem, Cpu, T>,
) -> Tensor<Rank2<2, 4>, H::Elem, Cpu, T>
where
    Cpu: Device<H::Elem>,
{
    x.softmax::<Axis<1>>()
}

fn main() {}
