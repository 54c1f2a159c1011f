//! The UCI optdigits 8x8 handwritten digits that `smartcore` embeds (feature `datasets`): 1797
//! images, 64 pixels in 0..=16, 10 classes. No download. Shared by tests and examples through
//! `#[path = ".../tests/common/digits.rs"] mod digits;`.
#![allow(dead_code)]

use dfdx::prelude::{Const, Cpu, Rank2, Tensor, TensorFromVec};

/// Pixels per image.
pub const FEATURES: usize = 64;
/// Number of classes.
pub const CLASSES: usize = 10;

/// The ViT for these digits (`mpx::nn::vit::Vit` on 64 pixels, 10 classes): 2x2 patches (16
/// tokens), width 32, 4 heads, feed-forward width 64, 2 encoder blocks. Trained by
/// `examples/vit.rs`; build it with `dev.build_module::<DigitsVit, f32>()`.
pub type DigitsVit<E = f32, D = Cpu> =
    mpx::nn::vit::Vit<FEATURES, 4, 16, 32, 4, 64, 2, CLASSES, E, D>;

/// mpx's fused MLP for these digits, `FEATURES`-`HIDDEN`-`HIDDEN`-`CLASSES` with a ReLU fused
/// into each hidden layer: the mixed model of `examples/digits.rs`, `examples/digits_ddp.rs` and
/// `examples/bench_allreduce.rs`.
pub type FusedMlp<const HIDDEN: usize> = (
    mpx::nn::builders::LinearReLU<FEATURES, HIDDEN>,
    mpx::nn::builders::LinearReLU<HIDDEN, HIDDEN>,
    mpx::nn::builders::Linear<HIDDEN, CLASSES>,
);

/// A train/test split of the digits, pixels scaled to [0, 1].
pub struct Digits {
    /// Row-major `train_len x 64` pixels.
    pub train_x: Vec<f32>,
    /// Class of each training image.
    pub train_y: Vec<usize>,
    /// Row-major `test_len x 64` pixels.
    pub test_x: Vec<f32>,
    /// Class of each test image.
    pub test_y: Vec<usize>,
}

impl Digits {
    /// Loads the embedded data set and splits it: a seeded shuffle, then `test_fraction` of the
    /// images for testing.
    pub fn load(test_fraction: f32, seed: u64) -> Self {
        let ds = smartcore::dataset::digits::load_dataset();
        assert_eq!(ds.num_features, FEATURES);
        let n = ds.num_samples;
        let mut order: Vec<usize> = (0..n).collect();
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for i in (1..n).rev() {
            // xorshift64*: a deterministic shuffle without pulling in another rand version.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let r = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
            order.swap(i, (r % (i as u64 + 1)) as usize);
        }
        let n_test = ((n as f32) * test_fraction).round() as usize;
        let mut out = Digits {
            train_x: vec![],
            train_y: vec![],
            test_x: vec![],
            test_y: vec![],
        };
        for (k, &i) in order.iter().enumerate() {
            let pixels = ds.data[i * FEATURES..(i + 1) * FEATURES]
                .iter()
                .map(|p| p / 16.0);
            let label = ds.target[i] as usize;
            if k < n_test {
                out.test_x.extend(pixels);
                out.test_y.push(label);
            } else {
                out.train_x.extend(pixels);
                out.train_y.push(label);
            }
        }
        out
    }

    /// Number of training images.
    pub fn train_len(&self) -> usize {
        self.train_y.len()
    }

    /// The training indices in the order of `epoch`: a seeded shuffle (xorshift), the same on
    /// every machine, so several runs can see the same batches.
    pub fn epoch_order(&self, epoch: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.train_len()).collect();
        let mut s =
            0x2545_F491_4F6C_DD1Du64 ^ (epoch as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for i in (1..order.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            order.swap(i, (s % (i as u64 + 1)) as usize);
        }
        order
    }

    /// The training images `idx` (`B` of them) and their one-hot labels, as f32 tensors.
    pub fn train_batch<const B: usize>(
        &self,
        dev: &Cpu,
        idx: &[usize],
    ) -> (
        Tensor<Rank2<B, FEATURES>, f32, Cpu>,
        Tensor<Rank2<B, CLASSES>, f32, Cpu>,
    ) {
        assert_eq!(idx.len(), B, "a batch of {B} images");
        let mut x = Vec::with_capacity(B * FEATURES);
        let mut y = vec![0.0f32; B * CLASSES];
        for (r, &i) in idx.iter().enumerate() {
            x.extend_from_slice(&self.train_x[i * FEATURES..(i + 1) * FEATURES]);
            y[r * CLASSES + self.train_y[i]] = 1.0;
        }
        (
            dev.tensor_from_vec(x, (Const, Const)),
            dev.tensor_from_vec(y, (Const, Const)),
        )
    }

    /// Number of test images.
    pub fn test_len(&self) -> usize {
        self.test_y.len()
    }
}
