//! [`with_avx2`]: safe code compiled a second time for AVX2, chosen at run time.

/// Work that [`with_avx2`] compiles twice: once for the build's baseline, once for AVX2.
///
/// Mark [`run`](Avx2Task::run) `#[inline(always)]`, and the functions it calls too: only code
/// inlined into the AVX2 copy is compiled for AVX2 (a closure would not do: it cannot be marked,
/// and the compiler keeps a large one out of line, compiled for the baseline).
///
/// # Examples
/// ```
/// use mpx_kernels::{Avx2Task, with_avx2};
///
/// struct SumOfSquares<'a>(&'a [f32]);
///
/// impl Avx2Task for SumOfSquares<'_> {
///     type Output = f32;
///     #[inline(always)]
///     fn run(self) -> f32 {
///         self.0.iter().map(|v| v * v).sum()
///     }
/// }
///
/// assert_eq!(with_avx2(SumOfSquares(&[1.0, 2.0, 3.0])), 14.0);
/// ```
pub trait Avx2Task {
    /// What the work returns.
    type Output;

    /// Does the work (mark it `#[inline(always)]`).
    fn run(self) -> Self::Output;
}

/// Runs `task`, compiled for AVX2 where this CPU has it (detected at run time, once), else as
/// compiled for the build's baseline (SSE2 on x86-64). The result is the same either way: the
/// task is safe code, and enabling AVX2 changes which instructions compute it, never what it
/// computes (no FMA contraction: AVX2 does not imply FMA, and Rust never fuses on its own).
/// mpx's MX block codec runs its row loops this way.
///
/// # Examples
/// See [`Avx2Task`].
#[inline]
pub fn with_avx2<T: Avx2Task>(task: T) -> T::Output {
    #[cfg(target_arch = "x86_64")]
    if crate::convert::has_avx2() {
        /// `task`'s AVX2 copy: its `#[inline(always)]` `run` is inlined here.
        #[target_feature(enable = "avx2")]
        fn avx2<T: Avx2Task>(task: T) -> T::Output {
            task.run()
        }
        // SAFETY: the CPU has AVX2, detected just above: the only requirement of a
        // `#[target_feature(enable = "avx2")]` function.
        return unsafe { avx2(task) };
    }
    task.run()
}

#[cfg(test)]
mod tests {
    use super::{Avx2Task, with_avx2};

    struct Mix<'a>(&'a [f32]);

    impl Avx2Task for Mix<'_> {
        type Output = Vec<u32>;
        #[inline(always)]
        fn run(self) -> Vec<u32> {
            self.0
                .iter()
                .map(|v| (v * 1.5 + 0.25).sqrt().to_bits() ^ v.to_bits().rotate_left(7))
                .collect()
        }
    }

    #[test]
    fn both_copies_compute_the_same_bits() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        assert_eq!(with_avx2(Mix(&x)), Mix(&x).run());
    }
}
