//! Precision types: which element type a tensor is stored in, and how values are rounded into it.
//!
//! Full precision is [`f32`]. Half precision is a type parameter `H: HalfPrecision` with three
//! implementations:
//!
//! | marker | storage (`H::Elem`) | what it is |
//! |---|---|---|
//! | [`f16`](struct@f16) | `f16` | IEEE binary16, native dfdx dtype |
//! | [`AMP<f16>`] | `AMP<f16>` | dfdx's AMP wrapper: f16 storage, f32 accumulation in sums and optimizers |
//! | [`bf16`] | `f32` | **emulated** bfloat16: see below |
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
//! use mpx_runtime::precision::{HalfPrecision, Precision, bf16, f16};
//! assert_eq!(<f16 as Precision>::NAME, "float16");
//! let mut out = [0.0f32; 2];
//! // 1 + 2^-9 is not a bf16 value: it rounds to 1.0 (ties to even).
//! <bf16 as Precision>::from_f32_slice(&[1.0 + 1.0 / 512.0, 3.0], &mut out);
//! assert_eq!(out, [1.0, 3.0]);
//! assert!(<bf16 as HalfPrecision>::EMULATED);
//! ```

use crate::cast::FloatSliceMut;
pub use dfdx::dtypes::AMP;
use dfdx::shapes::{HasShape, Shape};
use dfdx::tensor::{Cpu, Tensor};
use dfdx::tensor_ops::ReshapeTo;
use half::slice::HalfFloatSliceExt;
pub use half::{bf16, f16};

/// A floating-point tensor element (`f32`, `f16` or `AMP<f16>`): the dtypes casts convert between.
///
/// Conversions work on whole slices (through `half`'s SIMD slice conversions), never element by
/// element.
///
/// # Examples
/// ```
/// use mpx_runtime::precision::{FloatElement, f16};
/// let mut h = [f16::ZERO; 2];
/// f16::from_f32_slice(&[1.5, 65520.0], &mut h);
/// assert_eq!(h[0], f16::from_f32(1.5));
/// assert!(h[1].is_infinite()); // 65520 rounds past f16's max, 65504
/// ```
pub trait FloatElement:
    'static + Copy + Send + Sync + std::fmt::Debug + dfdx::shapes::Dtype
{
    /// Short name, as jmp prints it: `full` for f32, `f16`.
    const NAME: &'static str;
    /// Converts `src` into `dst` (same length), rounding to nearest even.
    fn from_f32_slice(src: &[f32], dst: &mut [Self]);
    /// Widens `src` into `dst` (same length); exact.
    fn to_f32_slice(src: &[Self], dst: &mut [f32]);
    /// The slice as its raw IEEE bit patterns.
    fn bits(src: &[Self]) -> FloatBits<'_>;

    /// Reads a CPU tensor's values, in logical order, into `dst` as f32 (exact widening).
    /// `dst.len()` must be the tensor's element count; `tmp16` is reused scratch for 16-bit reads.
    ///
    /// dfdx 0.13 lends no slice of a tensor's storage outside the crate, so this is one memcpy
    /// (`copy_into`) plus, for 16-bit elements, one slice conversion.
    fn read_tensor_f32<S: Shape>(t: &Tensor<S, Self, Cpu>, dst: &mut [f32], tmp16: &mut Vec<f16>);

    /// Overwrites a CPU tensor's values with `src` converted to precision `P` (slice conversion,
    /// then one `copy_from`). `src.len()` must be the tensor's element count. `tmp32` and
    /// `tmp16` are reused scratch buffers: nothing is allocated once they are large enough.
    fn write_tensor_from_f32<P: Precision<Elem = Self>, S: Shape>(
        t: &mut Tensor<S, Self, Cpu>,
        src: &[f32],
        tmp32: &mut Vec<f32>,
        tmp16: &mut Vec<f16>,
    );

    /// Copies a CPU tensor's values into scratch and returns their bit patterns.
    fn read_tensor_bits<'a, S: Shape>(
        t: &Tensor<S, Self, Cpu>,
        tmp32: &'a mut Vec<f32>,
        tmp16: &'a mut Vec<f16>,
    ) -> FloatBits<'a>;

    /// Lets `visit` change a CPU tensor's values in place (copied out to scratch, then back).
    fn update_tensor<S: Shape>(
        t: &mut Tensor<S, Self, Cpu>,
        tmp32: &mut Vec<f32>,
        tmp16: &mut Vec<f16>,
        visit: &mut dyn FnMut(FloatSliceMut<'_>),
    );
}

/// A contiguous view of the tensor (shares storage when it already is contiguous), so that its
/// physical storage has exactly `num_elements` values in logical order.
fn contiguous<S: Shape, E: dfdx::shapes::Dtype>(t: &Tensor<S, E, Cpu>) -> Tensor<S, E, Cpu> {
    t.clone().contiguous()
}

/// Makes `t` contiguous in place (a no-op for tensors that already are).
fn make_contiguous<S: Shape, E: dfdx::shapes::Dtype>(t: &mut Tensor<S, E, Cpu>) {
    let c = t.clone().contiguous();
    *t = c;
}

/// Resizes a scratch buffer to `n` values (never shrinks its capacity) and returns it.
pub(crate) fn sized<T: Copy + Default>(buf: &mut Vec<T>, n: usize) -> &mut [T] {
    buf.resize(n, T::default());
    &mut buf[..n]
}

/// `true` when casting f32 or `P::Elem` values to `P` changes nothing (f32, f16, `AMP<f16>`; not the
/// emulated bf16, whose storage type differs from the precision).
pub(crate) fn is_identity<P: Precision>() -> bool {
    std::any::TypeId::of::<P>() == std::any::TypeId::of::<P::Elem>()
}

/// A float slice seen as its IEEE bit patterns, for bit-level checks (finiteness, exact compares).
#[derive(Debug, Clone, Copy)]
pub enum FloatBits<'a> {
    /// binary32 bit patterns.
    F32(&'a [u32]),
    /// binary16 bit patterns (`f16` and `AMP<f16>`).
    F16(&'a [u16]),
}

/// A precision a tree can be cast to: `f32`, `f16`, `AMP<f16>` or (emulated) `bf16`.
///
/// `Elem` is the dfdx dtype the values are stored in; for emulated bf16 it is `f32`.
pub trait Precision: 'static + Copy + Send + Sync + std::fmt::Debug {
    /// The dfdx element type tensors of this precision hold.
    type Elem: FloatElement;
    /// jmp's long dtype name: `float32`, `float16`, `bfloat16`.
    const NAME: &'static str;
    /// Converts f32 values into this precision's storage, rounding to nearest even (for emulated
    /// bf16: f32 values that are exactly bf16 values).
    fn from_f32_slice(src: &[f32], dst: &mut [Self::Elem]);
}

/// Half precision: the compute precision of a mixed step. Implemented by [`f16`](struct@f16),
/// [`AMP<f16>`] and the emulated [`bf16`].
pub trait HalfPrecision: Precision {
    /// `true` when values are stored in f32 and only rounded to this precision (bf16).
    const EMULATED: bool;
    /// Largest finite value of the half format (65504 for f16, about 3.39e38 for bf16).
    const MAX: f32;
}

// ---- element impls -------------------------------------------------------------------------

impl FloatElement for f32 {
    const NAME: &'static str = "full";
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn bits(src: &[Self]) -> FloatBits<'_> {
        // SAFETY: f32 and u32 have the same size and alignment and every bit pattern is valid.
        FloatBits::F32(unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u32>(), src.len()) })
    }
    fn read_tensor_f32<S: Shape>(t: &Tensor<S, f32, Cpu>, dst: &mut [f32], _: &mut Vec<f16>) {
        contiguous(t).copy_into(dst);
    }
    fn write_tensor_from_f32<P: Precision<Elem = f32>, S: Shape>(
        t: &mut Tensor<S, f32, Cpu>,
        src: &[f32],
        tmp32: &mut Vec<f32>,
        _: &mut Vec<f16>,
    ) {
        make_contiguous(t);
        if is_identity::<P>() {
            t.copy_from(src);
        } else {
            let buf = sized(tmp32, src.len());
            P::from_f32_slice(src, buf);
            t.copy_from(buf);
        }
    }
    fn read_tensor_bits<'a, S: Shape>(
        t: &Tensor<S, f32, Cpu>,
        tmp32: &'a mut Vec<f32>,
        _: &'a mut Vec<f16>,
    ) -> FloatBits<'a> {
        let buf = sized(tmp32, t.shape().num_elements());
        contiguous(t).copy_into(buf);
        f32::bits(buf)
    }
    fn update_tensor<S: Shape>(
        t: &mut Tensor<S, f32, Cpu>,
        tmp32: &mut Vec<f32>,
        _: &mut Vec<f16>,
        visit: &mut dyn FnMut(FloatSliceMut<'_>),
    ) {
        make_contiguous(t);
        let buf = sized(tmp32, t.shape().num_elements());
        t.copy_into(buf);
        visit(FloatSliceMut::F32(buf));
        t.copy_from(buf);
    }
}

impl FloatElement for f16 {
    const NAME: &'static str = "f16";
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn bits(src: &[Self]) -> FloatBits<'_> {
        FloatBits::F16(src.reinterpret_cast())
    }
    fn read_tensor_f32<S: Shape>(t: &Tensor<S, f16, Cpu>, dst: &mut [f32], tmp16: &mut Vec<f16>) {
        let buf = sized(tmp16, dst.len());
        contiguous(t).copy_into(buf);
        buf.convert_to_f32_slice(dst);
    }
    fn write_tensor_from_f32<P: Precision<Elem = f16>, S: Shape>(
        t: &mut Tensor<S, f16, Cpu>,
        src: &[f32],
        _: &mut Vec<f32>,
        tmp16: &mut Vec<f16>,
    ) {
        make_contiguous(t);
        let buf = sized(tmp16, src.len());
        P::from_f32_slice(src, buf);
        t.copy_from(buf);
    }
    fn read_tensor_bits<'a, S: Shape>(
        t: &Tensor<S, f16, Cpu>,
        _: &'a mut Vec<f32>,
        tmp16: &'a mut Vec<f16>,
    ) -> FloatBits<'a> {
        let buf = sized(tmp16, t.shape().num_elements());
        contiguous(t).copy_into(buf);
        f16::bits(buf)
    }
    fn update_tensor<S: Shape>(
        t: &mut Tensor<S, f16, Cpu>,
        _: &mut Vec<f32>,
        tmp16: &mut Vec<f16>,
        visit: &mut dyn FnMut(FloatSliceMut<'_>),
    ) {
        make_contiguous(t);
        let buf = sized(tmp16, t.shape().num_elements());
        t.copy_into(buf);
        visit(FloatSliceMut::F16(buf));
        t.copy_from(buf);
    }
}

/// Views `AMP<f16>` values as plain `f16` (`AMP` is `#[repr(transparent)]`).
pub fn amp_as_f16(src: &[AMP<f16>]) -> &[f16] {
    // SAFETY: AMP<F> is #[repr(transparent)] over F.
    unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<f16>(), src.len()) }
}

/// Mutable form of [`amp_as_f16`].
pub fn amp_as_f16_mut(src: &mut [AMP<f16>]) -> &mut [f16] {
    // SAFETY: AMP<F> is #[repr(transparent)] over F.
    unsafe { std::slice::from_raw_parts_mut(src.as_mut_ptr().cast::<f16>(), src.len()) }
}

/// Views plain `f16` values as `AMP<f16>` (the inverse of [`amp_as_f16_mut`]).
pub fn f16_as_amp_mut(src: &mut [f16]) -> &mut [AMP<f16>] {
    // SAFETY: AMP<F> is #[repr(transparent)] over F.
    unsafe { std::slice::from_raw_parts_mut(src.as_mut_ptr().cast::<AMP<f16>>(), src.len()) }
}

impl FloatElement for AMP<f16> {
    const NAME: &'static str = "f16";
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        amp_as_f16_mut(dst).convert_from_f32_slice(src);
    }
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        amp_as_f16(src).convert_to_f32_slice(dst);
    }
    fn bits(src: &[Self]) -> FloatBits<'_> {
        FloatBits::F16(amp_as_f16(src).reinterpret_cast())
    }
    fn read_tensor_f32<S: Shape>(
        t: &Tensor<S, AMP<f16>, Cpu>,
        dst: &mut [f32],
        tmp16: &mut Vec<f16>,
    ) {
        let buf = sized(tmp16, dst.len());
        contiguous(t).copy_into(f16_as_amp_mut(buf));
        buf.convert_to_f32_slice(dst);
    }
    fn write_tensor_from_f32<P: Precision<Elem = AMP<f16>>, S: Shape>(
        t: &mut Tensor<S, AMP<f16>, Cpu>,
        src: &[f32],
        _: &mut Vec<f32>,
        tmp16: &mut Vec<f16>,
    ) {
        make_contiguous(t);
        let buf = f16_as_amp_mut(sized(tmp16, src.len()));
        P::from_f32_slice(src, buf);
        t.copy_from(buf);
    }
    fn read_tensor_bits<'a, S: Shape>(
        t: &Tensor<S, AMP<f16>, Cpu>,
        _: &'a mut Vec<f32>,
        tmp16: &'a mut Vec<f16>,
    ) -> FloatBits<'a> {
        let buf = sized(tmp16, t.shape().num_elements());
        contiguous(t).copy_into(f16_as_amp_mut(buf));
        f16::bits(buf)
    }
    fn update_tensor<S: Shape>(
        t: &mut Tensor<S, AMP<f16>, Cpu>,
        _: &mut Vec<f32>,
        tmp16: &mut Vec<f16>,
        visit: &mut dyn FnMut(FloatSliceMut<'_>),
    ) {
        make_contiguous(t);
        let buf = sized(tmp16, t.shape().num_elements());
        t.copy_into(f16_as_amp_mut(buf));
        visit(FloatSliceMut::F16(buf));
        t.copy_from(f16_as_amp_mut(buf));
    }
}

// ---- precision impls -----------------------------------------------------------------------

impl Precision for f32 {
    type Elem = f32;
    const NAME: &'static str = "float32";
    fn from_f32_slice(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Precision for f16 {
    type Elem = f16;
    const NAME: &'static str = "float16";
    fn from_f32_slice(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
}
impl HalfPrecision for f16 {
    const EMULATED: bool = false;
    const MAX: f32 = 65504.0;
}

impl Precision for AMP<f16> {
    type Elem = AMP<f16>;
    const NAME: &'static str = "float16";
    fn from_f32_slice(src: &[f32], dst: &mut [AMP<f16>]) {
        amp_as_f16_mut(dst).convert_from_f32_slice(src);
    }
}
impl HalfPrecision for AMP<f16> {
    const EMULATED: bool = false;
    const MAX: f32 = 65504.0;
}

impl Precision for bf16 {
    type Elem = f32;
    const NAME: &'static str = "bfloat16";
    fn from_f32_slice(src: &[f32], dst: &mut [f32]) {
        round_to_bf16(src, dst);
    }
}
impl HalfPrecision for bf16 {
    const EMULATED: bool = true;
    const MAX: f32 = 3.389_531_4e38;
}

/// Rounds f32 values to the nearest bf16 value (ties to even), keeping f32 storage. NaN stays NaN
/// and values past bf16's max round to infinity, as `half::bf16::from_f32` does.
///
/// # Examples
/// ```
/// let mut out = [0.0f32; 1];
/// mpx_runtime::precision::round_to_bf16(&[1.0 + 3.0 / 256.0], &mut out);
/// assert_eq!(out[0], 1.0 + 4.0 / 256.0);
/// ```
pub fn round_to_bf16(src: &[f32], dst: &mut [f32]) {
    assert_eq!(
        src.len(),
        dst.len(),
        "round_to_bf16: slices differ in length"
    );
    // Bit-level round-to-nearest-even on the upper 16 bits; branch-free so it vectorises.
    for (d, s) in dst.iter_mut().zip(src) {
        let b = s.to_bits();
        let is_nan = (b & 0x7fff_ffff) > 0x7f80_0000;
        let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
        let quiet_nan = (b | 0x0040_0000) & 0xffff_0000;
        *d = f32::from_bits(if is_nan { quiet_nan } else { rounded });
    }
}
