//! The primitives on dfdx's `Cuda` device: dfdx's `to_dtype` for the casts, and small
//! kernels of mpx's own for the gradients (dfdx 0.13 keeps its tensors' buffers and its
//! gradient kernels crate-private, but hands out a gradient's device buffer through
//! `Gradients::get_or_alloc_mut`). The kernels are compiled with NVRTC at first use, as dfdx
//! compiles its own, and need no CUDA header: the f16 conversions are the PTX `cvt`
//! instructions themselves.
//!
//! On `Cuda` nothing is linked (mpx's fused layers are the `Cpu`'s): every working tensor's half
//! gradient is transferred, and a traced input's gradient is always computed.
//!
//! What crosses the bus per backward pass: the kernels' scalar arguments (a length, a scale),
//! and back, per master the backward pass reached, the two-word probe of whether its gradients
//! are kept ([`Primitives::kept`]) and the one-word finiteness flag of its gradients. No tensor
//! data.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;

use cudarc::driver::sys::CUresult;
use cudarc::driver::{
    CudaDevice, CudaFunction, CudaSlice, DevicePtr, DeviceRepr, DeviceSlice, DriverError,
    LaunchAsync, LaunchConfig,
};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use dfdx::optim::OptimizerUpdateError;
use dfdx::shapes::{Dtype, HasShape, Shape};
use dfdx::tensor::{
    Cuda, CudaError, Gradients, NoneTape, OwnedTape, PutTape, SplitTape, Storage, Tape, Tensor,
    Trace,
};
use dfdx::tensor_ops::{Backward, ReshapeTo, SumTo, TryMul};

use super::private::Primitives;
use super::{FullOp, HalfOp, Pair, SeedOp};
use crate::master::slots::{MasterSlot, Slot, SlotDevice};
use crate::precision::{AMP, Precision, f16};
use crate::region::{Flat, Leaves, RegionDevice, RegionError, Traced32};
use crate::step::error::StepError;

/// The module name the kernels are loaded under.
const MODULE: &str = "mpx_step";

/// The kernels' names, in the order of [`KERNELS`]' source.
const NAMES: [&str; 9] = [
    "mpx_add_widened_f16",
    "mpx_add_widened_f32",
    "mpx_seed_f16",
    "mpx_seed_f32",
    "mpx_flag_nonfinite",
    "mpx_assign_f16",
    "mpx_assign_f32",
    "mpx_mark",
    "mpx_unmark",
];

/// The kernels. Every sum is rounded as the `Cpu` path rounds it (NVRTC is told not to fuse a
/// multiply and an add), so an f32 step agrees with the `Cpu`'s formulas bit for bit.
const KERNELS: &str = r#"
typedef unsigned short mpx_half;

__device__ __forceinline__ float mpx_h2f(mpx_half h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ mpx_half mpx_f2h(float f) {
    mpx_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// true for inf and NaN (x - x is NaN there, 0 elsewhere)
__device__ __forceinline__ bool mpx_nonfinite(float x) { return !(x - x == 0.0f); }

#define MPX_LOOP for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x)

// the unscale-add: dst += float(src) * inv (a working tensor's half gradient into its master's,
// an input's half gradient into its f32 one, a region's f32 sums)
extern "C" __global__ void mpx_add_widened_f16(const size_t n, const mpx_half *src, const float inv, float *dst) {
    MPX_LOOP { dst[i] = dst[i] + mpx_h2f(src[i]) * inv; }
}

extern "C" __global__ void mpx_add_widened_f32(const size_t n, const float *src, const float inv, float *dst) {
    MPX_LOOP { dst[i] = dst[i] + src[i] * inv; }
}

// an output's half gradient += half(its f32 gradient * scale)
extern "C" __global__ void mpx_seed_f16(const size_t n, const float *g, const float scale, mpx_half *dst) {
    MPX_LOOP {
        mpx_half s = mpx_f2h(g[i] * scale);
        dst[i] = mpx_f2h(mpx_h2f(dst[i]) + mpx_h2f(s));
    }
}

extern "C" __global__ void mpx_seed_f32(const size_t n, const float *g, const float scale, float *dst) {
    MPX_LOOP { dst[i] = dst[i] + g[i] * scale; }
}

// the finiteness check: sets the flag on a non-finite element
extern "C" __global__ void mpx_flag_nonfinite(const size_t n, const float *g, unsigned int *flag) {
    MPX_LOOP {
        if (mpx_nonfinite(g[i])) { *flag = 1u; }
    }
}

// dst = round(src) (a full-precision region's gradient sums written back into the half graph)
extern "C" __global__ void mpx_assign_f16(const size_t n, const float *src, mpx_half *dst) {
    MPX_LOOP { dst[i] = mpx_f2h(src[i]); }
}

extern "C" __global__ void mpx_assign_f32(const size_t n, const float *src, float *dst) {
    MPX_LOOP { dst[i] = src[i]; }
}

// whether a gradient is kept: a NaN of mpx's own (any value but a fresh gradient's zero would do)
// in its first element, looked for after the gradients dropped what is not a leaf
#define MPX_MARK 0x7fc05a17u

// word[0] = the first element's bits; the mark in its place
extern "C" __global__ void mpx_mark(unsigned int *g, unsigned int *word) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        word[0] = g[0];
        g[0] = MPX_MARK;
    }
}

// word[1] = whether the first element is the mark; when it is, its value is put back
extern "C" __global__ void mpx_unmark(unsigned int *g, unsigned int *word) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned int kept = g[0] == MPX_MARK ? 1u : 0u;
        if (kept) { g[0] = word[0]; }
        word[1] = kept;
    }
}
"#;

/// Compiles and loads the kernels on `dev` unless they are loaded.
fn load(dev: &Arc<CudaDevice>) -> Result<(), StepError> {
    if dev.has_func(MODULE, NAMES[0]) {
        return Ok(());
    }
    let opts = CompileOptions {
        fmad: Some(false),
        ..CompileOptions::default()
    };
    let ptx = compile_ptx_with_opts(KERNELS, opts)
        .map_err(|e| StepError::CudaKernels(format!("{e:?}")))?;
    dev.load_ptx(ptx, MODULE, &NAMES)
        .map_err(|e| StepError::Cuda(CudaError::Driver(e)))
}

/// A kernel, loaded on `dev` first where it is not (a path that did not go through
/// [`Primitives::ready`], such as a full-precision region: NVRTC's log is then lost, its failure
/// an invalid-source driver error).
fn kernel(dev: &Arc<CudaDevice>, name: &str) -> Result<CudaFunction, CudaError> {
    load(dev).map_err(|e| match e {
        StepError::Cuda(e) => e,
        _ => CudaError::Driver(DriverError(CUresult::CUDA_ERROR_INVALID_SOURCE)),
    })?;
    dev.get_func(MODULE, name)
        .ok_or(CudaError::Driver(DriverError(
            CUresult::CUDA_ERROR_NOT_FOUND,
        )))
}

/// The kernel of a family (`[f16 name, f32 name]`) for elements of type `E`, on `dev`, with the
/// element count `n` of its two slices (`lens`) and its launch configuration: a length mismatch
/// is an error. What every elementwise launch below does before its `unsafe` call.
fn launcher<E>(
    dev: &Arc<CudaDevice>,
    (n, other): (usize, usize),
    [f16_name, f32_name]: [&'static str; 2],
) -> Result<(CudaFunction, LaunchConfig, usize), CudaError> {
    if other != n {
        return Err(mismatch());
    }
    // f16 and `AMP<f16>` are 2 bytes, f32 is 4: the only element types this module is
    // implemented for
    let name = if std::mem::size_of::<E>() == 2 {
        f16_name
    } else {
        f32_name
    };
    Ok((kernel(dev, name)?, config(n), n))
}

/// One thread per element, as dfdx launches its own elementwise kernels.
fn config(n: usize) -> LaunchConfig {
    // Lengths past u32 run as a grid-stride loop over the largest grid.
    LaunchConfig::for_num_elems(u32::try_from(n).unwrap_or(u32::MAX))
}

/// One thread (the probe's kernels touch one element).
fn single() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn mismatch() -> CudaError {
    CudaError::Cpu(dfdx::tensor::CpuError::WrongNumElements)
}

/// `t`'s gradient buffer in `grads` (allocated as zeros when `grads` has none), as long as `t`'s
/// buffer: a tensor and its cast (dfdx's `to_dtype` keeps the strides) have buffers of one
/// layout, so a gradient moves between them element by element whatever the layout.
fn buffer<'a, E: Dtype>(
    slot: &Slot<E, Cuda>,
    grads: &'a mut Gradients<E, Cuda>,
) -> Result<&'a mut CudaSlice<E>, CudaError>
where
    Cuda: SlotDevice<E>,
    <Cuda as Storage<E>>::Vec: std::ops::DerefMut<Target = CudaSlice<E>>,
{
    let buf: &mut CudaSlice<E> = slot.buffer(grads)?;
    Ok(buf)
}

/// [`buffer`], checked to hold the tensor's element count, as the `Cpu`'s `Slot::slice` checks
/// it (a master's and its working tensor's gradients).
fn checked<'a, E: Dtype>(
    slot: &Slot<E, Cuda>,
    grads: &'a mut Gradients<E, Cuda>,
) -> Result<&'a mut CudaSlice<E>, CudaError>
where
    Cuda: SlotDevice<E>,
    <Cuda as Storage<E>>::Vec: std::ops::DerefMut<Target = CudaSlice<E>>,
{
    let buf = buffer(slot, grads)?;
    if buf.len() == slot.len {
        Ok(buf)
    } else {
        Err(mismatch())
    }
}

/// The [`Primitives::Finite`] of `Cuda`: the device word the finiteness kernel sets on a
/// non-finite gradient (allocated at the first check of a verdict, read once by it).
#[derive(Default)]
pub struct Flag(Option<CudaSlice<u32>>);

impl Flag {
    fn get(&mut self, dev: &Arc<CudaDevice>) -> Result<&mut CudaSlice<u32>, CudaError> {
        if self.0.is_none() {
            self.0 = Some(dev.alloc_zeros::<u32>(1)?);
        }
        self.0.as_mut().ok_or_else(mismatch)
    }
}

/// The [`Primitives::Store`] of `Cuda`: nothing. A working copy's tensors are allocated on the
/// master's own device by dfdx's `to_dtype`, through that device's allocation cache when its
/// user turned it on (`dev.enable_cache()`); the step leaves the device's settings alone.
#[derive(Debug, Default, Clone, Copy)]
pub struct Store;

/// `dst += src * inv`: the unscale-add (a working tensor's half gradient into its master's, an
/// input's gradient leaving the half region, a full-precision region's f32 sums).
fn add_widened<E: DeviceRepr>(
    src: &CudaSlice<E>,
    dst: &mut CudaSlice<f32>,
    inv: f32,
) -> Result<(), CudaError> {
    let (f, cfg, n) = launcher::<E>(
        &dst.device(),
        (dst.len(), src.len()),
        ["mpx_add_widened_f16", "mpx_add_widened_f32"],
    )?;
    // SAFETY: the kernel reads `n` elements of `src` and reads and writes `n` of `dst` (both `n`
    // long, checked above); the argument types are its parameters' (`size_t`, 16- or 32-bit
    // elements as picked by size, `float`, `float*`).
    unsafe { f.launch(cfg, (n, src, inv, dst)) }?;
    Ok(())
}

/// `dst += round(g * scale)` (an output's gradient entering the half region).
fn seed<E: DeviceRepr>(
    g: &CudaSlice<f32>,
    dst: &mut CudaSlice<E>,
    scale: f32,
) -> Result<(), CudaError> {
    let (f, cfg, n) = launcher::<E>(
        &g.device(),
        (g.len(), dst.len()),
        ["mpx_seed_f16", "mpx_seed_f32"],
    )?;
    // SAFETY: the kernel reads `n` elements of `g` and reads and writes `n` of `dst` (both `n`
    // long, checked above); the argument types are its parameters'.
    unsafe { f.launch(cfg, (n, g, scale, dst)) }?;
    Ok(())
}

/// `dst = round(src)`.
fn assign<E: DeviceRepr>(src: &CudaSlice<f32>, dst: &mut CudaSlice<E>) -> Result<(), CudaError> {
    let (f, cfg, n) = launcher::<E>(
        &src.device(),
        (src.len(), dst.len()),
        ["mpx_assign_f16", "mpx_assign_f32"],
    )?;
    // SAFETY: the kernel reads `n` elements of `src` and writes `n` of `dst` (both `n` long,
    // checked above); the argument types are its parameters'.
    unsafe { f.launch(cfg, (n, src, dst)) }?;
    Ok(())
}

/// Flags a non-finite element of `g`.
fn flag_nonfinite(g: &CudaSlice<f32>, flag: &mut Flag) -> Result<(), CudaError> {
    let n = g.len();
    let dev = g.device();
    let f = kernel(&dev, "mpx_flag_nonfinite")?;
    let flag = flag.get(&dev)?;
    // SAFETY: the kernel reads `n` elements of `g` (its length) and writes the one element of
    // `flag`; the argument types are its parameters'.
    unsafe { f.launch(config(n), (n, g, flag)) }?;
    Ok(())
}

/// Whether `grads` keep `slot`'s gradient: the `Cpu`'s probe (a mark in its first element
/// survives dropping what is not a leaf exactly when the gradient is one, and its value is put
/// back then), with the mark written and looked for on the device, and one two-word read back.
fn probe_kept(
    slot: &MasterSlot<Cuda>,
    grads: &mut Gradients<f32, Cuda>,
) -> Result<bool, CudaError> {
    let g = checked(slot, grads)?;
    if g.len() == 0 {
        return Ok(true);
    }
    let dev = g.device();
    let (mark, unmark) = (kernel(&dev, "mpx_mark")?, kernel(&dev, "mpx_unmark")?);
    let mut word = dev.alloc_zeros::<u32>(2)?;
    // SAFETY: the kernel's one thread reads and writes element 0 of `g` (not empty, checked
    // above) as the bits of an f32 (both 4 bytes, every bit pattern valid for both) and writes
    // element 0 of `word` (2 long); the arguments are the two device pointers it takes.
    unsafe { mark.launch(single(), (&mut *g, &mut word)) }?;
    grads.drop_non_leafs();
    // the same buffer when it is a leaf; a fresh one of zeros when it was dropped
    let g = checked(slot, grads)?;
    // SAFETY: the kernel's one thread reads and may write element 0 of `g` (as long as the one
    // marked: checked against the slot's length) as the bits of an f32, as above, reads element
    // 0 of `word` and writes element 1 (2 long); the arguments are the two device pointers it
    // takes.
    unsafe { unmark.launch(single(), (&mut *g, &mut word)) }?;
    let word = dev.dtoh_sync_copy(&word)?;
    let kept = word.get(1) == Some(&1);
    if !kept {
        // the zeros just allocated to look
        grads.drop_non_leafs();
    }
    Ok(kept)
}

/// The gradients' device, as cudarc's handle (the kernels are loaded on it).
fn handle(dev: &Cuda) -> Result<Arc<CudaDevice>, StepError> {
    let probe = Storage::<f32>::try_alloc_len(dev, 1).map_err(StepError::Cuda)?;
    Ok(probe.device())
}

/// The ops that carry a traced input's half gradient (of `x`) back to its f32 gradient (of
/// `x32`), unscaled with `inv`: the region's bridge drops the half gradients before the f32 op
/// runs, so the first op keeps a device copy of the input's.
fn bridge_input<S: Shape, E: Dtype + DeviceRepr>(
    x: &Tensor<S, E, Cuda>,
    x32: &Tensor<S, f32, Cuda>,
    inv: f32,
) -> (HalfOp<E, Cuda>, FullOp<Cuda>)
where
    Cuda: SlotDevice<E> + SlotDevice<f32>,
    <Cuda as Storage<E>>::Vec: std::ops::DerefMut<Target = CudaSlice<E>>,
    <Cuda as Storage<f32>>::Vec: std::ops::DerefMut<Target = CudaSlice<f32>>,
{
    let (x, x32) = (Slot::of(x), Slot::of(x32));
    let captured: Rc<Cell<Option<CudaSlice<E>>>> = Rc::default();
    let capture = Rc::clone(&captured);
    let inner: HalfOp<E, Cuda> = Box::new(move |g: &mut Gradients<E, Cuda>| {
        let copy = buffer(&x, g)?.try_clone()?;
        capture.set(Some(copy));
        Ok(())
    });
    let writer: FullOp<Cuda> = Box::new(move |g: &mut Gradients<f32, Cuda>| {
        if let Some(src) = captured.take() {
            add_widened(&src, buffer(&x32, g)?, inv)?;
        }
        Ok(())
    });
    (inner, writer)
}

/// The op that seeds a traced output's half gradient (of `y`) with its f32 gradient (of `y32`)
/// times `scale`: the f32 gradient is copied on the device when the op runs, and added, scaled
/// and rounded, when the half backward starts.
fn seed_output<S: Shape, E: Dtype + DeviceRepr>(
    y: &Tensor<S, E, Cuda>,
    y32: &Tensor<S, f32, Cuda>,
    scale: f32,
) -> SeedOp<E, Cuda>
where
    Cuda: SlotDevice<E> + SlotDevice<f32>,
    <Cuda as Storage<E>>::Vec: std::ops::DerefMut<Target = CudaSlice<E>>,
    <Cuda as Storage<f32>>::Vec: std::ops::DerefMut<Target = CudaSlice<f32>>,
{
    let (y, y32) = (Slot::of(y), Slot::of(y32));
    Box::new(move |g32: &mut Gradients<f32, Cuda>| {
        let g = buffer(&y32, g32)?.try_clone()?;
        let apply: HalfOp<E, Cuda> =
            Box::new(move |h: &mut Gradients<E, Cuda>| seed(&g, buffer(&y, h)?, scale));
        Ok(apply)
    })
}

macro_rules! on_cuda {
    ($($h:ty),*) => {$(
        impl Primitives<$h> for Cuda {
            type Links = ();
            type Finite = Flag;

            fn step_error(e: CudaError) -> StepError {
                StepError::Cuda(e)
            }

            fn optimizer_error(e: OptimizerUpdateError<CudaError>) -> StepError {
                StepError::CudaOptimizer(e)
            }

            fn region_device<M: crate::boundary::MasterModel<Cuda>>(
                master: &M,
                _: &mut Self::Store,
            ) -> Result<Cuda, StepError> {
                let dev = crate::master::slots::first_device::<f32, Cuda, M>(master)
                    .map_err(StepError::Cuda)?
                    .ok_or(StepError::NoTensors {
                        model: std::any::type_name::<M>(),
                    })?;
                load(&handle(&dev)?)?;
                Ok(dev)
            }

            fn links(_: f32) {}

            fn linker(_: &()) -> crate::step::Linker {
                // mpx's fused layers are the `Cpu`'s: nothing to link to
                crate::step::Linker::none()
            }

            fn is_linked(_: &(), _: usize) -> bool {
                false
            }

            fn lend(_: &(), _: &mut Gradients<f32, Cuda>) {}

            fn restore(_: &(), _: &mut Gradients<f32, Cuda>) {}

            type Store = Store;

            fn to_working<S: Shape>(
                x: &Tensor<S, f32, Cuda>,
                _: &mut Store,
            ) -> Result<Tensor<S, <$h as Precision>::Elem, Cuda>, CudaError> {
                x.clone().try_to_dtype()
            }

            fn recycle(_: &mut Store) {}

            fn to_half<S: Shape, T>(
                x: &Tensor<S, f32, Cuda, T>,
            ) -> Result<Tensor<S, <$h as Precision>::Elem, Cuda>, CudaError> {
                x.retaped::<NoneTape>().try_to_dtype()
            }

            fn to_full<S: Shape, T>(
                y: &Tensor<S, <$h as Precision>::Elem, Cuda, T>,
            ) -> Result<Tensor<S, f32, Cuda>, CudaError> {
                y.retaped::<NoneTape>().try_to_dtype()
            }

            fn input_bridge<S: Shape>(
                x: &Tensor<S, <$h as Precision>::Elem, Cuda>,
                x32: &Tensor<S, f32, Cuda>,
                inv: f32,
                _: &(),
            ) -> (HalfOp<<$h as Precision>::Elem, Cuda>, Option<FullOp<Cuda>>) {
                let (capture, writer) = bridge_input(x, x32, inv);
                (capture, Some(writer))
            }

            fn unread_mark<S: Shape>(
                _: &Tensor<S, <$h as Precision>::Elem, Cuda>,
                _: &(),
            ) -> Option<HalfOp<<$h as Precision>::Elem, Cuda>> {
                // no linked layer to skip the input's gradient: it is computed and bridged
                None
            }

            fn output_seed<S: Shape>(
                y: &Tensor<S, <$h as Precision>::Elem, Cuda>,
                y32: &Tensor<S, f32, Cuda>,
                scale: f32,
            ) -> SeedOp<<$h as Precision>::Elem, Cuda> {
                seed_output(y, y32, scale)
            }

            fn transfer(
                half: &mut Gradients<<$h as Precision>::Elem, Cuda>,
                pair: &Pair<$h, Cuda>,
                grads: &mut Gradients<f32, Cuda>,
                inv: f32,
            ) -> Result<(), CudaError> {
                // never linked on `Cuda` (no links): the half gradient is always moved
                let src = checked(&pair.half, half)?;
                let dst = checked(&pair.master, grads)?;
                add_widened(src, dst, inv)
            }

            fn check(
                slot: &MasterSlot<Cuda>,
                grads: &mut Gradients<f32, Cuda>,
                finite: &mut Flag,
            ) -> Result<(), StepError> {
                let g = checked(slot, grads)?;
                // NVRTC's log, should the kernels first load here
                load(&g.device())?;
                flag_nonfinite(g, finite).map_err(StepError::Cuda)
            }

            fn verdict(finite: Flag) -> Result<bool, StepError> {
                let Some(flag) = finite.0 else {
                    return Ok(true);
                };
                // the one word of the verdict that crosses the bus
                let word = flag
                    .device()
                    .dtoh_sync_copy(&flag)
                    .map_err(|e| StepError::Cuda(e.into()))?;
                Ok(word.first() == Some(&0))
            }

            fn kept(
                slot: &MasterSlot<Cuda>,
                grads: &mut Gradients<f32, Cuda>,
            ) -> Result<bool, StepError> {
                probe_kept(slot, grads).map_err(StepError::Cuda)
            }

            #[cfg(feature = "mpi")]
            fn reduce(
                reducer: Option<&mut crate::distributed::Reducer>,
                _: &[&MasterSlot<Cuda>],
                _: &mut Gradients<f32, Cuda>,
                _: bool,
                _: bool,
                _: f32,
                _: [u64; 2],
            ) -> Result<Option<bool>, StepError> {
                no_reducer(reducer.as_deref()).map(|()| None)
            }

            #[cfg(feature = "mpi")]
            fn before_update(
                reducer: Option<&mut crate::distributed::Reducer>,
            ) -> Result<(), StepError> {
                no_reducer(reducer.as_deref())
            }
        }
    )*};
}
on_cuda!(f32, f16, AMP<f16>);

/// The data-parallel reducer packs host gradients: only a `Cpu` scaler takes one
/// (`with_reducer`), so a `Cuda` scaler has none, and one that had would be refused, not ignored.
#[cfg(feature = "mpi")]
fn no_reducer(reducer: Option<&crate::distributed::Reducer>) -> Result<(), StepError> {
    match reducer {
        None => Ok(()),
        Some(_) => Err(StepError::Cuda(CudaError::Driver(DriverError(
            CUresult::CUDA_ERROR_NOT_SUPPORTED,
        )))),
    }
}

// ---- full-precision regions (`mpx::region`) on Cuda ---------------------------------------------

macro_rules! region_on_cuda {
    ($($h:ty),*) => {$(
        impl RegionDevice<$h> for Cuda {
            fn enter<S: Shape, T: Tape<<$h as Precision>::Elem, Cuda>>(
                x: Tensor<S, <$h as Precision>::Elem, Cuda, T>,
                leaves: &mut Leaves<<$h as Precision>::Elem, Cuda>,
            ) -> Result<(Traced32<S, Cuda>, T), CudaError> {
                // contiguous, so that the gradient buffer and the logical values line up
                let (x, tape) = x.try_contiguous()?.split_tape();
                let n = x.shape().num_elements();
                let x32: Tensor<S, f32, Cuda> = x.clone().try_to_dtype()?;
                leaves.outer.push(x.try_reshape_like(&(n,))?);
                leaves.inner.push(x32.clone().try_reshape_like(&(n,))?);
                Ok((x32.leaky_traced(), tape))
            }

            fn widen_param<S: Shape>(
                t: &Tensor<S, <$h as Precision>::Elem, Cuda>,
                trainable: bool,
                leaves: &mut Leaves<<$h as Precision>::Elem, Cuda>,
            ) -> Result<Tensor<S, f32, Cuda>, CudaError> {
                let t32: Tensor<S, f32, Cuda> = t.clone().try_to_dtype()?;
                if trainable {
                    let n = t.shape().num_elements();
                    leaves.outer.push(t.clone().try_reshape_like(&(n,))?);
                    leaves.inner.push(t32.clone().try_reshape_like(&(n,))?);
                }
                Ok(t32)
            }

            fn bridge<S: Shape, T: Tape<<$h as Precision>::Elem, Cuda>>(
                leaves: Leaves<<$h as Precision>::Elem, Cuda>,
                mut tape: T,
                y32: Tensor<S, f32, Cuda, OwnedTape<f32, Cuda>>,
            ) -> Result<Tensor<S, <$h as Precision>::Elem, Cuda, T>, CudaError> {
                type E = <$h as Precision>::Elem;
                let (y32, inner_tape) = y32.try_contiguous()?.split_tape();
                let n = y32.shape().num_elements();
                let y: Tensor<S, E, Cuda> = y32.clone().try_to_dtype()?;
                if !T::OWNS_TAPE {
                    return Ok(y.put_tape(tape));
                }
                let y_flat = y.clone().try_reshape_like(&(n,))?;
                let y32_flat = y32.try_reshape_like(&(n,))?;
                tape.add_backward_op(move |grads: &mut Gradients<E, Cuda>| {
                    region_backward::<E>(grads, &leaves, &y_flat, y32_flat, inner_tape)
                });
                Ok(y.put_tape(tape))
            }

            fn region_error(e: CudaError) -> RegionError {
                RegionError::Cuda(Arc::new(e))
            }
        }
    )*};
}
region_on_cuda!(f32, f16, AMP<f16>);

/// A full-precision region's backward op on `Cuda`: the `Cpu`'s (`mpx::region`), with the
/// gradient sums in mpx's kernels.
fn region_backward<E: Dtype + DeviceRepr>(
    grads: &mut Gradients<E, Cuda>,
    leaves: &Leaves<E, Cuda>,
    y: &Flat<E, Cuda>,
    y32: Flat<f32, Cuda>,
    mut inner_tape: OwnedTape<f32, Cuda>,
) -> Result<(), CudaError>
where
    Cuda: dfdx::tensor_ops::Device<E>,
    <Cuda as Storage<E>>::Vec: std::ops::DerefMut<Target = CudaSlice<E>>,
    <Cuda as Storage<f32>>::Vec: std::ops::DerefMut<Target = CudaSlice<f32>>,
{
    // The output's gradient, widened.
    grads.try_alloc_for(y)?;
    let g32: Flat<f32, Cuda> = grads.get(y).try_to_dtype::<f32>()?;
    // What each leaf's gradient holds already (a device copy); a tensor passed twice shares one
    // gradient entry: only its first occurrence carries that value.
    let mut first_of = Vec::with_capacity(leaves.outer.len());
    let mut buffers: Vec<u64> = Vec::with_capacity(leaves.outer.len());
    let mut seeds: Vec<Option<CudaSlice<E>>> = Vec::with_capacity(leaves.outer.len());
    for (i, leaf) in leaves.outer.iter().enumerate() {
        let buf: &mut CudaSlice<E> = grads.get_or_alloc_mut(leaf)?;
        let ptr = *buf.device_ptr();
        if let Some(j) = buffers.iter().position(|p| *p == ptr && buf.len() != 0) {
            first_of.push(first_of[j]);
            seeds.push(None);
        } else {
            first_of.push(i);
            seeds.push(Some(buf.try_clone()?));
        }
        buffers.push(ptr);
    }
    // Run first of the region's own ops: accumulation inside continues from the outer values.
    let inner_leaves = leaves.inner.clone();
    inner_tape.add_backward_op(move |g: &mut Gradients<f32, Cuda>| {
        for (leaf, seed) in inner_leaves.iter().zip(seeds) {
            if let Some(seed) = seed {
                add_widened(&seed, g.get_or_alloc_mut(leaf)?, 1.0)?;
            }
        }
        Ok(())
    });
    let vjp = y32.put_tape(inner_tape).try_mul(g32)?.try_sum()?;
    let mut inner = vjp.try_backward()?;
    // Sum per gradient entry in f32, then round once into the outer buffer.
    let mut sums: Vec<Option<CudaSlice<f32>>> = (0..leaves.inner.len()).map(|_| None).collect();
    for (i, leaf) in leaves.inner.iter().enumerate() {
        let g: &mut CudaSlice<f32> = inner.get_or_alloc_mut(leaf)?;
        let j = first_of[i];
        match &mut sums[j] {
            Some(acc) => add_widened(g, acc, 1.0)?,
            None => sums[j] = Some(g.try_clone()?),
        }
    }
    for (leaf, sum) in leaves.outer.iter().zip(sums) {
        if let Some(sum) = sum {
            assign(&sum, grads.get_or_alloc_mut(leaf)?)?;
        }
    }
    Ok(())
}
