//! Element formats: the OCP MX element types, pychop-style custom floats and integers, and their
//! codecs (round to nearest, saturating encode; exact decode).

use std::fmt;

use super::error::MxError;

/// How element values halfway between two codes round.
///
/// # Examples
/// ```
/// use mpx_runtime::mx::{MxFormat, Rounding};
/// // 1.25 lies halfway between FP4 E2M1's 1.0 (code 2, even) and 1.5 (code 3)
/// assert_eq!(MxFormat::Fp4E2M1.encode_with(1.25, Rounding::NearestEven), Some(2));
/// assert_eq!(MxFormat::Fp4E2M1.encode_with(1.25, Rounding::NearestAway), Some(3));
/// assert_eq!(Rounding::default(), Rounding::NearestEven);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Rounding {
    /// Round to nearest, ties to even (IEEE; `ml_dtypes`, torchao and pychop). The default.
    #[default]
    NearestEven,
    /// Round to nearest, ties away from zero (microxcaling's default `round='nearest'`).
    NearestAway,
}

/// Which special values a float element format has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpecialValues {
    /// IEEE-like: the all-ones exponent holds ±Inf (mantissa 0) and NaN (else). FP8 E5M2.
    Ieee,
    /// No Inf; only the all-ones code `S.1111.111` is NaN. FP8 E4M3 (`float8_e4m3fn`).
    NanOnly,
    /// Every code is finite: no Inf, no NaN. FP6, FP4 and every custom float (pychop's rule).
    FiniteOnly,
    /// A two's-complement integer with a fixed binary point (MXINT8, custom integers).
    Int,
}

/// A custom float element format: `1 + exp_bits + man_bits` bits, bias `2^(exp_bits-1) - 1`,
/// every code finite (no Inf, no NaN), subnormals on. This is pychop's rule for a
/// `format=(exp_bits, sig_bits)` tuple, so `custom_float(4, 3)` is *not* OCP FP8 E4M3 (its max
/// is 480, not 448). Built by [`MxFormat::custom_float`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CustomFloat {
    exp_bits: u8,
    man_bits: u8,
}

impl CustomFloat {
    /// Exponent bits.
    pub fn exp_bits(&self) -> u32 {
        u32::from(self.exp_bits)
    }
    /// Mantissa (fraction) bits.
    pub fn man_bits(&self) -> u32 {
        u32::from(self.man_bits)
    }
}

/// A custom integer element format: a `bits`-bit two's-complement integer `k` with value
/// `k / 2^(bits-2)` (one sign bit, one integer bit), as pychop's `(0, bits-1)` tuples and
/// microxcaling's `int<bits>`; the encoder clamps to the symmetric range `±(2^(bits-1) - 1)`.
/// Built by [`MxFormat::custom_int`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CustomInt {
    bits: u8,
}

impl CustomInt {
    /// Total bits, sign included.
    pub fn bits(&self) -> u32 {
        u32::from(self.bits)
    }
}

/// An MX element format: the six OCP MX element types, or a custom float or integer.
///
/// | variant | bits | max normal | emax | special values |
/// |---|---|---|---|---|
/// | [`Fp8E4M3`](MxFormat::Fp8E4M3) | 8 | 448 | 8 | NaN only (`0x7F`/`0xFF`) |
/// | [`Fp8E5M2`](MxFormat::Fp8E5M2) | 8 | 57344 | 15 | IEEE Inf and NaN |
/// | [`Fp6E3M2`](MxFormat::Fp6E3M2) | 6 | 28 | 4 | none |
/// | [`Fp6E2M3`](MxFormat::Fp6E2M3) | 6 | 7.5 | 2 | none |
/// | [`Fp4E2M1`](MxFormat::Fp4E2M1) | 4 | 6 | 2 | none |
/// | [`Int8`](MxFormat::Int8) | 8 | 127/64 | 0 | none (value = code / 64) |
///
/// # Examples
/// ```
/// use mpx_runtime::mx::MxFormat;
/// let f = MxFormat::Fp8E4M3;
/// assert_eq!(f.max_normal(), 448.0);
/// assert_eq!(f.encode(500.0), Some(0x7E)); // saturates to 448
/// assert_eq!(f.decode(0x7E), 448.0);
/// let e3m2 = MxFormat::custom_float(3, 2)?; // finite-only, same values as FP6 E3M2
/// assert_eq!(e3m2.max_normal(), 28.0);
/// # Ok::<(), mpx_runtime::mx::MxError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MxFormat {
    /// OCP FP8 E4M3 (`float8_e4m3fn`): bias 7, max 448, no Inf.
    Fp8E4M3,
    /// OCP FP8 E5M2: bias 15, max 57344, IEEE Inf/NaN.
    Fp8E5M2,
    /// OCP FP6 E3M2: bias 3, max 28.
    Fp6E3M2,
    /// OCP FP6 E2M3: bias 1, max 7.5.
    Fp6E2M3,
    /// OCP FP4 E2M1: bias 1, max 6.
    Fp4E2M1,
    /// OCP MXINT8: two's complement, value `k / 64`, symmetric range ±127/64.
    Int8,
    /// A custom finite-only float; see [`MxFormat::custom_float`].
    CustomFloat(CustomFloat),
    /// A custom integer; see [`MxFormat::custom_int`].
    CustomInt(CustomInt),
}

impl fmt::Display for MxFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&self.name())
    }
}

impl MxFormat {
    /// The six OCP MX element formats, in the spec's order.
    pub const OCP: [MxFormat; 6] = [
        MxFormat::Fp8E5M2,
        MxFormat::Fp8E4M3,
        MxFormat::Fp6E3M2,
        MxFormat::Fp6E2M3,
        MxFormat::Fp4E2M1,
        MxFormat::Int8,
    ];

    /// A custom float with `exp_bits` exponent and `man_bits` mantissa bits (pychop's
    /// `format=(exp_bits, man_bits)`): finite-only, bias `2^(exp_bits-1) - 1`, subnormals on.
    /// As in pychop, `exp_bits = 0` means a `1 + man_bits`-bit integer: `custom_float(0, 7)` is
    /// `custom_int(8)`, MXINT8's values. Allowed: `1 + exp_bits + man_bits <= 8`, and at least one
    /// exponent or mantissa bit.
    ///
    /// # Errors
    /// [`MxError::TooFewBits`] for E0M0; [`MxError::TooManyBits`] when the format needs more
    /// than 8 bits.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::mx::MxFormat;
    /// let f = MxFormat::custom_float(4, 3)?;
    /// assert_eq!((f.max_normal(), f.emax()), (480.0, 8)); // not OCP E4M3's 448
    /// assert_eq!(MxFormat::custom_float(0, 3)?, MxFormat::custom_int(4)?); // pychop's (0, 3)
    /// assert!(MxFormat::custom_float(0, 0).is_err());
    /// assert!(MxFormat::custom_float(5, 3).is_err()); // 9 bits
    /// # Ok::<(), mpx_runtime::mx::MxError>(())
    /// ```
    pub fn custom_float(exp_bits: u32, man_bits: u32) -> Result<MxFormat, MxError> {
        if exp_bits == 0 {
            if man_bits == 0 {
                return Err(MxError::TooFewBits {
                    what: "custom float E0M0 (a sign bit and nothing else)".into(),
                    min: 2,
                });
            }
            return match man_bits.checked_add(1) {
                Some(bits) if bits <= 8 => MxFormat::custom_int(bits),
                _ => Err(MxError::TooManyBits {
                    what: format!("custom float E0M{man_bits} (an integer)"),
                    bits: man_bits.saturating_add(1),
                }),
            };
        }
        let bits = 1u64 + u64::from(exp_bits) + u64::from(man_bits);
        if bits > 8 {
            return Err(MxError::TooManyBits {
                what: format!("custom float E{exp_bits}M{man_bits}"),
                bits: u32::try_from(bits).unwrap_or(u32::MAX),
            });
        }
        Ok(MxFormat::CustomFloat(CustomFloat {
            exp_bits: exp_bits as u8,
            man_bits: man_bits as u8,
        }))
    }

    /// A custom `bits`-bit integer (sign included): value `k / 2^(bits-2)`, symmetric range.
    /// Allowed: `2 <= bits <= 8`; `custom_int(8)` has the values of [`MxFormat::Int8`].
    ///
    /// # Errors
    /// [`MxError::TooFewBits`] below 2 bits; [`MxError::TooManyBits`] above 8.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::mx::MxFormat;
    /// let int4 = MxFormat::custom_int(4)?;
    /// assert_eq!(int4.max_normal(), 1.75); // 7 / 4
    /// assert!(MxFormat::custom_int(9).is_err());
    /// # Ok::<(), mpx_runtime::mx::MxError>(())
    /// ```
    pub fn custom_int(bits: u32) -> Result<MxFormat, MxError> {
        if bits < 2 {
            return Err(MxError::TooFewBits {
                what: format!("custom integer with {bits} bits"),
                min: 2,
            });
        }
        if bits > 8 {
            return Err(MxError::TooManyBits {
                what: format!("custom integer INT{bits}"),
                bits,
            });
        }
        Ok(MxFormat::CustomInt(CustomInt { bits: bits as u8 }))
    }

    /// A short name: `"MXFP8 E4M3"`, …, `"MXINT8"`, `"E3M2 (custom)"`, `"INT4 (custom)"`.
    pub fn name(&self) -> String {
        match self {
            MxFormat::Fp8E4M3 => "MXFP8 E4M3".into(),
            MxFormat::Fp8E5M2 => "MXFP8 E5M2".into(),
            MxFormat::Fp6E3M2 => "MXFP6 E3M2".into(),
            MxFormat::Fp6E2M3 => "MXFP6 E2M3".into(),
            MxFormat::Fp4E2M1 => "MXFP4 E2M1".into(),
            MxFormat::Int8 => "MXINT8".into(),
            MxFormat::CustomFloat(c) => format!("E{}M{} (custom)", c.exp_bits, c.man_bits),
            MxFormat::CustomInt(c) => format!("INT{} (custom)", c.bits),
        }
    }

    /// Which special values the format has.
    pub fn special_values(&self) -> SpecialValues {
        match self {
            MxFormat::Fp8E4M3 => SpecialValues::NanOnly,
            MxFormat::Fp8E5M2 => SpecialValues::Ieee,
            MxFormat::Int8 | MxFormat::CustomInt(_) => SpecialValues::Int,
            _ => SpecialValues::FiniteOnly,
        }
    }

    /// Whether the elements are integers (MXINT8, custom integers).
    pub fn is_int(&self) -> bool {
        self.special_values() == SpecialValues::Int
    }

    /// Exponent bits (0 for integers).
    pub fn exp_bits(&self) -> u32 {
        match self {
            MxFormat::Fp8E4M3 => 4,
            MxFormat::Fp8E5M2 => 5,
            MxFormat::Fp6E3M2 => 3,
            MxFormat::Fp6E2M3 | MxFormat::Fp4E2M1 => 2,
            MxFormat::CustomFloat(c) => c.exp_bits(),
            MxFormat::Int8 | MxFormat::CustomInt(_) => 0,
        }
    }

    /// Mantissa bits (for integers: the magnitude bits, `bits - 1`, as pychop's `(0, sig_bits)`).
    pub fn man_bits(&self) -> u32 {
        match self {
            MxFormat::Fp8E4M3 | MxFormat::Fp6E2M3 => 3,
            MxFormat::Fp8E5M2 | MxFormat::Fp6E3M2 => 2,
            MxFormat::Fp4E2M1 => 1,
            MxFormat::CustomFloat(c) => c.man_bits(),
            MxFormat::Int8 => 7,
            MxFormat::CustomInt(c) => c.bits() - 1,
        }
    }

    /// Bits of one element code, sign included.
    pub fn bits(&self) -> u32 {
        1 + self.exp_bits() + self.man_bits()
    }

    /// Bits one element takes in packed storage: 4, 6 or 8 (the next of those at or above
    /// [`bits`](MxFormat::bits)).
    pub fn storage_bits(&self) -> u32 {
        match self.bits() {
            0..=4 => 4,
            5..=6 => 6,
            _ => 8,
        }
    }

    /// Exponent bias (`None` for integers).
    pub fn bias(&self) -> Option<i32> {
        if self.is_int() {
            None
        } else {
            Some((1i32 << (self.exp_bits() - 1)) - 1)
        }
    }

    /// Fraction bits of an integer format's fixed point (`bits - 2`; `None` for floats).
    fn int_frac_bits(self) -> Option<u32> {
        if self.is_int() {
            Some(self.bits() - 2)
        } else {
            None
        }
    }

    /// Largest finite value.
    pub fn max_normal(&self) -> f32 {
        let m = self.man_bits() as i32;
        match (self.special_values(), self.bias(), self.int_frac_bits()) {
            (SpecialValues::Int, _, Some(frac)) => {
                ((1u32 << (self.bits() - 1)) - 1) as f32 / pow2(frac as i32)
            }
            (special, Some(bias), _) => {
                let top = (1i32 << self.exp_bits()) - 1; // all-ones exponent field
                let (top, mant) = match special {
                    SpecialValues::Ieee => (top - 1, (1i32 << (m + 1)) - 1),
                    SpecialValues::NanOnly => (top, (1i32 << (m + 1)) - 2),
                    _ => (top, (1i32 << (m + 1)) - 1),
                };
                mant as f32 * pow2(top - bias - m)
            }
            _ => f32::NAN,
        }
    }

    /// `floor(log2(max_normal))`: the exponent the shared scale is measured against.
    pub fn emax(&self) -> i32 {
        exponent_of(self.max_normal())
    }

    /// Exponent of the smallest normal (`1 - bias`; `None` for integers).
    pub fn emin(&self) -> Option<i32> {
        self.bias().map(|b| 1 - b)
    }

    /// Smallest positive normal value (for integers: the step, `2^-(bits-2)`).
    pub fn min_normal(&self) -> f32 {
        match (self.emin(), self.int_frac_bits()) {
            (Some(emin), _) => pow2(emin),
            (None, Some(frac)) => pow2(-(frac as i32)),
            _ => f32::NAN,
        }
    }

    /// Smallest positive value (a subnormal for floats, the step for integers).
    pub fn min_subnormal(&self) -> f32 {
        match self.emin() {
            Some(emin) => pow2(emin - self.man_bits() as i32),
            None => self.min_normal(),
        }
    }

    /// The value of element code `code` (its low [`bits`](MxFormat::bits) bits), exactly;
    /// NaN codes decode to a quiet NaN with the code's sign. Higher bits are ignored.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::mx::MxFormat;
    /// assert_eq!(MxFormat::Fp4E2M1.decode(0x1), 0.5); // a subnormal
    /// assert_eq!(MxFormat::Fp4E2M1.decode(0xF), -6.0);
    /// assert_eq!(MxFormat::Fp8E5M2.decode(0x7C), f32::INFINITY);
    /// assert_eq!(MxFormat::Int8.decode(0x80), -2.0); // decodable, never produced
    /// ```
    pub fn decode(&self, code: u8) -> f32 {
        let bits = self.bits();
        let code = u32::from(code) & ((1u32 << bits) - 1);
        if let Some(frac) = self.int_frac_bits() {
            let k = ((code << (32 - bits)) as i32) >> (32 - bits);
            return k as f32 / pow2(frac as i32);
        }
        let (e, m) = (self.exp_bits(), self.man_bits());
        let bias = self.bias().unwrap_or(0);
        let sign = code >> (bits - 1);
        let ef = (code >> m) & ((1 << e) - 1);
        let mf = code & ((1 << m) - 1);
        let top = (1 << e) - 1;
        let nan = f32::from_bits(0x7fc0_0000 | (sign << 31));
        match self.special_values() {
            SpecialValues::Ieee if ef == top => {
                return if mf == 0 {
                    if sign == 1 {
                        f32::NEG_INFINITY
                    } else {
                        f32::INFINITY
                    }
                } else {
                    nan
                };
            }
            SpecialValues::NanOnly if ef == top && mf == (1 << m) - 1 => return nan,
            _ => {}
        }
        let (sig, exp) = if ef == 0 {
            (mf, 1 - bias - m as i32)
        } else {
            (mf | (1 << m), ef as i32 - bias - m as i32)
        };
        // sig < 2^8 and the exponent is within f32's range: the product is exact.
        let v = (f64::from(sig) * 2f64.powi(exp)) as f32;
        if sign == 1 { -v } else { v }
    }

    /// The value of every code, `2^bits` entries, index = code.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::mx::MxFormat;
    /// let t = MxFormat::Fp4E2M1.decode_table();
    /// assert_eq!(&t[..8], &[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]);
    /// ```
    pub fn decode_table(&self) -> Vec<f32> {
        (0..1u32 << self.bits())
            .map(|c| self.decode(c as u8))
            .collect()
    }

    /// Encodes `x` by the MX element rule: round to nearest, ties to even; finite values beyond
    /// the max saturate to ±max; ±Inf stays Inf where the format has Inf (E5M2), becomes NaN
    /// where it has only NaN (E4M3), and saturates otherwise; NaN gives the NaN code (sign kept),
    /// or `None` where the format has no NaN. `-0.0` and negative values that round to zero give
    /// the `-0` code (floats).
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::mx::MxFormat;
    /// assert_eq!(MxFormat::Fp4E2M1.encode(2.5), Some(0x4)); // tie -> even (2.0)
    /// assert_eq!(MxFormat::Fp4E2M1.encode(-100.0), Some(0xF)); // -6, saturated
    /// assert_eq!(MxFormat::Fp4E2M1.encode(f32::NAN), None);
    /// assert_eq!(MxFormat::Int8.encode(0.5), Some(32));
    /// ```
    pub fn encode(&self, x: f32) -> Option<u8> {
        self.encode_with(x, Rounding::NearestEven)
    }

    /// [`encode`](MxFormat::encode) with a choice of tie rule.
    pub fn encode_with(&self, x: f32, rounding: Rounding) -> Option<u8> {
        let codec = Codec::new(*self);
        let bits = x.to_bits();
        let sign = bits >> 31;
        let abs = bits & 0x7fff_ffff;
        let special = self.special_values();
        if abs > 0x7f80_0000 {
            let top = (1u32 << (self.bits() - 1)) - 1; // all ones below the sign
            return match special {
                SpecialValues::Ieee => Some(((sign << 7) | (top - 1)) as u8),
                SpecialValues::NanOnly => Some(((sign << 7) | top) as u8),
                _ => None,
            };
        }
        if abs == 0x7f80_0000 {
            match special {
                SpecialValues::Ieee => {
                    let inf = ((1u32 << self.exp_bits()) - 1) << self.man_bits();
                    return Some(((sign << 7) | inf) as u8);
                }
                SpecialValues::NanOnly => return Some(((sign << 7) | 0x7f) as u8),
                _ => {}
            }
        }
        let mut out = [0u8];
        codec.encode_slice(rounding, 1.0, &[x], &mut out);
        Some(out[0])
    }
}

/// `2^e` as an f32, exactly, for `-149 <= e <= 127` (subnormal powers included).
#[inline(always)]
pub(crate) fn pow2(e: i32) -> f32 {
    if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (e + 149).clamp(0, 22))
    }
}

/// `floor(log2(x))` of a positive finite f32, exactly (subnormals included).
pub(crate) fn exponent_of(x: f32) -> i32 {
    let b = x.to_bits() & 0x7fff_ffff;
    let ef = (b >> 23) as i32;
    if ef > 0 {
        ef - 127
    } else {
        // subnormal: value = mantissa * 2^-149
        31 - b.leading_zeros() as i32 - 149
    }
}

/// Precomputed constants of one element format for the hot loops.
#[derive(Clone)]
pub(crate) struct Codec {
    pub(crate) is_int: bool,
    pub(crate) emax: i32,
    /// Element code written into NaN blocks: the format's positive NaN code, else 0.
    pub(crate) block_nan_code: u8,
    pub(crate) storage_bits: u32,
    // floats
    sign_shift: u32,
    shift: u32,
    max_bits: u32,
    min_normal_bits: u32,
    rebias: u32,
    magic: f32,
    sub_scale: f32,
    // integers
    int_scale: f32,
    int_mask: u32,
}

/// The decoded value of every byte as an element code of `format` (codes past `2^bits` are NaN),
/// for table-driven dequantization without bounds checks.
pub(crate) fn decode_table_256(format: MxFormat) -> [f32; 256] {
    let mut table = [f32::NAN; 256];
    for (c, t) in table.iter_mut().enumerate().take(1 << format.bits()) {
        *t = format.decode(c as u8);
    }
    table
}

impl Codec {
    pub(crate) fn new(format: MxFormat) -> Codec {
        let bits = format.bits();
        let m = format.man_bits();
        let max_bits = format.max_normal().to_bits();
        let block_nan_code = match format.special_values() {
            SpecialValues::NanOnly => 0x7f,
            SpecialValues::Ieee => 0x7e,
            _ => 0,
        };
        let (emin, bias) = (format.emin().unwrap_or(0), format.bias().unwrap_or(0));
        Codec {
            is_int: format.is_int(),
            emax: format.emax(),
            block_nan_code,
            storage_bits: format.storage_bits(),
            sign_shift: bits - 1,
            shift: 23 - m.min(23),
            max_bits,
            min_normal_bits: pow2(emin).to_bits(),
            rebias: ((127 - bias) as u32) << m,
            magic: pow2(emin + 23 - m as i32),
            sub_scale: pow2(m as i32 - emin),
            int_scale: pow2(format.int_frac_bits().unwrap_or(0) as i32),
            int_mask: (1u32 << bits) - 1,
        }
    }

    /// Encodes `x[i] * inv` into `out[i]` (finite inputs; NaN blocks never get here).
    /// `inv` is a power of two, so the product is exact (see the module docs).
    #[inline(always)]
    pub(crate) fn encode_slice(&self, rounding: Rounding, inv: f32, x: &[f32], out: &mut [u8]) {
        match (self.is_int, rounding) {
            (false, Rounding::NearestEven) => self.encode_float::<false>(inv, x, out),
            (false, Rounding::NearestAway) => self.encode_float::<true>(inv, x, out),
            (true, Rounding::NearestEven) => self.encode_int::<false>(inv, x, out),
            (true, Rounding::NearestAway) => self.encode_int::<true>(inv, x, out),
        }
    }

    /// Float elements: bit arithmetic for normals, one float add for subnormals.
    #[inline(always)]
    fn encode_float<const AWAY: bool>(&self, inv: f32, x: &[f32], out: &mut [u8]) {
        let (sign_shift, shift, max) = (self.sign_shift, self.shift, f32::from_bits(self.max_bits));
        let (min_normal, rebias) = (self.min_normal_bits as i32, self.rebias as i32);
        let (magic, magic_bits, sub_scale) =
            (self.magic, self.magic.to_bits() as i32, self.sub_scale);
        let half = 1i32 << (shift - 1);
        for (o, &v) in out.iter_mut().zip(x) {
            let b = (v * inv).to_bits();
            let sign = ((b >> 31) << sign_shift) as i32;
            // Clamping the magnitude first saturates: max_normal lies on the element grid.
            // (A float compare-select is one `minps`; no NaN reaches here.)
            let m = f32::from_bits(b & 0x7fff_ffff);
            let a = (if m < max { m } else { max }).to_bits() as i32;
            let normal = if AWAY {
                ((a + half) >> shift) - rebias
            } else {
                ((a + (half - 1) + ((a >> shift) & 1)) >> shift) - rebias
            };
            let sub = if AWAY {
                // exact: y <= 2^man_bits and the RNE result differ by at most 1/2
                let y = f32::from_bits(a as u32) * sub_scale;
                let k = (y + 8_388_608.0).to_bits() as i32 - 0x4b00_0000;
                k + i32::from(y - k as f32 == 0.5)
            } else {
                (f32::from_bits(a as u32) + magic).to_bits() as i32 - magic_bits
            };
            let mag = if a >= min_normal { normal } else { sub };
            *o = (sign | mag) as u8;
        }
    }

    /// Integer elements: `round(x * 2^frac)`, clamped to the symmetric range.
    #[inline(always)]
    fn encode_int<const AWAY: bool>(&self, inv: f32, x: &[f32], out: &mut [u8]) {
        let (max, scale, mask) = (
            f32::from_bits(self.max_bits),
            self.int_scale,
            self.int_mask as i32,
        );
        for (o, &v) in out.iter_mut().zip(x) {
            let b = (v * inv).to_bits();
            let m = f32::from_bits(b & 0x7fff_ffff);
            let y = (if m < max { m } else { max }) * scale; // exact, <= 2^(bits-1) - 1
            let mut k = (y + 8_388_608.0).to_bits() as i32 - 0x4b00_0000;
            if AWAY {
                k += i32::from(y - k as f32 == 0.5);
            }
            let k = if b >> 31 == 1 { -k } else { k };
            *o = (k & mask) as u8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_formats() -> Vec<MxFormat> {
        let mut f = MxFormat::OCP.to_vec();
        for e in 1..=7 {
            for m in 0..=(7 - e) {
                f.push(MxFormat::custom_float(e, m).unwrap());
            }
        }
        for b in 2..=8 {
            f.push(MxFormat::custom_int(b).unwrap());
        }
        f
    }

    #[test]
    fn pow2_and_exponent_of_are_exact() {
        for e in -149..=127 {
            let p = pow2(e);
            assert_eq!(f64::from(p), 2f64.powi(e), "2^{e}");
            assert_eq!(exponent_of(p), e);
        }
        assert_eq!(exponent_of(f32::MAX), 127);
        assert_eq!(exponent_of(f32::from_bits(3)), -148);
    }

    #[test]
    fn every_finite_code_encodes_to_itself() {
        for f in all_formats() {
            for code in 0..(1u32 << f.bits()) {
                let v = f.decode(code as u8);
                if v.is_nan() || v.is_infinite() {
                    continue;
                }
                // The most negative integer code (-2.0 for INT8) decodes but is never produced:
                // the encoder clamps to the symmetric range.
                if f.is_int() && v < -f.max_normal() {
                    assert_eq!(f.encode(v), f.encode(-f.max_normal()));
                    continue;
                }
                let want = code as u8;
                for r in [Rounding::NearestEven, Rounding::NearestAway] {
                    assert_eq!(f.encode_with(v, r), Some(want), "{f} code {code:#x} = {v}");
                }
            }
        }
    }

    #[test]
    fn midpoints_round_to_even_or_away() {
        for f in all_formats().into_iter().filter(|f| !f.is_int()) {
            let table = f.decode_table();
            let half = 1usize << (f.bits() - 1); // positive codes
            for c in 0..half - 1 {
                let (lo, hi) = (table[c], table[c + 1]);
                if !(lo.is_finite() && hi.is_finite()) {
                    continue;
                }
                let mid = f64::midpoint(f64::from(lo), f64::from(hi)) as f32;
                let even = if c % 2 == 0 { c } else { c + 1 };
                assert_eq!(f.encode(mid), Some(even as u8), "{f}: {lo}..{hi}");
                assert_eq!(
                    f.encode_with(mid, Rounding::NearestAway),
                    Some(c as u8 + 1),
                    "{f}"
                );
                assert_eq!(f.encode(-mid), Some((even | half) as u8), "{f}: -{mid}");
            }
        }
    }

    #[test]
    fn widths_and_storage() {
        for f in all_formats() {
            assert!(f.bits() <= 8 && f.bits() >= 2, "{f}");
            assert!(f.storage_bits() >= f.bits() && [4, 6, 8].contains(&f.storage_bits()));
            assert!(f.max_normal() < pow2(f.emax() + 1) && f.max_normal() >= pow2(f.emax()));
        }
    }
}
