//! A small persistent pool of helper threads for the GEMM driver: the calling thread posts a job
//! of numbered blocks, helpers that are free take blocks from an atomic counter, and the caller
//! works through blocks too. The caller waits only for blocks that were actually claimed, so a
//! helper that is slow to wake (a busy neighbour on the machine) costs nothing: it finds no
//! block left and touches nothing.
//!
//! A helper that finished a job watches its mailbox for [`SPIN`] before it sleeps, so the
//! products of a training step, which follow each other closely, reach it without a wake-up
//! system call. Measured on `bench_step --serve` (2-core Zen 5 EPYC, lock-step A/B, 30 rounds):
//! the f16 step 0.96x and the emulated-bf16 step 0.95x of the time with a sleeping helper woken
//! through a channel for every product. The cost is up to 200 µs of one core's time after the
//! last product of a burst.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

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

/// How long a helper that finished a job keeps watching for the next one before it sleeps. The
/// products of one training step follow each other within this (the serial work between them is
/// short), so the caller hands them over without a wake-up system call and the helper starts at
/// once; a helper idle for longer sleeps and costs nothing.
const SPIN: Duration = Duration::from_micros(200);

/// One helper thread's mailbox: the latest job posted to it.
#[derive(Default)]
struct Helper {
    slot: Mutex<Mailbox>,
    wake: Condvar,
    /// Whether `slot` holds a job: what the spinning helper watches without taking the lock.
    posted: AtomicBool,
}

#[derive(Default)]
struct Mailbox {
    job: Option<Arc<Job>>,
    /// The helper waits on `wake` (only then does a post notify it).
    asleep: bool,
}

impl Helper {
    fn lock(&self) -> MutexGuard<'_, Mailbox> {
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Leaves `job` for the helper (replacing one it has not taken: that job's caller runs its
    /// blocks itself), waking the helper if it sleeps.
    fn post(&self, job: &Arc<Job>) {
        let asleep = {
            let mut m = self.lock();
            m.job = Some(Arc::clone(job));
            self.posted.store(true, Ordering::Release);
            m.asleep
        };
        if asleep {
            self.wake.notify_one();
        }
    }

    /// The helper thread's loop: watch for a job for [`SPIN`], else sleep until one is posted;
    /// take it and work on it.
    fn run(&self) {
        loop {
            let since = Instant::now();
            while !self.posted.load(Ordering::Acquire) && since.elapsed() < SPIN {
                std::hint::spin_loop();
            }
            let job = {
                let mut m = self.lock();
                while m.job.is_none() {
                    m.asleep = true;
                    m = self.wake.wait(m).unwrap_or_else(PoisonError::into_inner);
                    m.asleep = false;
                }
                self.posted.store(false, Ordering::Relaxed);
                m.job.take()
            };
            if let Some(job) = job {
                job.work();
            }
        }
    }
}

/// The helper threads, started on first use.
fn helpers() -> &'static Mutex<Vec<Arc<Helper>>> {
    static HELPERS: OnceLock<Mutex<Vec<Arc<Helper>>>> = OnceLock::new();
    HELPERS.get_or_init(|| Mutex::new(Vec::new()))
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
    if crate::threads::scoped_threads() {
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
    let mut all = helpers().lock().unwrap_or_else(PoisonError::into_inner);
    while all.len() < extra {
        let helper = Arc::new(Helper::default());
        let mine = Arc::clone(&helper);
        let started = std::thread::Builder::new()
            .name(format!("mpx-gemm-{}", all.len() + 1))
            .spawn(move || mine.run());
        if started.is_err() {
            break;
        }
        all.push(helper);
    }
    for helper in all.iter().take(extra) {
        helper.post(job);
    }
}

/// Element passes shorter than this run on the calling thread only (waking a helper costs more
/// than it saves).
const PAR_MIN_VALUES: usize = 1 << 17;

/// Runs `part` on matching parts of `dst` and `src` (cut at the same offsets, in multiples of 64
/// values), one part per thread that [`max_threads`](crate::threads::max_threads) allows, on the calling
/// thread and helpers of the pool; a short pass runs whole on the calling thread. Returns whether
/// every call returned `true`. For element-wise passes over a model's worth of values (a
/// gradient's unscaled sum, a master's rounding), whose result does not depend on the cut.
///
/// A panic in `part` is re-raised on the calling thread once every part has run.
///
/// # Panics
/// If the lengths differ, or a call of `part` panicked.
///
/// # Examples
/// ```
/// // an unscale-and-check pass: `dst += src / 8`, and whether every sum is finite
/// let src = vec![8.0f32; 1 << 18];
/// let mut dst = vec![1.0f32; 1 << 18];
/// let finite = mpx_kernels::zip_parts(&mut dst, &src, &|d, s| {
///     d.iter_mut().zip(s).for_each(|(d, s)| *d += s / 8.0);
///     d.iter().all(|v| v.is_finite())
/// });
/// assert!(finite && dst.iter().all(|&v| v == 2.0));
/// ```
pub fn zip_parts<A: Send, B: Sync>(
    dst: &mut [A],
    src: &[B],
    part: &(dyn Fn(&mut [A], &[B]) -> bool + Sync),
) -> bool {
    assert_eq!(dst.len(), src.len(), "zip_parts: lengths differ");
    let threads = if dst.len() < PAR_MIN_VALUES {
        1
    } else {
        crate::threads::max_threads()
    };
    if threads <= 1 {
        return part(dst, src);
    }
    let each = dst.len().div_ceil(threads).next_multiple_of(64);
    let parts: Vec<Mutex<(&mut [A], &[B])>> = dst
        .chunks_mut(each)
        .zip(src.chunks(each))
        .map(Mutex::new)
        .collect();
    let all = AtomicBool::new(true);
    for_each_block(parts.len(), threads - 1, &|t| {
        // each part is claimed by one block only: the lock is never contended
        let mut p = parts[t].lock().unwrap_or_else(PoisonError::into_inner);
        let (d, s) = &mut *p;
        if !part(d, s) {
            all.store(false, Ordering::Relaxed);
        }
    });
    all.load(Ordering::Relaxed)
}

/// [`zip_parts`] over one slice, read only: whether `part` returned `true` for every part.
///
/// # Panics
/// If a call of `part` panicked.
///
/// # Examples
/// ```
/// let v = vec![1.0f32; 1 << 18];
/// assert!(mpx_kernels::every_part(&v, &|p| p.iter().all(|x| x.is_finite())));
/// assert!(!mpx_kernels::every_part(&v, &|p| p.iter().all(|&x| x > 1.0)));
/// ```
pub fn every_part<B: Sync>(src: &[B], part: &(dyn Fn(&[B]) -> bool + Sync)) -> bool {
    // a slice of `()` to pair with: zero-sized, so nothing is allocated
    let mut units = vec![(); src.len()];
    zip_parts(&mut units, src, &|_, s| part(s))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::{every_part, for_each_block, zip_parts};

    #[test]
    fn jobs_posted_from_several_threads_at_once_each_run_every_block_once() {
        // four callers share the helpers' mailboxes: a job replaced before a helper took it is
        // run by its own caller, never lost or run twice
        std::thread::scope(|s| {
            for caller in 0..4u32 {
                s.spawn(move || {
                    for round in 0..200u32 {
                        let total = 1 + ((caller * 7 + round) % 13) as usize;
                        let hits: Vec<AtomicU32> = (0..total).map(|_| AtomicU32::new(0)).collect();
                        for_each_block(total, 3, &|t| {
                            hits[t].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(
                            hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                            "caller {caller}, round {round}"
                        );
                    }
                });
            }
        });
    }

    #[test]
    fn zip_parts_covers_every_value_once_and_folds_the_results() {
        for n in [0usize, 1, 63, 65, (1 << 17) - 1, 1 << 17, (1 << 18) + 77] {
            let src: Vec<u32> = (0..n).map(|i| u32::try_from(i).unwrap()).collect();
            let mut dst = vec![0u64; n];
            let ok = zip_parts(&mut dst, &src, &|d, s| {
                d.iter_mut()
                    .zip(s)
                    .for_each(|(d, s)| *d += u64::from(*s) + 1);
                true
            });
            assert!(ok);
            assert!(
                dst.iter().enumerate().all(|(i, &v)| v == i as u64 + 1),
                "n = {n}"
            );
            // one part failing (the one holding 999) makes the whole fail
            let failed = zip_parts(&mut dst, &src, &|_, s| !s.contains(&999));
            assert_eq!(failed, n <= 999, "n = {n}");
            assert_eq!(
                every_part(&src, &|s| !s.contains(&999)),
                n <= 999,
                "n = {n}"
            );
        }
    }
}
