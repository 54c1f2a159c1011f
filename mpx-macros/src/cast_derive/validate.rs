//! Checks the parsed input and decides the plan: which type parameter is the dtype, which fields
//! are cast, and where the runtime lives.

use proc_macro2::{TokenStream, TokenTree};

use super::parse::{Input, Kind};
use crate::ctxt::Ctxt;

/// One field of the plan.
pub(super) struct PlanField {
    pub member: syn::Member,
    pub ty: syn::Type,
    /// Cloned as is instead of cast.
    pub skip: bool,
}

/// What the expansion generates.
pub(super) struct Plan {
    pub ident: syn::Ident,
    pub generics: syn::Generics,
    /// The type parameter replaced by `<P as Precision>::Elem` in the output type; `None` when
    /// the struct casts to itself.
    pub dtype: Option<syn::Ident>,
    pub fields: Vec<PlanField>,
    /// Path of the runtime crate in generated code.
    pub rt: TokenStream,
}

/// Validates `input`; returns `None` when the item cannot be derived for at all.
pub(super) fn validate(input: &Input<'_>, cx: &mut Ctxt) -> Option<Plan> {
    match input.kind {
        Kind::Struct => {}
        Kind::Enum(span) => {
            cx.push(syn::Error::new(
                span,
                "#[derive(Cast)] supports structs only; for an enum, implement `mpx::cast::Cast` by hand or hold its variants in an `Option`/struct",
            ));
            return None;
        }
        Kind::Union(span) => {
            cx.push(syn::Error::new(
                span,
                "#[derive(Cast)] cannot be derived for a union: which field holds a float leaf is unknown; use a struct",
            ));
            return None;
        }
    }

    let type_params: Vec<&syn::Ident> = input.generics.type_params().map(|p| &p.ident).collect();
    let listed = || {
        type_params
            .iter()
            .map(|p| format!("`{p}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let dtype = match &input.dtype {
        Some(name) => {
            if type_params.contains(&name) {
                Some(name.clone())
            } else {
                let choices = if type_params.is_empty() {
                    format!("`{}` has no type parameters", input.ident)
                } else {
                    format!("expected one of {}", listed())
                };
                cx.error_spanned(
                    name,
                    format!(
                        "`{name}` is not a type parameter of `{}`; {choices}",
                        input.ident
                    ),
                );
                None
            }
        }
        None => match type_params.as_slice() {
            [] => None,
            [one] => Some((*one).clone()),
            _ => {
                cx.error_spanned(
                    input.ident,
                    format!(
                        "`{}` has several type parameters ({}); name the dtype one with `#[cast(dtype = ...)]`",
                        input.ident,
                        listed()
                    ),
                );
                None
            }
        },
    };

    let mut fields = Vec::with_capacity(input.fields.len());
    for f in &input.fields {
        if let (Some(_), Some(d)) = (&f.skip, &dtype)
            && mentions(quote::ToTokens::to_token_stream(f.ty), d)
        {
            let name = match &f.member {
                syn::Member::Named(id) => format!("`{id}`"),
                syn::Member::Unnamed(i) => format!("#{}", i.index),
            };
            cx.error_spanned(
                f.ty,
                format!(
                    "field {name} is marked `#[cast(skip)]` but its type mentions the dtype parameter `{d}`; a skipped field is cloned as is and cannot change type: remove `#[cast(skip)]` or use a type without `{d}`"
                ),
            );
        }
        fields.push(PlanField {
            member: f.member.clone(),
            ty: f.ty.clone(),
            skip: f.skip.is_some(),
        });
    }

    let rt = crate::ctxt::runtime_path(input.krate.as_ref());
    Some(Plan {
        ident: input.ident.clone(),
        generics: input.generics.clone(),
        dtype,
        fields,
        rt,
    })
}

/// `true` when the identifier `name` appears anywhere in `tokens` (also inside macros).
pub(super) fn mentions(tokens: TokenStream, name: &syn::Ident) -> bool {
    tokens.into_iter().any(|t| match t {
        TokenTree::Ident(id) => id == *name,
        TokenTree::Group(g) => mentions(g.stream(), name),
        _ => false,
    })
}
