//! The dtype a precision stores or emulates, by jmp's names.

use std::fmt;

/// A floating-point dtype a policy can name: jmp's four.
///
/// `Float64` exists because jmp accepts it in policy strings; no mpx cast produces f64 (mpx
/// leaves f64 alone), so a typed `mpx::policy::Policy` cannot hold it.
///
/// # Examples
/// ```
/// use mpx_runtime::precision::DType;
/// assert_eq!("bfloat16".parse::<DType>(), Ok(DType::BFloat16)); // jmp's names parse (`mpx::policy`)
/// assert_eq!(DType::Float32.to_string(), "full");
/// assert_eq!(DType::Float16.name(), "float16");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary16 (`f16`, `half`).
    Float16,
    /// bfloat16 (emulated in mpx: see [`bf16`](super::bf16)).
    BFloat16,
    /// IEEE binary32 (`full`).
    Float32,
    /// IEEE binary64.
    Float64,
}

impl DType {
    /// jmp's long name: `float16`, `bfloat16`, `float32`, `float64`.
    pub fn name(self) -> &'static str {
        match self {
            DType::Float16 => "float16",
            DType::BFloat16 => "bfloat16",
            DType::Float32 => "float32",
            DType::Float64 => "float64",
        }
    }

    /// jmp's short name, as its `str(policy)` prints it: `f16`, `bf16`, `full`, `f64`.
    pub fn short_name(self) -> &'static str {
        match self {
            DType::Float16 => "f16",
            DType::BFloat16 => "bf16",
            DType::Float32 => "full",
            DType::Float64 => "f64",
        }
    }
}

impl fmt::Display for DType {
    /// jmp's short name (`full`, `f16`, `bf16`, `f64`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short_name())
    }
}
