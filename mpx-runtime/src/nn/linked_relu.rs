//! [`LinkedReLU`]: the `ReLU` after a `Linear` in the mixed step's working copy, applied by the
//! fused linear layer before it.

use dfdx::nn::{Module, NonMutableModule, ZeroSizedModule};
use dfdx::shapes::{Dtype, Shape};
use dfdx::tensor::{Tape, Tensor};
use dfdx::tensor_ops::Device;

/// dfdx's `ReLU` as it stands in a mapped working copy
/// ([`HalfLayers`](crate::step::HalfLayers)): where it follows a `Linear` in a tuple, the fused
/// layer before it applies the `ReLU` in its own pass (its forward epilogue and its backward
/// mask), and this layer passes its input through; anywhere else it is dfdx's `ReLU`.
///
/// A model run as a whole (`model.forward(x)`) computes the same either way. A step that calls
/// the working copy's layers one by one and reads the `Linear`'s output without its `ReLU`
/// would see the `ReLU` applied: run such a tuple as a whole.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::nn::LinkedReLU;
/// let dev = Cpu::default();
/// let x = dev.tensor([-1.0f32, 2.0]);
/// assert_eq!(LinkedReLU::default().forward(x.clone()).array(), [0.0, 2.0]);
/// assert_eq!(LinkedReLU::applied_before().forward(x).array(), [-1.0, 2.0]);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkedReLU {
    applied: bool,
}

impl LinkedReLU {
    /// A `ReLU` that the layer before it applies: this one passes its input through.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::nn::LinkedReLU;
    /// assert!(LinkedReLU::applied_before().is_applied_before());
    /// assert!(!LinkedReLU::default().is_applied_before());
    /// ```
    pub fn applied_before() -> Self {
        Self { applied: true }
    }

    /// Whether the layer before applies this `ReLU`.
    ///
    /// # Examples
    /// See [`LinkedReLU::applied_before`].
    pub fn is_applied_before(&self) -> bool {
        self.applied
    }
}

impl ZeroSizedModule for LinkedReLU {}
impl NonMutableModule for LinkedReLU {}

impl<S: Shape, E: Dtype, D: Device<E>, T: Tape<E, D>> Module<Tensor<S, E, D, T>> for LinkedReLU {
    type Output = Tensor<S, E, D, T>;
    type Error = D::Err;
    fn try_forward(&self, x: Tensor<S, E, D, T>) -> Result<Self::Output, D::Err> {
        if self.applied { Ok(x) } else { x.try_relu() }
    }
}
