//! [`MxTensor`]: a quantized tensor in packed storage, and [`quantize_dequantize`].

use super::block::{Kernel, Layout, for_row_ranges};
use super::element::MxFormat;
use super::element::Rounding;
use super::error::MxError;
use super::packing::{packed_len, unpack};
use super::scale::ScaleCodec;
use super::spec::MxSpec;

/// A tensor quantized to an MX format: one scale code per block (one byte each) and the element
/// codes packed at 4, 6 or 8 bits.
///
/// Blocks run along the last axis: row `r` of a shape `[.., n]` holds `ceil(n / k)` blocks, the
/// last one short when `n` is not a multiple of the block size `k`. A scalar shape `[]` is one row
/// of one element.
///
/// # Examples
/// ```
/// use mpx_runtime::mx::{MxFormat, MxSpec, MxTensor};
/// let spec = MxSpec::new(MxFormat::Fp4E2M1).with_block_size(4)?;
/// let x = [0.0, 1.0, -2.5, 6.1, /* next row */ 100.0, 3.0, 1.0, f32::NAN];
/// let t = MxTensor::quantize(&x, &[2, 4], &spec)?;
/// // row 0: max 6.1 -> shared exponent 2 - emax 2 = 0 -> scale 2^0 (code 127)
/// // row 1: a NaN -> NaN scale (0xFF), the whole block is NaN
/// assert_eq!(t.scale_codes(), &[127, 255]);
/// assert_eq!(&t.element_codes()[..4], &[0x0, 0x2, 0xC, 0x7]); // 0, 1, -2 (tie to even), 6
/// let y = t.dequantize();
/// assert_eq!(&y[..4], &[0.0, 1.0, -2.0, 6.0]);
/// assert!(y[4..].iter().all(|v| v.is_nan()));
/// assert_eq!(t.packed_elements().len(), 4); // 8 elements x 4 bits
/// # Ok::<(), mpx_runtime::mx::MxError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MxTensor {
    shape: Vec<usize>,
    spec: MxSpec,
    layout: Layout,
    scales: Vec<u8>,
    elements: Vec<u8>,
}

/// Threads to use: `0` means all available.
pub(crate) fn thread_count(threads: usize) -> usize {
    if threads == 0 {
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
    } else {
        threads
    }
}

impl MxTensor {
    /// Quantizes `data`, the row-major contents of `shape`, single-threaded.
    ///
    /// # Errors
    /// [`MxError::ShapeMismatch`] when `shape` does not hold `data.len()` elements;
    /// [`MxError::ShapeOverflow`] when its element count overflows `usize`.
    pub fn quantize(data: &[f32], shape: &[usize], spec: &MxSpec) -> Result<MxTensor, MxError> {
        Self::quantize_threads(data, shape, spec, 1)
    }

    /// [`quantize`](MxTensor::quantize) on up to `threads` scoped threads (`0` = all available
    /// cores), split by rows. The threads are capped at the rows and at
    /// [`std::thread::available_parallelism`], so any count is safe to pass. The result is
    /// identical for any thread count.
    ///
    /// # Errors
    /// [`MxError::ShapeMismatch`] when `shape` does not hold `data.len()` elements;
    /// [`MxError::ShapeOverflow`] when its element count overflows `usize`.
    pub fn quantize_threads(
        data: &[f32],
        shape: &[usize],
        spec: &MxSpec,
        threads: usize,
    ) -> Result<MxTensor, MxError> {
        let layout = Layout::new(shape, spec.block_size(), Some(data.len()))?;
        let mut t = MxTensor {
            shape: shape.to_vec(),
            spec: *spec,
            layout,
            scales: vec![0; layout.num_blocks()],
            elements: vec![0; packed_len(layout.len(), spec.format().storage_bits())],
        };
        t.requantize(data, threads)?;
        Ok(t)
    }

    /// Quantizes new `data` of the same shape into this tensor's storage, without allocating.
    /// `threads` as in [`quantize_threads`](MxTensor::quantize_threads).
    ///
    /// # Errors
    /// [`MxError::ShapeMismatch`] when `data` does not have [`len`](MxTensor::len) elements
    /// (nothing is written).
    pub fn requantize(&mut self, data: &[f32], threads: usize) -> Result<(), MxError> {
        if data.len() != self.layout.len() {
            return Err(MxError::ShapeMismatch {
                shape: self.shape.clone(),
                expected: self.layout.len(),
                found: data.len(),
            });
        }
        let kernel = Kernel::new(&self.spec);
        let bits = kernel.codec.storage_bits;
        for_row_ranges(
            self.layout,
            bits,
            thread_count(threads),
            data,
            &mut self.scales[..],
            &mut self.elements[..],
            |layout, x, s, e| kernel.quantize_rows(layout, x, s, e),
        );
        Ok(())
    }

    /// Builds a tensor from codes: one scale code per block (row-major by block) and one element
    /// code per element (row-major, in the low bits).
    ///
    /// # Errors
    /// [`MxError::Length`] on a wrong number of scale or element codes;
    /// [`MxError::CodeOutOfRange`] on an element code wider than the format or a scale code past
    /// the scale's NaN code; [`MxError::ShapeOverflow`] when the shape's element count overflows.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::mx::{MxFormat, MxSpec, MxTensor};
    /// let spec = MxSpec::new(MxFormat::Fp8E5M2);
    /// let t = MxTensor::from_codes(&[2], &spec, vec![127 + 3], &[0x3C, 0x7C])?;
    /// assert_eq!(t.dequantize(), vec![8.0, f32::INFINITY]); // 1.0 * 2^3, Inf * 2^3
    /// assert!(MxTensor::from_codes(&[2], &spec, vec![127], &[0x3C]).is_err());
    /// # Ok::<(), mpx_runtime::mx::MxError>(())
    /// ```
    pub fn from_codes(
        shape: &[usize],
        spec: &MxSpec,
        scale_codes: Vec<u8>,
        element_codes: &[u8],
    ) -> Result<MxTensor, MxError> {
        let layout = Layout::new(shape, spec.block_size(), None)?;
        if scale_codes.len() != layout.num_blocks() {
            return Err(MxError::Length {
                what: "scale codes",
                expected: layout.num_blocks(),
                found: scale_codes.len(),
            });
        }
        if element_codes.len() != layout.len() {
            return Err(MxError::Length {
                what: "element codes",
                expected: layout.len(),
                found: element_codes.len(),
            });
        }
        check_scale_codes(spec, &scale_codes)?;
        let format = spec.format();
        let limit = 1u32 << format.bits();
        if let Some(i) = element_codes.iter().position(|&c| u32::from(c) >= limit) {
            return Err(MxError::CodeOutOfRange {
                what: "element",
                index: i,
                code: element_codes[i],
                limit,
            });
        }
        let bits = format.storage_bits();
        let mut elements = vec![0; packed_len(layout.len(), bits)];
        super::packing::pack(bits, element_codes, &mut elements);
        Ok(MxTensor {
            shape: shape.to_vec(),
            spec: *spec,
            layout,
            scales: scale_codes,
            elements,
        })
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The spec it was quantized with.
    pub fn spec(&self) -> &MxSpec {
        &self.spec
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.layout.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.layout.len() == 0
    }

    /// Number of blocks (= scale codes).
    pub fn num_blocks(&self) -> usize {
        self.scales.len()
    }

    /// The scale codes (E8M0 with the default spec), one per block, row-major by block.
    pub fn scale_codes(&self) -> &[u8] {
        &self.scales
    }

    /// The scale of each block as an f32 (`2^shared`, NaN for NaN blocks).
    pub fn scale_values(&self) -> Vec<f32> {
        let sc = ScaleCodec::new(&self.spec);
        self.scales.iter().map(|&c| sc.value(c)).collect()
    }

    /// One element code per element, row-major, in the low bits of each byte.
    pub fn element_codes(&self) -> Vec<u8> {
        let mut codes = vec![0; self.len()];
        unpack(
            self.spec.format().storage_bits(),
            &self.elements,
            &mut codes,
        );
        codes
    }

    /// The packed element codes (4, 6 or 8 bits each; see [`to_bytes`](MxTensor::to_bytes)).
    pub fn packed_elements(&self) -> &[u8] {
        &self.elements
    }

    /// Number of NaN blocks (blocks that held a NaN or an Inf).
    pub fn nan_blocks(&self) -> usize {
        let nan = ScaleCodec::new(&self.spec).nan_code;
        self.scales.iter().filter(|&&c| c >= nan).count()
    }

    /// Bytes of storage: one per block plus the packed elements (no header).
    pub fn storage_bytes(&self) -> usize {
        self.scales.len() + self.elements.len()
    }

    /// The values: element value times its block's scale, exact in f32 for every tensor the
    /// quantizer produces; NaN blocks give NaN.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.decode_into(&mut out, 1);
        out
    }

    /// [`dequantize`](MxTensor::dequantize) into `out` (no allocation) on up to `threads` scoped
    /// threads (`0` = all available cores), capped as in
    /// [`quantize_threads`](MxTensor::quantize_threads).
    ///
    /// # Errors
    /// [`MxError::OutputLength`] when `out` does not have [`len`](MxTensor::len) elements.
    pub fn dequantize_into(&self, out: &mut [f32], threads: usize) -> Result<(), MxError> {
        if out.len() != self.len() {
            return Err(MxError::OutputLength {
                expected: self.len(),
                found: out.len(),
            });
        }
        self.decode_into(out, thread_count(threads));
        Ok(())
    }

    fn decode_into(&self, out: &mut [f32], threads: usize) {
        let kernel = Kernel::new(&self.spec);
        for_row_ranges(
            self.layout,
            kernel.codec.storage_bits,
            threads,
            out,
            &self.scales[..],
            &self.elements[..],
            |layout, o, s, e| kernel.dequantize_rows(layout, s, e, o),
        );
    }

    /// Serializes: a header (magic `MXT1`, format, rounding, scale width, block size, shape),
    /// then one byte per block, then the packed elements. All integers little-endian.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::mx::{MxFormat, MxSpec, MxTensor};
    /// let spec = MxSpec::new(MxFormat::Fp6E3M2);
    /// let t = MxTensor::quantize(&[1.0, -0.3, 7.0], &[3], &spec)?;
    /// let bytes = t.to_bytes();
    /// assert_eq!(MxTensor::from_bytes(&bytes)?, t);
    /// assert!(MxTensor::from_bytes(&bytes[..bytes.len() - 1]).is_err());
    /// # Ok::<(), mpx_runtime::mx::MxError>(())
    /// ```
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(HEADER_FIXED + 8 * self.shape.len() + self.storage_bytes());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&spec_bytes(&self.spec));
        out.extend_from_slice(&(self.spec.block_size() as u64).to_le_bytes());
        out.extend_from_slice(&(self.shape.len() as u32).to_le_bytes());
        for &d in &self.shape {
            out.extend_from_slice(&(d as u64).to_le_bytes());
        }
        out.extend_from_slice(&self.scales);
        out.extend_from_slice(&self.elements);
        out
    }

    /// Reads what [`to_bytes`](MxTensor::to_bytes) wrote, and only that: every accepted input is
    /// canonical, `from_bytes(b)?.to_bytes() == b`.
    ///
    /// # Errors
    /// (never panics) a wrong magic, an invalid spec (unknown format, bad widths, block size 0), a
    /// header `to_bytes` never writes ([`MxError::BadHeader`]: non-zero reserved bytes, non-zero
    /// unused format fields, a custom float with 0 exponent bits), a shape whose element count
    /// overflows, a wrong total length, out-of-range codes or non-zero padding bits.
    pub fn from_bytes(bytes: &[u8]) -> Result<MxTensor, MxError> {
        if bytes.len() < HEADER_FIXED {
            return Err(MxError::Length {
                what: "header",
                expected: HEADER_FIXED,
                found: bytes.len(),
            });
        }
        if &bytes[..4] != MAGIC {
            return Err(MxError::BadHeader(format!(
                "magic {:?}, expected {:?}",
                &bytes[..4],
                MAGIC
            )));
        }
        let h = &bytes[4..12];
        let format = match h[0] {
            0 => MxFormat::Fp8E4M3,
            1 => MxFormat::Fp8E5M2,
            2 => MxFormat::Fp6E3M2,
            3 => MxFormat::Fp6E2M3,
            4 => MxFormat::Fp4E2M1,
            5 => MxFormat::Int8,
            6 => MxFormat::custom_float(u32::from(h[1]), u32::from(h[2]))?,
            7 => MxFormat::custom_int(u32::from(h[1]))?,
            k => {
                return Err(MxError::BadHeader(format!(
                    "format kind {k}, expected 0..=7"
                )));
            }
        };
        let rounding = match h[3] {
            0 => Rounding::NearestEven,
            1 => Rounding::NearestAway,
            r => return Err(MxError::BadHeader(format!("rounding {r}, expected 0 or 1"))),
        };
        let block = u64::from_le_bytes(read8(&bytes[12..20]));
        let block = usize::try_from(block)
            .map_err(|_| MxError::BadHeader(format!("block size {block} does not fit usize")))?;
        let spec = MxSpec::new(format)
            .with_rounding(rounding)
            .with_scale_exp_bits(u32::from(h[4]))?
            .with_block_size(block)?;
        check_canonical_spec(h, &spec)?;
        let ndim = u32::from_le_bytes([bytes[20], bytes[21], bytes[22], bytes[23]]) as usize;
        let dims_end = ndim
            .checked_mul(8)
            .and_then(|d| d.checked_add(HEADER_FIXED))
            .filter(|&end| end <= bytes.len())
            .ok_or(MxError::Length {
                what: "header",
                expected: HEADER_FIXED.saturating_add(ndim.saturating_mul(8)),
                found: bytes.len(),
            })?;
        let shape = bytes[HEADER_FIXED..dims_end]
            .chunks_exact(8)
            .map(|c| {
                let d = u64::from_le_bytes(read8(c));
                usize::try_from(d)
                    .map_err(|_| MxError::BadHeader(format!("dimension {d} does not fit usize")))
            })
            .collect::<Result<Vec<usize>, MxError>>()?;
        let layout = Layout::new(&shape, block, None)?;
        let bits = format.storage_bits();
        let nelem = packed_len(layout.len(), bits);
        let expected = dims_end
            .checked_add(layout.num_blocks())
            .and_then(|v| v.checked_add(nelem))
            .unwrap_or(usize::MAX);
        if bytes.len() != expected {
            return Err(MxError::Length {
                what: "packed tensor",
                expected,
                found: bytes.len(),
            });
        }
        let scales = bytes[dims_end..dims_end + layout.num_blocks()].to_vec();
        let elements = bytes[dims_end + layout.num_blocks()..].to_vec();
        check_scale_codes(&spec, &scales)?;
        let t = MxTensor {
            shape,
            spec,
            layout,
            scales,
            elements,
        };
        let limit = 1u32 << format.bits();
        if limit < 1 << bits
            && let Some((i, &c)) = t
                .element_codes()
                .iter()
                .enumerate()
                .find(|(_, c)| u32::from(**c) >= limit)
        {
            return Err(MxError::CodeOutOfRange {
                what: "element",
                index: i,
                code: c,
                limit,
            });
        }
        let used = (layout.len() % 8) * bits as usize % 8;
        if used != 0 && t.elements.last().is_some_and(|&b| b >> used != 0) {
            return Err(MxError::BadHeader(
                "non-zero padding bits after the last element".into(),
            ));
        }
        Ok(t)
    }
}

const MAGIC: &[u8; 4] = b"MXT1";
/// Magic (4), format/rounding/scale (8), block size (8), ndim (4).
const HEADER_FIXED: usize = 24;

/// The 8 header bytes after the magic: format kind, its two parameters (0 where unused),
/// rounding, scale exponent width, and 3 reserved zero bytes.
fn spec_bytes(spec: &MxSpec) -> [u8; 8] {
    let (kind, a, b) = match spec.format() {
        MxFormat::Fp8E4M3 => (0u8, 0u8, 0u8),
        MxFormat::Fp8E5M2 => (1, 0, 0),
        MxFormat::Fp6E3M2 => (2, 0, 0),
        MxFormat::Fp6E2M3 => (3, 0, 0),
        MxFormat::Fp4E2M1 => (4, 0, 0),
        MxFormat::Int8 => (5, 0, 0),
        MxFormat::CustomFloat(c) => (6, c.exp_bits() as u8, c.man_bits() as u8),
        MxFormat::CustomInt(c) => (7, c.bits() as u8, 0),
    };
    let rounding = match spec.rounding() {
        Rounding::NearestEven => 0u8,
        Rounding::NearestAway => 1,
    };
    [kind, a, b, rounding, spec.scale_exp_bits() as u8, 0, 0, 0]
}

/// Errors unless `header` (bytes 4..12) is exactly what [`spec_bytes`] writes for the spec read
/// from it, naming the first byte that differs.
fn check_canonical_spec(header: &[u8], spec: &MxSpec) -> Result<(), MxError> {
    let canonical = spec_bytes(spec);
    let Some(i) = header.iter().zip(&canonical).position(|(h, c)| h != c) else {
        return Ok(());
    };
    let field = match i {
        0 => "format kind",
        1 | 2 => "format parameter",
        3 => "rounding",
        4 => "scale exponent width",
        _ => "reserved byte",
    };
    Err(MxError::BadHeader(format!(
        "non-canonical {field} at byte {}: {:#04x}, but {} is written as {:#04x} \
         (unused format parameters and reserved bytes are 0; a custom float has at least 1 \
         exponent bit)",
        4 + i,
        header[i],
        spec.format(),
        canonical[i]
    )))
}

fn read8(b: &[u8]) -> [u8; 8] {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    a
}

fn check_scale_codes(spec: &MxSpec, scales: &[u8]) -> Result<(), MxError> {
    let nan = ScaleCodec::new(spec).nan_code;
    if let Some(i) = scales.iter().position(|&c| c > nan) {
        return Err(MxError::CodeOutOfRange {
            what: "scale",
            index: i,
            code: scales[i],
            limit: u32::from(nan) + 1,
        });
    }
    Ok(())
}

/// Quantizes `data` (the row-major contents of `shape`) to `spec` and back, in one pass without
/// packing: what [`MxTensor::quantize`] then [`MxTensor::dequantize`] return, faster.
///
/// # Errors
/// [`MxError::ShapeMismatch`] when `shape` does not hold `data.len()` elements;
/// [`MxError::ShapeOverflow`] when its element count overflows `usize`.
///
/// # Examples
/// ```
/// use mpx_runtime::mx::{quantize_dequantize, MxFormat, MxSpec};
/// let spec = MxSpec::new(MxFormat::Fp8E4M3);
/// // max 255.99998 has exponent 7 (exact, no float log2): scale 2^(7-8), 255.99998*2 -> 448
/// let y = quantize_dequantize(&[255.99998, 1.0], &[2], &spec)?;
/// assert_eq!(y, vec![224.0, 1.0]);
/// # Ok::<(), mpx_runtime::mx::MxError>(())
/// ```
pub fn quantize_dequantize(
    data: &[f32],
    shape: &[usize],
    spec: &MxSpec,
) -> Result<Vec<f32>, MxError> {
    let layout = Layout::new(shape, spec.block_size(), Some(data.len()))?;
    let mut out = vec![0.0; data.len()];
    Kernel::new(spec).quantize_dequantize_rows(layout, data, &mut out);
    Ok(out)
}

/// [`quantize_dequantize`] into `out` (no allocation).
///
/// # Errors
/// [`MxError::ShapeMismatch`] when `shape` does not hold `data.len()` elements;
/// [`MxError::ShapeOverflow`] when its element count overflows `usize`;
/// [`MxError::OutputLength`] when `out` has another length than `data`.
///
/// # Examples
/// ```
/// use mpx_runtime::mx::{quantize_dequantize_into, MxFormat, MxSpec};
/// let mut out = [0.0; 3];
/// quantize_dequantize_into(&[0.1, 1.0, 3.3], &[3], &MxSpec::new(MxFormat::Int8), &mut out)?;
/// assert_eq!(out, [0.09375, 1.0, 3.3125]); // steps of 2^1 / 64: the block max 3.3 has exponent 1
/// # Ok::<(), mpx_runtime::mx::MxError>(())
/// ```
pub fn quantize_dequantize_into(
    data: &[f32],
    shape: &[usize],
    spec: &MxSpec,
    out: &mut [f32],
) -> Result<(), MxError> {
    let layout = Layout::new(shape, spec.block_size(), Some(data.len()))?;
    if out.len() != data.len() {
        return Err(MxError::OutputLength {
            expected: data.len(),
            found: out.len(),
        });
    }
    Kernel::new(spec).quantize_dequantize_rows(layout, data, out);
    Ok(())
}
