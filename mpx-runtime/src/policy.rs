//! jmp-style precision policies (param / compute / output) and their strings.
//!
//! Two forms:
//! - [`PolicySpec`]: a runtime value of three [`DType`]s, parsed from jmp's policy strings
//!   (`"params=float32,compute=float16,output=float32"`, `"p=f32,c=bf16,o=f32"`, `"half"`, ...).
//! - [`Policy<P, C, O>`]: the same policy as types (zero-sized), which casts trees:
//!   [`Policy::cast_to_param`], [`Policy::cast_to_compute`], [`Policy::cast_to_output`].
//!
//! # Strings
//! The grammar is jmp's `get_policy`: either one dtype name for all three precisions, or
//! comma-separated `key=dtype` pairs with keys `p`/`params`, `c`/`compute`, `o`/`output`.
//! Missing keys take jmp's defaults: params = f32, compute = params, output = compute.
//! Dtype names are jmp's, case-sensitive: `full`/`f32`/`float32`, `half`/`f16`/`float16`,
//! `bf16`/`bfloat16`, `f64`/`float64`. `half` means f16 (jmp's choice on CPU and GPU; jmp picks
//! bf16 only on TPU).
//!
//! Where jmp is sloppy we are strict, and say why:
//! - ASCII spaces (`' '`, U+0020) around keys, values and a lone dtype are allowed
//!   (`"p=f32, c=f16"`; jmp rejects the key `" c"`); nothing else is trimmed: tabs, newlines and
//!   other Unicode whitespace are errors;
//! - a repeated key is an error (jmp lets the last one win: `"c=f16,c=bf16"`);
//! - unknown keys and dtypes are errors that list the valid choices; Keras names such as
//!   `mixed_float16` point to the preset constructors.
//!
//! # Examples
//! ```
//! use mpx_runtime::policy::{Policy, PolicySpec};
//! use mpx_runtime::precision::DType;
//! use mpx_runtime::precision::f16;
//!
//! let spec: PolicySpec = "params=float32,compute=float16,output=float32".parse().unwrap();
//! assert_eq!(spec.compute, DType::Float16);
//! assert_eq!(spec.to_string(), "p=full,c=f16,o=full");
//!
//! let policy = Policy::mixed_float16();
//! assert_eq!(policy.spec(), spec);
//! let h: Vec<f16> = policy.cast_to_compute(&vec![0.5f32]);
//! assert_eq!(h, vec![f16::from_f32(0.5)]);
//! ```

use std::fmt;
use std::marker::PhantomData;
use std::str::FromStr;

use crate::cast::Cast;
use crate::precision::{DType, Precision, bf16, f16};

/// Every dtype name the parser accepts, for error messages.
const DTYPE_CHOICES: &str = "full, f32, float32, half, f16, float16, bf16, bfloat16, f64, float64";
/// Every key the parser accepts, for error messages.
const KEY_CHOICES: &str = "p, params, c, compute, o, output";
/// Characters of user input an error keeps (and quotes); longer input is cut, with `…` appended.
const QUOTE_CHARS: usize = 64;

/// `input` cut to [`QUOTE_CHARS`] characters, with `…` appended when cut: errors quote user input
/// bounded, never a 10 MB string.
fn excerpt(input: &str) -> String {
    match input.char_indices().nth(QUOTE_CHARS) {
        Some((end, _)) => format!("{}…", &input[..end]),
        None => input.to_string(),
    }
}

/// Trims ASCII spaces (U+0020) only, as the grammar says.
fn trim_spaces(s: &str) -> &str {
    s.trim_matches(' ')
}

/// `" in policy `…`"`, or nothing when the policy is the quoted part itself (quote input once).
fn in_policy(part: &str, policy: &str) -> String {
    if part == policy {
        String::new()
    } else {
        format!(" in policy `{policy}`")
    }
}

/// Why a policy string or a typed policy was rejected.
///
/// User input in the fields (and so in the messages) is cut to 64 characters, with `…` appended
/// when cut; the whole policy is quoted only when it is not the offending part itself.
///
/// # Examples
/// ```
/// use mpx_runtime::policy::{PolicyError, PolicySpec};
/// let err = PolicySpec::parse("fp16").unwrap_err();
/// assert!(matches!(&err, PolicyError::UnknownDType { value, .. } if value == "fp16"));
/// assert!(err.to_string().starts_with("unknown dtype `fp16`; expected one of"));
/// let long = PolicySpec::parse(&"x".repeat(1000)).unwrap_err().to_string();
/// assert!(long.len() < 200);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// A dtype name that is not one of jmp's.
    #[error("unknown dtype `{value}`{}; expected one of {DTYPE_CHOICES}", in_policy(.value, .policy))]
    UnknownDType {
        /// The rejected name (after trimming spaces; at most 64 characters and `…`).
        value: String,
        /// The whole policy string (at most 64 characters and `…`).
        policy: String,
    },
    /// A Keras policy name, which is not a jmp policy string.
    #[error(
        "`{value}` is a Keras policy name, not a jmp policy string; use `{constructor}` or the string `{equivalent}`"
    )]
    KerasName {
        /// The Keras name given (after trimming spaces).
        value: String,
        /// The preset constructor to call instead.
        constructor: &'static str,
        /// The jmp string with the same precisions.
        equivalent: &'static str,
    },
    /// A key other than `p`/`params`, `c`/`compute`, `o`/`output`.
    #[error("unknown key `{key}` in policy `{policy}`; expected one of {KEY_CHOICES}")]
    UnknownKey {
        /// The rejected key (after trimming spaces; at most 64 characters and `…`).
        key: String,
        /// The whole policy string (at most 64 characters and `…`).
        policy: String,
    },
    /// A key given twice (jmp silently keeps the last one).
    #[error(
        "key `{key}` appears twice in policy `{policy}`; give each of params, compute, output at most once"
    )]
    DuplicateKey {
        /// The long name of the repeated key (`params`, `compute` or `output`).
        key: &'static str,
        /// The whole policy string (at most 64 characters and `…`).
        policy: String,
    },
    /// A comma-separated part that is not `key=dtype` (empty, or with several `=`).
    #[error("`{part}`{} is not of the form `key=dtype`", in_policy(.part, .policy))]
    MalformedPart {
        /// The offending part (at most 64 characters and `…`).
        part: String,
        /// The whole policy string (at most 64 characters and `…`).
        policy: String,
    },
    /// A string parsed as a typed [`Policy`] names other precisions than the type.
    #[error("policy `{found}` does not match the type's precisions `{expected}`")]
    Mismatch {
        /// What the type `Policy<P, C, O>` stands for.
        expected: PolicySpec,
        /// What the string said.
        found: PolicySpec,
    },
}

impl DType {
    /// Parses one jmp dtype name (exact, case-sensitive); `None` if unknown.
    fn from_jmp_name(s: &str) -> Option<DType> {
        Some(match s {
            "bf16" | "bfloat16" => DType::BFloat16,
            "f16" | "float16" | "half" => DType::Float16,
            "full" | "f32" | "float32" => DType::Float32,
            "f64" | "float64" => DType::Float64,
            _ => return None,
        })
    }

    /// Parses a dtype name inside `policy` (for the error message), after trimming ASCII spaces.
    fn parse_in(value: &str, policy: &str) -> Result<DType, PolicyError> {
        let v = trim_spaces(value);
        if let Some(d) = DType::from_jmp_name(v) {
            return Ok(d);
        }
        let keras = match v {
            "mixed_float16" => Some(("PolicySpec::mixed_float16()", "p=f32,c=f16,o=f32")),
            "mixed_bfloat16" => Some(("PolicySpec::mixed_bfloat16()", "p=f32,c=bf16,o=f32")),
            _ => None,
        };
        Err(match keras {
            Some((constructor, equivalent)) => PolicyError::KerasName {
                value: v.to_string(),
                constructor,
                equivalent,
            },
            None => PolicyError::UnknownDType {
                value: excerpt(v),
                policy: excerpt(if value == policy { v } else { policy }),
            },
        })
    }
}

impl FromStr for DType {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::parse_in(s, s)
    }
}

/// A precision policy as runtime values: jmp's `Policy(param_dtype, compute_dtype,
/// output_dtype)`, parsed from jmp's strings.
///
/// # Examples
/// ```
/// use mpx_runtime::policy::PolicySpec;
/// use mpx_runtime::precision::DType;
/// // jmp's defaults: compute = params, output = compute
/// let s: PolicySpec = "c=bf16".parse().unwrap();
/// assert_eq!((s.param, s.compute, s.output), (DType::Float32, DType::BFloat16, DType::BFloat16));
/// // Display is jmp's short form and parses back to the same policy
/// assert_eq!(s.to_string().parse::<PolicySpec>(), Ok(s));
/// // stricter than jmp: a repeated key is an error
/// assert!("c=f16,c=bf16".parse::<PolicySpec>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PolicySpec {
    /// Precision parameters are stored in (jmp's `param_dtype`).
    pub param: DType,
    /// Precision the forward pass computes in.
    pub compute: DType,
    /// Precision outputs are returned in.
    pub output: DType,
}

impl PolicySpec {
    /// A policy from its three dtypes.
    pub const fn new(param: DType, compute: DType, output: DType) -> Self {
        Self {
            param,
            compute,
            output,
        }
    }

    /// Everything in f32 (Keras' `float32`).
    pub const fn float32() -> Self {
        Self::new(DType::Float32, DType::Float32, DType::Float32)
    }

    /// Keras' `mixed_float16`: f32 parameters and outputs, f16 compute.
    pub const fn mixed_float16() -> Self {
        Self::new(DType::Float32, DType::Float16, DType::Float32)
    }

    /// Keras' `mixed_bfloat16`: f32 parameters and outputs, bf16 compute.
    pub const fn mixed_bfloat16() -> Self {
        Self::new(DType::Float32, DType::BFloat16, DType::Float32)
    }

    /// Parses a jmp policy string (jmp's `get_policy`); see the [module docs](self) for the
    /// grammar and where we are stricter than jmp.
    ///
    /// # Errors
    /// [`PolicyError`] naming the offending key, dtype or part and the valid choices.
    pub fn parse(policy: &str) -> Result<Self, PolicyError> {
        const NAMES: [&str; 3] = ["params", "compute", "output"];
        if !policy.contains('=') {
            let d = DType::parse_in(policy, policy)?;
            return Ok(Self::new(d, d, d));
        }
        let mut slots: [Option<DType>; 3] = [None; 3];
        for part in policy.split(',') {
            let mut kv = part.split('=');
            let (Some(key), Some(value), None) = (kv.next(), kv.next(), kv.next()) else {
                return Err(PolicyError::MalformedPart {
                    part: excerpt(part),
                    policy: excerpt(policy),
                });
            };
            let slot = match trim_spaces(key) {
                "p" | "params" => 0,
                "c" | "compute" => 1,
                "o" | "output" => 2,
                other => {
                    return Err(PolicyError::UnknownKey {
                        key: excerpt(other),
                        policy: excerpt(policy),
                    });
                }
            };
            let d = DType::parse_in(value, policy)?;
            if slots[slot].replace(d).is_some() {
                return Err(PolicyError::DuplicateKey {
                    key: NAMES[slot],
                    policy: excerpt(policy),
                });
            }
        }
        let param = slots[0].unwrap_or(DType::Float32);
        let compute = slots[1].unwrap_or(param);
        let output = slots[2].unwrap_or(compute);
        Ok(Self::new(param, compute, output))
    }
}

impl fmt::Display for PolicySpec {
    /// jmp's `str(policy)`: `p=full,c=f16,o=full`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p={},c={},o={}", self.param, self.compute, self.output)
    }
}

impl FromStr for PolicySpec {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// Zero-sized marker for the three precisions (`fn() -> _`: always `Send`, `Sync` and covariant).
type Marker<P, C, O> = PhantomData<fn() -> (P, C, O)>;

/// A precision policy as types: parameters in `P`, compute in `C`, outputs in `O` (each `f32`,
/// `f16`, `AMP<f16>` or emulated `bf16`). Zero-sized; its methods cast any [`Cast`] tree. jmp's
/// `Policy`, with the dtypes checked at compile time.
///
/// # Examples
/// ```
/// use dfdx::prelude::*;
/// use mpx_runtime::policy::Policy;
/// use mpx_runtime::precision::{bf16, f16};
///
/// let dev = Cpu::default();
/// let policy: Policy<f32, f16, f32> = "p=f32,c=f16,o=f32".parse().unwrap();
/// let x: Tensor<Rank1<2>, f32, _> = dev.tensor([0.1, 2.0]);
/// let xh: Tensor<Rank1<2>, f16, _> = policy.cast_to_compute(&x);
/// let y: Tensor<Rank1<2>, f32, _> = policy.cast_to_output(&xh);
/// assert_eq!(y.array(), [f16::from_f32(0.1).to_f32(), 2.0]);
///
/// // a string that names other precisions than the type is an error
/// assert!("p=f32,c=bf16,o=f32".parse::<Policy<f32, f16, f32>>().is_err());
/// assert_eq!(Policy::mixed_bfloat16().to_string(), "p=full,c=bf16,o=full");
/// let _: Policy<f32, bf16, f32> = Policy::mixed_bfloat16();
/// ```
#[derive(Clone, Copy)]
pub struct Policy<P: Precision, C: Precision, O: Precision> {
    _p: Marker<P, C, O>,
}

impl<P: Precision, C: Precision, O: Precision> Policy<P, C, O> {
    /// The policy of these three types.
    pub const fn new() -> Self {
        Self { _p: PhantomData }
    }

    /// The policy as runtime values.
    pub fn spec(&self) -> PolicySpec {
        PolicySpec::new(P::DTYPE, C::DTYPE, O::DTYPE)
    }

    /// Casts the float leaves of `tree` to the parameter precision `P` (jmp's `cast_to_param`).
    pub fn cast_to_param<T: Cast<P> + ?Sized>(&self, tree: &T) -> T::Output {
        tree.cast()
    }

    /// Casts the float leaves of `tree` to the compute precision `C` (jmp's `cast_to_compute`).
    pub fn cast_to_compute<T: Cast<C> + ?Sized>(&self, tree: &T) -> T::Output {
        tree.cast()
    }

    /// Casts the float leaves of `tree` to the output precision `O` (jmp's `cast_to_output`).
    pub fn cast_to_output<T: Cast<O> + ?Sized>(&self, tree: &T) -> T::Output {
        tree.cast()
    }

    /// The same policy with another output precision (jmp's `with_output_dtype`).
    pub const fn with_output<O2: Precision>(&self) -> Policy<P, C, O2> {
        Policy::new()
    }
}

impl Policy<f32, f32, f32> {
    /// Everything in f32 (Keras' `float32`).
    pub const fn float32() -> Self {
        Self::new()
    }
}

impl Policy<f32, f16, f32> {
    /// Keras' `mixed_float16`: f32 parameters and outputs, f16 compute.
    pub const fn mixed_float16() -> Self {
        Self::new()
    }
}

impl Policy<f32, bf16, f32> {
    /// Keras' `mixed_bfloat16`: f32 parameters and outputs, (emulated) bf16 compute.
    pub const fn mixed_bfloat16() -> Self {
        Self::new()
    }
}

impl<P: Precision, C: Precision, O: Precision> Default for Policy<P, C, O> {
    fn default() -> Self {
        Self::new()
    }
}
impl<P: Precision, C: Precision, O: Precision> PartialEq for Policy<P, C, O> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl<P: Precision, C: Precision, O: Precision> Eq for Policy<P, C, O> {}
impl<P: Precision, C: Precision, O: Precision> fmt::Debug for Policy<P, C, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Policy({})", self.spec())
    }
}
impl<P: Precision, C: Precision, O: Precision> fmt::Display for Policy<P, C, O> {
    /// jmp's short form, `p=full,c=f16,o=full`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.spec(), f)
    }
}

impl<P: Precision, C: Precision, O: Precision> FromStr for Policy<P, C, O> {
    type Err = PolicyError;
    /// Parses a jmp policy string and checks that it names this type's precisions.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let found = PolicySpec::parse(s)?;
        let policy = Self::new();
        let expected = policy.spec();
        if found == expected {
            Ok(policy)
        } else {
            Err(PolicyError::Mismatch { expected, found })
        }
    }
}
