//! The counting global allocator of the tests and the examples. It counts, around the system
//! allocator:
//! - the bytes the current thread has allocated ([`allocated_here`]): what the allocation tests
//!   bound (per thread, so tests running beside each other do not count into each other);
//! - the process's heap in use now and its peak ([`current`], [`reset_peak`], [`peak`]): what the
//!   examples report.
//!
//! A binary installs it with
//! `#[global_allocator] static ALLOC: heap::Counting = heap::Counting;`
//! (the examples through `#[path = "../tests/common/heap.rs"] mod heap;`).
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting the bytes it hands out.
pub struct Counting;

thread_local! {
    static HERE: Cell<usize> = const { Cell::new(0) };
}
static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// Records a block of `bytes` handed to this thread.
fn handed_out(bytes: usize) {
    // `try_with`: the thread-local may already be gone while a thread shuts down.
    let _ = HERE.try_with(|c| c.set(c.get() + bytes));
}

/// Records `bytes` more in use in the process.
fn grew(bytes: usize) {
    let now = CURRENT.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

/// Records `bytes` fewer in use in the process.
fn shrank(bytes: usize) {
    CURRENT.fetch_sub(bytes, Ordering::Relaxed);
}

// SAFETY: every method forwards to the system allocator with the caller's arguments unchanged,
// and only adds to counters; no memory is touched.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires it.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            handed_out(layout.size());
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            handed_out(layout.size());
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from `System`) with this layout.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator (so from `System`) with this layout; the caller
        // guarantees `new_size` is valid for it.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // A moved or grown block counts in full for the thread: it may be a new buffer.
            handed_out(new_size);
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                shrank(layout.size() - new_size);
            }
        }
        p
    }
}

/// Bytes of the blocks the current thread has been handed since it started (a `realloc` counts
/// its whole new size; frees are not subtracted).
pub fn allocated_here() -> usize {
    HERE.with(Cell::get)
}

/// Heap bytes in use in the process now.
pub fn current() -> usize {
    CURRENT.load(Ordering::Relaxed)
}

/// Restarts the peak from the heap in use now, and returns that.
pub fn reset_peak() -> usize {
    let now = current();
    PEAK.store(now, Ordering::Relaxed);
    now
}

/// The highest heap use since the last [`reset_peak`].
pub fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}
