//! Casting any tree: mpx's `cast_to_half_precision`, `cast_to_full_precision`, `cast_to_f16`,
//! `cast_to_bf16`, `cast_to_f32`.
//!
//! A *tree* is anything that implements [`Cast<P>`]: dfdx tensors and modules, tuples, arrays,
//! `Vec`, `Option`, `Box`, map values, and user structs through `#[derive(Cast)]`. Only
//! floating-point leaves change; integer tensors (labels), bools and plain fields are untouched.
//!
//! (Contract written first; the implementations follow in this module.)

use crate::precision::{FloatBits, Precision};

/// A tree whose floating-point leaves can be cast to precision `P`.
///
/// `Output` is the same tree with every float leaf stored as `P::Elem`.
pub trait Cast<P: Precision> {
    /// The tree after the cast.
    type Output;
    /// Returns a copy of the tree with its float leaves converted to `P` (round to nearest even).
    fn cast(&self) -> Self::Output;
}

/// A mutable view of one floating-point leaf's values.
#[derive(Debug)]
pub enum FloatSliceMut<'a> {
    /// f32 values (also emulated bf16).
    F32(&'a mut [f32]),
    /// f16 values (also `AMP<f16>`, viewed as f16).
    F16(&'a mut [half::f16]),
}

/// Visits the floating-point leaves of a tree in place: the basis of [`crate::finite::all_finite`]
/// and of unscaling. Implemented wherever [`Cast`] is.
pub trait FloatLeaves {
    /// Calls `visit` with the bits of every float leaf, in a fixed order, until it returns `false`.
    /// Returns `false` if a call returned `false`.
    fn visit_float_bits(&self, visit: &mut dyn FnMut(FloatBits<'_>) -> bool) -> bool;
    /// Calls `visit` with every float leaf's values, mutably, in the same order.
    fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>));
}
