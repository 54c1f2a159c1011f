//! The [`GradScaler`] methods that attach a [`Reducer`].

use super::GradScaler;
use crate::distributed::Reducer;
use crate::precision::Precision;
use crate::scaling::LossScale;

impl<H: Precision, L: LossScale> GradScaler<H, L>
where
    dfdx::tensor::Cpu: super::MixedDevice<H>,
{
    /// Makes this scaler data-parallel: the backward pass of the last micro-batch all-reduces
    /// the master's gradients over `reducer`'s ranks (their mean comes back), and every rank
    /// takes the same skip-or-apply decision ([`crate::distributed`]). `#[mixed_step]` code is
    /// unchanged. A skip another rank caused is reported as
    /// [`SkipReason::GradsNotFinite`](crate::step::SkipReason::GradsNotFinite).
    ///
    /// # Examples
    /// ```no_run
    /// use mpx_runtime::distributed::{Reducer, mpi};
    /// use mpx_runtime::{precision::f16, step::GradScaler};
    /// let universe = mpi::initialize().unwrap();
    /// let scaler = GradScaler::<f16>::default().with_reducer(Reducer::new(&universe.world()));
    /// assert_eq!(scaler.reducer().map(|r| r.accumulation()), Some(1));
    /// ```
    #[must_use]
    pub fn with_reducer(mut self, reducer: Reducer) -> Self {
        self.reducer = Some(reducer);
        self
    }

    /// The reducer set with [`with_reducer`](Self::with_reducer).
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::{precision::f16, step::GradScaler};
    /// assert!(GradScaler::<f16>::default().reducer().is_none());
    /// ```
    pub fn reducer(&self) -> Option<&Reducer> {
        self.reducer.as_ref()
    }

    /// The reducer, mutably (for its collectives: [`Reducer::models_agree`], …).
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::{precision::f16, step::GradScaler};
    /// assert!(GradScaler::<f16>::default().reducer_mut().is_none());
    /// ```
    pub fn reducer_mut(&mut self) -> Option<&mut Reducer> {
        self.reducer.as_mut()
    }
}
