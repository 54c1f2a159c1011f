//! Validation: the function kind, the half type and `skip`, all recorded at once.

use super::ast::Args;
use crate::ctxt::Ctxt;
use crate::ops::FP32_OPS;
use crate::syntax::find_half;

/// A checked function, ready to rewrite.
pub(crate) struct Plan {
    /// The caller's precision type: the regions return their results in it. `None` when it
    /// could not be told (the error is recorded; the body is still read for its own errors).
    pub half: Option<syn::Type>,
    /// Names of the operations left in the half type (`skip = ..`).
    pub skip: Vec<String>,
}

/// Rejects what cannot be rewritten; every problem is recorded in `cx`.
pub(crate) fn check(args: &Args, f: &syn::ItemFn, cx: &mut Ctxt) -> Plan {
    let sig = &f.sig;
    if let Some(t) = &sig.constness {
        cx.error_spanned(
            t,
            "`#[autocast]` cannot rewrite a `const fn`: tensor code is not const",
        );
    }
    let mut skip = Vec::new();
    for name in args.skip.iter().flatten() {
        let s = name.to_string();
        if !FP32_OPS.iter().any(|op| op.name == s) {
            cx.error_spanned(
                name,
                format!(
                    "`skip` names `{s}`, which `#[autocast]` does not wrap; it wraps {}",
                    op_list()
                ),
            );
        } else if skip.contains(&s) {
            cx.error_spanned(name, format!("`{s}` is listed twice in `skip`"));
        } else {
            skip.push(s);
        }
    }
    if args.half.is_none() && is_training_step(f) {
        cx.error_spanned(
            &sig.ident,
            "`#[autocast]` rewrites a function that computes in half precision (a model's forward pass, generic over `H: Precision`); this one trains (a backward pass, or `#[mixed_step]`), and a mixed step already computes its loss in f32: the model's output comes back to it in f32. Remove `#[autocast]` here; to run a model's own softmax, norm or sum in f32, put it on that model's forward pass",
        );
        return Plan { half: None, skip };
    }
    let half = match &args.half {
        Some(h) => Some(h.clone()),
        None => find_half(&sig.generics, &sig.ident, "autocast", cx),
    };
    Plan { half, skip }
}

/// Whether `f` is a training step: `#[mixed_step]` on it, or a backward pass in its body.
fn is_training_step(f: &syn::ItemFn) -> bool {
    struct Backward(bool);
    impl syn::visit::Visit<'_> for Backward {
        fn visit_expr_method_call(&mut self, m: &syn::ExprMethodCall) {
            self.0 |= (m.method == "backward" || m.method == "try_backward") && m.args.is_empty();
            syn::visit::visit_expr_method_call(self, m);
        }
    }
    let attributed = f.attrs.iter().any(|a| {
        a.path()
            .segments
            .last()
            .is_some_and(|s| s.ident == "mixed_step")
    });
    let mut b = Backward(false);
    syn::visit::Visit::visit_block(&mut b, &f.block);
    attributed || b.0
}

/// Every operation of the table, as error messages list them: `` `softmax`, `exp`, .. ``.
pub(crate) fn op_list() -> String {
    let names: Vec<String> = FP32_OPS.iter().map(|op| format!("`{}`", op.name)).collect();
    names.join(", ")
}
