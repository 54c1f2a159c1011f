//! mpx's fused `Linear` / `LinearReLU` against dfdx's `Linear` (f32) and an exact f64 reference
//! (f16, `AMP<f16>`), on every kernel path this CPU supports, and a small MLP trained in f16 with
//! the mixed step.
//!
//! Tolerances come from the kernels' stated bounds: with `S = Σ|a||b|` (plus `|bias|`), an f32
//! result is within `γ(K+1, 2^-24)·S` of exact, so two f32 implementations differ by at most twice
//! that; an f16 result adds one rounding to f16 (`2^-11` relative, `2^-25` absolute near zero)
//! and, on the AVX512-FP16 path, the f16-sum bound `fp16_error_bound(K)`.

use dfdx::shapes::Shape;
use dfdx::{optim::*, prelude::*};
use mpx::__bench::{KernelPath, f32_error_bound, fp16_error_bound, with_path};
use mpx::nn::{self, IntoLayers, Mpx};
use mpx::precision::{AMP, f16};
use mpx::scaling::{DynamicLossScale, StaticLossScale};
use mpx::step::{GradScaler, Mapped, Mixed};

const B: usize = 13;

/// A layer's forward on a traced batch.
type Layer<'a> = dyn Fn(
        Tensor<Rank2<B, I>, f32, Cpu, OwnedTape<f32, Cpu>>,
    ) -> Tensor<Rank2<B, O>, f32, Cpu, OwnedTape<f32, Cpu>>
    + 'a;
const I: usize = 70;
const O: usize = 45;

/// Exact (f64) forward and gradients of `sum(act(x·Wᵀ + b) * c)`, with the `S` of each entry.
struct Reference {
    y: Vec<(f64, f64)>,
    dx: Vec<(f64, f64)>,
    dw: Vec<(f64, f64)>,
    db: Vec<(f64, f64)>,
}

fn reference(x: &[f64], w: &[f64], b: &[f64], c: &[f64], relu: bool) -> Reference {
    let mut y = vec![(0.0, 0.0); B * O];
    let mut dz = vec![0.0; B * O];
    for r in 0..B {
        for o in 0..O {
            let (mut z, mut s) = (b[o], b[o].abs());
            for i in 0..I {
                z += x[r * I + i] * w[o * I + i];
                s += (x[r * I + i] * w[o * I + i]).abs();
            }
            let keep = !relu || z > 0.0;
            y[r * O + o] = (if keep { z } else { 0.0 }, s);
            dz[r * O + o] = if keep { c[r * O + o] } else { 0.0 };
        }
    }
    let mut dx = vec![(0.0, 0.0); B * I];
    for r in 0..B {
        for i in 0..I {
            for o in 0..O {
                dx[r * I + i].0 += dz[r * O + o] * w[o * I + i];
                dx[r * I + i].1 += (dz[r * O + o] * w[o * I + i]).abs();
            }
        }
    }
    let mut dw = vec![(0.0, 0.0); O * I];
    let mut db = vec![(0.0, 0.0); O];
    for o in 0..O {
        for r in 0..B {
            db[o].0 += dz[r * O + o];
            db[o].1 += dz[r * O + o].abs();
            for i in 0..I {
                dw[o * I + i].0 += dz[r * O + o] * x[r * I + i];
                dw[o * I + i].1 += (dz[r * O + o] * x[r * I + i]).abs();
            }
        }
    }
    Reference { y, dx, dw, db }
}

fn f64s<E: Into<f64> + Copy>(v: &[E]) -> Vec<f64> {
    v.iter().map(|&x| x.into()).collect()
}

/// Checks `got` against exact values: `|got - exact| ≤ rel·S + out_rel·|exact| + abs`, where `K`
/// is the inner dimension of the entry.
fn within(what: &str, got: &[f64], exact: &[(f64, f64)], bound: impl Fn(f64, f64) -> f64) {
    assert_eq!(got.len(), exact.len(), "{what}");
    for (k, (g, (e, s))) in got.iter().zip(exact).enumerate() {
        assert!(
            (g - e).abs() <= bound(*e, *s),
            "{what}[{k}]: {g} vs exact {e} (S = {s}), bound {}",
            bound(*e, *s)
        );
    }
}

/// f32: mpx's layer against dfdx's `Linear` (+ `ReLU`), on every path, with the layer used twice
/// on one tape so that gradients accumulate.
#[test]
fn f32_forward_and_gradients_match_dfdx_linear_on_every_path() {
    let dev = Cpu::seed_from_u64(3);
    let dl = dev.build_module::<Linear<I, O>, f32>();
    let x: Tensor<Rank2<B, I>, f32, Cpu> = dev.sample_normal();
    let c: Tensor<Rank2<B, O>, f32, Cpu> = dev.sample_normal();
    for relu in [false, true] {
        // dfdx: loss = sum(act(l(x))·c) + sum(act(l(2x))·c)
        let xt = x.clone().traced(Gradients::leaky());
        let y1 = dl.forward(xt.with_empty_tape());
        let y1 = if relu { y1.relu() } else { y1 };
        let y2 = dl.forward(xt * 2.0);
        let y2 = if relu { y2.relu() } else { y2 };
        let want_grads = ((y1 * c.clone()).sum() + (y2 * c.clone()).sum()).backward();
        let want_y = if relu {
            dl.forward(x.clone()).relu()
        } else {
            dl.forward(x.clone())
        };

        for path in KernelPath::supported() {
            with_path(path, || {
                let run = |m: &Layer<'_>, ids: (&Tensor<Rank2<O, I>, f32, Cpu>, &Tensor<Rank1<O>, f32, Cpu>)| {
                    let g = Gradients::leaky();
                    let xt = x.clone().traced(g);
                    let y1 = m(xt.with_empty_tape());
                    let y2 = m(xt * 2.0);
                    let g = ((y1 * c.clone()).sum() + (y2 * c.clone()).sum()).backward();
                    (g.get(ids.0).as_vec(), g.get(ids.1).as_vec(), g.get(&x).as_vec())
                };
                let (y, (gw, gb, gx)) = if relu {
                    let l: nn::LinearReLU<I, O, f32> = (dl.clone(), ReLU).into();
                    (l.forward(x.clone()).as_vec(), run(&|t| l.forward(t), (&l.weight, &l.bias)))
                } else {
                    let l: nn::Linear<I, O, f32> = dl.clone().into();
                    (l.forward(x.clone()).as_vec(), run(&|t| l.forward(t), (&l.weight, &l.bias)))
                };
                // exact values for the bound's S (x2 input: S doubles, use 3x to cover both terms)
                let r = reference(&f64s(&x.as_vec()), &f64s(&dl.weight.as_vec()), &f64s(&dl.bias.as_vec()), &f64s(&c.as_vec()), relu);
                let two = |k: usize, mult: f64| move |_: f64, s: f64| 2.0 * f32_error_bound(k + 2) * mult * s;
                let pairs = |ours: &[f32], theirs: Vec<f32>, exact: &[(f64, f64)]| -> Vec<(f64, f64)> {
                    // dfdx's value as the "exact" entry, the reference's S as the scale
                    ours.iter().zip(theirs).zip(exact).map(|((_, t), (_, s))| (t as f64, *s)).collect()
                };
                within(&format!("{path:?} relu={relu} y"), &f64s(&y), &pairs(&y, want_y.as_vec(), &r.y), two(I, 1.0));
                // the two uses add: scales are at most 3x the single-use S
                within(&format!("{path:?} relu={relu} dW"), &f64s(&gw), &pairs(&gw, want_grads.get(&dl.weight).as_vec(), &r.dw), two(2 * B, 3.0));
                within(&format!("{path:?} relu={relu} db"), &f64s(&gb), &pairs(&gb, want_grads.get(&dl.bias).as_vec(), &r.db), two(2 * B, 2.0));
                within(&format!("{path:?} relu={relu} dX"), &f64s(&gx), &pairs(&gx, want_grads.get(&x).as_vec(), &r.dx), two(2 * O, 3.0));
            })
            .unwrap();
        }
    }
}

/// The bound of an f16 result with inner dimension `k` on `path`: accumulation, then one rounding.
fn f16_bound(path: KernelPath, k: usize) -> impl Fn(f64, f64) -> f64 {
    let (rel, abs) = if path == KernelPath::Avx512Fp16 {
        fp16_error_bound(k + 1)
    } else {
        (f32_error_bound(k + 1), 0.0)
    };
    let u16 = 2f64.powi(-11);
    move |e: f64, s: f64| rel * s * (1.0 + u16) + abs + u16 * e.abs() + 2f64.powi(-25)
}

/// The values of a tensor of any float dtype, as f64.
fn vals<S: Shape, E: mpx::precision::Precision<Elem = E> + Dtype>(
    t: &Tensor<S, E, Cpu>,
) -> Vec<f64> {
    let h = t.as_vec();
    let mut v = vec![0.0f32; h.len()];
    E::widen(&h, &mut v);
    f64s(&v)
}

/// f16 and AMP<f16> layers against the exact values of their own f16 parameters and inputs.
macro_rules! half_matches_exact {
    ($name:ident, $e:ty) => {
        #[test]
        fn $name() {
            type E = $e;
            let dev = Cpu::seed_from_u64(5);
            let dl = dev.build_module::<Linear<I, O>, f32>().to_dtype::<E>();
            let x: Tensor<Rank2<B, I>, f32, Cpu> = dev.sample_normal();
            let c: Tensor<Rank2<B, O>, f32, Cpu> = dev.sample_normal();
            let (x, c) = (x.to_dtype::<E>(), c.to_dtype::<E>());
            for relu in [false, true] {
                let r = reference(
                    &vals(&x),
                    &vals(&dl.weight),
                    &vals(&dl.bias),
                    &vals(&c),
                    relu,
                );
                for path in KernelPath::supported() {
                    with_path(path, || {
                        let (y, g, w, b) = if relu {
                            let l: nn::LinearReLU<I, O, E> = (dl.clone(), ReLU).into();
                            let y = l.forward(x.clone().traced(Gradients::leaky()));
                            let (y, t) = y.split_tape();
                            let g = (y.clone().put_tape(t) * c.clone()).sum().backward();
                            (y, g, l.weight.clone(), l.bias.clone())
                        } else {
                            let l: nn::Linear<I, O, E> = dl.clone().into();
                            let y = l.forward(x.clone().traced(Gradients::leaky()));
                            let (y, t) = y.split_tape();
                            let g = (y.clone().put_tape(t) * c.clone()).sum().backward();
                            (y, g, l.weight.clone(), l.bias.clone())
                        };
                        let tag = format!("{} {path:?} relu={relu}", stringify!($e));
                        within(&format!("{tag} y"), &vals(&y), &r.y, f16_bound(path, I));
                        within(
                            &format!("{tag} dW"),
                            &vals(&g.get(&w)),
                            &r.dw,
                            f16_bound(path, B),
                        );
                        within(
                            &format!("{tag} db"),
                            &vals(&g.get(&b)),
                            &r.db,
                            f16_bound(KernelPath::Portable, B),
                        );
                        within(
                            &format!("{tag} dX"),
                            &vals(&g.get(&x)),
                            &r.dx,
                            f16_bound(path, O),
                        );
                    })
                    .unwrap();
                }
            }
        }
    };
}

half_matches_exact!(
    f16_forward_and_gradients_are_within_the_f16_bound_of_exact_on_every_path,
    f16
);
half_matches_exact!(
    amp_f16_forward_and_gradients_are_within_the_f16_bound_of_exact_on_every_path,
    AMP<f16>
);

/// A rank-3 input is the same rows as a rank-2 one.
#[test]
fn rank3_input_equals_rank2_rows() {
    let dev = Cpu::seed_from_u64(7);
    let l = dev.build_module::<nn::builders::LinearReLU<6, 5>, f32>();
    let x: Tensor<Rank3<2, 3, 6>, f32, Cpu> = dev.sample_normal();
    let y3 = l.forward(x.clone());
    let y2 = l.forward(x.clone().reshape::<Rank2<6, 6>>());
    assert_eq!(y3.as_vec(), y2.as_vec());
    let y1 = l.forward(x.reshape::<Rank2<6, 6>>().select(dev.tensor(4)));
    assert_eq!(y1.as_vec(), y2.as_vec()[20..25].to_vec());
}

/// Conversions move the parameters unchanged, both ways.
#[test]
fn conversions_keep_parameters() {
    let dev = Cpu::seed_from_u64(8);
    let model = dev.build_module::<(Linear<4, 8>, ReLU, Linear<8, 2>), f32>();
    let (w0, b2) = (model.0.weight.as_vec(), model.2.bias.as_vec());
    let (a, relu, b) = model.into_layers(Mpx);
    assert_eq!(
        (a.weight.as_vec(), b.bias.as_vec()),
        (w0.clone(), b2.clone())
    );
    let fused = nn::LinearReLU::from((dfdx::nn::modules::Linear::from(a), relu));
    let (back, _relu): (dfdx::nn::modules::Linear<4, 8, f32, Cpu>, ReLU) = fused.into();
    assert_eq!(back.weight.as_vec(), w0);
    let b_back: dfdx::nn::modules::Linear<8, 2, f32, Cpu> = b.into();
    assert_eq!(b_back.bias.as_vec(), b2);
    // A model that mixes both families converts whole, either way.
    let mixed = (
        nn::Linear::from(b_back),
        ReLU,
        dev.build_module::<Linear<2, 3>, f32>(),
    );
    let (l0, _, l2): (nn::Linear<8, 2, f32>, ReLU, nn::Linear<2, 3, f32>) =
        mixed.clone().into_layers(Mpx);
    assert_eq!(
        (l0.bias.as_vec(), l2.weight.as_vec()),
        (b2, mixed.2.weight.as_vec())
    );
    let (d0, _, d2) = mixed.clone().into_layers(nn::Dfdx);
    assert_eq!(
        (d0.weight.as_vec(), d2.bias.as_vec()),
        (mixed.0.weight.as_vec(), mixed.2.bias.as_vec())
    );
}

type MpxMlp = (
    nn::builders::LinearReLU<16, 32>,
    nn::builders::LinearReLU<32, 32>,
    nn::builders::Linear<32, 4>,
);

/// Mean cross-entropy after `steps` Adam steps of the mixed step with working precision `H`.
fn train<H: mpx::precision::Stored>(steps: usize) -> (f32, f32)
where
    Cpu: Device<H::Elem>,
    mpx::step::WorkingCopy<H, <MpxMlp as BuildOnDevice<Cpu, f32>>::Built>:
        dfdx::nn::tensor_collection::TensorCollection<H::Elem, Cpu>
            + Module<
                Tensor<Rank2<64, 16>, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
                Output = Tensor<Rank2<64, 4>, H::Elem, Cpu, OwnedTape<H::Elem, Cpu>>,
            > + Send
            + Sync
            + 'static,
    Cpu: mpx::step::MixedDevice<H>,
{
    let dev = Cpu::seed_from_u64(11);
    let mut master = Mixed::new(dev.build_module::<MpxMlp, f32>());
    let mut opt = Adam::new(
        &*master,
        AdamConfig {
            lr: 3e-3,
            ..Default::default()
        },
    );
    let mut scaler =
        GradScaler::<H, _>::new(DynamicLossScale::builder().initial(1024.0).build().unwrap());
    // a fixed batch whose labels come from a fixed random linear map: learnable
    let x: Tensor<Rank2<64, 16>, f32, Cpu> = SampleTensor::<f32>::sample_normal(&dev);
    let proj: Tensor<Rank2<16, 4>, f32, Cpu> = SampleTensor::<f32>::sample_normal(&dev);
    let y = (x.clone().matmul(proj) * 4.0).softmax::<Axis<1>>();
    let mut first = None;
    let mut last = 0.0;
    for _ in 0..steps {
        let out = scaler
            .forward(&master, x.clone().trace(master.alloc_grads()), |m, x| {
                m.forward(x)
            })
            .unwrap();
        let loss = cross_entropy_with_logits_loss(out, y.clone());
        first.get_or_insert(loss.array());
        last = loss.array();
        let grads = scaler.backward(loss).unwrap();
        scaler.update(&mut master, &mut opt, &grads).unwrap();
    }
    (first.unwrap(), last)
}

#[test]
fn mlp_of_fused_layers_trains_in_f16_to_the_f32_loss() {
    let (start32, end32) = train::<f32>(60);
    let (start16, end16) = train::<f16>(60);
    assert!(end32 < 0.5 * start32, "f32 learns: {start32} -> {end32}");
    assert!(end16 < 0.5 * start16, "f16 learns: {start16} -> {end16}");
    assert!(
        (end16 - end32).abs() <= 0.05 * end32 + 0.01,
        "f16 {end16} vs f32 {end32}"
    );
}

/// A batch of more rows than the layer's f32 scratch holds (computed in chunks) matches dfdx.
#[test]
fn long_batches_are_computed_in_chunks_and_match_dfdx() {
    let dev = Cpu::seed_from_u64(9);
    let dl = dev.build_module::<Linear<8, 6>, f32>();
    let rows = 1100;
    let x: Tensor<(usize, Const<8>), f32, Cpu> = dev.sample_normal_like(&(rows, Const));
    let c: Tensor<(usize, Const<6>), f32, Cpu> = dev.sample_normal_like(&(rows, Const));
    let want_y = dl.forward(x.clone());
    let g_want = (dl.forward(x.clone().traced(Gradients::leaky())) * c.clone())
        .sum()
        .backward();
    let l: nn::Linear<8, 6, f32> = dl.clone().into();
    let y = l.forward(x.clone());
    let g = (l.forward(x.clone().traced(Gradients::leaky())) * c.clone())
        .sum()
        .backward();
    // S of y: |x|·|W|ᵀ + |b|; of dX: |c|·|W|
    let s_y = x.clone().abs().matmul(dl.weight.clone().abs().permute())
        + dl.bias.clone().abs().broadcast_like(&(rows, Const::<6>));
    let s_dx = c.clone().abs().matmul(dl.weight.clone().abs());
    let close = |what: &str, a: Vec<f32>, b: Vec<f32>, s: Vec<f32>, k: usize| {
        for (j, ((a, b), s)) in a.iter().zip(&b).zip(&s).enumerate() {
            let bound = 2.0 * f32_error_bound(k + 2) * (*s as f64) * 1.01;
            assert!(
                ((a - b) as f64).abs() <= bound,
                "{what}[{j}]: {a} vs {b}, bound {bound}"
            );
        }
    };
    close("y", y.as_vec(), want_y.as_vec(), s_y.as_vec(), 8);
    close(
        "dX",
        g.get(&x).as_vec(),
        g_want.get(&x).as_vec(),
        s_dx.as_vec(),
        6,
    );
}

// ---- the direct path: a GradScaler's forward pass on a model of mpx's layers -------------------

/// Loss scale of the direct-path tests: a power of two, so unscaling is exact.
const SCALE: f32 = 1024.0;

/// The f32 master gradient of `sum(layer(x) * c)` through a `GradScaler<f16>` with a static
/// scale: `(dW, db, dX)` of the master.
fn scaler_grads<L>(
    master: &L,
    x: &Tensor<Rank2<B, I>, f32, Cpu>,
    c: &Tensor<Rank2<B, O>, f32, Cpu>,
) -> [Vec<f64>; 3]
where
    L: mpx::step::HalfLayers<f16> + Clone + HasWeightBias,
    L::Working: Module<
            Tensor<Rank2<B, I>, f16, Cpu, OwnedTape<f16, Cpu>>,
            Output = Tensor<Rank2<B, O>, f16, Cpu, OwnedTape<f16, Cpu>>,
        >,
{
    let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(SCALE).unwrap());
    // the layer as a master whose working copy links it to the master's tensors
    let mapped = Mixed::mapped(master.clone());
    // leaky, so that the input's gradient is kept too
    let out = scaler
        .forward(&mapped, x.clone().traced(Gradients::leaky()), |m, x| {
            m.forward(x)
        })
        .unwrap();
    let g = scaler.backward((out * c.clone()).sum()).unwrap();
    let (w, b) = master.weight_bias();
    [vals(&g.get(w)), vals(&g.get(b)), vals(&g.get(x))]
}

/// The weight and bias of a fused layer, whatever its activation.
trait HasWeightBias {
    fn weight_bias(&self) -> (&Tensor<Rank2<O, I>, f32, Cpu>, &Tensor<Rank1<O>, f32, Cpu>);
}
impl<A> HasWeightBias for nn::FusedLinear<I, O, f32, Cpu, A> {
    fn weight_bias(&self) -> (&Tensor<Rank2<O, I>, f32, Cpu>, &Tensor<Rank1<O>, f32, Cpu>) {
        (&self.weight, &self.bias)
    }
}

/// Inside a `GradScaler` forward pass, a fused layer of the working copy writes `dW` and `db` in
/// f32 straight into the master's gradient: they match the exact gradient of the f16 operands
/// to the f32 bound, which a gradient rounded to f16 on the way (the half-gradient path) cannot.
#[test]
fn scaler_writes_the_weight_gradient_in_f32_straight_into_the_master() {
    let dev = Cpu::seed_from_u64(21);
    let dl = dev.build_module::<Linear<I, O>, f32>();
    let x: Tensor<Rank2<B, I>, f32, Cpu> = dev.sample_normal();
    let c: Tensor<Rank2<B, O>, f32, Cpu> = dev.sample_normal();
    // what the half graph sees: f16 parameters and input, and the seed c·scale rounded to f16
    let h = |t: Vec<f32>| -> Vec<f64> { t.iter().map(|v| f16::from_f32(*v).to_f64()).collect() };
    let seed: Vec<f64> = c
        .as_vec()
        .iter()
        .map(|v| f16::from_f32(v * SCALE).to_f64() / f64::from(SCALE))
        .collect();
    let (xh, wh, bh) = (h(x.as_vec()), h(dl.weight.as_vec()), h(dl.bias.as_vec()));
    let mut rounded_would_fail = false;
    for relu in [false, true] {
        let r = reference(&xh, &wh, &bh, &seed, relu);
        for path in KernelPath::supported() {
            with_path(path, || {
                let [dw, db, dx] = if relu {
                    let l: nn::LinearReLU<I, O, f32> = (dl.clone(), ReLU).into();
                    scaler_grads(&l, &x, &c)
                } else {
                    let l: nn::Linear<I, O, f32> = dl.clone().into();
                    scaler_grads(&l, &x, &c)
                };
                let tag = format!("{path:?} relu={relu}");
                // f32 sums only (the f16-sum bound on the AVX512-FP16 path), no f16 rounding
                let f32_bound = |k: usize| {
                    let (rel, abs) = if path == KernelPath::Avx512Fp16 {
                        fp16_error_bound(k + 1)
                    } else {
                        (f32_error_bound(k + 1), 0.0)
                    };
                    move |_e: f64, s: f64| rel * s + abs + 1e-30
                };
                within(&format!("{tag} dW"), &dw, &r.dw, f32_bound(B));
                within(&format!("{tag} db"), &db, &r.db, move |_e: f64, s: f64| {
                    f32_error_bound(B + 1) * s + 1e-30
                });
                // dX leaves the half graph as f16, unscaled afterwards
                within(&format!("{tag} dX"), &dx, &r.dx, f16_bound(path, O));
                if path != KernelPath::Avx512Fp16 {
                    // the same gradient rounded to f16 at the scale would miss that bound
                    let bound = f32_bound(B);
                    rounded_would_fail |= r.dw.iter().any(|&(e, s)| {
                        let scaled = f16::from_f64(e * f64::from(SCALE)).to_f64();
                        (scaled / f64::from(SCALE) - e).abs() > bound(e, s)
                    });
                }
            })
            .unwrap();
        }
    }
    assert!(
        rounded_would_fail,
        "the test must tell f32 from f16-rounded gradients"
    );
}

/// A clone of a linked layer used in the same pass takes the half-gradient path, and the same
/// layer used twice is linked both times: either way the master gets every contribution.
#[test]
fn a_linked_layer_used_twice_or_beside_its_clone_loses_no_gradient() {
    type Sq = nn::Linear<8, 8, f32>;
    let dev = Cpu::seed_from_u64(22);
    let l: Sq = dev.build_module::<Linear<8, 8>, f32>().into();
    let x: Tensor<Rank2<5, 8>, f32, Cpu> = dev.sample_normal();
    let c: Tensor<Rank2<5, 8>, f32, Cpu> = dev.sample_normal();
    // f32 reference: sum(L(L(x)) * c), the layer applied twice
    let want = {
        let y = l.forward(l.forward(x.clone().traced(l.alloc_grads())));
        let g = (y * c.clone()).sum().backward();
        (vals(&g.get(&l.weight)), vals(&g.get(&l.bias)))
    };
    type Fwd = fn(
        &nn::Linear<8, 8, f16>,
        Tensor<Rank2<5, 8>, f16, Cpu, OwnedTape<f16, Cpu>>,
    ) -> Tensor<Rank2<5, 8>, f16, Cpu, OwnedTape<f16, Cpu>>;
    let twice: Fwd = |m, x| m.forward(m.forward(x));
    let beside_clone: Fwd = |m, x| {
        let twin = m.clone();
        twin.forward(m.forward(x))
    };
    for (name, f) in [("twice", twice), ("beside its clone", beside_clone)] {
        let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(SCALE).unwrap());
        let mapped = Mixed::mapped(l.clone());
        let out = scaler
            .forward(&mapped, x.clone().traced(l.alloc_grads()), f)
            .unwrap();
        let g = scaler.backward((out * c.clone()).sum()).unwrap();
        for (what, got, want) in [
            ("dW", vals(&g.get(&l.weight)), &want.0),
            ("db", vals(&g.get(&l.bias)), &want.1),
        ] {
            let size = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (k, (a, b)) in got.iter().zip(want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-2 * size,
                    "{name} {what}[{k}]: {a} vs f32 {b} (largest {size})"
                );
            }
        }
    }
}

/// A loss scale that overflows f16 makes the linked layers' gradients non-finite: the step is
/// skipped, the master stays bit-identical, the scale backs off, and Adam's state is untouched
/// (the next good step equals that of a fresh Adam on the same master, bit for bit).
#[test]
fn an_overflow_in_a_linked_layer_skips_the_step_and_keeps_the_master() {
    type Master = <MpxMlp as BuildOnDevice<Cpu, f32>>::Built;
    fn params(m: &Master) -> Vec<Vec<f32>> {
        vec![
            m.0.weight.as_vec(),
            m.0.bias.as_vec(),
            m.1.weight.as_vec(),
            m.1.bias.as_vec(),
            m.2.weight.as_vec(),
            m.2.bias.as_vec(),
        ]
    }
    let dev = Cpu::seed_from_u64(23);
    let mut master = Mixed::mapped(dev.build_module::<MpxMlp, f32>());
    let mut opt = Adam::new(&*master, AdamConfig::default());
    let x: Tensor<Rank2<8, 16>, f32, Cpu> = dev.sample_normal();
    let y: Tensor<Rank2<8, 4>, f32, Cpu> = dev.sample_normal::<Rank2<8, 4>>().softmax::<Axis<1>>();
    let scaling = DynamicLossScale::builder()
        .initial(2f32.powi(40))
        .build()
        .unwrap();
    let mut scaler = GradScaler::<f16, _>::new(scaling);
    let before = master.clone();
    let out = scaler
        .forward(&master, x.clone().traced(master.alloc_grads()), |m, x| {
            m.forward(x)
        })
        .unwrap();
    let grads = scaler
        .backward(cross_entropy_with_logits_loss(out, y.clone()))
        .unwrap();
    let outcome = scaler.update(&mut master, &mut opt, &grads).unwrap();
    assert!(!outcome.is_applied(), "{outcome:?}");
    assert_eq!(params(&master), params(&before));
    assert_eq!(scaler.loss_scale(), 2f32.powi(39));
    // a scale that fits trains; the skipped step left Adam as a fresh one
    let good_step = |m: &mut Mixed<Master, Mapped>, opt: &mut Adam<Master, f32, Cpu>| {
        let mut scaler = GradScaler::<f16, _>::new(StaticLossScale::new(SCALE).unwrap());
        let out = scaler
            .forward(&*m, x.clone().traced(m.alloc_grads()), |m, x| m.forward(x))
            .unwrap();
        let grads = scaler
            .backward(cross_entropy_with_logits_loss(out, y.clone()))
            .unwrap();
        scaler.update(m, opt, &grads).unwrap().is_applied()
    };
    let mut fresh = before.clone();
    let mut fresh_opt = Adam::new(&*fresh, AdamConfig::default());
    assert!(good_step(&mut master, &mut opt) && good_step(&mut fresh, &mut fresh_opt));
    assert_ne!(params(&master), params(&before));
    assert_eq!(params(&master), params(&fresh));
}

/// In emulated bf16 (`forward_in::<bf16, _>` on f32 tensors) the fused layer multiplies bf16
/// operands, as autocast does (on `vdpbf16ps` where the CPU has it), and rounds its output and
/// its gradients to bf16, as a layer of bf16 storage would. On operands that are bf16 values
/// already, each result is the f32 result (the same layer run in f32, within the f32 bound)
/// rounded once to bf16, so within a bf16 rounding (`2^-8` relative) of it, and holds bf16
/// values only. Operands that are not bf16 values are rounded to bf16 first: the same bits as
/// rounding them beforehand.
#[test]
fn emulated_bf16_rounds_output_and_gradients_to_bf16() {
    use mpx::cast::Cast;
    use mpx::nn::ForwardIn;
    use mpx::precision::bf16;
    let dev = Cpu::seed_from_u64(21);
    let l = dev.build_module::<nn::builders::LinearReLU<I, O>, f32>();
    let x_raw: Tensor<Rank2<B, I>, f32, Cpu> = dev.sample_normal();
    let x = Cast::<bf16>::cast(&x_raw);
    let c: Tensor<Rank2<B, O>, f32, Cpu> = dev.sample_normal();
    let c = Cast::<bf16>::cast(&c);
    let l = Cast::<bf16>::cast(&l);
    let run = |bf: bool, l: &nn::LinearReLU<I, O, f32, Cpu>, x: &Tensor<Rank2<B, I>, f32, Cpu>| {
        let y = if bf {
            l.forward_in::<bf16, _>(x.leaky_trace())
        } else {
            l.forward_in::<f32, _>(x.leaky_trace())
        };
        let out = y.retaped::<NoneTape>().as_vec();
        let g = (y * c.clone()).sum().backward();
        [
            out,
            g.get(x).as_vec(),
            g.get(&l.weight).as_vec(),
            g.get(&l.bias).as_vec(),
        ]
    };
    // an unrounded input: rounded to bf16 by the layer, the same bits
    assert!(
        run(true, &l, &x_raw) == run(true, &l, &x),
        "an unrounded input changes the bf16 run"
    );
    let run = |bf| run(bf, &l, &x);
    let (bf, f) = (run(true), run(false));
    for (i, (a, b)) in bf.iter().zip(&f).enumerate() {
        assert!(
            a.iter().all(|v| v.to_bits() & 0xffff == 0),
            "#{i}: not bf16"
        );
        assert!(b.iter().any(|v| v.to_bits() & 0xffff != 0), "#{i}: f32 is");
        for (a, b) in a.iter().zip(b) {
            // one bf16 rounding of a value within 1e-5 relative of b (f32 sums of 70 terms)
            assert!(
                (a - b).abs() <= b.abs() * (1.0 / 256.0 + 1e-5) + 1e-6,
                "#{i}: {a} vs {b}"
            );
        }
    }
}
