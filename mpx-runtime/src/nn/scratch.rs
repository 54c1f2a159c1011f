//! The fused ops' buffers: the operand copies a forward pass keeps for its backward, the copied
//! output gradient, and the f32 sums of the GEMMs; and the host copies a mixed step reads its
//! half region's inputs and outputs through.
//!
//! A training step asks for buffers of the same sizes every time, and some are large (the
//! layer's input, its weight, its f32 weight gradient). By default each comes from the
//! allocator and goes back to it when the op is done ([`Buf`]'s `drop`): mpx keeps nothing
//! between steps. A program that wants the buffers kept (a fresh large block costs a page fault
//! for every 4 KiB its first write touches) holds a [`KeepBuffers`]: while one lives, returned
//! buffers go to a pool and later steps take them again (best fit by capacity) without
//! allocating; when the last one is dropped, the pool is freed. Buffers under 64 KiB never enter
//! the pool: the allocator keeps such blocks itself, and its fast path costs less than the
//! pool's lock.
//!
//! A buffer's contents are whatever its last user left: every caller overwrites the values it
//! reads (a copy, or a GEMM with `accumulate = false`), or clears them first.
//!
//! A buffer of at most 32 values (a tiny model's: a 2-2-1 net's weights and sums) lives inside
//! its `Buf`, with no allocation: the 2-2-1 step of `bench_step_overhead` went from 1.99 to 1.85
//! of f32 with it (2-core Zen 5, the runs at `77ef25f` and `a6fa813`).

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

/// The kept buffers and how many [`KeepBuffers`] values keep them.
struct Pool {
    holders: usize,
    /// Each a `Vec<T>` for one of the ops' element types.
    free: Vec<Box<dyn Any + Send>>,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    holders: 0,
    free: Vec::new(),
});

fn pool() -> std::sync::MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// While a `KeepBuffers` lives, the buffers mpx's fused layers free at the end of a step (their
/// operand copies, output-gradient copies and f32 sums, from 64 KiB up) are kept for the next
/// step instead of going back to the allocator; dropping the last one frees them. Off by default:
/// mpx keeps no memory a program did not ask it to keep.
///
/// Measure before keeping it: it depends on what else the step allocates. On a 2-core Zen 5 the
/// f16 step of `cargo run --release --example bench_transformer` runs at x0.31 of f32 without it
/// and x0.25 with it (`-- --keep-buffers`; `docs/benchmarks.md`, at `a6fa813`). The MLP of
/// `bench_step` (row f, 512-1024-1024-10 at batch 256) is slower with it: x1.07 to x1.09 of the
/// step without it in three lock-step runs of four (x0.97 in the fourth; `bench_step --serve
/// --keep-buffers` against `--serve`). Its steps also allocate large dfdx tensors, and with the
/// layers' buffers held back, the C allocator returns memory to the system and takes it again:
/// 200 steps in that server, which holds three other models, took 91K page faults with it and
/// 25K without (alone in its process, `bench_faults`, the row takes none either way). The kept
/// memory is what one step's fused ops held at once at their peak (at most 256 buffers).
/// Results are the same with or without it.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::builders;
/// use mpx_runtime::precision::f16;
/// use mpx_runtime::settings::KeepBuffers;
/// let dev = Cpu::default();
/// let l = dev.build_module::<builders::Linear<256, 256>, f16>();
/// let keep = KeepBuffers::new(); // for the whole training run
/// for _ in 0..2 {
///     let x: Tensor<Rank2<64, 256>, f32, Cpu> = dev.sample_normal();
///     let _grads = l.forward(x.to_dtype::<f16>().leaky_trace()).sum().backward();
/// } // the second step reused the first one's buffers
/// drop(keep); // the kept buffers are freed
/// ```
#[must_use = "buffers are kept only while the value lives"]
#[derive(Debug)]
pub struct KeepBuffers(());

impl KeepBuffers {
    /// Starts keeping freed buffers (see [`KeepBuffers`]).
    pub fn new() -> Self {
        pool().holders += 1;
        Self(())
    }
}

impl Default for KeepBuffers {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for KeepBuffers {
    fn drop(&mut self) {
        let freed = {
            let mut pool = pool();
            pool.holders -= 1;
            if pool.holders == 0 {
                std::mem::take(&mut pool.free)
            } else {
                Vec::new()
            }
        };
        drop(freed); // outside the lock
    }
}

/// `n` values of type `T` from the pool (returned to it on drop). The values are stale: the
/// caller overwrites them.
pub(crate) struct Buf<T: Copy + Default + Send + 'static> {
    values: Values<T>,
    /// The buffer is the first `n` values.
    n: usize,
}

/// Where a [`Buf`]'s values are.
enum Values<T> {
    /// A buffer of at most [`INLINE`] values (a tiny model's), in place: no allocation at all.
    Inline([T; INLINE]),
    /// Initialised up to its capacity (see [`take`]).
    Heap(Vec<T>),
}

/// Buffers of at most this many values live inside the [`Buf`] itself.
const INLINE: usize = 32;

/// Values an activation's backward pass works on at a time (8 KiB of f32 per buffer), so that
/// no pass holds an f32 copy of a whole gradient at the step's peak.
pub(crate) const CHUNK: usize = 2048;

/// A buffer of `n` values (see [`Buf`]): the pool's best fit of element type `T` ([`pooled`]),
/// or a new one as `vec!` makes it (a zeroed allocation where the type allows, f32, which the
/// allocator need not clear when the memory is fresh from the system).
pub(crate) fn take<T: Copy + Default + Send + 'static>(n: usize) -> Buf<T> {
    if n <= INLINE {
        return Buf {
            values: Values::Inline([T::default(); INLINE]),
            n,
        };
    }
    let values = pooled(n).unwrap_or_else(|| vec![T::default(); n]);
    Buf {
        values: Values::Heap(values),
        n,
    }
}

/// A buffer holding a copy of `values`: a pooled one overwritten, else new memory the copy is
/// the first to write (no clearing first).
pub(crate) fn copy_of<T: Copy + Default + Send + 'static>(values: &[T]) -> Buf<T> {
    let n = values.len();
    if n <= INLINE {
        let mut b = take(n);
        b.copy_from_slice(values);
        return b;
    }
    let values = match pooled(n) {
        Some(mut v) => {
            v[..n].copy_from_slice(values);
            v
        }
        None => values.to_vec(),
    };
    Buf {
        values: Values::Heap(values),
        n,
    }
}

/// The pool's best fit for `n` values of `T` (the smallest capacity that holds `n`, else the
/// largest, grown), taken out of the pool; `None` for a small buffer (which never enters the
/// pool) or when the pool holds none of `T`.
fn pooled<T: Copy + Default + Send + 'static>(n: usize) -> Option<Vec<T>> {
    if small::<T>(n) {
        return None;
    }
    let found = {
        let mut pool = pool();
        let mut best: Option<(usize, usize)> = None;
        for (i, b) in pool.free.iter().enumerate() {
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
        best.map(|(i, _)| pool.free.swap_remove(i))
    };
    let mut values = *found?.downcast::<Vec<T>>().ok()?;
    // A pooled vector stays initialised up to its capacity, so a buffer taken for fewer values
    // and then for more again writes nothing: only growth writes its new tail, once.
    if values.len() < n {
        // exact: a doubled capacity would hold (and write) up to twice what is asked
        values.reserve_exact(n - values.len());
        values.resize(n, T::default());
        values.resize(values.capacity(), T::default());
    }
    Some(values)
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
        match &self.values {
            Values::Inline(v) => &v[..self.n],
            Values::Heap(v) => &v[..self.n],
        }
    }
}

impl<T: Copy + Default + Send + 'static> DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.values {
            Values::Inline(v) => &mut v[..self.n],
            Values::Heap(v) => &mut v[..self.n],
        }
    }
}

impl<T: Copy + Default + Send + 'static> Drop for Buf<T> {
    fn drop(&mut self) {
        let Values::Heap(values) = &mut self.values else {
            return;
        };
        let values = std::mem::take(values);
        if values.capacity() == 0 || small::<T>(values.capacity()) {
            return;
        }
        let mut pool = pool();
        if pool.holders > 0 && pool.free.len() < MAX_KEPT {
            pool.free.push(Box::new(values));
            return;
        }
        drop(pool);
        drop(values); // outside the lock
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

    /// Whether the pool holds a buffer of element type `T`.
    fn kept<T: 'static>() -> bool {
        pool().free.iter().any(|b| b.is::<Vec<T>>())
    }

    /// The tests run one at a time, each holding the only `KeepBuffers` values of the process
    /// (no other test makes one), so that the pool's holders are theirs.
    fn alone() -> std::sync::MutexGuard<'static, ()> {
        static ALONE: Mutex<()> = Mutex::new(());
        ALONE.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[test]
    fn a_returned_buffer_is_taken_again_without_allocating() {
        let _alone = alone();
        let _keep = KeepBuffers::new();
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
    fn a_copy_holds_the_values_in_a_kept_buffer_or_in_new_memory() {
        // element type of its own (see above)
        #[derive(Clone, Copy, Default, PartialEq, Debug)]
        struct D(u32);
        let _alone = alone();
        for n in [5, 1_000, 70_001] {
            let values: Vec<D> = (0..n).map(|i| D(i as u32 * 7 + 1)).collect();
            assert_eq!(
                &copy_of(&values)[..],
                &values[..],
                "{n} values, nothing kept"
            );
        }
        let _keep = KeepBuffers::new();
        let n = 70_001;
        let at = take::<D>(n + 9).as_ptr();
        let values: Vec<D> = (0..n).map(|i| D(i as u32 ^ 0x5555)).collect();
        let copy = copy_of(&values);
        assert_eq!(copy.as_ptr(), at, "the kept buffer is reused");
        assert_eq!(&copy[..], &values[..]);
    }

    #[test]
    fn a_shorter_take_does_not_make_the_next_longer_one_write_its_tail() {
        // element type of its own (see above)
        #[derive(Clone, Copy, Default, PartialEq, Debug)]
        struct C(u16);
        let _alone = alone();
        let _keep = KeepBuffers::new();
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
        let _alone = alone();
        let _keep = KeepBuffers::new();
        let (a, b) = (take::<B>(1_000_003), take::<B>(2_000_003));
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        drop((a, b));
        let small = take::<B>(999_999);
        let large = take::<B>(1_999_999);
        assert_eq!((small.as_ptr(), large.as_ptr()), (pa, pb));
    }

    #[test]
    fn a_buffer_of_a_few_values_lives_inline_and_allocates_nothing() {
        for n in [0, 1, INLINE] {
            let mut b = take::<A>(n);
            assert!(matches!(b.values, Values::Inline(_)), "{n} values");
            assert_eq!(b.len(), n);
            b.iter_mut().for_each(|v| *v = A(3));
            assert!(b.iter().all(|&v| v == A(3)));
            let z = take_zeroed::<A>(n);
            assert!(z.iter().all(|&v| v == A(0)));
        }
        assert!(matches!(take::<A>(INLINE + 1).values, Values::Heap(ref v) if v.len() > INLINE));
    }

    #[test]
    fn a_small_buffer_never_enters_the_pool() {
        #[derive(Clone, Copy, Default, PartialEq, Debug)]
        struct D(u32);
        let _alone = alone();
        let _keep = KeepBuffers::new();
        let n = SMALL_BYTES / 4 - 1;
        let b = take::<D>(n);
        assert_eq!(b.len(), n);
        drop(b);
        assert!(!kept::<D>());
    }

    #[test]
    fn without_a_keep_buffers_nothing_is_kept_and_the_last_one_dropped_frees_the_pool() {
        #[derive(Clone, Copy, Default, PartialEq, Debug)]
        struct F(u32);
        let _alone = alone();
        let n = SMALL_BYTES; // above the small-buffer bound
        assert_eq!(pool().holders, 0);
        drop(take::<F>(n));
        assert!(!kept::<F>(), "nothing is kept by default");
        let outer = KeepBuffers::new();
        let inner = KeepBuffers::new();
        drop(take::<F>(n));
        assert!(kept::<F>());
        drop(inner);
        assert!(kept::<F>(), "kept while one value lives");
        drop(outer);
        assert!(pool().free.is_empty(), "freed with the last value");
    }
}
