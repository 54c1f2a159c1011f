//! Helpers shared by the integration tests (`mod common;` in a test file). Each test binary uses
//! the part it needs, so the rest is dead code there.
#![allow(dead_code)]

pub mod bits;
pub mod compare;
pub mod digits;
pub mod grads;
pub mod heap;
pub mod mlp;
pub mod params;
