//! Parsing: the attribute's arguments.

use proc_macro2::TokenStream;

use crate::ctxt::{Ctxt, parse_keyed, set_crate, set_names, set_parsed};

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
        "skip" => set_names(meta, cx, &mut out.skip, "skip", SKIP_USAGE),
        "crate" => set_crate(meta, cx, &mut out.krate),
        _ => Ok(false),
    });
    out
}

/// What `skip` takes, as its error says.
const SKIP_USAGE: &str = "`skip` lists operation names: `skip = sum` or `skip = (sum, exp)`";
