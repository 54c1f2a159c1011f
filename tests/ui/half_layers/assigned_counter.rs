// A module of the user's own whose forward pass counts its calls in a field: the working copy's
// forward pass runs on a copy, so the count would never reach the module (it stayed 0); the
// assignment is an error at the field, which says what the step writes back.
use dfdx::nn::modules::Linear;
use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection};
use dfdx::prelude::*;

#[derive(Clone, mpx::HalfLayers)]
struct Net<E: Dtype, D: Device<E>> {
    l: Linear<4, 2, E, D>,
    calls: usize,
}

impl<E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform, D: Device<E>>
    TensorCollection<E, D> for Net<E, D>
{
    type To<E2: Dtype, D2: Device<E2>> = Net<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(Self::module("l", |s| &s.l, |s| &mut s.l), |l| Net { l, calls: 0 })
    }
}

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> ModuleMut<Tensor<Rank2<3, 4>, E, D, OwnedTape<E, D>>> for Net<E, D> {
    type Output = Tensor<Rank2<3, 2>, E, D, OwnedTape<E, D>>;
    type Error = D::Err;
    fn try_forward_mut(
        &mut self,
        x: Tensor<Rank2<3, 4>, E, D, OwnedTape<E, D>>,
    ) -> Result<Self::Output, D::Err> {
        self.calls += 1;
        self.l.try_forward(x)
    }
}

fn main() {}
