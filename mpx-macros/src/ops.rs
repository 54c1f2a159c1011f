//! The precision-critical operations: one table, shared by every macro that decides where half
//! precision ends and f32 begins (`#[autocast]` wraps each of these calls in an f32 region;
//! `#[mixed_step]` runs everything after a model's forward pass in f32, which covers them all).
//!
//! The list is PyTorch autocast's "ops that autocast to float32" (CUDA and CPU lists,
//! `docs/source/amp.md`), mapped to the names dfdx 0.13 gives the same operations. Operations
//! PyTorch lists that dfdx does not have (cdist, cumsum, fft, ...) have no row.

/// How an operation is written in dfdx code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form {
    /// A free function: `cross_entropy_with_logits_loss(logits, y)`. Every one is a dfdx loss:
    /// its first argument is the prediction, which carries the tape; its second the target,
    /// which has none; any others are scalars.
    Function,
    /// A tensor method: `x.softmax::<Axis<1>>()`.
    Method,
}

/// One precision-critical operation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fp32Op {
    /// The dfdx name (last path segment for functions, method name for methods).
    pub name: &'static str,
    /// Function or method.
    pub form: Form,
    /// How many arguments dfdx's operation takes, besides the receiver of a method: a call with
    /// another count is some other function (`self.norm.normalize(x, eps)` is not dfdx's
    /// `normalize(eps)`). A loss takes `(prediction, target)` and then its scalars (`delta`).
    pub args: usize,
    /// The PyTorch autocast name it corresponds to (documentation: `docs/dsl.md` renders it,
    /// and a test checks the two agree).
    #[cfg_attr(not(test), allow(dead_code))]
    pub torch: &'static str,
    /// Why it needs f32 (documentation, as `torch`).
    #[cfg_attr(not(test), allow(dead_code))]
    pub why: &'static str,
}

const LOSS: &str =
    "a loss reduces a whole batch to one value; f16 loses small terms and overflows large sums";
const EXP: &str = "exp/log overflow or underflow f16's range (exp(11.1) > 65504)";
const REDUCE: &str = "a reduction over many values passes 65504 or loses the small terms";
const NORM: &str = "statistics over a row (sum of squares) overflow f16";
const POW: &str = "powers leave f16's range quickly";

macro_rules! ops {
    ($($form:ident $name:literal $args:literal $torch:literal $why:ident;)*) => {
        /// The table: every dfdx operation that runs in f32 inside a mixed-precision computation.
        pub(crate) static FP32_OPS: &[Fp32Op] = &[
            $(Fp32Op { name: $name, form: Form::$form, args: $args, torch: $torch, why: $why },)*
        ];
    };
}

ops! {
    Function "cross_entropy_with_logits_loss" 2 "cross_entropy" LOSS;
    Function "binary_cross_entropy_with_logits_loss" 2 "binary_cross_entropy_with_logits" LOSS;
    Function "kl_div_with_logits_loss" 2 "kl_div" LOSS;
    Function "mse_loss" 2 "mse_loss" LOSS;
    Function "rmse_loss" 2 "mse_loss" LOSS;
    Function "mae_loss" 2 "l1_loss" LOSS;
    Function "huber_loss" 3 "huber_loss" LOSS;
    Function "smooth_l1_loss" 3 "smooth_l1_loss" LOSS;
    Method "softmax" 0 "softmax" EXP;
    Method "log_softmax" 0 "log_softmax" EXP;
    Method "logsumexp" 0 "logsumexp (sum of exp)" EXP;
    Method "exp" 0 "exp" EXP;
    Method "ln" 0 "log" EXP;
    Method "sum" 0 "sum" REDUCE;
    Method "mean" 0 "mean (sum / n)" REDUCE;
    Method "var" 0 "var (sum of squares)" REDUCE;
    Method "stddev" 1 "std (sum of squares)" REDUCE;
    Method "normalize" 1 "layer_norm / normalize" NORM;
    Method "powf" 1 "pow" POW;
    Method "powi" 1 "pow" POW;
    Method "recip" 0 "reciprocal" POW;
}

/// The f32 operation called `name` in the given form, if it is one.
pub(crate) fn fp32_op(name: &str, form: Form) -> Option<&'static Fp32Op> {
    FP32_OPS
        .iter()
        .find(|op| op.name == name && op.form == form)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_per_form_and_found() {
        for (i, a) in FP32_OPS.iter().enumerate() {
            for b in &FP32_OPS[i + 1..] {
                assert!(!(a.name == b.name && a.form == b.form), "{} twice", a.name);
            }
            assert_eq!(fp32_op(a.name, a.form).map(|o| o.torch), Some(a.torch));
        }
        assert!(fp32_op("softmax", Form::Function).is_none());
        assert!(fp32_op("matmul", Form::Method).is_none());
    }

    #[test]
    fn the_docs_list_every_operation_of_the_table() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/dsl.md");
        let docs = std::fs::read_to_string(path).expect("docs/dsl.md exists");
        let section = docs
            .split("### Operations run in f32")
            .nth(1)
            .expect("docs/dsl.md has the section `### Operations run in f32`");
        let rows: Vec<&str> = section
            .lines()
            .skip_while(|l| !l.starts_with("|---"))
            .skip(1)
            .take_while(|l| l.starts_with('|'))
            .collect();
        let expected: Vec<String> = FP32_OPS
            .iter()
            .map(|op| {
                let form = match op.form {
                    Form::Function => "function",
                    Form::Method => "method",
                };
                format!("| `{}` | {form} | {} | {} |", op.name, op.torch, op.why)
            })
            .collect();
        assert_eq!(
            rows, expected,
            "docs/dsl.md's table of operations has drifted from ops.rs"
        );
    }
}
