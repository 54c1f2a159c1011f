// A step generic over dtype, device and model, written the way dfdx users write one: the batch
// gets a fresh recording tape with `retaped::<OwnedTape<_, _>>()` (no `alloc_grads`), and the
// step returns the input's gradient (a saliency map) beside the loss.
use dfdx::{optim::Optimizer, prelude::*};

#[mpx::mixed_step(scaling = scaler)]
pub fn saliency_step<E, D, M, O>(
    model: &mut M,
    opt: &mut O,
    batch: Tensor<Rank2<16, 6>, E, D>,
    target: Tensor<Rank2<16, 3>, E, D>,
    scaler: &mut super::Scaler,
) -> (E, Tensor<Rank2<16, 6>, E, D>)
where
    E: Dtype,
    D: Device<E> + TensorToArray<Rank0, E, Array = E>,
    M: Module<
            Tensor<Rank2<16, 6>, E, D, OwnedTape<E, D>>,
            Output = Tensor<Rank2<16, 3>, E, D, OwnedTape<E, D>>,
            Error = D::Err,
        > + TensorCollection<E, D>,
    O: Optimizer<M, D, E>,
{
    let x = batch.retaped::<OwnedTape<_, _>>();
    let y = model.forward(x);
    let loss = mse_loss(y, target);
    let value = loss.array();
    let grads = loss.backward();
    let saliency = grads.get(&batch);
    opt.update(model, &grads).unwrap();
    (value, saliency)
}
