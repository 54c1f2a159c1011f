//! Parsing: the attribute's arguments.

use proc_macro2::TokenStream;

use crate::ctxt::{Ctxt, crate_path, parse_keyed, set_once};

/// The valid arguments, as error messages list them.
pub(crate) const VALID_ARGS: &str = "`half`, `skip`, `crate`";

/// `#[autocast(half = H, skip = (sum, exp), crate = "path")]`, every argument optional.
#[derive(Default)]
pub(crate) struct Args {
    /// The caller's precision type (`H`, `f16`, ...); found from the generics when absent.
    pub half: Option<syn::Type>,
    /// Operations of the table this function keeps in the half type (`skip = sum`).
    pub skip: Option<Vec<syn::Ident>>,
    /// Path of the `mpx` facade, when it is not `::mpx`.
    pub krate: Option<syn::Path>,
}

/// Parses `key = value` arguments, recording unknown and duplicate keys in `cx` and carrying on,
/// so every mistake is reported at once.
pub(crate) fn parse_args(args: TokenStream, cx: &mut Ctxt) -> Args {
    let mut out = Args::default();
    parse_keyed(args, cx, VALID_ARGS, |key, meta, cx| {
        Ok(match key {
            "half" => {
                let v: syn::Type = meta.value()?.parse()?;
                set_once(cx, &meta.path, &mut out.half, v, "half");
                true
            }
            "skip" => {
                let v: syn::Expr = meta.value()?.parse()?;
                let names = op_names(&v)?;
                set_once(cx, &meta.path, &mut out.skip, names, "skip");
                true
            }
            "crate" => {
                let v = crate_path(meta)?;
                set_once(cx, &meta.path, &mut out.krate, v, "crate");
                true
            }
            _ => false,
        })
    });
    out
}

/// `sum` or `(sum, exp, ..)`: operation names.
fn op_names(e: &syn::Expr) -> syn::Result<Vec<syn::Ident>> {
    let one = |e: &syn::Expr| match e {
        syn::Expr::Path(p) if p.qself.is_none() && p.path.get_ident().is_some() => p
            .path
            .get_ident()
            .cloned()
            .ok_or_else(|| syn::Error::new_spanned(e, "`skip` lists operation names")),
        other => Err(syn::Error::new_spanned(
            other,
            "`skip` lists operation names: `skip = sum` or `skip = (sum, exp)`",
        )),
    };
    match e {
        syn::Expr::Tuple(t) => t.elems.iter().map(one).collect(),
        syn::Expr::Paren(p) => Ok(vec![one(&p.expr)?]),
        other => Ok(vec![one(other)?]),
    }
}
