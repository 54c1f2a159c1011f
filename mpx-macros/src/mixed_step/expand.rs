//! Expansion: each role call is rewritten in place (see [`super::roles`]); everything else in
//! the body, the signature and the return type stay as written.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit_mut::VisitMut;

use super::ast::{Args, Half};
use super::roles::{Traced, as_update, forward_path, is_backward, key};
use super::valid::Plan;
use crate::ctxt::runtime_path;

/// Rewrites the step according to `plan`.
pub(crate) fn expand(args: &Args, plan: Plan, mut f: syn::ItemFn) -> TokenStream {
    let root = runtime_path(args.krate.as_ref());
    // Without `half = ..`, the scaler's type decides (`GradScaler<f16>` by default).
    let half = match plan.half {
        Some(Half::F16) => quote!(#root::precision::f16),
        Some(Half::AmpF16) => quote!(#root::precision::AMP<#root::precision::f16>),
        Some(Half::Bf16) => quote!(#root::precision::bf16),
        Some(Half::F32) => quote!(f32),
        None => quote!(_),
    };
    // A step generic over its model runs on an f32 master on the CPU: specialise it (dtype ->
    // f32, device -> Cpu) and add the working-copy bounds; the precision must then be concrete.
    // A generic step needs the precision spelled out in its bounds: `half = ..`, else the first
    // argument of a `GradScaler<..>` parameter type, else `f16` (`GradScaler`'s default).
    let concrete = match (&plan.half, scaler_param_type(&f, &plan.scaling)) {
        (Some(_), _) => half.clone(),
        (None, Some(ty)) => scaler_half(&ty).unwrap_or_else(|| quote!(#root::precision::f16)),
        (None, None) => quote!(#root::precision::f16),
    };
    let half = if super::generic::specialise(&mut f, &plan.master, &root, &concrete) {
        concrete
    } else {
        half
    };
    let mut rewriter = Rewriter {
        master_key: key(&plan.master),
        master: plan.master,
        traced: plan.traced,
        scaling: plan.scaling,
        half,
        root,
    };
    rewriter.visit_block_mut(&mut f.block);
    quote!(#f)
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
    scaling: syn::Expr,
    master: syn::Expr,
    master_key: String,
    traced: Traced,
}

/// What a method call is, decided on the call as the user wrote it.
enum Role {
    Forward(Vec<syn::Member>),
    Backward,
    Update,
}

impl Rewriter {
    fn role(&self, m: &syn::ExprMethodCall) -> Option<Role> {
        if as_update(m).is_some_and(|(_, master, _)| key(master) == self.master_key) {
            return Some(Role::Update);
        }
        if is_backward(m) {
            return Some(Role::Backward);
        }
        let path = forward_path(m, &self.master_key)?;
        self.traced
            .mentions(&m.args[0])
            .then_some(Role::Forward(path))
    }

    /// `&mut GradScaler<H, _>`, from the place the user named; every token carries the place's
    /// span, so a wrong type is reported once, there.
    fn scaler(&self) -> TokenStream {
        let span = self.scaling.span();
        let root = respan(self.root.clone(), span);
        let half = respan(self.half.clone(), span);
        let scaling = &self.scaling;
        quote_spanned!(span=>
            #root::step::scaler_of::<#half, _>({
                use #root::step::__macro_support::ByMut as _;
                (#scaling).__mpx_by_mut()
            })
        )
    }

    fn rewrite(&self, role: Role, m: &syn::ExprMethodCall) -> syn::Expr {
        let root = &self.root;
        let scaler = self.scaler();
        let tokens = match role {
            Role::Forward(path) => {
                let master = &self.master;
                let method = &m.method;
                let turbofish = &m.turbofish;
                let arg = &m.args[0];
                let input = quote_spanned!(arg.span()=> __mpx_input);
                let master_ref = quote_spanned!(master.span()=> {
                    use #root::step::__macro_support::ByMut as _;
                    &*(#master).__mpx_by_mut()
                });
                // The master boundary first, at the model's tokens, so its message leads.
                let check_master = quote_spanned!(master.span()=>
                    let _ = #root::boundary::require_master(#master_ref);
                );
                quote!({
                    let __mpx_input = #arg;
                    #check_master
                    #scaler.forward(
                        #master_ref,
                        #input,
                        |__mpx_working, __mpx_x| __mpx_working #(.#path)* .#method #turbofish (__mpx_x),
                    )
                })
            }
            Role::Backward => {
                let loss = &m.receiver;
                let method = &m.method;
                let call = if m.method == "try_backward" {
                    quote!(try_backward_with)
                } else {
                    quote!(backward_with)
                };
                quote!({
                    let __mpx_loss = #loss;
                    #scaler.#call(__mpx_loss, |__mpx_loss| __mpx_loss.#method())
                })
            }
            Role::Update => {
                let Some((opt, master, grads)) = as_update(m) else {
                    return syn::Expr::MethodCall(m.clone());
                };
                let method = &m.method;
                quote!({
                    let __mpx_grads = #root::step::__macro_support::shared(#grads);
                    #scaler.update_with(#master, |__mpx_master| (#opt).#method(__mpx_master, __mpx_grads))
                })
            }
        };
        syn::parse2(tokens).unwrap_or_else(|e| syn::Expr::Verbatim(e.to_compile_error()))
    }
}

/// `tokens` with every span set to `span` (groups included).
fn respan(tokens: TokenStream, span: proc_macro2::Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut t| {
            if let proc_macro2::TokenTree::Group(g) = &t {
                let mut ng = proc_macro2::Group::new(g.delimiter(), respan(g.stream(), span));
                ng.set_span(span);
                t = proc_macro2::TokenTree::Group(ng);
            } else {
                t.set_span(span);
            }
            t
        })
        .collect()
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
