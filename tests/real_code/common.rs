//! What the real training loops need around them: their model types as their examples declare
//! them, and synthetic data in place of downloads.
#![allow(dead_code)]

/// A deterministic stream of uniform and normal samples (no other `rand` version needed).
pub struct Lcg(u64);

impl Lcg {
    pub fn new(seed: u64) -> Self {
        Lcg(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 40) as f32) / ((1u64 << 24) as f32)
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u = self.uniform().max(1e-7);
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
    pub fn normals<const N: usize>(&mut self) -> [f32; N] {
        std::array::from_fn(|_| self.normal())
    }
}

pub mod mnist {
    use dfdx::data::ExactSizeDataset;
    use dfdx::prelude::*;

    pub type MlpStructure = (
        (Linear<784, 512>, ReLU),
        (Linear<512, 128>, ReLU),
        (Linear<128, 32>, ReLU),
        Linear<32, 10>,
    );
    pub type Mlp = <MlpStructure as BuildOnDevice<Cpu, f32>>::Built;
    pub const BATCH_SIZE: usize = 32;

    /// MNIST-shaped images (28x28 in [0, 1]) made from the real 8x8 UCI digits that `smartcore`
    /// embeds: each pixel becomes a 3x3 block, centred with a 2-pixel border.
    pub struct MnistTrainSet {
        images: Vec<Vec<f32>>,
        labels: Vec<usize>,
    }

    impl MnistTrainSet {
        pub fn new(n: usize) -> Self {
            let ds = smartcore::dataset::digits::load_dataset();
            let mut images = Vec::new();
            let mut labels = Vec::new();
            for i in 0..n.min(ds.num_samples) {
                let mut img = vec![0.0f32; 784];
                for r in 0..8 {
                    for c in 0..8 {
                        let v = ds.data[i * 64 + r * 8 + c] / 16.0;
                        for dr in 0..3 {
                            for dc in 0..3 {
                                img[(2 + 3 * r + dr) * 28 + 2 + 3 * c + dc] = v;
                            }
                        }
                    }
                }
                images.push(img);
                labels.push(ds.target[i] as usize);
            }
            Self { images, labels }
        }
    }

    impl ExactSizeDataset for MnistTrainSet {
        type Item<'a>
            = (Vec<f32>, usize)
        where
            Self: 'a;
        fn get(&self, index: usize) -> Self::Item<'_> {
            (self.images[index].clone(), self.labels[index])
        }
        fn len(&self) -> usize {
            self.labels.len()
        }
    }

    /// The example's `preprocess` closure, as a function of the device.
    pub fn preprocess(
        dev: &Cpu,
        (img, lbl): (Vec<f32>, usize),
    ) -> (Tensor<Rank1<784>, f32, Cpu>, Tensor<Rank1<10>, f32, Cpu>) {
        let mut one_hotted = [0.0; 10];
        one_hotted[lbl] = 1.0;
        (
            dev.tensor_from_vec(img, (Const::<784>,)),
            dev.tensor(one_hotted),
        )
    }
}

pub mod rl {
    use dfdx::prelude::*;

    pub const BATCH: usize = 64;
    pub const STATE: usize = 4;
    pub const ACTION: usize = 2;

    pub type QNetworkStructure = (
        (Linear<STATE, 32>, ReLU),
        (Linear<32, 32>, ReLU),
        Linear<32, ACTION>,
    );
    pub type QNetwork = <QNetworkStructure as BuildOnDevice<Cpu, f32>>::Built;
    pub type PolicyNetwork = QNetwork;

    pub type ActorStructure = (Linear<4, 32>, ReLU, Linear<32, 2>);
    pub type Actor = <ActorStructure as BuildOnDevice<Cpu, f32>>::Built;
    pub type CriticStructure = (Linear<4, 32>, ReLU, Linear<32, 1>);
    pub type Critic = <CriticStructure as BuildOnDevice<Cpu, f32>>::Built;
}

pub mod housing {
    use dfdx::prelude::*;

    pub type MlpStructure = (
        (Linear<2, 32>, ReLU),
        (Linear<32, 32>, ReLU),
        (Linear<32, 1>, Sigmoid),
    );
    pub type Mlp = <MlpStructure as BuildOnDevice<Cpu, f32>>::Built;
}

pub mod gan {
    use dfdx::prelude::*;

    pub type GeneratorStructure = (Linear<4, 32>, ReLU, Linear<32, 2>);
    pub type Generator = <GeneratorStructure as BuildOnDevice<Cpu, f32>>::Built;
    pub type DiscriminatorStructure = (Linear<2, 32>, ReLU, Linear<32, 1>);
    pub type Discriminator = <DiscriminatorStructure as BuildOnDevice<Cpu, f32>>::Built;
}

pub mod regress {
    use dfdx::prelude::*;

    pub type Structure = (Linear<3, 16>, Tanh, Linear<16, 1>);
    pub type Model = <Structure as BuildOnDevice<Cpu, f32>>::Built;
}
