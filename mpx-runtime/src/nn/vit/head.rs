//! [`ClassificationHead`]: pool the tokens, normalize in f32, project to class logits.

use crate::nn::Linear;
use dfdx::shapes::{Axis, Const, Dim, HasShape};
use dfdx::tensor::{Cpu, OwnedTape, Tensor};
use dfdx::tensor_ops::{BroadcastTo, MeanTo};

use crate::nn::layer_impls::{build_on_device, composite_layer, mixed_module, native_module};
use crate::nn::{LayerNorm1D, MixedModule};
use crate::region::FullPrecision;

composite_layer! {
    /// A ViT classification head: on a `(B, S, M)` sequence, the mean over its `S` tokens, a
    /// [`LayerNorm1D`] and a `Linear` to `C` logits; on a `(B, M)` input (a class token already
    /// taken out), the layer norm and the `Linear` only.
    ///
    /// The mean and the layer norm run in one f32 region; the `Linear` in the half type.
    ///
    /// # Examples
    /// ```
    /// use dfdx::prelude::*;
    /// use mpx_runtime::nn::vit::ClassificationHead;
    /// let dev = Cpu::default();
    /// let head = dev.build_module::<ClassificationHead<8, 3>, f32>();
    /// let tokens: Tensor<Rank3<2, 5, 8>, f32, Cpu> = dev.sample_normal();
    /// let logits = head.forward(tokens.clone());
    /// // The same as the head on the mean token.
    /// let pooled = head.forward(tokens.mean::<Rank2<2, 8>, _>());
    /// assert_eq!(logits.array(), pooled.array());
    /// ```
    #[derive(Debug, Clone)]
    pub struct ClassificationHead<const M, const C> {
        /// Layer norm of the pooled token.
        pub norm: LayerNorm1D<M, E, D>,
        /// Projection to the class logits.
        pub linear: Linear<M, C, E, D>,
    }
}

build_on_device!(ClassificationHead[const M, const C]);
native_module!(ClassificationHead[const M, const C]);

/// dfdx's `LayerNorm1D` on `(B, M)`, in f32, inside a region.
fn layer_norm_f32<B: Dim, const M: usize>(
    ln: &LayerNorm1D<M, f32, Cpu>,
    eps: f64,
    x: Tensor<(B, Const<M>), f32, Cpu, OwnedTape<f32, Cpu>>,
) -> Tensor<(B, Const<M>), f32, Cpu, OwnedTape<f32, Cpu>> {
    let shape = *x.shape();
    let gamma = ln
        .gamma
        .retaped::<OwnedTape<f32, Cpu>>()
        .broadcast_like(&shape);
    let beta = ln
        .beta
        .retaped::<OwnedTape<f32, Cpu>>()
        .broadcast_like(&shape);
    x.normalize::<Axis<1>>(eps) * gamma + beta
}

mixed_module! {
    ClassificationHead[const M, const C], dims [B, S],
    /// Mean over the tokens, then the head.
    fn(self, x: Tensor<(B, S, Const<M>), E, Cpu, T>) -> Tensor<(B, Const<C>), E, Cpu, T> {
        let eps = self.norm.epsilon;
        let pooled = FullPrecision::<P>::try_run_with(&self.norm, x, |ln, x| {
            layer_norm_f32(ln, eps, x.mean::<(B, Const<M>), Axis<1>>())
        })?;
        MixedModule::<P, _>::try_mixed_forward(&self.linear, pooled)
    }
}

mixed_module! {
    ClassificationHead[const M, const C], dims [B],
    /// One pooled token (a class token) per example: the head without pooling.
    fn(self, x: Tensor<(B, Const<M>), E, Cpu, T>) -> Tensor<(B, Const<C>), E, Cpu, T> {
        let eps = self.norm.epsilon;
        let normed =
            FullPrecision::<P>::try_run_with(&self.norm, x, |ln, x| layer_norm_f32(ln, eps, x))?;
        MixedModule::<P, _>::try_mixed_forward(&self.linear, normed)
    }
}
