//! Reading the user's function, shared by `#[full_precision]` and `#[autocast]`: which type
//! parameter is the caller's half type, and whether an expression is `self`.

use crate::ctxt::Ctxt;

/// The precision traits a generic parameter may be bounded by to be taken as the half type.
const PRECISION_TRAITS: [&str; 2] = ["Precision", "HalfPrecision"];

/// The type parameters bounded by a trait whose last path segment is one of `traits`, in their
/// own list or in the where clause, each once, in order.
pub(crate) fn params_bounded_by(generics: &syn::Generics, traits: &[&str]) -> Vec<syn::Ident> {
    let bounded = |bounds: &syn::punctuated::Punctuated<syn::TypeParamBound, syn::Token![+]>| {
        bounds.iter().any(|b| {
            matches!(b, syn::TypeParamBound::Trait(t)
                if t.path.segments.last().is_some_and(|s| traits.iter().any(|n| s.ident == n)))
        })
    };
    let mut found: Vec<syn::Ident> = generics
        .type_params()
        .filter(|p| bounded(&p.bounds))
        .map(|p| p.ident.clone())
        .collect();
    if let Some(wc) = &generics.where_clause {
        for pred in &wc.predicates {
            if let syn::WherePredicate::Type(pt) = pred
                && let syn::Type::Path(tp) = &pt.bounded_ty
                && let Some(id) = tp.path.get_ident()
                && bounded(&pt.bounds)
                && !found.contains(id)
            {
                found.push(id.clone());
            }
        }
    }
    found
}

/// The type parameter bounded by `Precision` or `HalfPrecision`, when there is exactly one;
/// otherwise an error on `ident` naming the attribute `#[<attr>]`.
pub(crate) fn find_half(
    generics: &syn::Generics,
    ident: &syn::Ident,
    attr: &str,
    cx: &mut Ctxt,
) -> Option<syn::Type> {
    let mut found = params_bounded_by(generics, &PRECISION_TRAITS);
    match found.len() {
        1 => {
            let id = found.remove(0);
            Some(syn::parse_quote!(#id))
        }
        0 => {
            cx.error_spanned(
                ident,
                format!("`#[{attr}]` cannot tell the half type: add a type parameter `H: mpx::precision::Precision` (tensors of element `H::Elem`), or name it with `#[{attr}(half = H)]` (e.g. for a method whose `H` belongs to the `impl`)"),
            );
            None
        }
        _ => {
            let names: Vec<String> = found.iter().map(|i| format!("`{i}`")).collect();
            cx.error_spanned(
                ident,
                format!(
                    "`#[{attr}]` found several precision parameters ({}); name the caller's with `half = ..`",
                    names.join(", ")
                ),
            );
            None
        }
    }
}

/// `true` for the expression `self`.
pub(crate) fn is_self(e: &syn::Expr) -> bool {
    matches!(e, syn::Expr::Path(p) if p.qself.is_none() && p.path.is_ident("self"))
}

/// `tokens` with every span set to `span` (groups included): generated code that the compiler's
/// errors point at the user's tokens through.
pub(crate) fn respan(
    tokens: proc_macro2::TokenStream,
    span: proc_macro2::Span,
) -> proc_macro2::TokenStream {
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
