//! The mixed-precision step (mpx's steps 3-10): mixed gradients and skip-on-overflow updates.
//!
//! | mpx / jmp / PyTorch | here |
//! |---|---|
//! | `mpx.filter_value_and_grad(func, scaling)(model, batch)` | [`filter_value_and_grad`]`(&master, &mut scaling, &mut workspace, forward, loss)` |
//! | `mpx.filter_grad` | [`filter_grad`] |
//! | `has_aux=True` | [`filter_value_and_grad_with_aux`] |
//! | `mpx.optimizer_update(model, optimizer, optimizer_state, grads, grads_finite)` | [`optimizer_update`]`(&mut master, &mut opt, &grads, grads_finite)` |
//! | `optax.apply_if_finite(.., max_consecutive_errors)` | [`MixedWorkspace::with_max_consecutive_skips`] (an error, never a bad update) |
//! | PyTorch `GradScaler.scale(loss).backward(); scaler.step(opt); scaler.update()` | the same pair of calls |
//!
//! dfdx has no `jit` to fuse casts and free buffers, so the step keeps its buffers in a
//! [`MixedWorkspace`]: the half working copy, its gradients and the f32 master-shaped gradients,
//! reused every step. The model function is split in two at the model output: `forward` runs in
//! half precision on the working copy, `loss` runs in f32 (the loss and its scaling never enter
//! the half graph: 2^16 is already inf in f16).
//!
//! # Examples
//! A complete training step:
//! ```
//! use dfdx::{optim::*, prelude::*};
//! use mpx_runtime::precision::f16;
//! use mpx_runtime::scaling::{DynamicLossScale, LossScale};
//! use mpx_runtime::step::{MixedWorkspace, filter_value_and_grad, optimizer_update};
//!
//! let dev: Cpu = Default::default();
//! type Mlp = (Linear<8, 16>, ReLU, Linear<16, 3>);
//! let mut master = dev.build_module::<Mlp, f32>();
//! let mut opt = Adam::new(&master, AdamConfig { lr: 1e-2, ..Default::default() });
//! let mut ws = MixedWorkspace::<f16, _>::new(&master)?;
//! let mut scaling = DynamicLossScale::builder().initial(65536.0).period(2000).build().unwrap();
//!
//! let x: Tensor<Rank2<4, 8>, f32, _> = dev.sample_normal();
//! let labels: Tensor<Rank2<4, 3>, f32, _> = dev.tensor([[1.0, 0.0, 0.0]; 4]);
//! let x = x.to_dtype::<f16>();
//! for _ in 0..3 {
//!     let grads = filter_value_and_grad(
//!         &master,
//!         &mut scaling,
//!         &mut ws,
//!         |model, tape| model.forward(x.clone().put_tape(tape)),
//!         |logits| cross_entropy_with_logits_loss(logits, labels.clone()),
//!     )?;
//!     let finite = grads.grads_finite;
//!     optimizer_update(&mut master, &mut opt, &grads, finite)?;
//! }
//! assert_eq!(ws.applied_steps() + ws.skipped_steps(), 3);
//! # Ok::<(), mpx_runtime::step::StepError>(())
//! ```

mod clip;
pub(crate) mod direct;
mod error;
mod grads;
mod half_region;
mod report;
mod scaler;
mod update;
mod working;
mod workspace;

pub use clip::{clip_grad_norm, grad_norm};
pub use error::StepError;
pub use grads::{MixedGrads, filter_grad, filter_value_and_grad, filter_value_and_grad_with_aux};
pub use half_region::{HalfInput, HalfOutput, Region};
pub use report::StepReport;
pub use scaler::{GradScaler, MixedScaler, scaler_of};
pub use update::{SkipReason, UpdateOutcome, optimizer_update};
#[cfg(feature = "mpi")]
pub(crate) use workspace::MasterSlot;
pub use workspace::{MixedWorkspace, StepTimings, WorkingCopy};

/// Support for code `#[mixed_step]` generates. Not a public API.
#[doc(hidden)]
pub mod __macro_support {
    /// `(expr).__mpx_by_mut()` borrows a place mutably whether it holds a value or a `&mut`
    /// reference (method-call autoref and reborrow), which a plain `&mut expr` cannot do for an
    /// immutable binding of a `&mut` parameter.
    pub trait ByMut {
        /// The place, mutably.
        fn __mpx_by_mut(&mut self) -> &mut Self {
            self
        }
    }
    impl<T: ?Sized> ByMut for T {}

    /// A shared borrow of what the user passed as the gradients (`&grads`, or a `&mut`
    /// binding, which coerces), without moving a `&mut` binding.
    pub fn shared<T: ?Sized>(t: &T) -> &T {
        t
    }
}
