//! Where emulated bf16 is in force: the precision dfdx's `Module` runs an `mpx::nn` layer of f32
//! elements in.
//!
//! Emulated [`bf16`](half::bf16) stores its tensors in f32, so a working copy in emulated bf16
//! has the master's element type, and a layer's dfdx `Module` call cannot tell it from an f32
//! run by its types. A mixed step's forward pass in emulated bf16 says so here, for the thread it
//! runs on; an f32 region inside it ([`FullPrecision`](crate::region::FullPrecision)) says f32
//! again. `mpx::nn`'s layers of f32 elements read it in their `Module` impls and run in bf16
//! (products on `vdpbf16ps` where the CPU has it, outputs and gradients rounded to bf16) while
//! it holds; `forward_in::<P, _>` names its precision and does not read it.

use std::cell::Cell;

use super::{DType, Precision};

thread_local! {
    static BF16: Cell<bool> = const { Cell::new(false) };
}

/// Whether dfdx's `Module` calls on this thread run `mpx::nn`'s f32 layers in emulated bf16.
pub(crate) fn f32_runs_as_bf16() -> bool {
    BF16.with(Cell::get)
}

/// Restores the previous setting when dropped (also when the code inside panics).
pub(crate) struct Emulation(bool);

impl Drop for Emulation {
    fn drop(&mut self) {
        BF16.with(|c| c.set(self.0));
    }
}

/// From now until the guard drops, `mpx::nn`'s f32 layers run in `H` where `H` is emulated bf16,
/// and in f32 otherwise (`H = f32` for an f32 region).
pub(crate) fn emulate<H: Precision>() -> Emulation {
    let bf16 = !H::IDENTITY && H::DTYPE == DType::BFloat16;
    Emulation(BF16.with(|c| c.replace(bf16)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precision::{bf16, f16};

    #[test]
    fn the_setting_nests_and_is_restored() {
        assert!(!f32_runs_as_bf16());
        {
            let _outer = emulate::<bf16>();
            assert!(f32_runs_as_bf16());
            {
                let _region = emulate::<f32>();
                assert!(!f32_runs_as_bf16());
            }
            assert!(f32_runs_as_bf16());
            let _f16 = emulate::<f16>();
            assert!(!f32_runs_as_bf16());
        }
        assert!(!f32_runs_as_bf16());
        // other threads are not affected
        let _g = emulate::<bf16>();
        assert!(!std::thread::spawn(f32_runs_as_bf16).join().unwrap());
    }
}
