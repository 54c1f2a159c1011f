//! Validation: the function kind, the arguments, a scaler that persists across steps, and the
//! roles of the body ([`super::roles`]).

use proc_macro2::Span;

use super::ast::{Args, Half};

use super::roles::{Found, Traced, as_update, forward_path, key, place};
use crate::ctxt::Ctxt;

/// Everything `expand` needs.
pub(crate) struct Plan {
    /// The `GradScaler` place.
    pub scaling: syn::Expr,
    /// `None`: the scaler's type decides.
    pub half: Option<Half>,
    /// The master model: the place the optimizer updates.
    pub master: syn::Expr,
    /// Bindings holding traced values.
    pub traced: Traced,
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
            "missing argument `scaling`: name the mixed-precision state, declared once outside the loop, e.g. `#[mixed_step(scaling = scaler)]` with `let mut scaler = mpx::step::GradScaler::new(DynamicLossScale::default());`",
        ));
    }
    let found = Found::in_block(&f.block);
    if let Some(scaling) = &args.scaling {
        check_persistent(scaling, f, &found, cx);
    }
    let master = find_master(f, &found, cx);
    let traced = Traced::of(f);
    if let Some(master) = &master {
        check_forward_and_backward(f, &found, master, &traced, cx);
    }
    Some(Plan {
        scaling: args.scaling.clone()?,
        half: args.half,
        master: master?,
        traced,
    })
}

/// The master: the model every optimizer update names.
fn find_master(f: &syn::ItemFn, found: &Found<'_>, cx: &mut Ctxt) -> Option<syn::Expr> {
    let Some((first, _)) = found.updates.first() else {
        cx.error_spanned(
            &f.sig.ident,
            "no optimizer update in this step: `#[mixed_step]` needs `opt.update(&mut model, &grads)` to find the f32 master model, and replaces it with an update that skips non-finite steps",
        );
        return None;
    };
    let (_, master, _) = as_update(first)?;
    let master_key = key(master);
    for (other, _) in &found.updates[1..] {
        if let Some((_, m, _)) = as_update(other)
            && key(m) != master_key
        {
            cx.error_spanned(
                m,
                format!(
                    "this update names `{}` but another one names `{master_key}`: a `#[mixed_step]` trains one master model; give each model its own step and scaler",
                    key(m)
                ),
            );
        }
    }
    Some(place(master).clone())
}

/// At least one traced forward pass of the master, and a backward pass.
fn check_forward_and_backward(
    f: &syn::ItemFn,
    found: &Found<'_>,
    master: &syn::Expr,
    traced: &Traced,
    cx: &mut Ctxt,
) {
    let master_key = key(master);
    let forwards = found
        .forwards
        .iter()
        .filter(|(m, _)| forward_path(m, &master_key).is_some() && traced.mentions(&m.args[0]))
        .count();
    if forwards == 0 {
        let untraced = found
            .forwards
            .iter()
            .find(|(m, _)| forward_path(m, &master_key).is_some());
        match untraced {
            Some((m, _)) => cx.error_spanned(
                &m.args[0],
                format!(
                    "this forward pass of `{master_key}` has no traced input: `#[mixed_step]` runs the traced forward pass (`{master_key}.forward(x.traced(grads))`) in half precision; trace the input as the f32 step does"
                ),
            ),
            None => cx.error_spanned(
                &f.sig.ident,
                format!(
                    "no traced forward pass of `{master_key}` (the model the optimizer updates) in this step: `#[mixed_step]` runs `{master_key}.forward(x.traced(grads))` (or `forward_mut`, `try_forward`, a field's forward) on the half working copy"
                ),
            ),
        }
    }
    if found.backwards.is_empty() {
        cx.error_spanned(
            &f.sig.ident,
            "no backward pass in this step: `#[mixed_step]` needs `grads = loss.backward();` (or `try_backward()`), where it brings the half gradients back unscaled",
        );
    }
}

/// The scaler must outlive the step: a place declared once, never a value built per call.
fn check_persistent(scaling: &syn::Expr, f: &syn::ItemFn, found: &Found<'_>, cx: &mut Ctxt) {
    let base = place(scaling);
    let mut root = base;
    loop {
        match root {
            syn::Expr::Field(fe) => root = place(&fe.base),
            syn::Expr::Unary(u) if matches!(u.op, syn::UnOp::Deref(_)) => root = place(&u.expr),
            _ => break,
        }
    }
    let syn::Expr::Path(p) = root else {
        cx.error_spanned(
            scaling,
            "`scaling = ..` builds a new value every time the step runs, so the loss scale, the half working copy and the skip counters would start over on every step (a dynamic scale that overflows would skip every step, forever); declare the scaler once outside the loop (`let mut scaler = GradScaler::new(..);` before the loop, a field, or a `&mut GradScaler` parameter) and name it here",
        );
        return;
    };
    let Some(name) = p.path.get_ident().map(ToString::to_string) else {
        return; // a path to a static or a constant: not ours to judge
    };
    if name == "self" {
        return;
    }
    let is_param = f.sig.inputs.iter().any(|a| match a {
        syn::FnArg::Typed(pt) => {
            let mut names = std::collections::HashSet::new();
            super::roles::bound_names(&pt.pat, &mut names);
            names.contains(&name)
        }
        syn::FnArg::Receiver(_) => false,
    });
    if is_param {
        return;
    }
    let Some(&(_, depth)) = found.lets.iter().rev().find(|(n, _)| *n == name) else {
        return;
    };
    let roles_depth = found
        .updates
        .iter()
        .chain(&found.backwards)
        .map(|(_, d)| *d)
        .min();
    if depth > 0 {
        cx.error_spanned(
            scaling,
            format!(
                "`{name}` is declared inside a loop or closure of this step, so every iteration starts a new scaler (the loss scale, the half working copy and the skip counters start over); declare it once, before the loop"
            ),
        );
    } else if roles_depth == Some(0) {
        cx.error_spanned(
            scaling,
            format!(
                "`{name}` is declared inside the step function, so every call starts a new scaler (the loss scale, the half working copy and the skip counters start over); pass it in (`{name}: &mut GradScaler`) or keep it in a field"
            ),
        );
    }
}
