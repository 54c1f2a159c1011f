//! OCP Microscaling (MX) block formats: element codecs, block quantization, packed tensors, and
//! MX training layers for dfdx.
//!
//! An MX block is `k` elements of a narrow format sharing one power-of-two scale (E8M0): value
//! `v_i = 2^shared * P_i`. This module follows the OCP MX v1.0 conversion (the MX paper's
//! Algorithm 1) and microxcaling's kernel, and differs from pychop where pychop deviates from
//! them; `docs/mx.md` lists each difference.
//!
//! | item | what it is |
//! |---|---|
//! | [`MxFormat`] | element formats: FP8 E4M3/E5M2, FP6 E3M2/E2M3, FP4 E2M1, INT8, custom floats and ints; `encode`/`decode`/`decode_table` |
//! | [`E8M0`] | the shared scale type |
//! | [`MxSpec`] | format + block size (default 32) + [`Rounding`] + scale width |
//! | [`MxTensor`] | a quantized tensor in packed storage: `quantize`, `dequantize`, `scale_codes`, `element_codes`, `to_bytes`/`from_bytes`, `statistics` |
//! | [`quantize_dequantize`] | round trip in one pass, no packing |
//! | [`compare_formats`], [`format_table`] | printable tables |
//! | [`MxFakeQuant`] | fake quantization of dfdx tensors with a straight-through gradient |
//! | [`MxLinear`] | a dfdx linear layer with MX weights (and optionally inputs); `model.into_layers(config)` ([`IntoLayers`](crate::nn::IntoLayers)) converts a model's `Linear` layers, `nn::builders::MxLinear` builds one |
//!
//! # The quantization rule
//! * Blocks of `k` consecutive elements run along the **last axis**; a row whose length is not a
//!   multiple of `k` ends in a short block. Blocks never cross rows.
//! * `shared = floor(log2(max |x_i|)) - emax_elem`, with the **exact** binary exponent read from the
//!   f32 bits (never a float `log2`), clamped below at -127 (all-zero blocks get 2^-127, code 0).
//! * Any NaN or Inf in a block makes its scale NaN (E8M0 0xFF): every value of the block decodes to
//!   NaN.
//! * Elements `x_i / 2^shared` round to nearest, ties to even (or ties away, microxcaling's
//!   default, with [`Rounding::NearestAway`]), saturate at ±max normal, keep subnormals and the
//!   sign of zero. MXINT8 is symmetric (±127/64).
//!
//! Every case of the reference data (`tests/data/mx/`) matches bit for bit: scale codes, element
//! codes and dequantized values.
//!
//! # Examples
//! ```
//! use mpx_runtime::mx::{MxFormat, MxSpec, MxTensor, quantize_dequantize};
//! let spec = MxSpec::new(MxFormat::Fp8E4M3).with_block_size(4)?;
//! let x = [0.1, -3.0, 250.0, 1e-3, /* row 2 */ 1.0, 2.0, 3.0, 4.0, 5.0];
//! // shape [1, 9]: blocks [0..4], [4..8], [8] (short)
//! let t = MxTensor::quantize(&x, &[1, 9], &spec)?;
//! assert_eq!(t.scale_codes(), &[127 + 7 - 8, 127 + 2 - 8, 127 + 2 - 8]);
//! let y = t.dequantize();
//! // 3 mantissa bits; the block max 250 = 1.95 * 2^7 scales to 500 and saturates at 448
//! // (the spec's floor rule clips block maxima whose significand exceeds 1.75)
//! assert_eq!(&y[..3], &[0.1015625, -3.0, 224.0]);
//! assert_eq!(y, quantize_dequantize(&x, &[1, 9], &spec)?);
//! let bytes = t.to_bytes();
//! assert_eq!(MxTensor::from_bytes(&bytes)?, t);
//! # Ok::<(), mpx_runtime::mx::MxError>(())
//! ```

mod block;
mod element;
mod error;
mod fake_quant;
mod linear;
mod packing;
mod scale;
mod spec;
mod stats;
mod tensor;

pub use element::{CustomFloat, CustomInt, MxFormat, Rounding, SpecialValues};
pub use error::MxError;
pub use fake_quant::MxFakeQuant;
pub use linear::{
    MxConfig, MxLinear, Mxfp4Weights, Mxfp6Weights, Mxfp8, Mxfp8Weights, Mxint8Weights,
};
pub use scale::E8M0;
pub use spec::MxSpec;
pub use stats::{FormatComparison, FormatTable, MxStatistics, compare_formats, format_table};
pub use tensor::{MxTensor, quantize_dequantize, quantize_dequantize_into};
