//! Data-parallel training under `mpirun` (feature `mpi`; `harness = false`).
//!
//! ```text
//! cargo test --features mpi --test distributed
//! ```
//!
//! Run by cargo, this binary is the **launcher**: it starts itself under
//! `mpirun --oversubscribe -np 2` and `-np 3` (the scenarios), and `-np 2` once more with a rank
//! that dies, each with a time limit, and checks what they report. Started by `mpirun`, it is a
//! **rank**: it runs the scenarios in order; a failed check prints what failed and aborts the
//! whole job (`MPI_Abort`), so no rank waits forever on one that gave up. Without `mpirun` on
//! the `PATH` it prints why and passes (install `openmpi-bin libopenmpi-dev`).
//!
//! The scenarios, each on the 8x8 digits with mpx's fused MLP and a dynamic loss scale:
//! - `agreement` (f32, f16 and bf16 on the wire): N ranks on shards of a global batch of 24
//!   against one process on the whole batch: masters within the stated tolerance, bit-identical
//!   across ranks, the same loss-scale trajectory and skips;
//! - `exact` (2 ranks): bit for bit the same as one process that runs the two shards as two
//!   micro-batches and halves their sum (a sum of two is the same in any order);
//! - `skip`: a NaN in one rank's shard makes every rank skip; masters unchanged everywhere;
//! - `reduction_overflow`: an f16 all-reduce whose sum overflows (each rank's payload finite) is a
//!   skip on every rank, the scale backs off, the next step applies; in f32 the same step applies;
//! - `accumulation`: two micro-batches per rank and update, one all-reduce per update, clipping by
//!   global norm after it; against one process; an update after one micro-batch is an error;
//! - `half_bound`: each element of the f16 / bf16 all-reduced gradient within the stated bound of
//!   the f32 one;
//! - `checkpoint`: rank 0's checkpoint (masters and loss-scale state) restored on every rank via
//!   broadcast continues bit-identically to the uninterrupted run;
//! - `layout_mismatch`: one rank with a different model, then one with another wire type: an
//!   error on every rank at the first step, and the update after it refused.

mod common;

use std::io::Read;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use common::digits::{CLASSES, Digits, FEATURES};
use common::grads;
use common::params::{load, values};
use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorRef,
};
use dfdx::{optim::*, prelude::*};
use mpx::distributed::mpi::topology::SimpleCommunicator;
use mpx::distributed::mpi::traits::{Communicator, CommunicatorCollectives, Root};
use mpx::distributed::{AllReduceDtype, DistributedError, Reducer, mpi};
use mpx::precision::f16;
use mpx::scaling::DynamicLossScale;
use mpx::step::{GradScaler, Mixed, ScalerState, StepError, clip_grad_norm};

// ---- the model, the data and the step -----------------------------------------------------------

type Arch = (
    mpx::nn::builders::LinearReLU<FEATURES, 32>,
    mpx::nn::builders::Linear<32, CLASSES>,
);
type Model = <Arch as BuildOnDevice<Cpu, f32>>::Built;
type Tiny = <Linear<1, 1> as BuildOnDevice<Cpu, f32>>::Built;
type X<const B: usize> = Tensor<Rank2<B, FEATURES>, f32, Cpu>;
type Y<const B: usize> = Tensor<Rank2<B, CLASSES>, f32, Cpu>;

/// Images per global batch (a multiple of 2 and 3, twice over for accumulation).
const GLOBAL: usize = 24;
const STEPS: usize = 8;

/// Rows `rows` of global batch `step`.
fn rows<const B: usize>(d: &Digits, step: usize, first: usize) -> (X<B>, Y<B>) {
    let order = d.epoch_order(0);
    let at = step * GLOBAL + first;
    d.train_batch::<B>(&Cpu::default(), &order[at..at + B])
}

fn sgd(m: &Model) -> Sgd<Model, f32, Cpu> {
    Sgd::new(
        m,
        SgdConfig {
            lr: 0.1,
            ..Default::default()
        },
    )
}

fn scaling(initial: f32, period: u32) -> DynamicLossScale {
    DynamicLossScale::builder()
        .initial(initial)
        .period(period)
        .build()
        .expect("a valid loss scale")
}

/// An ordinary dfdx step, made mixed (and, with a reducer on the scaler, data-parallel) by the
/// attribute alone.
#[mpx::mixed_step(scaling = scaler)]
fn step<const B: usize>(
    model: &mut Model,
    opt: &mut Sgd<Model, f32, Cpu>,
    grads: Gradients<f32, Cpu>,
    x: &X<B>,
    y: &Y<B>,
    scaler: &mut GradScaler<f16>,
) -> Gradients<f32, Cpu> {
    let out = model.forward(x.clone().traced(grads));
    let loss = cross_entropy_with_logits_loss(out, y.clone());
    let mut grads = loss.backward();
    opt.update(model, &grads).expect("the update runs");
    model.zero_grads(&mut grads);
    grads
}

// ---- flat views of models and gradients ---------------------------------------------------------

/// The gradients of `m`'s trainable tensors in `g`, flat.
fn grad_vec<M: TensorCollection<f32, Cpu>>(m: &M, g: &Gradients<f32, Cpu>) -> Vec<f32> {
    grads::param_grads::<f32, M>(m, g).concat()
}

struct ScaleGrads<'a>(&'a mut Gradients<f32, Cpu>, f32);

impl TensorVisitor<f32, Cpu> for ScaleGrads<'_> {
    type Viewer = ViewTensorRef;
    type Err = CpuError;
    type E2 = f32;
    type D2 = Cpu;
    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, f32, Cpu>,
        t: &Tensor<S, f32, Cpu>,
    ) -> Result<Option<Tensor<S, f32, Cpu>>, CpuError> {
        if opts.do_gradient_update {
            self.0
                .get_or_alloc_mut(t)?
                .iter_mut()
                .for_each(|v| *v *= self.1);
        }
        Ok(None)
    }
}

/// Multiplies `m`'s gradients in `g` by `factor`.
fn scale_grads<M: TensorCollection<f32, Cpu>>(m: &M, g: &mut Gradients<f32, Cpu>, factor: f32) {
    M::iter_tensors(&mut RecursiveWalker {
        m,
        f: &mut ScaleGrads(g, factor),
    })
    .expect("writable");
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

// ---- the rank side ------------------------------------------------------------------------------

struct Rank {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    data: Digits,
}

type Outcome = Result<String, String>;
/// A named scenario.
type Scenario<'a> = (&'static str, Box<dyn Fn(&Rank) -> Outcome + 'a>);

macro_rules! check {
    ($cond:expr, $($msg:tt)+) => {
        let holds: bool = $cond;
        if !holds {
            return Err(format!($($msg)+));
        }
    };
}

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

impl Rank {
    /// A model drawn from this rank's own seed, then rank 0's weights broadcast to every rank.
    fn common_init(&self) -> Result<Model, String> {
        let dev = Cpu::seed_from_u64(10 + self.rank as u64);
        let mut m = dev.build_module::<Arch, f32>();
        let mut r = Reducer::new(&self.world);
        let before = r.models_agree(&m).map_err(err)?;
        check!(
            !before || self.size == 1,
            "the per-rank draws should differ before the broadcast"
        );
        r.broadcast_model(&mut m, 0).map_err(err)?;
        check!(
            r.models_agree(&m).map_err(err)?,
            "models differ after broadcast_model"
        );
        Ok(m)
    }

    /// The single-process reference: the whole global batch per step.
    fn reference(&self, init: &Model, steps: std::ops::Range<usize>) -> (Model, GradScaler<f16>) {
        let mut m = init.clone();
        let mut opt = sgd(&m);
        let mut scaler = GradScaler::<f16>::new(scaling(1024.0, 4));
        let mut g = m.alloc_grads();
        for k in steps {
            let (x, y) = rows::<GLOBAL>(&self.data, k, 0);
            g = step(&mut m, &mut opt, g, &x, &y, &mut scaler);
        }
        (m, scaler)
    }

    fn agreement<const B: usize>(&self, dtype: AllReduceDtype, tol: f32) -> Outcome {
        let init = self.common_init()?;
        let mut scaler = GradScaler::<f16>::new(scaling(1024.0, 4))
            .with_reducer(Reducer::new(&self.world).with_dtype(dtype));
        let mut m = init.clone();
        let mut opt = sgd(&m);
        let mut g = m.alloc_grads();
        let mut trajectory = vec![];
        for k in 0..STEPS {
            let (x, y) = rows::<B>(&self.data, k, self.rank * B);
            g = step(&mut m, &mut opt, g, &x, &y, &mut scaler);
            trajectory.push(u64::from(scaler.loss_scale().to_bits()));
        }
        let (rm, rscaler) = self.reference(&init, 0..STEPS);
        let counts = [scaler.applied_steps(), scaler.skipped_steps()];
        let r = scaler.reducer_mut().ok_or("no reducer")?;
        check!(
            r.models_agree(&m).map_err(err)?,
            "{dtype:?}: the masters differ across ranks"
        );
        check!(
            r.values_agree(&trajectory).map_err(err)? && r.values_agree(&counts).map_err(err)?,
            "{dtype:?}: loss-scale trajectory or step counts differ across ranks"
        );
        check!(
            r.reductions() == STEPS as u64,
            "{dtype:?}: {} all-reduces for {STEPS} updates",
            r.reductions()
        );
        let diff = max_abs_diff(&values(&m), &values(&rm));
        check!(
            diff <= tol,
            "{dtype:?}: max |ddp - single process| = {diff:e} > {tol:e}"
        );
        check!(
            scaler.loss_scale() == rscaler.loss_scale()
                && scaler.skipped_steps() == rscaler.skipped_steps(),
            "{dtype:?}: loss scale {} / skips {} vs single process {} / {}",
            scaler.loss_scale(),
            scaler.skipped_steps(),
            rscaler.loss_scale(),
            rscaler.skipped_steps()
        );
        Ok(format!(
            "{}: {STEPS} steps, max |ddp - single process| = {diff:.2e} (tolerance {tol:.0e}), masters bit-identical across ranks, loss scale {} on every rank",
            dtype.name(),
            scaler.loss_scale()
        ))
    }

    /// With 2 ranks the f32 sum across the ranks is one addition, whose order does not matter:
    /// the data-parallel run equals, bit for bit, one process that runs the two shards as two
    /// micro-batches and halves their sum.
    fn exact<const B: usize>(&self) -> Outcome {
        if self.size != 2 {
            return Ok(format!(
                "bit-exactness against one process is claimed for 2 ranks (the order of MPI's {}-way sum is its own)",
                self.size
            ));
        }
        let init = self.common_init()?;
        let mut scaler =
            GradScaler::<f16>::new(scaling(1024.0, 4)).with_reducer(Reducer::new(&self.world));
        let mut m = init.clone();
        let mut opt = sgd(&m);
        let mut g = m.alloc_grads();
        for k in 0..STEPS {
            let (x, y) = rows::<B>(&self.data, k, self.rank * B);
            g = step(&mut m, &mut opt, g, &x, &y, &mut scaler);
        }
        let mut rm = Mixed::mapped(init.clone());
        let mut ropt = sgd(&rm);
        let mut rscaler = GradScaler::<f16>::new(scaling(1024.0, 4));
        let mut rg = rm.alloc_grads();
        for k in 0..STEPS {
            for shard in 0..2 {
                let (x, y) = rows::<B>(&self.data, k, shard * B);
                let out = rscaler
                    .forward(&rm, x.traced(rg), |m, x| m.forward(x))
                    .map_err(err)?;
                rg = rscaler
                    .backward(cross_entropy_with_logits_loss(out, y))
                    .map_err(err)?;
            }
            scale_grads(&*rm, &mut rg, 0.5);
            rscaler.update(&mut rm, &mut ropt, &rg).map_err(err)?;
            rm.zero_grads(&mut rg);
        }
        let diff = max_abs_diff(&values(&m), &values(&*rm));
        check!(
            values(&m) == values(&*rm),
            "2 ranks differ from one process with the shards as micro-batches by {diff:e}"
        );
        Ok(format!(
            "{STEPS} steps on 2 ranks bit-identical to one process running the 2 shards as micro-batches"
        ))
    }

    fn skip<const B: usize>(&self) -> Outcome {
        let init = self.common_init()?;
        let mut scaler =
            GradScaler::<f16>::new(scaling(1024.0, 100)).with_reducer(Reducer::new(&self.world));
        let mut m = init.clone();
        let mut opt = sgd(&m);
        let mut g = m.alloc_grads();
        for k in 0..4 {
            let (mut x, y) = rows::<B>(&self.data, k, self.rank * B);
            let poisoned = k == 2 && self.rank == self.size - 1;
            if poisoned {
                let mut v = x.as_vec();
                v[5] = f32::NAN;
                x.copy_from(&v);
            }
            let before = values(&m);
            let scale = scaler.loss_scale();
            g = step(&mut m, &mut opt, g, &x, &y, &mut scaler);
            let applied = scaler.last_step().is_some_and(|s| s.is_applied());
            if k == 2 {
                check!(
                    !applied,
                    "step 2 applied although rank {} had a NaN",
                    self.size - 1
                );
                check!(values(&m) == before, "the skipped step changed the master");
                check!(
                    scaler.loss_scale() == scale / 2.0,
                    "the scale did not back off: {scale} -> {}",
                    scaler.loss_scale()
                );
            } else {
                check!(applied, "step {k} skipped");
            }
        }
        let skipped = scaler.skipped_steps();
        let r = scaler.reducer_mut().ok_or("no reducer")?;
        check!(
            r.skipped_before_reduction() == 1 && r.reductions() == 3,
            "{} skips before the reduction, {} reductions",
            r.skipped_before_reduction(),
            r.reductions()
        );
        check!(
            r.models_agree(&m).map_err(err)? && r.values_agree(&[skipped]).map_err(err)?,
            "ranks differ after the injected skip"
        );
        Ok(format!(
            "a NaN on rank {} at step 2: skipped on every rank, masters untouched, scale halved",
            self.size - 1
        ))
    }

    /// One update of a `Linear<1, 1>` whose bias gradient is `c` per micro-batch, two
    /// micro-batches, at loss scale 2^15, with `dtype` on the wire.
    fn overflow_step(
        &self,
        m: &mut Mixed<Tiny>,
        scaler: &mut GradScaler<f16>,
    ) -> Result<bool, String> {
        // scaled, one micro-batch's bias gradient is 40000: finite in f16 (max 65504); two
        // accumulated, the payload 2 * 40000 / N per rank sums to 80000 across the ranks
        let c = 40000.0 / 32768.0;
        let dev = Cpu::default();
        let mut opt = Sgd::new(&**m, SgdConfig::default());
        let mut g = m.alloc_grads();
        for _ in 0..2 {
            let x: Tensor<Rank2<1, 1>, f32, _> = dev.zeros();
            let y = scaler
                .forward(m, x.trace(g), |m, x| m.forward(x))
                .map_err(err)?;
            g = scaler.backward((y * c).sum()).map_err(err)?;
        }
        let out = scaler.update(m, &mut opt, &g).map_err(err)?;
        Ok(out.is_applied())
    }

    fn reduction_overflow(&self) -> Outcome {
        let dev = Cpu::seed_from_u64(3);
        let init = dev.build_module::<Linear<1, 1>, f32>();
        for dtype in [AllReduceDtype::F32, AllReduceDtype::F16] {
            let reducer = Reducer::new(&self.world)
                .with_dtype(dtype)
                .with_accumulation(2)
                .map_err(err)?;
            let mut scaler = GradScaler::<f16>::new(scaling(32768.0, 100)).with_reducer(reducer);
            let mut m = Mixed::new(init.clone());
            let before = values(&*m);
            let applied = self.overflow_step(&mut m, &mut scaler)?;
            if dtype == AllReduceDtype::F32 {
                check!(applied, "f32 wire: the step was skipped");
                check!(values(&*m) != before, "f32 wire: the master did not move");
            } else {
                check!(!applied, "f16 wire: an overflowing sum was applied");
                check!(
                    values(&*m) == before,
                    "f16 wire: the skip changed the master"
                );
                check!(
                    scaler.loss_scale() == 16384.0,
                    "f16 wire: the scale is {}, not 16384",
                    scaler.loss_scale()
                );
                let r = scaler.reducer().ok_or("no reducer")?;
                check!(
                    r.reductions() == 1 && r.skipped_before_reduction() == 0,
                    "f16 wire: the overflow must come from the reduction"
                );
                // at half the scale the sum fits
                let again = self.overflow_step(&mut m, &mut scaler)?;
                check!(
                    again,
                    "f16 wire: the step after the back-off was skipped too"
                );
                let r = scaler.reducer_mut().ok_or("no reducer")?;
                check!(
                    r.models_agree(&*m).map_err(err)?,
                    "masters differ across ranks"
                );
            }
        }
        Ok("f16 sum of finite payloads overflowing: skipped on every rank, scale 32768 -> 16384, next step applied; f32 applies".into())
    }

    fn accumulation<const M: usize>(&self) -> Outcome {
        const CLIP: f32 = 0.5;
        let init = self.common_init()?;
        let reducer = Reducer::new(&self.world)
            .with_accumulation(2)
            .map_err(err)?;
        let mut scaler = GradScaler::<f16>::new(scaling(1024.0, 4)).with_reducer(reducer);
        let mut m = Mixed::mapped(init.clone());
        let mut opt = sgd(&m);
        let mut g = m.alloc_grads();
        let mut clipped = 0;
        for k in 0..STEPS {
            for micro in 0..2 {
                let (x, y) = rows::<M>(&self.data, k, (self.rank * 2 + micro) * M);
                let out = scaler
                    .forward(&m, x.traced(g), |m, x| m.forward(x))
                    .map_err(err)?;
                // the mean over the micro-batch, halved: the two add up to the shard's mean
                let loss = cross_entropy_with_logits_loss(out, y) * 0.5;
                g = scaler.backward(loss).map_err(err)?;
            }
            if clip_grad_norm(&*m, &mut g, CLIP).map_err(err)? > CLIP {
                clipped += 1;
            }
            scaler.update(&mut m, &mut opt, &g).map_err(err)?;
            m.zero_grads(&mut g);
        }
        // the reference: the whole batch, clipped the same way
        let mut rm = Mixed::mapped(init.clone());
        let mut ropt = sgd(&rm);
        let mut rscaler = GradScaler::<f16>::new(scaling(1024.0, 4));
        let mut rg = rm.alloc_grads();
        for k in 0..STEPS {
            let (x, y) = rows::<GLOBAL>(&self.data, k, 0);
            let out = rscaler
                .forward(&rm, x.traced(rg), |m, x| m.forward(x))
                .map_err(err)?;
            rg = rscaler
                .backward(cross_entropy_with_logits_loss(out, y))
                .map_err(err)?;
            clip_grad_norm(&*rm, &mut rg, CLIP).map_err(err)?;
            rscaler.update(&mut rm, &mut ropt, &rg).map_err(err)?;
            rm.zero_grads(&mut rg);
        }
        let diff = max_abs_diff(&values(&*m), &values(&*rm));
        check!(diff <= 1e-4, "max |ddp - single process| = {diff:e} > 1e-4");
        check!(clipped > 0, "the clipping never acted");
        let r = scaler.reducer_mut().ok_or("no reducer")?;
        check!(
            r.reductions() == STEPS as u64,
            "{} all-reduces for {STEPS} updates of 2 micro-batches",
            r.reductions()
        );
        check!(
            r.models_agree(&*m).map_err(err)?,
            "masters differ across ranks"
        );
        // an update after one micro-batch of two
        let before = values(&*m);
        let (x, y) = rows::<M>(&self.data, 0, self.rank * 2 * M);
        let out = scaler
            .forward(&m, x.traced(g), |m, x| m.forward(x))
            .map_err(err)?;
        let g = scaler
            .backward(cross_entropy_with_logits_loss(out, y))
            .map_err(err)?;
        match scaler.update(&mut m, &mut opt, &g) {
            Err(StepError::Distributed(DistributedError::AccumulationMismatch {
                expected: 2,
                found: 1,
            })) => {}
            other => {
                return Err(format!(
                    "an update after 1 of 2 micro-batches gave {other:?}"
                ));
            }
        }
        check!(
            values(&*m) == before,
            "the refused update changed the master"
        );
        Ok(format!(
            "2 micro-batches x {M} rows per rank: {STEPS} all-reduces for {STEPS} updates, clipped {clipped} times, max |ddp - single process| = {diff:.2e}; an early update is refused"
        ))
    }

    fn half_bound<const B: usize>(&self, dtype: AllReduceDtype) -> Outcome {
        const S: f32 = 1024.0;
        let init = Mixed::mapped(self.common_init()?);
        let (x, y) = rows::<B>(&self.data, 0, self.rank * B);
        let grads_with = |reducer: Option<Reducer>| -> Result<Vec<f32>, String> {
            let mut scaler = GradScaler::<f16>::new(scaling(S, 100));
            if let Some(r) = reducer {
                scaler = scaler.with_reducer(r);
            }
            let out = scaler
                .forward(&init, x.clone().traced(init.alloc_grads()), |m, x| {
                    m.forward(x)
                })
                .map_err(err)?;
            let g = scaler
                .backward(cross_entropy_with_logits_loss(out, y.clone()))
                .map_err(err)?;
            Ok(grad_vec(&*init, &g))
        };
        let local = grads_with(None)?;
        let exact = grads_with(Some(Reducer::new(&self.world)))?;
        let half = grads_with(Some(Reducer::new(&self.world).with_dtype(dtype)))?;
        let mut mean_abs: Vec<f32> = local.iter().map(|v| v.abs()).collect();
        Reducer::new(&self.world)
            .all_reduce_mean(&mut mean_abs, 1.0)
            .map_err(err)?;
        let n = self.size as f32;
        let (u, tiny) = match dtype {
            AllReduceDtype::F16 => (2f32.powi(-11), 2.0 * n * 2f32.powi(-25) / S),
            _ => (2f32.powi(-8), 0.0),
        };
        let (mut worst, mut differ) = (0.0f32, 0usize);
        for i in 0..exact.len() {
            let e = (half[i] - exact[i]).abs();
            let bound = (n + 0.01) * u * mean_abs[i] + tiny + 1e-7 * exact[i].abs();
            check!(
                e <= bound,
                "{}: element {i}: |{} - {}| = {e:e} > bound {bound:e}",
                dtype.name(),
                half[i],
                exact[i]
            );
            if e > 0.0 {
                differ += 1;
                worst = worst.max(e / bound);
            }
        }
        check!(
            differ > 0,
            "{}: no element differs from f32: the wire is not {}",
            dtype.name(),
            dtype.name()
        );
        Ok(format!(
            "{}: {} elements, {differ} differ from the f32 all-reduce, the worst at {:.0}% of the bound (N + 0.01) u mean|g_r| + 2N 2^-25 / S",
            dtype.name(),
            exact.len(),
            worst * 100.0
        ))
    }

    fn checkpoint<const B: usize>(&self, dir: &std::path::Path) -> Outcome {
        const K: usize = 3;
        let path = dir.join("checkpoint.bin");
        let init = self.common_init()?;
        let run = |m: &mut Model, scaler: &mut GradScaler<f16>, steps: std::ops::Range<usize>| {
            let mut opt = sgd(m);
            let mut g = m.alloc_grads();
            for k in steps {
                let (x, y) = rows::<B>(&self.data, k, self.rank * B);
                g = step(m, &mut opt, g, &x, &y, scaler);
            }
        };
        let new_scaler =
            |s: DynamicLossScale| GradScaler::<f16>::new(s).with_reducer(Reducer::new(&self.world));
        // uninterrupted
        let mut a = init.clone();
        let mut sa = new_scaler(scaling(1024.0, 2));
        run(&mut a, &mut sa, 0..2 * K);
        // interrupted after K steps: rank 0 writes the checkpoint
        let mut b = init.clone();
        let mut sb = new_scaler(scaling(1024.0, 2));
        run(&mut b, &mut sb, 0..K);
        if self.rank == 0 {
            let json = serde_json::to_string(&sb.state_dict()).map_err(err)?;
            let mut bytes: Vec<u8> = values(&b).iter().flat_map(|v| v.to_le_bytes()).collect();
            bytes.extend_from_slice(json.as_bytes());
            std::fs::write(&path, bytes).map_err(err)?;
        }
        drop((b, sb));
        self.world.barrier();
        // a fresh process: other weights, another scale; rank 0 reads, every rank receives
        let mut c = Cpu::seed_from_u64(77 + self.rank as u64).build_module::<Arch, f32>();
        let mut sc = new_scaler(DynamicLossScale::default());
        let mut json = Vec::new();
        if self.rank == 0 {
            let bytes = std::fs::read(&path).map_err(err)?;
            let n = values(&c).len() * 4;
            let v: Vec<f32> = bytes[..n]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            load(&mut c, &v);
            json = bytes[n..].to_vec();
        }
        let mut len = json.len() as u64;
        let root = self.world.process_at_rank(0);
        root.broadcast_into(&mut len);
        json.resize(len as usize, 0);
        root.broadcast_into(&mut json[..]);
        let state: ScalerState<DynamicLossScale> = serde_json::from_slice(&json).map_err(err)?;
        // the restore keeps the scaler's reducer: the run goes on averaging
        sc.load_state_dict(state.clone()).map_err(err)?;
        check!(sc.reducer().is_some(), "the restore dropped the reducer");
        sc.reducer_mut()
            .ok_or("no reducer")?
            .broadcast_model(&mut c, 0)
            .map_err(err)?;
        run(&mut c, &mut sc, K..2 * K);
        check!(
            values(&c) == values(&a),
            "the restored run differs from the uninterrupted one by {:e}",
            max_abs_diff(&values(&c), &values(&a))
        );
        check!(
            sc.loss_scale() == sa.loss_scale(),
            "restored loss scale {} vs {}",
            sc.loss_scale(),
            sa.loss_scale()
        );
        let r = sc.reducer_mut().ok_or("no reducer")?;
        check!(
            r.models_agree(&c).map_err(err)?,
            "the restored ranks' masters differ"
        );
        // a mismatched restore: the last rank loads another checkpoint (the uninterrupted run's
        // state, K steps later) than the others: the next backward pass is an error on every
        // rank, not a hang and not a silent drift
        let mut sd = new_scaler(DynamicLossScale::default());
        let wrong = if self.rank == self.size - 1 {
            sa.state_dict()
        } else {
            state
        };
        sd.load_state_dict(wrong).map_err(err)?;
        let d = Mixed::mapped(c.clone());
        let (x, y) = rows::<B>(&self.data, 0, self.rank * B);
        let out = sd
            .forward(&d, x.traced(d.alloc_grads()), |m, x| m.forward(x))
            .map_err(err)?;
        let mismatch = match sd.backward(cross_entropy_with_logits_loss(out, y)) {
            Err(e @ StepError::Distributed(DistributedError::ConfigMismatch { .. })) => e,
            other => {
                return Err(format!(
                    "ranks restored from different checkpoints did not fail the step: {:?}",
                    other.map(|_| ())
                ));
            }
        };
        Ok(format!(
            "written by rank 0 after {K} steps, restored on every rank (state_dict / load_state_dict, the reducer kept): {} more steps bit-identical to the uninterrupted run (loss scale {}); one rank restored from another checkpoint: \"{mismatch}\" on every rank",
            K,
            sa.loss_scale()
        ))
    }

    fn layout_mismatch(&self) -> Outcome {
        let layout = if self.rank == self.size - 1 {
            self.mismatch_with::<3>()
        } else {
            self.mismatch_with::<2>()
        }?;
        // the same model, but the last rank reduces in f16: an error everywhere, nothing moved
        let dev = Cpu::seed_from_u64(5);
        let mut m = Mixed::new(dev.build_module::<Linear<4, 2>, f32>());
        let before = values(&*m);
        let dtype = if self.rank == self.size - 1 {
            AllReduceDtype::F16
        } else {
            AllReduceDtype::F32
        };
        let mut scaler =
            GradScaler::<f16>::default().with_reducer(Reducer::new(&self.world).with_dtype(dtype));
        let x: Tensor<Rank2<1, 4>, f32, _> = dev.ones();
        let y = scaler
            .forward(&m, x.trace(m.alloc_grads()), |m, x| m.forward(x))
            .map_err(err)?;
        match scaler.backward(y.sum()) {
            Err(StepError::Distributed(DistributedError::ConfigMismatch { .. })) => {}
            other => {
                return Err(format!(
                    "ranks with different wire types did not fail the step: {:?}",
                    other.map(|_| ())
                ));
            }
        }
        let mut opt = Sgd::new(&*m, SgdConfig::default());
        let g = m.alloc_grads();
        // the update after the failed backward is refused too, not applied
        let refused = matches!(
            scaler.update(&mut m, &mut opt, &g),
            Err(StepError::Distributed(DistributedError::ReductionFailed))
        );
        check!(
            refused && values(&*m) == before,
            "the update after a failed all-reduce was not refused"
        );
        Ok(format!(
            "{layout}; different wire types: ConfigMismatch on every rank"
        ))
    }

    fn mismatch_with<const O: usize>(&self) -> Outcome {
        let dev = Cpu::default();
        let mut m = dev.build_module::<Linear<4, O>, f32>();
        let mut r = Reducer::new(&self.world);
        match r.broadcast_model(&mut m, 0) {
            Err(DistributedError::LayoutMismatch { .. }) => {}
            other => {
                return Err(format!(
                    "broadcast_model of different models gave {other:?}"
                ));
            }
        }
        let mut scaler = GradScaler::<f16>::default().with_reducer(r);
        let m = Mixed::new(m);
        let x: Tensor<Rank2<1, 4>, f32, _> = dev.ones();
        let y = scaler
            .forward(&m, x.trace(m.alloc_grads()), |m, x| m.forward(x))
            .map_err(err)?;
        match scaler.backward(y.sum()) {
            Err(e @ StepError::Distributed(DistributedError::LayoutMismatch { .. })) => {
                Ok(format!("every rank: \"{e}\""))
            }
            other => Err(format!(
                "a rank with another model did not fail the step: {:?}",
                other.map(|_| ())
            )),
        }
    }

    /// A scaler moved to another thread while MPI runs below `Threading::Multiple` (as
    /// `mpi::initialize()` leaves it): its reducer refuses to call MPI there, before sending
    /// anything, and still works on the thread that made it.
    fn wrong_thread(&self) -> Outcome {
        use mpx::distributed::mpi::Threading;
        let level = mpx::distributed::mpi::environment::threading_support();
        if level == Threading::Multiple {
            return Ok("MPI runs at Threading::Multiple: every thread may call it".into());
        }
        let mut scaler = GradScaler::<f16>::default().with_reducer(Reducer::new(&self.world));
        let moved = std::thread::scope(|s| {
            s.spawn(|| {
                let r = scaler.reducer_mut().expect("a reducer");
                r.values_agree(&[1])
            })
            .join()
            .expect("the thread ran")
        });
        check!(
            matches!(moved, Err(DistributedError::WrongThread { .. })),
            "a reducer used from another thread at {level:?} gave {moved:?}"
        );
        let r = scaler.reducer_mut().ok_or("no reducer")?;
        check!(
            r.values_agree(&[2]).map_err(err)?,
            "the reducer failed on its own thread"
        );
        Ok(format!(
            "at {level:?}: refused on another thread (WrongThread), works on its own"
        ))
    }

    /// The last rank exits without a word before the first step; the others step on.
    fn die(&self) -> Outcome {
        let init = self.common_init()?;
        let mut scaler = GradScaler::<f16>::default().with_reducer(Reducer::new(&self.world));
        if self.rank == self.size - 1 {
            eprintln!("rank {}: exiting on purpose", self.rank);
            std::process::exit(3);
        }
        let mut m = init.clone();
        let mut opt = sgd(&m);
        let mut g = m.alloc_grads();
        for k in 0..STEPS {
            let (x, y) = rows::<12>(&self.data, k, 0);
            g = step(&mut m, &mut opt, g, &x, &y, &mut scaler);
        }
        Ok("finished all steps".into())
    }
}

/// Runs `f` with the shard size for this many ranks (the global batch split evenly).
macro_rules! per_size {
    ($size:expr, $b:ident => $e:expr) => {
        match $size {
            1 => {
                const $b: usize = GLOBAL;
                $e
            }
            2 => {
                const $b: usize = GLOBAL / 2;
                $e
            }
            3 => {
                const $b: usize = GLOBAL / 3;
                $e
            }
            n => Err(format!("run with 1 to 3 ranks, not {n}")),
        }
    };
}

fn rank_main(what: &str, dir: &std::path::Path) -> ExitCode {
    let Some(universe) = mpi::initialize() else {
        eprintln!("MPI was initialised already");
        return ExitCode::FAILURE;
    };
    mpx::settings::set_max_threads(1);
    let world = universe.world();
    let me = Rank {
        rank: world.rank() as usize,
        size: world.size() as usize,
        world,
        data: Digits::load(0.2, 7),
    };
    let scenarios: Vec<Scenario<'_>> = if what == "die" {
        vec![("die", Box::new(Rank::die))]
    } else {
        vec![
            (
                "agreement",
                Box::new(
                    |r: &Rank| per_size!(r.size, B => r.agreement::<B>(AllReduceDtype::F32, 1e-4)),
                ),
            ),
            (
                "agreement",
                Box::new(
                    |r: &Rank| per_size!(r.size, B => r.agreement::<B>(AllReduceDtype::F16, 1e-3)),
                ),
            ),
            (
                "agreement",
                Box::new(
                    |r: &Rank| per_size!(r.size, B => r.agreement::<B>(AllReduceDtype::Bf16, 5e-3)),
                ),
            ),
            (
                "exact",
                Box::new(|r: &Rank| per_size!(r.size, B => r.exact::<B>())),
            ),
            (
                "skip",
                Box::new(|r: &Rank| per_size!(r.size, B => r.skip::<B>())),
            ),
            ("reduction_overflow", Box::new(Rank::reduction_overflow)),
            (
                "accumulation",
                Box::new(
                    |r: &Rank| per_size!(r.size, B => { const M: usize = B / 2; r.accumulation::<M>() }),
                ),
            ),
            (
                "half_bound",
                Box::new(|r: &Rank| per_size!(r.size, B => r.half_bound::<B>(AllReduceDtype::F16))),
            ),
            (
                "half_bound",
                Box::new(
                    |r: &Rank| per_size!(r.size, B => r.half_bound::<B>(AllReduceDtype::Bf16)),
                ),
            ),
            (
                "checkpoint",
                Box::new(move |r: &Rank| per_size!(r.size, B => r.checkpoint::<B>(dir))),
            ),
            ("layout_mismatch", Box::new(Rank::layout_mismatch)),
            ("wrong_thread", Box::new(Rank::wrong_thread)),
        ]
    };
    for (name, f) in &scenarios {
        match f(&me) {
            Ok(msg) => {
                if me.rank == 0 {
                    println!("np {}: {name}: ok: {msg}", me.size);
                }
            }
            Err(msg) => {
                eprintln!("np {} rank {}: {name}: FAILED: {msg}", me.size, me.rank);
                me.world.abort(1);
            }
        }
        me.world.barrier();
    }
    println!("rank {} finished", me.rank);
    ExitCode::SUCCESS
}

// ---- the launcher side --------------------------------------------------------------------------

/// Runs `mpirun -np <np> <this binary> <what> <dir>` for at most `limit`; returns the exit
/// status (`None` when it had to be killed), the output and the time taken.
fn launch(np: usize, what: &str, limit: Duration) -> (Option<i32>, String, Duration) {
    let dir = std::env::temp_dir().join(format!(
        "mpx-distributed-{}-{np}-{what}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let exe = std::env::current_exe().expect("the test binary's path");
    let start = Instant::now();
    let mut child = Command::new("mpirun")
        .args([
            "--oversubscribe",
            "--bind-to",
            "none",
            "-np",
            &np.to_string(),
        ])
        .arg(exe)
        .arg(what)
        .arg(&dir)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun starts");
    let mut pipes = [
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    ];
    let readers: Vec<_> = pipes
        .iter_mut()
        .filter_map(Option::take)
        .map(|mut p| {
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = p.read_to_string(&mut s);
                s
            })
        })
        .collect();
    let status = loop {
        if let Some(st) = child.try_wait().expect("waitable") {
            break st.code();
        }
        if start.elapsed() > limit {
            // mpirun forwards SIGTERM to its ranks; SIGKILL would orphan them
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            std::thread::sleep(Duration::from_secs(5));
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let elapsed = start.elapsed();
    let out = readers
        .into_iter()
        .map(|r| r.join().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("");
    let _ = std::fs::remove_dir_all(&dir);
    (status, out, elapsed)
}

fn launcher() -> ExitCode {
    let found = Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        println!(
            "distributed: skipped: `mpirun` is not on the PATH (Debian: apt-get install openmpi-bin libopenmpi-dev)"
        );
        return ExitCode::SUCCESS;
    }
    let mut failed = 0;
    for np in [2, 3] {
        let (status, out, t) = launch(np, "all", Duration::from_secs(300));
        print!("{out}");
        let ok = status == Some(0)
            && (0..np).all(|r| out.contains(&format!("rank {r} finished")))
            && out.matches(": ok: ").count() == 12;
        println!(
            "test distributed -np {np} ... {} ({:.1} s)",
            if ok { "ok" } else { "FAILED" },
            t.as_secs_f64()
        );
        failed += usize::from(!ok);
    }
    // a rank that dies: the job must end, with an error, well before the limit
    let limit = Duration::from_secs(60);
    let (status, out, t) = launch(2, "die", limit);
    let ok = matches!(status, Some(code) if code != 0)
        && t < limit
        && !out.contains("rank 0 finished")
        && out.contains("exiting on purpose");
    println!(
        "test distributed rank death ... {} ({:.1} s, mpirun exit status {status:?})",
        if ok { "ok" } else { "FAILED" },
        t.as_secs_f64()
    );
    if !ok {
        println!("{out}");
    } else {
        let first = out
            .lines()
            .find(|l| l.contains("exited") || l.contains("died") || l.contains("non-zero"))
            .unwrap_or("");
        println!("  mpirun said: {}", first.trim());
    }
    failed += usize::from(!ok);
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        println!("distributed: {failed} failed");
        ExitCode::FAILURE
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let under_mpirun = std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some()
        || std::env::var_os("PMI_SIZE").is_some();
    if under_mpirun && args.len() >= 3 {
        rank_main(&args[1], std::path::Path::new(&args[2]))
    } else {
        launcher()
    }
}
