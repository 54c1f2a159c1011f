//! A master run in f32 on itself: what `#[mixed_step]` falls back to where the half working
//! copy's forward pass cannot be type-checked (a model whose type is a generic parameter of the
//! `impl`, whose bounds the attribute on the method cannot see). The compiler says so at the
//! step (a warning, with the fix); the step keeps the scaler's bookkeeping (one update per
//! backward pass, the skip on non-finite gradients, the iteration's scale adjustment) and
//! reports that it ran in f32 ([`StepReport::precision`](super::StepReport::precision)).
//!
//! The forward pass runs on the master, so its gradients land in the master's f32 gradients as
//! dfdx's do; one op on the input's tape leaves the master's gradient slots for the scaler's
//! backward, which judges them as any master's.

use dfdx::shapes::Shape;
use dfdx::tensor::{Gradients, HasErr, NoneTape, OwnedTape, PutTape, SplitTape, Tape, Tensor};
use dfdx::tensor_ops::Device;

use super::half_region::Batch;

/// The op that hands a master's gradients to the scaler's backward.
pub(crate) type PostOp<D> =
    Box<dyn FnOnce(&mut Gradients<f32, D>) -> Result<(), <D as HasErr>::Err>>;

/// An input of a forward pass run in f32 on the master: a traced tensor carries the op that
/// hands the master's gradients to the scaler's backward; the value is what the f32 step passes.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot enter a half-precision forward pass",
    label = "expected an f32 (or integer) tensor, traced or not, or a tuple, array or `Vec` of them",
    note = "pass the f32 batch as in an f32 step (`x.traced(grads)`): the mixed step rounds it to the half type itself; a half tensor can be widened with `mpx::cast::cast_to_f32(&t)`"
)]
pub trait FullInput<D: Device<f32>> {
    /// The input as the model takes it.
    type Plain;
    /// Adds `post` (when still there) to the input's tape.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn attach(self, post: &mut Option<PostOp<D>>) -> Self::Plain;
}

/// The element types a batch of a mixed step may hold: f32, and the integer and boolean types of
/// indices and masks (a half batch is refused: the step rounds the f32 batch itself).
#[diagnostic::on_unimplemented(
    message = "a batch of `{Self}` cannot enter a half-precision forward pass",
    label = "the batch of a mixed step holds f32 (or integer indices, or bool masks)",
    note = "pass the f32 batch as in an f32 step (`x.traced(grads)`): the mixed step rounds it to the half type itself; a half tensor can be widened with `mpx::cast::cast_to_f32(&t)`"
)]
pub trait BatchElem: dfdx::shapes::Unit + sealed::Sealed {}

mod sealed {
    pub trait Sealed {}
}

macro_rules! batch_elems {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl BatchElem for $t {}
    )*};
}
batch_elems!(f32, usize, u32, u64, i32, i64, bool);

impl<S: Shape, E: BatchElem, D: Device<f32> + dfdx::tensor::Storage<E>> FullInput<D>
    for Tensor<S, E, D, OwnedTape<f32, D>>
{
    type Plain = Self;
    fn attach(self, post: &mut Option<PostOp<D>>) -> Self {
        let (x, mut tape) = self.split_tape();
        if let Some(op) = post.take() {
            tape.add_backward_op(op);
        }
        x.put_tape(tape)
    }
}

impl<S: Shape, E: BatchElem, D: Device<f32> + dfdx::tensor::Storage<E>> FullInput<D>
    for Tensor<S, E, D, NoneTape>
{
    type Plain = Self;
    fn attach(self, _: &mut Option<PostOp<D>>) -> Self {
        self
    }
}

impl<D: Device<f32>, T: FullInput<D>> FullInput<D> for Batch<T> {
    type Plain = T::Plain;
    fn attach(self, post: &mut Option<PostOp<D>>) -> T::Plain {
        self.0.attach(post)
    }
}

macro_rules! tuples {
    ($($name:ident),+) => {
        impl<D: Device<f32>, $($name: FullInput<D>),+> FullInput<D> for ($($name,)+) {
            type Plain = ($($name::Plain,)+);
            #[allow(non_snake_case)]
            fn attach(self, post: &mut Option<PostOp<D>>) -> Self::Plain {
                let ($($name,)+) = self;
                ($($name.attach(post),)+)
            }
        }
    };
}
tuples!(A);
tuples!(A, B);
tuples!(A, B, C);
tuples!(A, B, C, D4);

impl<D: Device<f32>, T: FullInput<D>> FullInput<D> for Vec<T> {
    type Plain = Vec<T::Plain>;
    fn attach(self, post: &mut Option<PostOp<D>>) -> Self::Plain {
        self.into_iter().map(|x| x.attach(post)).collect()
    }
}

impl<D: Device<f32>, T: FullInput<D>, const N: usize> FullInput<D> for [T; N] {
    type Plain = [T::Plain; N];
    fn attach(self, post: &mut Option<PostOp<D>>) -> Self::Plain {
        self.map(|x| x.attach(post))
    }
}
