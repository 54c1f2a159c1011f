// dfdx 0.13.0 `examples/06-mnist.rs`: the epoch loop of `main`, moved into a function whose
// signature is the only new code (`mut model: &mut Mlp`, so the author's `&mut model` stands
// as written). Synthetic data in place of the download: `.shuffled(&mut rng)` dropped
// (the data set is built in a fixed random order), `println!` of the epoch kept out of the test
// output by returning the epoch losses instead.
use dfdx::{data::*, optim::Adam, prelude::*};
use indicatif::ProgressIterator;

use super::common::mnist::{BATCH_SIZE, Mlp, MnistTrainSet, preprocess};

pub fn train(
    mut model: &mut Mlp,
    opt: &mut Adam<Mlp, f32, Cpu>,
    dataset: &MnistTrainSet,
    epochs: usize,
) -> Vec<f32> {
    let dev: Cpu = Default::default();
    let mut grads = model.alloc_grads();
    let mut losses = Vec::new();
    for _i_epoch in 0..epochs {
        let mut total_epoch_loss = 0.0;
        let mut num_batches = 0;
        for (img, lbl) in dataset
            .iter()
            .map(|item| preprocess(&dev, item))
            .batch_exact(Const::<BATCH_SIZE>)
            .collate()
            .stack()
            .progress()
        {
            let logits = model.forward_mut(img.traced(grads));
            let loss = cross_entropy_with_logits_loss(logits, lbl);

            total_epoch_loss += loss.array();
            num_batches += 1;

            grads = loss.backward();
            opt.update(&mut model, &grads).unwrap();
            model.zero_grads(&mut grads);
        }
        losses.push(BATCH_SIZE as f32 * total_epoch_loss / num_batches as f32);
    }
    losses
}
