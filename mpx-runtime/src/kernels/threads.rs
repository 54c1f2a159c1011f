//! How many threads one GEMM may use: the machine's cores by default, capped process-wide with
//! [`set_max_threads`] (a data-parallel rank per core wants one), or forced for the current
//! thread with [`with_threads`].

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::KernelError;

/// The hardware threads this process may use (`std::thread::available_parallelism`, 1 if
/// unknown), read once.
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
pub fn set_max_threads(n: usize) {
    CAP.store(n, Ordering::Relaxed);
}

/// The threads a GEMM called on this thread may use: the count forced by [`with_threads`], else
/// the cap of [`set_max_threads`], else [`available_threads`]; never more than
/// [`available_threads`].
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
