//! Fused element-wise passes around a Linear layer's GEMMs: bias, activation and cast forward;
//! activation mask and bias gradient backward; accumulation of an f32 result into a gradient.
//!
//! Each pass works row by row on short f32 buffers that stay in L1, and converts f16 with
//! `half`'s slice conversions (F16C where the CPU has it), never one element at a time.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::KernelError;

/// The activation fused after a Linear layer's GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    /// `y = z`.
    #[default]
    Identity,
    /// `y = max(z, 0)`.
    ReLU,
}

/// A destination of a pass: f32 or f16 values.
#[derive(Debug)]
pub enum Dst<'a> {
    /// f32 values (also emulated bf16 storage).
    F32(&'a mut [f32]),
    /// f16 values (also `AMP<f16>`, viewed as f16).
    F16(&'a mut [f16]),
}

impl Dst<'_> {
    fn len(&self) -> usize {
        match self {
            Dst::F32(v) => v.len(),
            Dst::F16(v) => v.len(),
        }
    }
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
/// [`KernelError::Length`] if `acc` is not a whole number of rows of `bias.len()`, or `out`'s
/// length differs from `acc`'s.
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{bias_act_into, Activation, Dst};
/// let mut acc = [1.0f32, -3.0, 0.5, 0.5];
/// let mut out = [0.0f32; 4];
/// bias_act_into(&mut acc, &[1.0, 1.0], Activation::ReLU, Dst::F32(&mut out)).unwrap();
/// assert_eq!(out, [2.0, 0.0, 1.5, 1.5]);
/// ```
pub fn bias_act_into(
    acc: &mut [f32],
    bias: &[f32],
    act: Activation,
    out: Dst<'_>,
) -> Result<(), KernelError> {
    let cols = bias.len();
    expect_len("out", out.len(), acc.len())?;
    if cols == 0 || acc.len() % cols != 0 {
        return Err(KernelError::Length {
            what: "acc (whole rows of bias.len())",
            len: acc.len(),
            expected: acc.len() - acc.len() % cols.max(1),
        });
    }
    let rows = acc.chunks_exact_mut(cols);
    match (act, out) {
        (Activation::Identity, Dst::F32(o)) => {
            for (row, orow) in rows.zip(o.chunks_exact_mut(cols)) {
                for ((d, a), b) in orow.iter_mut().zip(row.iter()).zip(bias) {
                    *d = *a + *b;
                }
            }
        }
        (Activation::ReLU, Dst::F32(o)) => {
            for (row, orow) in rows.zip(o.chunks_exact_mut(cols)) {
                for ((d, a), b) in orow.iter_mut().zip(row.iter()).zip(bias) {
                    *d = (*a + *b).max(0.0);
                }
            }
        }
        (act, Dst::F16(o)) => {
            for (row, orow) in rows.zip(o.chunks_exact_mut(cols)) {
                if act == Activation::ReLU {
                    row.iter_mut()
                        .zip(bias)
                        .for_each(|(a, b)| *a = (*a + *b).max(0.0));
                } else {
                    row.iter_mut().zip(bias).for_each(|(a, b)| *a += *b);
                }
                orow.convert_from_f32_slice(row);
            }
        }
    }
    Ok(())
}

/// Backward epilogue for f16 gradients: with `relu_out = Some(y)`, zeroes `dy` where the layer's
/// ReLU output `y` is not positive (ReLU's mask, read from the output: `y > 0` exactly where the
/// pre-activation was); then adds the column sums of (masked) `dy` to `bias_grad` in f32.
///
/// # Errors
/// [`KernelError::Length`] if `dy` is not whole rows of `bias_grad.len()`, or `y` differs from
/// `dy` in length.
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::relu_mask_bias_grad_f16;
/// use mpx_runtime::precision::f16;
/// let h = |v: [f32; 4]| v.map(f16::from_f32);
/// let (mut dy, y) = (h([1.0, 2.0, 3.0, 4.0]), h([0.5, 0.0, 1.0, 2.0]));
/// let mut db = [0.0f32; 2];
/// relu_mask_bias_grad_f16(&mut dy, Some(&y), &mut db).unwrap();
/// assert_eq!(dy, h([1.0, 0.0, 3.0, 4.0]));
/// assert_eq!(db, [4.0, 4.0]);
/// ```
pub fn relu_mask_bias_grad_f16(
    dy: &mut [f16],
    relu_out: Option<&[f16]>,
    bias_grad: &mut [f32],
) -> Result<(), KernelError> {
    let cols = bias_grad.len();
    check_rows(dy.len(), relu_out.map(<[f16]>::len), cols)?;
    let mut row32 = vec![0.0f32; cols];
    for (r, drow) in dy.chunks_exact_mut(cols).enumerate() {
        if let Some(y) = relu_out {
            let yrow = &y[r * cols..(r + 1) * cols];
            let (d, yb): (&mut [u16], &[u16]) =
                (drow.reinterpret_cast_mut(), yrow.reinterpret_cast());
            // y > 0: sign clear, not zero, not NaN (positive infinity counts as positive)
            d.iter_mut().zip(yb).for_each(|(d, &y)| {
                if !(1..=0x7c00).contains(&y) {
                    *d = 0;
                }
            });
        }
        drow.convert_to_f32_slice(&mut row32);
        bias_grad.iter_mut().zip(&row32).for_each(|(g, v)| *g += *v);
    }
    Ok(())
}

/// [`relu_mask_bias_grad_f16`] for f32 gradients.
///
/// # Errors
/// As [`relu_mask_bias_grad_f16`].
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::relu_mask_bias_grad_f32;
/// let (mut dy, y) = ([1.0f32, 2.0, 3.0, 4.0], [-0.0f32, 1.0, 1.0, f32::NAN]);
/// let mut db = [0.0f32; 2];
/// relu_mask_bias_grad_f32(&mut dy, Some(&y), &mut db).unwrap();
/// assert_eq!(dy, [0.0, 2.0, 3.0, 0.0]);
/// assert_eq!(db, [3.0, 2.0]);
/// ```
pub fn relu_mask_bias_grad_f32(
    dy: &mut [f32],
    relu_out: Option<&[f32]>,
    bias_grad: &mut [f32],
) -> Result<(), KernelError> {
    let cols = bias_grad.len();
    check_rows(dy.len(), relu_out.map(<[f32]>::len), cols)?;
    for (r, drow) in dy.chunks_exact_mut(cols).enumerate() {
        if let Some(y) = relu_out {
            let yrow = &y[r * cols..(r + 1) * cols];
            drow.iter_mut().zip(yrow).for_each(|(d, y)| {
                if y.is_nan() || *y <= 0.0 {
                    *d = 0.0;
                }
            });
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
        expect_len("y", y, dy)?;
    }
    if cols == 0 || dy % cols != 0 {
        return Err(KernelError::Length {
            what: "dy (whole rows of bias_grad.len())",
            len: dy,
            expected: dy - dy % cols.max(1),
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
/// use mpx_runtime::kernels::{add_f32_into, Dst};
/// use mpx_runtime::precision::f16;
/// let mut g = [f16::from_f32(1.0); 3];
/// add_f32_into(&[0.5, 1.0, 2.0], Dst::F16(&mut g)).unwrap();
/// assert_eq!(g.map(f32::from), [1.5, 2.0, 3.0]);
/// ```
pub fn add_f32_into(src: &[f32], dst: Dst<'_>) -> Result<(), KernelError> {
    expect_len("dst", dst.len(), src.len())?;
    match dst {
        Dst::F32(d) => d.iter_mut().zip(src).for_each(|(d, s)| *d += *s),
        Dst::F16(d) => {
            let mut buf = [0.0f32; 256];
            for (dc, sc) in d.chunks_mut(256).zip(src.chunks(256)) {
                let b = &mut buf[..dc.len()];
                dc.convert_to_f32_slice(b);
                b.iter_mut().zip(sc).for_each(|(b, s)| *b += *s);
                dc.convert_from_f32_slice(b);
            }
        }
    }
    Ok(())
}
