//! [`KernelPath`]: which instructions the kernels use, detected once and overridable per thread.

use std::cell::Cell;
use std::sync::OnceLock;

use super::KernelError;

/// The instruction set a kernel runs on. See the [module docs](super) for what each does with
/// f32, f16 and bf16 operands.
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::KernelPath;
/// for path in KernelPath::ALL {
///     println!("{path:?}: {}", if path.is_supported() { "supported" } else { "not on this CPU" });
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelPath {
    /// AVX-512 F with AVX512-FP16: f16 operands are multiplied and summed in f16.
    Avx512Fp16,
    /// AVX-512 F, BW and VL with AVX512-BF16: bf16 operands are multiplied in pairs and summed in
    /// f32 (`vdpbf16ps`); f32 and f16 operands as on [`KernelPath::Avx512`].
    Avx512Bf16,
    /// AVX-512 F: f32 FMA on 16 lanes.
    Avx512,
    /// AVX2 with FMA: f32 FMA on 8 lanes.
    Avx2Fma,
    /// Plain Rust, any CPU.
    Portable,
}

impl KernelPath {
    /// Every path, fastest first.
    pub const ALL: [KernelPath; 5] = [
        KernelPath::Avx512Fp16,
        KernelPath::Avx512Bf16,
        KernelPath::Avx512,
        KernelPath::Avx2Fma,
        KernelPath::Portable,
    ];

    /// Whether this CPU has the instructions of the path.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::kernels::KernelPath;
    /// assert!(KernelPath::Portable.is_supported());
    /// ```
    pub fn is_supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                KernelPath::Avx512Fp16 => {
                    is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512fp16")
                }
                KernelPath::Avx512Bf16 => {
                    is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512bf16")
                }
                KernelPath::Avx512 => is_x86_feature_detected!("avx512f"),
                KernelPath::Avx2Fma => {
                    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
                }
                KernelPath::Portable => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == KernelPath::Portable
        }
    }

    /// The paths this CPU supports, fastest first.
    ///
    /// # Examples
    /// ```
    /// use mpx_runtime::kernels::KernelPath;
    /// assert_eq!(KernelPath::supported().last(), Some(&KernelPath::Portable));
    /// ```
    pub fn supported() -> Vec<KernelPath> {
        KernelPath::ALL
            .into_iter()
            .filter(|p| p.is_supported())
            .collect()
    }
}

/// The best path this CPU supports, detected on the first call and cached.
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::detected_path;
/// assert!(detected_path().is_supported());
/// ```
pub fn detected_path() -> KernelPath {
    static DETECTED: OnceLock<KernelPath> = OnceLock::new();
    *DETECTED.get_or_init(|| KernelPath::supported()[0])
}

thread_local! {
    static FORCED: Cell<Option<KernelPath>> = const { Cell::new(None) };
}

/// The path kernels called on this thread use: the one forced by [`with_path`], else
/// [`detected_path`].
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{KernelPath, active_path, with_path};
/// with_path(KernelPath::Portable, || assert_eq!(active_path(), KernelPath::Portable)).unwrap();
/// ```
pub fn active_path() -> KernelPath {
    FORCED.with(Cell::get).unwrap_or_else(detected_path)
}

/// Runs `f` with every kernel on this thread forced to `path` (layers included), then restores
/// the previous choice.
///
/// # Errors
/// [`KernelError::Unsupported`] if this CPU lacks the path's instructions; `f` does not run.
///
/// # Examples
/// ```
/// use mpx_runtime::kernels::{KernelPath, with_path};
/// for path in KernelPath::supported() {
///     with_path(path, || { /* run a layer or a GEMM */ }).unwrap();
/// }
/// ```
pub fn with_path<R>(path: KernelPath, f: impl FnOnce() -> R) -> Result<R, KernelError> {
    struct Restore(Option<KernelPath>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|c| c.set(self.0));
        }
    }
    if !path.is_supported() {
        return Err(KernelError::Unsupported {
            path,
            supported: KernelPath::supported(),
        });
    }
    let _restore = Restore(FORCED.with(|c| c.replace(Some(path))));
    Ok(f())
}
