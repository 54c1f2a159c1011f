//! The roles of a training step, found wherever they stand (loops, branches, closures,
//! assignments, field places), and the forms they are seen through (`?`, `unwrap`, `expect`,
//! `try_` methods, which stay as the user wrote them around the rewritten call).
//!
//! | role | recognised as | rewritten to |
//! |---|---|---|
//! | optimizer update | `opt.update(master, &grads)` (the model a place) | `scaler.update(master, opt, &grads)` (skips a non-finite step) |
//! | forward of the master | `master.forward(x)`, `master.layer.forward_mut(x)`, `try_forward(_mut)`, where `x` is traced | `scaler.forward(&master, x, \|wc, x\| wc.layer.forward(x))` (half working copy, f32 out) |
//! | backward | `loss.backward()`, `loss.try_backward()` | `scaler.backward(loss)` (half gradients unscaled into the master's) |
//! | gradient allocation, traced input, `zero_grads` | `model.alloc_grads()`, `x.traced(grads)`, `x.trace(grads)`, `model.zero_grads(&mut grads)` | unchanged: the master's f32 gradients flow exactly as in the f32 step (a batch traced with gradients nothing can read it from is passed as a `Batch`: see [`unread_batch`]) |
//!
//! The same calls written by path (`Optimizer::update(opt, model, &grads)`, `Module::forward(&model,
//! x)`) were read as method calls before ([`path_calls`](super::path_calls)).
//!
//! The master is the model the optimizer updates. A forward pass of the master (or of one of its
//! fields) runs on the half working copy when its input is traced: an argument that mentions a
//! traced value (`x.traced(..)`, `x.trace(..)`, a binding made from one, a parameter whose type
//! carries a tape). An untraced forward (evaluation inside the loop) runs on the master in f32.

use std::collections::HashSet;

use quote::ToTokens;
use syn::visit::Visit;

/// The forward methods of dfdx modules.
pub(crate) const FORWARDS: &[&str] = &["forward", "forward_mut", "try_forward", "try_forward_mut"];

/// Methods that put a tape on a tensor.
const TRACING: &[&str] = &["traced", "trace", "leaky_traced", "leaky_trace", "put_tape"];

/// `x.retaped::<OwnedTape<..>>()`: a fresh tape that records (dfdx's way to trace without
/// `alloc_grads`).
fn retapes_owned(m: &syn::ExprMethodCall) -> bool {
    m.method == "retaped"
        && m.turbofish
            .as_ref()
            .is_some_and(|t| t.to_token_stream().to_string().contains("OwnedTape"))
}

/// Whether a forward pass's argument is a batch whose own gradient nothing in the step can read,
/// so that the step may leave it out ([`Batch`](https://docs.rs/mpx-dfdx) in the runtime):
/// - the argument is `x.traced(grads)` or `x.trace(grads)` itself (a tape that starts there, so
///   no op before the forward pass needs the batch's gradient), `x` not a part of a master;
/// - `grads` is a binding of the step (not a parameter: the caller's gradients may keep every
///   tensor's) whose every value comes from `alloc_grads` or a backward pass (gradients that
///   keep the model's tensors alone, so the batch's is dropped);
/// - nothing in the step is leaky (`leaky_trace`, `Gradients::leaky()`: gradients that keep
///   every tensor's).
pub(crate) fn unread_batch(arg: &syn::Expr, f: &syn::ItemFn, masters: &[syn::Expr]) -> bool {
    let body = &*f.block;
    let syn::Expr::MethodCall(m) = place(arg) else {
        return false;
    };
    if !(m.method == "traced" || m.method == "trace") || m.args.len() != 1 {
        return false;
    }
    let receiver = key(&m.receiver);
    if masters
        .iter()
        .any(|master| receiver.starts_with(&key(master)))
    {
        return false;
    }
    let syn::Expr::Path(g) = place(&m.args[0]) else {
        return false;
    };
    let Some(grads) = g.path.get_ident().map(ToString::to_string) else {
        return false;
    };
    if body.to_token_stream().to_string().contains("leaky") {
        return false;
    }
    let mut params = HashSet::new();
    for input in &f.sig.inputs {
        if let syn::FnArg::Typed(pt) = input {
            bound_names(&pt.pat, &mut params);
        }
    }
    if params.contains(&grads) {
        return false;
    }
    let mut bindings = Bindings::default();
    bindings.visit_block(body);
    let values: Vec<String> = bindings
        .pairs
        .iter()
        .filter(|(names, _)| names.contains(&grads))
        .map(|(_, value)| value.to_token_stream().to_string())
        .collect();
    !values.is_empty()
        && values
            .iter()
            .all(|v| v.contains("alloc_grads") || v.contains("backward"))
}

/// Removes parentheses and a leading `&` / `&mut`.
pub(crate) fn place(mut e: &syn::Expr) -> &syn::Expr {
    loop {
        match e {
            syn::Expr::Paren(p) => e = &p.expr,
            syn::Expr::Reference(r) => e = &r.expr,
            syn::Expr::Group(g) => e = &g.expr,
            _ => return e,
        }
    }
}

/// Normalised tokens of a place, to compare the model of a forward pass with the one updated.
/// Leading derefs go too: `*self.model` (a boxed model) and `*m` name the model `self.model` and
/// `m` reach, as method calls auto-deref.
pub(crate) fn key(e: &syn::Expr) -> String {
    let mut e = place(e);
    while let syn::Expr::Unary(u) = e {
        if !matches!(u.op, syn::UnOp::Deref(_)) {
            break;
        }
        e = place(&u.expr);
    }
    e.to_token_stream().to_string().replace(' ', "")
}

/// `opt.update(master, &grads)`: (optimizer, master, grads).
pub(crate) fn as_update(m: &syn::ExprMethodCall) -> Option<(&syn::Expr, &syn::Expr, &syn::Expr)> {
    if m.method != "update" || m.args.len() != 2 {
        return None;
    }
    // The model is a place (`model`, `&mut self.model`, `*m`, `&mut self.models[i]`), never a
    // computed value.
    let is_place = |e: &syn::Expr| {
        matches!(
            place(e),
            syn::Expr::Path(_) | syn::Expr::Field(_) | syn::Expr::Unary(_) | syn::Expr::Index(_)
        )
    };
    is_place(&m.args[0]).then(|| (&*m.receiver, &m.args[0], &m.args[1]))
}

/// `loss.backward()` / `loss.try_backward()`.
pub(crate) fn is_backward(m: &syn::ExprMethodCall) -> bool {
    (m.method == "backward" || m.method == "try_backward") && m.args.is_empty()
}

/// A forward call whose receiver is the master or one of its fields: the field path from the
/// master to the receiver (empty for the master itself).
pub(crate) fn forward_path(m: &syn::ExprMethodCall, master: &str) -> Option<Vec<syn::Member>> {
    if !FORWARDS.iter().any(|f| m.method == f) || m.args.len() != 1 {
        return None;
    }
    let mut path = Vec::new();
    let mut e = place(&m.receiver);
    loop {
        if key(e) == master {
            path.reverse();
            return Some(path);
        }
        match e {
            syn::Expr::Field(f) => {
                path.push(f.member.clone());
                e = place(&f.base);
            }
            _ => return None,
        }
    }
}

/// The masters (by index into `masters`, their keys) that are parts of the model forward call
/// `m` runs, when that model is no master nor part of one: the step updates it part by part,
/// each with its own optimizer. Empty otherwise.
pub(crate) fn parts_of(m: &syn::ExprMethodCall, masters: &[String]) -> Vec<usize> {
    let whole = key(&m.receiver);
    if forward_path(m, &whole).is_none() || masters.iter().any(|k| forward_path(m, k).is_some()) {
        return Vec::new();
    }
    let prefix = format!("{whole}.");
    (0..masters.len())
        .filter(|&i| masters[i].starts_with(&prefix))
        .collect()
}

/// Names whose values carry a tape, found by a flow-insensitive pass over the bindings.
#[derive(Default)]
pub(crate) struct Traced {
    names: HashSet<String>,
}

impl Traced {
    /// Bindings of `f` (and its parameters whose type carries a tape) that hold traced values.
    pub(crate) fn of(f: &syn::ItemFn) -> Self {
        let mut t = Traced::default();
        for arg in &f.sig.inputs {
            if let syn::FnArg::Typed(pt) = arg {
                let ty = pt.ty.to_token_stream().to_string();
                if ty.contains("OwnedTape") || ty.contains("Traced") {
                    bound_names(&pt.pat, &mut t.names);
                }
            }
        }
        let mut bindings = Bindings::default();
        bindings.visit_block(&f.block);
        loop {
            let before = t.names.len();
            for (names, init) in &bindings.pairs {
                if t.mentions(init) {
                    t.names.extend(names.iter().cloned());
                }
            }
            if t.names.len() == before {
                return t;
            }
        }
    }

    /// Whether `e` puts a tape on something or uses a traced binding.
    pub(crate) fn mentions(&self, e: &syn::Expr) -> bool {
        let mut m = Mentions {
            names: &self.names,
            found: false,
        };
        m.visit_expr(e);
        m.found
    }
}

struct Mentions<'a> {
    names: &'a HashSet<String>,
    found: bool,
}

impl<'ast> Visit<'ast> for Mentions<'_> {
    fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
        if TRACING.iter().any(|t| m.method == t) || retapes_owned(m) {
            self.found = true;
        }
        syn::visit::visit_expr_method_call(self, m);
    }
    fn visit_expr_path(&mut self, p: &'ast syn::ExprPath) {
        if let Some(id) = p.path.get_ident()
            && self.names.contains(&id.to_string())
        {
            self.found = true;
        }
    }
    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        // A macro's arguments are tokens, not expressions (`vec![x.traced(grads), ..]`): read
        // them as such.
        self.found |= self.in_tokens(m.tokens.clone());
    }
}

impl Mentions<'_> {
    /// Whether `tokens` call a tracing method (`.traced(`) or name a traced binding (not a
    /// field: `.x`).
    fn in_tokens(&self, tokens: proc_macro2::TokenStream) -> bool {
        any_ident(tokens, &mut |id, after_dot, _| {
            let id = id.to_string();
            if after_dot {
                TRACING.contains(&id.as_str())
            } else {
                self.names.contains(&id)
            }
        })
    }
}

/// Whether a macro's argument tokens call one of `methods` (`. method (..)`), at any depth.
pub(crate) fn calls_in_tokens(tokens: proc_macro2::TokenStream, methods: &[&str]) -> bool {
    any_ident(tokens, &mut |id, after_dot, next| {
        after_dot
            && matches!(next, Some(proc_macro2::TokenTree::Group(g))
                if g.delimiter() == proc_macro2::Delimiter::Parenthesis)
            && methods.iter().any(|m| id == m)
    })
}

/// Whether `hit(ident, after a '.', the next token)` holds for an identifier of `tokens`, at any
/// depth: macro arguments read as tokens, since they are no expressions.
fn any_ident(
    tokens: proc_macro2::TokenStream,
    hit: &mut dyn FnMut(&proc_macro2::Ident, bool, Option<&proc_macro2::TokenTree>) -> bool,
) -> bool {
    let tokens: Vec<proc_macro2::TokenTree> = tokens.into_iter().collect();
    tokens.iter().enumerate().any(|(i, tt)| match tt {
        proc_macro2::TokenTree::Group(g) => any_ident(g.stream(), hit),
        proc_macro2::TokenTree::Ident(id) => {
            let after_dot = i > 0
                && matches!(&tokens[i - 1], proc_macro2::TokenTree::Punct(p) if p.as_char() == '.');
            hit(id, after_dot, tokens.get(i + 1))
        }
        _ => false,
    })
}

/// Every `let` and assignment of the body: (names bound, value).
#[derive(Default)]
struct Bindings {
    pairs: Vec<(Vec<String>, syn::Expr)>,
}

impl Bindings {
    /// Records `value` bound to the names `names` finds (`bound_names` of a pattern,
    /// `assigned_names` of an assignment's left side).
    fn bind(&mut self, names: impl FnOnce(&mut HashSet<String>), value: &syn::Expr) {
        let mut found = HashSet::new();
        names(&mut found);
        self.pairs
            .push((found.into_iter().collect(), value.clone()));
    }
}

impl<'ast> Visit<'ast> for Bindings {
    fn visit_local(&mut self, l: &'ast syn::Local) {
        if let Some(init) = &l.init {
            self.bind(|n| bound_names(&l.pat, n), &init.expr);
        }
        syn::visit::visit_local(self, l);
    }
    fn visit_expr_assign(&mut self, a: &'ast syn::ExprAssign) {
        self.bind(|n| assigned_names(&a.left, n), &a.right);
        syn::visit::visit_expr_assign(self, a);
    }
    fn visit_expr_for_loop(&mut self, f: &'ast syn::ExprForLoop) {
        // `for x in batches_of_traced` binds `x` from the iterator.
        self.bind(|n| bound_names(&f.pat, n), &f.expr);
        syn::visit::visit_expr_for_loop(self, f);
    }
    fn visit_item(&mut self, _: &'ast syn::Item) {}
}

/// The identifiers a pattern binds.
pub(crate) fn bound_names(p: &syn::Pat, out: &mut HashSet<String>) {
    match p {
        syn::Pat::Ident(pi) => {
            out.insert(pi.ident.to_string());
        }
        syn::Pat::Type(pt) => bound_names(&pt.pat, out),
        syn::Pat::Tuple(t) => t.elems.iter().for_each(|e| bound_names(e, out)),
        syn::Pat::TupleStruct(t) => t.elems.iter().for_each(|e| bound_names(e, out)),
        syn::Pat::Reference(r) => bound_names(&r.pat, out),
        syn::Pat::Slice(s) => s.elems.iter().for_each(|e| bound_names(e, out)),
        syn::Pat::Struct(s) => s.fields.iter().for_each(|f| bound_names(&f.pat, out)),
        _ => {}
    }
}

/// The names an assignment's left side writes (`x`, `(a, b)`, `self.field`).
fn assigned_names(e: &syn::Expr, out: &mut HashSet<String>) {
    match e {
        syn::Expr::Path(p) => {
            if let Some(id) = p.path.get_ident() {
                out.insert(id.to_string());
            }
        }
        syn::Expr::Tuple(t) => t.elems.iter().for_each(|e| assigned_names(e, out)),
        other => {
            out.insert(key(other));
        }
    }
}

/// Where each role stands, for validation: the calls themselves and their loop depth.
#[derive(Default)]
pub(crate) struct Found<'a> {
    /// `(call, loop depth)` of each optimizer update.
    pub updates: Vec<(&'a syn::ExprMethodCall, usize)>,
    /// Each backward call and its loop depth.
    pub backwards: Vec<(&'a syn::ExprMethodCall, usize)>,
    /// Each forward call (any receiver) with an argument and its loop depth.
    pub forwards: Vec<(&'a syn::ExprMethodCall, usize)>,
    /// Every other method call, to find hand-written calls of the scaler's own roles.
    pub others: Vec<&'a syn::ExprMethodCall>,
    /// `let` bindings: (name, loop depth, the value bound, when there is one).
    pub lets: Vec<(String, usize, Option<&'a syn::Expr>)>,
    /// Every macro call, whose arguments (tokens) may hide a role.
    pub macros: Vec<&'a syn::Macro>,
    depth: usize,
}

impl<'a> Found<'a> {
    /// Finds the roles in a body.
    pub(crate) fn in_block(block: &'a syn::Block) -> Self {
        let mut f = Found::default();
        f.visit_block(block);
        f
    }
}

impl<'a> Visit<'a> for Found<'a> {
    fn visit_macro(&mut self, m: &'a syn::Macro) {
        self.macros.push(m);
    }
    fn visit_expr_method_call(&mut self, m: &'a syn::ExprMethodCall) {
        if as_update(m).is_some() {
            self.updates.push((m, self.depth));
        } else if is_backward(m) {
            self.backwards.push((m, self.depth));
        } else if FORWARDS.iter().any(|f| m.method == f) && m.args.len() == 1 {
            self.forwards.push((m, self.depth));
        } else {
            self.others.push(m);
        }
        syn::visit::visit_expr_method_call(self, m);
    }
    fn visit_local(&mut self, l: &'a syn::Local) {
        let mut names = HashSet::new();
        bound_names(&l.pat, &mut names);
        let init = l.init.as_ref().map(|i| &*i.expr);
        self.lets
            .extend(names.into_iter().map(|n| (n, self.depth, init)));
        syn::visit::visit_local(self, l);
    }
    fn visit_expr_for_loop(&mut self, e: &'a syn::ExprForLoop) {
        self.visit_expr(&e.expr);
        self.depth += 1;
        self.visit_block(&e.body);
        self.depth -= 1;
    }
    fn visit_expr_while(&mut self, e: &'a syn::ExprWhile) {
        self.depth += 1;
        syn::visit::visit_expr_while(self, e);
        self.depth -= 1;
    }
    fn visit_expr_loop(&mut self, e: &'a syn::ExprLoop) {
        self.depth += 1;
        syn::visit::visit_expr_loop(self, e);
        self.depth -= 1;
    }
    fn visit_expr_closure(&mut self, e: &'a syn::ExprClosure) {
        self.depth += 1;
        syn::visit::visit_expr_closure(self, e);
        self.depth -= 1;
    }
    fn visit_item(&mut self, _: &'a syn::Item) {}
}
