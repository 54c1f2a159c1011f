//! [`MatRef`]: a strided view of a GEMM operand in f32, f16 or (emulated) bf16.
//!
//! A `MatRef` is valid by construction: its constructors check, with checked arithmetic, that
//! every element its shape and strides reach lies inside its slice, and its fields are private,
//! so no view can name an element past the slice (or an offset past `usize::MAX`).

use half::f16;

use super::KernelError;

/// The values of an operand and how the kernel reads them.
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{gemm, MatRef, Operand};
/// // 1 + 2^-9 is not a bf16 value: as Bf16 it is read as 1.0
/// let a = [1.0f32 + 1.0 / 512.0];
/// let mut c = [0.0f32];
/// let one = MatRef::row_major_f32(&[1.0], 1, 1).unwrap();
/// gemm(MatRef::row_major(Operand::Bf16(&a), 1, 1).unwrap(), one, &mut c, false).unwrap();
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
/// let m = MatRef::new(Operand::F32(&v), 2, 3, 3, 1).unwrap();
/// assert_eq!(m.t().rows(), 3);
/// // a view reaching past its slice is refused
/// assert!(MatRef::new(Operand::F32(&v), 3, 3, 3, 1).is_err());
/// ```
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    values: Operand<'a>,
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
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::kernels::{KernelError, MatRef, Operand};
    /// let v = [0.0f32; 4];
    /// let e = MatRef::new(Operand::F32(&v), 3, 1, 1 << 63, 1).unwrap_err();
    /// assert!(matches!(e, KernelError::OperandOverflow { .. }));
    /// ```
    pub fn new(
        values: Operand<'a>,
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
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::kernels::{MatRef, Operand};
    /// let v = [1.0f32; 6];
    /// let m = MatRef::row_major(Operand::Bf16(&v), 2, 3).unwrap();
    /// assert_eq!((m.rows(), m.cols()), (2, 3));
    /// assert!(MatRef::row_major(Operand::Bf16(&v), 1 << 63, 2).is_err());
    /// ```
    pub fn row_major(values: Operand<'a>, rows: usize, cols: usize) -> Result<Self, KernelError> {
        Self::new(values, rows, cols, cols, 1)
    }

    /// A row-major view of f32 values.
    ///
    /// # Errors
    /// As [`MatRef::row_major`].
    ///
    /// # Examples
    /// ```
    /// let m = mpx_runtime::kernels::MatRef::row_major_f32(&[0.0; 6], 3, 2).unwrap();
    /// assert_eq!(m.t().rows(), 2);
    /// ```
    pub fn row_major_f32(values: &'a [f32], rows: usize, cols: usize) -> Result<Self, KernelError> {
        Self::row_major(Operand::F32(values), rows, cols)
    }

    /// A row-major view of f16 values.
    ///
    /// # Errors
    /// As [`MatRef::row_major`].
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::precision::f16;
    /// let m = mpx_runtime::kernels::MatRef::row_major_f16(&[f16::ONE; 4], 2, 2).unwrap();
    /// assert_eq!(m.cols(), 2);
    /// ```
    pub fn row_major_f16(values: &'a [f16], rows: usize, cols: usize) -> Result<Self, KernelError> {
        Self::row_major(Operand::F16(values), rows, cols)
    }

    /// The transpose: the same values, rows and columns swapped (valid, as `self` is).
    ///
    /// # Examples
    /// ```
    /// let m = mpx_runtime::kernels::MatRef::row_major_f32(&[0.0; 6], 2, 3).unwrap().t();
    /// assert_eq!((m.rows(), m.cols()), (3, 2));
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

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The values.
    pub(crate) fn values(&self) -> Operand<'a> {
        self.values
    }

    /// Distance between rows.
    pub(crate) fn row_stride(&self) -> usize {
        self.row_stride
    }

    /// Distance between columns.
    pub(crate) fn col_stride(&self) -> usize {
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
