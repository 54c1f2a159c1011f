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
