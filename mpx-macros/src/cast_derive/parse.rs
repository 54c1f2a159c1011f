//! Reads the derive input: the container attribute `#[cast(dtype = E, crate = "path")]`, the
//! field attribute `#[cast(skip)]`, and the fields.

use proc_macro2::Span;
use syn::spanned::Spanned;

use crate::ctxt::{Ctxt, crate_path, key_of, set_once, skip_value};

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
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("cast")) {
        let res = attr.parse_nested_meta(|meta| {
            let key = key_of(&meta.path);
            match key.as_str() {
                "dtype" => {
                    let v: syn::Ident = meta.value()?.parse().map_err(|e| {
                        syn::Error::new(e.span(), "`dtype` takes a type parameter name: `#[cast(dtype = E)]`")
                    })?;
                    set_once(cx, &meta.path, &mut dtype, v, "dtype");
                }
                "crate" => {
                    let v = crate_path(&meta)?;
                    set_once(cx, &meta.path, &mut krate, v, "crate");
                }
                "skip" => {
                    cx.error_spanned(
                        &meta.path,
                        "`skip` belongs on a field, not on the struct; expected one of `dtype`, `crate` here",
                    );
                }
                _ => {
                    cx.error_spanned(
                        &meta.path,
                        format!("unknown argument `{key}`; expected one of {CONTAINER_KEYS}"),
                    );
                    skip_value(meta.input)?;
                }
            }
            Ok(())
        });
        if let Err(err) = res {
            cx.push(err);
        }
    }

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
            for attr in f.attrs.iter().filter(|a| a.path().is_ident("cast")) {
                let res = attr.parse_nested_meta(|meta| {
                    let key = key_of(&meta.path);
                    if key == "skip" {
                        set_once(cx, &meta.path, &mut skip, meta.path.clone(), "skip");
                    } else {
                        cx.error_spanned(
                            &meta.path,
                            format!("unknown field argument `{key}`; expected {FIELD_KEYS}"),
                        );
                        skip_value(meta.input)?;
                    }
                    Ok(())
                });
                if let Err(err) = res {
                    cx.push(err);
                }
            }
            Field {
                member,
                ty: &f.ty,
                skip,
            }
        })
        .collect()
}
