//! Shared scales: the OCP E8M0 type and the exact shared-exponent rule.

use std::fmt;

use super::element::pow2;
use super::spec::MxSpec;

/// An OCP E8M0 scale: an unsigned biased exponent, bias 127, no sign, no zero, no Inf.
/// Code `c` in `0..=254` is `2^(c-127)` (0x00 = 2^-127, an f32 subnormal; 0x7F = 1.0);
/// 0xFF is NaN.
///
/// # Examples
/// ```
/// use mpx_runtime::mx::E8M0;
/// assert_eq!(E8M0::from_bits(0x7F).to_f32(), 1.0);
/// assert_eq!(E8M0::from_exponent(-127), Some(E8M0::from_bits(0)));
/// assert!(E8M0::NAN.to_f32().is_nan());
/// assert_eq!(E8M0::from_f32(3.0).exponent(), Some(2)); // nearest power of two, ties up
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct E8M0(u8);

impl fmt::Display for E8M0 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.exponent() {
            Some(e) => write!(f, "2^{e}"),
            None => f.write_str("NaN"),
        }
    }
}

impl E8M0 {
    /// The NaN scale (0xFF): every value of its block is NaN.
    pub const NAN: E8M0 = E8M0(0xff);
    /// 1.0 (0x7F).
    pub const ONE: E8M0 = E8M0(0x7f);
    /// The smallest scale, 2^-127 (0x00).
    pub const MIN: E8M0 = E8M0(0x00);
    /// The largest scale, 2^127 (0xFE).
    pub const MAX: E8M0 = E8M0(0xfe);
    /// Exponent bias.
    pub const BIAS: i32 = 127;

    /// The scale with code `bits`.
    pub const fn from_bits(bits: u8) -> E8M0 {
        E8M0(bits)
    }

    /// The code.
    pub const fn to_bits(self) -> u8 {
        self.0
    }

    /// `2^e`, for `-127 <= e <= 127`; `None` outside.
    pub fn from_exponent(e: i32) -> Option<E8M0> {
        (-127..=127).contains(&e).then(|| E8M0((e + 127) as u8))
    }

    /// The exponent, `None` for NaN.
    pub fn exponent(self) -> Option<i32> {
        (self.0 != 0xff).then(|| i32::from(self.0) - 127)
    }

    /// Whether this is the NaN scale.
    pub fn is_nan(self) -> bool {
        self.0 == 0xff
    }

    /// The value as an f32 (exact; 0x00 is the subnormal 2^-127).
    pub fn to_f32(self) -> f32 {
        match self.exponent() {
            Some(e) => pow2(e),
            None => f32::NAN,
        }
    }

    /// The value of every code, index = code.
    pub fn decode_table() -> [f32; 256] {
        std::array::from_fn(|c| E8M0(c as u8).to_f32())
    }

    /// A plain conversion of an arbitrary f32 (`ml_dtypes`' `float8_e8m0fnu` cast, *not* the MX
    /// scale rule): the nearest power of two in the linear domain with ties up
    /// (`1.5 * 2^k -> 2^(k+1)`); positive values below 2^-127 give 2^-127; zero, negative,
    /// NaN, ±Inf and values >= 1.5 * 2^127 give NaN.
    pub fn from_f32(x: f32) -> E8M0 {
        if x.is_nan() || x <= 0.0 || x.is_infinite() {
            return E8M0::NAN;
        }
        let b = x.to_bits();
        let e = if b < 0x0080_0000 {
            // [2^-127, 2^-126) rounds by the 2^-128 bit; below 2^-127 stays at the minimum.
            if b >= 0x0060_0000 { -126 } else { -127 }
        } else {
            let e = (b >> 23) as i32 - 127;
            if b & 0x0040_0000 != 0 { e + 1 } else { e }
        };
        E8M0::from_exponent(e).unwrap_or(E8M0::NAN)
    }
}

/// The shared-scale rule of one spec: `E<k>M0` with bias `2^(k-1) - 1`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ScaleCodec {
    pub(crate) bias: i32,
    pub(crate) nan_code: u8,
}

impl ScaleCodec {
    pub(crate) fn new(spec: &MxSpec) -> ScaleCodec {
        ScaleCodec {
            bias: spec.scale_bias(),
            nan_code: ((1u32 << spec.scale_exp_bits()) - 1) as u8,
        }
    }

    /// The shared exponent of a block whose largest magnitude has f32 bits `amax_bits` (sign
    /// cleared, NaN-propagating): `floor(log2(amax)) - emax`, exactly, clamped below at `-bias`;
    /// `None` (a NaN block) for NaN or Inf, or past `+bias`.
    #[inline(always)]
    pub(crate) fn shared_exponent(self, amax_bits: u32, emax: i32) -> Option<i32> {
        if amax_bits >= 0x7f80_0000 {
            return None;
        }
        // An f32 subnormal (or zero) maximum has exponent <= -127: with emax >= 0 and bias <= 127
        // it clamps to -bias whatever its exact value, as the CUDA kernel's "biased exponent 0".
        let e = if amax_bits < 0x0080_0000 {
            -127
        } else {
            (amax_bits >> 23) as i32 - 127
        };
        let shared = (e - emax).max(-self.bias);
        (shared <= self.bias).then_some(shared)
    }

    /// The code of a shared exponent.
    #[inline(always)]
    pub(crate) fn code(self, shared: i32) -> u8 {
        (shared + self.bias) as u8
    }

    /// The f32 value of a scale code (NaN for the NaN code or past it).
    #[inline(always)]
    pub(crate) fn value(self, code: u8) -> f32 {
        if code >= self.nan_code {
            f32::NAN
        } else {
            pow2(i32::from(code) - self.bias)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mx::MxFormat;

    #[test]
    fn shared_exponent_is_exact_and_clamped() {
        let sc = ScaleCodec::new(&MxSpec::new(MxFormat::Fp8E4M3));
        assert_eq!((sc.bias, sc.nan_code), (127, 255));
        // just below a power of two keeps the lower exponent (a float log2 would round up)
        let below = f32::from_bits(0x4380_0000 - 1); // 255.99998
        assert_eq!(sc.shared_exponent(below.to_bits(), 8), Some(7 - 8));
        assert_eq!(sc.shared_exponent(256f32.to_bits(), 8), Some(0));
        assert_eq!(sc.shared_exponent(f32::MAX.to_bits(), 8), Some(119));
        assert_eq!(sc.shared_exponent(0, 8), Some(-127));
        assert_eq!(sc.shared_exponent(1, 0), Some(-127)); // subnormal max
        assert_eq!(sc.shared_exponent(1e-38f32.to_bits(), 0), Some(-127));
        assert_eq!(sc.shared_exponent(f32::INFINITY.to_bits(), 8), None);
        assert_eq!(sc.shared_exponent(f32::NAN.to_bits(), 8), None);
        let narrow = ScaleCodec::new(&MxSpec::new(MxFormat::Int8).with_scale_exp_bits(3).unwrap());
        assert_eq!((narrow.bias, narrow.nan_code), (3, 7));
        assert_eq!(narrow.shared_exponent(8f32.to_bits(), 0), Some(3));
        assert_eq!(narrow.shared_exponent(16f32.to_bits(), 0), None);
        assert_eq!(narrow.shared_exponent(0.001f32.to_bits(), 0), Some(-3));
        assert!(narrow.value(7).is_nan() && narrow.value(0) == 0.125);
    }
}
