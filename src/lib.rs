//! # mpx: mixed-precision training for dfdx
//!
//! mpx trains [dfdx](https://docs.rs/dfdx/0.13) 0.13 models the way NVIDIA AMP, PyTorch autocast
//! with `GradScaler`, Google's `jmp` and the JAX library `mpx` do: f32 **master weights**, the
//! forward and backward passes in a **half type** (`f16`, dfdx's `AMP<f16>`, or emulated `bf16`),
//! the loss **scaled** before backward and the gradients **unscaled** after, a **dynamic loss
//! scale**, and the optimizer step **skipped** when the gradients are not finite.
//!
//! Start with the [`prelude`] and [`macro@mixed_step`]: the attribute turns an ordinary f32 dfdx
//! training step into the mixed recipe, and [`GradScaler`](step::GradScaler) keeps its state
//! from step to step.
//!
//! # A converted step
//! The f32 step a dfdx user writes, plus the attribute and the scaler parameter. The forward pass
//! runs in f16 on a working copy of the f32 master, the loss in f32, and the optimizer updates
//! the master only when the step's gradients are finite:
//! ```
//! use dfdx::{optim::*, prelude::*};
//! use mpx::prelude::*;
//!
//! type Mlp = (Linear<4, 16>, ReLU, Linear<16, 2>);
//! type Model = <Mlp as BuildOnDevice<Cpu, f32>>::Built;
//!
//! #[mixed_step(scaling = scaler)] // added
//! fn train_step(
//!     model: &mut Model,
//!     opt: &mut Adam<Model, f32, Cpu>,
//!     x: Tensor<Rank2<8, 4>, f32, Cpu>,
//!     y: Tensor<Rank2<8, 2>, f32, Cpu>,
//!     scaler: &mut GradScaler, // added
//! ) -> f32 {
//!     let grads = model.alloc_grads();
//!     let out = model.forward_mut(x.traced(grads)); // f16 working copy, f32 out
//!     let loss = mse_loss(out, y); // f32
//!     let value = loss.array();
//!     let grads = loss.backward(); // unscaled into the master's f32 gradients
//!     opt.update(model, &grads).unwrap(); // skipped when not finite
//!     value
//! }
//!
//! let dev = Cpu::default();
//! let mut model = dev.build_module::<Mlp, f32>();
//! let mut opt = Adam::new(&model, AdamConfig { lr: 1e-2, ..Default::default() });
//! let mut scaler = GradScaler::new(DynamicLossScale::default());
//! let x: Tensor<Rank2<8, 4>, f32, Cpu> = dev.sample_normal();
//! let y: Tensor<Rank2<8, 2>, f32, Cpu> = dev.sample_normal();
//! let first = train_step(&mut model, &mut opt, x.clone(), y.clone(), &mut scaler);
//! for _ in 0..20 {
//!     train_step(&mut model, &mut opt, x.clone(), y.clone(), &mut scaler);
//! }
//! let last = train_step(&mut model, &mut opt, x, y, &mut scaler);
//! assert!(last < first);
//! assert_eq!(scaler.applied_steps() + scaler.skipped_steps(), 22);
//! ```
//!
//! # A tour
//! | module | what it is for |
//! |---|---|
//! | [`prelude`] | the macros, [`GradScaler`](step::GradScaler), [`DynamicLossScale`](scaling::DynamicLossScale), the precisions and the traits most code needs: `use mpx::prelude::*` |
//! | [`precision`] | the precisions: `f32`, [`f16`](precision::f16), [`AMP<f16>`](precision::AMP) and emulated [`bf16`](precision::bf16), and what each one is (its storage, its rounding) |
//! | [`policy`] | jmp-style precision policies (`"params=float32,compute=float16,output=float32"`) |
//! | [`cast`] | casting any tree (tensors, modules, containers, `#[derive(Cast)]` structs) between precisions |
//! | [`scaling`] | loss scales: [`NoOpLossScale`](scaling::NoOpLossScale), [`StaticLossScale`](scaling::StaticLossScale), [`DynamicLossScale`](scaling::DynamicLossScale) (jmp's semantics, bit for bit) |
//! | [`finite`] | bit-level finiteness checks over slices and trees (`all_finite`) |
//! | [`step`] | the mixed step by hand: [`GradScaler`](step::GradScaler)'s `forward`, `backward` and `update` on a [`Mixed`](step::Mixed) model |
//! | [`region`] | full-precision regions inside a half-precision graph (what `#[full_precision]` and `#[autocast]` generate) |
//! | [`boundary`] | compile-time precision boundaries: a half model where the f32 master belongs is an error that says what to do |
//! | [`nn`] | mixed-ready layers: a fused `Linear`, layer norm, attention, a transformer encoder, a ViT |
//! | [`mx`] | OCP Microscaling (MX) block formats: quantization, fake quantization, `MxLinear` |
//! | [`settings`] | mpx's process-wide settings, all opt-in: how many threads the kernels use ([`set_max_threads`](settings::set_max_threads), [`with_threads`](settings::with_threads)), the layers' buffers kept between steps ([`KeepBuffers`](settings::KeepBuffers)) |
//!
//! The attribute macros ([`macro@mixed_step`], [`macro@full_precision`], [`macro@autocast`],
//! [`derive@Cast`]) generate calls into these modules and nothing else: everything they write can
//! be written by hand (`examples/mixed_step-expanded.rs` shows one expansion in full).
//!
//! # Safety
//! mpx's `unsafe` code (SIMD kernels, slice views, a thread pool) is all in one crate,
//! [`mpx-kernels`](https://docs.rs/mpx-kernels), behind safe functions; its crate docs state how
//! each is made sound. This crate and `mpx-runtime` forbid `unsafe_code` (`mpx-runtime` allows it
//! on one module each with the `cuda` and `mpi` features: see its crate docs).
#![warn(missing_docs, unreachable_pub, clippy::pedantic)]
#![forbid(unsafe_code)]

pub use mpx_macros::{Cast, HalfLayers, autocast, full_precision, half_forward, mixed_step};
/// Data-parallel training over MPI (feature `mpi`): see [`mpx_runtime::distributed`].
#[cfg(feature = "mpi")]
pub use mpx_runtime::distributed;
pub use mpx_runtime::{
    boundary, cast, finite, mx, nn, policy, precision, region, scaling, settings, step,
};

pub mod prelude {
    //! The names most mixed-precision code uses, for a glob import beside dfdx's prelude.
    //!
    //! ```
    //! use dfdx::prelude::*;
    //! use mpx::prelude::*;
    //! ```
    //!
    //! It holds the macros ([`mixed_step`], [`full_precision`], [`autocast`], `derive(Cast)`), the
    //! step's state ([`GradScaler`]) and default loss scale ([`DynamicLossScale`]), the precisions
    //! ([`f16`](struct@f16), [`bf16`], [`AMP`]) and the traits whose methods such code calls: [`LossScale`]
    //! (`loss_scale`, `adjust`), [`Precision`] and [`HalfPrecision`] (bounds of code generic over the
    //! half type) and [`Cast`] (`cast`).
    //!
    //! # Examples
    //! ```
    //! use dfdx::prelude::*;
    //! use mpx::prelude::*;
    //!
    //! let mut scale = DynamicLossScale::builder().initial(1024.0).build()?;
    //! scale.adjust(false); // a non-finite step backs off
    //! assert_eq!(scale.loss_scale(), 512.0);
    //!
    //! let dev = Cpu::default();
    //! let x = dev.tensor([1.0f32, 70000.0]);
    //! let h: Tensor<Rank1<2>, f16, Cpu> = Cast::<f16>::cast(&x);
    //! assert!(h.array()[1].is_infinite()); // past f16's max, 65504
    //! assert_eq!(<bf16 as HalfPrecision>::MAX, 3.389_531_4e38);
    //! # Ok::<(), mpx::scaling::LossScaleError>(())
    //! ```

    pub use mpx_macros::{Cast, autocast, full_precision, mixed_step};
    pub use mpx_runtime::cast::Cast;
    pub use mpx_runtime::precision::{AMP, HalfPrecision, Precision, bf16, f16};
    pub use mpx_runtime::scaling::{DynamicLossScale, LossScale};
    pub use mpx_runtime::step::GradScaler;
}

/// The kernels' benchmark and test hooks (`mpx_runtime::__bench`): the examples and tests that
/// time or force a GEMM path use them. Not a public API.
#[doc(hidden)]
pub use mpx_runtime::__bench;

/// Paths used by macro-generated code. Not a public API.
#[doc(hidden)]
pub mod __private {
    pub use mpx_runtime;
}
