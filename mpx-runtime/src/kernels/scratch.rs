//! Reusable f32 scratch for GEMM outputs: buffers kept by each thread across calls and only ever
//! grown, so a training step that needs the same scratch every step allocates it once and
//! touches its pages once (a buffer allocated anew per call is zero-filled, or first touched by
//! the GEMM, every step: page faults on every call).
//!
//! Each thread keeps a small stack of buffers: a call takes the top one (or a new one), grows it
//! to the size asked for if it is shorter, and puts it back when done, so nested calls get
//! distinct buffers and a thread holds, per nesting level, the largest scratch it has used.

use std::cell::RefCell;

thread_local! {
    static FREE: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on `n` f32 values of this thread's reusable scratch. Their contents are whatever the
/// last use left (zero the first time): `f` must overwrite them, as a GEMM with
/// `accumulate = false` does.
pub(crate) fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    // put back on every return path, a panic in `f` included
    struct Return(Vec<f32>);
    impl Drop for Return {
        fn drop(&mut self) {
            let buf = std::mem::take(&mut self.0);
            // a thread being torn down has no free list left to return to: drop the buffer
            let _ = FREE.try_with(|free| free.borrow_mut().push(buf));
        }
    }
    let mut buf = FREE
        .with(|free| free.borrow_mut().pop())
        .unwrap_or_default();
    if buf.len() < n {
        buf.resize(n, 0.0);
    }
    let mut held = Return(buf);
    f(&mut held.0[..n])
}

#[cfg(test)]
mod tests {
    use super::with_scratch;

    #[test]
    fn scratch_is_reused_across_calls_and_grown_only() {
        let (p1, cap1) = with_scratch(1000, |s| {
            s.fill(1.0);
            (s.as_ptr(), 1000)
        });
        // a smaller request reuses the same buffer, unzeroed (the caller overwrites it)
        let (p2, first) = with_scratch(10, |s| (s.as_ptr(), s[0]));
        assert_eq!(p1, p2);
        assert_eq!(first, 1.0);
        // a larger one grows it; then a request of the first size gets the grown buffer
        let p3 = with_scratch(cap1 * 4, |s| {
            assert_eq!(s.len(), cap1 * 4);
            s.as_ptr()
        });
        assert_eq!(with_scratch(cap1, |s| s.as_ptr()), p3);
    }

    #[test]
    fn nested_calls_get_distinct_buffers() {
        with_scratch(64, |outer| {
            outer.fill(2.0);
            with_scratch(64, |inner| {
                assert_ne!(outer.as_ptr(), inner.as_ptr());
                inner.fill(3.0);
            });
            assert!(outer.iter().all(|&x| x == 2.0));
        });
    }

    #[test]
    fn a_panic_returns_the_buffer() {
        let p = with_scratch(256, |s| s.as_ptr());
        let r = std::panic::catch_unwind(|| with_scratch(256, |_| panic!("inside")));
        assert!(r.is_err());
        assert_eq!(with_scratch(256, |s| s.as_ptr()), p);
    }
}
