//! [`Operand`]: a slice of values in some precision, as mpx's GEMM reads it.

use half::f16;

/// The values of an operand and how the kernel reads them.
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
