//! Data-parallel mixed-precision training over MPI (feature `mpi`), PyTorch's
//! `DistributedDataParallel` + `GradScaler` for dfdx.
//!
//! Every rank holds the f32 master and runs the mixed step on its shard of the global batch. A
//! [`Reducer`] on the [`GradScaler`](crate::step::GradScaler)
//! ([`with_reducer`](crate::step::GradScaler::with_reducer)) all-reduces the master's
//! gradients in the backward pass of the last micro-batch, so `#[mixed_step]` code and the
//! scaler's methods are unchanged:
//!
//! 1. **One decision.** The ranks first all-reduce (MPI `MIN`) a small header: their local
//!    finiteness (gradients and loss of every micro-batch since the last update), a hash of the
//!    master's layout and a hash of the settings (wire type, accumulation count, loss scale). A
//!    layout or settings difference is an error on every rank; one rank's non-finite gradient
//!    makes every rank skip (and the gradient all-reduce is not run at all).
//! 2. **The mean.** Otherwise the gradients are packed into one buffer and averaged: in f32 with
//!    MPI's `MPI_Allreduce` (the default), or at half the bytes in f16 / bf16
//!    ([`AllReduceDtype`]), where the payload is the **scaled** gradient: each rank sends
//!    `round(g * S / N)` (`S` the step's loss scale, `N` the ranks), the ring sums in the half
//!    type, and the result is widened and divided by `S`. Scaling keeps small gradients above
//!    f16's underflow, as it does in the backward pass; an overflow of the sum is `inf` in the
//!    same bits on every rank (the ring's all-gather copies the reduced chunks), so every rank
//!    sees a non-finite gradient and skips, and the dynamic loss scale backs off.
//! 3. **The update** then runs, or is skipped, on every rank alike: masters, optimizer states and
//!    loss scales stay identical.
//!
//! Gradient accumulation over `K` micro-batches: [`Reducer::with_accumulation`] with `K` (DeepSpeed's
//! `gradient_accumulation_steps`); the first `K - 1` backward passes only accumulate locally, the
//! `K`-th all-reduces once, and the update checks that exactly `K` ran. Clipping by global norm
//! ([`clip_grad_norm`](crate::step::clip_grad_norm)) between backward and update sees the averaged
//! gradients, the same on every rank.
//!
//! `docs/distributed.md` has the design, the tolerances and the way to more machines.
//!
//! # Examples
//! Run with `mpirun -np 2 target/release/examples/<name>`; every rank runs the same program:
//! ```no_run
//! use dfdx::{optim::*, prelude::*};
//! use mpx_runtime::distributed::{Reducer, mpi};
//! use mpx_runtime::precision::f16;
//! use mpx_runtime::step::{GradScaler, Mixed};
//!
//! let universe = mpi::initialize().expect("MPI initialised once");
//! let world = universe.world();
//! let dev: Cpu = Default::default();
//! let mut model = Mixed::mapped(dev.build_module::<(Linear<4, 8>, ReLU, Linear<8, 2>), f32>());
//! let mut reducer = Reducer::new(&world);
//! reducer.broadcast_model(&mut *model, 0)?; // every rank starts from rank 0's weights
//! let mut scaler = GradScaler::<f16>::default().with_reducer(reducer);
//! let mut opt = Sgd::new(&*model, Default::default());
//! let grads = model.alloc_grads();
//! // this rank's shard of the global batch
//! let x: Tensor<Rank2<3, 4>, f32, _> = dev.sample_normal();
//! let y: Tensor<Rank2<3, 2>, f32, _> = dev.sample_normal();
//! let out = scaler.forward(&model, x.trace(grads), |m, x| m.forward(x))?;
//! let grads = scaler.backward(mse_loss(out, y))?; // averaged over the ranks
//! scaler.update(&mut model, &mut opt, &grads)?; // applied or skipped on every rank alike
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod model;
mod ring;

use std::time::{Duration, Instant};

use dfdx::tensor::{Cpu, Gradients};
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator, CommunicatorCollectives};

pub use error::DistributedError;
/// The `mpi` crate (rsmpi) mpx is built against: `mpi::initialize()`, communicators.
pub use mpi;

use crate::finite::all_finite_f32;
use crate::master::slots::MasterSlot;
use ring::Half;

/// The type the gradients travel in during the all-reduce.
///
/// | here | PyTorch DDP |
/// |---|---|
/// | `F32` | the default (no hook) |
/// | `F16` | `fp16_compress_hook` (which divides by the world size before the cast, as here) |
/// | `Bf16` | `bf16_compress_hook` |
///
/// # Examples
/// ```
/// use mpx_runtime::distributed::AllReduceDtype;
/// assert_eq!(AllReduceDtype::F16.bytes(), 2);
/// assert_eq!(AllReduceDtype::default(), AllReduceDtype::F32);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AllReduceDtype {
    /// f32 with MPI's own `MPI_Allreduce` (`MPI_SUM`), then divided by the rank count.
    #[default]
    F32,
    /// IEEE half: the scaled gradients, rounded to f16, summed in f16 by a ring of MPI
    /// point-to-point messages. An overflow of the sum is a skip on every rank.
    F16,
    /// bfloat16 (real 16-bit bf16 on the wire): as `F16`, with f32's range and 8 significant
    /// bits.
    Bf16,
}

impl AllReduceDtype {
    /// Bytes per gradient element on the wire.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::distributed::AllReduceDtype;
    /// assert_eq!(AllReduceDtype::F32.bytes(), 4);
    /// ```
    pub fn bytes(self) -> usize {
        match self {
            AllReduceDtype::F32 => 4,
            AllReduceDtype::F16 | AllReduceDtype::Bf16 => 2,
        }
    }

    /// The type's name (`"f32"`, `"f16"`, `"bf16"`).
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::distributed::AllReduceDtype;
    /// assert_eq!(AllReduceDtype::Bf16.name(), "bf16");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            AllReduceDtype::F32 => "f32",
            AllReduceDtype::F16 => "f16",
            AllReduceDtype::Bf16 => "bf16",
        }
    }

    fn half(self) -> Option<Half> {
        match self {
            AllReduceDtype::F32 => None,
            AllReduceDtype::F16 => Some(Half::F16),
            AllReduceDtype::Bf16 => Some(Half::Bf16),
        }
    }
}

/// What the last gradient all-reduce moved and how long it took.
///
/// # Examples
/// ```
/// use mpx_runtime::distributed::ReductionStats;
/// let s = ReductionStats::default();
/// assert_eq!(s.payload_bytes, 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReductionStats {
    /// Gradient elements reduced.
    pub elements: usize,
    /// Bytes of the payload on each rank (`elements` times the wire type's size); a ring sends
    /// `2 (N - 1) / N` times this per rank.
    pub payload_bytes: usize,
    /// Wall-clock time of the reduction (header, packing, all-reduce, unpacking).
    pub time: Duration,
}

/// The data-parallel all-reduce a [`GradScaler`](crate::step::GradScaler) carries
/// ([`with_reducer`](crate::step::GradScaler::with_reducer)): a duplicate of the user's
/// communicator, the wire type, the accumulation count, and reusable buffers.
///
/// Every method that communicates is collective: every rank of the communicator calls it, in
/// the same order. Drop the reducer (and the scaler holding it) before MPI's `Universe`: it frees
/// its duplicated communicator.
///
/// # Examples
/// ```no_run
/// use mpx_runtime::distributed::{AllReduceDtype, Reducer, mpi};
/// let universe = mpi::initialize().unwrap();
/// let reducer = Reducer::new(&universe.world())
///     .with_dtype(AllReduceDtype::F16)
///     .with_accumulation(4)?;
/// assert_eq!(reducer.accumulation(), 4);
/// # Ok::<(), mpx_runtime::distributed::DistributedError>(())
/// ```
pub struct Reducer {
    comm: Comm,
    rank: usize,
    size: usize,
    dtype: AllReduceDtype,
    accumulation: u32,
    /// Backward passes since the last update.
    seen: u32,
    /// Whether every one of them was finite on this rank.
    local_finite: bool,
    /// The last reduction failed: the next update is refused.
    failed: bool,
    reductions: u64,
    skipped: u64,
    last: ReductionStats,
    flat: Vec<f32>,
    out: Vec<f32>,
    wire: Vec<u16>,
    scratch: Vec<u16>,
}

/// The reducer's communicator, usable only from a thread MPI's threading level allows: the
/// thread that made the reducer (rsmpi's communicators cannot leave the thread that initialised
/// MPI, so that is where a reducer is made), or any thread once MPI runs at
/// `Threading::Multiple`. Dropped on another thread, the communicator is left unfreed (a leak,
/// never an MPI call from the wrong thread).
struct Comm {
    inner: Option<SimpleCommunicator>,
    home: std::thread::ThreadId,
    level: mpi::Threading,
}

impl Comm {
    fn new(inner: SimpleCommunicator) -> Self {
        Self {
            inner: Some(inner),
            home: std::thread::current().id(),
            level: mpi::environment::threading_support(),
        }
    }

    /// Whether MPI may be called from this thread.
    fn here(&self) -> bool {
        self.level == mpi::Threading::Multiple || std::thread::current().id() == self.home
    }

    /// The communicator, from a thread that may use it.
    fn get(&self) -> Result<&SimpleCommunicator, DistributedError> {
        match &self.inner {
            Some(c) if self.here() => Ok(c),
            _ => Err(DistributedError::WrongThread { level: self.level }),
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if !self.here() {
            std::mem::forget(self.inner.take());
        }
    }
}

// SAFETY: every MPI call of a reducer goes through `Comm::get`, which refuses a thread MPI's
// threading level forbids (any thread but the one that made it, below `Threading::Multiple`),
// and `Comm::drop` frees the communicator only on such a thread; `&mut self` keeps a reducer's
// calls from running concurrently. Moving it to another thread is then safe: there it can only
// return `WrongThread` (or, at `Threading::Multiple`, call MPI as MPI allows).
#[allow(unsafe_code)]
unsafe impl Send for Reducer {}
// SAFETY: no `&self` method calls MPI (every collective takes `&mut self`).
#[allow(unsafe_code)]
unsafe impl Sync for Reducer {}

impl std::fmt::Debug for Reducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reducer")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("dtype", &self.dtype)
            .field("accumulation", &self.accumulation)
            .field("reductions", &self.reductions)
            .field("skipped", &self.skipped)
            .finish_non_exhaustive()
    }
}

impl Reducer {
    /// A reducer over a duplicate of `comm` (its messages never mix with the caller's), f32 on
    /// the wire, one backward pass per update. Collective.
    ///
    /// # Examples
    /// ```no_run
    /// use mpx_runtime::distributed::{Reducer, mpi};
    /// use mpi::traits::Communicator;
    /// let universe = mpi::initialize().unwrap();
    /// let world = universe.world();
    /// let reducer = Reducer::new(&world);
    /// assert_eq!(reducer.size(), world.size() as usize);
    /// ```
    pub fn new<C: Communicator>(comm: &C) -> Self {
        let comm = comm.duplicate();
        Self {
            rank: comm.rank() as usize,
            size: comm.size() as usize,
            comm: Comm::new(comm),
            dtype: AllReduceDtype::F32,
            accumulation: 1,
            seen: 0,
            local_finite: true,
            failed: false,
            reductions: 0,
            skipped: 0,
            last: ReductionStats::default(),
            flat: Vec::new(),
            out: Vec::new(),
            wire: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Sets the type the gradients travel in ([`AllReduceDtype`]; f32 by default). Every rank
    /// must choose the same (checked at each reduction).
    ///
    /// # Examples
    /// ```no_run
    /// use mpx_runtime::distributed::{AllReduceDtype, Reducer, mpi};
    /// let universe = mpi::initialize().unwrap();
    /// let r = Reducer::new(&universe.world()).with_dtype(AllReduceDtype::Bf16);
    /// assert_eq!(r.dtype(), AllReduceDtype::Bf16);
    /// ```
    #[must_use]
    pub fn with_dtype(mut self, dtype: AllReduceDtype) -> Self {
        self.dtype = dtype;
        self
    }

    /// Sets the number of backward passes (micro-batches) per update: the gradients accumulate
    /// locally (dfdx adds them up) and are all-reduced once, in the backward pass of the last
    /// one. Each update must follow exactly `steps` backward passes, or it is an error
    /// ([`DistributedError::AccumulationMismatch`]).
    ///
    /// # Errors
    /// [`DistributedError::ZeroAccumulation`] for 0.
    ///
    /// # Examples
    /// ```no_run
    /// use mpx_runtime::distributed::{Reducer, mpi};
    /// let universe = mpi::initialize().unwrap();
    /// assert!(Reducer::new(&universe.world()).with_accumulation(0).is_err());
    /// ```
    pub fn with_accumulation(mut self, steps: u32) -> Result<Self, DistributedError> {
        if steps == 0 {
            return Err(DistributedError::ZeroAccumulation);
        }
        self.accumulation = steps;
        Ok(self)
    }

    /// This process's rank in the communicator.
    ///
    /// # Examples
    /// ```no_run
    /// use mpx_runtime::distributed::{Reducer, mpi};
    /// let universe = mpi::initialize().unwrap();
    /// let r = Reducer::new(&universe.world());
    /// assert!(r.rank() < r.size());
    /// ```
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    ///
    /// # Examples
    /// See [`rank`](Self::rank).
    pub fn size(&self) -> usize {
        self.size
    }

    /// The wire type ([`with_dtype`](Self::with_dtype)).
    ///
    /// # Examples
    /// See [`with_dtype`](Self::with_dtype).
    pub fn dtype(&self) -> AllReduceDtype {
        self.dtype
    }

    /// Backward passes per update ([`with_accumulation`](Self::with_accumulation)).
    ///
    /// # Examples
    /// See [`Reducer`].
    pub fn accumulation(&self) -> u32 {
        self.accumulation
    }

    /// Gradient all-reduces run so far (one per applied-or-overflowed update; a step some rank
    /// found non-finite before the reduction runs none).
    ///
    /// # Examples
    /// ```no_run
    /// use mpx_runtime::distributed::{Reducer, mpi};
    /// let universe = mpi::initialize().unwrap();
    /// assert_eq!(Reducer::new(&universe.world()).reductions(), 0);
    /// ```
    pub fn reductions(&self) -> u64 {
        self.reductions
    }

    /// Updates skipped before the reduction because some rank's gradients or loss were not
    /// finite (the same count on every rank).
    ///
    /// # Examples
    /// ```no_run
    /// use mpx_runtime::distributed::{Reducer, mpi};
    /// let universe = mpi::initialize().unwrap();
    /// assert_eq!(Reducer::new(&universe.world()).skipped_before_reduction(), 0);
    /// ```
    pub fn skipped_before_reduction(&self) -> u64 {
        self.skipped
    }

    /// What the last gradient all-reduce moved and how long it took.
    ///
    /// # Examples
    /// ```no_run
    /// use mpx_runtime::distributed::{Reducer, mpi};
    /// let universe = mpi::initialize().unwrap();
    /// assert_eq!(Reducer::new(&universe.world()).last_reduction().elements, 0);
    /// ```
    pub fn last_reduction(&self) -> ReductionStats {
        self.last
    }

    /// Averages `data` over the ranks, in place, in the wire type, and returns whether the
    /// result is finite (the same answer on every rank). `scale` is the loss scale the values
    /// are multiplied by on the half wire (pass the step's loss scale for unscaled gradients, 1
    /// for plain values); f32 ignores it. Collective: every rank passes the same length.
    ///
    /// # Errors
    /// [`DistributedError::InvalidScale`] when `scale` is not finite and positive.
    ///
    /// # Examples
    /// ```no_run
    /// use mpx_runtime::distributed::{AllReduceDtype, Reducer, mpi};
    /// let universe = mpi::initialize().unwrap();
    /// let mut r = Reducer::new(&universe.world()).with_dtype(AllReduceDtype::F16);
    /// let mut v = vec![r.rank() as f32; 4];
    /// assert!(r.all_reduce_mean(&mut v, 1024.0)?);
    /// assert_eq!(v[0], (r.size() - 1) as f32 / 2.0);
    /// # Ok::<(), mpx_runtime::distributed::DistributedError>(())
    /// ```
    pub fn all_reduce_mean(
        &mut self,
        data: &mut [f32],
        scale: f32,
    ) -> Result<bool, DistributedError> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(DistributedError::InvalidScale { scale });
        }
        let n = self.size as f32;
        match self.dtype.half() {
            None => {
                self.out.clear();
                self.out.resize(data.len(), 0.0);
                self.comm
                    .get()?
                    .all_reduce_into(&*data, &mut self.out[..], SystemOperation::sum());
                for (d, s) in data.iter_mut().zip(&self.out) {
                    *d = *s / n;
                }
                // MPI does not promise the same bits on every rank: agree on the verdict.
                let finite = u8::from(all_finite_f32(data));
                let mut all = 0u8;
                self.comm
                    .get()?
                    .all_reduce_into(&finite, &mut all, SystemOperation::min());
                Ok(all == 1)
            }
            Some(half) => {
                let factor = scale / n;
                self.wire.clear();
                self.wire.resize(data.len(), 0);
                let mut buf = [0.0f32; 512];
                for (src, dst) in data.chunks(512).zip(self.wire.chunks_mut(512)) {
                    let b = &mut buf[..src.len()];
                    for (x, y) in b.iter_mut().zip(src) {
                        *x = *y * factor;
                    }
                    half.encode(b, dst);
                }
                ring::all_reduce_sum(self.comm.get()?, half, &mut self.wire, &mut self.scratch);
                half.decode(&self.wire, data);
                for d in data.iter_mut() {
                    *d /= scale;
                }
                // the ring leaves the same bits on every rank: the same verdict everywhere
                Ok(all_finite_f32(data))
            }
        }
    }

    /// The header every rank all-reduces before the gradients: whether the layouts and the
    /// settings are the same everywhere, and whether every rank was finite.
    fn agree(
        &mut self,
        layout: u64,
        config: u64,
        finite: bool,
    ) -> Result<(bool, bool, bool), DistributedError> {
        let send = [layout, !layout, config, !config, u64::from(finite)];
        let mut min = [0u64; 5];
        self.comm
            .get()?
            .all_reduce_into(&send[..], &mut min[..], SystemOperation::min());
        Ok((
            min[0] == layout && min[1] == !layout,
            min[2] == config && min[3] == !config,
            min[4] == 1,
        ))
    }

    /// Whether `values` are the same on every rank. Collective.
    ///
    /// # Errors
    /// [`DistributedError::WrongThread`] from a thread MPI's threading level does not allow.
    ///
    /// # Examples
    /// ```no_run
    /// use mpx_runtime::distributed::{Reducer, mpi};
    /// let universe = mpi::initialize().unwrap();
    /// let mut r = Reducer::new(&universe.world());
    /// assert!(r.values_agree(&[42, 7])?);
    /// # Ok::<(), mpx_runtime::distributed::DistributedError>(())
    /// ```
    pub fn values_agree(&mut self, values: &[u64]) -> Result<bool, DistributedError> {
        let h = hash_words(values.iter().copied());
        Ok(self.agree(h, 0, true)?.0)
    }

    fn config_hash(&self, scale: f32, counters: [u64; 2]) -> u64 {
        hash_words([
            self.dtype as u64,
            u64::from(self.accumulation),
            u64::from(scale.to_bits()),
            counters[0],
            counters[1],
        ])
    }
}

/// FNV-1a over 64-bit words.
fn hash_words(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for w in words {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The scaler's hook after each backward pass (`GradScaler::backward`): counts the
/// micro-batch (`finite`: whether its gradients and loss were), and in the last one agrees with
/// the other ranks and averages the master's gradients. Returns the agreed finiteness after the
/// last micro-batch, `None` before it or without a reducer.
pub(crate) fn after_backward(
    reducer: Option<&mut Reducer>,
    slots: &[&MasterSlot],
    grads: &mut Gradients<f32, Cpu>,
    finite: bool,
    scale: f32,
    counters: [u64; 2],
) -> Result<Option<bool>, DistributedError> {
    let Some(r) = reducer else {
        return Ok(None);
    };
    r.seen += 1;
    r.local_finite &= finite;
    if r.seen < r.accumulation {
        return Ok(None);
    }
    if r.seen > r.accumulation {
        return Err(DistributedError::AccumulationMismatch {
            expected: r.accumulation,
            found: r.seen,
        });
    }
    let reduced = reduce(r, slots, grads, scale, counters);
    r.failed = reduced.is_err();
    reduced.map(Some)
}

/// The header and the gradients' mean, for the last micro-batch; returns the agreed finiteness.
/// `counters` (the scaler's applied and skipped updates) are part of the settings the ranks
/// must share: a rank restored from another checkpoint than the others is an error on every
/// rank, not a silent drift or a hang.
fn reduce(
    r: &mut Reducer,
    slots: &[&MasterSlot],
    grads: &mut Gradients<f32, Cpu>,
    scale: f32,
    counters: [u64; 2],
) -> Result<bool, DistributedError> {
    if slots.is_empty() {
        return Err(DistributedError::NoForward);
    }
    let start = Instant::now();
    let layout =
        hash_words(std::iter::once(slots.len() as u64).chain(slots.iter().map(|s| s.len as u64)));
    let config = r.config_hash(scale, counters);
    let (same_layout, same_config, all_finite) = r.agree(layout, config, r.local_finite)?;
    if !same_layout {
        return Err(DistributedError::LayoutMismatch {
            rank: r.rank,
            tensors: slots.len(),
            elements: slots.iter().map(|s| s.len).sum(),
        });
    }
    if !same_config {
        return Err(DistributedError::ConfigMismatch {
            rank: r.rank,
            dtype: r.dtype.name(),
            accumulation: r.accumulation,
            scale,
            applied: counters[0],
            skipped: counters[1],
        });
    }
    if !all_finite {
        r.skipped += 1;
        return Ok(false);
    }
    let mut flat = std::mem::take(&mut r.flat);
    flat.clear();
    for s in slots {
        flat.extend_from_slice(s.slice(grads)?);
    }
    let finite = r.all_reduce_mean(&mut flat, scale);
    let mut at = 0;
    for s in slots {
        let dst = s.slice(grads)?;
        dst.copy_from_slice(&flat[at..at + dst.len()]);
        at += dst.len();
    }
    r.last = ReductionStats {
        elements: flat.len(),
        payload_bytes: flat.len() * r.dtype.bytes(),
        time: start.elapsed(),
    };
    r.flat = flat;
    r.reductions += 1;
    finite
}

/// The scaler's hook before each update (`GradScaler::update_with`): checks that the last
/// micro-batch's backward pass (the one that all-reduced) has run and succeeded, and starts the
/// next count.
pub(crate) fn before_update(reducer: Option<&mut Reducer>) -> Result<(), DistributedError> {
    let Some(r) = reducer else {
        return Ok(());
    };
    let seen = std::mem::take(&mut r.seen);
    r.local_finite = true;
    if std::mem::take(&mut r.failed) {
        Err(DistributedError::ReductionFailed)
    } else if seen == r.accumulation {
        Ok(())
    } else {
        Err(DistributedError::AccumulationMismatch {
            expected: r.accumulation,
            found: seen,
        })
    }
}
