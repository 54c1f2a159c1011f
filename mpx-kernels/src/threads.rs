//! The kernels' thread knobs, all of them: how many threads one GEMM (and one long element-wise
//! pass, [`zip_parts`](crate::zip_parts)) may use, and how a split product reaches its threads.
//! mpx re-exports its knobs in `mpx::settings`, next to the layers' kept buffers.
//!
//! | knob | scope | default |
//! |---|---|---|
//! | [`set_max_threads`] | process-wide cap | 0: all of [`available_threads`] |
//! | [`with_threads`] | the current thread, for one closure | none: the cap |
//! | [`use_scoped_threads`] | process-wide switch, for a benchmark | `false`: the persistent pool |
//!
//! [`max_threads`] reads what they add up to. None of them changes a result's bits: every output
//! element is computed by the same instructions in the same order whatever the thread count.
//!
//! # Examples
//! ```
//! use mpx_kernels::threads::{available_threads, max_threads, set_max_threads, with_threads};
//!
//! set_max_threads(1); // one data-parallel rank per core
//! assert_eq!(max_threads(), 1);
//! set_max_threads(0); // back to every core
//! assert_eq!(max_threads(), available_threads());
//! let n = with_threads(1, max_threads)?;
//! assert_eq!(n, 1);
//! # Ok::<(), mpx_kernels::KernelError>(())
//! ```

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::KernelError;

/// The hardware threads this process may use (`std::thread::available_parallelism`, 1 if
/// unknown), read once.
///
/// # Examples
/// ```
/// assert!(mpx_kernels::threads::available_threads() >= 1);
/// ```
pub fn available_threads() -> usize {
    static AVAILABLE: OnceLock<usize> = OnceLock::new();
    *AVAILABLE
        .get_or_init(|| std::thread::available_parallelism().map_or(1, std::num::NonZero::get))
}

/// The process-wide cap of [`set_max_threads`]; 0 for none.
static CAP: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static FORCED: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Caps the threads of every GEMM in the process at `n`; `0` restores the default (all
/// available threads). [`with_threads`] overrides it on its thread. Results are bit-identical
/// for any count.
///
/// # Examples
/// ```
/// mpx_kernels::threads::set_max_threads(1);
/// assert_eq!(mpx_kernels::threads::max_threads(), 1);
/// mpx_kernels::threads::set_max_threads(0); // back to all cores
/// ```
pub fn set_max_threads(n: usize) {
    CAP.store(n, Ordering::Relaxed);
}

/// The threads a GEMM called on this thread may use: the count forced by [`with_threads`], else
/// the cap of [`set_max_threads`], else [`available_threads`]; never more than
/// [`available_threads`].
///
/// # Examples
/// ```
/// use mpx_kernels::threads::{available_threads, max_threads};
/// assert!((1..=available_threads()).contains(&max_threads()));
/// ```
pub fn max_threads() -> usize {
    FORCED
        .with(Cell::get)
        .unwrap_or_else(|| match CAP.load(Ordering::Relaxed) {
            0 => available_threads(),
            n => n,
        })
        .clamp(1, available_threads())
}

/// Runs `f` with every GEMM called on this thread (layers included) using at most `n` threads,
/// then restores the previous setting. `n` above [`available_threads`] is clamped to it.
///
/// # Errors
/// [`KernelError::ZeroThreads`] if `n` is 0; `f` does not run.
///
/// # Examples
/// ```
/// use mpx_kernels::threads::{max_threads, with_threads};
/// assert_eq!(with_threads(1, max_threads)?, 1);
/// assert!(with_threads(0, || ()).is_err());
/// # Ok::<(), mpx_kernels::KernelError>(())
/// ```
pub fn with_threads<R>(n: usize, f: impl FnOnce() -> R) -> Result<R, KernelError> {
    struct Restore(Option<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|c| c.set(self.0));
        }
    }
    if n == 0 {
        return Err(KernelError::ZeroThreads);
    }
    let _restore = Restore(FORCED.with(|c| c.replace(Some(n))));
    Ok(f())
}

/// Makes split products use `std::thread::scope` (`true`: threads started for each product) or
/// the persistent pool (`false`, the default), process-wide: a switch for the benchmark that
/// compares the two (`examples/bench_kernels`, see the crate docs' [Threads](crate#threads)).
///
/// # Examples
/// ```
/// mpx_kernels::threads::use_scoped_threads(true);
/// mpx_kernels::threads::use_scoped_threads(false); // the pool again
/// ```
pub fn use_scoped_threads(on: bool) {
    SCOPED.store(on, Ordering::Relaxed);
}

/// The switch of [`use_scoped_threads`]; `false` by default.
static SCOPED: AtomicBool = AtomicBool::new(false);

/// Whether split products run on `std::thread::scope` instead of the pool.
pub(crate) fn scoped_threads() -> bool {
    SCOPED.load(Ordering::Relaxed)
}
