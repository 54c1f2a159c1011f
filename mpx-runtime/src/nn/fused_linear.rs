//! [`fused_linear`]: `y = act(x·Wᵀ + b)` as one op on the tape, on mpx's kernels, forward and
//! backward: the op of the fused [`Linear`](super::Linear), also run by the layers made of it
//! (the attention's projections, the encoder's feed-forward) with another activation.

use dfdx::shapes::{Dtype, HasShape, Rank1, Rank2, Shape};
use dfdx::tensor::{Cpu, CpuError, PutTape, SplitTape, Tape, Tensor, TensorFromVec};
use dfdx::tensor_ops::Device;
use mpx_kernels::{
    Activation, KernelError, MatRef, ReluMask, add_f32_into, bias_act_into, gemm,
    relu_mask_bias_grad_f16, relu_mask_bias_grad_f32,
};

use super::contiguous::contiguous;
use super::half_ops::{grad_slice, read, relu_mask_of, round_in_place, shape_err};
use super::scratch;
use crate::master::link::Link;
use crate::precision::{FloatSliceMut, Precision};

/// A linear layer's weight, bias and link, as [`fused_linear`] reads them.
pub(crate) type LayerParts<'a, const I: usize, const O: usize, E> = (
    &'a Tensor<Rank2<O, I>, E, Cpu>,
    &'a Tensor<Rank1<O>, E, Cpu>,
    Option<&'a Link>,
);

/// Where a fused layer's weight and bias gradients go.
enum Sink<G> {
    /// In f32, straight into the master's (a mixed step's forward pass).
    Master(Link),
    /// Into the layer's own gradient entries (`G`: the weight's and the bias's ghosts), rounded
    /// to its element type.
    Own(G),
}

/// `ReLU` mask (where given) and bias-gradient column sums, in one pass.
fn mask_bias_grad<E: Precision<Elem = E> + Dtype>(
    dy: &mut [E],
    mask: Option<&ReluMask>,
    bias_grad: &mut [f32],
) -> Result<(), KernelError> {
    match E::floats_mut(dy) {
        FloatSliceMut::F32(v) => relu_mask_bias_grad_f32(v, mask, bias_grad),
        FloatSliceMut::F16(v) => relu_mask_bias_grad_f16(v, mask, bias_grad),
    }
}

/// Rows per GEMM call in the forward and in `dX`: bounds the f32 sums (`ROW_CHUNK x O` or
/// `ROW_CHUNK x I` values) whatever the batch.
const ROW_CHUNK: usize = 512;

/// `dst += dZᵀ·X` with `dZ` (`rows x O`) and `X` (`rows x I`), summed in f32 and rounded once
/// into `dst` (`O x I`, of precision `P`): the weight gradient of a layer no scaler links.
fn write_weight_grad<P: Precision<Elem = E>, E: Precision<Elem = E> + Dtype>(
    dz: &[E],
    x: &[E],
    rows: usize,
    dst: &mut [E],
) -> Result<(), KernelError> {
    with_weight_grad::<P, E, _>(dz, x, rows, |dw| {
        add_f32_into(dw, E::floats_mut(dst))?;
        round_in_place::<P>(dst);
        Ok(())
    })
}

/// Computes `dZᵀ·X` (f32 sums, `O x I`) into a pooled buffer and hands it to `use_dw`:
/// [`write_weight_grad`] rounds it into a gradient of the layer's dtype, a linked layer adds it
/// to the master's f32 gradient ([`crate::step::direct`]).
fn with_weight_grad<P: Precision<Elem = E>, E: Precision<Elem = E> + Dtype, R>(
    dz: &[E],
    x: &[E],
    rows: usize,
    use_dw: impl FnOnce(&mut [f32]) -> Result<R, KernelError>,
) -> Result<R, KernelError> {
    let o = dz.len().checked_div(rows).unwrap_or(0);
    let i = x.len().checked_div(rows).unwrap_or(0);
    for (what, len, expected) in [("dz", dz.len(), rows * o), ("x", x.len(), rows * i)] {
        if len != expected {
            return Err(KernelError::Length {
                what,
                len,
                expected,
            });
        }
    }
    let mut dw = scratch::take::<f32>(o * i);
    gemm(
        MatRef::row_major(P::floats(dz), rows, o)?.t(),
        MatRef::row_major(P::floats(x), rows, i)?,
        &mut dw,
        false,
    )?;
    use_dw(&mut dw)
}

/// `y = act(x·Wᵀ + b)` over the last axis of `x` (`I` values) with the weight and bias of
/// a layer (and its [`Link`], if any), shaped `out`, in precision `P`: the fused op of
/// `FusedLinear` (`act` its own
/// activation), also run by the layers made of mpx's `Linear`
/// ([`MultiHeadAttention`](super::MultiHeadAttention), the encoder's feed-forward).
///
/// - Forward: one GEMM (f32 sums) per `ROW_CHUNK` rows, then one pass adding the bias, applying
///   the activation and rounding to the element type; for emulated bf16 (f32 storage) the output
///   is then rounded to bf16. Every GEMM sees its operands as `P` holds them (`P::floats`):
///   emulated bf16's f32 values as bf16 operands (rounded while packing, multiplied with
///   `vdpbf16ps` where the CPU has AVX512-BF16), f16 as f16.
/// - Backward: `ReLU`'s mask and the bias-gradient sums in one pass over a copy of `dY`; inside a
///   mixed step's forward pass (a [`Link`]),
///   `dW` and `db` go in f32 to the master's gradients; otherwise they are added to the
///   gradient entries and rounded once to `P`. Then `dX += dZ·W`, rounded once to `P`.
///
/// The op keeps the input and the weight tensors themselves for the backward (shared, not
/// copied): dfdx lends no slice of a tensor's storage, so each pass copies the values it
/// multiplies into pooled buffers ([`scratch`]) and gives them back when its GEMM is done. The
/// pool then holds one layer's operands at a time, not a copy of every layer's input and weight
/// from the forward to the backward.
pub(crate) fn fused_linear<P, E, const I: usize, const O: usize, Sx, Sy, T>(
    (weight, bias, link): LayerParts<'_, I, O, E>,
    act: Activation,
    x: Tensor<Sx, E, Cpu, T>,
    out: Sy,
) -> Result<Tensor<Sy, E, Cpu, T>, CpuError>
where
    P: Precision<Elem = E>,
    E: Precision<Elem = E> + Dtype,
    Cpu: Device<E>,
    Sx: Shape,
    Sy: Shape,
    T: Tape<E, Cpu>,
{
    let (x, mut tape) = contiguous(x)?.split_tape();
    let rows = x.shape().num_elements() / I;
    let (xv, wv) = (read(&x), read(weight));
    let mut b32 = scratch::take::<f32>(O);
    E::widen(&read(bias), &mut b32);
    let mut y = vec![E::default(); rows * O];
    let w = MatRef::row_major(P::floats(&wv), O, I).map_err(shape_err)?;
    by_row_chunks::<P, E>(&xv, I, w.t(), &mut y, |acc, yc| {
        bias_act_into(acc, &b32, act, E::floats_mut(yc))
    })?;
    drop((b32, xv, wv));
    round_in_place::<P>(&mut y);
    let mask = (T::OWNS_TAPE && act == Activation::ReLU).then(|| relu_mask_of(&y));
    // Inside a mixed step's forward pass, the master tensors this weight and bias stand for:
    // their gradients are then written there directly, in f32.
    let link = if T::OWNS_TAPE { link.cloned() } else { None };
    let y = x.device().try_tensor_from_vec(y, out)?;
    if T::OWNS_TAPE {
        // The op keeps the input and the weight (the tensors, shared), the ReLU mask (1 bit per
        // output) and ghosts for the gradient entries.
        let (x_id, y_id) = (x.ghost(), y.ghost());
        // where the weight's and bias's gradients go: the master's through the link, else their
        // own gradient entries
        let sink = match link {
            Some(link) => Sink::Master(link),
            None => Sink::Own((weight.ghost(), bias.ghost())),
        };
        let w = weight.clone();
        tape.add_backward_op(move |grads| {
            let mut dz = scratch::copy_of(grad_slice::<E>(grads.get_or_alloc_mut(&y_id)?));
            let mut db = scratch::take_zeroed::<f32>(O);
            mask_bias_grad(&mut dz, mask.as_ref(), &mut db).map_err(shape_err)?;
            drop(mask);
            let xv = read(&x);
            drop(x);
            match &sink {
                Sink::Master(link) => {
                    link.add_bias_grad(&db)?;
                    with_weight_grad::<P, E, _>(&dz, &xv, rows, |dw| Ok(link.add_weight_grad(dw)))
                        .map_err(shape_err)??;
                }
                Sink::Own((w_id, b_id)) => {
                    let gb = grad_slice::<E>(grads.get_or_alloc_mut(b_id)?);
                    add_f32_into(&db, E::floats_mut(gb)).map_err(shape_err)?;
                    round_in_place::<P>(gb);
                    let gw = grad_slice::<E>(grads.get_or_alloc_mut(w_id)?);
                    write_weight_grad::<P, E>(&dz, &xv, rows, gw).map_err(shape_err)?;
                }
            }
            drop((db, xv));
            let gx = grad_slice::<E>(grads.get_or_alloc_mut(&x_id)?);
            if matches!(&sink, Sink::Master(link) if link.is_unread(gx)) {
                // a mixed step's batch whose gradient nothing reads
                return Ok(());
            }
            let wv = read(&w);
            drop(w);
            input_grad::<P, E, I, O>(&dz, &wv, gx)
        });
    }
    Ok(y.put_tape(tape))
}

/// `gx += dZ·W`, in row chunks of f32 sums, rounded once to `P`. `W` is the forward pass's: the
/// op holds that tensor, and dfdx copies a shared tensor's storage before writing to it.
fn input_grad<
    P: Precision<Elem = E>,
    E: Precision<Elem = E> + Dtype,
    const I: usize,
    const O: usize,
>(
    dz: &[E],
    wv: &[E],
    gx: &mut [E],
) -> Result<(), CpuError> {
    let w = MatRef::row_major(P::floats(wv), O, I).map_err(shape_err)?;
    by_row_chunks::<P, E>(dz, O, w, gx, |dx, gxc| {
        add_f32_into(dx, E::floats_mut(gxc))?;
        round_in_place::<P>(gxc);
        Ok(())
    })
}

/// `a·b` (`a` of `k` values a row, `b` of `k` rows) for `ROW_CHUNK` rows of `a` at a time, so the
/// f32 sums stay small at any batch: each chunk's product goes to `finish` with the rows of `out`
/// it stands for (`out` has as many values a row as `b` has columns).
fn by_row_chunks<P: Precision<Elem = E>, E: Precision<Elem = E> + Dtype>(
    a: &[E],
    k: usize,
    b: MatRef<'_>,
    out: &mut [E],
    mut finish: impl FnMut(&mut [f32], &mut [E]) -> Result<(), KernelError>,
) -> Result<(), CpuError> {
    let (rows, n) = (a.len() / k, b.cols());
    let mut sums = scratch::take::<f32>(rows.min(ROW_CHUNK) * n);
    for (ac, oc) in a.chunks(ROW_CHUNK * k).zip(out.chunks_mut(ROW_CHUNK * n)) {
        let r = ac.len() / k;
        let sums = &mut sums[..r * n];
        let a = MatRef::row_major(P::floats(ac), r, k).map_err(shape_err)?;
        gemm(a, b, sums, false).map_err(shape_err)?;
        finish(sums, oc).map_err(shape_err)?;
    }
    Ok(())
}
