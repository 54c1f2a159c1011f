//! Full-precision regions: f32 computations inside a half-precision graph, gradients flowing through.
