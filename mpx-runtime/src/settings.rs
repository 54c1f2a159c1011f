//! mpx's process-wide settings, all of them, each off or at its default until a program asks:
//! how many threads the kernels use, and whether mpx's layers keep their freed buffers between
//! steps. Constructing a scaler or running a layer changes none of them.
//!
//! | setting | scope | default |
//! |---|---|---|
//! | [`set_max_threads`] | process-wide cap on the threads of one product | 0: all of [`available_threads`] |
//! | [`with_threads`] | the current thread, for one closure | none: the cap |
//! | [`use_scoped_threads`] | process-wide switch, for a benchmark | `false`: the kernels' persistent pool |
//! | [`KeepBuffers`] | while a value lives | none: freed buffers go back to the allocator |
//!
//! [`max_threads`] reads what the thread settings add up to. None of them changes a result's
//! bits.
//!
//! # Examples
//! ```
//! use mpx_runtime::settings::{KeepBuffers, available_threads, max_threads, set_max_threads};
//! set_max_threads(1); // one data-parallel rank per core
//! assert_eq!(max_threads(), 1);
//! set_max_threads(0); // back to every core
//! assert_eq!(max_threads(), available_threads());
//! let _keep = KeepBuffers::new(); // keep the layers' buffers from step to step
//! ```

pub use crate::nn::scratch::KeepBuffers;
pub use mpx_kernels::threads::{
    available_threads, max_threads, set_max_threads, use_scoped_threads, with_threads,
};
