//! [`MatRef`]: a strided view of a GEMM operand in f32, f16 or (emulated) bf16.

use half::f16;

/// The values of an operand and how the kernel reads them.
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{gemm, MatRef, Operand};
/// // 1 + 2^-9 is not a bf16 value: as Bf16 it is read as 1.0
/// let a = [1.0f32 + 1.0 / 512.0];
/// let mut c = [0.0f32];
/// gemm(MatRef::row_major(Operand::Bf16(&a), 1, 1), MatRef::row_major_f32(&[1.0], 1, 1), &mut c, false).unwrap();
/// assert_eq!(c, [1.0]);
/// ```
#[derive(Debug, Clone, Copy)]
pub enum Operand<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// f16 values.
    F16(&'a [f16]),
    /// f32 storage whose values are rounded to bf16 while packing (emulated bf16).
    Bf16(&'a [f32]),
}

impl Operand<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Operand::F32(v) | Operand::Bf16(v) => v.len(),
            Operand::F16(v) => v.len(),
        }
    }
}

/// A `rows x cols` matrix view: element `(i, j)` is `values[i * row_stride + j * col_stride]`.
/// A transpose is the same values with the strides swapped ([`MatRef::t`]).
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{MatRef, Operand};
/// let v = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
/// // every other column of a 2x6 matrix, as a 2x3 view
/// let m = MatRef { values: Operand::F32(&v), rows: 2, cols: 3, row_stride: 3, col_stride: 1 };
/// assert_eq!(m.t().rows, 3);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    /// The values.
    pub values: Operand<'a>,
    /// Number of rows.
    pub rows: usize,
    /// Number of columns.
    pub cols: usize,
    /// Distance between rows.
    pub row_stride: usize,
    /// Distance between columns.
    pub col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major `rows x cols` view of any operand.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::kernels::{MatRef, Operand};
    /// let v = [1.0f32; 6];
    /// let m = MatRef::row_major(Operand::Bf16(&v), 2, 3);
    /// assert_eq!((m.rows, m.cols, m.row_stride, m.col_stride), (2, 3, 3, 1));
    /// ```
    pub fn row_major(values: Operand<'a>, rows: usize, cols: usize) -> Self {
        Self {
            values,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// A row-major view of f32 values.
    ///
    /// # Examples
    /// ```
    /// let m = mpx_runtime::kernels::MatRef::row_major_f32(&[0.0; 6], 3, 2);
    /// assert_eq!(m.t().rows, 2);
    /// ```
    pub fn row_major_f32(values: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::row_major(Operand::F32(values), rows, cols)
    }

    /// A row-major view of f16 values.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::precision::f16;
    /// let m = mpx_runtime::kernels::MatRef::row_major_f16(&[f16::ONE; 4], 2, 2);
    /// assert_eq!(m.cols, 2);
    /// ```
    pub fn row_major_f16(values: &'a [f16], rows: usize, cols: usize) -> Self {
        Self::row_major(Operand::F16(values), rows, cols)
    }

    /// The transpose: the same values, rows and columns swapped.
    ///
    /// # Examples
    /// ```
    /// let m = mpx_runtime::kernels::MatRef::row_major_f32(&[0.0; 6], 2, 3).t();
    /// assert_eq!((m.rows, m.cols, m.row_stride, m.col_stride), (3, 2, 1, 3));
    /// ```
    #[must_use]
    pub fn t(self) -> Self {
        Self {
            values: self.values,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// Elements the view reaches (0 for an empty matrix).
    pub(crate) fn needed(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride + 1
        }
    }
}
