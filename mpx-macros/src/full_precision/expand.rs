//! Expansion: the body moves into a closure that `FullPrecision::<H>::run` (or `run_with`) calls
//! on f32 copies of the tensor arguments.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};
use syn::visit_mut::VisitMut;

use super::ast::Args;
use super::valid::{Params, Plan};
use crate::syntax::is_self;

/// Name of the f32 parameter copy inside the closure when `params = self.field`.
const PARAMS: &str = "__mpx_params";

/// Rewrites `f` according to `plan`.
pub(crate) fn expand(args: &Args, plan: &Plan, mut f: syn::ItemFn) -> TokenStream {
    let root = crate::ctxt::runtime_path(args.krate.as_ref());
    let half = &plan.half;

    // Tensor arguments get plain names in the signature; their patterns move to the closure.
    let mut names = Vec::new();
    let mut pats = Vec::new();
    for (n, &i) in plan.tensor_args.iter().enumerate() {
        if let Some(syn::FnArg::Typed(pt)) = f.sig.inputs.iter_mut().nth(i) {
            let name = format_ident!("__mpx_x{}", n);
            pats.push((*pt.pat).clone());
            *pt.pat = syn::parse_quote!(#name);
            names.push(name);
        }
    }
    let (input, pat) = if names.len() == 1 {
        let (name, pat) = (&names[0], &pats[0]);
        (quote!(#name), quote!(#pat))
    } else {
        (quote!((#(#names,)*)), quote!((#(#pats,)*)))
    };

    let region = quote!(#root::region::FullPrecision::<#half>);
    let mut block = (*f.block).clone();
    let call = match &plan.params {
        None => {
            CheckLayers { root: &root }.visit_block_mut(&mut block);
            quote!(#region::run(#input, |#pat| #block))
        }
        Some(Params::Arg { ident, by_ref }) => {
            let arg = if *by_ref {
                quote!(#ident)
            } else {
                quote!(&#ident)
            };
            quote!(#region::run_with(#arg, #input, |#ident, #pat| #block))
        }
        Some(Params::Field(field)) => {
            let p = format_ident!("{}", PARAMS);
            ReplaceField {
                member: &field.member,
                with: syn::parse_quote!((*#p)),
            }
            .visit_block_mut(&mut block);
            quote!(#region::run_with(&#field, #input, |#p, #pat| #block))
        }
    };
    *f.block = syn::parse_quote!({ #call });
    quote!(#f)
}

/// Replaces every `self.<member>` in the body with the f32 parameter copy.
struct ReplaceField<'a> {
    member: &'a syn::Member,
    with: syn::Expr,
}

impl VisitMut for ReplaceField<'_> {
    fn visit_expr_mut(&mut self, e: &mut syn::Expr) {
        if let syn::Expr::Field(ef) = e
            && is_self(&ef.base)
            && ef.member == *self.member
        {
            *e = self.with.clone();
            return;
        }
        syn::visit_mut::visit_expr_mut(self, e);
    }
}

/// Without `params`, routes each `self.<field>.forward(x)` / `try_forward(x)` of the body
/// through `RegionLayer`, whose error says to name the layer with `params` when its parameters
/// are not f32 (dfdx's own error would name a matmul of mismatched element types).
struct CheckLayers<'a> {
    root: &'a TokenStream,
}

impl VisitMut for CheckLayers<'_> {
    fn visit_expr_mut(&mut self, e: &mut syn::Expr) {
        syn::visit_mut::visit_expr_mut(self, e);
        let syn::Expr::MethodCall(m) = e else {
            return;
        };
        let on_self_field = matches!(&*m.receiver, syn::Expr::Field(f) if is_self(&f.base));
        if !on_self_field || m.args.len() != 1 || m.turbofish.is_some() {
            return;
        }
        let root = self.root;
        let (layer, x) = (&m.receiver, &m.args[0]);
        // the error points at the user's call
        let span = syn::spanned::Spanned::span(&m.method);
        let call = quote::quote_spanned!(span=> #root::region::RegionLayer::region_try_forward(&#layer, #x));
        if m.method == "forward" {
            *e = syn::parse_quote!(#call.unwrap());
        } else if m.method == "try_forward" {
            *e = syn::parse_quote!(#call);
        }
    }
}
