//! The primitives on dfdx's `Cuda` device: dfdx's `to_dtype` for the casts, and small
//! kernels of mpx's own for the gradients (dfdx 0.13 keeps its tensors' buffers and its
//! gradient kernels crate-private, but hands out a gradient's device buffer through
//! `Gradients::get_or_alloc_mut`). The kernels are compiled with NVRTC at first use, as dfdx
//! compiles its own, and need no CUDA header: the f16 conversions are the PTX `cvt`
//! instructions themselves.
//!
//! What crosses the bus per step: the kernels' scalar arguments (a length, a scale), and one
//! 4-byte word back, the finiteness flag of the master's gradients. No tensor data.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::CUresult;
use cudarc::driver::{
    CudaDevice, CudaFunction, CudaSlice, DevicePtr, DeviceRepr, DeviceSlice, DriverError,
    LaunchAsync, LaunchConfig,
};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use dfdx::nn::tensor_collection::TensorCollection;
use dfdx::optim::OptimizerUpdateError;
use dfdx::shapes::HasShape;
use dfdx::shapes::Shape;
use dfdx::tensor::{
    Cuda, CudaError, Gradients, NoneTape, OwnedTape, PutTape, SplitTape, Storage, Tape, Tensor,
    Trace,
};
use dfdx::tensor_ops::{Backward, ReshapeTo, SumTo, TryMul};

use super::private::Primitives;
use super::{FullOp, HalfOp, SeedOp, Unread};
use super::{FullWorking, share};
use crate::boundary::MasterModel;
use crate::cast::CastScratch;
use crate::precision::{AMP, Precision, f16};
use crate::region::{Flat, Leaves, RegionDevice, RegionError, Traced32};
use crate::step::direct::{Direct, ScopeGuard};
use crate::step::error::StepError;
use crate::step::layout::{MasterSlot, WorkingCopy, len_mismatch};
use crate::step::local::Local;
use crate::step::workspace::ErasedWorking;

/// The module name the kernels are loaded under.
const MODULE: &str = "mpx_step";

/// The kernels' names, in the order of [`KERNELS`]' source.
const NAMES: [&str; 9] = [
    "mpx_unscale_add_f16",
    "mpx_unscale_add_f32",
    "mpx_add_widened_f16",
    "mpx_add_widened_f32",
    "mpx_seed_f16",
    "mpx_seed_f32",
    "mpx_flag_nonfinite",
    "mpx_assign_f16",
    "mpx_assign_f32",
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

// master += half * inv; half = 0; flag non-finite sums
extern "C" __global__ void mpx_unscale_add_f16(const size_t n, mpx_half *src, const float inv, float *dst, unsigned int *flag) {
    MPX_LOOP {
        float d = dst[i] + mpx_h2f(src[i]) * inv;
        dst[i] = d;
        src[i] = 0;
        if (mpx_nonfinite(d)) { *flag = 1u; }
    }
}

extern "C" __global__ void mpx_unscale_add_f32(const size_t n, float *src, const float inv, float *dst, unsigned int *flag) {
    MPX_LOOP {
        float d = dst[i] + src[i] * inv;
        dst[i] = d;
        src[i] = 0.0f;
        if (mpx_nonfinite(d)) { *flag = 1u; }
    }
}

// an input's f32 gradient += its half gradient * inv
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

/// A loaded kernel (an error, not a panic, when [`load`] did not run on this device).
fn kernel(dev: &Arc<CudaDevice>, name: &str) -> Result<CudaFunction, CudaError> {
    dev.get_func(MODULE, name)
        .ok_or(CudaError::Driver(DriverError(
            CUresult::CUDA_ERROR_NOT_FOUND,
        )))
}

/// The kernel of a family (`[f16 name, f32 name]`) for elements of type `E`, on `dev`, with the
/// element count `n` of its two slices (`lens`) and its launch configuration: a length mismatch is
/// an error. What every launch below does before its `unsafe` call.
fn launcher<E>(
    dev: &Arc<CudaDevice>,
    (n, other): (usize, usize),
    [f16_name, f32_name]: [&'static str; 2],
) -> Result<(CudaFunction, LaunchConfig, usize), CudaError> {
    if other != n {
        return Err(mismatch());
    }
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

fn mismatch() -> CudaError {
    CudaError::Cpu(dfdx::tensor::CpuError::WrongNumElements)
}

/// The device flag the kernels set on a non-finite gradient (allocated at the first use of a
/// pass, read once by the verdict).
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

/// `dst += src * inv`, `src = 0`, flagging non-finite sums in `flag`.
fn unscale_add<E: DeviceRepr>(
    src: &mut CudaSlice<E>,
    dst: &mut CudaSlice<f32>,
    inv: f32,
    flag: &mut Flag,
) -> Result<(), CudaError> {
    let dev = dst.device();
    let (f, cfg, n) = launcher::<E>(
        &dev,
        (dst.len(), src.len()),
        ["mpx_unscale_add_f16", "mpx_unscale_add_f32"],
    )?;
    let flag = flag.get(&dev)?;
    // SAFETY: the kernel reads and writes `n` elements of `src` and of `dst` (both `n` long,
    // checked above) and writes the one element of `flag`; the argument types are its
    // parameters' (`size_t`, 16- or 32-bit elements as picked by size, `float`, `float*`,
    // `unsigned int*`).
    unsafe { f.launch(cfg, (n, src, inv, dst, flag)) }?;
    Ok(())
}

/// `dst += src * inv` (an input's gradient leaving the region).
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
    // long, checked above); the argument types are its parameters'.
    unsafe { f.launch(cfg, (n, src, inv, dst)) }?;
    Ok(())
}

/// `dst += round(g * scale)` (an output's gradient entering the region).
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

/// Loads the kernels on the device of `slice` (a region's first use of them).
fn load_for<E>(slice: &CudaSlice<E>) -> Result<(), CudaError> {
    load(&slice.device()).map_err(|e| match e {
        StepError::Cuda(e) => e,
        _ => CudaError::Driver(DriverError(CUresult::CUDA_ERROR_INVALID_SOURCE)),
    })
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

/// The gradients' device, as cudarc's handle (the kernels are loaded on it).
fn handle(dev: &Cuda) -> Result<Arc<CudaDevice>, StepError> {
    let probe = Storage::<f32>::try_alloc_len(dev, 1).map_err(StepError::Cuda)?;
    Ok(probe.device())
}

macro_rules! on_cuda {
    ($($h:ty),*) => {$(
        impl Primitives<$h> for Cuda {
            const IN_PLACE: bool = false;
            type Finite = Flag;

            fn step_error(e: CudaError) -> StepError {
                StepError::Cuda(e)
            }

            fn fallback_device() -> Option<Cuda> {
                None
            }

            fn optimizer_error(e: OptimizerUpdateError<CudaError>) -> StepError {
                StepError::CudaOptimizer(e)
            }

            fn ready(dev: &Cuda) -> Result<(), StepError> {
                load(&handle(dev)?)
            }

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

            fn unread_input<S: Shape>(
                _: &Tensor<S, <$h as Precision>::Elem, Cuda>,
                _: &Tensor<S, f32, Cuda>,
                tape: OwnedTape<f32, Cuda>,
            ) -> Result<Unread<<$h as Precision>::Elem, Cuda>, CudaError> {
                // mpx's fused layers are the `Cpu`'s: the input's gradient is always computed
                Ok((tape, None))
            }

            fn input_bridge<S: Shape>(
                x: &Tensor<S, <$h as Precision>::Elem, Cuda>,
                x32: &Tensor<S, f32, Cuda>,
                inv: f32,
            ) -> (HalfOp<<$h as Precision>::Elem, Cuda>, FullOp<Cuda>) {
                type E = <$h as Precision>::Elem;
                let (x, x32) = (x.ghost(), x32.ghost());
                // The half backward drops the input's gradient (not a leaf) before it returns:
                // a copy is kept, on the device.
                let captured: Arc<Mutex<Option<CudaSlice<E>>>> = Arc::default();
                let capture = Arc::clone(&captured);
                let inner: HalfOp<E, Cuda> = Box::new(move |g: &mut Gradients<E, Cuda>| {
                    let copy = (**g.get_or_alloc_mut(&x)?).try_clone()?;
                    *capture.lock().unwrap_or_else(PoisonError::into_inner) = Some(copy);
                    Ok(())
                });
                let writer: FullOp<Cuda> = Box::new(move |g: &mut Gradients<f32, Cuda>| {
                    let taken = captured.lock().unwrap_or_else(PoisonError::into_inner).take();
                    if let Some(src) = taken {
                        add_widened(&src, &mut **g.get_or_alloc_mut(&x32)?, inv)?;
                    }
                    Ok(())
                });
                (inner, writer)
            }

            fn output_seed<S: Shape>(
                y: &Tensor<S, <$h as Precision>::Elem, Cuda>,
                y32: &Tensor<S, f32, Cuda>,
                scale: f32,
            ) -> SeedOp<<$h as Precision>::Elem, Cuda> {
                type E = <$h as Precision>::Elem;
                let (y, y32) = (y.ghost(), y32.ghost());
                Box::new(move |g32: &mut Gradients<f32, Cuda>| {
                    let g = (**g32.get_or_alloc_mut(&y32)?).try_clone()?;
                    let apply: HalfOp<E, Cuda> = Box::new(move |h: &mut Gradients<E, Cuda>| {
                        seed(&g, &mut **h.get_or_alloc_mut(&y)?, scale)
                    });
                    Ok(apply)
                })
            }

            fn accumulate<S: Shape>(
                half: &mut Gradients<<$h as Precision>::Elem, Cuda>,
                t: &Tensor<S, <$h as Precision>::Elem, Cuda>,
                slot: &MasterSlot<Cuda>,
                index: usize,
                grads: &mut Gradients<f32, Cuda>,
                inv: f32,
                _direct: bool,
                finite: &mut Flag,
            ) -> Result<(), StepError> {
                let src = half.get_or_alloc_mut(t).map_err(StepError::Cuda)?;
                let dst = slot.buffer(grads).map_err(StepError::Cuda)?;
                if src.len() != dst.len() {
                    return Err(len_mismatch(index, dst.len(), src.len()));
                }
                unscale_add(&mut **src, &mut **dst, inv, finite).map_err(StepError::Cuda)
            }

            fn check(
                slot: &MasterSlot<Cuda>,
                grads: &mut Gradients<f32, Cuda>,
                finite: &mut Flag,
            ) -> Result<(), StepError> {
                let g = slot.buffer(grads).map_err(StepError::Cuda)?;
                flag_nonfinite(&**g, finite).map_err(StepError::Cuda)
            }

            fn verdict(finite: Flag) -> Result<bool, StepError> {
                let Some(flag) = finite.0 else {
                    return Ok(true);
                };
                // the one value that crosses the bus
                let word = flag.device().dtoh_sync_copy(&flag).map_err(|e| StepError::Cuda(e.into()))?;
                Ok(word.first() == Some(&0))
            }

            fn refresh_same<M>(
                master: &M,
                _half: Option<WorkingCopy<$h, M, Cuda>>,
                _scratch: &mut CastScratch,
            ) -> Result<WorkingCopy<$h, M, Cuda>, StepError>
            where
                M: MasterModel<Cuda>,
                WorkingCopy<$h, M, Cuda>: TensorCollection<<$h as Precision>::Elem, Cuda>,
            {
                // dfdx's `to_dtype` per tensor: a new working copy (an f32 one shares the
                // master's tensors)
                share::<$h, Cuda, M>(master)
            }

            fn hold_full(w: FullWorking<$h, Cuda>) -> Box<dyn ErasedWorking> {
                Box::new(Local::new(w))
            }

            fn links(_: &Arc<[MasterSlot<Cuda>]>) -> Option<Arc<Direct>> {
                None
            }

            fn enter_scope<C: TensorCollection<<$h as Precision>::Elem, Cuda>>(
                _: &C,
                _: Option<&Arc<Direct>>,
            ) -> Result<Option<ScopeGuard>, StepError> {
                Ok(None)
            }

            fn lend(_: &Direct, _: &mut Gradients<f32, Cuda>) {}

            fn restore(_: &Direct, _: &mut Gradients<f32, Cuda>) {}
        }
    )*};
}
on_cuda!(f32, f16, AMP<f16>);

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
fn region_backward<E: dfdx::shapes::Dtype + DeviceRepr>(
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
        if seeds.is_empty() {
            load_for(buf)?;
        }
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
