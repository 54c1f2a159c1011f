// A module of the user's own holding its layers in a `Vec`: the derive carries a `Vec` as it is,
// in f32, so the layers would neither run in half precision nor train there. The error is at the
// field's type and names what holds layers instead.
use dfdx::nn::modules::Linear;

#[derive(Clone, mpx::HalfLayers)]
struct Net<E: dfdx::prelude::Dtype, D: dfdx::prelude::Device<E>> {
    layers: Vec<Linear<4, 4, E, D>>,
}

fn main() {}
