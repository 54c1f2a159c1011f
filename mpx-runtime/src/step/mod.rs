//! The mixed-precision step: [`GradScaler`], the state kept across steps like PyTorch's
//! `GradScaler`, and [`Mixed`], a model with the state kept for it.
//!
//! | PyTorch AMP / mpx / jmp | here |
//! |---|---|
//! | `with autocast(): out = model(x)` | [`GradScaler::forward`] |
//! | `scaler.scale(loss).backward()` | [`GradScaler::backward`] |
//! | `scaler.step(opt); scaler.update()` | [`GradScaler::update`] (the scale is adjusted once per iteration) |
//! | `scaler.step(opt)` with an optimizer of one's own | [`GradScaler::update_with`] |
//! | `scaler.state_dict()` / `load_state_dict` | [`GradScaler::state_dict`] / [`GradScaler::load_state_dict`], or serde on the scaler |
//! | `mpx.filter_value_and_grad(func, scaling)(model, batch)` | `forward` + `backward`: the loss is in [`StepReport::loss`], `grads_finite` in [`StepReport::grads_finite`] |
//! | `mpx.optimizer_update(model, optimizer, optimizer_state, grads, grads_finite)` | `update` |
//! | `optax.apply_if_finite(.., max_consecutive_errors)` | [`GradScaler::with_max_consecutive_skips`] (an error, never a bad update) |
//! | `torch.nn.utils.clip_grad_norm_` after `scaler.unscale_(opt)` | [`clip_grad_norm`] (the gradients are already unscaled) |
//! | `scaler.step(opt1); scaler.step(opt2)`, an optimizer for each part of one model | [`GradScaler::forward_parts`] + [`GradScaler::update_part`] with a [`MixedPart`] per part |
//!
//! The state of a step lives in typed values the code names, never in tables found by a
//! model's identity: the scaler holds what spans models (the loss scale, the counters); each
//! master's verdict lives with the master ([`Mixed`], or, in `#[mixed_step]`, a local of the
//! step); each forward pass builds its working copy from the master as it is then, and what
//! its backward needs travels on the tape.
//!
//! # Examples
//! A complete training step, by hand:
//! ```
//! use dfdx::{optim::*, prelude::*};
//! use mpx_runtime::precision::f16;
//! use mpx_runtime::scaling::DynamicLossScale;
//! use mpx_runtime::step::{GradScaler, Mixed};
//!
//! let dev: Cpu = Default::default();
//! type Mlp = (Linear<8, 16>, ReLU, Linear<16, 3>);
//! let mut model = Mixed::new(dev.build_module::<Mlp, f32>());
//! let mut opt = Adam::new(&*model, AdamConfig { lr: 1e-2, ..Default::default() });
//! let mut scaler = GradScaler::<f16>::new(DynamicLossScale::builder().initial(65536.0).build().unwrap());
//!
//! let x: Tensor<Rank2<4, 8>, f32, _> = dev.sample_normal();
//! let labels: Tensor<Rank2<4, 3>, f32, _> = dev.tensor([[1.0, 0.0, 0.0]; 4]);
//! let mut grads = model.alloc_grads();
//! for _ in 0..3 {
//!     let logits = scaler.forward(&model, x.trace(grads), |m, x| m.forward(x))?;
//!     let loss = cross_entropy_with_logits_loss(logits, labels.clone());
//!     grads = scaler.backward(loss)?;
//!     scaler.update(&mut model, &mut opt, &grads)?;
//!     model.zero_grads(&mut grads);
//! }
//! assert_eq!(scaler.applied_steps() + scaler.skipped_steps(), 3);
//! # Ok::<(), mpx_runtime::step::StepError>(())
//! ```

mod checkpoint;
mod clip;
mod device;
mod error;
mod full;
mod half_layers;
mod half_region;
pub(crate) mod iteration;
mod mapped;
mod mixed;
mod outcome;
pub(crate) mod owners;
mod parts;
pub(crate) mod pending;
#[cfg(feature = "mpi")]
mod reducer;
mod report;
mod scaler;
mod streaks;
mod with_scaler;
mod working;

pub use crate::master::link::{Link, Linker};
pub use checkpoint::ScalerState;
pub use clip::{clip_grad_norm, grad_norm};
pub use device::MixedDevice;
pub use error::StepError;
#[doc(hidden)]
pub use full::FullInput;
#[doc(hidden)]
pub use half_layers::BuildCx;
pub use half_layers::HalfLayers;
#[doc(hidden)]
pub use half_region::Region;
pub use half_region::{Batch, HalfInput, HalfOutput};
pub use mixed::Mixed;
pub use outcome::{SkipReason, UpdateOutcome};
pub use owners::Part;
pub use parts::MixedPart;
pub use report::StepReport;
pub use scaler::GradScaler;
#[doc(hidden)]
pub use scaler::Verdict;
pub use with_scaler::WithScaler;
pub use working::{Kind, Mapped, Plain, WorkingCopy};
