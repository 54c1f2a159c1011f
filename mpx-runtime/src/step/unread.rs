//! Unread input gradients: a batch's gradient that nothing can read is not computed.
//!
//! A dfdx step traces its batch (`model.forward(x.traced(grads))`) because the tape has to
//! start somewhere, so dfdx's f32 step computes the batch's gradient, then drops it:
//! `backward` keeps only the gradients of the tensors `alloc_grads` named (the model's). JAX
//! differentiates only what it is asked to, and PyTorch only tensors that require a gradient.
//! The mixed step does the same where the batch's gradient **cannot be read**: when the traced
//! f32 input that enters a [`GradScaler`](super::GradScaler) forward pass
//! - carries a tape that has recorded nothing yet (no op before it needs its gradient), and
//! - would lose its gradient when `backward` returns: the tape's gradients keep only named
//!   tensors (`alloc_grads`, not `leaky_trace`), and the input is not one of them.
//!
//! Then the half input's gradient is marked unread for the half backward: mpx's fused linear
//! layers skip `dX = dZ·W` for it (the first layer's largest product after its weight
//! gradient), and no f32 gradient is written for the batch. Every other op computes what it
//! always did; nothing it writes there is read. A batch traced with `leaky_trace`, a batch
//! that is itself a trained tensor, or one computed by traced ops before the forward pass keeps
//! its gradient, computed as before.
//!
//! dfdx 0.13 keeps a tape's ops and its gradients' named set private, so the two conditions
//! are read through its public surface: the op count from the tape's `Debug` output (its head
//! only: formatting stops there), and whether the input's gradient survives by running the
//! op-less tape's backward on a one-value probe and seeing whether a mark written into the
//! input's gradient is still there. Anything that cannot be read this way counts as read.

use std::cell::{Cell, RefCell};
use std::fmt::{self, Write as _};
use std::rc::Rc;

use dfdx::shapes::{HasShape, Rank0, Shape};
use dfdx::tensor::{
    Cpu, CpuError, Gradients, OwnedTape, PutTape, SplitTape, Storage, Tape, Tensor, Trace,
    ZerosTensor,
};
use dfdx::tensor_ops::Backward;

use crate::cast::grad_slice;

/// The bits written into the input's gradient while probing: any value but that of a freshly
/// allocated gradient (zero) tells the two apart; a NaN with its own payload, for reading.
const MARK: u32 = 0x7fc0_5a17;

thread_local! {
    /// The addresses of the half gradients marked unread in the half backward running on this
    /// thread.
    static UNREAD: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    /// The one-value tensor whose backward runs the probe (one per thread, so that a leaky
    /// tape gains one entry at most).
    static PROBE: Tensor<Rank0, f32, Cpu> = Cpu::default().zeros();
}

/// Whether the gradient of `x32`, traced on `tape`, can be read once the backward has run (see
/// the [module docs](self)). Returns the tape, holding the same gradients and leaves.
///
/// # Errors
/// A device error (allocation).
pub(crate) fn read_after_backward<S: Shape>(
    x32: &Tensor<S, f32, Cpu>,
    tape: OwnedTape<f32, Cpu>,
) -> Result<(OwnedTape<f32, Cpu>, bool), CpuError> {
    if recorded_ops(&tape) != Some(0) || x32.shape().num_elements() == 0 {
        return Ok((tape, true));
    }
    let mut tape = tape;
    let kept = Rc::new(Cell::new(0.0f32));
    let (x, saved) = (x32.ghost(), Rc::clone(&kept));
    tape.add_backward_op(move |g: &mut Gradients<f32, Cpu>| {
        let first = &mut grad_slice::<f32>(g.get_or_alloc_mut(&x)?)[0];
        saved.set(*first);
        *first = f32::from_bits(MARK);
        Ok(())
    });
    let probe = PROBE.with(Tensor::clone);
    // No op but the mark and the probe's seed: `backward` then only drops what the tape's
    // gradients do not keep.
    let mut g = probe.clone().put_tape(tape).try_backward()?;
    let first = &mut grad_slice::<f32>(g.get_or_alloc_mut(x32)?)[0];
    let read = first.to_bits() == MARK;
    if read {
        *first = kept.get();
    } else {
        // the zeros just allocated to look
        g.drop_non_leafs();
    }
    Ok((probe.traced(g).split_tape().1, read))
}

/// How many backward ops `tape` holds, from its `Debug` output's head (`OwnedTape {
/// num_operations: N, ...`); `None` when it does not read that way.
fn recorded_ops<E: fmt::Debug, D: Storage<E>>(tape: &OwnedTape<E, D>) -> Option<usize> {
    /// Keeps the first bytes written and fails the formatter once the count is in, so the
    /// gradient buffers after it are never formatted.
    struct Head {
        text: [u8; 64],
        len: usize,
    }
    impl Head {
        fn count(&self) -> Option<usize> {
            std::str::from_utf8(&self.text[..self.len])
                .ok()?
                .strip_prefix("OwnedTape { num_operations: ")?
                .parse()
                .ok()
        }
    }
    impl fmt::Write for Head {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            let end = self.len + s.len();
            if end > self.text.len() || self.count().is_some() {
                return Err(fmt::Error);
            }
            self.text[self.len..end].copy_from_slice(s.as_bytes());
            self.len = end;
            Ok(())
        }
    }
    let mut head = Head {
        text: [0; 64],
        len: 0,
    };
    // Fails by design once the count is read.
    let _ = write!(head, "{tape:?}");
    head.count()
}

/// An op for the half backward that marks `x`'s half gradient unread (added last, so it runs
/// before every op that uses `x`).
pub(crate) fn mark<S: Shape, E: dfdx::shapes::Dtype>(
    x: &Tensor<S, E, Cpu>,
) -> impl FnOnce(&mut Gradients<E, Cpu>) -> Result<(), CpuError> + 'static {
    let x = x.ghost();
    move |g| {
        let at = grad_slice::<E>(g.get_or_alloc_mut(&x)?).as_ptr() as usize;
        UNREAD.with(|u| u.borrow_mut().push(at));
        Ok(())
    }
}

/// Whether `grad` is a half gradient marked unread in the half backward running on this
/// thread: nothing reads what would be added to it.
pub(crate) fn is_unread<E>(grad: &[E]) -> bool {
    !grad.is_empty() && UNREAD.with(|u| u.borrow().contains(&(grad.as_ptr() as usize)))
}

/// The marks of one half backward: those made while it lives are cleared when it drops.
pub(crate) struct Marks(usize);

impl Marks {
    /// Starts a half backward's marks.
    pub(crate) fn begin() -> Self {
        Self(UNREAD.with(|u| u.borrow().len()))
    }
}

impl Drop for Marks {
    fn drop(&mut self) {
        UNREAD.with(|u| u.borrow_mut().truncate(self.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dfdx::prelude::*;

    type Mlp = (Linear<3, 4>, ReLU, Linear<4, 2>);

    fn batch(dev: &Cpu) -> Tensor<Rank2<5, 3>, f32, Cpu> {
        dev.sample_normal()
    }

    fn probe(
        x: Tensor<Rank2<5, 3>, f32, Cpu, OwnedTape<f32, Cpu>>,
    ) -> (bool, Tensor<Rank2<5, 3>, f32, Cpu, OwnedTape<f32, Cpu>>) {
        let (x, tape) = x.split_tape();
        let (tape, read) = read_after_backward(&x, tape).unwrap();
        (read, x.put_tape(tape))
    }

    #[test]
    fn a_batch_traced_with_the_models_gradients_is_unread_and_the_gradients_are_unchanged() {
        let dev = Cpu::default();
        let m = dev.build_module::<Mlp, f32>();
        let x = batch(&dev);
        // gradients with values in them, as after an accumulation step
        let g = m.forward(x.trace(m.alloc_grads())).sum().backward();
        let before = g.get(&m.0.weight).as_vec();
        let (read, x_t) = probe(x.traced(g));
        assert!(!read);
        let g = x_t.sum().backward();
        // the model's accumulated gradients went through the probe untouched (the sum adds
        // nothing to them)
        assert_eq!(g.get(&m.0.weight).as_vec(), before);
    }

    #[test]
    fn leaky_tapes_recorded_ops_and_trained_tensors_are_read() {
        let dev = Cpu::default();
        let m = dev.build_module::<Mlp, f32>();
        let x = batch(&dev);
        // leaky: every gradient stays
        assert!(probe(x.leaky_trace()).0);
        // ops before the forward pass need the input's gradient
        assert!(probe(x.trace(m.alloc_grads()) * 2.0).0);
        // and the tape goes on as it was: d(sum(2x))/dx = 2
        let (read, y) = probe(x.leaky_trace() * 2.0);
        assert!(read);
        let g = y.sum().backward();
        assert!(g.get(&x).as_vec().iter().all(|v| *v == 2.0));
    }

    #[test]
    fn a_trained_tensor_entering_as_input_is_read_and_keeps_its_gradient() {
        let dev = Cpu::default();
        let m = dev.build_module::<Linear<3, 4>, f32>();
        let mut g = m.alloc_grads();
        // an accumulated value in the weight's gradient
        let w = m.weight.clone();
        g = (w.clone().traced(g) * 3.0).sum().backward();
        let (w_t, tape) = w.clone().traced(g).split_tape();
        let (tape, read) = read_after_backward(&w_t, tape).unwrap();
        assert!(read);
        let g = w_t.put_tape(tape).sum().backward();
        // 3 from before, 1 from this sum: the probe's mark was put back
        assert!(g.get(&w).as_vec().iter().all(|v| *v == 4.0));
    }

    #[test]
    fn the_op_count_is_read_from_the_tapes_head() {
        let dev = Cpu::default();
        let x = batch(&dev);
        let t: Tensor<_, f32, _, OwnedTape<f32, Cpu>> = x.leaky_trace();
        assert_eq!(recorded_ops(&t.split_tape().1), Some(0));
        let (_, t) = (x.leaky_trace() * 2.0 + 1.0).split_tape();
        assert_eq!(recorded_ops(&t), Some(2));
    }

    #[test]
    fn marks_last_for_one_half_backward() {
        let dev = Cpu::default();
        let x: Tensor<Rank1<4>, f32, Cpu> = dev.zeros();
        let mut g = Gradients::leaky();
        {
            let _marks = Marks::begin();
            mark(&x)(&mut g).unwrap();
            assert!(is_unread(grad_slice::<f32>(
                g.get_or_alloc_mut(&x).unwrap()
            )));
        }
        assert!(!is_unread(grad_slice::<f32>(
            g.get_or_alloc_mut(&x).unwrap()
        )));
    }
}
