//! Expansion: each call of an operation of the table becomes an f32 region,
//! `FullPrecision::<H>::run(x, |__mpx_x0| __mpx_x0.op(..))`; the rest of the body is untouched.
//!
//! * A chain of table operations is one region: `x.exp().sum()` runs both in f32, with no
//!   rounding to the half type in between (`?` between `try_` forms is absorbed too).
//! * A loss's prediction and target enter as a tuple; inside, the target's f32 copy loses its
//!   tape (`.retaped()`), as dfdx's losses take the target untaped.
//! * Scalar arguments (`eps`, `delta`) stay as written, inside the closure.
//! * A call whose outermost operation is a `try_` form becomes `try_run` (same `Result` type).

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit_mut::{self, VisitMut};

use crate::ops::{Form, Fp32Op, fp32_op};
use crate::syntax::is_self;

/// Method names whose result is an iterator: a table method called on one (`.iter().sum()`) is
/// `Iterator`'s, not dfdx's, and stays as it is.
const ITERATOR_ADAPTERS: &[&str] = &[
    "iter",
    "iter_mut",
    "into_iter",
    "map",
    "filter",
    "filter_map",
    "flat_map",
    "flatten",
    "zip",
    "chain",
    "copied",
    "cloned",
    "enumerate",
    "rev",
    "take",
    "skip",
    "step_by",
    "take_while",
    "skip_while",
    "inspect",
    "peekable",
    "scan",
    "chars",
    "bytes",
    "lines",
    "windows",
    "chunks",
    "keys",
    "values",
    "drain",
];

/// dfdx's free functions for the table's tensor methods (`ln(x)`, `exp(x)`,
/// `softmax::<Axis<1>, _, _, _, _>(x)`, `powi(x, 2)`), rewritten to the method form they stand
/// for (`x.ln()`, `x.softmax::<Axis<1>>()`), so that both forms run in f32. A free function of
/// the table's name whose argument count does not match dfdx's is someone else's, and stays.
pub(crate) struct FreeToMethod;

impl VisitMut for FreeToMethod {
    fn visit_expr_mut(&mut self, e: &mut syn::Expr) {
        visit_mut::visit_expr_mut(self, e);
        let syn::Expr::Call(call) = e else {
            return;
        };
        let syn::Expr::Path(p) = &*call.func else {
            return;
        };
        let Some(last) = p.path.segments.last() else {
            return;
        };
        // `ln(x)`, `dfdx::tensor_ops::ln(x)`; never `f32::exp(k)` or another type's function
        let dfdx_path = p.path.segments.len() == 1
            || p.path.segments.first().is_some_and(|s| s.ident == "dfdx");
        if p.qself.is_some() || call.args.is_empty() || !dfdx_path {
            return;
        }
        let Some(op) = fp32_op(&last.ident.to_string(), Form::Method) else {
            return;
        };
        if call.args.len() != op.args + 1 || !may_be_tensor(&call.args[0], &[]) {
            return;
        }
        // the axes are the first generic argument of the axis-generic functions; the others
        // (shape, dtype, device, tape) are the receiver's
        let turbofish = match &last.arguments {
            syn::PathArguments::AngleBracketed(a) if AXIS_GENERIC.contains(&op.name) => {
                a.args.first().map(|axes| quote!(::<#axes>))
            }
            _ => None,
        };
        let method = syn::Ident::new(op.name, last.ident.span());
        let mut args = call.args.iter();
        let Some(receiver) = args.next() else {
            return;
        };
        let rest: Vec<_> = args.collect();
        // parentheses only where the argument is not already a postfix expression
        let receiver = match receiver {
            syn::Expr::Path(_)
            | syn::Expr::MethodCall(_)
            | syn::Expr::Call(_)
            | syn::Expr::Field(_)
            | syn::Expr::Index(_)
            | syn::Expr::Paren(_)
            | syn::Expr::Try(_) => quote!(#receiver),
            other => quote!((#other)),
        };
        *e = syn::parse_quote_spanned!(call.span()=> #receiver.#method #turbofish (#(#rest),*));
    }
}

/// The table's operations whose dfdx free function takes the reduced axes as its first generic
/// argument.
const AXIS_GENERIC: &[&str] = &[
    "softmax",
    "log_softmax",
    "logsumexp",
    "sum",
    "mean",
    "var",
    "stddev",
    "normalize",
];

/// Rewrites a function body; counts the regions and collects what it cannot rewrite.
pub(crate) struct Rewriter<'a> {
    /// The attribute whose rewrite this is, for its errors.
    attribute: &'static str,
    /// What a region's `run` and `try_run` are called on: `<root>::region::FullPrecision::<H>`.
    region: TokenStream,
    /// Operations left in the half type.
    skip: &'a [String],
    /// How many regions were made.
    pub wrapped: usize,
    /// Arguments that cannot move into a closure.
    pub errors: Vec<syn::Error>,
    /// Type parameters whose values are numbers (`#[half_forward]`'s element type): a receiver
    /// made from one (`E::from_usize(8).unwrap().sqrt()`, `E::ONE`) is no tensor.
    scalars: Vec<syn::Ident>,
}

impl<'a> Rewriter<'a> {
    /// A rewriter whose regions are `<root>::region::FullPrecision::<half>`.
    pub(crate) fn new(root: &TokenStream, half: &syn::Type, skip: &'a [String]) -> Self {
        Self::with_region(
            "#[autocast]",
            quote!(#root::region::FullPrecision::<#half>),
            skip,
        )
    }

    /// A rewriter for `attribute` whose regions are `region::run` and `region::try_run`
    /// (`#[half_forward]`'s run in their inputs' own element type).
    pub(crate) fn with_region(
        attribute: &'static str,
        region: TokenStream,
        skip: &'a [String],
    ) -> Self {
        Self {
            attribute,
            region,
            skip,
            wrapped: 0,
            errors: Vec::new(),
            scalars: Vec::new(),
        }
    }

    /// The same, with `scalars` as the type parameters whose values are numbers.
    pub(crate) fn with_scalars(mut self, scalars: Vec<syn::Ident>) -> Self {
        self.scalars = scalars;
        self
    }

    /// The table row of `e` when `e` is a call this macro wraps, whether it is a `try_` form,
    /// and the span its region takes (the method or function name).
    fn op_of(&self, e: &syn::Expr) -> Option<(&'static Fp32Op, bool, Span)> {
        match e {
            syn::Expr::MethodCall(mc) => {
                let name = mc.method.to_string();
                let (base, fallible) = match name.strip_prefix("try_") {
                    Some(base) => (base, true),
                    None => (name.as_str(), false),
                };
                let op = fp32_op(base, Form::Method)?;
                let iterator_sum =
                    base == "sum" && mc.turbofish.as_ref().is_some_and(|t| t.args.len() == 1);
                (mc.args.len() == op.args
                    && !self.skipped(op)
                    && !iterator_sum
                    && may_be_tensor(&mc.receiver, &self.scalars))
                .then(|| (op, fallible, mc.method.span()))
            }
            syn::Expr::Call(call) => {
                let syn::Expr::Path(p) = &*call.func else {
                    return None;
                };
                if p.qself.is_some() {
                    return None;
                }
                let last = p.path.segments.last()?;
                let op = fp32_op(&last.ident.to_string(), Form::Function)?;
                (call.args.len() == op.args && !self.skipped(op))
                    .then(|| (op, false, last.ident.span()))
            }
            _ => None,
        }
    }

    fn skipped(&self, op: &Fp32Op) -> bool {
        self.skip.iter().any(|s| s == op.name)
    }

    /// Moves the operations of `e` (a wrapped call) into `region`'s closure body; what they
    /// work on becomes the region's inputs.
    fn absorb(&mut self, e: syn::Expr, region: &mut Region) -> syn::Expr {
        let op = self.op_of(&e).map(|(op, _, _)| op.form);
        match (e, op) {
            (syn::Expr::MethodCall(mut mc), Some(Form::Method)) => {
                let name = mc.method.to_string();
                if let Some(base) = name.strip_prefix("try_") {
                    mc.method = syn::Ident::new(base, mc.method.span());
                }
                let receiver = std::mem::replace(&mut *mc.receiver, placeholder());
                *mc.receiver = self.absorb_receiver(receiver, region);
                for arg in &mut mc.args {
                    self.scalar_arg(arg, &mc.method);
                }
                syn::Expr::MethodCall(mc)
            }
            (syn::Expr::Call(mut call), Some(Form::Function)) if !region.has_loss => {
                region.has_loss = true;
                let name = match &*call.func {
                    syn::Expr::Path(p) => p.path.segments.last().map(|s| s.ident.clone()),
                    _ => None,
                }
                .unwrap_or_else(|| format_ident!("loss"));
                let mut args = std::mem::take(&mut call.args).into_iter();
                if let Some(prediction) = args.next() {
                    let inside = self.absorb_receiver(prediction, region);
                    call.args.push(inside);
                }
                if let Some(mut target) = args.next() {
                    self.visit_expr_mut(&mut target);
                    let x = region.input(target);
                    call.args.push(syn::parse_quote!(#x.retaped()));
                }
                for mut arg in args {
                    self.scalar_arg(&mut arg, &name);
                    call.args.push(arg);
                }
                syn::Expr::Call(call)
            }
            (mut other, _) => {
                // an input is an argument of the region's call: parentheses it no longer
                // needs would warn in the user's crate (`(a * s).exp()`)
                while let syn::Expr::Paren(p) = other {
                    other = *p.expr;
                }
                self.visit_expr_mut(&mut other);
                let x = region.input(other);
                syn::parse_quote!(#x)
            }
        }
    }

    /// A receiver (or a loss's prediction): another operation of the table joins the region,
    /// through parentheses and through the `?` of a `try_` form; anything else is an input.
    fn absorb_receiver(&mut self, e: syn::Expr, region: &mut Region) -> syn::Expr {
        match e {
            syn::Expr::Paren(mut p) if self.joins(&p.expr, region) => {
                let inner = std::mem::replace(&mut *p.expr, placeholder());
                *p.expr = self.absorb(inner, region);
                syn::Expr::Paren(p)
            }
            syn::Expr::Try(t) if self.joins(&t.expr, region) && is_try_form(&t.expr) => {
                self.absorb(*t.expr, region)
            }
            other => self.absorb(other, region),
        }
    }

    /// `true` when `e` is an operation that can join `region` (one loss per region, so a
    /// region has at most two inputs).
    fn joins(&self, e: &syn::Expr, region: &Region) -> bool {
        match self.op_of(e) {
            Some((op, _, _)) => op.form == Form::Method || !region.has_loss,
            None => false,
        }
    }

    /// A scalar argument (`eps`, `delta`): kept as written inside the closure, after its own
    /// calls are rewritten; it must not leave the function from there.
    fn scalar_arg(&mut self, arg: &mut syn::Expr, op: &syn::Ident) {
        let mut escapes = Escapes::default();
        escapes.visit_expr_mut(arg);
        for (span, what) in escapes.found {
            self.errors.push(syn::Error::new(
                span,
                format!(
                    "`{}` moves the arguments of `{op}` into the closure of an f32 region, where `{what}` cannot leave the function; bind this argument to a `let` before the call",
                    self.attribute
                ),
            ));
        }
        self.visit_expr_mut(arg);
    }
}

impl VisitMut for Rewriter<'_> {
    fn visit_expr_mut(&mut self, e: &mut syn::Expr) {
        let Some((_, fallible, span)) = self.op_of(e) else {
            visit_mut::visit_expr_mut(self, e);
            return;
        };
        let call = std::mem::replace(e, placeholder());
        let mut region = Region::default();
        let body = self.absorb(call, &mut region);
        let run = if fallible {
            quote_spanned!(span=> try_run)
        } else {
            quote_spanned!(span=> run)
        };
        let (input, pat) = region.input_and_pattern();
        // the region's path at the operation too, so that an error on the call (an input that
        // is no tensor) points there
        let path = crate::syntax::respan(self.region.clone(), span);
        let region = quote_spanned!(span=> #path::#run(#input, |#pat| #body));
        // parsed, so that a later pass (`#[half_forward]`'s concrete types) sees inside it
        *e = syn::parse2(region.clone()).unwrap_or(syn::Expr::Verbatim(region));
        self.wrapped += 1;
    }

    // A nested item (a helper `fn` inside the body) is not part of this function.
    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
}

/// The inputs of one region.
#[derive(Default)]
struct Region {
    inputs: Vec<syn::Expr>,
    has_loss: bool,
}

impl Region {
    /// Adds an input; returns the name the closure gives its f32 copy.
    fn input(&mut self, e: syn::Expr) -> syn::Ident {
        let name = format_ident!("__mpx_x{}", self.inputs.len());
        self.inputs.push(e);
        name
    }

    /// `x` and `__mpx_x0`, or `(x, y,)` and `(__mpx_x0, __mpx_x1,)`.
    fn input_and_pattern(&self) -> (TokenStream, TokenStream) {
        let names: Vec<syn::Ident> = (0..self.inputs.len())
            .map(|i| format_ident!("__mpx_x{}", i))
            .collect();
        let inputs = &self.inputs;
        if let ([input], [name]) = (inputs.as_slice(), names.as_slice()) {
            (quote!(#input), quote!(#name))
        } else {
            (quote!((#(#inputs,)*)), quote!((#(#names,)*)))
        }
    }
}

/// A temporary expression while a node is moved out of the tree.
fn placeholder() -> syn::Expr {
    syn::Expr::Verbatim(TokenStream::new())
}

/// `true` for a method call of a `try_` form (its `?` can be absorbed into the region).
fn is_try_form(e: &syn::Expr) -> bool {
    matches!(e, syn::Expr::MethodCall(mc) if mc.method.to_string().starts_with("try_"))
}

/// `false` for receivers that cannot be a dfdx tensor: literals, ranges, arrays, tuples,
/// references, casts, macros, `self` and its fields, iterators (`.iter().sum()`), and values made
/// from a type parameter of `scalars` through the methods on them (`E::from_usize(8).unwrap()`).
fn may_be_tensor(receiver: &syn::Expr, scalars: &[syn::Ident]) -> bool {
    if from_scalar(receiver, scalars) {
        return false;
    }
    match receiver {
        syn::Expr::Lit(_)
        | syn::Expr::Range(_)
        | syn::Expr::Array(_)
        | syn::Expr::Repeat(_)
        | syn::Expr::Tuple(_)
        | syn::Expr::Reference(_)
        | syn::Expr::Cast(_)
        | syn::Expr::Macro(_) => false,
        syn::Expr::Unary(u) => !matches!(&*u.expr, syn::Expr::Lit(_)),
        syn::Expr::Paren(p) => may_be_tensor(&p.expr, scalars),
        syn::Expr::Group(g) => may_be_tensor(&g.expr, scalars),
        syn::Expr::Path(p) => !p.path.is_ident("self"),
        // `self.ln.normalize(x)` is a module's method: a tensor field is moved out only through
        // `.clone()` (`self.w.clone().exp()`, which is wrapped).
        syn::Expr::Field(f) => !is_self(&f.base),
        syn::Expr::MethodCall(mc) => {
            let name = mc.method.to_string();
            !ITERATOR_ADAPTERS.contains(&name.as_str())
        }
        _ => true,
    }
}

/// Whether `e`'s chain of method calls starts at an item of a type parameter in `scalars`
/// (`E::ONE`, `E::from_f32(..)`): a number of that type, then methods on it.
fn from_scalar(e: &syn::Expr, scalars: &[syn::Ident]) -> bool {
    let through =
        |p: &syn::Path| p.segments.len() >= 2 && scalars.iter().any(|s| p.segments[0].ident == *s);
    match e {
        syn::Expr::MethodCall(mc) => from_scalar(&mc.receiver, scalars),
        syn::Expr::Try(t) => from_scalar(&t.expr, scalars),
        syn::Expr::Paren(p) => from_scalar(&p.expr, scalars),
        syn::Expr::Group(g) => from_scalar(&g.expr, scalars),
        syn::Expr::Path(p) => p.qself.is_none() && through(&p.path),
        syn::Expr::Call(c) => {
            matches!(&*c.func, syn::Expr::Path(p) if p.qself.is_none() && through(&p.path))
        }
        _ => false,
    }
}

/// Finds what cannot move into a closure: `?`, `return`, `.await`, `yield`, and `break` or
/// `continue` outside a loop of the same expression. Closures, async blocks and items are not
/// entered (their control flow is their own).
#[derive(Default)]
struct Escapes {
    found: Vec<(Span, &'static str)>,
    loops: usize,
}

impl VisitMut for Escapes {
    fn visit_expr_mut(&mut self, e: &mut syn::Expr) {
        let what = match e {
            syn::Expr::Try(t) => Some((t.question_token.span(), "?")),
            syn::Expr::Return(r) => Some((r.return_token.span(), "return")),
            syn::Expr::Await(a) => Some((a.await_token.span(), ".await")),
            syn::Expr::Yield(y) => Some((y.yield_token.span(), "yield")),
            syn::Expr::Break(b) if self.loops == 0 => Some((b.break_token.span(), "break")),
            syn::Expr::Continue(c) if self.loops == 0 => {
                Some((c.continue_token.span(), "continue"))
            }
            syn::Expr::Closure(_) | syn::Expr::Async(_) => return,
            _ => None,
        };
        if let Some(found) = what {
            self.found.push(found);
        }
        let is_loop = matches!(
            e,
            syn::Expr::Loop(_) | syn::Expr::While(_) | syn::Expr::ForLoop(_)
        );
        self.loops += usize::from(is_loop);
        visit_mut::visit_expr_mut(self, e);
        self.loops -= usize::from(is_loop);
    }

    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
}
