// A module of the user's own with the derive, holding another of the user's own without it: the
// error is at the inner module's field type, and says what gives it mpx's layers (without the
// check, the step ran the whole model on dfdx's f16 layers, with a warning naming a derive that
// is already there).
use dfdx::nn::modules::Linear;
use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection};
use dfdx::prelude::*;

#[derive(Clone)]
struct Inner<E: Dtype, D: Device<E>> {
    l: Linear<4, 4, E, D>,
}

impl<E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform, D: Device<E>>
    TensorCollection<E, D> for Inner<E, D>
{
    type To<E2: Dtype, D2: Device<E2>> = Inner<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(Self::module("l", |s| &s.l, |s| &mut s.l), |l| Inner { l })
    }
}

#[derive(Clone, mpx::HalfLayers)]
struct Outer<E: Dtype, D: Device<E>> {
    inner: Inner<E, D>,
    head: Linear<4, 2, E, D>,
}

impl<E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform, D: Device<E>>
    TensorCollection<E, D> for Outer<E, D>
{
    type To<E2: Dtype, D2: Device<E2>> = Outer<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            (
                Self::module("inner", |s| &s.inner, |s| &mut s.inner),
                Self::module("head", |s| &s.head, |s| &mut s.head),
            ),
            |(inner, head)| Outer { inner, head },
        )
    }
}

fn main() {}
