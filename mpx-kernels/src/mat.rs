//! [`MatRef`]: a strided view of a GEMM operand in f32, f16 or (emulated) bf16.
//!
//! A `MatRef` is valid by construction: its constructors check, with checked arithmetic, that
//! every element its shape and strides reach lies inside its slice, and its fields are private,
//! so no view can name an element past the slice (or an offset past `usize::MAX`).

use super::KernelError;

use crate::FloatSlice;
use half::f16;

/// A `rows x cols` matrix view: element `(i, j)` is `values[i * row_stride + j * col_stride]`.
/// A transpose is the same values with the strides swapped ([`MatRef::t`]).
///
/// # Examples
/// ```
/// use mpx_kernels::{FloatSlice, KernelError, MatRef};
///
/// let w = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
/// let m = MatRef::row_major_f32(&w, 2, 3)?;
/// let t = m.t(); // 3 x 2, the same values
/// assert_eq!((t.rows(), t.cols(), t.row_stride(), t.col_stride()), (3, 2, 1, 3));
/// // every element a view reaches must lie in its slice
/// assert!(matches!(
///     MatRef::new(FloatSlice::F32(&w), 2, 3, 4, 1),
///     Err(KernelError::OperandTooShort { needed: 7, len: 6, .. })
/// ));
/// # Ok::<(), KernelError>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    values: FloatSlice<'a>,
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A `rows x cols` view with element `(i, j)` at `values[i * row_stride + j * col_stride]`.
    ///
    /// # Errors
    /// [`KernelError::OperandTooShort`] if the last element the view reaches lies past the
    /// slice, [`KernelError::OperandOverflow`] if its offset does not even fit in `usize`.
    pub fn new(
        values: FloatSlice<'a>,
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<Self, KernelError> {
        let m = Self {
            values,
            rows,
            cols,
            row_stride,
            col_stride,
        };
        m.validate("operand")?;
        Ok(m)
    }

    /// A row-major `rows x cols` view of any operand.
    ///
    /// # Errors
    /// As [`MatRef::new`]: the slice must hold `rows x cols` values.
    pub fn row_major(
        values: FloatSlice<'a>,
        rows: usize,
        cols: usize,
    ) -> Result<Self, KernelError> {
        Self::new(values, rows, cols, cols, 1)
    }

    /// A row-major view of f32 values.
    ///
    /// # Errors
    /// As [`MatRef::row_major`].
    pub fn row_major_f32(values: &'a [f32], rows: usize, cols: usize) -> Result<Self, KernelError> {
        Self::row_major(FloatSlice::F32(values), rows, cols)
    }

    /// A row-major view of f16 values.
    ///
    /// # Errors
    /// As [`MatRef::row_major`].
    pub fn row_major_f16(values: &'a [f16], rows: usize, cols: usize) -> Result<Self, KernelError> {
        Self::row_major(FloatSlice::F16(values), rows, cols)
    }

    /// The transpose: the same values, rows and columns swapped (valid, as `self` is).
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

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The values.
    pub fn values(&self) -> FloatSlice<'a> {
        self.values
    }

    /// Distance between rows.
    pub fn row_stride(&self) -> usize {
        self.row_stride
    }

    /// Distance between columns.
    pub fn col_stride(&self) -> usize {
        self.col_stride
    }

    /// Elements the view reaches (0 for an empty matrix): `(rows - 1)·row_stride + (cols -
    /// 1)·col_stride + 1`, or `None` if that does not fit in `usize`.
    pub(crate) fn needed(&self) -> Option<usize> {
        if self.rows == 0 || self.cols == 0 {
            return Some(0);
        }
        (self.rows - 1)
            .checked_mul(self.row_stride)?
            .checked_add((self.cols - 1).checked_mul(self.col_stride)?)?
            .checked_add(1)
    }

    /// Checks that every element the view reaches lies inside its slice; `name` names the
    /// operand in the error.
    pub(crate) fn validate(&self, name: &'static str) -> Result<(), KernelError> {
        let len = self.values.len();
        match self.needed() {
            None => Err(KernelError::OperandOverflow {
                name,
                rows: self.rows,
                cols: self.cols,
                row_stride: self.row_stride,
                col_stride: self.col_stride,
            }),
            Some(needed) if needed > len => Err(KernelError::OperandTooShort { name, needed, len }),
            Some(_) => Ok(()),
        }
    }
}
