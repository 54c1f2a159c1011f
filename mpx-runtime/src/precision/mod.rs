//! Precision types: which element type a tensor is stored in, and how values are rounded into it.
//!
//! Two sealed traits describe every precision mpx knows; no other crate can implement them:
//!
//! - [`Precision`]: what a precision is. Its storage type (`Elem`), its jmp dtype ([`DType`]),
//!   how f32 values round into it and widen out of it, and its stored values seen through the
//!   view pair ([`FloatSlice`] to read, [`FloatSliceMut`] to write). The work done *in* a
//!   precision (unscaling gradients, reading gradient buffers, multiplying matrices) lives with
//!   the code that does it (`mpx::finite`, `mpx::step`, the kernels), on the views.
//! - [`HalfPrecision`]: a precision that can be the compute precision of a mixed step.
//!
//! | marker | storage (`P::Elem`) | [`HalfPrecision`] | what it is |
//! |---|---|---|---|
//! | `f32` | `f32` | no | IEEE binary32: full precision |
//! | [`f16`](struct@f16) | `f16` | yes | IEEE binary16, native dfdx dtype |
//! | [`AMP<f16>`] | `AMP<f16>` | yes | dfdx's AMP wrapper: f16 storage, f32 accumulation in sums and optimizers |
//! | [`bf16`] | `f32` | yes | **emulated** bfloat16: see below |
//!
//! `f32`, `f16` and `AMP<f16>` store themselves (`Elem = Self`): code generic over a dfdx element
//! type is written `E: Precision<Elem = E> + Dtype` (Rust does not carry `Elem`'s `Dtype` bound over
//! to `E` through the equality, so it is spelled out).
//!
//! # Emulated bf16
//! dfdx 0.13 cannot take `bf16` as a dtype (its device trait needs crate-private matmul kernels), so
//! `bf16` is emulated: tensors stay `f32`, and every value is rounded to the nearest bf16 (ties to
//! even) wherever mpx casts: parameters, inputs, activations at region boundaries and gradients.
//! Emulated bf16 reproduces bf16 numerics at those points and saves **no** memory; arithmetic
//! between casts runs in f32.
//!
//! # Examples
//! ```
//! use mpx_runtime::precision::DType;
//! use mpx_runtime::precision::{HalfPrecision, Precision, bf16, f16};
//! assert_eq!(<f16 as Precision>::DTYPE, DType::Float16);
//! let mut out = [0.0f32; 2];
//! // 1 + 2^-9 is not a bf16 value: it rounds to 1.0 (ties to even).
//! bf16::round(&[1.0 + 1.0 / 512.0, 3.0], &mut out);
//! assert_eq!(out, [1.0, 3.0]);
//! assert!(bf16::EMULATED);
//! ```

mod dtype;
mod impls;
mod slices;

pub use dfdx::dtypes::AMP;
pub use dtype::DType;
pub use half::{bf16, f16};
/// Defined with the SIMD conversions (`mpx-kernels`).
pub use mpx_kernels::convert::round_to_bf16;
/// The view pair, defined with the kernels that take it (`mpx-kernels`).
pub use mpx_kernels::{FloatSlice, FloatSliceMut};
pub(crate) use slices::sized;

mod sealed {
    /// Seals [`Precision`](super::Precision): only mpx implements it, for `f32`, `f16`,
    /// `AMP<f16>` and `bf16`.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` is not an mpx precision: `Precision` is sealed",
        label = "mpx implements `Precision` only for its own precision types",
        note = "the precisions are `f32`, `f16`, `AMP<f16>` and the emulated `bf16` (`mpx::precision`); other formats (FP8, FP4, INT8) are MX block formats: see `mpx::mx`"
    )]
    pub trait Sealed {
        /// The reused scratch buffer `n` values of this precision's storage are read into:
        /// `tmp32` for f32 storage, `tmp16` for f16 storage. Grows, never shrinks. For mpx's
        /// tensor reads (`cast`), which need the storage type itself rather than a view; kept on
        /// the sealed supertrait, out of [`Precision`](super::Precision)'s API and docs: users
        /// can neither name nor implement it. Not a public API.
        fn scratch<'a>(
            tmp32: &'a mut Vec<f32>,
            tmp16: &'a mut Vec<half::f16>,
            n: usize,
        ) -> &'a mut [<Self as super::Precision>::Elem]
        where
            Self: super::Precision;
    }
}

/// A precision: `f32`, [`f16`](struct@f16), [`AMP<f16>`] or (emulated) [`bf16`]. Sealed: only mpx
/// implements it.
///
/// `Elem` is the dfdx dtype the values are stored in: the precision itself for `f32`, `f16` and
/// `AMP<f16>`, `f32` for emulated bf16. Every method works on whole slices (through `half`'s SIMD
/// slice conversions), never element by element.
///
/// # Examples
/// ```
/// use mpx_runtime::precision::DType;
/// use mpx_runtime::precision::{Precision, bf16, f16};
/// let mut h = [f16::ZERO; 2];
/// f16::round(&[1.5, 65520.0], &mut h);
/// assert_eq!(h[0], f16::from_f32(1.5));
/// assert!(h[1].is_infinite()); // 65520 rounds past f16's max, 65504
/// let mut wide = [0.0f32; 2];
/// f16::widen(&h, &mut wide);
/// assert_eq!(wide, [1.5, f32::INFINITY]);
/// assert_eq!((bf16::DTYPE, bf16::DTYPE.name()), (DType::BFloat16, "bfloat16"));
/// ```
pub trait Precision: sealed::Sealed + 'static + Copy + Send + Sync + std::fmt::Debug {
    /// The dfdx element type tensors of this precision hold (a precision that stores itself).
    type Elem: Precision<Elem = Self::Elem> + dfdx::shapes::Dtype;

    /// The jmp dtype this precision stores or emulates (`AMP<f16>` is [`DType::Float16`]).
    const DTYPE: DType;

    /// `true` when casting to this precision changes nothing (only `f32`): a mixed step's working
    /// copy then shares the master's buffers instead of copying them, and the gradients are
    /// checked and unscaled where they are (mpx's `use_mixed_precision=False` path casts nothing
    /// either). `GradScaler<f32, _>` with scale 1 reproduces a plain f32 step bit for bit.
    const IDENTITY: bool;

    /// Rounds f32 values into this precision's storage (same length), to nearest even; for
    /// emulated bf16, into f32 values that are exactly bf16 values.
    fn round(src: &[f32], dst: &mut [Self::Elem]);

    /// Widens values of this precision into f32 (same length): exact for `f32`, `f16` and
    /// `AMP<f16>`. Emulated bf16 rounds its f32 storage to bf16 here: this is where a real bf16
    /// tensor would be cast.
    fn widen(src: &[Self::Elem], dst: &mut [f32]);

    /// The stored values, to read (emulated bf16: [`FloatSlice::Bf16`], f32 values read as
    /// bf16).
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::precision::{AMP, FloatSlice, Precision, bf16, f16};
    /// assert!(matches!(f32::floats(&[1.0]), FloatSlice::F32(&[1.0])));
    /// assert!(matches!(<AMP<f16>>::floats(&[AMP(f16::ONE)]), FloatSlice::F16(v) if v == [f16::ONE]));
    /// assert!(matches!(bf16::floats(&[1.0]), FloatSlice::Bf16(_)));
    /// assert_eq!(bf16::floats(&[1.0, 2.0]).len(), 2);
    /// ```
    fn floats(values: &[Self::Elem]) -> FloatSlice<'_>;

    /// The stored values, to write (emulated bf16: its f32 storage).
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::precision::{AMP, FloatSliceMut, Precision, f16};
    /// let mut v = [AMP(f16::ONE)];
    /// if let FloatSliceMut::F16(h) = <AMP<f16>>::floats_mut(&mut v) {
    ///     h[0] = f16::from_f32(2.0);
    /// }
    /// assert_eq!(v[0].0, f16::from_f32(2.0));
    /// ```
    fn floats_mut(values: &mut [Self::Elem]) -> FloatSliceMut<'_>;

    /// An f32 tensor as this precision's, sharing its buffer, where casting changes nothing
    /// ([`IDENTITY`](Self::IDENTITY): `f32`); `None` for every other precision.
    fn share<
        S: dfdx::shapes::Shape,
        D: dfdx::tensor::Storage<f32> + dfdx::tensor::Storage<Self::Elem>,
    >(
        t: &dfdx::tensor::Tensor<S, f32, D>,
    ) -> Option<dfdx::tensor::Tensor<S, Self::Elem, D>>;
}

/// A precision whose tensors dfdx stores in the precision itself: `f32`, [`f16`](struct@f16) and
/// [`AMP<f16>`]: a model's own layers compute in it. Emulated [`bf16`] is stored in f32, where
/// dfdx's layers compute in f32: only mpx's layers run in bf16 (the mapped working copy,
/// [`Mixed::mapped`](crate::step::Mixed::mapped)). Sealed.
///
/// # Examples
/// ```
/// use mpx_runtime::precision::{AMP, Stored, f16};
/// fn stored<H: Stored>() {}
/// stored::<f16>();
/// stored::<AMP<f16>>();
/// stored::<f32>();
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not stored by dfdx in its own type: a model's own layers cannot compute in it",
    note = "emulated bf16 is stored in f32, where dfdx's layers compute in f32; mpx's layers run in bf16: hold the model with `Mixed::mapped` (its layers must map to mpx's, `HalfLayers`), or train in f16"
)]
pub trait Stored: Precision {}

impl Stored for f32 {}
impl Stored for f16 {}
impl Stored for AMP<f16> {}

/// Half precision: the compute precision of a mixed step. Implemented by [`f16`](struct@f16),
/// [`AMP<f16>`] and the emulated [`bf16`]; sealed, as [`Precision`] is.
///
/// # Examples
/// ```
/// use mpx_runtime::precision::{AMP, HalfPrecision, bf16, f16};
/// assert_eq!(<AMP<f16>>::MAX, 65504.0);
/// assert!(bf16::EMULATED && !f16::EMULATED);
/// ```
pub trait HalfPrecision: Precision {
    /// `true` when values are stored in f32 and only rounded to this precision (bf16).
    const EMULATED: bool;
    /// Largest finite value of the half format (65504 for f16, about 3.39e38 for bf16).
    const MAX: f32;
}
