//! Real training loops, f32 against their `#[mixed_step]` conversion (issue 32): the loops of
//! `tests/real_code/` as their authors wrote them (dfdx's MNIST, DQN and PPO examples, its
//! housing struct, its generic train loop, a GAN) and the shapes users add: a module of the
//! user's own with `#[derive(HalfLayers)]` and without, one with weight tensors of its own, one
//! written as dense layers by hand (biases broadcast), one with scalar ops, attention written by
//! hand over sequences (batched products), a hand-unrolled RNN (a module of the user's own), a VAE
//! of the user's own whose forward pass calls its own helper method, a small REINFORCE policy, an MLP with a `PReLU` (a layer of
//! dfdx's that mpx keeps as dfdx's own), one with GeLU, one of `UnbiasedLinear`, one with
//! `LeakyReLU`, one with a residual block, a token model (an embedding table) and an MLP with
//! batch norms in training mode. Each row runs one call of the loop in f32 and in mixed f16 in
//! interleaved rounds (one of each per round, so a busy neighbour slows both alike) and reports
//! the medians and their ratio; the last line is the median ratio.
//!
//! ```text
//! cargo run --release --example bench_real_code [-- ROUNDS] [--avx2] [--only TEXT]
//! ```
//!
//! `--avx2` forces mpx's GEMM onto its AVX2 + FMA path, the instructions of a CPU without AVX-512
//! (dfdx's f32 loops and mpx's element-wise passes keep this CPU's own).

#![allow(clippy::too_many_arguments, clippy::type_complexity)]

use std::time::Duration;

use dfdx::nn::modules::{Linear as DLinear, ReLU as DReLU};
use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection};
use dfdx::optim::{Adam, Momentum, Sgd, SgdConfig};
use dfdx::prelude::*;
use mpx::mixed_step;
use mpx::precision::f16;
use mpx::step::GradScaler;

#[path = "common/measure.rs"]
mod measure;

#[path = "../tests/real_code/common.rs"]
pub mod common;

/// The loops as written, in f32.
#[allow(dead_code, clippy::needless_borrow)]
mod original {
    pub use super::common;
    pub mod mnist {
        include!("../tests/real_code/mnist.rs");
    }
    pub mod dqn {
        include!("../tests/real_code/dqn.rs");
    }
    pub mod ppo {
        include!("../tests/real_code/ppo.rs");
    }
    pub mod housing {
        include!("../tests/real_code/housing.rs");
    }
    pub mod generic {
        include!("../tests/real_code/generic.rs");
    }
    pub mod gan {
        include!("../tests/real_code/gan.rs");
    }
}

/// The same loops converted: the attribute and the scaler.
#[allow(dead_code, clippy::needless_borrow)]
mod half {
    pub use super::common;
    pub type Scaler = mpx::step::GradScaler<mpx::precision::f16>;
    pub mod mnist {
        include!("../tests/real_code/mnist_mixed.rs");
    }
    pub mod dqn {
        include!("../tests/real_code/dqn_mixed.rs");
    }
    pub mod ppo {
        include!("../tests/real_code/ppo_mixed.rs");
    }
    pub mod housing {
        include!("../tests/real_code/housing_mixed.rs");
    }
    // generic over its model: the model's own layers in f16 (the compiler warns)
    #[allow(deprecated)]
    pub mod generic {
        include!("../tests/real_code/generic_mixed.rs");
    }
    pub mod gan {
        include!("../tests/real_code/gan_mixed.rs");
    }
}

// ---- the shapes users add ----------------------------------------------------------------------

/// A module of the user's own: two linear layers and a ReLU, with the two lines that give its
/// working copy mpx's layers (`Own`), and the same without them (`Bare`, on dfdx's f16 layers).
macro_rules! user_module {
    ($name:ident $(, $derive:path, $fwd:meta)?) => {
        #[derive(Clone $(, $derive)?)]
        pub struct $name<E: Dtype, D: Device<E>> {
            l1: DLinear<16, 64, E, D>,
            act: DReLU,
            l2: DLinear<64, 4, E, D>,
        }

        impl<E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform, D: Device<E>>
            TensorCollection<E, D> for $name<E, D>
        {
            type To<E2: Dtype, D2: Device<E2>> = $name<E2, D2>;
            fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
                visitor: &mut V,
            ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
                visitor.visit_fields(
                    (
                        Self::module("l1", |s| &s.l1, |s| &mut s.l1),
                        Self::module("l2", |s| &s.l2, |s| &mut s.l2),
                    ),
                    |(l1, l2)| $name { l1, act: DReLU, l2 },
                )
            }
        }

        $(#[$fwd])?
        impl<E: Dtype, D: Device<E>, T: Tape<E, D>> Module<Tensor<Rank2<64, 16>, E, D, T>>
            for $name<E, D>
        {
            type Output = Tensor<Rank2<64, 4>, E, D, T>;
            type Error = D::Err;
            fn try_forward(&self, x: Tensor<Rank2<64, 16>, E, D, T>) -> Result<Self::Output, D::Err> {
                self.l2.try_forward(self.act.try_forward(self.l1.try_forward(x)?)?)
            }
        }
    };
}
user_module!(Own, mpx::HalfLayers, mpx::half_forward);
user_module!(Bare);

/// A hand-unrolled RNN, a module of the user's own (with the two lines): four steps of
/// `h = tanh(Wx x_t + Wh h)`, then a linear read-out.
#[derive(Clone, mpx::HalfLayers)]
pub struct Rnn<E: Dtype, D: Device<E>> {
    wx: DLinear<8, 32, E, D>,
    wh: DLinear<32, 32, E, D>,
    out: DLinear<32, 4, E, D>,
}

impl<E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform, D: Device<E>>
    TensorCollection<E, D> for Rnn<E, D>
{
    type To<E2: Dtype, D2: Device<E2>> = Rnn<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            (
                Self::module("wx", |s| &s.wx, |s| &mut s.wx),
                Self::module("wh", |s| &s.wh, |s| &mut s.wh),
                Self::module("out", |s| &s.out, |s| &mut s.out),
            ),
            |(wx, wh, out)| Rnn { wx, wh, out },
        )
    }
}

type Seq<E, T = NoneTape> = Tensor<Rank2<32, 8>, E, Cpu, T>;

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>, T: Tape<E, D>>
    Module<(
        Tensor<Rank2<32, 8>, E, D, T>,
        Tensor<Rank2<32, 8>, E, D>,
        Tensor<Rank2<32, 8>, E, D>,
        Tensor<Rank2<32, 8>, E, D>,
    )> for Rnn<E, D>
{
    type Output = Tensor<Rank2<32, 4>, E, D, T>;
    type Error = D::Err;
    fn try_forward(
        &self,
        (x0, x1, x2, x3): (
            Tensor<Rank2<32, 8>, E, D, T>,
            Tensor<Rank2<32, 8>, E, D>,
            Tensor<Rank2<32, 8>, E, D>,
            Tensor<Rank2<32, 8>, E, D>,
        ),
    ) -> Result<Self::Output, D::Err> {
        let mut h = self.wx.try_forward(x0)?.try_tanh()?;
        for x in [x1, x2, x3] {
            h = self
                .wh
                .try_forward(h)?
                .try_add(self.wx.try_forward(x)?)?
                .try_tanh()?;
        }
        self.out.try_forward(h)
    }
}

/// A variational autoencoder of the user's own (with the two lines, and the attribute on its
/// helper's impl too): the forward pass calls its own `encode` (mean and log-variance), samples
/// `z = mu + exp(logvar / 2) * eps` with a fixed noise, and returns the reconstruction with the
/// log-variance; 32-64-8 and back, batch 64.
#[derive(Clone, mpx::HalfLayers)]
pub struct Vae<E: Dtype, D: Device<E>> {
    enc: DLinear<32, 64, E, D>,
    mu: DLinear<64, 8, E, D>,
    logvar: DLinear<64, 8, E, D>,
    dec1: DLinear<8, 64, E, D>,
    dec2: DLinear<64, 32, E, D>,
}

impl<E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform, D: Device<E>>
    TensorCollection<E, D> for Vae<E, D>
{
    type To<E2: Dtype, D2: Device<E2>> = Vae<E2, D2>;
    fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(
            (
                Self::module("enc", |s| &s.enc, |s| &mut s.enc),
                Self::module("mu", |s| &s.mu, |s| &mut s.mu),
                Self::module("logvar", |s| &s.logvar, |s| &mut s.logvar),
                Self::module("dec1", |s| &s.dec1, |s| &mut s.dec1),
                Self::module("dec2", |s| &s.dec2, |s| &mut s.dec2),
            ),
            |(enc, mu, logvar, dec1, dec2)| Vae {
                enc,
                mu,
                logvar,
                dec1,
                dec2,
            },
        )
    }
}

type Code<E, D> = Tensor<Rank2<64, 8>, E, D, OwnedTape<E, D>>;

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> Vae<E, D> {
    fn encode(&self, x: Tensor<Rank2<64, 32>, E, D, OwnedTape<E, D>>) -> (Code<E, D>, Code<E, D>) {
        let (h, tape) = self.enc.forward(x).relu().split_tape();
        (
            self.mu.forward(h.clone().put_tape(tape)),
            self.logvar.forward(h.retaped()),
        )
    }
}

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> Module<Tensor<Rank2<64, 32>, E, D, OwnedTape<E, D>>> for Vae<E, D> {
    type Output = (Tensor<Rank2<64, 32>, E, D, OwnedTape<E, D>>, Code<E, D>);
    type Error = D::Err;
    fn try_forward(
        &self,
        x: Tensor<Rank2<64, 32>, E, D, OwnedTape<E, D>>,
    ) -> Result<Self::Output, D::Err> {
        let eps: Tensor<Rank2<64, 8>, E, D> = x.device().ones() * E::from_f32(0.3).unwrap();
        let (mu, logvar) = self.encode(x);
        let (lv, tape) = logvar.split_tape();
        let std = (lv.clone().put_tape(tape) * E::from_f32(0.5).unwrap()).exp();
        let h = self.dec1.forward(mu + std * eps).relu();
        Ok((self.dec2.forward(h), lv.retaped()))
    }
}

/// The `TensorCollection` of a module of the user's own made of tensors only, each trained and
/// reset to entries of about 1/4 (keeping the activations in range).
macro_rules! weights_only {
    ($name:ident { $($f:ident),+ }) => {
        impl<E: Dtype + num_traits::Float + rand_distr::uniform::SampleUniform, D: Device<E>>
            TensorCollection<E, D> for $name<E, D>
        {
            type To<E2: Dtype, D2: Device<E2>> = $name<E2, D2>;
            fn iter_tensors<V: ModuleVisitor<Self, E, D>>(
                visitor: &mut V,
            ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
                visitor.visit_fields(
                    ($(
                        Self::tensor(
                            stringify!($f),
                            |s| &s.$f,
                            |s| &mut s.$f,
                            TensorOptions::reset_with(|t| {
                                let b = E::from_f32(0.25).unwrap();
                                t.try_fill_with_distr(rand_distr::Uniform::new(-b, b))
                            }),
                        ),
                    )+),
                    |($($f,)+)| $name { $($f),+ },
                )
            }
        }
    };
}

/// A module of the user's own with weight tensors of its own (no layers): a residual MLP
/// `h = tanh(x·W1)`, `y = (h + (h·W2) * g)·W3` with a gate `g = sigmoid(x·Wg)`, with the two lines.
#[derive(Clone, mpx::HalfLayers)]
pub struct Raw<E: Dtype, D: Device<E>> {
    w1: Tensor<Rank2<16, 64>, E, D>,
    w2: Tensor<Rank2<64, 64>, E, D>,
    wg: Tensor<Rank2<16, 64>, E, D>,
    w3: Tensor<Rank2<64, 4>, E, D>,
}

weights_only!(Raw { w1, w2, wg, w3 });

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> Module<Tensor<Rank2<64, 16>, E, D, OwnedTape<E, D>>> for Raw<E, D> {
    type Output = Tensor<Rank2<64, 4>, E, D, OwnedTape<E, D>>;
    type Error = D::Err;
    fn try_forward(
        &self,
        x: Tensor<Rank2<64, 16>, E, D, OwnedTape<E, D>>,
    ) -> Result<Self::Output, D::Err> {
        let (x, tape) = x.split_tape();
        let g = x.clone().try_matmul(self.wg.clone())?.try_sigmoid()?;
        let (h, tape) = x
            .put_tape(tape)
            .try_matmul(self.w1.clone())?
            .try_tanh()?
            .split_tape();
        let y = h
            .clone()
            .put_tape(tape)
            .try_matmul(self.w2.clone())?
            .try_mul(g)?;
        (y + h).try_matmul(self.w3.clone())
    }
}

/// A module of the user's own written as a dense layer by hand, with the two lines: `x·W1 + b1`
/// (the bias broadcast over the batch), a ReLU, `·W2 + b2`.
#[derive(Clone, mpx::HalfLayers)]
pub struct Dense<E: Dtype, D: Device<E>> {
    w1: Tensor<Rank2<16, 64>, E, D>,
    b1: Tensor<Rank1<64>, E, D>,
    w2: Tensor<Rank2<64, 4>, E, D>,
    b2: Tensor<Rank1<4>, E, D>,
}

weights_only!(Dense { w1, b1, w2, b2 });

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> Module<Tensor<Rank2<64, 16>, E, D, OwnedTape<E, D>>> for Dense<E, D> {
    type Output = Tensor<Rank2<64, 4>, E, D, OwnedTape<E, D>>;
    type Error = D::Err;
    fn try_forward(
        &self,
        x: Tensor<Rank2<64, 16>, E, D, OwnedTape<E, D>>,
    ) -> Result<Self::Output, D::Err> {
        let b1 = self.b1.clone().broadcast::<Rank2<64, 64>, Axis<0>>();
        let h = (x.try_matmul(self.w1.clone())? + b1).try_relu()?;
        Ok(h.try_matmul(self.w2.clone())? + self.b2.clone().broadcast())
    }
}

/// A module of the user's own with scalar ops on its activations, with the two lines: `h =
/// relu(x·W1 * 0.5 + 0.1)`, `y = h·W2 / 2 - 0.1`.
#[derive(Clone, mpx::HalfLayers)]
pub struct Scaled<E: Dtype, D: Device<E>> {
    w1: Tensor<Rank2<16, 256>, E, D>,
    w2: Tensor<Rank2<256, 4>, E, D>,
}

weights_only!(Scaled { w1, w2 });

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> Module<Tensor<Rank2<64, 16>, E, D, OwnedTape<E, D>>> for Scaled<E, D> {
    type Output = Tensor<Rank2<64, 4>, E, D, OwnedTape<E, D>>;
    type Error = D::Err;
    fn try_forward(
        &self,
        x: Tensor<Rank2<64, 16>, E, D, OwnedTape<E, D>>,
    ) -> Result<Self::Output, D::Err> {
        let (half, shift, two) = (E::from_f32(0.5), E::from_f32(0.1), E::from_f32(2.0));
        let (half, shift, two) = (half.unwrap(), shift.unwrap(), two.unwrap());
        let h = (x.try_matmul(self.w1.clone())? * half + shift).try_relu()?;
        Ok(h.try_matmul(self.w2.clone())? / two - shift)
    }
}

/// A module of the user's own over sequences, with the two lines: one head of attention written
/// by hand, `softmax(q·kᵀ * 0.25)·v` with `q = x·Wq`, `k = x·Wk`, `v = x·Wv` (batched products),
/// then `·Wo`.
#[derive(Clone, mpx::HalfLayers)]
pub struct Attend<E: Dtype, D: Device<E>> {
    wq: Tensor<Rank2<32, 16>, E, D>,
    wk: Tensor<Rank2<32, 16>, E, D>,
    wv: Tensor<Rank2<32, 16>, E, D>,
    wo: Tensor<Rank2<16, 4>, E, D>,
}

weights_only!(Attend { wq, wk, wv, wo });

type Tokens<E, T> = Tensor<Rank3<8, 16, 32>, E, Cpu, T>;

#[mpx::half_forward]
impl<E: Dtype, D: Device<E>> Module<Tensor<Rank3<8, 16, 32>, E, D, OwnedTape<E, D>>>
    for Attend<E, D>
{
    type Output = Tensor<Rank3<8, 16, 4>, E, D, OwnedTape<E, D>>;
    type Error = D::Err;
    fn try_forward(
        &self,
        x: Tensor<Rank3<8, 16, 32>, E, D, OwnedTape<E, D>>,
    ) -> Result<Self::Output, D::Err> {
        let (x, tape) = x.split_tape();
        let q = x.clone().put_tape(tape).try_matmul(self.wq.clone())?;
        let (q, tape) = q.split_tape();
        let k = x.clone().put_tape(tape).try_matmul(self.wk.clone())?;
        let (k, tape) = k.split_tape();
        let v = x.put_tape(tape).try_matmul(self.wv.clone())?;
        let (v, tape) = v.split_tape();
        let quarter = E::from_f32(0.25).unwrap();
        let scores = q
            .put_tape(tape)
            .try_matmul(k.permute::<_, Axes3<0, 2, 1>>())?
            * quarter;
        let (scores, tape) = scores.split_tape();
        let weights = scores.put_tape(tape).try_softmax::<Axis<2>>()?;
        weights.try_matmul(v)?.try_matmul(self.wo.clone())
    }
}

/// One step of each shape, written once for f32 and once with the attribute.
macro_rules! steps {
    ($f32:ident, $mixed:ident, ($($arg:ident: $ty:ty),*), |$m:ident, $o:ident| $body:block) => {
        pub fn $f32($m: &mut M, $o: &mut Adam<M, f32, Cpu>, $($arg: $ty),*) -> f32 $body
        #[mixed_step(scaling = scaler)]
        pub fn $mixed($m: &mut M, $o: &mut Adam<M, f32, Cpu>, $($arg: $ty,)* scaler: &mut GradScaler) -> f32 $body
    };
}

/// A module of the user's own, one Adam step of the mean squared error of its output, per row:
/// `mod name { M = Module<f32, Cpu>; f32_step, mixed_step }` with the input and target types.
macro_rules! mse_steps {
    ($($(#[$attr:meta])* $name:ident: $module:ident, $x:ty, $y:ty;)+) => {$(
        $(#[$attr])*
        mod $name {
            use super::*;
            pub type M = $module<f32, Cpu>;
            steps!(f32_step, mixed_step, (x: &$x, y: &$y), |model, opt| {
                let loss = mse_loss(model.forward(x.trace(model.alloc_grads())), y.clone());
                let v = loss.array();
                let grads = loss.backward();
                opt.update(model, &grads).unwrap();
                v
            });
        }
    )+};
}

type Rows64<const N: usize> = Tensor<Rank2<64, N>, f32, Cpu>;

mse_steps! {
    own: Own, Rows64<16>, Rows64<4>;
    // runs on dfdx's f16 layers: the compiler says so, this benchmark measures it
    #[allow(deprecated)]
    bare: Bare, Rows64<16>, Rows64<4>;
    raw: Raw, Rows64<16>, Rows64<4>;
    dense: Dense, Rows64<16>, Rows64<4>;
    scaled: Scaled, Rows64<16>, Rows64<4>;
    attend: Attend, Tokens<f32, NoneTape>, Tensor<Rank3<8, 16, 4>, f32, Cpu>;
}

mod rnn {
    use super::*;
    pub type M = Rnn<f32, Cpu>;
    steps!(f32_step, mixed_step, (xs: &[Seq<f32>; 4], y: &Tensor<Rank2<32, 4>, f32, Cpu>), |model, opt| {
        let [a, b, c, d] = xs.clone();
        let out = model.forward((a.trace(model.alloc_grads()), b, c, d));
        let loss = mse_loss(out, y.clone());
        let v = loss.array();
        let grads = loss.backward();
        opt.update(model, &grads).unwrap();
        v
    });
}

mod vae {
    use super::*;
    pub type M = Vae<f32, Cpu>;
    steps!(f32_step, mixed_step, (x: &Tensor<Rank2<64, 32>, f32, Cpu>), |model, opt| {
        // reconstruction plus a penalty on the log-variance
        let (rec, logvar) = model.forward(x.trace(model.alloc_grads()));
        let loss = mse_loss(rec, x.clone()) + logvar.square().mean() * 0.1;
        let v = loss.array();
        let grads = loss.backward();
        opt.update(model, &grads).unwrap();
        v
    });
}

mod policy {
    use super::*;
    pub type Structure = (Linear<4, 64>, Tanh, Linear<64, 2>);
    pub type M = <Structure as BuildOnDevice<Cpu, f32>>::Built;
    steps!(f32_step, mixed_step, (s: &Tensor<Rank2<128, 4>, f32, Cpu>, a: &Tensor<Rank1<128>, usize, Cpu>, ret: &Tensor<Rank1<128>, f32, Cpu>), |model, opt| {
        // REINFORCE: -mean(log pi(a|s) * return)
        let logp = model.forward(s.trace(model.alloc_grads())).log_softmax::<Axis<1>>();
        let chosen = logp.select(a.clone());
        let loss = (chosen * ret.clone()).mean().negate();
        let v = loss.array();
        let grads = loss.backward();
        opt.update(model, &grads).unwrap();
        v
    });
}

/// A loop over a dfdx model `$structure` (10 classes, batch 32, cross-entropy), its forward pass
/// `$forward` (`forward`, or `forward_mut` for a batch norm's training mode), its input a batch
/// of 64 features or `$x`.
macro_rules! mlp_loop {
    ($name:ident, $forward:ident, $structure:ty) => {
        mlp_loop!($name, $forward, $structure, Tensor<Rank2<32, 64>, f32, Cpu>);
    };
    ($name:ident, $forward:ident, $structure:ty, $x:ty) => {
        mod $name {
            use super::*;
            pub type Structure = $structure;
            pub type M = <Structure as BuildOnDevice<Cpu, f32>>::Built;
            steps!(f32_step, mixed_step, (x: &$x, y: &Tensor<Rank2<32, 10>, f32, Cpu>), |model, opt| {
                let out = model.$forward(x.clone().traced(model.alloc_grads()));
                let loss = cross_entropy_with_logits_loss(out, y.clone());
                let v = loss.array();
                let grads = loss.backward();
                opt.update(model, &grads).unwrap();
                v
            });
        }
    };
}

mlp_loop!(
    prelu,
    forward,
    (
        Linear<64, 256>,
        PReLU,
        Linear<256, 256>,
        ReLU,
        Linear<256, 10>
    )
);
mlp_loop!(
    gelu,
    forward,
    (
        Linear<64, 256>,
        FastGeLU,
        Linear<256, 256>,
        FastGeLU,
        Linear<256, 10>
    )
);
mlp_loop!(
    unbiased,
    forward,
    (
        UnbiasedLinear<64, 256>,
        ReLU,
        UnbiasedLinear<256, 256>,
        ReLU,
        Linear<256, 10>
    )
);
mlp_loop!(
    leaky,
    forward,
    (
        Linear<64, 256>,
        LeakyReLU<f32>,
        Linear<256, 256>,
        LeakyReLU<f32>,
        Linear<256, 10>
    )
);
mlp_loop!(
    residual,
    forward,
    (
        Linear<64, 256>,
        ReLU,
        Residual<(Linear<256, 256>, ReLU)>,
        Linear<256, 10>
    )
);
// a token model: an embedding table, then an MLP on each token's row
mlp_loop!(
    tokens,
    forward,
    (Embedding<100, 64>, Linear<64, 64>, ReLU, Linear<64, 10>),
    Tensor<Rank1<32>, usize, Cpu>
);
mlp_loop!(
    batch_norm,
    forward_mut,
    (
        (Linear<64, 256>, BatchNorm1D<256>, ReLU),
        (Linear<256, 256>, BatchNorm1D<256>, ReLU),
        Linear<256, 10>,
    )
);

// ---- the table ---------------------------------------------------------------------------------

/// One row: the f32 call and the mixed call, measured interleaved.
/// Measures one row and pushes it onto `rows`, unless `--only` names other rows.
fn row(
    rows: &mut Vec<(&'static str, Duration, Duration)>,
    label: &'static str,
    rounds: usize,
    f32_call: &mut dyn FnMut(),
    mixed_call: &mut dyn FnMut(),
) {
    if ONLY
        .get()
        .is_some_and(|only| !label.contains(only.as_str()))
    {
        return;
    }
    let t = measure::measure(rounds, &mut [f32_call, mixed_call]);
    rows.push((label, t[0], t[1]));
}

/// `--only TEXT`: the rows whose label contains `TEXT`, alone (for a profiler).
static ONLY: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Rows of shapes written by [`steps!`], one per `label => module(init; args)`: the module's f32
/// step and mixed step, each on its own copy of `init` with its own Adam, measured interleaved;
/// pushed onto `$rows` in order.
macro_rules! adam_rows {
    ($rows:ident, $rounds:expr; $($label:expr => $m:ident($init:expr; $($arg:expr),*);)+) => {$({
        let init = $init;
        let (mut a, mut b) = (init.clone(), init);
        let (mut oa, mut ob) = (
            Adam::new(&a, Default::default()),
            Adam::new(&b, Default::default()),
        );
        let mut s = GradScaler::default();
        row(
            &mut $rows,
            $label,
            $rounds,
            &mut || {
                std::hint::black_box($m::f32_step(&mut a, &mut oa, $($arg),*));
            },
            &mut || {
                std::hint::black_box($m::mixed_step(&mut b, &mut ob, $($arg,)* &mut s));
            },
        );
    })+};
}

fn sgd_config() -> SgdConfig {
    SgdConfig {
        lr: 1e-1,
        momentum: Some(Momentum::Nesterov(0.9)),
        weight_decay: None,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rounds: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(15);
    if let Some(i) = args.iter().position(|a| a == "--only") {
        let _ = ONLY.set(args.get(i + 1).cloned().unwrap_or_default());
    }
    measure::on_path(args.iter().any(|a| a == "--avx2"), || table(rounds));
}

/// Runs every loop for `rounds` interleaved rounds and prints the table.
fn table(rounds: usize) {
    let cpu = measure::cpu_name();
    let mut rows: Vec<(&'static str, Duration, Duration)> = Vec::new();
    let dev = Cpu::seed_from_u64(0);

    // dfdx's MNIST example: two epochs of 8 batches
    {
        let data = common::mnist::MnistTrainSet::new(256);
        let init = dev.build_module::<common::mnist::MlpStructure, f32>();
        let (mut a, mut b) = (init.clone(), init);
        let (mut oa, mut ob) = (
            Adam::new(&a, Default::default()),
            Adam::new(&b, Default::default()),
        );
        let mut s = GradScaler::<f16>::default();
        row(
            &mut rows,
            "mnist (dfdx example, MLP 784-512-128-32-10, batch 32)",
            rounds,
            &mut || drop(original::mnist::train(&mut a, &mut oa, &data, 1)),
            &mut || drop(half::mnist::train(&mut b, &mut ob, &data, 1, &mut s)),
        );
    }
    // dfdx's DQN and PPO examples: 3 epochs on a batch of 64 transitions
    {
        let mut rng = common::Lcg::new(7);
        let rows_of =
            |rng: &mut common::Lcg| -> [[f32; 4]; 64] { std::array::from_fn(|_| rng.normals()) };
        let state: Tensor<Rank2<64, 4>, f32, Cpu> = dev.tensor(rows_of(&mut rng));
        let action: Tensor<Rank1<64>, usize, Cpu> =
            dev.tensor(std::array::from_fn::<usize, 64, _>(|i| (i + 1) % 2));
        let reward: Tensor<Rank1<64>, f32, Cpu> = dev.tensor(rng.normals::<64>());
        let done: Tensor<Rank1<64>, f32, Cpu> = dev.zeros();
        let next: Tensor<Rank2<64, 4>, f32, Cpu> = dev.tensor(rows_of(&mut rng));
        let init = dev.build_module::<common::rl::QNetworkStructure, f32>();
        let (mut qa, mut ta, mut qb, mut tb) =
            (init.clone(), init.clone(), init.clone(), init.clone());
        let (mut oa, mut ob) = (Sgd::new(&qa, sgd_config()), Sgd::new(&qb, sgd_config()));
        let mut s = GradScaler::<f16>::default();
        row(
            &mut rows,
            "dqn (dfdx example, Q-network 4-64-64-2, batch 64)",
            rounds,
            &mut || {
                (qa, ta) = (init.clone(), init.clone());
                drop(original::dqn::train(
                    &mut qa, &mut ta, &mut oa, &state, &action, &reward, &done, &next, 3,
                ))
            },
            &mut || {
                (qb, tb) = (init.clone(), init.clone());
                drop(half::dqn::train(
                    &mut qb, &mut tb, &mut ob, &state, &action, &reward, &done, &next, 3, &mut s,
                ))
            },
        );
        let (mut pa, mut ta, mut pb, mut tb) =
            (init.clone(), init.clone(), init.clone(), init.clone());
        let (mut oa, mut ob) = (Sgd::new(&pa, sgd_config()), Sgd::new(&pb, sgd_config()));
        let mut s = GradScaler::<f16>::default();
        let adv = reward.clone();
        row(
            &mut rows,
            "ppo (dfdx example, policy 4-64-64-2, batch 64)",
            rounds,
            // each call from the same policy: repeated, PPO's surrogate runs away in both
            &mut || {
                (pa, ta) = (init.clone(), init.clone());
                drop(original::ppo::train(
                    &mut pa, &mut ta, &mut oa, &state, &action, &adv, 3,
                ))
            },
            &mut || {
                (pb, tb) = (init.clone(), init.clone());
                drop(half::ppo::train(
                    &mut pb, &mut tb, &mut ob, &state, &action, &adv, 3, &mut s,
                ))
            },
        );
    }
    // dfdx's housing struct: 16 batches of 32
    {
        let mut rng = common::Lcg::new(13);
        let batches: Vec<_> = (0..16)
            .map(|_| {
                let (mut x, mut y) = (Vec::new(), Vec::new());
                for _ in 0..32 {
                    let (a, b) = (rng.uniform() * 4.0 - 2.0, rng.uniform() * 4.0 - 2.0);
                    x.extend([a, b]);
                    y.push(f32::from(u8::from((a * a + b * b).sqrt() > 1.0)));
                }
                (
                    dev.tensor_from_vec(x, (32usize, Const::<2>)),
                    dev.tensor_from_vec(y, (32usize, Const::<1>)),
                )
            })
            .collect();
        let (mut pa, mut pb) = (
            original::housing::Predictor::new(3),
            half::housing::Predictor::new(3),
        );
        let mut s = GradScaler::<f16>::default();
        row(
            &mut rows,
            "housing (dfdx example, MLP 2-32-32-1 in a struct, batch 32)",
            rounds,
            &mut || {
                for (x, y) in &batches {
                    pa.learn_batch(x.clone(), y.clone());
                }
            },
            &mut || {
                for (x, y) in &batches {
                    pb.learn_batch(x.clone(), y.clone(), &mut s);
                }
            },
        );
    }
    // dfdx's generic train loop: 100 batches of 5
    {
        type M = <Linear<10, 2> as BuildOnDevice<Cpu, f32>>::Built;
        let mut rng = common::Lcg::new(5);
        let data: Vec<(
            Tensor<Rank2<5, 10>, f32, Cpu>,
            Tensor<Rank2<5, 2>, f32, Cpu>,
        )> = (0..100)
            .map(|_| {
                (
                    dev.tensor(std::array::from_fn::<[f32; 10], 5, _>(|_| rng.normals())),
                    dev.tensor([[0.0, 1.0]; 5]),
                )
            })
            .collect();
        let init: M = dev.build_module::<Linear<10, 2>, f32>();
        let (mut a, mut b) = (init.clone(), init);
        let (mut oa, mut ob) = (
            Sgd::new(&a, Default::default()),
            Sgd::new(&b, Default::default()),
        );
        let mut s = GradScaler::<f16>::default();
        row(
            &mut rows,
            "generic (dfdx example, Linear 10-2 generic over its model, batch 5)",
            rounds,
            &mut || {
                original::generic::classification_train(
                    &mut a,
                    &mut oa,
                    cross_entropy_with_logits_loss,
                    data.clone().into_iter(),
                    1,
                )
                .unwrap()
            },
            &mut || {
                half::generic::classification_train(
                    &mut b,
                    &mut ob,
                    cross_entropy_with_logits_loss,
                    data.clone().into_iter(),
                    1,
                    &mut s,
                )
                .unwrap()
            },
        );
    }
    // a GAN: 40 iterations of two models
    {
        let mut rng = common::Lcg::new(21);
        let (real, noise): (
            Vec<Tensor<Rank2<32, 2>, f32, Cpu>>,
            Vec<Tensor<Rank2<32, 4>, f32, Cpu>>,
        ) = (0..40)
            .map(|_| {
                let r: [[f32; 2]; 32] = std::array::from_fn(|_| {
                    let a = rng.uniform() * std::f32::consts::TAU;
                    [1.0 + 2.0 * a.cos(), -1.0 + 2.0 * a.sin()]
                });
                let n: [[f32; 4]; 32] = std::array::from_fn(|_| rng.normals());
                (dev.tensor(r), dev.tensor(n))
            })
            .unzip();
        let (g0, d0) = (
            dev.build_module::<common::gan::GeneratorStructure, f32>(),
            dev.build_module::<common::gan::DiscriminatorStructure, f32>(),
        );
        let (mut ga, mut da, mut gb, mut db) = (g0.clone(), d0.clone(), g0, d0);
        let (mut goa, mut doa) = (
            Adam::new(&ga, Default::default()),
            Adam::new(&da, Default::default()),
        );
        let (mut gob, mut dob) = (
            Adam::new(&gb, Default::default()),
            Adam::new(&db, Default::default()),
        );
        let mut s = GradScaler::<f16>::default();
        row(
            &mut rows,
            "gan (two MLPs 4-32-2 and 2-32-1, batch 32)",
            rounds,
            &mut || {
                drop(original::gan::train(
                    &mut ga, &mut da, &mut goa, &mut doa, &real, &noise,
                ))
            },
            &mut || {
                drop(half::gan::train(
                    &mut gb, &mut db, &mut gob, &mut dob, &real, &noise, &mut s,
                ))
            },
        );
    }
    // the user's own modules, with the two lines and without
    let x: Tensor<Rank2<64, 16>, f32, Cpu> = dev.sample_normal();
    let y: Tensor<Rank2<64, 4>, f32, Cpu> = dev.sample_normal();
    adam_rows!(rows, rounds * 20;
        "a module of the user's own (16-64-4, batch 64), #[derive(HalfLayers)]"
            => own(own::M::build(&dev); &x, &y);
        "the same module without the two lines (dfdx's f16 layers)"
            => bare(bare::M::build(&dev); &x, &y);
        "a module of the user's own with weight tensors of its own (matmul, +, *; 16-64-64-4, batch 64)"
            => raw(raw::M::build(&dev); &x, &y);
        "a module of the user's own, dense layers by hand (x·W + b broadcast; 16-64-4, batch 64)"
            => dense(dense::M::build(&dev); &x, &y);
        "a module of the user's own with scalar ops (x·W * s + t, / s; 16-256-4, batch 64)"
            => scaled(scaled::M::build(&dev); &x, &y);
    );
    let tokens: Tokens<f32, NoneTape> = dev.sample_normal();
    let y: Tensor<Rank3<8, 16, 4>, f32, Cpu> = dev.sample_normal();
    adam_rows!(rows, rounds * 20;
        "a module of the user's own over sequences: attention by hand (batched matmuls; 8x16x32, one head of 16)"
            => attend(attend::M::build(&dev); &tokens, &y);
    );
    // a hand-unrolled RNN, a REINFORCE policy
    let xs: [Seq<f32>; 4] = std::array::from_fn(|_| dev.sample_normal());
    let y: Tensor<Rank2<32, 4>, f32, Cpu> = dev.sample_normal();
    let s_: Tensor<Rank2<128, 4>, f32, Cpu> = dev.sample_normal();
    let a_: Tensor<Rank1<128>, usize, Cpu> =
        dev.tensor(std::array::from_fn::<usize, 128, _>(|i| i % 2));
    let r_: Tensor<Rank1<128>, f32, Cpu> = dev.sample_normal();
    adam_rows!(rows, rounds * 20;
        "a hand-unrolled RNN, 4 steps of 8-32 (a module of the user's own), batch 32"
            => rnn(rnn::M::build(&dev); &xs, &y);
        "a REINFORCE policy 4-64-2 (log_softmax, select), batch 128"
            => policy(dev.build_module::<policy::Structure, f32>(); &s_, &a_, &r_);
    );
    let xv: Tensor<Rank2<64, 32>, f32, Cpu> = dev.sample_normal();
    adam_rows!(rows, rounds * 20;
        "a VAE of the user's own, its forward pass calling its own encode (32-64-8-64-32, batch 64)"
            => vae(vae::M::build(&dev); &xv);
    );
    // dfdx MLPs, each with a layer the mixed step maps its own way, and a token model
    let x: Tensor<Rank2<32, 64>, f32, Cpu> = dev.sample_normal();
    let y: Tensor<Rank2<32, 10>, f32, Cpu> =
        dev.sample_normal::<Rank2<32, 10>>().softmax::<Axis<1>>();
    let ids: Tensor<Rank1<32>, usize, Cpu> =
        dev.tensor(std::array::from_fn::<usize, 32, _>(|i| (i * 7) % 100));
    adam_rows!(rows, rounds * 20;
        "a dfdx MLP with a PReLU (64-256-256-10, batch 32)"
            => prelu(dev.build_module::<prelu::Structure, f32>(); &x, &y);
        "a dfdx MLP with GeLU (64-256-256-10, FastGeLU, batch 32)"
            => gelu(dev.build_module::<gelu::Structure, f32>(); &x, &y);
        "a dfdx MLP of UnbiasedLinear (64-256-256-10, batch 32)"
            => unbiased(dev.build_module::<unbiased::Structure, f32>(); &x, &y);
        "a dfdx MLP with LeakyReLU (64-256-256-10, batch 32)"
            => leaky(dev.build_module::<leaky::Structure, f32>(); &x, &y);
        "a dfdx MLP with a residual block (64-256, Residual<(Linear 256-256, ReLU)>, 10, batch 32)"
            => residual(dev.build_module::<residual::Structure, f32>(); &x, &y);
        "a token model: Embedding 100x64, MLP 64-64-10, batch 32"
            => tokens(dev.build_module::<tokens::Structure, f32>(); &ids, &y);
        "a dfdx MLP with batch norms (64-256-256-10, forward_mut, batch 32)"
            => batch_norm(dev.build_module::<batch_norm::Structure, f32>(); &x, &y);
    );

    let path = mpx::__bench::active_path();
    println!(
        "real loops, f32 against `#[mixed_step]` f16, medians of interleaved rounds, mpx's GEMM on {path:?}, {cpu}"
    );
    println!("| loop | f32 | mixed | mixed / f32 |");
    println!("|---|---|---|---|");
    let mut ratios = Vec::new();
    for (name, f, m) in &rows {
        let r = m.as_secs_f64() / f.as_secs_f64();
        ratios.push(r);
        println!(
            "| {name} | {:.3} ms | {:.3} ms | {r:.2} |",
            f.as_secs_f64() * 1e3,
            m.as_secs_f64() * 1e3
        );
    }
    ratios.sort_by(f64::total_cmp);
    if let Some(median) = ratios.get(ratios.len() / 2) {
        println!(
            "median mixed / f32 over {} loops: {median:.2}",
            ratios.len()
        );
    }
}
