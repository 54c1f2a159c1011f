// A module of the user's own that counts its `forward(&self)` calls in a `Cell` it marks to be
// carried: each pass's working copy holds a clone of the cell, so the count would never reach the
// module. The derive says so at the field's type, with what shares the count instead.
use dfdx::nn::modules::Linear;
use std::cell::Cell;

#[derive(Clone, mpx::HalfLayers)]
struct Net<E: dfdx::prelude::Dtype, D: dfdx::prelude::Device<E>> {
    l: Linear<4, 2, E, D>,
    #[half_layers(keep)]
    calls: Cell<usize>,
}

fn main() {}
