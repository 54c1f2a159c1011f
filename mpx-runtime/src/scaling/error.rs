//! Errors from building (or deserializing) a loss scale.

/// Why a loss scale could not be built. Each message names the offending value and what is allowed.
///
/// # Examples
/// ```
/// use mpx_runtime::scaling::{DynamicLossScale, LossScaleError};
/// let err = DynamicLossScale::builder().period(0).build().unwrap_err();
/// assert_eq!(err, LossScaleError::ZeroPeriod);
/// assert!(err.to_string().contains("period 0"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum LossScaleError {
    /// A scale value (initial, static, min or max) that is NaN, infinite, zero, negative, or so
    /// small (at most 2^-128) that its reciprocal, the factor unscaling multiplies by, overflows.
    #[error(
        "invalid {name} {value:?}: a loss scale must be a finite number greater than 2^-128 (about 2.94e-39), so that its reciprocal is finite (e.g. 1.0, 32768.0)"
    )]
    InvalidScale {
        /// Which value: `"initial scale"`, `"static scale"`, `"min scale"`, `"max scale"`, or
        /// `"loss scale"` (the current scale of restored state).
        name: &'static str,
        /// The rejected value.
        value: f32,
    },
    /// A growth period of 0 steps.
    #[error(
        "invalid period 0: the period (consecutive finite steps before the scale grows) must be at least 1 (default 2000)"
    )]
    ZeroPeriod,
    /// A growth factor that is not a finite number greater than 1.
    #[error("invalid factor {0:?}: the factor must be a finite number greater than 1 (default 2)")]
    InvalidFactor(f32),
    /// A max scale below the min scale.
    #[error(
        "invalid max scale {max:?}: it is below the min scale {min:?}; the max must be at least the min"
    )]
    MaxBelowMin {
        /// The min scale.
        min: f32,
        /// The rejected max scale.
        max: f32,
    },
    /// A restored counter that is not below the period (only from deserialized state).
    #[error(
        "invalid counter {counter} for period {period}: the counter counts finite steps since the last change and must be below the period"
    )]
    CounterOutOfRange {
        /// The rejected counter.
        counter: u32,
        /// The period it was checked against.
        period: u32,
    },
}

/// Checks that `value` is a usable scale: finite, greater than 0, with a finite reciprocal.
pub(crate) fn check_scale(name: &'static str, value: f32) -> Result<f32, LossScaleError> {
    if value.is_finite() && value > 0.0 && (1.0 / value).is_finite() {
        Ok(value)
    } else {
        Err(LossScaleError::InvalidScale { name, value })
    }
}
