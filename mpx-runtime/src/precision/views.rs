//! The view pair: a slice of values in some precision, to read ([`FloatSlice`]) or to write
//! ([`FloatSliceMut`]). Every place mpx looks at stored values without knowing their type at
//! compile time takes one of the two: the finiteness checks, the tree visitors of
//! [`FloatLeaves`](crate::cast::FloatLeaves) and the GEMM's operands and destinations.

use half::f16;

/// Values of one precision, to read: what [`Precision::floats`](super::Precision::floats)
/// returns, what the tree visitors pass and what mpx's GEMM multiplies.
///
/// `Bf16` is f32 storage that holds (or is to be read as) emulated bf16 values: the GEMM rounds
/// it to bf16 while packing; bit-level checks read it as the f32 values it stores.
///
/// # Examples
/// ```
/// use mpx_runtime::precision::{AMP, FloatSlice, Precision, bf16, f16};
/// assert!(matches!(f32::floats(&[1.0]), FloatSlice::F32(&[1.0])));
/// assert!(matches!(<AMP<f16>>::floats(&[AMP(f16::ONE)]), FloatSlice::F16(v) if v == [f16::ONE]));
/// assert!(matches!(bf16::floats(&[1.0]), FloatSlice::Bf16(_)));
/// assert_eq!(bf16::floats(&[1.0, 2.0]).len(), 2);
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
    /// use mpx_runtime::precision::FloatSlice;
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
    /// use mpx_runtime::precision::FloatSlice;
    /// assert!(FloatSlice::F16(&[]).is_empty());
    /// ```
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Values of one precision, to write: what [`Precision::floats_mut`](super::Precision::floats_mut)
/// returns, what the in-place visitors
/// ([`FloatLeaves::visit_floats_mut`](crate::cast::FloatLeaves::visit_floats_mut)) pass and where
/// mpx's element-wise kernels write. Emulated bf16 is written as its f32 storage.
///
/// # Examples
/// ```
/// use mpx_runtime::precision::{AMP, FloatSliceMut, Precision, f16};
/// let mut v = [AMP(f16::ONE)];
/// if let FloatSliceMut::F16(h) = <AMP<f16>>::floats_mut(&mut v) {
///     h[0] = f16::from_f32(2.0);
/// }
/// assert_eq!(v[0].0, f16::from_f32(2.0));
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
    /// use mpx_runtime::precision::FloatSliceMut;
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
    /// use mpx_runtime::precision::FloatSliceMut;
    /// assert!(FloatSliceMut::F16(&mut []).is_empty());
    /// ```
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
