//! Loss scales: [`NoOpLossScale`], [`StaticLossScale`] and [`DynamicLossScale`] (jmp semantics).
//!
//! (Contract written first; the implementations follow in this module.)

/// A loss scale: multiplies the loss before backward, divides the gradients after, and adapts.
pub trait LossScale {
    /// The scale currently applied.
    fn loss_scale(&self) -> f32;
    /// Updates the scale after a step whose gradients were (or were not) all finite.
    fn adjust(&mut self, grads_finite: bool);
}
