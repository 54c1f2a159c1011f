//! `mpx::nn`: the mixed-ready layers against dfdx's.
//!
//! * f32: bit for bit equal to dfdx's layers, forward and every parameter and input gradient
//!   (an f32 region changes nothing by design, and the layers keep dfdx's operation order).
//! * f16 on rows whose sums pass 65504: dfdx's encoder gives NaN/inf, ours stays finite and its
//!   gradients match the f32 computation within a bound derived from f16's precision.
//! * A small ViT trains a few steps in f16 through the runtime's mixed step.

use dfdx::nn::tensor_collection::{
    RecursiveWalker, TensorCollection, TensorOptions, TensorVisitor, ViewTensorRef,
};
use dfdx::prelude::*;
use mpx::nn::{self, DfdxLayer};

// ---- helpers --------------------------------------------------------------------------------

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every trainable tensor's gradient, in the module's visit order.
struct GradsOf<'a> {
    grads: &'a Gradients<f32, Cpu>,
    out: Vec<Vec<f32>>,
}

impl TensorVisitor<f32, Cpu> for GradsOf<'_> {
    type Viewer = ViewTensorRef;
    type Err = CpuError;
    type E2 = f32;
    type D2 = Cpu;
    fn visit<S: Shape>(
        &mut self,
        opts: TensorOptions<S, f32, Cpu>,
        t: &Tensor<S, f32, Cpu>,
    ) -> Result<Option<Tensor<S, f32, Cpu>>, CpuError> {
        if opts.do_gradient_update {
            self.out.push(self.grads.get(t).as_vec());
        }
        Ok(None)
    }
}

fn param_grads<M: TensorCollection<f32, Cpu>>(m: &M, grads: &Gradients<f32, Cpu>) -> Vec<Vec<f32>> {
    let mut v = GradsOf {
        grads,
        out: Vec::new(),
    };
    M::iter_tensors(&mut RecursiveWalker { m, f: &mut v }).expect("walk");
    v.out
}

/// Forward with a traced input, loss `sum(y * w)`: returns the output and the gradients.
fn run<M, S: Shape>(
    m: &M,
    x: &Tensor<S, f32, Cpu>,
    w: &Tensor<S, f32, Cpu>,
) -> (Vec<f32>, Gradients<f32, Cpu>)
where
    M: Module<
            Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
            Output = Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
        >,
{
    let y = m.forward(x.leaky_trace());
    let out = y.retaped::<NoneTape>().as_vec();
    let g = (y * w.clone()).sum().backward();
    (out, g)
}

/// Asserts that two models with the same tensors (one converted from the other) give the same
/// output and gradients, bit for bit. `ids` is either model: they share tensor ids.
fn assert_bit_identical<A, B, S: Shape, M: TensorCollection<f32, Cpu>>(
    ours: &A,
    theirs: &B,
    ids: &M,
    x: &Tensor<S, f32, Cpu>,
    w: &Tensor<S, f32, Cpu>,
) where
    A: Module<
            Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
            Output = Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
        >,
    B: Module<
            Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
            Output = Tensor<S, f32, Cpu, OwnedTape<f32, Cpu>>,
        >,
{
    let (y0, g0) = run(theirs, x, w);
    let (y1, g1) = run(ours, x, w);
    assert_eq!(bits(&y0), bits(&y1), "forward differs");
    assert_eq!(
        bits(&g0.get(x).as_vec()),
        bits(&g1.get(x).as_vec()),
        "input gradient differs"
    );
    let (p0, p1) = (param_grads(ids, &g0), param_grads(ids, &g1));
    assert!(!p0.is_empty());
    for (i, (a, b)) in p0.iter().zip(&p1).enumerate() {
        assert_eq!(bits(a), bits(b), "gradient of parameter #{i} differs");
    }
    // Not trivially zero.
    assert!(p1.iter().flatten().any(|g| *g != 0.0));
}

// ---- f32: bit for bit ----------------------------------------------------------------------

#[test]
fn f32_layer_norm_is_bit_identical_to_dfdx() {
    let dev = Cpu::seed_from_u64(1);
    let mut theirs = dev.build_module::<builders::LayerNorm1D<8>, f32>();
    theirs.gamma = dev.sample_normal();
    theirs.beta = dev.sample_normal();
    let ours = nn::LayerNorm1D::from_dfdx(theirs.clone());
    let x1: Tensor<Rank1<8>, f32, Cpu> = dev.sample_normal();
    assert_bit_identical(&ours, &theirs, &theirs, &x1, &dev.sample_normal());
    let x2: Tensor<Rank2<3, 8>, f32, Cpu> = dev.sample_normal() * 40.0;
    assert_bit_identical(&ours, &theirs, &theirs, &x2, &dev.sample_normal());
    let x3: Tensor<Rank3<2, 3, 8>, f32, Cpu> = dev.sample_normal();
    assert_bit_identical(&ours, &theirs, &theirs, &x3, &dev.sample_normal());
}

#[test]
fn f32_attention_is_bit_identical_to_dfdx() {
    let dev = Cpu::seed_from_u64(2);
    let theirs = dev.build_module::<builders::MultiHeadAttention<8, 2>, f32>();
    let ours: nn::MultiHeadAttention<8, 2> = theirs.clone().into();
    let x2: Tensor<Rank2<5, 8>, f32, Cpu> = dev.sample_normal();
    assert_bit_identical(&ours, &theirs, &theirs, &x2, &dev.sample_normal());
    let x3: Tensor<Rank3<3, 5, 8>, f32, Cpu> = dev.sample_normal() * 3.0;
    assert_bit_identical(&ours, &theirs, &theirs, &x3, &dev.sample_normal());

    // Cross-attention with different key and value sizes: (q, k, v).
    let theirs = dev.build_module::<builders::MultiHeadAttention<8, 2, 6, 4>, f32>();
    let ours: nn::MultiHeadAttention<8, 2, 6, 4> = theirs.clone().into();
    let q: Tensor<Rank3<2, 3, 8>, f32, Cpu> = dev.sample_normal();
    let k: Tensor<Rank3<2, 5, 8>, f32, Cpu> = dev.sample_normal();
    let v: Tensor<Rank3<2, 5, 8>, f32, Cpu> = dev.sample_normal();
    let w: Tensor<Rank3<2, 3, 8>, f32, Cpu> = dev.sample_normal();
    let y0 = theirs.forward((q.leaky_trace(), k.clone(), v.clone()));
    let y1 = ours.forward((q.leaky_trace(), k.clone(), v.clone()));
    assert_eq!(bits(&y0.as_vec()), bits(&y1.as_vec()));
    let (g0, g1) = ((y0 * w.clone()).sum().backward(), (y1 * w).sum().backward());
    assert_eq!(bits(&g0.get(&q).as_vec()), bits(&g1.get(&q).as_vec()));
    for (a, b) in param_grads(&theirs, &g0)
        .iter()
        .zip(&param_grads(&theirs, &g1))
    {
        assert_eq!(bits(a), bits(b));
    }
}

#[test]
fn f32_encoder_block_and_encoder_are_bit_identical_to_dfdx() {
    let dev = Cpu::seed_from_u64(3);
    let theirs = dev.build_module::<builders::TransformerEncoderBlock<8, 2, 16>, f32>();
    let ours: nn::TransformerEncoderBlock<8, 2, 16> = theirs.clone().into();
    let x3: Tensor<Rank3<2, 5, 8>, f32, Cpu> = dev.sample_normal();
    assert_bit_identical(&ours, &theirs, &theirs, &x3, &dev.sample_normal());
    let x2: Tensor<Rank2<5, 8>, f32, Cpu> = dev.sample_normal();
    assert_bit_identical(&ours, &theirs, &theirs, &x2, &dev.sample_normal());

    let theirs = dev.build_module::<builders::TransformerEncoder<8, 2, 16, 3>, f32>();
    let ours = nn::TransformerEncoder::<8, 2, 16, 3>::from_dfdx(theirs.clone());
    let x3: Tensor<Rank3<2, 5, 8>, f32, Cpu> = dev.sample_normal() * 10.0;
    assert_bit_identical(&ours, &theirs, &theirs, &x3, &dev.sample_normal());
}
