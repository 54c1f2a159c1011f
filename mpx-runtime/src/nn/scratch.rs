//! The fused ops' buffers, kept across steps: the operand copies a forward pass keeps for its
//! backward, the copied output gradient, and the f32 sums of the GEMMs.
//!
//! A training step asks for buffers of the same sizes every time, and most of them are large
//! (the layer's input, its weight, its f32 weight gradient). Allocating them anew each step costs
//! a page fault for every 4 KiB the first write touches, so the ops take them from one
//! process-wide pool and give them back when done ([`Buf`]'s `drop`). The pool only grows: after
//! the first step it holds what the ops held at once at their peak, and later steps take those
//! buffers again (best fit by capacity) without allocating. Buffers under 64 KiB skip the pool:
//! the allocator keeps such blocks itself, and its fast path costs less than the pool's lock.
//!
//! A buffer's contents are whatever its last user left: every caller overwrites the values it
//! reads (a copy, or a GEMM with `accumulate = false`), or clears them first.

use std::any::Any;
use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, PoisonError};

/// Buffers below this many bytes are allocated and freed as they come: the allocator serves
/// them from memory it keeps (no page faults), faster than the pool's lock and search.
const SMALL_BYTES: usize = 64 << 10;

/// Whether `n` values of `T` are a small buffer (see [`SMALL_BYTES`]).
fn small<T>(n: usize) -> bool {
    n.saturating_mul(std::mem::size_of::<T>()) < SMALL_BYTES
}

/// Most buffers the pool keeps; beyond that a returned buffer is freed (a bound for programs that
/// run many different models at once, far above what one model's step holds).
const MAX_KEPT: usize = 256;

/// The free buffers, each a `Vec<T>` for one of the ops' element types.
static POOL: Mutex<Vec<Box<dyn Any + Send>>> = Mutex::new(Vec::new());

/// `n` values of type `T` from the pool (returned to it on drop). The values are stale: the
/// caller overwrites them.
pub(crate) struct Buf<T: Copy + Default + Send + 'static> {
    /// Initialised up to its capacity (see [`take`]); the buffer is its first `n` values.
    values: Vec<T>,
    n: usize,
}

/// A buffer of `n` values (see [`Buf`]): the pool's best fit of element type `T` (the smallest
/// capacity that holds `n`, else the largest, grown), or a new one.
pub(crate) fn take<T: Copy + Default + Send + 'static>(n: usize) -> Buf<T> {
    if small::<T>(n) {
        return Buf {
            values: vec![T::default(); n],
            n,
        };
    }
    let found = {
        let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
        let mut best: Option<(usize, usize)> = None;
        for (i, b) in pool.iter().enumerate() {
            let Some(v) = b.downcast_ref::<Vec<T>>() else {
                continue;
            };
            let cap = v.capacity();
            let better = match best {
                None => true,
                Some((_, best_cap)) if best_cap >= n => cap >= n && cap < best_cap,
                Some((_, best_cap)) => cap > best_cap,
            };
            if better {
                best = Some((i, cap));
            }
        }
        best.map(|(i, _)| pool.swap_remove(i))
    };
    let mut values = found
        .and_then(|b| b.downcast::<Vec<T>>().ok())
        .map_or_else(Vec::new, |b| *b);
    // A pooled vector stays initialised up to its capacity, so a buffer taken for fewer values
    // and then for more again writes nothing: only growth writes its new tail, once.
    if values.len() < n {
        // exact: a doubled capacity would hold (and write) up to twice what is asked
        values.reserve_exact(n - values.len());
        values.resize(n, T::default());
        values.resize(values.capacity(), T::default());
    }
    Buf { values, n }
}

/// Frees the buffers mpx's fused layers keep between steps (their operand copies and work
/// buffers; see [`Linear`](crate::nn::Linear)); the next forward pass allocates them again.
///
/// The pool only grows while training: it holds what the fused ops of one step held at once at
/// their peak. Call this when a program is done with a model (or before measuring the heap one
/// step needs), not between steps.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::{self, builders};
/// use mpx_runtime::precision::f16;
/// let dev = Cpu::default();
/// let l = dev.build_module::<builders::Linear<64, 64>, f16>();
/// let x: Tensor<Rank2<8, 64>, f32, Cpu> = dev.sample_normal();
/// let y = l.forward(x.to_dtype::<f16>().leaky_trace());
/// let _grads = y.sum().backward(); // the op's buffers went back to the pool
/// nn::release_buffers();
/// ```
pub fn release_buffers() {
    POOL.lock().unwrap_or_else(PoisonError::into_inner).clear();
}

/// A zeroed buffer of `n` values (for sums that are added to).
pub(crate) fn take_zeroed<T: Copy + Default + Send + 'static>(n: usize) -> Buf<T> {
    let mut b = take(n);
    b.fill(T::default());
    b
}

impl<T: Copy + Default + Send + 'static> Deref for Buf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.values[..self.n]
    }
}

impl<T: Copy + Default + Send + 'static> DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.values[..self.n]
    }
}

impl<T: Copy + Default + Send + 'static> Drop for Buf<T> {
    fn drop(&mut self) {
        let values = std::mem::take(&mut self.values);
        if values.capacity() == 0 || small::<T>(values.capacity()) {
            return;
        }
        let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.len() < MAX_KEPT {
            pool.push(Box::new(values));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Element types of their own, so that tests running at the same time share no buffers.
    #[derive(Clone, Copy, Default, PartialEq, Debug)]
    struct A(u8);
    #[derive(Clone, Copy, Default)]
    struct B(#[allow(dead_code, reason = "a value of some size; never read")] u64);

    #[test]
    fn a_returned_buffer_is_taken_again_without_allocating() {
        let n = 123_457;
        let first = take::<A>(n);
        let at = first.as_ptr();
        drop(first);
        let mut again = take::<A>(n - 7);
        assert_eq!(again.as_ptr(), at, "the same allocation is reused");
        assert_eq!(again.len(), n - 7);
        again[0] = A(9);
        drop(again);
        let zeroed = take_zeroed::<A>(5);
        assert_eq!(&zeroed[..], &[A(0); 5]);
    }

    #[test]
    fn a_shorter_take_does_not_make_the_next_longer_one_write_its_tail() {
        // element type of its own (see above)
        #[derive(Clone, Copy, Default, PartialEq, Debug)]
        struct C(u16);
        // both takes above the small-buffer bound
        let n = 150_021;
        let mut first = take::<C>(n);
        first.fill(C(7));
        let at = first.as_ptr();
        drop(first);
        drop(take::<C>(n / 3));
        let again = take::<C>(n);
        assert_eq!(again.as_ptr(), at);
        // stale values, as documented: nothing rewrote the tail the short take left out
        assert!(again.iter().all(|&v| v == C(7)));
    }

    #[test]
    fn the_best_fit_is_the_smallest_buffer_that_holds_the_request() {
        let (a, b) = (take::<B>(1_000_003), take::<B>(2_000_003));
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        drop((a, b));
        let small = take::<B>(999_999);
        let large = take::<B>(1_999_999);
        assert_eq!((small.as_ptr(), large.as_ptr()), (pa, pb));
    }

    #[test]
    fn a_small_buffer_never_enters_the_pool() {
        #[derive(Clone, Copy, Default, PartialEq, Debug)]
        struct D(u32);
        let n = SMALL_BYTES / 4 - 1;
        let b = take::<D>(n);
        assert_eq!(b.len(), n);
        drop(b);
        let pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
        assert!(!pool.iter().any(|b| b.is::<Vec<D>>()));
    }
}
