//! Generates `impl Cast<__P>` and `impl FloatLeaves` from the plan.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit_mut::VisitMut;

use super::validate::{Plan, mentions};

/// Replaces the dtype parameter by `<__P as Precision>::Elem` inside types.
struct Subst<'a> {
    from: &'a syn::Ident,
    to: &'a syn::Type,
}

impl VisitMut for Subst<'_> {
    fn visit_type_mut(&mut self, ty: &mut syn::Type) {
        if let syn::Type::Path(tp) = ty {
            let first_is_dtype = tp.qself.is_none()
                && tp.path.leading_colon.is_none()
                && tp.path.segments.first().is_some_and(|s| {
                    s.ident == *self.from && matches!(s.arguments, syn::PathArguments::None)
                });
            if first_is_dtype {
                if tp.path.segments.len() == 1 {
                    *ty = self.to.clone();
                    return;
                }
                // `E::Assoc` becomes `<Elem>::Assoc`
                let rest: Vec<_> = tp.path.segments.iter().skip(1).cloned().collect();
                let to = self.to;
                let mut new: syn::TypePath = syn::parse_quote!(<#to>::__Placeholder);
                new.path.segments = rest.into_iter().collect();
                *ty = syn::Type::Path(new);
                return;
            }
        }
        syn::visit_mut::visit_type_mut(self, ty);
    }
}

fn subst_type(ty: &syn::Type, dtype: Option<&syn::Ident>, elem: &syn::Type) -> syn::Type {
    let mut out = ty.clone();
    if let Some(from) = dtype {
        Subst { from, to: elem }.visit_type_mut(&mut out);
    }
    out
}

/// Both impls for the plan.
pub(super) fn expand(plan: &Plan) -> TokenStream {
    let rt = &plan.rt;
    let name = &plan.ident;
    let dtype = plan.dtype.as_ref();
    let elem: syn::Type = syn::parse_quote!(<__P as #rt::precision::Precision>::Elem);

    // ---- Cast -------------------------------------------------------------------------------
    let mut cast_generics = plan.generics.clone();
    cast_generics
        .params
        .push(syn::parse_quote!(__P: #rt::precision::Precision));
    let (cast_impl_generics, _, _) = cast_generics.split_for_impl();
    let (impl_generics, ty_generics, _) = plan.generics.split_for_impl();

    let mut preds: Vec<TokenStream> = Vec::new();
    if let Some(wc) = &plan.generics.where_clause {
        preds.extend(wc.predicates.iter().map(|p| quote!(#p)));
    }
    // The output type must satisfy the struct's own bounds: repeat every bound that mentions the
    // dtype with the dtype replaced (e.g. `D: Storage<E>` -> `D: Storage<__P::Elem>`).
    if let Some(d) = dtype {
        for p in plan.generics.type_params() {
            let bounds: Vec<&syn::TypeParamBound> = p
                .bounds
                .iter()
                .filter(|b| !quote!(#b).to_string().starts_with('?'))
                .collect();
            if bounds.is_empty() {
                continue;
            }
            if p.ident == *d {
                preds.push(quote!(#elem: #(#bounds)+*));
            } else if bounds.iter().any(|b| mentions(quote!(#b), d)) {
                let mut wp: syn::WherePredicate = {
                    let id = &p.ident;
                    syn::parse_quote!(#id: #(#bounds)+*)
                };
                Subst { from: d, to: &elem }.visit_where_predicate_mut(&mut wp);
                preds.push(quote!(#wp));
            }
        }
        if let Some(wc) = &plan.generics.where_clause {
            for p in &wc.predicates {
                if mentions(quote!(#p), d) {
                    let mut wp = p.clone();
                    Subst { from: d, to: &elem }.visit_where_predicate_mut(&mut wp);
                    preds.push(quote!(#wp));
                }
            }
        }
    }
    for f in plan.fields.iter().filter(|f| !f.skip) {
        let ty = &f.ty;
        let out = subst_type(ty, dtype, &elem);
        preds.push(quote_spanned!(ty.span()=> #ty: #rt::cast::Cast<__P, Output = #out>));
    }

    let out_args = plan.generics.params.iter().map(|p| match p {
        syn::GenericParam::Lifetime(l) => {
            let l = &l.lifetime;
            quote!(#l)
        }
        syn::GenericParam::Type(t) if Some(&t.ident) == dtype => quote!(#elem),
        syn::GenericParam::Type(t) => {
            let id = &t.ident;
            quote!(#id)
        }
        syn::GenericParam::Const(c) => {
            let id = &c.ident;
            quote!(#id)
        }
    });
    let output = if plan.generics.params.is_empty() {
        quote!(#name)
    } else {
        quote!(#name<#(#out_args),*>)
    };

    let inits = plan.fields.iter().map(|f| {
        let m = &f.member;
        if f.skip {
            quote!(#m: ::core::clone::Clone::clone(&self.#m))
        } else {
            quote_spanned!(f.ty.span()=> #m: #rt::cast::Cast::<__P>::cast(&self.#m))
        }
    });

    // ---- FloatLeaves ------------------------------------------------------------------------
    let mut leaf_preds: Vec<TokenStream> = Vec::new();
    if let Some(wc) = &plan.generics.where_clause {
        leaf_preds.extend(wc.predicates.iter().map(|p| quote!(#p)));
    }
    let cast_fields: Vec<_> = plan.fields.iter().filter(|f| !f.skip).collect();
    for f in &cast_fields {
        let ty = &f.ty;
        leaf_preds.push(quote_spanned!(ty.span()=> #ty: #rt::cast::FloatLeaves));
    }
    let members: Vec<_> = cast_fields.iter().map(|f| &f.member).collect();

    quote! {
        #[automatically_derived]
        impl #cast_impl_generics #rt::cast::Cast<__P> for #name #ty_generics
        where
            #(#preds,)*
        {
            type Output = #output;
            fn cast(&self) -> Self::Output {
                #name { #(#inits,)* }
            }
        }

        #[automatically_derived]
        impl #impl_generics #rt::cast::FloatLeaves for #name #ty_generics
        where
            #(#leaf_preds,)*
        {
            fn visit_floats(
                &self,
                visit: &mut dyn ::core::ops::FnMut(#rt::precision::FloatSlice<'_>) -> bool,
            ) -> bool {
                true #(&& #rt::cast::FloatLeaves::visit_floats(&self.#members, visit))*
            }
            fn visit_floats_mut(
                &mut self,
                visit: &mut dyn ::core::ops::FnMut(#rt::cast::FloatSliceMut<'_>),
            ) {
                #(#rt::cast::FloatLeaves::visit_floats_mut(&mut self.#members, visit);)*
            }
        }
    }
}
