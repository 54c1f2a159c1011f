//! Validation: the function kind, the arguments, and the shape of the step's body.
//!
//! The recognised shape of an f32 dfdx training step, in this order:
//!
//! ```text
//! <prefix statements>                                   kept
//! let grads = model.alloc_grads();                      dropped (the step allocates its own)
//! let out = model.forward_mut(x.traced(grads));         forward pass: `forward` or `forward_mut`,
//!                                                       on `x.traced(..)` or `x.trace(..)`
//! <loss statements, e.g. let loss = mse_loss(out, y);>  the loss, in f32
//! let grads = loss.backward();                          backward of the loss (`try_backward()?` too)
//! opt.update(model, &grads).unwrap();                   the update (`.expect(..)`, `?`, `let _ =` too)
//! <tail statements>                                     kept
//! [loss_value]                                          optional: a binding made in the loss
//!                                                       statements; the report's `loss` replaces it
//! ```

use proc_macro2::Span;
use quote::ToTokens;

use super::ast::{Args, Half};
use crate::ctxt::Ctxt;

/// A step body split at its landmarks.
pub(crate) struct Step {
    pub prefix: Vec<syn::Stmt>,
    pub out_pat: syn::Pat,
    pub forward: syn::Ident,
    pub input: syn::Expr,
    pub loss_stmts: Vec<syn::Stmt>,
    pub loss: syn::Ident,
    pub opt: syn::Expr,
    pub master: syn::Expr,
    pub tail: Vec<syn::Stmt>,
    /// The loss-value binding the step ended with, replaced by the report.
    pub replaced: Option<syn::Ident>,
}

/// Everything `expand` needs.
pub(crate) struct Plan {
    pub scaling: syn::Expr,
    pub half: Half,
    pub step: Step,
}

/// Checks the function kind, the arguments and the body; records every problem in `cx`.
pub(crate) fn check(args: &Args, f: &syn::ItemFn, cx: &mut Ctxt) -> Option<Plan> {
    let sig = &f.sig;
    if let Some(t) = &sig.constness {
        cx.error_spanned(
            t,
            "`#[mixed_step]` cannot rewrite a `const fn`: a training step is not const",
        );
    }
    if let Some(t) = &sig.asyncness {
        cx.error_spanned(
            t,
            "`#[mixed_step]` cannot rewrite an `async fn`; make the step a plain `fn`",
        );
    }
    if let Some(abi) = &sig.abi {
        cx.error_spanned(
            abi,
            "`#[mixed_step]` cannot rewrite an `extern` function; remove the ABI",
        );
    }
    if let Some(v) = &sig.variadic {
        cx.error_spanned(v, "`#[mixed_step]` cannot rewrite a variadic function");
    }
    if args.scaling.is_none() {
        cx.push(syn::Error::new(
            Span::call_site(),
            "missing argument `scaling`: pass the loss scale, e.g. `#[mixed_step(scaling = scaler)]` with `scaler: &mut DynamicLossScale` (use `NoOpLossScale` for none)",
        ));
    }
    let step = read_body(f, cx);
    Some(Plan {
        scaling: args.scaling.clone()?,
        half: args.half.unwrap_or(Half::F16),
        step: step?,
    })
}

/// Removes `?`, `.unwrap()` and `.expect(..)` around an expression.
fn peel(mut e: &syn::Expr) -> &syn::Expr {
    loop {
        match e {
            syn::Expr::Try(t) => e = &t.expr,
            syn::Expr::MethodCall(m)
                if (m.method == "unwrap" && m.args.is_empty())
                    || (m.method == "expect" && m.args.len() == 1) =>
            {
                e = &m.receiver
            }
            syn::Expr::Paren(p) => e = &p.expr,
            _ => return e,
        }
    }
}

/// The expression a statement evaluates (`let _ = e;`, `e;`, `let p = e;`).
fn stmt_expr(s: &syn::Stmt) -> Option<&syn::Expr> {
    match s {
        syn::Stmt::Local(l) => l.init.as_ref().map(|i| &*i.expr),
        syn::Stmt::Expr(e, _) => Some(e),
        _ => None,
    }
}

/// `model.forward(x.traced(grads))` / `forward_mut`, `trace`: (method, input, grads expr).
fn as_forward(e: &syn::Expr) -> Option<(syn::Ident, syn::Expr, syn::Expr)> {
    let syn::Expr::MethodCall(m) = peel(e) else {
        return None;
    };
    if (m.method != "forward" && m.method != "forward_mut") || m.args.len() != 1 {
        return None;
    }
    let syn::Expr::MethodCall(t) = &m.args[0] else {
        return None;
    };
    if (t.method != "traced" && t.method != "trace") || t.args.len() != 1 {
        return None;
    }
    Some((m.method.clone(), (*t.receiver).clone(), t.args[0].clone()))
}

/// `loss.backward()` / `loss.try_backward()?`: the loss identifier.
fn as_backward(e: &syn::Expr) -> Option<&syn::Expr> {
    let syn::Expr::MethodCall(m) = peel(e) else {
        return None;
    };
    ((m.method == "backward" || m.method == "try_backward") && m.args.is_empty())
        .then_some(&*m.receiver)
}

/// `opt.update(model, &grads)`: (optimizer, master).
fn as_update(e: &syn::Expr) -> Option<(syn::Expr, syn::Expr)> {
    let syn::Expr::MethodCall(m) = peel(e) else {
        return None;
    };
    (m.method == "update" && m.args.len() == 2).then(|| ((*m.receiver).clone(), m.args[0].clone()))
}

/// `let <ident> = <x>.alloc_grads();` (or `try_alloc_grads()?`): the bound name.
fn as_alloc(s: &syn::Stmt) -> Option<&syn::Ident> {
    let syn::Stmt::Local(l) = s else { return None };
    let syn::Expr::MethodCall(m) = peel(&l.init.as_ref()?.expr) else {
        return None;
    };
    if m.method != "alloc_grads" && m.method != "try_alloc_grads" {
        return None;
    }
    match &l.pat {
        syn::Pat::Ident(pi) => Some(&pi.ident),
        syn::Pat::Type(pt) => match &*pt.pat {
            syn::Pat::Ident(pi) => Some(&pi.ident),
            _ => None,
        },
        _ => None,
    }
}

/// Normalised tokens, to compare the model of the forward pass with the model updated.
fn key(e: &syn::Expr) -> String {
    let e = match e {
        syn::Expr::Reference(r) => &*r.expr,
        other => other,
    };
    e.to_token_stream().to_string().replace(' ', "")
}

/// The identifiers a `let` pattern binds.
fn bound_idents(p: &syn::Pat, out: &mut Vec<syn::Ident>) {
    match p {
        syn::Pat::Ident(pi) => out.push(pi.ident.clone()),
        syn::Pat::Type(pt) => bound_idents(&pt.pat, out),
        syn::Pat::Tuple(t) => t.elems.iter().for_each(|e| bound_idents(e, out)),
        syn::Pat::Reference(r) => bound_idents(&r.pat, out),
        _ => {}
    }
}

/// What the f32 step declared it returns; the rewritten step returns its `StepReport` instead.
enum Returns<'a> {
    /// No return type, `()` or `f32` (the loss value, which the report carries).
    Plain,
    /// A `Result` (the f32 step's own error handling), ended by `Ok(..)`.
    Result,
    /// Anything else: an error.
    Other(&'a syn::Type),
}

impl<'a> Returns<'a> {
    fn of(output: &'a syn::ReturnType) -> Self {
        let syn::ReturnType::Type(_, ty) = output else {
            return Returns::Plain;
        };
        match &**ty {
            syn::Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == "Result") => {
                Returns::Result
            }
            syn::Type::Path(p) if p.path.is_ident("f32") => Returns::Plain,
            syn::Type::Tuple(t) if t.elems.is_empty() => Returns::Plain,
            other => Returns::Other(other),
        }
    }
}

/// Splits the body at its forward pass, backward and update.
fn read_body(f: &syn::ItemFn, cx: &mut Ctxt) -> Option<Step> {
    let stmts = &f.block.stmts;
    let forwards: Vec<usize> = (0..stmts.len())
        .filter(|&i| {
            matches!(&stmts[i], syn::Stmt::Local(_))
                && stmt_expr(&stmts[i]).and_then(as_forward).is_some()
        })
        .collect();
    let backwards: Vec<usize> = (0..stmts.len())
        .filter(|&i| stmt_expr(&stmts[i]).and_then(as_backward).is_some())
        .collect();
    let updates: Vec<usize> = (0..stmts.len())
        .filter(|&i| stmt_expr(&stmts[i]).and_then(as_update).is_some())
        .collect();

    let name = &f.sig.ident;
    if forwards.is_empty() {
        cx.error_spanned(
            name,
            "no traced forward pass in this step: `#[mixed_step]` needs `let out = model.forward(x.traced(grads));` (or `forward_mut`), which it runs on the half working copy",
        );
    }
    if backwards.is_empty() {
        cx.error_spanned(
            name,
            "no loss to scale in this step: `#[mixed_step]` needs the loss's backward pass, `let grads = loss.backward();`, to scale the loss before it",
        );
    }
    if updates.is_empty() {
        cx.error_spanned(
            name,
            "no optimizer update in this step: `#[mixed_step]` needs `opt.update(model, &grads)`, which it replaces with a skip-on-overflow update of the f32 master",
        );
    }
    for extra in forwards.iter().skip(1) {
        cx.error_spanned(
            &stmts[*extra],
            "a mixed step runs one traced forward pass; this is a second one",
        );
    }
    for extra in backwards.iter().skip(1) {
        cx.error_spanned(
            &stmts[*extra],
            "a mixed step runs one backward pass; this is a second one",
        );
    }
    for extra in updates.iter().skip(1) {
        cx.error_spanned(
            &stmts[*extra],
            "a mixed step runs one optimizer update; this is a second one",
        );
    }
    let (&fi, &bi, &ui) = (forwards.first()?, backwards.first()?, updates.first()?);
    if !(fi < bi && bi < ui) {
        cx.error_spanned(
            &stmts[bi],
            "the step must run forward pass, then `loss.backward()`, then `opt.update(..)`, in that order",
        );
        return None;
    }

    let syn::Stmt::Local(fwd_local) = &stmts[fi] else {
        return None;
    };
    let (forward, input, grads_arg) = stmt_expr(&stmts[fi]).and_then(as_forward)?;
    let model_fwd = match peel(stmt_expr(&stmts[fi])?) {
        syn::Expr::MethodCall(m) => (*m.receiver).clone(),
        _ => return None,
    };

    let loss = match as_backward(stmt_expr(&stmts[bi])?)? {
        syn::Expr::Path(p) if p.path.get_ident().is_some() => p.path.get_ident().cloned(),
        other => {
            cx.error_spanned(
                other,
                "call `.backward()` on the loss binding (`let loss = ..; let grads = loss.backward();`) so the step can compute the loss in f32 and scale it",
            );
            None
        }
    };

    let (opt, master) = as_update(stmt_expr(&stmts[ui])?)?;
    if key(&master) != key(&model_fwd) {
        cx.error_spanned(
            &master,
            format!(
                "the optimizer updates `{}` but the forward pass ran `{}`: a mixed step updates the model it ran",
                key(&master),
                key(&model_fwd)
            ),
        );
    }
    for s in &stmts[bi + 1..ui] {
        cx.error_spanned(
            s,
            "statements between `backward()` and the optimizer update are not supported in a mixed step (the gradients they see are replaced by the unscaled f32 ones); move them before the forward pass or after the update",
        );
    }

    // The prefix without the `alloc_grads` that fed the forward pass.
    let grads_name = match &grads_arg {
        syn::Expr::Path(p) => p.path.get_ident().cloned(),
        _ => None,
    };
    let prefix: Vec<syn::Stmt> = stmts[..fi]
        .iter()
        .filter(|s| !matches!((as_alloc(s), &grads_name), (Some(a), Some(g)) if a == g))
        .cloned()
        .collect();

    let loss_stmts: Vec<syn::Stmt> = stmts[fi + 1..bi].to_vec();
    let mut loss_bindings = Vec::new();
    for s in &loss_stmts {
        if let syn::Stmt::Local(l) = s {
            bound_idents(&l.pat, &mut loss_bindings);
        }
    }

    let mut tail: Vec<syn::Stmt> = stmts[ui + 1..].to_vec();
    let mut replaced = None;
    let returns = Returns::of(&f.sig.output);
    if let Some(syn::Stmt::Expr(e, None)) = tail.last() {
        // The value the step ends with: `e` itself, or the argument of `Ok(..)` when the f32 step
        // returned a `Result`.
        let ok_arg = match e {
            syn::Expr::Call(c) if matches!(returns, Returns::Result) && c.args.len() == 1 => {
                match &*c.func {
                    syn::Expr::Path(p)
                        if p.path.segments.last().is_some_and(|s| s.ident == "Ok") =>
                    {
                        c.args.first()
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        let value = ok_arg.unwrap_or(e);
        let loss_binding = match value {
            syn::Expr::Path(p) => p.path.get_ident().filter(|i| loss_bindings.contains(i)),
            _ => None,
        };
        let ok_unit =
            ok_arg.is_some() && matches!(value, syn::Expr::Tuple(t) if t.elems.is_empty());
        if ok_unit || loss_binding.is_some() {
            replaced = loss_binding.cloned();
            tail.pop();
        } else {
            cx.error_spanned(
                e,
                "a `#[mixed_step]` function returns its `StepReport` (loss, finite flag, scales, update outcome); end the step with a statement, with the binding of the loss value (the report's `loss` replaces it), or with `Ok(())` or `Ok(loss_value)` when it returned a `Result`",
            );
        }
    }
    if let Returns::Other(ty) = returns {
        cx.error_spanned(
            ty,
            "a `#[mixed_step]` function returns `Result<StepReport, StepError>`; declare no return type, `()`, `f32` (the loss, which the report carries) or the `Result` of the f32 step",
        );
    }
    let _ = fwd_local;
    Some(Step {
        prefix,
        out_pat: fwd_local.pat.clone(),
        forward,
        input,
        loss_stmts,
        loss: loss?,
        opt,
        master,
        tail,
        replaced,
    })
}
