//! Fused element-wise passes around a Linear layer's GEMMs: bias, activation and cast forward;
//! activation mask and bias gradient backward; accumulation of an f32 result into a gradient.
//!
//! Each pass works row by row on short f32 buffers that stay in L1, and converts f16 with
//! `half`'s slice conversions (F16C where the CPU has it), never one element at a time.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::KernelError;
use super::relu_mask::{MaskValue, Simd, word};
use crate::FloatSliceMut;

/// The activation fused after a Linear layer's GEMM (mpx re-exports it as
/// `mpx::nn::Activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    /// `y = z`.
    #[default]
    Identity,
    /// `y = max(z, 0)`.
    ReLU,
}

fn expect_len(what: &'static str, len: usize, expected: usize) -> Result<(), KernelError> {
    if len == expected {
        Ok(())
    } else {
        Err(KernelError::Length {
            what,
            len,
            expected,
        })
    }
}

/// Forward epilogue: `out[r][j] = act(acc[r][j] + bias[j])`, rounded to `out`'s type. `acc` is a
/// row-major `rows x bias.len()` GEMM result and is overwritten with the f32 values.
///
/// # Errors
/// [`KernelError::EmptyRow`] if `bias` is empty, [`KernelError::NotWholeRows`] if `acc` is not a
/// whole number of rows of `bias.len()`, [`KernelError::Length`] if `out`'s length differs from
/// `acc`'s.
///
/// # Examples
/// ```
/// use half::f16;
/// use mpx_kernels::{Activation, FloatSliceMut, bias_act_into};
///
/// // two rows of three GEMM sums, a bias, ReLU, written as f16
/// let mut acc = [1.0f32, -2.0, 0.5, -1.0, 3.0, 0.0];
/// let mut out = [f16::ZERO; 6];
/// bias_act_into(&mut acc, &[0.5, 0.5, -1.0], Activation::ReLU, FloatSliceMut::F16(&mut out))?;
/// assert_eq!(out.map(f16::to_f32), [1.5, 0.0, 0.0, 0.0, 3.5, 0.0]);
/// # Ok::<(), mpx_kernels::KernelError>(())
/// ```
pub fn bias_act_into(
    acc: &mut [f32],
    bias: &[f32],
    act: Activation,
    out: FloatSliceMut<'_>,
) -> Result<(), KernelError> {
    let cols = bias.len();
    expect_len("out", out.len(), acc.len())?;
    whole_rows("acc", acc.len(), "bias", cols)?;
    let rows = acc.chunks_exact_mut(cols);
    match (act, out) {
        (Activation::Identity, FloatSliceMut::F32(o)) => {
            for (row, orow) in rows.zip(o.chunks_exact_mut(cols)) {
                for ((d, a), b) in orow.iter_mut().zip(row.iter()).zip(bias) {
                    *d = *a + *b;
                }
            }
        }
        (Activation::ReLU, FloatSliceMut::F32(o)) => {
            for (row, orow) in rows.zip(o.chunks_exact_mut(cols)) {
                for ((d, a), b) in orow.iter_mut().zip(row.iter()).zip(bias) {
                    *d = (*a + *b).max(0.0);
                }
            }
        }
        (act, FloatSliceMut::F16(o)) => {
            for row in rows {
                if act == Activation::ReLU {
                    row.iter_mut()
                        .zip(bias)
                        .for_each(|(a, b)| *a = (*a + *b).max(0.0));
                } else {
                    row.iter_mut().zip(bias).for_each(|(a, b)| *a += *b);
                }
            }
            // one conversion pass over every row (a call per row costs more than its work
            // on narrow layers)
            crate::convert::round_f16(acc, o);
        }
    }
    Ok(())
}

/// `ReLU`'s derivative as one bit per element (set: the output was positive, the gradient passes).
/// Made from the layer's output in the forward pass, so the backward needs neither the output
/// nor the pre-activation (1/16 of an f16 activation's memory).
///
/// # Examples
/// ```
/// use mpx_kernels::ReluMask;
/// let mask = ReluMask::from_f32(&[1.0, 0.0, -0.0, f32::NAN, f32::INFINITY]);
/// assert_eq!(mask.len(), 5);
/// assert_eq!((0..6).map(|i| mask.get(i)).collect::<Vec<_>>(), [true, false, false, false, true, false]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReluMask {
    pub(crate) bits: Vec<u64>,
    len: usize,
}

impl ReluMask {
    /// The mask of `ReLU` outputs `y` in f16: `y > 0` (sign clear, not zero, not NaN; +inf passes).
    ///
    /// # Examples
    /// ```
    /// use half::f16;
    /// let mask = mpx_kernels::ReluMask::from_f16(&[f16::ONE, f16::NEG_ONE]);
    /// assert!(mask.get(0) && !mask.get(1));
    /// ```
    pub fn from_f16(y: &[f16]) -> Self {
        Self::from_values::<u16>(y.reinterpret_cast())
    }

    /// The mask of `ReLU` outputs `y` in f32: `y > 0`.
    ///
    /// # Examples
    /// ```
    /// let mask = mpx_kernels::ReluMask::from_f32(&[2.0, -2.0]);
    /// assert!(mask.get(0) && !mask.get(1));
    /// ```
    pub fn from_f32(y: &[f32]) -> Self {
        Self::from_values(y)
    }

    /// The mask on the widest SIMD loop this CPU has, else the scalar definition.
    fn from_values<T: MaskValue>(y: &[T]) -> Self {
        Self::on(Simd::ALL.into_iter().find(|s| s.present()), y)
    }

    /// The mask of `y` made on `simd` (`None`, or a path this CPU lacks: the scalar definition,
    /// one bit per value); the last partial word always from the definition.
    fn on<T: MaskValue>(simd: Option<Simd>, y: &[T]) -> Self {
        let mut bits = Vec::with_capacity(y.len().div_ceil(64));
        let rest = match simd.filter(|s| s.present()) {
            Some(s) => {
                // SAFETY: the CPU has `s`'s features (checked just above).
                unsafe { T::words(s, y, &mut bits) };
                y.chunks_exact(64).remainder()
            }
            None => y,
        };
        bits.extend(rest.chunks(64).map(word));
        Self { bits, len: y.len() }
    }

    /// The masks of `y` (f32) and `yh` (f16) from the definition and from every SIMD loop this
    /// CPU has, named; a loop the CPU lacks is said to be skipped.
    #[cfg(test)]
    pub(crate) fn each_path(y: &[f32], yh: &[f16]) -> Vec<(String, Self, Self)> {
        let yb: &[u16] = yh.reinterpret_cast();
        let mut all = vec![(
            "portable".to_string(),
            Self::on(None, y),
            Self::on(None, yb),
        )];
        for s in Simd::ALL {
            if s.present() {
                all.push((
                    format!("{s:?}"),
                    Self::on(Some(s), y),
                    Self::on(Some(s), yb),
                ));
            } else {
                eprintln!(
                    "skipped: this CPU lacks {s:?} (the mask's loop for it is untested here)"
                );
            }
        }
        all
    }

    /// Number of elements.
    ///
    /// # Examples
    /// ```
    /// assert_eq!(mpx_kernels::ReluMask::from_f32(&[1.0; 70]).len(), 70);
    /// ```
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` for the mask of no elements.
    ///
    /// # Examples
    /// ```
    /// assert!(mpx_kernels::ReluMask::from_f32(&[]).is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether element `i` passes (false past the end).
    ///
    /// # Examples
    /// ```
    /// let mask = mpx_kernels::ReluMask::from_f32(&[1.0]);
    /// assert!(mask.get(0) && !mask.get(1));
    /// ```
    pub fn get(&self, i: usize) -> bool {
        i < self.len && (self.bits[i / 64] >> (i % 64)) & 1 == 1
    }

    /// `ReLU`'s backward on its own: zeroes `dy[i]` where bit `i` is clear (+0 in f16 and f32),
    /// and keeps it where the bit is set.
    ///
    /// # Errors
    /// [`KernelError::Length`] when `dy` is not as long as the mask.
    ///
    /// # Examples
    /// ```
    /// use mpx_kernels::{FloatSliceMut, ReluMask};
    /// let mask = ReluMask::from_f32(&[1.0, 0.0, 2.0]);
    /// let mut dy = [0.5f32, 0.5, -0.5];
    /// mask.zero_where_clear(FloatSliceMut::F32(&mut dy))?;
    /// assert_eq!(dy, [0.5, 0.0, -0.5]);
    /// # Ok::<(), mpx_kernels::KernelError>(())
    /// ```
    pub fn zero_where_clear(&self, dy: FloatSliceMut<'_>) -> Result<(), KernelError> {
        expect_len("dy", dy.len(), self.len)?;
        // branch-free (a ReLU's mask is as random as its inputs), and compiled for AVX2 where
        // the CPU has it (variable shifts vectorise there, not on the SSE2 baseline)
        match dy {
            FloatSliceMut::F32(v) => crate::with_avx2(ZeroWhereClear(v, &self.bits)),
            FloatSliceMut::F16(v) => {
                crate::with_avx2(ZeroWhereClear(v.reinterpret_cast_mut(), &self.bits));
            }
        }
        Ok(())
    }

    /// Zeroes `row` (elements `start..start + row.len()`) where the mask is clear.
    fn apply<T: Copy>(&self, start: usize, row: &mut [T], zero: T) {
        // whole 64-bit words where aligned, bit by bit at the edges
        let mut j = 0;
        while j < row.len() {
            let i = start + j;
            if i.is_multiple_of(64) && j + 64 <= row.len() {
                let word = self.bits[i / 64];
                if word != u64::MAX {
                    // a select, not a conditional store: vectorises
                    for (b, v) in row[j..j + 64].iter_mut().enumerate() {
                        *v = if (word >> b) & 1 == 1 { *v } else { zero };
                    }
                }
                j += 64;
            } else {
                if !self.get(i) {
                    row[j] = zero;
                }
                j += 1;
            }
        }
    }
}

/// [`ReluMask::zero_where_clear`] on f32 values or f16 bits: each masked by its bit spread
/// over the value's width, a word of the mask per 64 values.
pub(crate) struct ZeroWhereClear<'a, T>(pub(crate) &'a mut [T], pub(crate) &'a [u64]);

impl crate::Avx2Task for ZeroWhereClear<'_, f32> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        for (chunk, &word) in self.0.chunks_mut(64).zip(self.1) {
            for (b, x) in chunk.iter_mut().enumerate() {
                let keep = 0u32.wrapping_sub(((word >> b) & 1) as u32);
                *x = f32::from_bits(x.to_bits() & keep);
            }
        }
    }
}

impl crate::Avx2Task for ZeroWhereClear<'_, u16> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        for (chunk, &word) in self.0.chunks_mut(64).zip(self.1) {
            for (b, x) in chunk.iter_mut().enumerate() {
                *x &= 0u16.wrapping_sub(((word >> b) & 1) as u16);
            }
        }
    }
}

/// Backward epilogue for f16 gradients: with a `ReLU` `mask`, zeroes `dy` where the mask is clear;
/// then adds the column sums of (masked) `dy` to `bias_grad` in f32.
///
/// # Errors
/// [`KernelError::EmptyRow`] if `bias_grad` is empty, [`KernelError::NotWholeRows`] if `dy` is
/// not whole rows of `bias_grad.len()`, [`KernelError::Length`] if the mask's length differs from
/// `dy`'s.
///
/// # Examples
/// ```
/// use half::f16;
/// use mpx_kernels::{ReluMask, relu_mask_bias_grad_f16};
///
/// let y = [f16::ONE, f16::ZERO, f16::ONE, f16::ONE]; // the forward's outputs, 2 x 2
/// let mask = ReluMask::from_f16(&y);
/// let mut dy = [f16::from_f32(0.5); 4];
/// let mut bias_grad = [0.0f32; 2];
/// relu_mask_bias_grad_f16(&mut dy, Some(&mask), &mut bias_grad)?;
/// assert_eq!(dy[1], f16::ZERO); // masked
/// assert_eq!(bias_grad, [1.0, 0.5]);
/// # Ok::<(), mpx_kernels::KernelError>(())
/// ```
pub fn relu_mask_bias_grad_f16(
    dy: &mut [f16],
    mask: Option<&ReluMask>,
    bias_grad: &mut [f32],
) -> Result<(), KernelError> {
    let cols = bias_grad.len();
    check_rows(dy.len(), mask.map(ReluMask::len), cols)?;
    if dy.len() <= SCALAR_MAX {
        for (r, drow) in dy.chunks_exact_mut(cols).enumerate() {
            if let Some(m) = mask {
                m.apply(r * cols, drow, f16::ZERO);
            }
            for (g, v) in bias_grad.iter_mut().zip(drow.iter()) {
                *g += v.to_f32();
            }
        }
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vl")
    {
        // SAFETY: AVX-512 F, BW and VL were detected; `check_rows` checked the rows and the
        // mask's length.
        unsafe {
            super::relu_grad::mask_bias_grad_f16_avx512(
                dy.reinterpret_cast_mut(),
                mask.map(|m| &m.bits[..]),
                bias_grad,
            );
        }
        return Ok(());
    }
    // widened 256 values at a time into a stack buffer: no allocation per call
    let mut buf = [0.0f32; 256];
    for (r, drow) in dy.chunks_exact_mut(cols).enumerate() {
        if let Some(m) = mask {
            m.apply(r * cols, drow, f16::ZERO);
        }
        for (dc, gc) in drow.chunks(256).zip(bias_grad.chunks_mut(256)) {
            let b = &mut buf[..dc.len()];
            crate::convert::widen_f16(dc, b);
            gc.iter_mut().zip(b.iter()).for_each(|(g, v)| *g += *v);
        }
    }
    Ok(())
}

/// Gradients of at most this many values take the scalar loop in the ReLU-mask and bias-gradient
/// pass: on so few (a tiny net's), the vector set-up costs more than it saves (0.8K fewer
/// instructions per mixed 2-2-1 step, of about 60K, counted by `valgrind --tool=callgrind
/// target/release/examples/bench_step_overhead --profile xor` at `b630144` against the same build
/// with the bound at 0). The sums are the same bits either way (each column's, row by row, in
/// f32).
const SCALAR_MAX: usize = 64;

/// [`relu_mask_bias_grad_f16`] for f32 gradients.
///
/// # Errors
/// As [`relu_mask_bias_grad_f16`].
///
/// # Examples
/// ```
/// let mut dy = [1.0f32, 2.0, 3.0, 4.0];
/// let mut bias_grad = [0.0f32; 2];
/// mpx_kernels::relu_mask_bias_grad_f32(&mut dy, None, &mut bias_grad)?; // no ReLU: sums only
/// assert_eq!(bias_grad, [4.0, 6.0]);
/// # Ok::<(), mpx_kernels::KernelError>(())
/// ```
pub fn relu_mask_bias_grad_f32(
    dy: &mut [f32],
    mask: Option<&ReluMask>,
    bias_grad: &mut [f32],
) -> Result<(), KernelError> {
    let cols = bias_grad.len();
    check_rows(dy.len(), mask.map(ReluMask::len), cols)?;
    #[cfg(target_arch = "x86_64")]
    if dy.len() > SCALAR_MAX && std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512 F was detected; `check_rows` checked that `dy` is whole rows of
        // `cols > 0` values and that the mask has `dy.len()` bits.
        unsafe {
            super::relu_grad::mask_bias_grad_f32_avx512(dy, mask.map(|m| &m.bits[..]), bias_grad);
        }
        return Ok(());
    }
    for (r, drow) in dy.chunks_exact_mut(cols).enumerate() {
        if let Some(m) = mask {
            m.apply(r * cols, drow, 0.0);
        }
        bias_grad
            .iter_mut()
            .zip(drow.iter())
            .for_each(|(g, v)| *g += *v);
    }
    Ok(())
}

fn check_rows(dy: usize, y: Option<usize>, cols: usize) -> Result<(), KernelError> {
    if let Some(y) = y {
        expect_len("mask", y, dy)?;
    }
    whole_rows("dy", dy, "bias_grad", cols)
}

/// Checks that `len` values (of `what`) are whole rows of `row_len` (the length of `row_what`),
/// and that rows are not empty.
fn whole_rows(
    what: &'static str,
    len: usize,
    row_what: &'static str,
    row_len: usize,
) -> Result<(), KernelError> {
    if row_len == 0 {
        return Err(KernelError::EmptyRow { what: row_what });
    }
    if !len.is_multiple_of(row_len) {
        return Err(KernelError::NotWholeRows {
            what,
            len,
            row_len,
            row_what,
        });
    }
    Ok(())
}

/// `dst += src`, the sum rounded once to `dst`'s type: how a GEMM's f32 result is accumulated
/// into a gradient entry.
///
/// # Errors
/// [`KernelError::Length`] if the lengths differ.
///
/// # Examples
/// ```
/// use mpx_kernels::{FloatSliceMut, add_f32_into};
/// let mut grad = [1.0f32, 2.0];
/// add_f32_into(&[0.5, 0.5], FloatSliceMut::F32(&mut grad))?;
/// assert_eq!(grad, [1.5, 2.5]);
/// assert!(add_f32_into(&[1.0], FloatSliceMut::F32(&mut grad)).is_err());
/// # Ok::<(), mpx_kernels::KernelError>(())
/// ```
pub fn add_f32_into(src: &[f32], dst: FloatSliceMut<'_>) -> Result<(), KernelError> {
    expect_len("dst", dst.len(), src.len())?;
    match dst {
        FloatSliceMut::F32(d) => d.iter_mut().zip(src).for_each(|(d, s)| *d += *s),
        FloatSliceMut::F16(d) => crate::convert::add_f32_into_f16(src, d),
    }
    Ok(())
}
