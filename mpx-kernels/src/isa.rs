//! [`KernelPath`]: the instruction sets the kernels have, and which of them this CPU runs (read
//! at run time; never from `-C target-cpu`). Which one a product uses is [`path`](super::path)'s.

/// The instruction set a kernel runs on. See the [crate docs](crate#paths) for what each does with
/// f32, f16 and bf16 operands.
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
    /// Every path, the widest instructions first (which is fastest depends on the CPU: see
    /// [`calibration`](crate::calibration)).
    pub const ALL: [KernelPath; 5] = [
        KernelPath::Avx512Fp16,
        KernelPath::Avx512Bf16,
        KernelPath::Avx512,
        KernelPath::Avx2Fma,
        KernelPath::Portable,
    ];

    /// Whether this CPU has the instructions of the path.
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

    /// The paths this CPU supports, in the order of [`KernelPath::ALL`].
    pub fn supported() -> Vec<KernelPath> {
        KernelPath::ALL
            .into_iter()
            .filter(|p| p.is_supported())
            .collect()
    }
}
