//! `a.matmul(b)` of two f16 matrices, as a `#[half_forward]` working copy runs it: on mpx's GEMM,
//! the sums in f32 and rounded once to f16 (as mpx's `Linear` computes `x·Wᵀ`), where dfdx's f16
//! matmul ran on dfdx's scalar f16 path. The gradients likewise: `dA += dY·Bᵀ` and
//! `dB += Aᵀ·dY`, each summed in f32 and rounded once into the gradient entry.

use dfdx::shapes::{Dim, HasShape};
use dfdx::tensor::{Cpu, CpuError, Merge, PutTape, Tape, Tensor, TensorFromVec};
use half::f16;
use mpx_kernels::{MatRef, gemm};

use super::binary::{Operands, contiguous_pair};
use super::half_ops::{accumulate, grad_slice, read, shape_err};
use super::scratch;
use crate::precision::Precision;

/// `v` as a row-major `r x c` matrix.
fn mat(v: &[f16], r: usize, c: usize) -> Result<MatRef<'_>, CpuError> {
    MatRef::row_major_f16(v, r, c).map_err(shape_err)
}

/// `a · b` for `a` of `m x k` and `b` of `k x n` f16 values (see the [module docs](self)).
fn matmul<M: Dim, K: Dim, N: Dim, LT, RT>(
    a: Tensor<(M, K), f16, Cpu, LT>,
    b: Tensor<(K, N), f16, Cpu, RT>,
) -> Result<Tensor<(M, N), f16, Cpu, LT>, CpuError>
where
    LT: Tape<f16, Cpu> + Merge<RT>,
    RT: Tape<f16, Cpu>,
{
    let (a, b, mut tape) = contiguous_pair(a, b)?;
    let (m, k) = (a.shape().0.size(), a.shape().1.size());
    let n = b.shape().1.size();
    if b.shape().0.size() != k {
        return Err(CpuError::WrongNumElements);
    }
    let (av, bv) = (read(&a), read(&b));
    let mut sums = scratch::take::<f32>(m * n);
    gemm(mat(&av, m, k)?, mat(&bv, k, n)?, &mut sums, false).map_err(shape_err)?;
    let mut y = vec![f16::ZERO; m * n];
    f16::round(&sums, &mut y);
    drop(sums);
    let y = a
        .device()
        .try_tensor_from_vec(y, (a.shape().0, b.shape().1))?;
    if LT::OWNS_TAPE {
        let (a_id, b_id, y_id) = (a.ghost(), b.ghost(), y.ghost());
        drop((a, b));
        tape.add_backward_op(move |grads| {
            // copied: the operands' entries are written while it is read
            let mut dy = scratch::take::<f16>(m * n);
            dy.copy_from_slice(grad_slice::<f16>(grads.get_or_alloc_mut(&y_id)?));
            let mut sums = scratch::take::<f32>(m * k);
            // dA = dY · Bᵀ
            gemm(mat(&dy, m, n)?, mat(&bv, k, n)?.t(), &mut sums, false).map_err(shape_err)?;
            accumulate::<f16>(grad_slice::<f16>(grads.get_or_alloc_mut(&a_id)?), &sums)?;
            // dB = Aᵀ · dY
            let mut sums = scratch::take::<f32>(k * n);
            gemm(mat(&av, m, k)?.t(), mat(&dy, m, n)?, &mut sums, false).map_err(shape_err)?;
            accumulate::<f16>(grad_slice::<f16>(grads.get_or_alloc_mut(&b_id)?), &sums)
        });
    }
    Ok(y.put_tape(tape))
}

/// `matmul` / `try_matmul` of two f16 matrices (picked first: `(&operands).matmul_op()` is
/// `Some`; any other operands take [`AsWritten`](super::binary::AsWritten)'s `None`).
#[doc(hidden)]
pub trait HalfMatMul {
    /// The product.
    type Output;
    /// `a.matmul(b)`.
    fn matmul_op(&self) -> Option<Self::Output>;
    /// `a.try_matmul(b)`.
    fn try_matmul_op(&self) -> Option<Result<Self::Output, CpuError>>;
}

impl<M: Dim, K: Dim, N: Dim, LT, RT> HalfMatMul
    for Operands<Tensor<(M, K), f16, Cpu, LT>, Tensor<(K, N), f16, Cpu, RT>>
where
    LT: Tape<f16, Cpu> + Merge<RT>,
    RT: Tape<f16, Cpu>,
{
    type Output = Tensor<(M, N), f16, Cpu, LT>;
    fn matmul_op(&self) -> Option<Self::Output> {
        self.try_matmul_op().map(Result::unwrap)
    }
    fn try_matmul_op(&self) -> Option<Result<Self::Output, CpuError>> {
        let (a, b) = self.take();
        Some(matmul(a, b))
    }
}

#[cfg(test)]
mod tests {
    use dfdx::prelude::*;
    use half::f16;

    use super::{HalfMatMul as _, Operands};
    use crate::nn::binary::AsWritten as _;

    /// Against the f64 product of the same f16 values: the output within one f16 rounding, the
    /// gradients within one rounding of their f64 values; the untaped and other-typed operands
    /// take dfdx's matmul.
    #[test]
    #[allow(
        clippy::needless_borrow,
        reason = "the dispatch is by autoref: `(&operands)`, as the generated code writes it"
    )]
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
}
