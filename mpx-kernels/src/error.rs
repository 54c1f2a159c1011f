//! [`KernelError`]: what a kernel call rejects.

use super::KernelPath;

/// A kernel call with operands that do not fit together, or a path the CPU lacks.
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
    /// An operand's shape and strides reach an element whose offset does not fit in `usize`: no
    /// slice can hold it.
    #[error(
        "GEMM operand {name} is {rows}x{cols} with row stride {row_stride} and column stride {col_stride}: its last element's offset overflows usize"
    )]
    OperandOverflow {
        /// "A", "B" or "operand".
        name: &'static str,
        /// Rows of the view.
        rows: usize,
        /// Columns of the view.
        cols: usize,
        /// Distance between rows.
        row_stride: usize,
        /// Distance between columns.
        col_stride: usize,
    },
    /// The output slice does not hold m x n values (or m x n overflows `usize`).
    #[error("GEMM output holds {len} values, expected m x n = {m}x{n} values")]
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
    /// A row length of zero was given to an element-wise pass (an empty bias or bias gradient).
    #[error(
        "element-wise pass: {what} is empty; it sets the row length and must hold at least one value"
    )]
    EmptyRow {
        /// Which slice.
        what: &'static str,
    },
    /// A slice of an element-wise pass is not a whole number of rows.
    #[error(
        "element-wise pass: {what} has {len} values, not a whole number of rows of {row_len} (the length of {row_what})"
    )]
    NotWholeRows {
        /// Which slice.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The row length.
        row_len: usize,
        /// The slice that sets the row length.
        row_what: &'static str,
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
