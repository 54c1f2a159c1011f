//! `#[autocast]`: parse ([`ast`]) -> validate ([`valid`]) -> expand ([`expand`]).
//!
//! ```text
//! #[autocast]
//! fn attend<H: Precision, T: Tape<H::Elem, Cpu>>(s: Tensor<S, H::Elem, Cpu, T>, v: ..) -> .. {
//!     s.softmax::<Axis<1>>().matmul(v)
//! }
//! // becomes
//! fn attend<H: Precision, T: Tape<H::Elem, Cpu>>(s: Tensor<S, H::Elem, Cpu, T>, v: ..) -> .. {
//!     ::mpx::__private::mpx_runtime::region::FullPrecision::<H>::run(s, |__mpx_x0| {
//!         __mpx_x0.softmax::<Axis<1>>()
//!     })
//!     .matmul(v)
//! }
//! ```
//!
//! Which calls are wrapped: those named in the table of [`crate::ops`], with dfdx's number of
//! arguments, except a method whose receiver cannot be a tensor (a literal, a range, an array, a
//! tuple, a reference, a cast, a macro, `self`, or an iterator such as `v.iter().sum()`) and a
//! `sum::<T>()` with one type argument (`Iterator::sum`; dfdx's takes two). Calls inside macro
//! invocations and nested items are not seen.

pub(crate) mod ast;
pub(crate) mod expand;
mod valid;

use proc_macro2::TokenStream;
use syn::visit_mut::VisitMut;

use crate::ctxt::{expand_fn, runtime_path};

/// Entry point: the rewritten function, or the errors followed by the user's item unchanged.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    expand_fn(
        (
            "autocast",
            "a function or a method with a body (a forward function, or `try_forward` inside `impl Module<..> for ..`)",
        ),
        (args, item),
        ast::parse_args,
        |args, f, cx| f.map(|f| rewrite(args, f, cx)),
        |_, f| quote::quote!(#f),
    )
}

/// Rewrites the body of `f` (recording the errors in `cx`); still read for its own errors when
/// the arguments name no half type.
fn rewrite(parsed_args: &ast::Args, mut f: syn::ItemFn, cx: &mut crate::ctxt::Ctxt) -> syn::ItemFn {
    let plan = valid::check(parsed_args, &f, cx);
    let root = runtime_path(parsed_args.krate.as_ref());
    // Without a half type (already reported) the body is still read for its own errors.
    let half = plan.half.unwrap_or_else(|| syn::parse_quote!(H));
    expand::FreeToMethod.visit_block_mut(&mut f.block);
    let mut rw = expand::Rewriter::new(&root, &half, &plan.skip);
    rw.visit_block_mut(&mut f.block);
    for err in rw.errors {
        cx.push(err);
    }
    if rw.wrapped == 0 {
        cx.error_spanned(&f.sig.ident, nothing_to_wrap());
    }
    f
}

/// The error for a function with no tensor operation of the table.
fn nothing_to_wrap() -> String {
    format!(
        "`#[autocast]` found no tensor operation to run in f32 in this function: it wraps calls of {} on dfdx tensors; remove the attribute from a function without them",
        valid::op_list()
    )
}

#[cfg(test)]
mod tests;
