//! [`InBf16`]: an `mpx::nn` layer of f32 elements that runs in emulated bf16.

use std::ops::{Deref, DerefMut};

use dfdx::nn::tensor_collection::{ModuleVisitor, TensorCollection};
use dfdx::nn::{Module, NonMutableModule};
use dfdx::shapes::Dtype;
use dfdx::tensor::CpuError;
use dfdx::tensor_ops::Device;

use super::mixed::MixedModule;
use crate::precision::bf16;

/// An `mpx::nn` layer of f32 elements (`L`) whose `Module` calls run in emulated bf16: its
/// products multiply bf16 operands (on `vdpbf16ps` where the CPU has AVX512-BF16), its outputs
/// and gradients are rounded to bf16. Emulated bf16 stores f32, so the element type cannot say
/// so: the type does. A mixed step in emulated bf16 builds its working copy of mpx's layers from
/// these ([`HalfLayers`](crate::step::HalfLayers)).
///
/// It dereferences to the layer (`wrapped.weight`, `wrapped.self_attn`); a sublayer called
/// through it on its own runs in f32, as any layer of f32 elements does. A cast of it (an f32
/// region's copy of its parameters) keeps the wrapper.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::{self, InBf16};
/// let dev = Cpu::default();
/// let layer = InBf16(dev.build_module::<nn::builders::Linear<2, 1>, f32>());
/// let y = layer.forward(dev.tensor([[1.0f32 / 3.0, 1.0]]));
/// // the output is a bf16 value, stored in f32
/// let v = y.array()[0][0];
/// assert_eq!(v, half::bf16::from_f32(v).to_f32());
/// ```
#[derive(Debug, Clone, Default)]
pub struct InBf16<L>(pub L);

impl<L> Deref for InBf16<L> {
    type Target = L;
    fn deref(&self) -> &L {
        &self.0
    }
}

impl<L> DerefMut for InBf16<L> {
    fn deref_mut(&mut self) -> &mut L {
        &mut self.0
    }
}

impl<L: TensorCollection<f32, D>, D: Device<f32>> TensorCollection<f32, D> for InBf16<L> {
    type To<E2: Dtype, D2: Device<E2>> = InBf16<L::To<E2, D2>>;

    fn iter_tensors<V: ModuleVisitor<Self, f32, D>>(
        visitor: &mut V,
    ) -> Result<Option<Self::To<V::E2, V::D2>>, V::Err> {
        visitor.visit_fields(Self::module("0", |s| &s.0, |s| &mut s.0), InBf16)
    }
}

impl<L: MixedModule<bf16, X>, X> Module<X> for InBf16<L> {
    type Output = L::Output;
    type Error = CpuError;
    fn try_forward(&self, x: X) -> Result<Self::Output, CpuError> {
        self.0.try_mixed_forward(x)
    }
}

impl<L> NonMutableModule for InBf16<L> {}
