//! Views between slices of dfdx's `AMP<f16>` and of plain `f16` (feature `amp`): dfdx stores an
//! `AMP<f16>` tensor's values as f16, and every kernel here reads and writes f16.
//!
//! # Safety
//! `AMP<F>` is `#[repr(transparent)]` over `F` (dfdx 0.13, `dtypes/amp.rs`): an `AMP<f16>` has
//! the size, alignment and bit validity of an `f16`, so a slice of one is a slice of the other,
//! of the same length, borrowed for the same lifetime. dfdx offers no safe view of its own.
//!
//! # Examples
//! ```
//! use dfdx::dtypes::AMP;
//! use half::f16;
//!
//! let mut v = [AMP(f16::ONE), AMP(f16::ZERO)];
//! assert_eq!(mpx_kernels::amp::as_f16(&v), [f16::ONE, f16::ZERO]);
//! mpx_kernels::amp::as_f16_mut(&mut v)[1] = f16::from_f32(2.0);
//! assert_eq!(v[1].0, f16::from_f32(2.0));
//! ```

use dfdx::dtypes::AMP;
use half::f16;

/// Views `AMP<f16>` values as plain `f16` (`AMP` is `#[repr(transparent)]`).
///
/// # Examples
/// ```
/// use dfdx::dtypes::AMP;
/// use half::f16;
/// assert_eq!(mpx_kernels::amp::as_f16(&[AMP(f16::ONE)]), [f16::ONE]);
/// ```
pub fn as_f16(src: &[AMP<f16>]) -> &[f16] {
    // SAFETY: AMP<F> is #[repr(transparent)] over F: same size, alignment and valid bit patterns;
    // the pointer and length come from a live slice borrowed for the returned lifetime.
    unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<f16>(), src.len()) }
}

/// Mutable form of [`as_f16`].
///
/// # Examples
/// ```
/// use dfdx::dtypes::AMP;
/// use half::f16;
/// let mut v = [AMP(f16::ONE)];
/// mpx_kernels::amp::as_f16_mut(&mut v)[0] = f16::ZERO;
/// assert_eq!(v[0], AMP(f16::ZERO));
/// ```
pub fn as_f16_mut(src: &mut [AMP<f16>]) -> &mut [f16] {
    // SAFETY: as in `as_f16`; the unique borrow of `src` moves to the result.
    unsafe { std::slice::from_raw_parts_mut(src.as_mut_ptr().cast::<f16>(), src.len()) }
}

/// Views plain `f16` values as `AMP<f16>` (the inverse of [`as_f16_mut`]).
///
/// # Examples
/// ```
/// use dfdx::dtypes::AMP;
/// use half::f16;
/// let mut v = [f16::ONE];
/// mpx_kernels::amp::from_f16_mut(&mut v)[0] = AMP(f16::ZERO);
/// assert_eq!(v[0], f16::ZERO);
/// ```
pub fn from_f16_mut(src: &mut [f16]) -> &mut [AMP<f16>] {
    // SAFETY: as in `as_f16` (every f16 is a valid AMP<f16>); the unique borrow of `src` moves
    // to the result.
    unsafe { std::slice::from_raw_parts_mut(src.as_mut_ptr().cast::<AMP<f16>>(), src.len()) }
}

#[cfg(test)]
mod tests {
    use dfdx::dtypes::AMP;
    use half::f16;

    #[test]
    fn views_keep_the_values_and_the_length_both_ways() {
        let vals: Vec<f16> = (0..37).map(|i| f16::from_f32(i as f32 - 18.5)).collect();
        let mut amp: Vec<AMP<f16>> = vals.iter().copied().map(AMP).collect();
        assert_eq!(super::as_f16(&amp), &vals[..]);
        assert_eq!(super::as_f16(&[]), &[] as &[f16]);
        for h in super::as_f16_mut(&mut amp) {
            *h = -*h;
        }
        assert!(amp.iter().zip(&vals).all(|(a, v)| a.0 == -*v));
        let mut plain = vals.clone();
        let back = super::from_f16_mut(&mut plain);
        assert_eq!(back.len(), vals.len());
        back[3] = AMP(f16::MAX);
        assert_eq!(plain[3], f16::MAX);
    }
}
