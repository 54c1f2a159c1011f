//! How many threads one GEMM may use: the machine's cores by default, capped process-wide with
//! [`set_max_threads`] or forced for the current thread with [`with_threads`].

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::KernelError;

/// The hardware threads this process may use (`std::thread::available_parallelism`, 1 if
/// unknown), read once.
///
/// # Examples
/// ```
/// assert!(mpx_runtime::kernels::available_threads() >= 1);
/// ```
pub fn available_threads() -> usize {
    static AVAILABLE: OnceLock<usize> = OnceLock::new();
    *AVAILABLE
        .get_or_init(|| std::thread::available_parallelism().map_or(1, std::num::NonZero::get))
}

/// 0: not set (all available threads).
static MAX_THREADS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static FORCED: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Caps the threads of every GEMM in the process at `n` (at most [`available_threads`]); `0`
/// restores the default, all available threads. [`with_threads`] overrides this on its thread.
///
/// A product splits only when it is large enough (at least 2^20 multiply-adds) and never into
/// more pieces than it has; each output element is computed by the same instructions in the same
/// order whatever the thread count, so results are bit-identical.
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{available_threads, max_threads, set_max_threads};
/// set_max_threads(1);
/// assert_eq!(max_threads(), 1);
/// set_max_threads(0); // back to the default
/// assert_eq!(max_threads(), available_threads());
/// ```
pub fn set_max_threads(n: usize) {
    MAX_THREADS.store(n, Ordering::Relaxed);
}

/// The threads a GEMM called on this thread may use: the count forced by [`with_threads`], else
/// the cap of [`set_max_threads`], else [`available_threads`]; never more than
/// [`available_threads`].
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{available_threads, max_threads};
/// assert!(max_threads() >= 1 && max_threads() <= available_threads());
/// ```
pub fn max_threads() -> usize {
    let asked =
        FORCED
            .with(Cell::get)
            .unwrap_or_else(|| match MAX_THREADS.load(Ordering::Relaxed) {
                0 => available_threads(),
                n => n,
            });
    asked.clamp(1, available_threads())
}

/// Runs `f` with every GEMM called on this thread (layers included) using at most `n` threads,
/// then restores the previous setting. `n` above [`available_threads`] is clamped to it.
///
/// # Errors
/// [`KernelError::ZeroThreads`] if `n` is 0; `f` does not run.
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{max_threads, with_threads};
/// assert_eq!(with_threads(1, max_threads), Ok(1));
/// assert!(with_threads(0, || ()).is_err());
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
