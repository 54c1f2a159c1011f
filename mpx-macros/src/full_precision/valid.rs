//! Validation: everything that can be wrong with an annotated function, all recorded at once.

use syn::spanned::Spanned;

use super::ast::{ArgKind, Args, classify};
use crate::ctxt::{Ctxt, plain_fn_only};
use crate::syntax::{find_half, is_self};

/// Where the region's parameters come from.
pub(crate) enum Params {
    /// A function argument: `params = ln`. `by_ref` when its type is already a reference.
    Arg { ident: syn::Ident, by_ref: bool },
    /// A field of `self`: `params = self.ln`.
    Field(syn::ExprField),
}

/// A checked function, ready to expand.
pub(crate) struct Plan {
    /// Indices (in `sig.inputs`) of the tensor arguments, in order.
    pub tensor_args: Vec<usize>,
    /// The caller's precision type.
    pub half: syn::Type,
    /// The module used inside, if any.
    pub params: Option<Params>,
}

/// Rejects what the region cannot rewrite: the fn kind, arguments, return type, half type and
/// `params`; every problem is recorded in `cx`.
pub(crate) fn check(args: &Args, f: &syn::ItemFn, cx: &mut Ctxt) -> Option<Plan> {
    let sig = &f.sig;
    plain_fn_only(
        sig,
        "full_precision",
        "tensor code is not const",
        "make it a plain `fn` (a region runs to completion on the CPU)",
        cx,
    );

    let tensor_args = match &args.inputs {
        Some(names) => named_inputs(names, sig, cx),
        None => detected_inputs(sig, cx),
    };

    match &sig.output {
        syn::ReturnType::Type(_, ty)
            if !matches!(
                **ty,
                syn::Type::Tuple(_) | syn::Type::Reference(_) | syn::Type::ImplTrait(_)
            ) => {}
        syn::ReturnType::Type(_, ty) => cx.error_spanned(
            ty,
            "`#[full_precision]` functions return one tensor (`-> Tensor<S, H::Elem, D, T>`), which the region casts back to the half type",
        ),
        syn::ReturnType::Default => cx.error_spanned(
            &sig.ident,
            "`#[full_precision]` functions return one tensor: add `-> Tensor<S, H::Elem, D, T>`",
        ),
    }

    let half = match &args.half {
        Some(h) => Some(h.clone()),
        None => find_half(&sig.generics, &sig.ident, "full_precision", cx),
    };

    // `None` inside means `check_params` recorded why.
    let params = args.params.as_ref().map(|p| check_params(p, sig, cx));
    Some(Plan {
        tensor_args,
        half: half?,
        params: params.map_or(Some(None), |p| p.map(Some))?,
    })
}

/// The arguments whose types read as tensors (or tuples of tensors), by index.
fn detected_inputs(sig: &syn::Signature, cx: &mut Ctxt) -> Vec<usize> {
    let mut found = Vec::new();
    let mut borrowed = false;
    for (i, input) in sig.inputs.iter().enumerate() {
        if let syn::FnArg::Typed(pt) = input {
            match classify(&pt.ty) {
                ArgKind::Tensor => found.push(i),
                ArgKind::TensorRef => {
                    borrowed = true;
                    cx.error_spanned(&pt.ty, BORROWED);
                }
                ArgKind::Other => {}
            }
        }
    }
    if found.is_empty() && !borrowed {
        cx.error_spanned(
            &sig.ident,
            "`#[full_precision]` found no tensor to cast: give the function at least one argument of type `Tensor<S, H::Elem, D, T>` (or a tuple of tensors), or name the arguments with `inputs = (x, ..)` when their type is an alias",
        );
    }
    found
}

const BORROWED: &str = "`#[full_precision]` takes tensors by value: a borrowed tensor cannot be split off its tape and cast; pass it by value (`.clone()` it at the call site if you need it afterwards)";

/// The arguments listed in `inputs = (..)`, by index.
fn named_inputs(names: &[syn::Ident], sig: &syn::Signature, cx: &mut Ctxt) -> Vec<usize> {
    let mut found = Vec::new();
    for name in names {
        let hit = sig.inputs.iter().enumerate().find_map(|(i, a)| match a {
            syn::FnArg::Typed(pt) => match &*pt.pat {
                syn::Pat::Ident(pi) if pi.ident == *name => Some((i, pt)),
                _ => None,
            },
            syn::FnArg::Receiver(_) => None,
        });
        match hit {
            Some((_, pt)) if matches!(*pt.ty, syn::Type::Reference(_)) => {
                cx.error_spanned(&pt.ty, BORROWED);
            }
            Some((i, _)) if found.contains(&i) => {
                cx.error_spanned(name, format!("`{name}` is listed twice in `inputs`"));
            }
            Some((i, _)) => found.push(i),
            None => cx.error_spanned(
                name,
                format!("`inputs` names `{name}`, which is not an argument of this function"),
            ),
        }
    }
    found
}

/// `params = ln` (an argument that is not a tensor) or `params = self.ln`.
fn check_params(p: &syn::Expr, sig: &syn::Signature, cx: &mut Ctxt) -> Option<Params> {
    const WHAT: &str = "`params` names the module whose parameters the body uses: a function argument (`params = ln`) or a field of `self` (`params = self.ln`)";
    match p {
        syn::Expr::Path(ep) if ep.qself.is_none() && ep.path.get_ident().is_some() => {
            let ident = ep.path.get_ident()?.clone();
            let arg = sig.inputs.iter().find_map(|a| match a {
                syn::FnArg::Typed(pt) => match &*pt.pat {
                    syn::Pat::Ident(pi) if pi.ident == ident => Some(pt),
                    _ => None,
                },
                syn::FnArg::Receiver(_) => None,
            });
            match arg {
                Some(pt) if classify(&pt.ty) != ArgKind::Other => {
                    cx.error_spanned(
                        p,
                        format!("`params = {ident}` names a tensor argument; {WHAT}"),
                    );
                    None
                }
                Some(pt) => Some(Params::Arg {
                    ident,
                    by_ref: matches!(*pt.ty, syn::Type::Reference(_)),
                }),
                None => {
                    cx.error_spanned(p, format!("no argument named `{ident}`; {WHAT}"));
                    None
                }
            }
        }
        syn::Expr::Field(ef) if is_self(&ef.base) => {
            if sig.receiver().is_none() {
                cx.error_spanned(
                    p,
                    format!("`self` is not an argument of this function; {WHAT}"),
                );
                return None;
            }
            Some(Params::Field(ef.clone()))
        }
        other => {
            cx.push(syn::Error::new(other.span(), WHAT));
            None
        }
    }
}
