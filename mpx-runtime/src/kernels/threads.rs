//! How many threads one GEMM may use: the machine's cores by default, or the count forced for the
//! current thread with [`with_threads`].

use std::cell::Cell;
use std::sync::OnceLock;

use super::KernelError;

/// The hardware threads this process may use (`std::thread::available_parallelism`, 1 if
/// unknown), read once.
pub fn available_threads() -> usize {
    static AVAILABLE: OnceLock<usize> = OnceLock::new();
    *AVAILABLE
        .get_or_init(|| std::thread::available_parallelism().map_or(1, std::num::NonZero::get))
}

thread_local! {
    static FORCED: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The threads a GEMM called on this thread may use: the count forced by [`with_threads`], else
/// [`available_threads`]; never more than [`available_threads`].
pub fn max_threads() -> usize {
    FORCED
        .with(Cell::get)
        .unwrap_or_else(available_threads)
        .clamp(1, available_threads())
}

/// Runs `f` with every GEMM called on this thread (layers included) using at most `n` threads,
/// then restores the previous setting. `n` above [`available_threads`] is clamped to it.
///
/// # Errors
/// [`KernelError::ZeroThreads`] if `n` is 0; `f` does not run.
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
