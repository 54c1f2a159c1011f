//! Unit tests of the scale checks: reciprocals that must stay finite, strict restored state, and
//! the rule that a skipped step never counts toward growth.

use super::*;

/// 2^-128: the largest power of two whose reciprocal (2^128) overflows f32.
const TWO_POW_MINUS_128: f32 = f32::from_bits(0x0020_0000);

/// The smallest f32 whose reciprocal is finite: the next value above 2^-128.
fn smallest_usable_scale() -> f32 {
    f32::from_bits(TWO_POW_MINUS_128.to_bits() + 1)
}

#[test]
fn the_boundary_is_where_the_reciprocal_overflows() {
    assert_eq!(TWO_POW_MINUS_128, 2f32.powi(-64) * 2f32.powi(-64));
    assert!((1.0 / TWO_POW_MINUS_128).is_infinite());
    assert!((1.0 / smallest_usable_scale()).is_finite());
}

#[test]
fn scales_with_an_infinite_reciprocal_are_rejected_everywhere() {
    let tiny = [1e-40f32, 1e-45, TWO_POW_MINUS_128, f32::from_bits(1)];
    for value in tiny {
        let err = StaticLossScale::new(value).unwrap_err();
        assert_eq!(
            err,
            LossScaleError::InvalidScale {
                name: "static scale",
                value
            }
        );
        let msg = err.to_string();
        assert!(msg.contains("reciprocal"), "{msg}");
        assert!(msg.contains("2^-128"), "{msg}");

        let err = DynamicLossScale::builder()
            .initial(value)
            .build()
            .unwrap_err();
        assert_eq!(
            err,
            LossScaleError::InvalidScale {
                name: "initial scale",
                value
            }
        );
        let err = DynamicLossScale::builder()
            .min_scale(value)
            .build()
            .unwrap_err();
        assert_eq!(
            err,
            LossScaleError::InvalidScale {
                name: "min scale",
                value
            }
        );
        let err = DynamicLossScale::new(value).unwrap_err();
        assert!(matches!(err, LossScaleError::InvalidScale { .. }));

        // Restored state: static, and each scale field of the dynamic state.
        let text = format!(r#"{{"loss_scale":{value:e}}}"#);
        let err = serde_json::from_str::<StaticLossScale>(&text).unwrap_err();
        assert!(err.to_string().contains("reciprocal"), "{err}");
        let good = serde_json::to_value(DynamicLossScale::default()).unwrap();
        for field in ["loss_scale", "min_scale", "max_scale"] {
            let mut bad = good.clone();
            bad[field] = serde_json::json!(value);
            if field == "max_scale" {
                bad["min_scale"] = serde_json::json!(value);
            }
            let err = serde_json::from_value::<DynamicLossScale>(bad).unwrap_err();
            assert!(err.to_string().contains("reciprocal"), "{field}: {err}");
        }
    }
    // The smallest usable scale is accepted everywhere, and its reciprocal is finite.
    let v = smallest_usable_scale();
    assert!(
        StaticLossScale::new(v)
            .unwrap()
            .inv_loss_scale()
            .is_finite()
    );
    let d = DynamicLossScale::builder()
        .initial(v)
        .min_scale(v)
        .max_scale(v)
        .build()
        .unwrap();
    assert!(d.inv_loss_scale().is_finite());
}

#[test]
fn a_dynamic_scale_at_its_minimum_keeps_a_finite_reciprocal() {
    // The issue's scenario: min_scale(1e-45) reached after 128 overflows. Now the smallest min is
    // just above 2^-128, and backing off from 1 for 200 steps stops there.
    let mut s = DynamicLossScale::builder()
        .initial(1.0)
        .min_scale(smallest_usable_scale())
        .build()
        .unwrap();
    for _ in 0..200 {
        s.adjust(false);
        assert!(s.inv_loss_scale().is_finite(), "scale {:e}", s.loss_scale());
    }
    assert_eq!(s.loss_scale(), smallest_usable_scale());
}

/// A user scale that skips the constructors' checks.
struct Unchecked(f32);

impl LossScale for Unchecked {
    fn loss_scale(&self) -> f32 {
        self.0
    }
    fn adjust(&mut self, _step_finite: bool) {}
}

#[test]
fn unscaling_checks_what_is_applied() {
    // 1/1e-40 is inf: finite gradients become inf (or NaN for zeros), and that is reported.
    let grads = vec![1.0f32, 0.0, -2.0];
    let (out, finite) = Unchecked(1e-40).unscale_checked(&grads);
    assert!(!finite, "unscaled {out:?} reported finite");
    let halves = vec![half::f16::ONE, half::f16::ZERO];
    let (_, finite) = Unchecked(1e-40).unscale_checked(&halves);
    assert!(!finite);
    // A scale below 1 whose product overflows f32 is not finite either.
    let (out, finite) = Unchecked(0.5).unscale_checked(&vec![f32::MAX]);
    assert!(out[0].is_infinite());
    assert!(!finite);
    // Finite results stay finite.
    let (out, finite) = Unchecked(4.0).unscale_checked(&vec![8.0f32, -0.0]);
    assert_eq!((out, finite), (vec![2.0, -0.0], true));
}

#[test]
fn restored_state_denies_unknown_fields() {
    // A "maxscale" typo must not restore silently without a maximum.
    let mut v = serde_json::to_value(
        DynamicLossScale::builder()
            .max_scale(65504.0)
            .build()
            .unwrap(),
    )
    .unwrap();
    let max = v["max_scale"].take();
    v.as_object_mut().unwrap().remove("max_scale");
    v["maxscale"] = max;
    let err = serde_json::from_value::<DynamicLossScale>(v)
        .unwrap_err()
        .to_string();
    assert!(err.contains("maxscale"), "{err}");
    let err = serde_json::from_str::<StaticLossScale>(r#"{"loss_scale":2.0,"scale":4.0}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("`scale`"), "{err}");
}

#[test]
fn a_skipped_step_never_counts_toward_growth() {
    // The step's rule: adjust(grads_finite && loss_finite). An inf loss with finite gradients is
    // a skipped step; with period 2, two of them must not take 1024 to 2048.
    let mut s = DynamicLossScale::builder()
        .initial(1024.0)
        .period(2)
        .build()
        .unwrap();
    let (_, grads_finite) = s.unscale_checked(&vec![1024.0f32, 2048.0]);
    let loss = f32::INFINITY;
    assert!(grads_finite);
    for _ in 0..2 {
        s.adjust(step_finite(grads_finite, loss));
    }
    assert_eq!((s.loss_scale(), s.counter()), (256.0, 0));
    // Two applied steps do grow it.
    for _ in 0..2 {
        s.adjust(step_finite(grads_finite, 0.5));
    }
    assert_eq!((s.loss_scale(), s.counter()), (512.0, 0));
}

#[test]
fn restored_dynamic_state_requires_every_field() {
    let good = serde_json::to_value(DynamicLossScale::default()).unwrap();
    assert_eq!(good["max_scale"], serde_json::Value::Null);
    for field in [
        "loss_scale",
        "counter",
        "period",
        "factor",
        "min_scale",
        "max_scale",
    ] {
        let mut bad = good.clone();
        bad.as_object_mut().unwrap().remove(field);
        let err = serde_json::from_value::<DynamicLossScale>(bad).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("missing field `{field}`")),
            "{field}: {err}"
        );
    }
    // An explicit null is "no maximum" and restores.
    let restored: DynamicLossScale = serde_json::from_value(good).unwrap();
    assert_eq!(restored.max_scale(), None);
}
