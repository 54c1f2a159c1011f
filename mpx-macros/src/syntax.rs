//! Reading the user's function, shared by `#[full_precision]` and `#[autocast]`: which type
//! parameter is the caller's half type, and whether an expression is `self`.

use crate::ctxt::Ctxt;

/// The precision traits a generic parameter may be bounded by to be taken as the half type.
const PRECISION_TRAITS: [&str; 2] = ["Precision", "HalfPrecision"];

/// Each type parameter's bounds, with the parameter: its own list, then each where-clause
/// predicate on the parameter alone, in order.
pub(crate) fn param_bounds(
    generics: &syn::Generics,
) -> impl Iterator<
    Item = (
        &syn::Ident,
        &syn::punctuated::Punctuated<syn::TypeParamBound, syn::Token![+]>,
    ),
> {
    let own = generics.type_params().map(|p| (&p.ident, &p.bounds));
    let wheres = generics
        .where_clause
        .iter()
        .flat_map(|w| &w.predicates)
        .filter_map(|pred| match pred {
            syn::WherePredicate::Type(pt) => match &pt.bounded_ty {
                syn::Type::Path(tp) if tp.qself.is_none() => {
                    tp.path.get_ident().map(|id| (id, &pt.bounds))
                }
                _ => None,
            },
            _ => None,
        });
    own.chain(wheres)
}

/// The type parameters bounded by a trait whose last path segment is one of `traits`, in their
/// own list or in the where clause, each once, in order.
pub(crate) fn params_bounded_by(generics: &syn::Generics, traits: &[&str]) -> Vec<syn::Ident> {
    let mut found: Vec<syn::Ident> = Vec::new();
    for (id, bounds) in param_bounds(generics) {
        let bounded = bounds.iter().any(|b| {
            matches!(b, syn::TypeParamBound::Trait(t)
                if t.path.segments.last().is_some_and(|s| traits.iter().any(|n| s.ident == n)))
        });
        if bounded && !found.contains(id) {
            found.push(id.clone());
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
