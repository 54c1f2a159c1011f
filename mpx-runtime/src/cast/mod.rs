//! Casting any tree: mpx's `cast_to_half_precision`, `cast_to_full_precision`, `cast_to_f16`,
//! `cast_to_bf16`, `cast_to_f32`.
//!
//! A *tree* is anything that implements [`Cast<P>`]: dfdx tensors and modules, tuples, arrays,
//! `Vec`, `Option`, `Box`, map values, and user structs through `#[derive(Cast)]`. Only
//! floating-point leaves change; integer tensors (labels), bools and plain fields are untouched.
//!
//! # Which leaves change
//! mpx casts a leaf iff it is an array of dtype f16, bf16 or f32 (`_cast.py`); we follow it:
//!
//! | leaf | cast to `P`? |
//! |---|---|
//! | `Tensor<S, f32 / f16 / AMP<f16>, Cpu>` | yes, to `Tensor<S, P::Elem, Cpu>` |
//! | `f32`, `f16`, `AMP<f16>` scalars (0-d values) | yes, to `P::Elem` |
//! | integer and `bool` tensors and scalars | no, returned bit-identical |
//! | `f64` tensors and scalars | no (mpx leaves f64 alone; jmp would cast it) |
//! | `String`, `&'static str`, `()`, `char` | no |
//!
//! # Half precision is a type, not a global
//! mpx has a process-wide half dtype (`set_half_precision_datatype`) that
//! `cast_to_half_precision` reads. Rust has no global dtype: [`cast_to_half_precision`] takes the
//! half type as a parameter (`cast_to_half_precision::<f16, _>(&tree)`), and the result type says
//! which one was used.
//!
//! # Speed
//! Every conversion goes through `half`'s slice conversions (SIMD where the CPU has it), never
//! element by element. dfdx 0.13 lends no slice of a tensor's storage outside its crate, so a
//! tensor cast costs one `copy_into`, one slice conversion and a fresh tensor.
//!
//! # Examples
//! ```
//! use dfdx::prelude::*;
//! use mpx_runtime::cast::{cast_to_f16, cast_to_f32};
//! use mpx_runtime::precision::f16;
//!
//! let dev = Cpu::default();
//! let x: Tensor<Rank1<3>, f32, _> = dev.tensor([1.0, 65520.0, 1e-8]);
//! let labels: Tensor<Rank1<3>, usize, _> = dev.tensor([0, 7, 2]);
//! let (xh, lh) = cast_to_f16(&(x, labels));
//! let back: Tensor<Rank1<3>, f32, _> = cast_to_f32(&xh);
//! // round to nearest even: 65520 overflows f16, 1e-8 underflows to 0
//! assert_eq!(back.array(), [1.0, f32::INFINITY, 0.0]);
//! assert_eq!(lh.array(), [0, 7, 2]); // labels untouched
//! let _: Tensor<Rank1<3>, f16, _> = xh;
//! ```

mod containers;
mod dfdx_modules;
mod leaf;
mod module;
mod tensor_io;

pub(crate) use tensor_io::grad_slice;

use crate::precision::{FloatSlice, HalfPrecision, Precision, bf16, f16};

/// The mutable view of a float leaf that [`FloatLeaves::visit_floats_mut`] passes (defined in
/// [`crate::precision`], next to [`FloatSlice`]).
pub use crate::precision::FloatSliceMut;

pub use module::{
    CastError, cast_module, module_visit_floats, module_visit_floats_mut, try_cast_module,
};

pub use crate::walk::copy_scalar;

/// `Cast<P>` and [`FloatLeaves`] for a module of a const-generic layout and a float element,
/// field by field, for each float element type (f32, f16, `AMP<f16>`): the `cast` fields are
/// cast, the `keep` fields (hyperparameters such as `epsilon`) cloned.
///
/// `cast_by_fields!(LayerNorm1D [M] cast { gamma, beta } keep { epsilon });` covers
/// `LayerNorm1D<M, E, Cpu>` for every `E`. Used for dfdx's modules and for `mpx::nn`'s layers.
macro_rules! cast_by_fields {
    ($($t:tt)*) => {
        $crate::cast::cast_by_fields_of!(f32; $($t)*);
        $crate::cast::cast_by_fields_of!($crate::precision::f16; $($t)*);
        $crate::cast::cast_by_fields_of!($crate::precision::AMP<$crate::precision::f16>; $($t)*);
    };
}
pub(crate) use cast_by_fields;

/// [`cast_by_fields`] for one element type `$e`.
macro_rules! cast_by_fields_of {
    ($e:ty; $name:ident [$($c:ident),*] cast { $($f:tt),* } keep { $($k:tt),* }) => {
        impl<$(const $c: usize,)* P: $crate::precision::Precision> $crate::cast::Cast<P>
            for $name<$($c,)* $e, ::dfdx::tensor::Cpu>
        {
            type Output = $name<$($c,)* P::Elem, ::dfdx::tensor::Cpu>;
            fn cast(&self) -> Self::Output {
                $name {
                    $($f: $crate::cast::Cast::<P>::cast(&self.$f),)*
                    $($k: ::core::clone::Clone::clone(&self.$k),)*
                }
            }
        }
        impl<$(const $c: usize),*> $crate::cast::FloatLeaves for $name<$($c,)* $e, ::dfdx::tensor::Cpu> {
            fn visit_floats(
                &self,
                visit: &mut dyn FnMut($crate::precision::FloatSlice<'_>) -> bool,
            ) -> bool {
                true $(&& $crate::cast::FloatLeaves::visit_floats(&self.$f, visit))*
            }
            fn visit_floats_mut(
                &mut self,
                visit: &mut dyn FnMut($crate::cast::FloatSliceMut<'_>),
            ) {
                $($crate::cast::FloatLeaves::visit_floats_mut(&mut self.$f, visit);)*
            }
        }
    };
}
pub(crate) use cast_by_fields_of;

/// A tree whose floating-point leaves can be cast to precision `P`.
///
/// `Output` is the same tree with every float leaf stored as `P::Elem`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be cast to precision `{P}`",
    label = "not a castable tree",
    note = "casts reach dfdx CPU tensors (no tape), dfdx modules, scalars, tuples, arrays, Vec, Option, Box and map values; derive `mpx::Cast` for your own structs"
)]
pub trait Cast<P: Precision> {
    /// The tree after the cast.
    type Output;
    /// Returns a copy of the tree with its float leaves converted to `P` (round to nearest even).
    fn cast(&self) -> Self::Output;
}

/// Visits the floating-point leaves of a tree in place: the basis of [`crate::finite::all_finite`]
/// and of unscaling. Implemented wherever [`Cast`] is.
pub trait FloatLeaves {
    /// Calls `visit` with the values of every float leaf, in a fixed order, until it returns `false`.
    /// Returns `false` if a call returned `false`.
    fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool;
    /// Calls `visit` with every float leaf's values, mutably, in the same order.
    fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>));
}

/// Casts the float leaves of `tree` to precision `P`: mpx's `cast_tree(tree, dtype)`, with the
/// dtype as a type parameter.
///
/// # Examples
/// ```
/// use mpx_runtime::cast::cast_tree;
/// use mpx_runtime::precision::bf16;
/// // emulated bf16 keeps f32 storage and rounds the value: 1 + 2^-9 is a tie, rounds to 1
/// let v: (f32, u8) = cast_tree::<bf16, _>(&(1.0f32 + 1.0 / 512.0, 3u8));
/// assert_eq!(v, (1.0, 3));
/// ```
pub fn cast_tree<P: Precision, T: Cast<P> + ?Sized>(tree: &T) -> T::Output {
    tree.cast()
}

/// Casts the float leaves of `tree` to f32: mpx's `cast_to_float32`.
///
/// # Examples
/// ```
/// use mpx_runtime::cast::cast_to_f32;
/// use mpx_runtime::precision::f16;
/// assert_eq!(cast_to_f32(&vec![f16::from_f32(0.5)]), vec![0.5f32]);
/// ```
pub fn cast_to_f32<T: Cast<f32> + ?Sized>(tree: &T) -> T::Output {
    tree.cast()
}

/// Casts the float leaves of `tree` to full precision (f32): mpx's `cast_to_full_precision`, the
/// same as [`cast_to_f32`].
///
/// # Examples
/// ```
/// use mpx_runtime::cast::cast_to_full_precision;
/// use mpx_runtime::precision::f16;
/// assert_eq!(cast_to_full_precision(&Some(f16::from_f32(2.0))), Some(2.0f32));
/// ```
pub fn cast_to_full_precision<T: Cast<f32> + ?Sized>(tree: &T) -> T::Output {
    tree.cast()
}

/// Casts the float leaves of `tree` to f16: mpx's `cast_to_float16`.
///
/// # Examples
/// ```
/// use mpx_runtime::cast::cast_to_f16;
/// use mpx_runtime::precision::f16;
/// let (h, n) = cast_to_f16(&(1.5f32, 7i32));
/// assert_eq!((h, n), (f16::from_f32(1.5), 7));
/// ```
pub fn cast_to_f16<T: Cast<f16> + ?Sized>(tree: &T) -> T::Output {
    tree.cast()
}

/// Casts the float leaves of `tree` to (emulated) bf16: mpx's `cast_to_bfloat16`. Values are
/// rounded to bf16 and stored as f32 (see [`crate::precision`]).
///
/// # Examples
/// ```
/// use mpx_runtime::cast::cast_to_bf16;
/// let v = cast_to_bf16(&[1.0f32 + 3.0 / 256.0, 2.0]);
/// assert_eq!(v, [1.0 + 4.0 / 256.0, 2.0]);
/// ```
pub fn cast_to_bf16<T: Cast<bf16> + ?Sized>(tree: &T) -> T::Output {
    tree.cast()
}

/// Casts the float leaves of `tree` to the half precision `H` (`f16`, `AMP<f16>` or `bf16`):
/// mpx's `cast_to_half_precision`.
///
/// mpx reads a process-wide half dtype here; in Rust the half type is this function's type
/// parameter, so the result type records which half precision was used.
///
/// # Examples
/// ```
/// use mpx_runtime::cast::cast_to_half_precision;
/// use mpx_runtime::precision::{AMP, f16};
/// let h = cast_to_half_precision::<f16, _>(&vec![0.1f32]);
/// assert_eq!(h, vec![f16::from_f32(0.1)]);
/// let a = cast_to_half_precision::<AMP<f16>, _>(&0.1f32);
/// assert_eq!(a.0, f16::from_f32(0.1));
/// ```
pub fn cast_to_half_precision<H: HalfPrecision, T: Cast<H> + ?Sized>(tree: &T) -> T::Output {
    tree.cast()
}
