//! Mixed-ready layers: drop-in replacements for dfdx layers whose forward and backward run as
//! single fused operations on mpx's own [kernels](crate::kernels).

mod linear;

pub use linear::*;
