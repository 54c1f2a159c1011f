//! [`DynamicLossScale`]: jmp 0.0.4's dynamic loss scale, with an optional max.

use super::LossScale;
use super::error::{LossScaleError, check_scale};
use serde::{Deserialize, Serialize};

/// Default initial scale, 2^15: the value jmp's `DynamicLossScale` docstring suggests (jmp and mpx
/// have no default; mpx's README starts at `FLOAT16_MAX`, 65504, which makes every later scale a
/// non-power of two and unscaling inexact).
const DEFAULT_INITIAL_SCALE: f32 = 32768.0;
/// Default growth period: 2000 consecutive finite steps (jmp, mpx, PyTorch's `growth_interval`).
const DEFAULT_PERIOD: u32 = 2000;
/// Default growth and backoff factor: 2 (jmp, mpx; PyTorch's `growth_factor = 1 / backoff_factor`).
const DEFAULT_FACTOR: f32 = 2.0;
/// Default min scale: 1 (jmp's `min_loss_scale`).
const DEFAULT_MIN_SCALE: f32 = 1.0;

/// A loss scale that backs off on overflow and grows after `period` finite steps in a row: jmp's
/// `DynamicLossScale`, mpx's `DynamicLossScaling`, PyTorch's `GradScaler`.
///
/// [`adjust`](LossScale::adjust) follows jmp 0.0.4 (eager) bit for bit, in f32 arithmetic:
///
/// ```text
/// finite, counter == period - 1:  scale' = scale * factor   if that is finite, else scale
/// finite, otherwise:              scale' = scale
/// not finite:                     scale' = max(min, scale / factor)      (true f32 division)
/// counter' = ((counter + 1) % period) * finite
/// ```
///
/// so the scale grows on the `period`-th consecutive finite step, and the counter runs
/// `1, ..., period - 1, 0`. An initial scale below `min` is allowed (as in jmp): it rises to `min`
/// at the first backoff.
///
/// **Max scale** (off by default; jmp and PyTorch have none): when set with
/// [`max_scale`](DynamicLossScaleBuilder::max_scale), `scale' = min(scale', max)` on every adjust.
/// mpx always clips to `[min, 65504]`; `.max_scale(65504.0)` (f16's max,
/// `<f16 as HalfPrecision>::MAX`) reproduces mpx's trajectories whenever the scale starts at or
/// above `min` (mpx also raises a scale below `min` on finite steps; we follow jmp there).
///
/// The whole state (scale, counter, period, factor, min, max) serializes with serde and is
/// validated when read back (every field is required; no maximum is `"max_scale": null`), so a restored scale continues the identical trajectory (jmp loses
/// a custom min through pytree round-trips; this does not).
///
/// | jmp / mpx | PyTorch `GradScaler` | here |
/// |---|---|---|
/// | `loss_scale` / `loss_scaling` | `init_scale` | [`initial`](DynamicLossScaleBuilder::initial) |
/// | `period` | `growth_interval` | [`period`](DynamicLossScaleBuilder::period) |
/// | `factor` | `growth_factor`, `backoff_factor = 1/factor` | [`factor`](DynamicLossScaleBuilder::factor) |
/// | `min_loss_scale` / `min_loss_scaling` | – | [`min_scale`](DynamicLossScaleBuilder::min_scale) |
/// | mpx: fixed 65504 | – | [`max_scale`](DynamicLossScaleBuilder::max_scale) (optional) |
/// | `counter` | `_growth_tracker` | [`counter`](DynamicLossScale::counter) |
///
/// # Examples
/// ```
/// use mpx_runtime::scaling::{DynamicLossScale, LossScale};
/// let mut s = DynamicLossScale::builder()
///     .initial(4.0)
///     .period(3)
///     .factor(2.0)
///     .min_scale(1.0)
///     .build()?;
/// for _ in 0..3 {
///     s.adjust(true);
/// }
/// assert_eq!((s.loss_scale(), s.counter()), (8.0, 0));
/// s.adjust(false);
/// assert_eq!(s.loss_scale(), 4.0);
///
/// // Checkpoint and resume.
/// let json = serde_json::to_string(&s).unwrap();
/// let restored: DynamicLossScale = serde_json::from_str(&json).unwrap();
/// assert_eq!(restored, s);
/// # Ok::<(), mpx_runtime::scaling::LossScaleError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "DynamicState", into = "DynamicState")]
pub struct DynamicLossScale {
    loss_scale: f32,
    counter: u32,
    period: u32,
    factor: f32,
    min_scale: f32,
    max_scale: Option<f32>,
}

impl DynamicLossScale {
    /// A builder with the defaults: initial 2^15, period 2000, factor 2, min 1, no max.
    pub fn builder() -> DynamicLossScaleBuilder {
        DynamicLossScaleBuilder::default()
    }

    /// A dynamic scale starting at `initial`, with the other defaults (period 2000, factor 2, min 1,
    /// no max).
    ///
    /// # Errors
    /// [`LossScaleError::InvalidScale`] unless `initial` is finite and greater than 2^-128
    /// (so that its reciprocal is finite).
    pub fn new(initial: f32) -> Result<Self, LossScaleError> {
        Self::builder().initial(initial).build()
    }

    /// The current loss scale. The same as [`LossScale::loss_scale`], callable without the trait
    /// in scope.
    pub fn loss_scale(&self) -> f32 {
        self.loss_scale
    }

    /// jmp's update after a step that was applied (`true`: gradients and loss finite, see
    /// [`step_finite`](super::step_finite)) or skipped (`false`), bit for bit (see the type's
    /// docs), then the optional max clip. A skipped step resets the counter, so it never counts
    /// toward growth. The same as [`LossScale::adjust`], callable without the trait in scope.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::scaling::DynamicLossScale;
    /// let mut s = DynamicLossScale::builder().initial(8.0).period(2).build()?;
    /// s.adjust(true);
    /// assert_eq!((s.loss_scale(), s.counter()), (8.0, 1));
    /// s.adjust(true);
    /// assert_eq!((s.loss_scale(), s.counter()), (16.0, 0));
    /// s.adjust(false);
    /// assert_eq!((s.loss_scale(), s.counter()), (8.0, 0));
    /// # Ok::<(), mpx_runtime::scaling::LossScaleError>(())
    /// ```
    pub fn adjust(&mut self, step_finite: bool) {
        let s = self.loss_scale;
        let mut next = if step_finite {
            if self.counter == self.period - 1 {
                let grown = s * self.factor;
                if grown.is_finite() { grown } else { s }
            } else {
                s
            }
        } else {
            // jnp.maximum(min, s / factor); both operands are finite and positive here.
            let backed_off = s / self.factor;
            if backed_off < self.min_scale {
                self.min_scale
            } else {
                backed_off
            }
        };
        if let Some(max) = self.max_scale
            && next > max
        {
            next = max;
        }
        self.loss_scale = next;
        // counter < period <= u32::MAX, so counter + 1 cannot overflow.
        self.counter = ((self.counter + 1) % self.period) * u32::from(step_finite);
    }

    /// Finite steps since the scale last changed (or since a backoff); always below the period.
    pub fn counter(&self) -> u32 {
        self.counter
    }

    /// Consecutive finite steps after which the scale grows.
    pub fn period(&self) -> u32 {
        self.period
    }

    /// Growth and backoff factor.
    pub fn factor(&self) -> f32 {
        self.factor
    }

    /// The floor a backoff stops at (jmp's `min_loss_scale`).
    pub fn min_scale(&self) -> f32 {
        self.min_scale
    }

    /// The ceiling, if one was set.
    pub fn max_scale(&self) -> Option<f32> {
        self.max_scale
    }
}

impl Default for DynamicLossScale {
    /// Initial 2^15, period 2000, factor 2, min 1, no max.
    fn default() -> Self {
        Self {
            loss_scale: DEFAULT_INITIAL_SCALE,
            counter: 0,
            period: DEFAULT_PERIOD,
            factor: DEFAULT_FACTOR,
            min_scale: DEFAULT_MIN_SCALE,
            max_scale: None,
        }
    }
}

impl LossScale for DynamicLossScale {
    fn loss_scale(&self) -> f32 {
        DynamicLossScale::loss_scale(self)
    }

    /// jmp's update, bit for bit (see the type's docs), then the optional max clip.
    fn adjust(&mut self, step_finite: bool) {
        DynamicLossScale::adjust(self, step_finite);
    }
}

/// Builds a [`DynamicLossScale`], checking every value. Start from [`DynamicLossScale::builder`].
///
/// # Examples
/// ```
/// use mpx_runtime::scaling::{DynamicLossScale, LossScale, LossScaleError};
/// let mpx_like = DynamicLossScale::builder().initial(65504.0).max_scale(65504.0).build()?;
/// assert_eq!(mpx_like.max_scale(), Some(65504.0));
/// let err = DynamicLossScale::builder().factor(1.0).build().unwrap_err();
/// assert_eq!(err, LossScaleError::InvalidFactor(1.0));
/// # Ok::<(), LossScaleError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DynamicLossScaleBuilder {
    initial: f32,
    period: u32,
    factor: f32,
    min_scale: f32,
    max_scale: Option<f32>,
}

impl Default for DynamicLossScaleBuilder {
    fn default() -> Self {
        Self {
            initial: DEFAULT_INITIAL_SCALE,
            period: DEFAULT_PERIOD,
            factor: DEFAULT_FACTOR,
            min_scale: DEFAULT_MIN_SCALE,
            max_scale: None,
        }
    }
}

/// The builder's setters: `name(value: T) => field = expression;` sets one field and hands the
/// builder back; [`build`](DynamicLossScaleBuilder::build) checks the values.
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident($v:ident: $t:ty) => $field:ident = $value:expr;)+) => {$(
        $(#[$doc])*
        #[must_use]
        pub fn $name(mut self, $v: $t) -> Self {
            self.$field = $value;
            self
        }
    )+};
}

impl DynamicLossScaleBuilder {
    setters! {
        /// The starting scale (default 2^15). It may lie below the min scale, as in jmp.
        initial(scale: f32) => initial = scale;
        /// Consecutive finite steps before the scale grows (default 2000; at least 1).
        period(period: u32) => period = period;
        /// Growth and backoff factor (default 2; finite and greater than 1).
        factor(factor: f32) => factor = factor;
        /// The floor a backoff stops at (default 1; finite and greater than 2^-128, so that
        /// its reciprocal is finite).
        min_scale(min: f32) => min_scale = min;
        /// A ceiling applied on every adjust (default: none). `65504.0` gives mpx's clip.
        max_scale(max: f32) => max_scale = Some(max);
    }

    /// Checks the values and builds the scale, with its counter at 0.
    ///
    /// # Errors
    /// - [`LossScaleError::InvalidScale`]: the initial, min or max scale is not finite or not
    ///   greater than 2^-128 (its reciprocal must be finite);
    /// - [`LossScaleError::ZeroPeriod`]: the period is 0;
    /// - [`LossScaleError::InvalidFactor`]: the factor is not finite or not greater than 1;
    /// - [`LossScaleError::MaxBelowMin`]: the max scale is below the min scale.
    pub fn build(self) -> Result<DynamicLossScale, LossScaleError> {
        validate(
            "initial scale",
            DynamicState {
                loss_scale: self.initial,
                counter: 0,
                period: self.period,
                factor: self.factor,
                min_scale: self.min_scale,
                max_scale: self.max_scale,
            },
        )
    }
}

/// Serialized form of [`DynamicLossScale`]: every field, validated when read back. Unknown
/// fields are errors, so a misspelt field (`"maxscale"`) cannot restore silently, and every
/// field is required: "no maximum" is written as `"max_scale": null`, never by leaving the
/// field out (serde would otherwise read a missing `Option` as `None`).
#[derive(Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct DynamicState {
    loss_scale: f32,
    counter: u32,
    period: u32,
    factor: f32,
    min_scale: f32,
    #[serde(deserialize_with = "Option::deserialize")]
    max_scale: Option<f32>,
}

/// Checks every field; `scale_name` names the scale in errors ("initial scale" from the builder,
/// "loss scale" from restored state).
fn validate(
    scale_name: &'static str,
    st: DynamicState,
) -> Result<DynamicLossScale, LossScaleError> {
    let loss_scale = check_scale(scale_name, st.loss_scale)?;
    if st.period == 0 {
        return Err(LossScaleError::ZeroPeriod);
    }
    if !(st.factor.is_finite() && st.factor > 1.0) {
        return Err(LossScaleError::InvalidFactor(st.factor));
    }
    let min_scale = check_scale("min scale", st.min_scale)?;
    if let Some(max) = st.max_scale {
        check_scale("max scale", max)?;
        if max < min_scale {
            return Err(LossScaleError::MaxBelowMin {
                min: min_scale,
                max,
            });
        }
    }
    if st.counter >= st.period {
        return Err(LossScaleError::CounterOutOfRange {
            counter: st.counter,
            period: st.period,
        });
    }
    Ok(DynamicLossScale {
        loss_scale,
        counter: st.counter,
        period: st.period,
        factor: st.factor,
        min_scale,
        max_scale: st.max_scale,
    })
}

impl TryFrom<DynamicState> for DynamicLossScale {
    type Error = LossScaleError;
    fn try_from(st: DynamicState) -> Result<Self, LossScaleError> {
        validate("loss scale", st)
    }
}

impl From<DynamicLossScale> for DynamicState {
    fn from(s: DynamicLossScale) -> Self {
        Self {
            loss_scale: s.loss_scale,
            counter: s.counter,
            period: s.period,
            factor: s.factor,
            min_scale: s.min_scale,
            max_scale: s.max_scale,
        }
    }
}
