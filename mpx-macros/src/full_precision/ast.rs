//! Parsing: the attribute's arguments and the annotated item.

use proc_macro2::TokenStream;

use crate::ctxt::{Ctxt, parse_keyed, set_crate, set_names, set_parsed};

/// The valid arguments, as error messages list them.
pub(crate) const VALID_ARGS: &str = "`half`, `params`, `inputs`, `crate`";

/// `#[full_precision(half = H, params = ln, crate = "path")]`, every argument optional.
#[derive(Default)]
pub(crate) struct Args {
    /// The caller's precision type (`H`, `f16`, ...); found from the generics when absent.
    pub half: Option<syn::Type>,
    /// The module whose parameters the body uses: an argument (`ln`) or a field (`self.ln`).
    pub params: Option<syn::Expr>,
    /// The arguments to cast, when the types do not say it (a type alias of a tensor):
    /// `inputs = x` or `inputs = (x, y)`.
    pub inputs: Option<Vec<syn::Ident>>,
    /// Path of the `mpx` facade, when it is not `::mpx`.
    pub krate: Option<syn::Path>,
}

/// Parses `key = value` arguments with `syn::meta::parser`, recording unknown and duplicate keys
/// in `cx` and carrying on, so every mistake is reported at once.
pub(crate) fn parse_args(args: TokenStream, cx: &mut Ctxt) -> Args {
    let mut out = Args::default();
    parse_keyed(args, cx, VALID_ARGS, |key, meta, cx| match key {
        "half" => set_parsed(meta, cx, &mut out.half, "half"),
        "params" => set_parsed(meta, cx, &mut out.params, "params"),
        "inputs" => set_names(meta, cx, &mut out.inputs, "inputs", INPUTS_USAGE),
        "crate" => set_crate(meta, cx, &mut out.krate),
        _ => Ok(false),
    });
    out
}

/// What `inputs` takes, as its error says.
const INPUTS_USAGE: &str = "`inputs` lists argument names: `inputs = x` or `inputs = (x, y)`";

/// How an argument's type reads to the macro: the region casts only tensors passed by value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ArgKind {
    /// `Tensor<..>` or a tuple of them.
    Tensor,
    /// `&Tensor<..>` or `&mut Tensor<..>`: cannot be split off its tape.
    TensorRef,
    /// Anything else: captured by the body as it is.
    Other,
}

/// Classifies a type syntactically (a type alias of a tensor reads as `Other`).
pub(crate) fn classify(ty: &syn::Type) -> ArgKind {
    match ty {
        syn::Type::Path(p) if p.qself.is_none() => match p.path.segments.last() {
            Some(seg) if seg.ident == "Tensor" => ArgKind::Tensor,
            _ => ArgKind::Other,
        },
        syn::Type::Tuple(t)
            if !t.elems.is_empty() && t.elems.iter().all(|e| classify(e) == ArgKind::Tensor) =>
        {
            ArgKind::Tensor
        }
        syn::Type::Paren(p) => classify(&p.elem),
        syn::Type::Group(g) => classify(&g.elem),
        syn::Type::Reference(r) if classify(&r.elem) == ArgKind::Tensor => ArgKind::TensorRef,
        _ => ArgKind::Other,
    }
}
