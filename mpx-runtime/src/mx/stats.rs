//! Statistics of a quantized tensor, format comparisons and the table of formats (pychop's
//! `get_statistics`, `compare_mx_formats` and `print_mx_format_table`, as Display tables).

use std::fmt;

use super::element::MxFormat;
use super::error::MxError;
use super::spec::MxSpec;
use super::tensor::MxTensor;

/// Storage cost and error of one quantized tensor against its original data, from
/// [`MxTensor::statistics`].
///
/// Errors (MSE, max absolute error, SQNR) are measured over the elements of the blocks that are
/// not NaN; NaN blocks (a NaN or an Inf in the block) are counted in
/// [`nan_blocks`](MxStatistics::nan_blocks) instead, since every value in them is NaN.
#[derive(Debug, Clone, PartialEq)]
pub struct MxStatistics {
    /// The spec the tensor was quantized with.
    pub spec: MxSpec,
    /// Number of elements.
    pub elements: usize,
    /// Number of blocks (= scale bytes).
    pub blocks: usize,
    /// Storage bits per element: element bits plus the scale bytes spread over the elements
    /// (short blocks and the last byte's padding included).
    pub bits_per_element: f64,
    /// `16 / bits_per_element`.
    pub compression_vs_f16: f64,
    /// `32 / bits_per_element`.
    pub compression_vs_f32: f64,
    /// Mean squared error over the elements of non-NaN blocks (0 if there are none).
    pub mse: f64,
    /// Largest absolute error over the elements of non-NaN blocks.
    pub max_abs_error: f64,
    /// Signal-to-quantization-noise ratio in dB, `10 log10(sum x^2 / sum err^2)` over the same
    /// elements (infinite when the error is 0, NaN when the data is all zero).
    pub sqnr_db: f64,
    /// Blocks whose scale is NaN.
    pub nan_blocks: usize,
}

impl MxTensor {
    /// Storage and error statistics against `original`, the data this tensor was quantized
    /// from (the tensor keeps no copy of it).
    ///
    /// # Errors
    /// [`MxError::OriginalLength`] when `original` does not have [`len`](MxTensor::len) elements.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::mx::{MxFormat, MxSpec, MxTensor};
    /// let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
    /// let t = MxTensor::quantize(&x, &[2, 32], &MxSpec::new(MxFormat::Fp8E4M3))?;
    /// let s = t.statistics(&x)?;
    /// assert_eq!(s.bits_per_element, 8.25); // 8 bits + one scale byte per 32 elements
    /// // a block max just under 1 is 1.99 * 2^-1: it saturates to 448 * 2^-9 = 0.875
    /// assert!(s.max_abs_error <= 0.125 && s.nan_blocks == 0);
    /// println!("{s}");
    /// # Ok::<(), mpx_runtime::mx::MxError>(())
    /// ```
    pub fn statistics(&self, original: &[f32]) -> Result<MxStatistics, MxError> {
        if original.len() != self.len() {
            return Err(MxError::OriginalLength {
                expected: self.len(),
                found: original.len(),
            });
        }
        let deq = self.dequantize();
        let (mut sq_err, mut sq_sig, mut max_err, mut counted) = (0.0f64, 0.0f64, 0.0f64, 0usize);
        for (&x, &y) in original.iter().zip(&deq) {
            if y.is_nan() {
                continue; // a NaN block
            }
            let e = f64::from(x) - f64::from(y);
            sq_err += e * e;
            sq_sig += f64::from(x) * f64::from(x);
            max_err = max_err.max(e.abs());
            counted += 1;
        }
        let n = self.len();
        let bits_per_element = if n == 0 {
            self.spec().bits_per_element()
        } else {
            self.storage_bytes() as f64 * 8.0 / n as f64
        };
        Ok(MxStatistics {
            spec: *self.spec(),
            elements: n,
            blocks: self.num_blocks(),
            bits_per_element,
            compression_vs_f16: 16.0 / bits_per_element,
            compression_vs_f32: 32.0 / bits_per_element,
            mse: if counted == 0 {
                0.0
            } else {
                sq_err / counted as f64
            },
            max_abs_error: max_err,
            sqnr_db: 10.0 * (sq_sig / sq_err).log10(),
            nan_blocks: self.nan_blocks(),
        })
    }
}

impl fmt::Display for MxStatistics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rows = [
            ("spec", self.spec.to_string()),
            ("elements", self.elements.to_string()),
            ("blocks", self.blocks.to_string()),
            ("bits per element", format!("{:.3}", self.bits_per_element)),
            (
                "compression vs f16",
                format!("{:.2}x", self.compression_vs_f16),
            ),
            (
                "compression vs f32",
                format!("{:.2}x", self.compression_vs_f32),
            ),
            ("MSE", format!("{:.4e}", self.mse)),
            ("max abs error", format!("{:.4e}", self.max_abs_error)),
            ("SQNR", format!("{:.2} dB", self.sqnr_db)),
            ("NaN blocks", self.nan_blocks.to_string()),
        ];
        for (k, v) in rows {
            writeln!(f, "{k:<19} {v}")?;
        }
        Ok(())
    }
}

/// The statistics of one data set under several specs, from [`compare_formats`]; prints as a
/// table.
#[derive(Debug, Clone, PartialEq)]
pub struct FormatComparison {
    /// One row per spec, in the order given.
    pub rows: Vec<MxStatistics>,
}

/// Quantizes `data` (row-major contents of `shape`) with each spec and collects the
/// [`MxStatistics`]; print the result for a table.
///
/// # Errors
/// [`MxError::ShapeMismatch`] when `shape` does not hold `data.len()` elements;
/// [`MxError::ShapeOverflow`] when its element count overflows `usize`.
///
/// # Examples
/// ```
/// use mpx_runtime::mx::{compare_formats, MxFormat, MxSpec};
/// let x: Vec<f32> = (0..256).map(|i| (i as f32 * 0.1).cos() * 3.0).collect();
/// let specs: Vec<MxSpec> = MxFormat::OCP.iter().map(|&f| MxSpec::new(f)).collect();
/// let table = compare_formats(&x, &[8, 32], &specs)?;
/// let fp8 = &table.rows[1];
/// let fp4 = &table.rows[4];
/// assert!(fp8.mse < fp4.mse);
/// println!("{table}");
/// # Ok::<(), mpx_runtime::mx::MxError>(())
/// ```
pub fn compare_formats(
    data: &[f32],
    shape: &[usize],
    specs: &[MxSpec],
) -> Result<FormatComparison, MxError> {
    let rows = specs
        .iter()
        .map(|spec| MxTensor::quantize(data, shape, spec)?.statistics(data))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(FormatComparison { rows })
}

impl fmt::Display for FormatComparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let header = [
            "format",
            "block",
            "bits/elem",
            "vs f16",
            "vs f32",
            "MSE",
            "max abs err",
            "SQNR dB",
            "NaN blocks",
        ];
        let rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|s| {
                vec![
                    s.spec.format().name(),
                    s.spec.block_size().to_string(),
                    format!("{:.3}", s.bits_per_element),
                    format!("{:.2}x", s.compression_vs_f16),
                    format!("{:.2}x", s.compression_vs_f32),
                    format!("{:.3e}", s.mse),
                    format!("{:.3e}", s.max_abs_error),
                    format!("{:.2}", s.sqnr_db),
                    s.nan_blocks.to_string(),
                ]
            })
            .collect();
        write_table(f, &header, &rows)
    }
}

/// A table of element formats and their constants; prints aligned. See [`format_table`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormatTable {
    /// The formats, one per row.
    pub formats: Vec<MxFormat>,
}

/// The table of `formats` (bits, exponent/mantissa bits, bias, emax, range, special values,
/// storage bits); `format_table(&MxFormat::OCP)` lists the six OCP formats.
///
/// # Examples
/// ```
/// use mpx_runtime::mx::{format_table, MxFormat};
/// let text = format_table(&MxFormat::OCP).to_string();
/// assert!(text.lines().any(|l| l.starts_with("MXFP8 E4M3") && l.contains("448")));
/// println!("{text}");
/// ```
pub fn format_table(formats: &[MxFormat]) -> FormatTable {
    FormatTable {
        formats: formats.to_vec(),
    }
}

impl fmt::Display for FormatTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let header = [
            "format",
            "bits",
            "E",
            "M",
            "bias",
            "emax",
            "max normal",
            "min normal",
            "min subnormal",
            "special values",
            "stored bits",
        ];
        let rows: Vec<Vec<String>> = self
            .formats
            .iter()
            .map(|m| {
                vec![
                    m.name(),
                    m.bits().to_string(),
                    m.exp_bits().to_string(),
                    m.man_bits().to_string(),
                    m.bias().map_or("-".into(), |b| b.to_string()),
                    m.emax().to_string(),
                    number(m.max_normal()),
                    number(m.min_normal()),
                    number(m.min_subnormal()),
                    format!("{:?}", m.special_values()),
                    m.storage_bits().to_string(),
                ]
            })
            .collect();
        write_table(f, &header, &rows)
    }
}

/// Plain notation for moderate magnitudes, scientific otherwise.
fn number(x: f32) -> String {
    if x == 0.0 || (1e-3..1e6).contains(&x.abs()) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

/// Writes an aligned table: first column left-aligned, the others right-aligned.
fn write_table(f: &mut fmt::Formatter<'_>, header: &[&str], rows: &[Vec<String>]) -> fmt::Result {
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |f: &mut fmt::Formatter<'_>, cells: &mut dyn Iterator<Item = &str>| -> fmt::Result {
        for (i, (cell, w)) in cells.zip(&width).enumerate() {
            if i == 0 {
                write!(f, "{cell:<w$}")?;
            } else {
                write!(f, "  {cell:>w$}")?;
            }
        }
        writeln!(f)
    };
    line(f, &mut header.iter().copied())?;
    let total = width.iter().sum::<usize>() + 2 * (width.len().saturating_sub(1));
    writeln!(f, "{}", "-".repeat(total))?;
    for row in rows {
        line(f, &mut row.iter().map(String::as_str))?;
    }
    Ok(())
}
