//! Parsing: the attribute's arguments. (The body's shape is read in [`super::valid`].)

use proc_macro2::TokenStream;

use crate::ctxt::{Ctxt, parse_keyed, set_crate, set_once, set_parsed};

/// The valid arguments, as error messages list them.
pub(crate) const VALID_ARGS: &str = "`scaling`, `half`, `crate`";

/// The half types `half = ..` accepts.
pub(crate) const VALID_HALF: &str = "`f16`, `AMP<f16>`, `bf16`, `f32`";

/// The precision the working copy runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Half {
    /// IEEE binary16.
    F16,
    /// dfdx's `AMP<f16>`.
    AmpF16,
    /// Emulated bfloat16.
    Bf16,
    /// f32: the working copy shares the master's buffers (a check of the machinery: with scale 1
    /// it reproduces the f32 step bit for bit).
    F32,
}

/// `#[mixed_step(scaling = .., half = .., crate = "..")]`.
#[derive(Default)]
pub(crate) struct Args {
    /// The `GradScaler` place: required.
    pub scaling: Option<syn::Expr>,
    /// When absent, the scaler's type decides.
    pub half: Option<Half>,
    /// Path of the `mpx` facade, when it is not `::mpx`.
    pub krate: Option<syn::Path>,
}

/// Parses the arguments, recording every unknown, duplicate or invalid one in `cx`.
pub(crate) fn parse_args(args: TokenStream, cx: &mut Ctxt) -> Args {
    let mut out = Args::default();
    parse_keyed(args, cx, VALID_ARGS, |key, meta, cx| {
        Ok(match key {
            "scaling" => set_parsed(meta, cx, &mut out.scaling, "scaling")?,
            "half" => {
                let ty: syn::Type = meta.value()?.parse()?;
                let half = half_of(&ty);
                if let Some(h) = half {
                    set_once(cx, &meta.path, &mut out.half, h, "half");
                } else {
                    let shown = quote::quote!(#ty).to_string().replace(' ', "");
                    cx.error_spanned(
                        &ty,
                        format!("`half = {shown}` is not a precision a mixed step runs in; expected one of {VALID_HALF}"),
                    );
                }
                true
            }
            "crate" => set_crate(meta, cx, &mut out.krate)?,
            _ => false,
        })
    });
    out
}

/// The precision a type names, as the sibling macros take it: `f16`, `AMP<f16>`, `bf16`,
/// `f32`, bare or by path (`mpx::precision::AMP<mpx::precision::f16>`).
fn half_of(ty: &syn::Type) -> Option<Half> {
    let syn::Type::Path(p) = ty else { return None };
    if p.qself.is_some() {
        return None;
    }
    let last = p.path.segments.last()?;
    match (last.ident.to_string().as_str(), &last.arguments) {
        ("f16", syn::PathArguments::None) => Some(Half::F16),
        ("bf16", syn::PathArguments::None) => Some(Half::Bf16),
        ("f32", syn::PathArguments::None) => Some(Half::F32),
        ("AMP", syn::PathArguments::AngleBracketed(a)) if a.args.len() == 1 => match &a.args[0] {
            syn::GenericArgument::Type(inner) => {
                (half_of(inner) == Some(Half::F16)).then_some(Half::AmpF16)
            }
            _ => None,
        },
        _ => None,
    }
}
