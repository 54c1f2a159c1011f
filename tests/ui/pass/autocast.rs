// Every accepted form of `#[autocast]`, run once in f16.
use dfdx::prelude::*;
use mpx::autocast;
use mpx::precision::{Precision, f16};

type Row<E, T = NoneTape> = Tensor<Rank2<2, 4>, E, Cpu, T>;

// A free function generic over the half type: a chain of operations is one region with its
// scalar argument; the iterator `sum` is left alone.
#[autocast]
fn probs<H: Precision, T: Tape<H::Elem, Cpu>>(x: Row<H::Elem, T>, scale: &[f32]) -> Row<H::Elem, T> {
    let k: f32 = scale.iter().sum();
    x.normalize::<Axis<1>>(1e-5 * k).softmax::<Axis<1>>()
}

// A loss with its target and a scalar, a concrete half type, the facade's path, and `skip`.
#[autocast(half = f16, crate = "::mpx", skip = mean)]
fn loss(pred: Row<f16, OwnedTape<f16, Cpu>>, y: Row<f16>, delta: f64) -> Tensor<Rank0, f16, Cpu, OwnedTape<f16, Cpu>> {
    let l = huber_loss(pred.exp(), y.clone(), delta);
    l + y.mean::<Rank0, _>() // `mean` skipped: it runs in f16
}

// An `impl Module` method: `H` belongs to the impl, `try_` forms and their `?`.
struct Norm<H>(std::marker::PhantomData<H>);

impl<H: Precision, T: Tape<H::Elem, Cpu>> Module<Row<H::Elem, T>> for Norm<H> {
    type Output = Row<H::Elem, T>;
    type Error = CpuError;

    #[autocast(half = H)]
    fn try_forward(&self, x: Row<H::Elem, T>) -> Result<Self::Output, CpuError> {
        let y = x.try_exp()?.try_normalize::<Axis<1>>(1e-5)?;
        Ok(y)
    }
}

fn main() {
    let dev = Cpu::default();
    let x: Row<f16> = dev.tensor([[30000.0f32, 30000.0, 30000.0, 1.0], [1.0, 2.0, 3.0, 4.0]]).to_dtype::<f16>();
    let p = probs::<f16, _>(x.leaky_trace(), &[0.5, 0.5]);
    assert!(p.as_vec().iter().all(|v| v.is_finite()));
    let l = loss(p, x.clone() / f16::from_f32(65504.0), 1.0);
    let g = l.backward();
    assert!(g.get(&x).as_vec().iter().all(|v| v.is_finite()));
    let n = Norm::<f16>(Default::default()).forward(x.clone() / f16::from_f32(3000.0));
    assert!(n.as_vec().iter().all(|v| v.is_finite()));
}
