//! `a.matmul(b)` of two f16 matrices, or batches of them in dfdx's shapes (`(B, M, K)` by
//! `(K, N)` or `(B, K, N)`, `(B, S, M, K)` by `(B, S, K, N)`), as a `#[half_forward]` working copy
//! runs it: on mpx's GEMM, the sums in f32 and rounded once to f16 (as mpx's `Linear` computes
//! `x·Wᵀ`), where dfdx's f16 matmul ran on dfdx's scalar f16 path. The gradients likewise:
//! `dA += dY·Bᵀ` and `dB += Aᵀ·dY`, each summed in f32 and rounded once into the gradient entry
//! (a view's, such as a transposed weight's, summed per buffer element first).

use dfdx::shapes::{Dim, HasShape, Shape};
use dfdx::tensor::{Cpu, CpuError, Merge, PutTape, Tape, Tensor, TensorFromVec};
use half::f16;
use mpx_kernels::{MatRef, gemm};

use super::binary::{Operands, operands};
use super::contiguous::{add_grad, values};
use super::half_ops::{grad_slice, shape_err};
use super::scratch;
use crate::precision::Precision;

/// `v` as a row-major `r x c` matrix.
fn mat(v: &[f16], r: usize, c: usize) -> Result<MatRef<'_>, CpuError> {
    MatRef::row_major_f16(v, r, c).map_err(shape_err)
}

/// The sizes of a (batched) product: `batch` products of an `m x k` matrix of `a` by a `k x n`
/// one of `b`, each matrix contiguous after the last. A `b` shared by a batch of `a`s is one
/// product of the stacked rows (`batch` 1, `m` the rows of all of them).
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
}

/// `a · b` of f16 values in `dims`' products, with the output's shape `out` (see the [module
/// docs](self)).
fn matmul<SA: Shape, SB: Shape, SY: Shape, LT, RT>(
    a: Tensor<SA, f16, Cpu, LT>,
    b: Tensor<SB, f16, Cpu, RT>,
    dims: Dims,
    out: SY,
) -> Result<Tensor<SY, f16, Cpu, LT>, CpuError>
where
    LT: Tape<f16, Cpu> + Merge<RT>,
    RT: Tape<f16, Cpu>,
{
    let Dims { batch, m, k, n } = dims;
    // a view (a transposed weight, `k.permute()`) is gathered, not copied into a tensor first
    let ((a, va), (b, vb), mut tape) = operands(a, b)?;
    let (av, bv) = (values(&a, va.as_ref())?, values(&b, vb.as_ref())?);
    let (a_at, b_at, y_at) = (
        move |i: usize| i * m * k,
        move |i: usize| i * k * n,
        move |i: usize| i * m * n,
    );
    let mut sums = scratch::take::<f32>(batch * m * n);
    for i in 0..batch {
        let (x, w) = (mat(&av[a_at(i)..], m, k)?, mat(&bv[b_at(i)..], k, n)?);
        gemm(x, w, &mut sums[y_at(i)..y_at(i + 1)], false).map_err(shape_err)?;
    }
    let mut y = vec![f16::ZERO; batch * m * n];
    f16::round(&sums, &mut y);
    drop(sums);
    let y = a.device().try_tensor_from_vec(y, out)?;
    if LT::OWNS_TAPE {
        let (a_id, b_id, y_id) = (a.ghost(), b.ghost(), y.ghost());
        drop((a, b));
        tape.add_backward_op(move |grads| {
            // copied: the operands' entries are written while it is read
            let dy = scratch::copy_of(grad_slice::<f16>(grads.get_or_alloc_mut(&y_id)?));
            // dA = dY · Bᵀ
            let mut sums = scratch::take::<f32>(batch * m * k);
            for i in 0..batch {
                let (g, w) = (mat(&dy[y_at(i)..], m, n)?, mat(&bv[b_at(i)..], k, n)?.t());
                gemm(g, w, &mut sums[a_at(i)..a_at(i + 1)], false).map_err(shape_err)?;
            }
            add_grad::<f16, _>(
                grad_slice::<f16>(grads.get_or_alloc_mut(&a_id)?),
                va.as_ref(),
                &sums,
            )?;
            // dB = Aᵀ · dY
            let mut sums = scratch::take::<f32>(batch * k * n);
            for i in 0..batch {
                let (x, g) = (mat(&av[a_at(i)..], m, k)?.t(), mat(&dy[y_at(i)..], m, n)?);
                gemm(x, g, &mut sums[b_at(i)..b_at(i + 1)], false).map_err(shape_err)?;
            }
            add_grad::<f16, _>(
                grad_slice::<f16>(grads.get_or_alloc_mut(&b_id)?),
                vb.as_ref(),
                &sums,
            )
        });
    }
    Ok(y.put_tape(tape))
}

/// `matmul` / `try_matmul` of f16 tensors in dfdx's matrix shapes (picked first:
/// `(&operands).matmul_op()` is `Some`; any other operands take
/// [`AsWritten`](super::binary::AsWritten)'s `None`).
#[doc(hidden)]
pub trait HalfMatMul {
    /// The product.
    type Output;
    /// `a.matmul(b)`.
    fn matmul_op(&self) -> Option<Self::Output>;
    /// `a.try_matmul(b)`.
    fn try_matmul_op(&self) -> Option<Result<Self::Output, CpuError>>;
}

impl<SA, SB, LT, RT> HalfMatMul for Operands<Tensor<SA, f16, Cpu, LT>, Tensor<SB, f16, Cpu, RT>>
where
    SA: Products<SB>,
    SB: Shape,
    LT: Tape<f16, Cpu> + Merge<RT>,
    RT: Tape<f16, Cpu>,
{
    type Output = Tensor<SA::Out, f16, Cpu, LT>;
    fn matmul_op(&self) -> Option<Self::Output> {
        self.try_matmul_op().map(Result::unwrap)
    }
    fn try_matmul_op(&self) -> Option<Result<Self::Output, CpuError>> {
        let (a, b) = self.take();
        let (dims, agree, out) = a.shape().products(b.shape());
        if !agree {
            return Some(Err(CpuError::WrongNumElements));
        }
        Some(matmul(a, b, dims, out))
    }
}

/// A pair of shapes dfdx multiplies as matrices (`Self` by `SB`): the products, whether the
/// sizes agree (dfdx asserts that they do), and the output's shape.
#[doc(hidden)]
pub trait Products<SB>: Shape {
    /// The output's shape.
    type Out: Shape;
    /// See the [trait docs](Products).
    fn products(&self, b: &SB) -> (Dims, bool, Self::Out);
}

impl<M: Dim, K: Dim, N: Dim> Products<(K, N)> for (M, K) {
    type Out = (M, N);
    fn products(&self, b: &(K, N)) -> (Dims, bool, (M, N)) {
        let (m, k, n) = (self.0.size(), self.1.size(), b.1.size());
        (Dims { batch: 1, m, k, n }, b.0.size() == k, (self.0, b.1))
    }
}

/// A `b` shared by the batch: one product of the stacked rows.
impl<B: Dim, M: Dim, K: Dim, N: Dim> Products<(K, N)> for (B, M, K) {
    type Out = (B, M, N);
    fn products(&self, b: &(K, N)) -> (Dims, bool, (B, M, N)) {
        let (m, k, n) = (self.0.size() * self.1.size(), self.2.size(), b.1.size());
        (
            Dims { batch: 1, m, k, n },
            b.0.size() == k,
            (self.0, self.1, b.1),
        )
    }
}

impl<B: Dim, M: Dim, K: Dim, N: Dim> Products<(B, K, N)> for (B, M, K) {
    type Out = (B, M, N);
    fn products(&self, b: &(B, K, N)) -> (Dims, bool, (B, M, N)) {
        let (batch, m, k, n) = (self.0.size(), self.1.size(), self.2.size(), b.2.size());
        let agree = b.0.size() == batch && b.1.size() == k;
        (Dims { batch, m, k, n }, agree, (self.0, self.1, b.2))
    }
}

impl<B: Dim, S: Dim, M: Dim, K: Dim, N: Dim> Products<(B, S, K, N)> for (B, S, M, K) {
    type Out = (B, S, M, N);
    fn products(&self, b: &(B, S, K, N)) -> (Dims, bool, (B, S, M, N)) {
        let batch = self.0.size() * self.1.size();
        let (m, k, n) = (self.2.size(), self.3.size(), b.3.size());
        let agree = b.0.size() == self.0.size() && b.1.size() == self.1.size() && b.2.size() == k;
        (
            Dims { batch, m, k, n },
            agree,
            (self.0, self.1, self.2, b.3),
        )
    }
}

#[cfg(test)]
#[allow(
    clippy::needless_borrow,
    reason = "the dispatch is by autoref: `(&operands)`, as the generated code writes it"
)]
mod tests {
    use dfdx::prelude::*;
    use half::f16;

    use super::{HalfMatMul as _, Operands};
    use crate::nn::binary::AsWritten as _;

    /// Against the f64 product of the same f16 values: the output within one f16 rounding, the
    /// gradients within one rounding of their f64 values; the untaped and other-typed operands
    /// take dfdx's matmul.
    #[test]
    fn the_product_and_its_gradients_match_an_f64_reference() {
        let dev = Cpu::seed_from_u64(5);
        let a32: Tensor<Rank2<7, 13>, f32, Cpu> = dev.sample_normal();
        let b32: Tensor<Rank2<13, 5>, f32, Cpu> = dev.sample_normal();
        let w32: Tensor<Rank2<7, 5>, f32, Cpu> = dev.sample_normal();
        let (a, b, w) = (
            a32.clone().to_dtype::<f16>(),
            b32.clone().to_dtype::<f16>(),
            w32.to_dtype::<f16>(),
        );
        let y = (&Operands::new(a.leaky_trace(), b.clone()))
            .try_matmul_op()
            .expect("two f16 matrices take mpx's product")
            .unwrap();
        let (av, bv, wv) = (a.array(), b.array(), w.array());
        let f = |v: f16| f64::from(v.to_f32());
        let close = |got: f16, want: f64, what: &str| {
            let tol = want.abs() * 2f64.powi(-10) + 1e-6;
            assert!((f(got) - want).abs() <= tol, "{what}: {got} against {want}");
        };
        let yv = y.retaped::<NoneTape>().array();
        for i in 0..7 {
            for j in 0..5 {
                let want: f64 = (0..13).map(|p| f(av[i][p]) * f(bv[p][j])).sum();
                close(yv[i][j], want, "y");
            }
        }
        // a gradient `w` into the output: dA = w · Bᵀ, dB = Aᵀ · w
        let g = (y * w.clone()).sum().backward();
        let da = g.get(&a).array();
        for i in 0..7 {
            for p in 0..13 {
                let want: f64 = (0..5).map(|j| f(wv[i][j]) * f(bv[p][j])).sum();
                close(da[i][p], want, "dA");
            }
        }
        // both traced: dB = Aᵀ · w
        let y = (&Operands::new(a.leaky_trace(), b.leaky_trace()))
            .matmul_op()
            .expect("two f16 matrices take mpx's product");
        let g = (y * w.clone()).sum().backward();
        let db = g.get(&b).array();
        for p in 0..13 {
            for j in 0..5 {
                let want: f64 = (0..7).map(|i| f(av[i][p]) * f(wv[i][j])).sum();
                close(db[p][j], want, "dB");
            }
        }
        // f32 operands: `None`, for dfdx's matmul as written
        let ops = Operands::new(a32, b32);
        assert!((&ops).matmul_op::<()>().is_none());
    }

    /// `y`, `dA` and `dB` of `sum(y * w)` for `batch` products `m x k` by `k x n`, in f64 from the
    /// f16 values (flattened); `shared`: one `b` for every product, its gradient summed over them.
    fn reference(
        (a, b, w): (&[f16], &[f16], &[f16]),
        (batch, m, k, n): (usize, usize, usize, usize),
        shared: bool,
    ) -> [Vec<f64>; 3] {
        let f = |v: f16| f64::from(v.to_f32());
        let (mut y, mut da) = (vec![0.0; batch * m * n], vec![0.0; batch * m * k]);
        let mut db = vec![0.0; if shared { k * n } else { batch * k * n }];
        for t in 0..batch {
            let bt = if shared { 0 } else { t };
            for i in 0..m {
                for p in 0..k {
                    for j in 0..n {
                        let (ai, bi, yi) = (
                            (t * m + i) * k + p,
                            (bt * k + p) * n + j,
                            (t * m + i) * n + j,
                        );
                        y[yi] += f(a[ai]) * f(b[bi]);
                        da[ai] += f(w[yi]) * f(b[bi]);
                        db[bi] += f(a[ai]) * f(w[yi]);
                    }
                }
            }
        }
        [y, da, db]
    }

    /// mpx's product of `a` and `b` (both traced) and its gradients under `w`, against
    /// [`reference`]: each within one f16 rounding of its f64 value.
    fn check<SA, SB, SY>(
        a: &Tensor<SA, f16, Cpu>,
        b: &Tensor<SB, f16, Cpu>,
        w: &Tensor<SY, f16, Cpu>,
        dims: (usize, usize, usize, usize),
        shared: bool,
    ) where
        SA: super::Products<SB, Out = SY>,
        SB: Shape,
        SY: Shape,
    {
        let y = (&Operands::new(a.leaky_trace(), b.leaky_trace()))
            .try_matmul_op()
            .expect("f16 operands take mpx's product")
            .unwrap();
        let yv = y.retaped::<NoneTape>().as_vec();
        let g = (y * w.clone()).sum().backward();
        let got = [yv, g.get(a).as_vec(), g.get(b).as_vec()];
        let want = reference((&a.as_vec(), &b.as_vec(), &w.as_vec()), dims, shared);
        for ((got, want), what) in got.iter().zip(&want).zip(["y", "dA", "dB"]) {
            close(got, want, what);
        }
    }

    /// `got` within one f16 rounding of the f64 values `want`, element by element.
    fn close(got: &[f16], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (g, w) in got.iter().zip(want) {
            let tol = w.abs() * 2f64.powi(-10) + 1e-6;
            assert!(
                (f64::from(g.to_f32()) - w).abs() <= tol,
                "{what}: {g} against {w}"
            );
        }
    }

    /// Views as operands, read where they lie: a transposed weight (`x·Wᵀ` by hand, `W` untraced)
    /// and a matrix broadcast over a batch; each buffer element's gradient is the f32 sum of
    /// what its uses get, rounded once (within one f16 rounding of the f64 sum).
    #[test]
    fn view_operands_get_their_gradients_summed_per_buffer_element() {
        let dev = Cpu::seed_from_u64(11);
        // `a · wtᵀ`, the weight stored as `5 x 13`
        let a: Tensor<Rank2<7, 13>, f16, Cpu> = dev.sample_normal();
        let wt: Tensor<Rank2<5, 13>, f16, Cpu> = dev.sample_normal();
        let w: Tensor<Rank2<7, 5>, f16, Cpu> = dev.sample_normal();
        let view = wt.clone().permute::<Rank2<13, 5>, Axes2<1, 0>>();
        let logical = view.as_vec();
        let y = (&Operands::new(a.leaky_trace(), view))
            .try_matmul_op()
            .expect("f16 operands take mpx's product")
            .unwrap();
        let yv = y.retaped::<NoneTape>().as_vec();
        let g = (y * w.clone()).sum().backward();
        let [want_y, want_da, want_db] =
            reference((&a.as_vec(), &logical, &w.as_vec()), (1, 7, 13, 5), false);
        close(&yv, &want_y, "y");
        close(&g.get(&a).as_vec(), &want_da, "dA");
        // the weight's buffer is `5 x 13`: element (j, p) is the view's (p, j)
        let want_dwt: Vec<f64> = (0..5 * 13)
            .map(|e| want_db[(e % 13) * 5 + e / 13])
            .collect();
        close(&g.get(&wt).as_vec(), &want_dwt, "dWᵀ");
        // one `5 x 6` matrix broadcast over a batch of 3: its gradient the sum over the batch
        let a: Tensor<Rank3<3, 4, 5>, f16, Cpu> = dev.sample_normal();
        let b: Tensor<Rank2<5, 6>, f16, Cpu> = dev.sample_normal();
        let w: Tensor<Rank3<3, 4, 6>, f16, Cpu> = dev.sample_normal();
        let y = (&Operands::new(
            a.leaky_trace(),
            b.leaky_trace().broadcast::<Rank3<3, 5, 6>, Axis<0>>(),
        ))
            .try_matmul_op()
            .expect("f16 operands take mpx's product")
            .unwrap();
        let g = (y * w.clone()).sum().backward();
        let [_, want_da, want_db] =
            reference((&a.as_vec(), &b.as_vec(), &w.as_vec()), (3, 4, 5, 6), true);
        close(&g.get(&a).as_vec(), &want_da, "batched dA");
        close(&g.get(&b).as_vec(), &want_db, "broadcast dB");
    }

    /// The batched shapes dfdx multiplies: `(B, M, K)` by a shared `(K, N)` and by `(B, K, N)`,
    /// `(B, S, M, K)` by `(B, S, K, N)`; batches whose sizes disagree are errors, as dfdx's
    /// asserts are.
    #[test]
    fn batched_products_and_their_gradients_match_an_f64_reference() {
        let dev = Cpu::seed_from_u64(9);
        let a: Tensor<Rank3<3, 4, 5>, f16, Cpu> = dev.sample_normal();
        let w: Tensor<Rank3<3, 4, 6>, f16, Cpu> = dev.sample_normal();
        let b: Tensor<Rank2<5, 6>, f16, Cpu> = dev.sample_normal();
        check(&a, &b, &w, (3, 4, 5, 6), true);
        let b: Tensor<Rank3<3, 5, 6>, f16, Cpu> = dev.sample_normal();
        check(&a, &b, &w, (3, 4, 5, 6), false);
        let a: Tensor<Rank4<2, 3, 4, 5>, f16, Cpu> = dev.sample_normal();
        let b: Tensor<Rank4<2, 3, 5, 6>, f16, Cpu> = dev.sample_normal();
        let w: Tensor<Rank4<2, 3, 4, 6>, f16, Cpu> = dev.sample_normal();
        check(&a, &b, &w, (6, 4, 5, 6), false);
        // run-time batches that disagree
        let a: Tensor<(usize, Const<2>, Const<3>), f16, Cpu> =
            dev.sample_normal_like(&(2, Const, Const));
        let b: Tensor<(usize, Const<3>, Const<2>), f16, Cpu> =
            dev.sample_normal_like(&(3, Const, Const));
        let r = (&Operands::new(a.leaky_trace(), b))
            .try_matmul_op()
            .unwrap();
        assert!(r.is_err());
    }
}
