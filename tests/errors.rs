//! Error chains: every error that wraps another exposes it as `source()` and does not print it
//! again in its own message (a reporter that walks the chain would show it twice).

use std::error::Error;

use dfdx::optim::{OptimizerUpdateError, UnusedTensors};
use dfdx::tensor::CpuError;
use mpx::cast::CastError;
use mpx::region::RegionError;
use mpx::step::StepError;

/// Walks the chain: each level has a source where expected, and never repeats its source's text.
fn assert_chain(err: &dyn Error, depth: usize) {
    let mut cur = err;
    for level in 0..depth {
        let src = cur
            .source()
            .unwrap_or_else(|| panic!("level {level} of {err} has no source"));
        let (own, inner) = (cur.to_string(), src.to_string());
        assert!(
            !own.contains(&inner),
            "level {level} prints its source again: {own:?} contains {inner:?}"
        );
        cur = src;
    }
}

#[test]
fn wrapped_errors_keep_their_source_and_print_it_once() {
    assert_chain(&StepError::from(CpuError::OutOfMemory), 1);
    assert_chain(&StepError::from(CastError::NotRebuilt), 1);
    assert_chain(&RegionError::from(CpuError::OutOfMemory), 1);
    let unused = OptimizerUpdateError::UnusedParams(UnusedTensors::default());
    assert_chain(&StepError::Optimizer(unused), 1);
    let device = OptimizerUpdateError::DeviceError(CpuError::OutOfMemory);
    let err = StepError::Optimizer(device);
    assert_chain(&err, 1);
    assert_eq!(
        err.source().map(ToString::to_string),
        Some(CpuError::OutOfMemory.to_string())
    );
}

#[test]
fn leaf_errors_have_no_source() {
    assert!(RegionError::NotRebuilt.source().is_none());
    assert!(CastError::NotRebuilt.source().is_none());
}

#[test]
fn device_errors_convert_into_cpu_error_as_themselves() {
    let err = StepError::from(CpuError::OutOfMemory);
    assert!(matches!(CpuError::from(err), CpuError::OutOfMemory));
    let inside_optimizer =
        StepError::Optimizer(OptimizerUpdateError::DeviceError(CpuError::OutOfMemory));
    assert!(matches!(
        CpuError::from(inside_optimizer),
        CpuError::OutOfMemory
    ));
}

#[test]
fn layout_errors_convert_into_cpu_error_as_wrong_num_elements() {
    let mismatch = StepError::MasterChanged { model: "Mlp" };
    assert!(matches!(
        CpuError::from(mismatch),
        CpuError::WrongNumElements
    ));
    let unused = StepError::Optimizer(OptimizerUpdateError::UnusedParams(UnusedTensors::default()));
    assert!(matches!(CpuError::from(unused), CpuError::WrongNumElements));
}

#[test]
#[should_panic(expected = "3 consecutive steps were skipped (limit 2)")]
fn too_many_skips_is_not_reported_as_a_shape_error() {
    let err = StepError::TooManySkips {
        consecutive: 3,
        limit: 2,
        scale: 1.0,
    };
    let _ = CpuError::from(err);
}

#[test]
#[should_panic(expected = "the loss scale must be finite and greater than 0, got NaN")]
fn an_invalid_scale_is_not_reported_as_a_shape_error() {
    let _ = CpuError::from(StepError::InvalidScale { scale: f32::NAN });
}
