//! The small MLP of the scaler tests (4-16-3 with a ReLU) and its deterministic batches.

use dfdx::prelude::*;

/// The model's structure.
pub type Mlp = (Linear<4, 16>, ReLU, Linear<16, 3>);
/// The built model.
pub type Model = <Mlp as BuildOnDevice<Cpu, f32>>::Built;
/// A batch of 8 inputs.
pub type X = Tensor<Rank2<8, 4>, f32, Cpu>;
/// One-hot targets of a batch.
pub type Y = Tensor<Rank2<8, 3>, f32, Cpu>;

/// Batch `k`: inputs on a sine, one-hot targets cycling through the 3 classes.
pub fn batch(dev: &Cpu, k: usize) -> (X, Y) {
    let x: X = dev.tensor(std::array::from_fn(|i| {
        std::array::from_fn(|j| ((i * 4 + j + 3 * k) as f32 * 0.37).sin())
    }));
    let y: Y = dev.tensor(std::array::from_fn(|i| {
        std::array::from_fn(|j| if (i + k) % 3 == j { 1.0 } else { 0.0 })
    }));
    (x, y)
}
