//! Errors from building MX formats and specs, quantizing, and reading packed bytes.

/// Why an MX format, spec or tensor could not be built. Each message names the offending value
/// and what is allowed.
///
/// # Examples
/// ```
/// use mpx_runtime::mx::{MxError, MxFormat, MxSpec};
/// let err = MxSpec::new(MxFormat::Fp8E4M3).with_block_size(0).unwrap_err();
/// assert_eq!(err, MxError::ZeroBlockSize);
/// assert!(err.to_string().contains("at least 1"));
/// let err = MxFormat::custom_float(5, 3).unwrap_err();
/// assert!(err.to_string().contains("at most 8"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MxError {
    /// A custom format too narrow to hold a value (E0M0, an integer of 0 or 1 bits).
    #[error(
        "invalid {what}: an element format needs at least {min} bits; allowed: floats with exponent + mantissa bits in 1..=7 (plus the sign; 0 exponent bits make an integer, as pychop), integers with 2..=8 bits"
    )]
    TooFewBits {
        /// What was rejected, e.g. `"custom integer with 1 bits"`.
        what: String,
        /// The smallest width allowed for that field.
        min: u32,
    },
    /// A custom format wider than 8 bits (sign included).
    #[error(
        "invalid {what}: {bits} bits per element, at most 8 are allowed (MX elements are 4, 6 or 8 bits wide; custom formats are stored in the next of those)"
    )]
    TooManyBits {
        /// What was rejected, e.g. `"custom float E5M3"`.
        what: String,
        /// Its total width, sign included.
        bits: u32,
    },
    /// A block size of 0.
    #[error(
        "invalid block size 0: a block must hold at least 1 element (the OCP MX formats use 32)"
    )]
    ZeroBlockSize,
    /// A scale exponent width outside 1..=8.
    #[error(
        "invalid scale exponent width {0}: the shared scale is an E<k>M0 power of two with 1 <= k <= 8 exponent bits (8 = the OCP E8M0 scale)"
    )]
    ScaleExpBits(u32),
    /// A shape whose element count differs from the data's length.
    #[error(
        "shape {shape:?} holds {expected} elements but {found} were given; the data must be the row-major contents of the shape"
    )]
    ShapeMismatch {
        /// The shape given.
        shape: Vec<usize>,
        /// Its element count.
        expected: usize,
        /// The number of values given.
        found: usize,
    },
    /// A shape whose element count does not fit `usize`.
    #[error("shape {0:?} has more elements than fit in usize")]
    ShapeOverflow(Vec<usize>),
    /// Packed bytes or codes of the wrong length.
    #[error("invalid {what} length: expected {expected} bytes, found {found}")]
    Length {
        /// Which part: `"packed tensor"`, `"scale codes"`, `"element codes"`, `"header"`.
        what: &'static str,
        /// The length the header, shape and spec call for.
        expected: usize,
        /// The length given.
        found: usize,
    },
    /// A packed tensor whose header is not one this version writes.
    #[error("invalid packed MX tensor: {0}")]
    BadHeader(String),
    /// A code that does not fit its field (an element code wider than the format, or a scale
    /// code past the scale's NaN code).
    #[error(
        "invalid {what} code {code:#04x} at index {index}: codes of this field are below {limit:#x}"
    )]
    CodeOutOfRange {
        /// `"element"` or `"scale"`.
        what: &'static str,
        /// Position of the code (element index or block index).
        index: usize,
        /// The rejected code.
        code: u8,
        /// One past the largest valid code.
        limit: u32,
    },
    /// Statistics or comparisons asked for with data that is not the tensor's original.
    #[error(
        "original data has {found} values but the tensor holds {expected}; pass the data the tensor was quantized from"
    )]
    OriginalLength {
        /// Elements in the tensor.
        expected: usize,
        /// Values given.
        found: usize,
    },
    /// An output buffer of the wrong length.
    #[error("output buffer holds {found} values but the tensor has {expected} elements")]
    OutputLength {
        /// Elements in the tensor.
        expected: usize,
        /// Length of the buffer given.
        found: usize,
    },
}
