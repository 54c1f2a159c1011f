//! Validation: the function kind, the arguments, a scaler that persists across steps, and the
//! roles of the body ([`super::roles`]).

use proc_macro2::Span;

use super::ast::{Args, Half};

use quote::ToTokens;

use super::roles::{Found, Traced, as_update, calls_in_tokens, forward_path, key, parts_of, place};
use crate::ctxt::{Ctxt, plain_fn_only};

/// Everything `expand` needs.
pub(crate) struct Plan {
    /// The `GradScaler` place.
    pub scaling: syn::Expr,
    /// `None`: the scaler's type decides.
    pub half: Option<Half>,
    /// The master models: the places the optimizer updates, each once, in order.
    pub masters: Vec<syn::Expr>,
    /// Bindings holding traced values.
    pub traced: Traced,
}

/// Checks the function kind, the arguments and the body; records every problem in `cx`.
pub(crate) fn check(args: &Args, f: &syn::ItemFn, cx: &mut Ctxt) -> Option<Plan> {
    plain_fn_only(
        &f.sig,
        "mixed_step",
        "a training step is not const",
        "make the step a plain `fn`",
        cx,
    );
    if let Some(a) = f.attrs.iter().find(|a| {
        a.path()
            .segments
            .last()
            .is_some_and(|s| s.ident == "autocast")
    }) {
        cx.error_spanned(
            a,
            "`#[autocast]` on a `#[mixed_step]`: the step already computes its loss in f32 (the model's output comes back to it in f32); remove `#[autocast]` here, and to run a model's own softmax, norm or sum in f32, put it on that model's forward pass",
        );
    }
    if args.scaling.is_none() {
        cx.push(syn::Error::new(
            Span::call_site(),
            "missing argument `scaling`: name the mixed-precision state, declared once outside the loop, e.g. `#[mixed_step(scaling = scaler)]` with `let mut scaler = mpx::step::GradScaler::default();`",
        ));
    }
    let found = Found::in_block(&f.block);
    if let Some(scaling) = &args.scaling {
        check_persistent(scaling, f, &found, cx);
        check_no_hand_written_roles(scaling, &found, cx);
    }
    let masters = find_masters(f, &found, cx);
    let traced = Traced::of(f);
    check_forwards(f, &found, &masters, &traced, cx);
    if !masters.is_empty() && found.backwards.is_empty() {
        match in_a_macro(&found, &["backward", "try_backward"]) {
            Some(mac) => cx.error_spanned(mac, in_a_macro_message("backward pass")),
            None => cx.error_spanned(
                &f.sig.ident,
                "no backward pass in this step: `#[mixed_step]` needs `grads = loss.backward();` (or `try_backward()`), where it brings the half gradients back unscaled",
            ),
        }
    }
    if masters.is_empty() {
        return None;
    }
    Some(Plan {
        scaling: args.scaling.clone()?,
        half: args.half,
        masters: masters.into_iter().map(|(m, _)| m).collect(),
        traced,
    })
}

/// The masters: every model an optimizer update names, each once, with the update's model
/// tokens (for errors).
fn find_masters<'a>(
    f: &syn::ItemFn,
    found: &Found<'a>,
    cx: &mut Ctxt,
) -> Vec<(syn::Expr, &'a syn::Expr)> {
    let mut masters: Vec<(syn::Expr, &syn::Expr)> = Vec::new();
    for (update, _) in &found.updates {
        let Some((_, master, _)) = as_update(update) else {
            continue;
        };
        if !masters.iter().any(|(m, _)| key(m) == key(master)) {
            masters.push((place(master).clone(), master));
        }
    }
    if masters.is_empty() {
        match in_a_macro(found, &["update", "try_update"]) {
            Some(mac) => cx.error_spanned(mac, in_a_macro_message("optimizer update")),
            None => cx.error_spanned(
                &f.sig.ident,
                "no optimizer update in this step: `#[mixed_step]` needs `opt.update(&mut model, &grads)` to find the f32 master model, and replaces it with an update that skips non-finite steps",
            ),
        }
    }
    masters
}

/// The first macro call of the body whose arguments call one of `methods` (`.update(..)` inside
/// `println!(..)`).
fn in_a_macro<'a>(found: &Found<'a>, methods: &[&str]) -> Option<&'a syn::Macro> {
    found
        .macros
        .iter()
        .copied()
        .find(|m| calls_in_tokens(m.tokens.clone(), methods))
}

/// The error at a macro call that hides the step's `what` in its arguments.
fn in_a_macro_message(what: &str) -> String {
    format!(
        "this {what} is inside a macro's arguments, which `#[mixed_step]` cannot read as code (it rewrites the step's {what}): bind its result with `let` before the macro, and pass the binding"
    )
}

/// Each master has a traced forward pass (of itself or of one of its fields).
fn check_forwards(
    f: &syn::ItemFn,
    found: &Found<'_>,
    masters: &[(syn::Expr, &syn::Expr)],
    traced: &Traced,
    cx: &mut Ctxt,
) {
    let traced_of = |master_key: &str| {
        found
            .forwards
            .iter()
            .find(|(m, _)| forward_path(m, master_key).is_some() && traced.mentions(&m.args[0]))
    };
    // The models whose traced forward passes run in this step, for the messages.
    let ran: Vec<String> = found
        .forwards
        .iter()
        .filter(|(m, _)| traced.mentions(&m.args[0]))
        .map(|(m, _)| key(&m.receiver))
        .collect();
    // a traced forward pass of a model whose parts the step updates, each with its own optimizer
    let keys: Vec<String> = masters.iter().map(|(m, _)| key(m)).collect();
    let of_parts = |i: usize| {
        found
            .forwards
            .iter()
            .any(|(m, _)| traced.mentions(&m.args[0]) && parts_of(m, &keys).contains(&i))
    };
    for (i, (master, written)) in masters.iter().enumerate() {
        let master_key = key(master);
        if let Some(outer) = keys
            .iter()
            .find(|k| master_key.starts_with(&format!("{k}.")))
        {
            cx.error_spanned(
                written,
                format!(
                    "this update names `{master_key}`, a part of `{outer}`, which this step also updates: two optimizers would update `{master_key}`'s tensors, and each tensor's gradients are judged for one update; give each optimizer fields of its own (or update `{outer}` with one optimizer)"
                ),
            );
            continue;
        }
        if traced_of(&master_key).is_some() || of_parts(i) {
            continue;
        }
        let untraced = found
            .forwards
            .iter()
            .find(|(m, _)| forward_path(m, &master_key).is_some());
        match (untraced, ran.first()) {
            (Some((m, _)), _) => cx.error_spanned(
                &m.args[0],
                format!(
                    "this forward pass of `{master_key}` has no traced input: `#[mixed_step]` runs the traced forward pass (`{master_key}.forward(x.traced(grads))`) in half precision; trace the input as the f32 step does"
                ),
            ),
            (None, Some(other)) => cx.error_spanned(
                written,
                format!(
                    "this update names `{master_key}`, but no traced forward pass of `{master_key}` runs in this step: the traced forward pass runs `{other}`; update the model whose forward pass is traced (`opt.update(&mut {other}, &grads)`)"
                ),
            ),
            (None, None) => cx.error_spanned(
                if found.forwards.is_empty() { f.sig.ident.to_token_stream() } else { written.to_token_stream() },
                format!(
                    "no traced forward pass of `{master_key}` (the model the optimizer updates) in this step: `#[mixed_step]` runs `{master_key}.forward(x.traced(grads))` (or `forward_mut`, `try_forward`, a field's forward) on the half working copy; it reads this function's body only, so a forward pass inside a helper function is not seen: call `{master_key}.forward(..)` here and pass its output to the helper"
                ),
            ),
        }
    }
}

/// The scaler's own roles, called by hand inside an attributed step, would run twice.
fn check_no_hand_written_roles(scaling: &syn::Expr, found: &Found<'_>, cx: &mut Ctxt) {
    const ROLES: &[&str] = &["forward", "backward", "update", "update_with"];
    let scaler = key(scaling);
    for m in &found.others {
        if key(&m.receiver) == scaler && ROLES.iter().any(|r| m.method == r) {
            let method = &m.method;
            cx.error_spanned(
                m,
                format!(
                    "`{scaler}.{method}(..)` is written by hand inside a `#[mixed_step]`, which already routes the step's forward pass, `loss.backward()` and `opt.update(..)` through `{scaler}`: the optimizer would run twice; remove this call and keep the f32 code"
                ),
            );
        }
    }
}

/// The root of a scaler expression: the binding or `self` it is reached from, through fields,
/// indexing (`self.scalers[i]`, one scaler per model of an ensemble), derefs, accessors and locks (`self.scaler()`, `scaler.lock().unwrap()`), or `None` for a
/// value built in place.
fn scaler_root(mut e: &syn::Expr) -> Option<&syn::ExprPath> {
    loop {
        e = place(e);
        match e {
            syn::Expr::Field(fe) => e = &fe.base,
            syn::Expr::Index(ix) => e = &ix.expr,
            syn::Expr::Unary(u) if matches!(u.op, syn::UnOp::Deref(_)) => e = &u.expr,
            syn::Expr::MethodCall(m) => e = &m.receiver,
            syn::Expr::Try(t) => e = &t.expr,
            syn::Expr::Path(p) => return Some(p),
            _ => return None,
        }
    }
}

/// The scaler must outlive the step: a place declared once, never a value built per call.
fn check_persistent(scaling: &syn::Expr, f: &syn::ItemFn, found: &Found<'_>, cx: &mut Ctxt) {
    let Some(root) = scaler_root(scaling) else {
        cx.error_spanned(
            scaling,
            "`scaling = ..` builds a new value every time the step runs, so the loss scale, the half working copy and the skip counters would start over on every step (a dynamic scale that overflows would skip every step, forever); declare the scaler once outside the loop (`let mut scaler = GradScaler::default();` before the loop, a field, or a `&mut GradScaler` parameter) and name it here",
        );
        return;
    };
    let Some(name) = root.path.get_ident().map(ToString::to_string) else {
        return; // a path to a static or a constant: not ours to judge
    };
    if name == "self" {
        return;
    }
    let param_type = |name: &str| {
        f.sig.inputs.iter().find_map(|a| match a {
            syn::FnArg::Typed(pt) => {
                let mut names = std::collections::HashSet::new();
                super::roles::bound_names(&pt.pat, &mut names);
                names.contains(name).then_some(&*pt.ty)
            }
            syn::FnArg::Receiver(_) => None,
        })
    };
    if let Some(ty) = param_type(&name) {
        // Only the parameter itself is judged; `scaler.lock()` of a shared handle is fine.
        if matches!(place(scaling), syn::Expr::Path(_)) {
            check_param_type(&name, ty, cx);
        }
        return;
    }
    let Some(&(_, depth, init)) = found.lets.iter().rev().find(|(n, ..)| *n == name) else {
        return;
    };
    // a binding into state that outlives the step (`let Self { opt, .. } = self;`,
    // `let s = &mut self.scaler;`, a part of a parameter) is that state
    let into_state = init
        .and_then(scaler_root)
        .and_then(|r| r.path.get_ident())
        .is_some_and(|r| r == "self" || param_type(&r.to_string()).is_some());
    if into_state {
        return;
    }
    let in_loop = found
        .updates
        .iter()
        .chain(&found.backwards)
        .any(|(_, d)| *d > 0);
    if depth > 0 {
        cx.error_spanned(
            scaling,
            format!(
                "`{name}` is declared inside a loop or closure of this step, so every iteration starts a new scaler (the loss scale, the half working copy and the skip counters start over); declare it once, before the loop"
            ),
        );
    } else if !in_loop {
        cx.error_spanned(
            scaling,
            format!(
                "`{name}` is declared inside the step function, which trains no loop, so every call starts a new scaler (the loss scale, the half working copy and the skip counters start over); pass it in (`{name}: &mut GradScaler`) or keep it in a field"
            ),
        );
    }
}

/// A scaler parameter is a `&mut GradScaler`: by value, each call would train with a fresh
/// copy; by shared reference, it cannot record anything.
fn check_param_type(name: &str, ty: &syn::Type, cx: &mut Ctxt) {
    let is_scaler = |t: &syn::Type| matches!(t, syn::Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == "GradScaler"));
    match ty {
        syn::Type::Reference(r) if r.mutability.is_none() && is_scaler(&r.elem) => cx.error_spanned(
            ty,
            format!(
                "`{name}` is a shared reference to the scaler, which must record every step (the loss scale, the skip counters, the working copy); take it as `{name}: &mut GradScaler`"
            ),
        ),
        t if is_scaler(t) => cx.error_spanned(
            ty,
            format!(
                "`{name}` takes the scaler by value, so every call trains with a fresh copy (the loss scale and the skip counters start over, and the caller's scaler never changes); take it as `{name}: &mut GradScaler`"
            ),
        ),
        _ => {}
    }
}
