//! The view pair: a slice of values in some precision, to read ([`FloatSlice`]) or to write
//! ([`FloatSliceMut`]). Every place mpx looks at stored values without knowing their type at
//! compile time takes one of the two: the finiteness checks, the tree visitors of mpx's
//! `cast::FloatLeaves`, and here the GEMM's operands and the element-wise passes' destinations.
//! mpx re-exports both from `mpx::precision`, where `Precision::floats` and
//! `Precision::floats_mut` make them from a precision's stored values.

use half::f16;

/// Values of one precision, to read: what mpx's `Precision::floats` returns, what its tree
/// visitors pass and what [`gemm`](crate::gemm) multiplies (through a [`MatRef`](crate::MatRef)).
///
/// `Bf16` is f32 storage that holds (or is to be read as) emulated bf16 values: the GEMM rounds
/// it to bf16 while packing; bit-level checks read it as the f32 values it stores.
///
/// # Examples
/// ```
/// use half::f16;
/// use mpx_kernels::FloatSlice;
/// let h = [f16::ONE, f16::ZERO];
/// assert!(matches!(FloatSlice::F16(&h), FloatSlice::F16(v) if v[0] == f16::ONE));
/// // f32 storage read as bf16 values: the GEMM rounds them to bf16 while packing
/// assert_eq!(FloatSlice::Bf16(&[1.0, 2.0]).len(), 2);
/// ```
#[derive(Debug, Clone, Copy)]
pub enum FloatSlice<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// f16 values (also `AMP<f16>`, viewed as f16).
    F16(&'a [f16]),
    /// f32 storage of emulated bf16 values.
    Bf16(&'a [f32]),
}

impl FloatSlice<'_> {
    /// Number of values.
    ///
    /// # Examples
    /// ```
    /// use mpx_kernels::FloatSlice;
    /// assert_eq!(FloatSlice::F32(&[1.0, 2.0]).len(), 2);
    /// ```
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            FloatSlice::F32(v) | FloatSlice::Bf16(v) => v.len(),
            FloatSlice::F16(v) => v.len(),
        }
    }

    /// `true` when there are no values.
    ///
    /// # Examples
    /// ```
    /// use mpx_kernels::FloatSlice;
    /// assert!(FloatSlice::F16(&[]).is_empty());
    /// ```
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Values of one precision, to write: what mpx's `Precision::floats_mut` returns, what its
/// in-place visitors (`FloatLeaves::visit_floats_mut`) pass and where the element-wise passes
/// ([`bias_act_into`](crate::bias_act_into), [`add_f32_into`](crate::add_f32_into)) write.
/// Emulated bf16 is written as its f32 storage.
///
/// # Examples
/// ```
/// use half::f16;
/// use mpx_kernels::{FloatSliceMut, add_f32_into};
/// let mut v = [f16::ONE];
/// add_f32_into(&[1.0], FloatSliceMut::F16(&mut v))?;
/// assert_eq!(v[0], f16::from_f32(2.0));
/// # Ok::<(), mpx_kernels::KernelError>(())
/// ```
#[derive(Debug)]
pub enum FloatSliceMut<'a> {
    /// f32 values (also emulated bf16).
    F32(&'a mut [f32]),
    /// f16 values (also `AMP<f16>`, viewed as f16).
    F16(&'a mut [f16]),
}

impl FloatSliceMut<'_> {
    /// Number of values.
    ///
    /// # Examples
    /// ```
    /// use mpx_kernels::FloatSliceMut;
    /// assert_eq!(FloatSliceMut::F32(&mut [1.0, 2.0]).len(), 2);
    /// ```
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            FloatSliceMut::F32(v) => v.len(),
            FloatSliceMut::F16(v) => v.len(),
        }
    }

    /// `true` when there are no values.
    ///
    /// # Examples
    /// ```
    /// use mpx_kernels::FloatSliceMut;
    /// assert!(FloatSliceMut::F16(&mut []).is_empty());
    /// ```
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
