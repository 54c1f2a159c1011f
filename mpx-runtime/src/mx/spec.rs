//! [`MxSpec`]: an element format, a block size, a tie rule and a scale width.

use std::fmt;

use super::element::{MxFormat, Rounding};
use super::error::MxError;

/// What to quantize to: an element format, the block size, the tie rule and the width of the
/// shared scale's exponent. Always valid: the setters that can fail return a `Result`.
///
/// Defaults: block size 32 (the OCP formats'), [`Rounding::NearestEven`], 8 scale exponent bits
/// (E8M0).
///
/// # Examples
/// ```
/// use mpx_runtime::mx::{MxFormat, MxSpec, Rounding};
/// let spec = MxSpec::new(MxFormat::Fp4E2M1)
///     .with_block_size(16)?
///     .with_rounding(Rounding::NearestAway);
/// assert_eq!((spec.block_size(), spec.format()), (16, MxFormat::Fp4E2M1));
/// assert!(MxSpec::new(MxFormat::Int8).with_scale_exp_bits(0).is_err());
/// # Ok::<(), mpx_runtime::mx::MxError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MxSpec {
    format: MxFormat,
    block_size: usize,
    rounding: Rounding,
    scale_exp_bits: u32,
}

impl fmt::Display for MxSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}, block {}", self.format, self.block_size)?;
        if self.rounding == Rounding::NearestAway {
            write!(f, ", ties away")?;
        }
        if self.scale_exp_bits != 8 {
            write!(f, ", E{}M0 scale", self.scale_exp_bits)?;
        }
        Ok(())
    }
}

impl MxSpec {
    /// The OCP block size.
    pub const DEFAULT_BLOCK_SIZE: usize = 32;

    /// `format` with the defaults: block size 32, ties to even, E8M0 scales.
    pub fn new(format: MxFormat) -> MxSpec {
        MxSpec {
            format,
            block_size: Self::DEFAULT_BLOCK_SIZE,
            rounding: Rounding::NearestEven,
            scale_exp_bits: 8,
        }
    }

    /// Sets the block size: any size >= 1 (blocks run along the last axis; a row whose length is
    /// not a multiple ends in a short block).
    ///
    /// # Errors
    /// [`MxError::ZeroBlockSize`] for a block size of 0.
    pub fn with_block_size(mut self, block_size: usize) -> Result<MxSpec, MxError> {
        if block_size == 0 {
            return Err(MxError::ZeroBlockSize);
        }
        self.block_size = block_size;
        Ok(self)
    }

    /// Sets the tie rule.
    #[must_use]
    pub fn with_rounding(mut self, rounding: Rounding) -> MxSpec {
        self.rounding = rounding;
        self
    }

    /// Sets the shared scale's exponent width `k` (pychop's `scale_exp_bits`): an `E<k>M0` power of
    /// two with bias `2^(k-1) - 1`, shared exponents in `[-bias, bias]`, code `2^k - 1` = NaN.
    /// Exponents below the range clamp to `-bias`; above it the block is NaN (as microxcaling;
    /// pychop saturates). Allowed: `1..=8`; 8 is the OCP E8M0 scale.
    ///
    /// # Errors
    /// [`MxError::ScaleExpBits`] outside `1..=8`.
    pub fn with_scale_exp_bits(mut self, bits: u32) -> Result<MxSpec, MxError> {
        if bits == 0 || bits > 8 {
            return Err(MxError::ScaleExpBits(bits));
        }
        self.scale_exp_bits = bits;
        Ok(self)
    }

    /// The element format.
    pub fn format(&self) -> MxFormat {
        self.format
    }

    /// Elements per block (along the last axis).
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The tie rule.
    pub fn rounding(&self) -> Rounding {
        self.rounding
    }

    /// Exponent bits of the shared scale (8 = E8M0).
    pub fn scale_exp_bits(&self) -> u32 {
        self.scale_exp_bits
    }

    /// Bias of the shared scale: 127 for E8M0.
    pub fn scale_bias(&self) -> i32 {
        (1i32 << (self.scale_exp_bits - 1)) - 1
    }

    /// Storage cost in bits per element for blocks of full length: element bits plus one scale
    /// byte per block.
    pub fn bits_per_element(&self) -> f64 {
        f64::from(self.format.storage_bits()) + 8.0 / self.block_size as f64
    }
}
