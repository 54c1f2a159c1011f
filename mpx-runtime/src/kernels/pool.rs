//! A small persistent pool of helper threads for the GEMM driver: the calling thread posts a job
//! of numbered blocks, helpers that are free take blocks from an atomic counter, and the caller
//! works through blocks too. The caller waits only for blocks that were actually claimed, so a
//! helper that is slow to wake (a busy neighbour on the machine) costs nothing: it finds no
//! block left and touches nothing.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, OnceLock};

/// One posted job: blocks `0..total` of a borrowed task.
struct Job {
    next: AtomicUsize,
    done: AtomicUsize,
    total: usize,
    panicked: AtomicBool,
    /// The caller's task with its lifetime erased; called only for a claimed block index
    /// `< total`, all of which finish before the caller returns (see [`for_each_block`]).
    task: *const (dyn Fn(usize) + Sync + 'static),
}

// SAFETY: `task` points to a `Sync` closure, and it is dereferenced only while the posting
// caller keeps it alive (until every claimed block is done); the counters are atomics.
unsafe impl Send for Job {}
// SAFETY: as for `Send`.
unsafe impl Sync for Job {}

impl Job {
    /// Claims and runs blocks until none is left; a panic in a block is recorded, not lost.
    fn work(&self) {
        loop {
            let t = self.next.fetch_add(1, Ordering::Relaxed);
            if t >= self.total {
                return;
            }
            // SAFETY: `t < total`, so the caller is still waiting in `for_each_block` for this
            // block to be counted done, and the task it borrowed is alive.
            let task = unsafe { &*self.task };
            if catch_unwind(AssertUnwindSafe(|| task(t))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

/// The helpers' job queues, one per helper thread, started on first use.
fn helpers() -> &'static Mutex<Vec<Sender<Arc<Job>>>> {
    static HELPERS: OnceLock<Mutex<Vec<Sender<Arc<Job>>>>> = OnceLock::new();
    HELPERS.get_or_init(|| Mutex::new(Vec::new()))
}

/// Whether [`for_each_block`] uses scoped threads (`std::thread::scope`) instead of the pool: a
/// switch for the benchmark that compares them.
static SCOPED: AtomicBool = AtomicBool::new(false);

/// Makes split products use `std::thread::scope` (`true`) or the persistent pool (`false`).
pub(crate) fn use_scoped_threads(on: bool) {
    SCOPED.store(on, Ordering::Relaxed);
}

/// Runs `task(t)` for every `t` in `0..total` on the calling thread and `extra` scoped threads
/// started for this call, which claim blocks from one counter.
fn for_each_block_scoped(total: usize, extra: usize, task: &(dyn Fn(usize) + Sync)) {
    let next = AtomicUsize::new(0);
    let work = || {
        loop {
            let t = next.fetch_add(1, Ordering::Relaxed);
            if t >= total {
                return;
            }
            task(t);
        }
    };
    std::thread::scope(|s| {
        for _ in 0..extra {
            // a thread that cannot be started leaves its blocks to the others
            let _ = std::thread::Builder::new().spawn_scoped(s, work);
        }
        work();
    });
}

/// Runs `task(t)` for every `t` in `0..total`, on the calling thread and up to `extra` helper
/// threads of the pool; returns when all have run. A panic in any block is re-raised here.
pub(crate) fn for_each_block(total: usize, extra: usize, task: &(dyn Fn(usize) + Sync)) {
    let extra = extra.min(total.saturating_sub(1));
    if extra == 0 {
        (0..total).for_each(task);
        return;
    }
    if SCOPED.load(Ordering::Relaxed) {
        for_each_block_scoped(total, extra, task);
        return;
    }
    let erased: *const (dyn Fn(usize) + Sync + '_) = task;
    #[allow(
        clippy::transmute_ptr_to_ptr,
        reason = "an `as` cast may not extend a trait object's lifetime bound"
    )]
    // SAFETY: only the lifetime bound changes (same pointer, same vtable); the pointer is used
    // under `Job::task`'s rules: only for claimed blocks, all done before this call returns.
    let erased = unsafe {
        std::mem::transmute::<
            *const (dyn Fn(usize) + Sync + '_),
            *const (dyn Fn(usize) + Sync + 'static),
        >(erased)
    };
    let job = Arc::new(Job {
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        total,
        panicked: AtomicBool::new(false),
        task: erased,
    });
    post(&job, extra);
    job.work();
    // every block is claimed by now; wait for the ones still running elsewhere
    while job.done.load(Ordering::Acquire) < total {
        std::thread::yield_now();
    }
    assert!(
        !job.panicked.load(Ordering::Relaxed),
        "a GEMM block panicked on a helper thread"
    );
}

/// Hands `job` to `extra` helpers, starting helpers that do not exist yet. A helper that cannot
/// be started or reached is skipped: the caller runs every block left.
fn post(job: &Arc<Job>, extra: usize) {
    let mut senders = match helpers().lock() {
        Ok(s) => s,
        Err(poisoned) => poisoned.into_inner(),
    };
    while senders.len() < extra {
        let (tx, rx) = channel::<Arc<Job>>();
        let started = std::thread::Builder::new()
            .name(format!("mpx-gemm-{}", senders.len() + 1))
            .spawn(move || {
                for job in rx {
                    job.work();
                }
            });
        if started.is_err() {
            break;
        }
        senders.push(tx);
    }
    for tx in senders.iter().take(extra) {
        // a helper that is gone leaves its share to the others
        let _ = tx.send(Arc::clone(job));
    }
}
