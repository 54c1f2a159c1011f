//! Block quantization kernels: blocks along the last axis, exact shared exponents, packed output.
//!
//! The hot loops work on f32 bits: the block max is an integer max of the magnitudes' bits
//! (NaN-propagating for free: NaN bits are above Inf's), the shared exponent is the max's exponent
//! field, scaling multiplies by an exact power of two, and elements are encoded with integer
//! rounding ([`Codec`]). No tables are searched, no float `log2` is taken and nothing is allocated
//! per block.
//!
//! On x86-64 CPUs with AVX2 the kernels run a copy compiled for AVX2, chosen at run time by
//! [`mpx_kernels::with_avx2`]: the row loops below and everything they call are
//! `#[inline(always)]`, so they are inlined into that copy ([`QuantizeRows`] and its siblings are
//! the tasks it runs). The portable build targets SSE2 only. Both compute the same bits.

use mpx_kernels::{Avx2Task, with_avx2};

use super::element::Rounding;
use super::element::{Codec, decode_table_256, pow2};
use super::error::MxError;
use super::packing::{pack, packed_len, unpack};
use super::scale::ScaleCodec;
use super::spec::MxSpec;

/// Codes staged per pack/unpack round (a multiple of 8, so every round ends on a byte).
const STAGE: usize = 1024;

/// How a shape splits into rows and blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Rows: the product of all axes but the last.
    pub(crate) rows: usize,
    /// Length of the last axis (1 for a scalar shape `[]`).
    pub(crate) cols: usize,
    /// Elements per block.
    pub(crate) block: usize,
    /// Blocks per row, the last one possibly short.
    pub(crate) blocks_per_row: usize,
}

impl Layout {
    /// The layout of `shape`; errors if its element count overflows `usize` or differs from
    /// `len` (when given).
    pub(crate) fn new(
        shape: &[usize],
        block: usize,
        len: Option<usize>,
    ) -> Result<Layout, MxError> {
        let expected = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| MxError::ShapeOverflow(shape.to_vec()))?;
        if let Some(found) = len.filter(|&l| l != expected) {
            return Err(MxError::ShapeMismatch {
                shape: shape.to_vec(),
                expected,
                found,
            });
        }
        let cols = shape.last().copied().unwrap_or(1);
        let rows = expected.checked_div(cols).unwrap_or(0);
        Ok(Layout {
            rows,
            cols,
            block,
            blocks_per_row: cols.div_ceil(block),
        })
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Number of blocks (= scale codes).
    pub(crate) fn num_blocks(&self) -> usize {
        self.rows * self.blocks_per_row
    }

    /// The same layout restricted to `rows` rows.
    fn with_rows(self, rows: usize) -> Layout {
        Layout { rows, ..self }
    }
}

/// Everything the kernels need for one spec.
pub(crate) struct Kernel {
    pub(crate) codec: Codec,
    /// Decoded value of every element code.
    table: [f32; 256],
    pub(crate) scale: ScaleCodec,
    pub(crate) rounding: Rounding,
}

impl Kernel {
    pub(crate) fn new(spec: &MxSpec) -> Kernel {
        Kernel {
            codec: Codec::new(spec.format()),
            table: decode_table_256(spec.format()),
            scale: ScaleCodec::new(spec),
            rounding: spec.rounding(),
        }
    }

    /// Scale code and the multiplier `2^-shared` (`None` for a NaN block) of block `x`.
    #[inline(always)]
    fn block_scale(&self, x: &[f32]) -> (u8, Option<f32>) {
        let amax = x
            .iter()
            .fold(0i32, |m, v| m.max((v.to_bits() & 0x7fff_ffff) as i32)) as u32;
        match self.scale.shared_exponent(amax, self.codec.emax) {
            Some(shared) => (self.scale.code(shared), Some(pow2(-shared))),
            None => (self.scale.nan_code, None),
        }
    }

    #[inline(always)]
    fn encode(&self, inv: Option<f32>, x: &[f32], out: &mut [u8]) {
        match inv {
            Some(inv) => self.codec.encode_slice(self.rounding, inv, x, out),
            None => out.fill(self.codec.block_nan_code),
        }
    }

    /// Quantizes `layout.rows` whole rows: `x` holds them, `scales` gets one code per block,
    /// `elems` the packed codes (it starts on the first element's byte).
    pub(crate) fn quantize_rows(
        &self,
        layout: Layout,
        x: &[f32],
        scales: &mut [u8],
        elems: &mut [u8],
    ) {
        with_avx2(QuantizeRows {
            kernel: self,
            layout,
            x,
            scales,
            elems,
        });
    }

    #[inline(always)]
    fn quantize_rows_impl(&self, layout: Layout, x: &[f32], scales: &mut [u8], elems: &mut [u8]) {
        let bits = self.codec.storage_bits;
        if layout.cols == 0 {
            return;
        }
        let mut si = 0;
        if bits == 8 {
            for (row, out) in x
                .chunks_exact(layout.cols)
                .zip(elems.chunks_exact_mut(layout.cols))
            {
                for (blk, o) in row.chunks(layout.block).zip(out.chunks_mut(layout.block)) {
                    let (code, inv) = self.block_scale(blk);
                    scales[si] = code;
                    si += 1;
                    self.encode(inv, blk, o);
                }
            }
            return;
        }
        let mut stage = [0u8; STAGE];
        let mut fill = 0;
        let mut off = 0;
        let stage_bytes = STAGE * bits as usize / 8;
        for row in x.chunks_exact(layout.cols) {
            for blk in row.chunks(layout.block) {
                let (code, inv) = self.block_scale(blk);
                scales[si] = code;
                si += 1;
                let mut rest = blk;
                while !rest.is_empty() {
                    let m = rest.len().min(STAGE - fill);
                    self.encode(inv, &rest[..m], &mut stage[fill..fill + m]);
                    fill += m;
                    rest = &rest[m..];
                    if fill == STAGE {
                        pack(bits, &stage, &mut elems[off..off + stage_bytes]);
                        off += stage_bytes;
                        fill = 0;
                    }
                }
            }
        }
        let tail = packed_len(fill, bits);
        pack(bits, &stage[..fill], &mut elems[off..off + tail]);
    }

    /// Dequantizes `layout.rows` whole rows into `out` (the inverse walk of `quantize_rows`).
    pub(crate) fn dequantize_rows(
        &self,
        layout: Layout,
        scales: &[u8],
        elems: &[u8],
        out: &mut [f32],
    ) {
        with_avx2(DequantizeRows {
            kernel: self,
            layout,
            scales,
            elems,
            out,
        });
    }

    #[inline(always)]
    fn dequantize_rows_impl(&self, layout: Layout, scales: &[u8], elems: &[u8], out: &mut [f32]) {
        let bits = self.codec.storage_bits;
        if layout.cols == 0 {
            return;
        }
        let table = &self.table;
        let mut si = 0;
        let decode = |s: f32, codes: &[u8], o: &mut [f32]| {
            if s.is_nan() {
                o.fill(f32::NAN);
            } else {
                for (v, &c) in o.iter_mut().zip(codes) {
                    *v = table[c as usize] * s;
                }
            }
        };
        if bits == 8 {
            for (row, codes) in out
                .chunks_exact_mut(layout.cols)
                .zip(elems.chunks_exact(layout.cols))
            {
                for (o, c) in row.chunks_mut(layout.block).zip(codes.chunks(layout.block)) {
                    decode(self.scale.value(scales[si]), c, o);
                    si += 1;
                }
            }
            return;
        }
        let mut stage = [0u8; STAGE];
        let mut avail = 0; // staged codes not yet used
        let mut pos = 0; // index of the next staged code
        let mut off = 0; // next packed byte
        let stage_bytes = STAGE * bits as usize / 8;
        let total = layout.len();
        let mut done = 0;
        for row in out.chunks_exact_mut(layout.cols) {
            for blk in row.chunks_mut(layout.block) {
                let s = self.scale.value(scales[si]);
                si += 1;
                let mut rest = blk;
                while !rest.is_empty() {
                    if avail == 0 {
                        let n = (total - done).min(STAGE);
                        let bytes = if n == STAGE {
                            stage_bytes
                        } else {
                            packed_len(n, bits)
                        };
                        unpack(bits, &elems[off..off + bytes], &mut stage[..n]);
                        off += bytes;
                        done += n;
                        avail = n;
                        pos = 0;
                    }
                    let m = rest.len().min(avail);
                    let (head, tail) = rest.split_at_mut(m);
                    decode(s, &stage[pos..pos + m], head);
                    pos += m;
                    avail -= m;
                    rest = tail;
                }
            }
        }
    }

    /// Quantizes and dequantizes `layout.rows` rows in one pass, without packing.
    pub(crate) fn quantize_dequantize_rows(&self, layout: Layout, x: &[f32], out: &mut [f32]) {
        with_avx2(QuantizeDequantizeRows {
            kernel: self,
            layout,
            x,
            out,
        });
    }

    #[inline(always)]
    fn quantize_dequantize_rows_impl(&self, layout: Layout, x: &[f32], out: &mut [f32]) {
        if layout.cols == 0 {
            return;
        }
        let table = &self.table;
        let mut stage = [0u8; STAGE];
        for (row, orow) in x
            .chunks_exact(layout.cols)
            .zip(out.chunks_exact_mut(layout.cols))
        {
            for (blk, o) in row.chunks(layout.block).zip(orow.chunks_mut(layout.block)) {
                let (code, inv) = self.block_scale(blk);
                let Some(inv) = inv else {
                    o.fill(f32::NAN);
                    continue;
                };
                let s = self.scale.value(code);
                for (xs, os) in blk.chunks(STAGE).zip(o.chunks_mut(STAGE)) {
                    let codes = &mut stage[..xs.len()];
                    self.codec.encode_slice(self.rounding, inv, xs, codes);
                    for (v, &c) in os.iter_mut().zip(codes.iter()) {
                        *v = table[c as usize] * s;
                    }
                }
            }
        }
    }
}

/// A method of [`Kernel`] on a layout and its slices, as a task of [`with_avx2`]: the struct
/// `$task` holds the kernel, the layout and the named slices, and runs `kernel.$method(layout,
/// slices..)`.
macro_rules! avx2_task {
    ($($(#[$doc:meta])* $task:ident($($f:ident: $t:ty),+) => $method:ident;)+) => {$(
        $(#[$doc])*
        struct $task<'a> {
            kernel: &'a Kernel,
            layout: Layout,
            $($f: $t,)+
        }

        impl Avx2Task for $task<'_> {
            type Output = ();
            #[inline(always)]
            fn run(self) {
                self.kernel.$method(self.layout, $(self.$f),+);
            }
        }
    )+};
}

avx2_task! {
    /// [`Kernel::quantize_rows`] as a task of [`with_avx2`].
    QuantizeRows(x: &'a [f32], scales: &'a mut [u8], elems: &'a mut [u8]) => quantize_rows_impl;
    /// [`Kernel::dequantize_rows`] as a task of [`with_avx2`].
    DequantizeRows(scales: &'a [u8], elems: &'a [u8], out: &'a mut [f32]) => dequantize_rows_impl;
    /// [`Kernel::quantize_dequantize_rows`] as a task of [`with_avx2`].
    QuantizeDequantizeRows(x: &'a [f32], out: &'a mut [f32]) => quantize_dequantize_rows_impl;
}

/// Splits `layout.rows` rows into row ranges whose packed element storage starts on a byte
/// boundary: at most `threads`, at most the rows, and at most the cores
/// ([`std::thread::available_parallelism`]), so a huge thread count never spawns a thread per row.
pub(crate) fn row_ranges(layout: Layout, bits: u32, threads: usize) -> Vec<(usize, usize)> {
    let rows = layout.rows;
    let align = (1..=8usize)
        .find(|r| ((r * layout.cols % 8) * bits as usize).is_multiple_of(8))
        .unwrap_or(8);
    let machine = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let threads = threads.min(machine).min(rows).max(1);
    let per = rows.div_ceil(threads).div_ceil(align) * align;
    if per == 0 || threads == 1 {
        return vec![(0, rows)];
    }
    (0..rows)
        .step_by(per)
        .map(|r| (r, (r + per).min(rows)))
        .collect()
}

/// A slice whose rows a row range takes its part of: shared (`&[T]`) or mutable (`&mut [T]`).
pub(crate) trait RowSlice: Sized + Send {
    /// How many values it holds.
    fn count(&self) -> usize;
    /// The first `at` values, and the rest.
    fn split(self, at: usize) -> (Self, Self);
}

impl<T: Sync> RowSlice for &[T] {
    fn count(&self) -> usize {
        self.len()
    }
    fn split(self, at: usize) -> (Self, Self) {
        self.split_at(at)
    }
}

impl<T: Send> RowSlice for &mut [T] {
    fn count(&self) -> usize {
        self.len()
    }
    fn split(self, at: usize) -> (Self, Self) {
        self.split_at_mut(at)
    }
}

/// Runs `f(layout of the part, its values, its scales, its packed elements)` on each row range,
/// on scoped threads when there is more than one: a part takes its rows of `values` (one per
/// element: the data to quantize, or the output of a dequantization), its blocks of `scales` and
/// its bytes of `elems`.
pub(crate) fn for_row_ranges<X: RowSlice, S: RowSlice, P: RowSlice, F>(
    layout: Layout,
    bits: u32,
    threads: usize,
    values: X,
    scales: S,
    elems: P,
    f: F,
) where
    F: Fn(Layout, X, S, P) + Sync,
{
    let ranges = row_ranges(layout, bits, threads);
    if ranges.len() <= 1 {
        f(layout, values, scales, elems);
        return;
    }
    std::thread::scope(|s| {
        let (mut values, mut scales, mut elems) = (values, scales, elems);
        for &(r0, r1) in &ranges {
            let part = layout.with_rows(r1 - r0);
            let (xa, xb) = values.split(part.len());
            let (sa, sb) = scales.split(part.num_blocks());
            let nbytes = if r1 == layout.rows {
                elems.count()
            } else {
                packed_len(part.len(), bits)
            };
            let (ea, eb) = elems.split(nbytes);
            (values, scales, elems) = (xb, sb, eb);
            let f = &f;
            s.spawn(move || f(part, xa, sa, ea));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts() {
        let l = Layout::new(&[3, 70], 32, Some(210)).unwrap();
        assert_eq!(
            (l.rows, l.cols, l.blocks_per_row, l.num_blocks()),
            (3, 70, 3, 9)
        );
        let l = Layout::new(&[], 32, Some(1)).unwrap();
        assert_eq!((l.rows, l.cols, l.num_blocks()), (1, 1, 1));
        assert!(Layout::new(&[2, 3], 1, Some(5)).is_err());
        assert!(Layout::new(&[usize::MAX, 3], 1, None).is_err());
        assert_eq!(Layout::new(&[5, 0], 4, Some(0)).unwrap().num_blocks(), 0);
    }

    #[test]
    fn portable_and_dispatched_kernels_agree() {
        use crate::mx::MxFormat;
        // The dispatcher picks the AVX2 copy where the CPU has it; the *_impl calls below are
        // compiled for the baseline target. Both must give the same bits.
        let mut s = 0x9E37_79B9u32;
        let x: Vec<f32> = (0..3 * 77)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                match i % 11 {
                    0 => f32::from_bits(s & 0x807f_ffff), // subnormals
                    1 => 0.0,
                    _ => f32::from_bits((s & 0x8fff_ffff) | 0x3000_0000),
                }
            })
            .collect();
        for format in MxFormat::OCP {
            for rounding in [Rounding::NearestEven, Rounding::NearestAway] {
                let spec = MxSpec::new(format)
                    .with_block_size(7)
                    .unwrap()
                    .with_rounding(rounding);
                let k = Kernel::new(&spec);
                let l = Layout::new(&[3, 77], 7, Some(x.len())).unwrap();
                let bytes = packed_len(l.len(), format.storage_bits());
                let (mut s1, mut e1) = (vec![0; l.num_blocks()], vec![0; bytes]);
                let (mut s2, mut e2) = (s1.clone(), e1.clone());
                k.quantize_rows(l, &x, &mut s1, &mut e1);
                k.quantize_rows_impl(l, &x, &mut s2, &mut e2);
                assert_eq!((&s1, &e1), (&s2, &e2), "{format} {rounding:?}");
                let (mut o1, mut o2) = (vec![0.0f32; x.len()], vec![0.0f32; x.len()]);
                k.dequantize_rows(l, &s1, &e1, &mut o1);
                k.dequantize_rows_impl(l, &s1, &e1, &mut o2);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&o1), bits(&o2));
                k.quantize_dequantize_rows(l, &x, &mut o1);
                k.quantize_dequantize_rows_impl(l, &x, &mut o2);
                assert_eq!(bits(&o1), bits(&o2));
            }
        }
    }

    #[test]
    fn threads_are_capped_at_the_rows_and_the_machine() {
        let machine = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        // [200000, 1] with usize::MAX threads once spawned one thread per row.
        let l = Layout::new(&[200_000, 1], 32, None).unwrap();
        for threads in [usize::MAX, 1_000_000, machine + 1] {
            let ranges = row_ranges(l, 4, threads);
            assert!(
                ranges.len() <= machine,
                "{} ranges for {threads} threads on {machine} cores",
                ranges.len()
            );
            assert_eq!((ranges[0].0, ranges.last().unwrap().1), (0, 200_000));
        }
        // Never more ranges than rows, and one range for one thread.
        let few = Layout::new(&[3, 64], 32, None).unwrap();
        assert!(row_ranges(few, 8, usize::MAX).len() <= 3);
        assert_eq!(row_ranges(l, 8, 1), vec![(0, 200_000)]);
        assert_eq!(row_ranges(l, 8, 0), vec![(0, 200_000)]);
    }

    #[test]
    fn row_ranges_start_on_bytes() {
        for cols in 1..20 {
            for bits in [4u32, 6, 8] {
                let l = Layout::new(&[37, cols], 5, None).unwrap();
                let ranges = row_ranges(l, bits, 3);
                assert_eq!(ranges.first().unwrap().0, 0);
                assert_eq!(ranges.last().unwrap().1, 37);
                for w in ranges.windows(2) {
                    assert_eq!(w[0].1, w[1].0);
                }
                for &(r0, _) in &ranges {
                    assert_eq!(r0 * cols * bits as usize % 8, 0, "cols {cols} bits {bits}");
                }
            }
        }
    }
}
