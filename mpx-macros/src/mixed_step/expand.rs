//! Expansion: each role call is rewritten in place (see [`super::roles`]); everything else in
//! the body, the signature and the return type stay as written.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit_mut::VisitMut;

use super::ast::{Args, Half};
use super::roles::{
    Traced, as_update, forward_path, is_backward, key, parts_of, place, unread_batch,
};
use super::valid::Plan;
use crate::ctxt::runtime_path;
use crate::syntax::respan;

/// Rewrites the step according to `plan`.
pub(crate) fn expand(args: &Args, plan: Plan, mut f: syn::ItemFn) -> TokenStream {
    let root = runtime_path(args.krate.as_ref());
    let half_of = |h: Half| match h {
        Half::F16 => quote!(#root::precision::f16),
        Half::AmpF16 => quote!(#root::precision::AMP<#root::precision::f16>),
        Half::Bf16 => quote!(#root::precision::bf16),
        Half::F32 => quote!(f32),
    };
    // Without `half = ..`, the scaler's type decides (`GradScaler<f16>` by default).
    let half = plan.half.map_or_else(|| quote!(_), half_of);
    let declared = scaler_param_type(&f, &plan.scaling);
    // A step generic over its model runs on an f32 master on the CPU: specialise it (dtype ->
    // f32, device -> Cpu) and add the working-copy bounds; the precision must then be concrete:
    // `half = ..`, else the first argument of a `GradScaler<..>` parameter type, else `f16`.
    let concrete = match (plan.half, &declared) {
        (Some(h), _) => half_of(h),
        (None, Some(ty)) => scaler_half(ty).unwrap_or_else(|| quote!(#root::precision::f16)),
        (None, None) => quote!(#root::precision::f16),
    };
    // The device is the one the step's types name: dfdx's `Cuda` where the step names it
    // anywhere (its signature, a local's type, a `Cuda::default()`), else the `Cpu`.
    let cuda = names_cuda(quote!(#f));
    let generic = plan
        .masters
        .iter()
        .any(|m| super::generic::specialise(&mut f, m, &root, &concrete, cuda));
    let half = if generic { concrete } else { half };
    annotate_local_scaler(&mut f, &plan.scaling, plan.half.map(half_of), &root, cuda);
    let batches: Vec<String> = super::roles::Found::in_block(&f.block)
        .forwards
        .iter()
        .map(|(m, _)| &m.args[0])
        .filter(|a| unread_batch(a, &f, &plan.masters))
        .map(key)
        .collect();
    let mut rewriter = Rewriter {
        masters: plan.masters.iter().map(|m| (key(m), m.clone())).collect(),
        traced: plan.traced,
        scaling: plan.scaling,
        half,
        // `half = ..` written: obeyed or rejected, never an f32 fallback
        strict: plan.half.is_some(),
        batches,
        root,
    };
    rewriter.visit_block_mut(&mut f.block);
    // The generated calls are methods of these traits (so that they auto-ref and auto-deref as
    // the user's own calls do), and the masters' state lives in one local of the step: both at
    // the top of the body, so that no generated call sits in a block of its own (a block would
    // drop a lock guard's temporary too early).
    let root = &rewriter.root;
    f.block.stmts.insert(
        0,
        syn::parse_quote!(
            let __mpx_masters = #root::__private::Masters::new();
        ),
    );
    f.block.stmts.insert(
        0,
        syn::parse_quote!(
            #[allow(unused_imports)]
            use #root::__private::{
                ByMut as _, Master as _, ViaFull as _, ViaHalf as _, ViaHalfNative as _, ViaMapped as _,
                ViaRejected as _,
            };
        ),
    );
    quote!(#f)
}

/// Whether `tokens` name dfdx's `Cuda` device (as a path segment anywhere).
fn names_cuda(tokens: TokenStream) -> bool {
    tokens.into_iter().any(|t| match t {
        proc_macro2::TokenTree::Ident(i) => i == "Cuda",
        proc_macro2::TokenTree::Group(g) => names_cuda(g.stream()),
        _ => false,
    })
}

/// Gives a local scaler declared as `GradScaler::default()` / `GradScaler::new(..)` a type.
struct Annotate<'a> {
    name: &'a syn::Ident,
    /// For `GradScaler::default()`: the loss scale's type is the default one too.
    defaults: syn::Type,
    /// For `GradScaler::new(scale)`: the loss scale's type is the argument's.
    with_scale: syn::Type,
}
impl VisitMut for Annotate<'_> {
    fn visit_local_mut(&mut self, l: &mut syn::Local) {
        if let syn::Pat::Ident(pi) = &l.pat
            && pi.ident == *self.name
            && let Some(init) = &l.init
            && let syn::Expr::Call(call) = &*init.expr
            && let syn::Expr::Path(fp) = &*call.func
            && fp.path.segments.len() == 2
            && fp.path.segments[0].ident == "GradScaler"
            && fp.path.segments[0].arguments.is_none()
        {
            let pat = l.pat.clone();
            let ty = if call.args.is_empty() {
                self.defaults.clone()
            } else {
                self.with_scale.clone()
            };
            l.pat = syn::Pat::Type(syn::PatType {
                attrs: Vec::new(),
                pat: Box::new(pat),
                colon_token: syn::Token![:](proc_macro2::Span::call_site()),
                ty: Box::new(ty),
            });
        }
        syn::visit_mut::visit_local_mut(self, l);
    }
    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
}

/// A scaler declared in the step as `let mut scaler = GradScaler::default();` (or
/// `GradScaler::new(..)`) names no precision, which Rust cannot infer there: it gets the type
/// it means, `GradScaler` with its defaults (or `half = ..`'s precision).
fn annotate_local_scaler(
    f: &mut syn::ItemFn,
    scaling: &syn::Expr,
    half: Option<TokenStream>,
    root: &TokenStream,
    cuda: bool,
) {
    let syn::Expr::Path(p) = super::roles::place(scaling) else {
        return;
    };
    let Some(name) = p.path.get_ident() else {
        return;
    };
    let h = half.unwrap_or_else(|| quote!(#root::precision::f16));
    let (defaults, with_scale) = if cuda {
        let cuda = quote!(#root::__dfdx::tensor::Cuda);
        (
            syn::parse_quote!(#root::step::GradScaler<#h, #root::scaling::DynamicLossScale, #cuda>),
            syn::parse_quote!(#root::step::GradScaler<#h, _, #cuda>),
        )
    } else {
        (
            syn::parse_quote!(#root::step::GradScaler<#h>),
            syn::parse_quote!(#root::step::GradScaler<#h, _>),
        )
    };
    Annotate {
        name,
        defaults,
        with_scale,
    }
    .visit_block_mut(&mut f.block);
}

/// The type a `&mut` scaler parameter points to (`scaler: &mut GradScaler<bf16>`), if the
/// scaling place is such a parameter.
fn scaler_param_type(f: &syn::ItemFn, scaling: &syn::Expr) -> Option<syn::Type> {
    let syn::Expr::Path(p) = super::roles::place(scaling) else {
        return None;
    };
    let name = p.path.get_ident()?;
    f.sig.inputs.iter().find_map(|a| match a {
        syn::FnArg::Typed(pt) if matches!(&*pt.pat, syn::Pat::Ident(pi) if pi.ident == *name) => {
            match &*pt.ty {
                syn::Type::Reference(r) => Some((*r.elem).clone()),
                other => Some(other.clone()),
            }
        }
        _ => None,
    })
}

/// `H` of a `GradScaler<H, ..>` type, as written.
fn scaler_half(ty: &syn::Type) -> Option<TokenStream> {
    let syn::Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    if last.ident != "GradScaler" {
        return None;
    }
    match &last.arguments {
        syn::PathArguments::AngleBracketed(a) => a.args.iter().find_map(|g| match g {
            syn::GenericArgument::Type(t) => Some(quote!(#t)),
            _ => None,
        }),
        _ => None,
    }
}

struct Rewriter {
    root: TokenStream,
    half: TokenStream,
    /// Whether `half = ..` was written (a forward pass that cannot run in it is an error).
    strict: bool,
    scaling: syn::Expr,
    /// Each master's key and place.
    masters: Vec<(String, syn::Expr)>,
    traced: Traced,
    /// The forward arguments (by key) whose gradient nothing can read: passed as `Batch`.
    batches: Vec<String>,
}

/// What a method call is, decided on the call as the user wrote it; the index is the master's.
enum Role {
    Forward(Target, Vec<syn::Member>),
    Backward,
    Update(usize),
}

/// The model a forward pass runs.
enum Target {
    /// A master (the forward pass is of it, or of one of its fields: the role's path).
    Master(usize),
    /// A model the step updates part by part (its place, and the masters that are its parts:
    /// an optimizer for each).
    Parts(Box<syn::Expr>, Vec<usize>),
}

impl Rewriter {
    fn master_of(&self, e: &syn::Expr) -> Option<usize> {
        let k = key(e);
        self.masters.iter().position(|(m, _)| *m == k)
    }

    fn role(&self, m: &syn::ExprMethodCall) -> Option<Role> {
        if let Some((_, master, _)) = as_update(m)
            && let Some(i) = self.master_of(master)
        {
            return Some(Role::Update(i));
        }
        if is_backward(m) {
            return Some(Role::Backward);
        }
        if !self.traced.mentions(m.args.first()?) {
            return None;
        }
        let of_master = self.masters.iter().enumerate().find_map(|(i, (k, _))| {
            forward_path(m, k).map(|p| Role::Forward(Target::Master(i), p))
        });
        of_master.or_else(|| {
            // a forward pass of a model whose parts the step updates, each on its own
            let keys: Vec<String> = self.masters.iter().map(|(k, _)| k.clone()).collect();
            let parts = parts_of(m, &keys);
            (!parts.is_empty()).then(|| {
                Role::Forward(
                    Target::Parts(Box::new(place(&m.receiver).clone()), parts),
                    Vec::new(),
                )
            })
        })
    }

    /// `&mut GradScaler<H, _>`, from the place the user named; every token carries the place's
    /// span, so a wrong type is reported once, there.
    fn scaler(&self) -> TokenStream {
        let span = self.scaling.span();
        let root = respan(self.root.clone(), span);
        let half = respan(self.half.clone(), span);
        let scaling = &self.scaling;
        quote_spanned!(span=>
            #root::__private::scaler_of::<#half, _>((#scaling).__mpx_by_mut())
        )
    }

    /// Master `i`, [`borrowed`].
    fn master(&self, i: usize, mutable: bool) -> TokenStream {
        borrowed(&self.masters[i].1, mutable)
    }

    fn rewrite(&self, role: Role, m: &syn::ExprMethodCall) -> syn::Expr {
        let root = &self.root;
        let scaler = self.scaler();
        let tokens = match role {
            Role::Forward(target, path) => {
                let (place, parts) = match &target {
                    Target::Master(i) => (&self.masters[*i].1, &[][..]),
                    Target::Parts(place, parts) => (&**place, &parts[..]),
                };
                let master_ref = borrowed(place, false);
                // `forward_mut` needs the master mutably where it runs in f32 on the master.
                let mutable = m.method.to_string().ends_with("_mut");
                let master_for_call = borrowed(place, mutable);
                let method = &m.method;
                let turbofish = &m.turbofish;
                let arg = &m.args[0];
                let input = if self.batches.contains(&key(arg)) {
                    quote_spanned!(arg.span()=> #root::step::Batch(#arg))
                } else {
                    quote!(#arg)
                };
                // The master boundary first, at the model's tokens, so its message leads.
                let span = place.span();
                let check_master = quote_spanned!(span=>
                    let _ = #root::boundary::require_master(#master_ref);
                );
                // the parts the step updates, each with its own optimizer, of a model it updates
                // no whole of
                let (parts, with_parts) = if parts.is_empty() {
                    (quote!(), quote!())
                } else {
                    let refs = parts.iter().map(|&j| self.master(j, false));
                    (
                        quote!(let __mpx_parts = ::std::vec![#(#root::__private::part(&__mpx_masters, #refs)),*];),
                        quote!(.parts(__mpx_parts)),
                    )
                };
                let call = match (path.is_empty(), mutable) {
                    (false, _) => quote!(#root::__private::call::Field),
                    (true, false) => quote!(#root::__private::call::Forward),
                    (true, true) => quote!(#root::__private::call::ForwardMut),
                };
                let fallback = if self.strict {
                    quote!(#root::__private::fallback::Reject)
                } else {
                    quote!(#root::__private::fallback::Warn)
                };
                // spanned at the user's call: an f32 fallback's warning points there
                let run = quote_spanned!(m.span()=> __mpx_forward);
                quote!({
                    let __mpx_input = #input;
                    #check_master
                    #parts
                    (&mut &mut #root::__private::forward::<_, _, _, _, _, #call, #fallback>(
                        #scaler,
                        &__mpx_masters,
                        #master_for_call,
                        __mpx_input,
                    )#with_parts)
                    .#run(|__mpx_working, __mpx_x| __mpx_working #(.#path)* .#method #turbofish (__mpx_x))
                })
            }
            Role::Backward => {
                // `(a + b).backward()`: bound without its parentheses (`let __mpx_loss = (a +
                // b);` would be linted at the user's tokens as unused parentheses)
                let mut loss = &*m.receiver;
                while let syn::Expr::Paren(p) = loss {
                    loss = &p.expr;
                }
                let method = &m.method;
                let call = if m.method == "try_backward" {
                    quote!(try_backward)
                } else {
                    quote!(backward)
                };
                quote!({
                    let __mpx_loss = #loss;
                    #root::__private::#call(#scaler, __mpx_loss, |__mpx_loss| __mpx_loss.#method())
                })
            }
            Role::Update(i) => {
                let Some((opt, written, grads)) = as_update(m) else {
                    return syn::Expr::MethodCall(m.clone());
                };
                let method = &m.method;
                let master_mut = self.master(i, true);
                // the update's site (the once-per-iteration scale adjustment tells updates apart
                // by it): a static of its own
                let begin = quote!(#root::__private::begin_update);
                // The step's own optimizer call runs as written (its model argument keeps
                // Rust's auto-ref and auto-deref), between the scaler's two halves, each its own
                // statement (a scaler behind a lock is locked once per half); the expression has
                // the type the step's own call has.
                // The gradients argument in a `let` of its own: `&loss.backward()` written inline
                // keeps its temporary alive through the call (Rust's temporary lifetime
                // extension), as in the step's own call.
                quote!({
                    let __mpx_grads_arg = #grads;
                    let __mpx_grads = #root::__private::shared(__mpx_grads_arg);
                    static __MPX_SITE: u8 = 0;
                    let __mpx_begun = #begin(#scaler, &__mpx_masters, #master_mut, &__MPX_SITE);
                    match __mpx_begun {
                        ::core::result::Result::Ok(__mpx_verdict) => {
                            let __mpx_ran = if __mpx_verdict.applies() {
                                ::core::option::Option::Some((#opt).#method(#written, __mpx_grads))
                            } else {
                                ::core::option::Option::None
                            };
                            #root::__private::end_update(#scaler, __mpx_verdict, __mpx_ran)
                        }
                        ::core::result::Result::Err(__mpx_e) => {
                            ::core::result::Result::Err(::core::convert::From::from(__mpx_e))
                        }
                    }
                })
            }
        };
        syn::parse2(tokens).unwrap_or_else(|e| syn::Expr::Verbatim(e.to_compile_error()))
    }
}

/// `place`, borrowed (`&M`, or `&mut M` when `mutable`) however the user holds it (a value, a
/// `&mut` binding, a field, a box), as method calls auto-deref; spanned at the place's tokens,
/// so a half model is reported there.
fn borrowed(place: &syn::Expr, mutable: bool) -> TokenStream {
    let span = place.span();
    let method = if mutable {
        quote_spanned!(span=> __mpx_master_mut)
    } else {
        quote_spanned!(span=> __mpx_master)
    };
    quote_spanned!(span=> (#place).#method())
}

impl VisitMut for Rewriter {
    fn visit_expr_mut(&mut self, e: &mut syn::Expr) {
        let role = match &*e {
            syn::Expr::MethodCall(m) => self.role(m),
            _ => None,
        };
        syn::visit_mut::visit_expr_mut(self, e);
        if let (Some(role), syn::Expr::MethodCall(m)) = (role, &*e) {
            *e = self.rewrite(role, m);
        }
    }

    /// Items nested in the body (helper functions) are not part of the step.
    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
}
