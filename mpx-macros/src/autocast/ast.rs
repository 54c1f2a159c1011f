//! Parsing: the attribute's arguments.

use proc_macro2::TokenStream;

use crate::ctxt::{Ctxt, crate_path, name_list, parse_keyed, set_once, set_parsed};

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
    parse_keyed(args, cx, VALID_ARGS, |key, meta, cx| match key {
        "half" => set_parsed(meta, cx, &mut out.half, "half"),
        "skip" => {
            let v: syn::Expr = meta.value()?.parse()?;
            let names = name_list(
                &v,
                "`skip` lists operation names: `skip = sum` or `skip = (sum, exp)`",
            )?;
            set_once(cx, &meta.path, &mut out.skip, names, "skip");
            Ok(true)
        }
        "crate" => {
            let v = crate_path(meta)?;
            set_once(cx, &meta.path, &mut out.krate, v, "crate");
            Ok(true)
        }
        _ => Ok(false),
    });
    out
}
