//! [`KernelError`]: what a kernel call rejects.

use super::KernelPath;

/// A kernel call with operands that do not fit together, or a path the CPU lacks.
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{gemm, KernelError, MatRef};
/// let a = [0.0f32; 6];
/// let mut c = [0.0f32; 4];
/// let e = gemm(MatRef::row_major_f32(&a, 2, 3), MatRef::row_major_f32(&a, 2, 3), &mut c, false);
/// assert!(matches!(e, Err(KernelError::InnerMismatch { .. })));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The inner dimensions of `A` (m x k) and `B` (k x n) differ.
    #[error(
        "GEMM inner dimensions differ: A is {a_rows}x{a_cols}, B is {b_rows}x{b_cols}; A's columns must equal B's rows"
    )]
    InnerMismatch {
        /// Rows of A.
        a_rows: usize,
        /// Columns of A.
        a_cols: usize,
        /// Rows of B.
        b_rows: usize,
        /// Columns of B.
        b_cols: usize,
    },
    /// An operand's slice is too short for its shape and strides.
    #[error(
        "GEMM operand {name} needs {needed} elements for its shape and strides, the slice has {len}"
    )]
    OperandTooShort {
        /// "A" or "B".
        name: &'static str,
        /// Elements the shape and strides reach.
        needed: usize,
        /// Elements present.
        len: usize,
    },
    /// The output slice does not hold m x n values.
    #[error("GEMM output holds {len} values, expected m x n = {m}x{n}")]
    OutputLength {
        /// Rows of C.
        m: usize,
        /// Columns of C.
        n: usize,
        /// Values in the slice.
        len: usize,
    },
    /// Slices of one element-wise pass differ in length.
    #[error("element-wise pass: {what} has {len} values, expected {expected}")]
    Length {
        /// Which slice.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The length required.
        expected: usize,
    },
    /// A thread count of zero was asked for.
    #[error(
        "GEMM thread count must be at least 1 (it is capped at the machine's available parallelism)"
    )]
    ZeroThreads,
    /// The CPU lacks the instructions of the forced path.
    #[error(
        "kernel path {path:?} needs CPU features this CPU lacks; supported here: {supported:?}"
    )]
    Unsupported {
        /// The path asked for.
        path: KernelPath,
        /// The paths this CPU runs.
        supported: Vec<KernelPath>,
    },
}
