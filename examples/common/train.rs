//! The training loop pieces both digits examples share (`digits.rs`, the MLP, and `vit.rs`, the
//! ViT): the epoch's batches, accuracy counting, progress bars and what one run reports.
#![allow(dead_code)]

use std::time::Duration;

use dfdx::prelude::{Cpu, Rank2, Tensor};
use indicatif::{ProgressBar, ProgressStyle};

use crate::digits::{CLASSES, Digits, FEATURES};

/// One training batch: `B` images as f32 pixels, their one-hot labels, and their classes.
pub type Batch<const B: usize> = (
    Tensor<Rank2<B, FEATURES>, f32, Cpu>,
    Tensor<Rank2<B, CLASSES>, f32, Cpu>,
    [usize; B],
);

/// The batches of one epoch (the same for every run of a program), the last partial batch
/// dropped.
pub fn epoch_batches<const B: usize>(dev: &Cpu, d: &Digits, epoch: usize) -> Vec<Batch<B>> {
    d.epoch_order(epoch)
        .chunks_exact(B)
        .map(|idx| {
            let (x, y) = d.train_batch(dev, idx);
            (x, y, std::array::from_fn(|r| d.train_y[idx[r]]))
        })
        .collect()
}

/// Index of the largest value (the first one on ties).
pub fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv { (i, v) } else { (bi, bv) }
        })
        .0
}

/// How many rows of `logits` pick the right label.
pub fn correct(logits: &[[f32; CLASSES]], labels: &[usize]) -> usize {
    logits
        .iter()
        .zip(labels)
        .filter(|(row, l)| argmax(&row[..]) == **l)
        .count()
}

/// Test accuracy in percent. `logits_of` maps `batch` test images (row-major f32 pixels, the last
/// batch padded with zero images) to one row of logits per image; only real images are counted.
pub fn test_accuracy(
    d: &Digits,
    batch: usize,
    mut logits_of: impl FnMut(Vec<f32>) -> Vec<[f32; CLASSES]>,
) -> f64 {
    let mut hits = 0;
    let n = d.test_len();
    for start in (0..n).step_by(batch) {
        let mut x = vec![0.0f32; batch * FEATURES];
        let real = batch.min(n - start);
        x[..real * FEATURES]
            .copy_from_slice(&d.test_x[start * FEATURES..(start + real) * FEATURES]);
        let logits = logits_of(x);
        hits += correct(&logits[..real], &d.test_y[start..start + real]);
    }
    100.0 * hits as f64 / n as f64
}

/// What one training run reports.
pub struct RunResult {
    /// Test accuracy, percent.
    pub test_acc: f64,
    /// Mean wall-clock time of one training step (forward, backward, update).
    pub step_time: Duration,
    /// Peak heap during training, above the heap in use when training started.
    pub peak_bytes: usize,
    /// Steps skipped for non-finite gradients.
    pub skipped: u64,
    /// Mean training loss of each epoch (over the steps whose loss was finite).
    pub epoch_loss: Vec<f32>,
}

/// Prints a line above the progress bar (or plainly when the bar is hidden, e.g. output piped).
pub fn say(pb: &ProgressBar, line: String) {
    if pb.is_hidden() {
        println!("{line}");
    } else {
        pb.println(line);
    }
}

/// A progress bar over `steps` training steps, named `name`.
pub fn bar(name: &str, steps: usize) -> ProgressBar {
    let pb = ProgressBar::new(steps as u64);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>11} [{bar:40}] {pos}/{len} steps  {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_prefix(name.to_string());
    pb
}
