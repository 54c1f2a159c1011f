//! Reads the derive input: the container attribute `#[cast(dtype = E, crate = "path")]`, the
//! field attribute `#[cast(skip)]`, and the fields.

use proc_macro2::Span;
use syn::spanned::Spanned;

use crate::ctxt::{Ctxt, parse_attrs, set_crate, set_once};

/// Keys a container `#[cast(...)]` accepts.
pub(super) const CONTAINER_KEYS: &str = "`dtype`, `crate`";
/// Keys a field `#[cast(...)]` accepts.
pub(super) const FIELD_KEYS: &str = "`skip`";

/// What kind of item the derive was put on.
pub(super) enum Kind {
    /// A struct with named, unnamed or no fields.
    Struct,
    /// An enum (rejected by validation), with the span of `enum`.
    Enum(Span),
    /// A union (rejected by validation), with the span of `union`.
    Union(Span),
}

/// One field of the struct.
pub(super) struct Field<'a> {
    /// `name` or `0`.
    pub member: syn::Member,
    /// The field's type.
    pub ty: &'a syn::Type,
    /// The `skip` key when the field is marked `#[cast(skip)]`.
    pub skip: Option<syn::Path>,
}

/// The derive input after parsing.
pub(super) struct Input<'a> {
    pub ident: &'a syn::Ident,
    pub generics: &'a syn::Generics,
    pub kind: Kind,
    pub fields: Vec<Field<'a>>,
    /// `#[cast(dtype = E)]`.
    pub dtype: Option<syn::Ident>,
    /// `#[cast(crate = "path")]`.
    pub krate: Option<syn::Path>,
}

/// Parses the item; every mistake goes into `cx`, and parsing goes on.
pub(super) fn parse<'a>(input: &'a syn::DeriveInput, cx: &mut Ctxt) -> Input<'a> {
    let mut dtype = None;
    let mut krate = None;
    let expected = format!("one of {CONTAINER_KEYS}");
    parse_attrs(
        &input.attrs,
        "cast",
        cx,
        ("argument", &expected),
        |key, meta, cx| match key {
            "dtype" => {
                let v: syn::Ident = meta.value()?.parse().map_err(|e| {
                    syn::Error::new(
                        e.span(),
                        "`dtype` takes a type parameter name: `#[cast(dtype = E)]`",
                    )
                })?;
                set_once(cx, &meta.path, &mut dtype, v, "dtype");
                Ok(true)
            }
            "crate" => set_crate(meta, cx, &mut krate),
            "skip" => {
                cx.error_spanned(
                    &meta.path,
                    "`skip` belongs on a field, not on the struct; expected one of `dtype`, `crate` here",
                );
                Ok(true)
            }
            _ => Ok(false),
        },
    );

    let (kind, fields) = match &input.data {
        syn::Data::Struct(data) => (Kind::Struct, parse_fields(&data.fields, cx)),
        syn::Data::Enum(data) => (Kind::Enum(data.enum_token.span()), Vec::new()),
        syn::Data::Union(data) => (Kind::Union(data.union_token.span()), Vec::new()),
    };
    Input {
        ident: &input.ident,
        generics: &input.generics,
        kind,
        fields,
        dtype,
        krate,
    }
}

fn parse_fields<'a>(fields: &'a syn::Fields, cx: &mut Ctxt) -> Vec<Field<'a>> {
    fields
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let member = match &f.ident {
                Some(id) => syn::Member::Named(id.clone()),
                None => syn::Member::Unnamed(syn::Index {
                    span: f.ty.span(),
                    ..syn::Index::from(i)
                }),
            };
            let mut skip = None;
            parse_attrs(
                &f.attrs,
                "cast",
                cx,
                ("field argument", FIELD_KEYS),
                |key, meta, cx| {
                    let known = key == "skip";
                    if known {
                        set_once(cx, &meta.path, &mut skip, meta.path.clone(), "skip");
                    }
                    Ok(known)
                },
            );
            Field {
                member,
                ty: &f.ty,
                skip,
            }
        })
        .collect()
}
